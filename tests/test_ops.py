"""The two custom ops: contracts, fake kernels (opcheck), and errors on bad operands."""

import pytest
import torch
from transformers.models.qwen3_5.modeling_qwen3_5 import (
    causal_conv1d_update as hf_conv_update,
    torch_recurrent_gated_delta_rule as hf_recurrent,
)

import gdn_fx  # noqa: F401
from gdn_fx.errors import DTypeError, GdnFxError, ShapeError
from gdn_fx.reference import causal_conv1d_update_reference

SCAN = torch.ops.gdn_fx.gated_delta_scan.default
CONV = torch.ops.gdn_fx.causal_conv1d_update.default


def scan_inputs(b=2, t=5, hk=2, g_heads=1, dk=8, dv=8, kda=False, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hv = hk * g_heads

    def rnd(*shape):
        return torch.randn(*shape, generator=gen)

    gate = -torch.rand(b, t, hv, dk, generator=gen) if kda else -torch.rand(b, t, hv, generator=gen)
    xs = [rnd(b, t, hk, dk), rnd(b, t, hk, dk), rnd(b, t, hv, dv), gate,
          torch.rand(b, t, hv, generator=gen)]
    return [x.to(dtype) for x in xs] + [rnd(b, hv, dk, dv)]


SCAN_CASES = {
    "f32": {}, "f16": dict(dtype=torch.float16), "bf16": dict(dtype=torch.bfloat16),
    "gqa": dict(g_heads=3), "kda": dict(kda=True), "batch1": dict(b=1), "empty": dict(t=0),
    "dk_ne_dv": dict(dk=8, dv=12), "kda_gqa_f16": dict(kda=True, g_heads=2, dtype=torch.float16),
}


@pytest.mark.parametrize("case", SCAN_CASES)
@pytest.mark.parametrize("l2", [True, False])
def test_scan_opcheck(case, l2):
    args = scan_inputs(**SCAN_CASES[case])
    torch.library.opcheck(SCAN, args, dict(scale=0.3, qk_l2norm=l2))


@pytest.mark.parametrize("case", SCAN_CASES)
def test_scan_dtypes_and_shapes(case):
    args = scan_inputs(**SCAN_CASES[case])
    out, state = SCAN(*args, scale=0.3, qk_l2norm=True)
    q, v, s0 = args[0], args[2], args[5]
    assert out.shape == v.shape and out.dtype == torch.promote_types(q.dtype, s0.dtype)
    assert state.shape == s0.shape and state.dtype == s0.dtype
    if v.shape[1] == 0:
        assert torch.equal(state, s0) and state.data_ptr() != s0.data_ptr()


@pytest.mark.parametrize("gqa", [1, 2])
@pytest.mark.parametrize("l2", [True, False])
def test_scan_matches_transformers(gqa, l2):
    q, k, v, g, beta, s0 = scan_inputs(t=9, g_heads=gqa, dk=16, dv=16)
    want, want_state = hf_recurrent(q, k, v, g, beta, s0, True, l2)
    out, state = SCAN(q, k, v, g, beta, s0, scale=16**-0.5, qk_l2norm=l2)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, want_state, rtol=1e-5, atol=1e-5)


def test_scan_gradients_flow():
    args = [x.double().requires_grad_(True) for x in scan_inputs(t=3, g_heads=2, dk=4, dv=4)]
    torch.autograd.gradcheck(lambda *a: SCAN(*a, scale=0.5, qk_l2norm=True), args)


@pytest.mark.parametrize("name,index,shape", [
    ("k", 1, (2, 5, 3, 8)), ("v", 2, (2, 4, 2, 8)), ("g", 3, (2, 5, 3)),
    ("beta", 4, (2, 5, 2, 1)), ("initial_state", 5, (2, 2, 8, 4)),
])
def test_scan_bad_shape_names_operand(name, index, shape):
    args = scan_inputs()
    args[index] = torch.zeros(shape)
    with pytest.raises(ShapeError, match=f"'{name}'"):
        SCAN(*args, scale=1.0, qk_l2norm=False)


def test_scan_bad_dtype_names_operand():
    args = scan_inputs()
    args[4] = args[4].to(torch.int32)
    with pytest.raises(DTypeError, match="'beta'.*int32"):
        SCAN(*args, scale=1.0, qk_l2norm=False)
    with pytest.raises(GdnFxError):  # also reported under fake tensors, i.e. at export time
        with torch._subclasses.FakeTensorMode() as mode:
            SCAN(*[mode.from_tensor(a) for a in args], scale=1.0, qk_l2norm=False)


