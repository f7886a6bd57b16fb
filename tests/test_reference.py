"""The reference oracles against each other and against independent textbook forms (float64).

Independent oracles used here (written in this file, not taken from gdn_fx.reference):
- the delta rule in its "Householder" form ``S = (I - beta k k^T) D S + beta k v^T``;
- an E4M3 round-to-nearest-even written from the format's definition (3 mantissa bits,
  minimum normal exponent -6, subnormal step 2^-9);
- ``torch.nn.functional.conv1d`` for the conv update.
"""

from __future__ import annotations

from typing import Optional

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from gdn_fx.errors import ShapeError
from gdn_fx.reference import (
    E4M3_MAX,
    causal_conv1d_update_reference,
    chunk_gdn_reference,
    gated_delta_reference,
    l2norm,
    recurrent_delta_rule_reference,
    state_fp8_qdq_reference,
)

F64 = torch.float64
TIGHT = dict(rtol=1e-11, atol=1e-11)


def make_inputs(b: int = 2, t: int = 11, hk: int = 2, hv: int = 4, dk: int = 5, dv: int = 3,
                kda: bool = False, state: bool = True, dtype: torch.dtype = F64,
                seed: int = 0) -> dict:
    """Random operands: unit-norm-ish keys (a stable recurrence), negative log gates."""
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=gen, dtype=F64)

    gate_shape = (b, t, hv, dk) if kda else (b, t, hv)
    xs = dict(q=rnd(b, t, hk, dk), k=l2norm(rnd(b, t, hk, dk)), v=rnd(b, t, hv, dv),
              g=-0.5 * torch.rand(*gate_shape, generator=gen, dtype=F64),
              beta=torch.rand(b, t, hv, generator=gen, dtype=F64),
              initial_state=rnd(b, hv, dk, dv) if state else None)
    return {n: None if x is None else x.to(dtype) for n, x in xs.items()}


def textbook_delta_rule(q, k, v, g, beta, initial_state=None, scale=None,
                        record_delta: bool = False):
    """Per batch/head/step loop of ``S = (I - b k k^T) D S + b k v^T``, ``o = scale q^T S``.

    Returns (out, final) or, with record_delta, the per-step delta rows
    ``beta (v - k^T D S)`` as [B, T, Hv, Dv].
    """
    bsz, t, hk, dk = q.shape
    hv, dv = v.shape[2:]
    scale = dk**-0.5 if scale is None else scale
    out = torch.zeros(bsz, t, hv, dv, dtype=v.dtype)
    deltas = torch.zeros(bsz, t, hv, dv, dtype=v.dtype)
    final = torch.zeros(bsz, hv, dk, dv, dtype=v.dtype)
    eye = torch.eye(dk, dtype=v.dtype)
    for b in range(bsz):
        for h in range(hv):
            kh = h // (hv // hk)
            s = torch.zeros(dk, dv, dtype=v.dtype) if initial_state is None else initial_state[b, h]
            for i in range(t):
                kt, bt = k[b, i, kh], beta[b, i, h]
                decay = torch.diag(g[b, i, h].exp() * torch.ones(dk, dtype=v.dtype))
                deltas[b, i, h] = bt * (v[b, i, h] - kt @ decay @ s)
                s = (eye - bt * torch.outer(kt, kt)) @ decay @ s + bt * torch.outer(kt, v[b, i, h])
                out[b, i, h] = scale * q[b, i, kh] @ s
            final[b, h] = s
    return deltas if record_delta else (out, final)


def both_references(chunk_size: int = 4):
    """(name, fn) of the two references, chunk size fixed."""
    def chunk(*args, **kw):
        return chunk_gdn_reference(*args, chunk_size=chunk_size, **kw)
    return [("recurrent", recurrent_delta_rule_reference), ("chunk", chunk)]


def args_of(x: dict) -> tuple:
    return x["q"], x["k"], x["v"], x["g"], x["beta"]


# ---- the recurrence itself ----------------------------------------------------------------------

@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("heads", [(2, 2), (1, 3)], ids=["mha", "gqa"])
def test_recurrent_matches_textbook_form(kda, heads):
    x = make_inputs(b=2, t=6, hk=heads[0], hv=heads[1], kda=kda)
    want_out, want_state = textbook_delta_rule(*args_of(x), x["initial_state"], scale=0.7)
    out, state = recurrent_delta_rule_reference(*args_of(x), scale=0.7,
                                                initial_state=x["initial_state"])
    torch.testing.assert_close(out, want_out, **TIGHT)
    torch.testing.assert_close(state, want_state, **TIGHT)


