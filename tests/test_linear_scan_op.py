"""gdn_fx::gated_linear_scan: opcheck, its float64 references against each other and against
the eager kernel (both modes), resets, an oracle written here, transformers' Mamba2 functions.

Independent oracles (written in this file or taken from transformers, not from gdn_fx):
- ``loop_oracle``: per batch, value head and step, ``S = e^g S + k v^T; o = scale q^T S``;
- transformers' ``mamba2_chunk_scan`` (its SSD torch path: segment_sum masks, cumulative
  decays, state pass) and ``mamba2_selective_state_update`` (its decode step), mapped with
  q = C, k = B, v = dt * x, g = dt * A and the value-first state [B, H, P, N] transposed.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import Tensor

import gdn_fx.ops  # noqa: F401  (registers torch.ops.gdn_fx.*)
from gdn_fx.errors import DTypeError, GdnFxError, ShapeError
from gdn_fx.ops import fast_scan_kernel
from gdn_fx.reference import chunk_linear_reference, recurrent_linear_reference

LINEAR = torch.ops.gdn_fx.gated_linear_scan.default
DELTA = torch.ops.gdn_fx.gated_delta_scan.default
F64 = torch.float64
TIGHT = dict(rtol=1e-10, atol=1e-10)
INF = float("-inf")
GATES = (0.0, -1e-6, -5.0, -100.0, -1e4, INF, "mixed")
LENGTHS = (1, 2, 3, 16, 100)  # 100: two blocks of the fast kernel (ops.CHUNK = 64)


def linear_inputs(b: int = 2, t: int = 5, hk: int = 2, groups: int = 1, dk: int = 4,
                  dv: int = 3, per_key: bool = False, gate=None, dtype=torch.float32,
                  state_dtype=None, seed: int = 0) -> list:
    """[q, k, v, g, initial_state]. ``gate``: None draws log gates in (-1, 0]; a number fills
    g with it; "mixed" draws and puts -inf, -1e4, -100 and 0 at some steps."""
    gen = torch.Generator().manual_seed(seed)
    hv = hk * groups

    def rnd(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=gen, dtype=F64)

    gate_shape = (b, t, hv, dk) if per_key else (b, t, hv)
    g = -torch.rand(*gate_shape, generator=gen, dtype=F64)
    if gate == "mixed":
        for step, value in zip((1, 4, 9, 70), (INF, -1e4, -100.0, 0.0)):
            g[:, step:step + 1] = value  # a no-op beyond T
        g[0, t // 2:t // 2 + 1, 0] = INF  # one head alone
    elif gate is not None:
        g = torch.full(gate_shape, gate, dtype=F64)
    xs = [rnd(b, t, hk, dk), rnd(b, t, hk, dk), rnd(b, t, hv, dv), g]
    return [x.to(dtype) for x in xs] + [rnd(b, hv, dk, dv).to(state_dtype or dtype)]


def loop_oracle(q, k, v, g, s0, scale: float) -> tuple[Tensor, Tensor]:
    """The recurrence written out per batch entry, value head and step (float64)."""
    bsz, t, hk, _ = q.shape
    hv = v.shape[2]
    out = torch.zeros(v.shape, dtype=F64)
    final = torch.zeros(s0.shape, dtype=F64)
    for b, h in itertools.product(range(bsz), range(hv)):
        kh = h // (hv // hk)  # value head h reads key head h // G
        s = s0[b, h].double()
        for i in range(t):
            decay = g[b, i, h].double().exp()  # a scalar, or one per key channel
            s = (decay.unsqueeze(-1) if decay.dim() else decay) * s
            s = s + torch.outer(k[b, i, kh].double(), v[b, i, h].double())
            out[b, i, h] = scale * (q[b, i, kh].double() @ s)
        final[b, h] = s
    return out, final


def run_op(args: list, scale: float, kernel: str) -> tuple[Tensor, Tensor]:
    """The op with one eager kernel: "math" (the default), "chunks" or "steps" (fast)."""
    if kernel == "math":
        return LINEAR(*args, scale=scale)
    with fast_scan_kernel(chunks=kernel == "chunks"):
        return LINEAR(*args, scale=scale)


def relative(got: Tensor, want: Tensor) -> float:
    return ((got.double() - want).abs().max() / want.abs().max().clamp(min=1e-30)).item()


# ---- contract: opcheck, dtypes, shapes ------------------------------------------------------

CASES = {
    "f32": {}, "f16": dict(dtype=torch.float16), "bf16": dict(dtype=torch.bfloat16),
    "f64": dict(dtype=F64), "bf16_f32_state": dict(dtype=torch.bfloat16, state_dtype=torch.float32),
    "gqa4": dict(groups=4), "per_key": dict(per_key=True, groups=2),
    "mamba1": dict(hk=1, groups=4, dv=1, per_key=True), "t1": dict(t=1), "empty": dict(t=0),
    "resets_f16": dict(gate="mixed", t=12, dtype=torch.float16),
}
# opcheck costs ~0.3 s a case: the cases above that add a dtype or a shape class of their own
OPCHECK = ("f32", "f16", "f64", "bf16_f32_state", "mamba1", "empty", "resets_f16")


@pytest.mark.parametrize("case", OPCHECK)
def test_opcheck(case):
    torch.library.opcheck(LINEAR, linear_inputs(**CASES[case]), dict(scale=0.5))


def test_opcheck_fast_kernel():
    with fast_scan_kernel(chunks=True):
        torch.library.opcheck(LINEAR, linear_inputs(t=7, groups=2, gate="mixed"), dict(scale=0.5))


@pytest.mark.parametrize("kernel", ["math", "chunks", "steps"])
@pytest.mark.parametrize("case", CASES)
def test_dtypes_and_shapes(case, kernel):
    args = linear_inputs(**CASES[case])
    out, state = run_op(args, 0.5, kernel)
    q, v, s0 = args[0], args[2], args[4]
    assert out.shape == v.shape and out.dtype == torch.promote_types(q.dtype, s0.dtype)
    assert state.shape == s0.shape and state.dtype == s0.dtype
    assert not out.isnan().any() and not state.isnan().any()
    if v.shape[1] == 0:
        assert torch.equal(state, s0) and state.data_ptr() != s0.data_ptr()


def test_gradients_flow():
    args = [x.requires_grad_(True) for x in linear_inputs(b=1, t=3, hk=1, groups=2, dk=2,
                                                          dv=2, per_key=True, dtype=F64)]
    torch.autograd.gradcheck(lambda *a: LINEAR(*a, scale=0.7), args)


# ---- float64: recurrent == chunked == the eager kernels == the loop oracle --------------------

@pytest.mark.parametrize("gate", GATES, ids=str)
@pytest.mark.parametrize("per_key", [False, True], ids=["scalar", "per_key"])
def test_float64_agreement(gate, per_key):
    """Every length, G = 1, 2, 4 (Dv = 1 with G = 4, a Mamba1 shape: one key head): the
    chunked reference (chunks of 16 and 7, the last one partial) and the three eager kernels
    equal the recurrent reference."""
    shapes = list(zip(LENGTHS, (1, 2, 4, 1, 2))) + [(100, 4)]
    for seed, (t, groups) in enumerate(shapes):
        dv = 1 if groups == 4 else 3
        args = linear_inputs(t=t, hk=2 if groups < 4 else 1, groups=groups, dv=dv,
                             per_key=per_key, gate=gate, dtype=F64, seed=seed)
        want = recurrent_linear_reference(*args[:4], scale=0.6, initial_state=args[4])
        assert not want[0].isnan().any() and not want[1].isnan().any()
        got = {f"chunk{c}": chunk_linear_reference(*args[:4], scale=0.6,
                                                   initial_state=args[4], chunk_size=c)
               for c in (16, 7)}
        got.update({kernel: run_op(args, 0.6, kernel) for kernel in ("math", "chunks", "steps")})
        for name, (out, state) in got.items():
            where = f"{name} T={t} G={groups} Dv={dv}"
            torch.testing.assert_close(out, want[0], **TIGHT, msg=lambda m: f"{where}: {m}")
            torch.testing.assert_close(state, want[1], **TIGHT, msg=lambda m: f"{where}: {m}")


@pytest.mark.parametrize("per_key, groups, dv", [(False, 1, 3), (False, 4, 1), (True, 2, 1),
                                                 (True, 1, 3)])
@pytest.mark.parametrize("gate", [None, "mixed", INF], ids=["draw", "mixed", "reset"])
def test_references_match_the_loop_oracle(per_key, groups, dv, gate):
    args = linear_inputs(t=13, groups=groups, dv=dv, per_key=per_key, gate=gate, dtype=F64)
    want = loop_oracle(*args, scale=0.4)
    for got in (recurrent_linear_reference(*args[:4], scale=0.4, initial_state=args[4]),
                chunk_linear_reference(*args[:4], scale=0.4, initial_state=args[4],
                                       chunk_size=5),
                LINEAR(*args, scale=0.4)):
        torch.testing.assert_close(got[0], want[0], **TIGHT)
        torch.testing.assert_close(got[1], want[1], **TIGHT)


@pytest.mark.parametrize("kernel", ["math", "chunks", "steps"])
@pytest.mark.parametrize("per_key", [False, True], ids=["scalar", "per_key"])
def test_float32_kernels_within_1e5_of_float64(kernel, per_key):
    """The kernels compute in f32 for f32 operands; resets included, two fast blocks."""
    args = linear_inputs(t=100, groups=2, dk=8, dv=8, per_key=per_key, gate="mixed")
    want = loop_oracle(*args, scale=8 ** -0.5)
    out, state = run_op(args, 8 ** -0.5, kernel)
    assert out.dtype == torch.float32
    assert relative(out, want[0]) < 1e-5 and relative(state, want[1]) < 1e-5


def test_a_reset_forgets_the_state_before():
    """g_t = -inf at one step: from there on, the scan restarted from a zero state."""
    q, k, v, g, s0 = linear_inputs(t=10, groups=2, dtype=F64)
    g[:, 6] = INF
    out, state = LINEAR(q, k, v, g, s0, scale=0.5)
    rest = [x[:, 6:] for x in (q, k, v, g)]
    again, again_state = LINEAR(*rest, torch.zeros_like(s0), scale=0.5)
    torch.testing.assert_close(out[:, 6:], again, **TIGHT)
    torch.testing.assert_close(state, again_state, **TIGHT)


# ---- laws and the other op ------------------------------------------------------------------

def test_linear_in_values_and_initial_state_jointly():
    q, k, v, g, s0 = linear_inputs(t=9, groups=2, per_key=True, dtype=F64)
    v2, s2 = torch.randn_like(v), torch.randn_like(s0)
    both = LINEAR(q, k, 2.0 * v - 3.0 * v2, g, 2.0 * s0 - 3.0 * s2, scale=0.5)
    one, two = LINEAR(q, k, v, g, s0, scale=0.5), LINEAR(q, k, v2, g, s2, scale=0.5)
    for i in range(2):
        torch.testing.assert_close(both[i], 2.0 * one[i] - 3.0 * two[i], **TIGHT)


def test_not_the_delta_rule():
    """With beta = 0 the delta rule is a pure decay: the linear scan with v = 0, and not the
    linear scan (which adds k v^T); with beta = 1 it erases, and differs again."""
    q, k, v, g, s0 = linear_inputs(t=6, groups=2, dtype=F64)
    zero = torch.zeros(g.shape, dtype=F64)
    decay = DELTA(q, k, v, g, zero, s0, scale=0.5, qk_l2norm=False)
    pure = LINEAR(q, k, torch.zeros_like(v), g, s0, scale=0.5)
    linear = LINEAR(q, k, v, g, s0, scale=0.5)
    torch.testing.assert_close(decay[0], pure[0], **TIGHT)
    torch.testing.assert_close(decay[1], pure[1], **TIGHT)
    for beta in (zero, torch.ones_like(zero)):
        delta = DELTA(q, k, v, g, beta, s0, scale=0.5, qk_l2norm=False)
        assert (delta[0] - linear[0]).abs().max() > 1e-3
        assert (delta[1] - linear[1]).abs().max() > 1e-3


# ---- transformers' Mamba2 SSD functions -----------------------------------------------------

def _mamba2(name: str):
    module = pytest.importorskip("transformers.models.mamba2.modeling_mamba2")
    if not hasattr(module, name):
        pytest.skip(f"transformers' mamba2 module has no {name}")
    return getattr(module, name)


def mamba2_inputs(t: int, seed: int = 0) -> tuple[Tensor, ...]:
    """x [B, T, H, P], dt [B, T, H] > 0, A [H] < 0, B and C [B, T, ngroups, N], state
    [B, H, P, N]: 4 heads over 2 groups (G = 2), P = 3, N = 5."""
    gen = torch.Generator().manual_seed(seed)
    bsz, heads, groups, p, n = 2, 4, 2, 3, 5
    x = torch.randn(bsz, t, heads, p, generator=gen)
    dt = torch.rand(bsz, t, heads, generator=gen) * 0.5 + 0.05
    a = -torch.rand(heads, generator=gen) * 4 - 0.1
    b, c = (torch.randn(bsz, t, groups, n, generator=gen) for _ in range(2))
    return x, dt, a, b, c, torch.randn(bsz, heads, p, n, generator=gen)


def as_linear(x, dt, a, b, c, state) -> list:
    """Mamba2 -> gated_linear_scan operands (float64): q = C, k = B, v = dt x, g = dt A."""
    x, dt, a, b, c, state = (y.double() for y in (x, dt, a, b, c, state))
    return [c, b, dt.unsqueeze(-1) * x, dt * a, state.transpose(-1, -2)]


@pytest.mark.parametrize("t, chunk", [(37, 16), (16, 16), (5, 256)])
def test_matches_transformers_mamba2_chunk_scan(t, chunk):
    chunk_scan = _mamba2("mamba2_chunk_scan")
    x, dt, a, b, c, s0 = mamba2_inputs(t)
    want, want_state = chunk_scan(x, dt, a, b, c, chunk, initial_states=s0,
                                  return_final_states=True)  # computed in f32
    out, state = LINEAR(*as_linear(x, dt, a, b, c, s0), scale=1.0)
    assert relative(out, want.double()) < 1e-5
    assert relative(state.transpose(-1, -2), want_state.double()) < 1e-5


def test_matches_transformers_mamba2_decode_steps():
    step = _mamba2("mamba2_selective_state_update")
    x, dt, a, b, c, s0 = mamba2_inputs(3, seed=1)
    heads, p, n = x.shape[2], x.shape[3], b.shape[3]
    state, outs = s0.clone(), []
    for i in range(x.shape[1]):  # as transformers' decode calls it: dt, A expanded to P, N
        outs.append(step(state, x[:, i], dt[:, i, :, None].expand(-1, -1, p),
                         a[:, None, None].expand(heads, p, n), b[:, i], c[:, i]))
    out, final = LINEAR(*as_linear(x, dt, a, b, c, s0), scale=1.0)
    assert relative(out, torch.stack(outs, dim=1).double()) < 1e-5
    assert relative(final.transpose(-1, -2), state.double()) < 1e-5


# ---- errors name the operand ----------------------------------------------------------------

@pytest.mark.parametrize("name, index, shape", [
    ("k", 1, (2, 5, 3, 4)), ("v", 2, (2, 4, 2, 3)), ("v", 2, (2, 5, 3, 3)),
    ("g", 3, (2, 5, 3)), ("g", 3, (2, 5, 2, 3)), ("initial_state", 4, (2, 2, 3, 4)),
])
def test_bad_shape_names_operand(name, index, shape):
    args = linear_inputs()
    args[index] = torch.zeros(shape)
    with pytest.raises(ShapeError, match=f"gated_linear_scan: operand '{name}'"):
        LINEAR(*args, scale=1.0)


def test_bad_dtype_names_operand():
    args = linear_inputs()
    args[3] = args[3].to(torch.int32)
    with pytest.raises(DTypeError, match="gated_linear_scan: operand 'g'.*int32"):
        LINEAR(*args, scale=1.0)
    with pytest.raises(GdnFxError):  # also reported under fake tensors, i.e. at export time
        with torch._subclasses.FakeTensorMode() as mode:
            LINEAR(*[mode.from_tensor(a) for a in args], scale=1.0)
    q, *rest = linear_inputs()
    with pytest.raises(ShapeError, match="gated_linear_scan: q and v must be 4-D"):
        LINEAR(q[0], *rest, scale=1.0)