def conv_inputs(b=2, c=6, t=3, k=4, bias=True, dtype=torch.float32, state_dtype=None):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(b, c, t, generator=gen).to(dtype)
    state = torch.randn(b, c, k, generator=gen).to(state_dtype or dtype)
    weight = torch.randn(c, k, generator=gen).to(dtype)
    return [x, state, weight, torch.randn(c, generator=gen).to(dtype) if bias else None]


CONV_CASES = {
    "f32": {}, "no_bias": dict(bias=False), "f16": dict(dtype=torch.float16),
    "bf16": dict(dtype=torch.bfloat16), "t1": dict(t=1), "t0": dict(t=0), "k2": dict(k=2),
    "mixed_state": dict(dtype=torch.bfloat16, state_dtype=torch.float32),
}


@pytest.mark.parametrize("case", CONV_CASES)
@pytest.mark.parametrize("act", [None, "silu"])
def test_conv_opcheck(case, act):
    torch.library.opcheck(CONV, conv_inputs(**CONV_CASES[case]) + [act])


@pytest.mark.parametrize("act", [None, "silu"])
@pytest.mark.parametrize("case", ["f32", "no_bias", "t1", "k2"])
def test_conv_matches_transformers(case, act):
    x, state, weight, bias = conv_inputs(**CONV_CASES[case])
    hf_state = state.clone()
    want = hf_conv_update(x, hf_state, weight, bias, act)
    out, new_state = CONV(x, state, weight, bias, act)
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)
    assert torch.equal(new_state, hf_state)


def test_conv_bad_state_width():
    x, state, weight, bias = conv_inputs()
    with pytest.raises(ShapeError, match="'conv_state'"):
        CONV(x, state[..., 1:], weight, bias, None)
    with pytest.raises(ValueError, match="activation"):
        causal_conv1d_update_reference(x, state, weight, bias, "gelu")


def test_opcheck_catches_a_wrong_fake_kernel():
    """A fake kernel claiming q's dtype (not the promoted one) must fail opcheck."""
    lib = torch.library.Library("gdn_fx_test", "FRAGMENT")
    try:
        @torch.library.custom_op("gdn_fx_test::scan", mutates_args=())
        def scan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                 beta: torch.Tensor, s0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return SCAN(q, k, v, g, beta, s0, scale=0.5, qk_l2norm=True)

        @scan.register_fake
        def _(q, k, v, g, beta, s0):
            return torch.empty_like(v), torch.empty_like(s0)  # wrong: out should be promoted

        args = scan_inputs(dtype=torch.float16)
        with pytest.raises(Exception, match="(?i)dtype"):
            torch.library.opcheck(scan, args)
    finally:
        del lib


@pytest.mark.parametrize("kda, groups, l2norm, t, chunks", [
    (False, 1, True, 9, True), (True, 2, False, 9, True), (False, 2, False, 9, True),
    (False, 2, True, 150, True),  # blocks of 64, 64 and 22 tokens (ops.CHUNK = 64)
    (False, 1, False, 70, False)])  # step by step (what validation falls back to)
def test_the_fast_eager_kernel_computes_the_reference(kda, groups, l2norm, t, chunks):
    """The kernel translation validation runs agrees with the float64 reference."""
    from gdn_fx.ops import fast_scan_kernel
    from gdn_fx.reference import l2norm as norm, recurrent_delta_rule_reference

    gen = torch.Generator().manual_seed(3)
    b, hk, dk, dv = 2, 2, 5, 3
    hv = hk * groups
    q, k = (torch.randn(b, t, hk, dk, generator=gen) for _ in range(2))
    v = torch.randn(b, t, hv, dv, generator=gen)
    g = -torch.rand(b, t, hv, *((dk,) if kda else ()), generator=gen)
    beta, s0 = torch.rand(b, t, hv, generator=gen), torch.randn(b, hv, dk, dv, generator=gen)
    with fast_scan_kernel(chunks):
        out, final = torch.ops.gdn_fx.gated_delta_scan(q, k, v, g, beta, s0, scale=0.4,
                                                       qk_l2norm=l2norm)
    q64, k64 = (norm(x.double()) if l2norm else x.double() for x in (q, k))
    want, want_final = recurrent_delta_rule_reference(q64, k64, v.double(), g.double(),
                                                      beta.double(), scale=0.4,
                                                      initial_state=s0.double())
    assert torch.allclose(out.double(), want, atol=1e-5)
    assert torch.allclose(final.double(), want_final, atol=1e-5)