def test_gated_delta_reference_is_head_major_recurrence():
    x = make_inputs(hk=3, hv=3)
    out, state = recurrent_delta_rule_reference(*args_of(x), initial_state=x["initial_state"])
    head_major = [t.transpose(1, 2) for t in args_of(x)]
    y, s = gated_delta_reference(*head_major, x["initial_state"])
    torch.testing.assert_close(y, out.transpose(1, 2), **TIGHT)
    torch.testing.assert_close(s, state, **TIGHT)


def test_l2norm_definition():
    x = torch.randn(3, 7, dtype=F64)
    want = x / torch.sqrt((x**2).sum(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(l2norm(x), want, **TIGHT)
    assert torch.equal(l2norm(torch.zeros(2, 4)), torch.zeros(2, 4))  # eps: no NaN at zero


# ---- chunk == recurrent -------------------------------------------------------------------------

@pytest.mark.parametrize("chunk_size", [1, 3, 4, 8, 64])
@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("state", [True, False], ids=["s0", "no_s0"])
def test_chunk_equals_recurrent(chunk_size, kda, state):
    x = make_inputs(t=11, hk=2, hv=4, dk=5, dv=3, kda=kda, state=state)  # T=11: partial chunks
    want = recurrent_delta_rule_reference(*args_of(x), initial_state=x["initial_state"])
    got = chunk_gdn_reference(*args_of(x), chunk_size=chunk_size,
                              initial_state=x["initial_state"])
    torch.testing.assert_close(got[0], want[0], **TIGHT)
    torch.testing.assert_close(got[1], want[1], **TIGHT)


def test_chunk_equals_recurrent_with_strong_kda_gates():
    """Per-key gates down to e^-8 a step: the chunk's e^G and e^(G_C - G) stay in range."""
    x = make_inputs(t=20, kda=True, seed=3)
    x["g"] = x["g"] * 16
    want = recurrent_delta_rule_reference(*args_of(x), initial_state=x["initial_state"])
    got = chunk_gdn_reference(*args_of(x), chunk_size=8, initial_state=x["initial_state"])
    torch.testing.assert_close(got[0], want[0], **TIGHT)
    torch.testing.assert_close(got[1], want[1], **TIGHT)


# ---- packed sequences, layouts, gate broadcast --------------------------------------------------

@pytest.mark.parametrize("name,ref", both_references(chunk_size=3))
@pytest.mark.parametrize("state", [True, False], ids=["s0", "no_s0"])
def test_cu_seqlens_equals_each_segment_alone(name, ref, state):
    lengths = [4, 0, 7, 1]  # an empty segment keeps its own initial state
    x = make_inputs(b=1, t=sum(lengths), kda=True, state=False, seed=1)
    s0 = torch.randn(len(lengths), 4, 5, 3, dtype=F64) if state else None
    cu = torch.tensor([0, 4, 4, 11, 12], dtype=torch.int32)
    out, final = ref(*args_of(x), initial_state=s0, cu_seqlens=cu)
    assert final.shape == (len(lengths), 4, 5, 3)
    for seq, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        part = [t[:, a:b] for t in args_of(x)]
        own = None if s0 is None else s0[seq:seq + 1]
        want_out, want_state = recurrent_delta_rule_reference(*part, initial_state=own)
        torch.testing.assert_close(out[:, a:b], want_out, **TIGHT)
        torch.testing.assert_close(final[seq:seq + 1], want_state, **TIGHT)


@pytest.mark.parametrize("name,ref", both_references())
def test_kda_gate_broadcast_over_dk_equals_gdn(name, ref):
    x = make_inputs(kda=False)
    gdn = ref(*args_of(x), initial_state=x["initial_state"])
    kda_gate = x["g"].unsqueeze(-1).expand(-1, -1, -1, x["q"].shape[-1]).contiguous()
    kda = ref(x["q"], x["k"], x["v"], kda_gate, x["beta"], initial_state=x["initial_state"])
    torch.testing.assert_close(kda[0], gdn[0], **TIGHT)
    torch.testing.assert_close(kda[1], gdn[1], **TIGHT)


@pytest.mark.parametrize("name,ref", both_references())
def test_state_v_first_is_the_transposed_state(name, ref):
    x = make_inputs(kda=True, dk=5, dv=3)
    key_first = ref(*args_of(x), initial_state=x["initial_state"])
    v_first = ref(*args_of(x), initial_state=x["initial_state"].transpose(-1, -2).contiguous(),
                  state_v_first=True)
    assert v_first[1].shape == (2, 4, 3, 5)
    torch.testing.assert_close(v_first[0], key_first[0], **TIGHT)
    torch.testing.assert_close(v_first[1], key_first[1].transpose(-1, -2), **TIGHT)


@pytest.mark.parametrize("name,ref", both_references())
@pytest.mark.parametrize("packed", [False, True])
def test_empty_sequence_returns_empty_out_and_initial_state(name, ref, packed):
    x = make_inputs(b=1, t=0, state=False)
    count = 2 if packed else 1
    s0 = torch.randn(count, 4, 5, 3, dtype=F64)
    cu = torch.tensor([0, 0, 0]) if packed else None
    out, final = ref(*args_of(x), initial_state=s0, cu_seqlens=cu)
    assert out.shape == (1, 0, 4, 3)
    assert torch.equal(final, s0) and final.data_ptr() != s0.data_ptr()


def test_empty_sequence_chunk_qdq_and_quantizer():
    x = make_inputs(b=2, t=0)
    calls = []
    out, final = chunk_gdn_reference(*args_of(x), initial_state=x["initial_state"],
                                     state_qdq=True, state_qdq_block_v=2,
                                     w_quantizer=lambda w: calls.append(w) or w)
    assert out.shape == (2, 0, 4, 3) and calls == []  # no W operand exists at T == 0
    torch.testing.assert_close(final, state_fp8_qdq_reference(x["initial_state"], 2), **TIGHT)


def test_accumulation_follows_input_dtype():
    x = make_inputs(dtype=torch.float32)
    for ref in (recurrent_delta_rule_reference, chunk_gdn_reference):
        out, final = ref(*args_of(x), initial_state=x["initial_state"])
        assert out.dtype == final.dtype == torch.float32


# ---- gradients ----------------------------------------------------------------------------------

def small_grad_inputs(kda: bool) -> list[Tensor]:
    x = make_inputs(b=1, t=5, hk=1, hv=2, dk=3, dv=2, kda=kda, seed=2)
    return [t.clone().requires_grad_(True) for t in (*args_of(x), x["initial_state"])]


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_gradcheck_recurrent(kda):
    def fn(q, k, v, g, beta, s0):
        return recurrent_delta_rule_reference(q, k, v, g, beta, initial_state=s0)
    assert torch.autograd.gradcheck(fn, small_grad_inputs(kda))


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_gradcheck_chunk(kda):
    def fn(q, k, v, g, beta, s0):
        return chunk_gdn_reference(q, k, v, g, beta, chunk_size=2, initial_state=s0)
    assert torch.autograd.gradcheck(fn, small_grad_inputs(kda))


def test_gradcheck_packed_and_v_first():
    cu = torch.tensor([0, 2, 5])

    def fn(q, k, v, g, beta, s0):
        return chunk_gdn_reference(q, k, v, g, beta, chunk_size=2, cu_seqlens=cu,
                                   initial_state=s0, state_v_first=True)
    q, k, v, g, beta, _ = small_grad_inputs(kda=True)
    s0 = torch.randn(2, 2, 2, 3, dtype=F64, requires_grad=True)  # [N, Hv, Dv, Dk]
    assert torch.autograd.gradcheck(fn, [q, k, v, g, beta, s0])


# ---- the W operand and its quantizer ------------------------------------------------------------

def w_from_textbook(x: dict, chunk_size: int) -> Tensor:
    """W of each chunk, from its definition: with v = 0 and a chunk starting from state I,
    the recurrence's deltas are exactly ``-W`` (delta = U - W S and U = 0)."""
    q, k, _, g, beta = args_of(x)
    b, t, hv, dk = q.shape[0], q.shape[1], x["v"].shape[2], q.shape[3]
    parts = []
    for a in range(0, t, chunk_size):
        e = slice(a, min(a + chunk_size, t))
        eye = torch.eye(dk, dtype=F64).expand(b, hv, dk, dk)
        zeros = torch.zeros(b, e.stop - a, hv, dk, dtype=F64)
        parts.append(-textbook_delta_rule(q[:, e], k[:, e], zeros, g[:, e], beta[:, e], eye,
                                          record_delta=True))
    return torch.cat(parts, dim=1)


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_w_quantizer_sees_the_whole_w_once(kda):
    x = make_inputs(t=11, kda=kda)
    seen = []

    def spy(w: Tensor) -> Tensor:
        seen.append(w.detach().clone())
        return w
    got = chunk_gdn_reference(*args_of(x), chunk_size=4, initial_state=x["initial_state"],
                              w_quantizer=spy)
    plain = chunk_gdn_reference(*args_of(x), chunk_size=4, initial_state=x["initial_state"])
    assert len(seen) == 1 and seen[0].shape == (2, 11, 4, 5)  # [B, T, Hv, Dk]
    torch.testing.assert_close(seen[0], w_from_textbook(x, 4), **TIGHT)
    assert torch.equal(got[0], plain[0]) and torch.equal(got[1], plain[1])


def test_w_quantizer_effect_is_visible_and_only_through_the_state():
    x = make_inputs(t=11)

    def coarse(w: Tensor) -> Tensor:
        return torch.round(w * 8) / 8

    def run(**kw):
        return chunk_gdn_reference(*args_of(x), chunk_size=4, **kw)
    changed = run(initial_state=x["initial_state"], w_quantizer=coarse)[0]
    assert (changed - run(initial_state=x["initial_state"])[0]).abs().max() > 1e-3
    # W multiplies only the incoming state: one chunk from a zero state never reads it.
    alone = chunk_gdn_reference(*args_of(x), chunk_size=64, w_quantizer=coarse)[0]
    torch.testing.assert_close(alone, chunk_gdn_reference(*args_of(x), chunk_size=64)[0],
                               **TIGHT)


class RoundWithGradScale(torch.autograd.Function):
    """Forward rounds W to 1/8; backward scales the gradient (a visible custom rule)."""

    calls = 0

    @staticmethod
    def forward(ctx, w: Tensor, factor: float) -> Tensor:
        ctx.factor = factor
        return torch.round(w * 8) / 8

    @staticmethod
    def backward(ctx, grad: Tensor):
        RoundWithGradScale.calls += 1
        return grad * ctx.factor, None


def test_w_quantizer_uses_its_own_autograd():
    x = make_inputs(t=9, kda=True)

    def grads(factor: float) -> list[Tensor]:
        leaves = [t.clone().requires_grad_(True) for t in (x["k"], x["initial_state"])]
        out, final = chunk_gdn_reference(
            x["q"], leaves[0], x["v"], x["g"], x["beta"], chunk_size=4,
            initial_state=leaves[1], w_quantizer=lambda w: RoundWithGradScale.apply(w, factor))
        (out.sum() + final.sum()).backward()
        return [t.grad for t in leaves]
    RoundWithGradScale.calls = 0
    one, zero = grads(1.0), grads(0.0)
    assert RoundWithGradScale.calls == 2  # one backward per run: W went through it once
    assert all(torch.isfinite(g).all() for g in one + zero)
    assert (one[0] - zero[0]).abs().max() > 1e-6  # the custom rule decides the W path's share
    # the state's gradient reads W's value, never W's derivative: it still flows, unchanged
    assert one[1].abs().max() > 1e-3 and torch.equal(one[1], zero[1])


# ---- state QDQ inside the chunk algorithm -------------------------------------------------------

def hand_composed_qdq(x: dict, chunk_size: int, block_v: int, cu: Optional[list] = None):
    """qdq(s0), then per chunk: exact recurrence over the chunk, then qdq of its final state."""
    s0 = x["initial_state"]
    bounds = cu or [0, x["q"].shape[1]]
    outs, finals = [], []
    for seq, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        state = state_fp8_qdq_reference(s0 if cu is None else s0[seq:seq + 1], block_v)
        for a in range(start, end, chunk_size):
            part = [t[:, a:min(a + chunk_size, end)] for t in args_of(x)]
            out, state = recurrent_delta_rule_reference(*part, initial_state=state)
            state = state_fp8_qdq_reference(state, block_v)
            outs.append(out)
        finals.append(state)
    return torch.cat(outs, dim=1), torch.cat(finals, dim=0)


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_state_qdq_at_chunk_boundaries(kda):
    x = make_inputs(t=11, dv=5, kda=kda)
    got = chunk_gdn_reference(*args_of(x), chunk_size=4, initial_state=x["initial_state"],
                              state_qdq=True, state_qdq_block_v=2)  # tiles 2, 2, 1
    want = hand_composed_qdq(x, chunk_size=4, block_v=2)
    torch.testing.assert_close(got[0], want[0], **TIGHT)
    torch.testing.assert_close(got[1], want[1], **TIGHT)
    exact = chunk_gdn_reference(*args_of(x), chunk_size=4, initial_state=x["initial_state"])
    assert (got[0] - exact[0]).abs().max() > 1e-4  # the QDQ really happened


def test_state_qdq_packed_and_v_first():
    x = make_inputs(b=1, t=9, dv=4, state=False)
    x["initial_state"] = torch.randn(2, 4, 5, 4, dtype=F64)
    cu = [0, 6, 9]
    got = chunk_gdn_reference(*args_of(x), chunk_size=4, cu_seqlens=torch.tensor(cu),
                              initial_state=x["initial_state"].transpose(-1, -2),
                              state_v_first=True, state_qdq=True, state_qdq_block_v=3)
    want = hand_composed_qdq(x, chunk_size=4, block_v=3, cu=cu)
    torch.testing.assert_close(got[0], want[0], **TIGHT)
    torch.testing.assert_close(got[1], want[1].transpose(-1, -2), **TIGHT)


# ---- fp8 state QDQ ------------------------------------------------------------------------------

def e4m3_round(x: Tensor) -> Tensor:
    """Round-to-nearest-even onto the E4M3 grid (|x| <= 448): 3 mantissa bits, exponents
    down to -6, subnormal spacing 2^-9."""
    exponent = torch.floor(torch.log2(x.abs().clamp_min(2.0**-6)))
    step = torch.exp2(exponent - 3)
    return torch.round(x / step) * step


def tile_oracle(state: Tensor, block_v: int) -> Tensor:
    """Per-[Dk, block_v]-tile scale amax/448 (one for a zero tile), E4M3 rounding."""
    out = torch.empty_like(state)
    for a in range(0, state.shape[-1], block_v):
        tile = state[..., a:a + block_v]
        amax = tile.abs().amax(dim=(-2, -1), keepdim=True)
        scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
        out[..., a:a + block_v] = e4m3_round(tile / scale) * scale
    return out


def test_fp8_qdq_matches_the_e4m3_definition():
    state = torch.randn(3, 2, 8, 12, dtype=F64) * torch.logspace(-3, 3, 12, dtype=F64)
    torch.testing.assert_close(state_fp8_qdq_reference(state, 4), tile_oracle(state, 4),
                               rtol=1e-14, atol=0)


def test_fp8_qdq_scale_is_per_tile():
    state = torch.randn(8, 8, dtype=F64)
    state[:, :4] *= 1e-4  # tile 0 tiny, tile 1 large
    state[:, 4:] *= 1e4
    got = state_fp8_qdq_reference(state, block_v=4)
    for cols in (slice(0, 4), slice(4, 8)):
        amax = state[:, cols].abs().max()
        assert (got[:, cols] - state[:, cols]).abs().max() <= 2**-4 * amax
    # one scale for the whole state would flush the tiny tile: it would not keep its precision
    one_scale = state_fp8_qdq_reference(state, block_v=8)
    assert (one_scale[:, :4] - state[:, :4]).abs().max() > 0.5 * state[:, :4].abs().max()


def test_fp8_qdq_zero_tile_and_partial_tile():
    state = torch.randn(2, 6, 10, dtype=F64)  # tiles of 4, 4 and a partial 2
    state[0, :, 4:8] = 0
    state[1, :, 8:] *= 1e-3
    got = state_fp8_qdq_reference(state, block_v=4)
    assert torch.equal(got[0, :, 4:8], torch.zeros(6, 4, dtype=F64))
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, tile_oracle(state, 4), rtol=1e-14, atol=0)
    partial = state[1, :, 8:]
    # the partial tile's largest element maps to 448, which E4M3 holds exactly
    index = partial.abs().argmax()
    torch.testing.assert_close(got[1, :, 8:].flatten()[index], partial.flatten()[index],
                               rtol=1e-14, atol=0)


def test_fp8_qdq_error_is_bounded_by_e4m3_resolution():
    gen = torch.Generator().manual_seed(5)
    state = torch.randn(4, 3, 16, 20, generator=gen, dtype=F64)
    state = state * torch.exp(4 * torch.randn(4, 3, 16, 20, generator=gen, dtype=F64))
    got = state_fp8_qdq_reference(state, block_v=8)  # tiles 8, 8, 4
    err = (got - state).abs()
    worst = 0.0
    for a in range(0, 20, 8):
        amax = state[..., a:a + 8].abs().amax(dim=(-2, -1), keepdim=True)
        rel_to_amax = err[..., a:a + 8] / amax
        worst = max(worst, rel_to_amax.max().item())
        # finer: half an ulp of the element for E4M3 normals, half a subnormal step below
        scale = amax / E4M3_MAX
        bound = torch.maximum(2.0**-4 * state[..., a:a + 8].abs(), 2.0**-10 * scale)
        assert (err[..., a:a + 8] <= bound * (1 + 1e-12)).all()
    assert 0 < worst <= 2**-4


@pytest.mark.parametrize("dtype", [F64, torch.float32])
def test_fp8_qdq_gradient_is_identity(dtype):
    state = torch.randn(2, 4, 6, dtype=dtype, requires_grad=True)
    weight = torch.randn(2, 4, 6, dtype=dtype)
    got = state_fp8_qdq_reference(state, block_v=4)
    assert got.dtype == dtype and not torch.equal(got, state)
    (got * weight).sum().backward()
    assert torch.equal(state.grad, weight)


# ---- causal conv1d update -----------------------------------------------------------------------

@pytest.mark.parametrize("seq_len", [1, 3, 6])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("activation", [None, "silu"])
def test_conv_update_matches_torch_conv1d(seq_len, bias, activation):
    gen = torch.Generator().manual_seed(seq_len)
    b, c, width = 2, 3, 4
    x = torch.randn(b, c, seq_len, generator=gen, dtype=F64)
    state = torch.randn(b, c, width, generator=gen, dtype=F64)
    weight = torch.randn(c, width, generator=gen, dtype=F64)
    bias_t = torch.randn(c, generator=gen, dtype=F64) if bias else None
    before = state.clone()
    out, new_state = causal_conv1d_update_reference(x, state, weight, bias_t, activation)
    full = torch.cat([state, x], dim=-1)
    want = F.conv1d(full, weight.unsqueeze(1), bias_t, groups=c)[..., -seq_len:]
    want = F.silu(want) if activation else want
    torch.testing.assert_close(out, want, **TIGHT)
    assert torch.equal(new_state, full[..., -width:]) and torch.equal(state, before)


def test_conv_update_empty_input_and_dtypes():
    x = torch.randn(1, 3, 0, dtype=torch.float16)
    state = torch.randn(1, 3, 4, dtype=torch.float16)
    out, new_state = causal_conv1d_update_reference(x, state, torch.randn(3, 4))
    assert out.shape == (1, 3, 0) and out.dtype == torch.float16
    assert torch.equal(new_state, state) and new_state.dtype == torch.float16


# ---- clear errors -------------------------------------------------------------------------------

def test_bad_operands_raise_shape_errors():
    x = make_inputs(b=2, t=4)
    with pytest.raises(ShapeError, match="beta"):
        recurrent_delta_rule_reference(x["q"], x["k"], x["v"], x["g"], x["beta"][..., :3])
    with pytest.raises(ShapeError, match="initial_state"):
        chunk_gdn_reference(*args_of(x), initial_state=x["initial_state"][:1])
    with pytest.raises(ShapeError, match="batch 1"):
        recurrent_delta_rule_reference(*args_of(x), cu_seqlens=torch.tensor([0, 4]))
    one = make_inputs(b=1, t=4)
    with pytest.raises(ShapeError, match="cu_seqlens"):
        chunk_gdn_reference(*args_of(one), cu_seqlens=torch.tensor([0, 3, 2, 4]))
    with pytest.raises(ShapeError, match="conv_state"):
        causal_conv1d_update_reference(torch.randn(1, 2, 3), torch.randn(1, 2, 1),
                                       torch.randn(2, 4))
