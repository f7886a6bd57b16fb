"""The reference oracles against transformers' own functions (imported, never copied).

HF's rules cast to f32, optionally l2-normalize q/k (use_qk_l2norm_in_kernel) and always scale
q by Dk ** -0.5; our references take already-normalized q/k, so the HF flag is mirrored by
normalizing before the call. KDA in transformers has no GQA. All comparisons are in f32 with
``max|a - b| / max|b| <= 1e-5``.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor
from transformers.models.kimi_linear.modeling_kimi_linear import (
    chunk_kimi_delta_attention,
    recurrent_kimi_delta_attention,
)
from transformers.models.qwen3_5.modeling_qwen3_5 import (
    causal_conv1d_update as hf_causal_conv1d_update,
    torch_chunk_gated_delta_rule,
    torch_recurrent_gated_delta_rule,
)

from gdn_fx.reference import (
    causal_conv1d_update_reference,
    chunk_gdn_reference,
    gated_delta_reference,
    l2norm,
    recurrent_delta_rule_reference,
)

F32 = torch.float32
LIMIT = 1e-5
WORST: dict[str, float] = {}  # largest relative error seen per comparison (printed with -s)


def rel_err(a: Tensor, b: Tensor) -> float:
    """max|a - b| / max|b|, in float64 so the measure adds no rounding of its own."""
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max()).item()


def check(name: str, got: Tensor, want: Tensor) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    err = rel_err(got, want)
    WORST[name] = max(WORST.get(name, 0.0), err)
    assert err <= LIMIT, f"{name}: relative error {err:.3g} > {LIMIT}"


def hf_inputs(b: int, t: int, hk: int, hv: int, dk: int, dv: int, kda: bool, l2: bool,
              state: bool, seed: int) -> dict:
    """f32 operands as the HF rules take them. Without in-kernel l2norm the keys are given
    norms in [0.5, 1] so the recurrence stays contractive, as normalized keys make it."""
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=gen)
    q, k = rnd(b, t, hk, dk), rnd(b, t, hk, dk)
    if not l2:
        k = l2norm(k) * (0.5 + 0.5 * torch.rand(b, t, hk, 1, generator=gen))
    gate_shape = (b, t, hv, dk) if kda else (b, t, hv)
    return dict(q=q, k=k, v=rnd(b, t, hv, dv), g=-torch.rand(*gate_shape, generator=gen),
                beta=torch.rand(b, t, hv, generator=gen),
                initial_state=rnd(b, hv, dk, dv) if state else None)


def ours_inputs(x: dict, l2: bool) -> tuple:
    """What our references take: q/k normalized here when HF normalizes in the kernel."""
    q, k = (l2norm(x["q"]), l2norm(x["k"])) if l2 else (x["q"], x["k"])
    return q, k, x["v"], x["g"], x["beta"]


def hf_call(fn, x: dict, l2: bool, **kw) -> tuple[Tensor, Tensor]:
    state = None if x["initial_state"] is None else x["initial_state"].clone()
    return fn(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=state,
              output_final_state=True, use_qk_l2norm_in_kernel=l2, **kw)


L2 = pytest.mark.parametrize("l2", [True, False], ids=["l2", "no_l2"])
STATE = pytest.mark.parametrize("state", [True, False], ids=["s0", "no_s0"])
HEADS = pytest.mark.parametrize("heads", [(4, 4), (2, 6)], ids=["mha", "gqa"])


@L2
@STATE
@HEADS
def test_gdn_matches_hf_recurrent_rule(l2, state, heads):
    x = hf_inputs(2, 13, heads[0], heads[1], 16, 12, kda=False, l2=l2, state=state, seed=1)
    want_out, want_state = hf_call(torch_recurrent_gated_delta_rule, x, l2)
    for name, ref in (("recurrent", recurrent_delta_rule_reference),
                      ("chunk", lambda *a, **kw: chunk_gdn_reference(*a, chunk_size=4, **kw))):
        out, final = ref(*ours_inputs(x, l2), initial_state=x["initial_state"])
        check(f"gdn {name} vs hf recurrent: out", out, want_out)
        check(f"gdn {name} vs hf recurrent: state", final, want_state)


@L2
@STATE
@HEADS
@pytest.mark.parametrize("chunk_size", [8, 64])
def test_gdn_matches_hf_chunk_rule(l2, state, heads, chunk_size):
    x = hf_inputs(2, 37, heads[0], heads[1], 16, 12, kda=False, l2=l2, state=state, seed=2)
    want_out, want_state = hf_call(torch_chunk_gated_delta_rule, x, l2, chunk_size=chunk_size)
    out, final = chunk_gdn_reference(*ours_inputs(x, l2), chunk_size=chunk_size,
                                     initial_state=x["initial_state"])
    check("gdn chunk vs hf chunk: out", out, want_out)
    check("gdn chunk vs hf chunk: state", final, want_state)


@L2
@STATE
def test_gated_delta_reference_matches_hf_on_normalized_inputs(l2, state):
    """The head-major oracle: HF's rule on its own inputs, ours on l2-normalized head-major ones."""
    x = hf_inputs(1, 9, 3, 3, 8, 8, kda=False, l2=l2, state=state, seed=3)
    want_out, want_state = hf_call(torch_recurrent_gated_delta_rule, x, l2)
    head_major = [t.transpose(1, 2) for t in ours_inputs(x, l2)]
    y, final = gated_delta_reference(*head_major, x["initial_state"])
    check("gated_delta_reference vs hf recurrent: out", y.transpose(1, 2), want_out)
    check("gated_delta_reference vs hf recurrent: state", final, want_state)


@L2
@STATE
def test_kda_matches_hf_kimi_recurrent(l2, state):
    x = hf_inputs(2, 13, 3, 3, 16, 12, kda=True, l2=l2, state=state, seed=4)
    want_out, want_state = hf_call(recurrent_kimi_delta_attention, x, l2)
    for name, ref in (("recurrent", recurrent_delta_rule_reference),
                      ("chunk", lambda *a, **kw: chunk_gdn_reference(*a, chunk_size=4, **kw))):
        out, final = ref(*ours_inputs(x, l2), initial_state=x["initial_state"])
        check(f"kda {name} vs hf kimi recurrent: out", out, want_out)
        check(f"kda {name} vs hf kimi recurrent: state", final, want_state)


@L2
@STATE
def test_kda_matches_hf_kimi_chunk(l2, state):
    x = hf_inputs(2, 21, 3, 3, 16, 12, kda=True, l2=l2, state=state, seed=5)
    want_out, want_state = hf_call(chunk_kimi_delta_attention, x, l2, chunk_size=8)
    out, final = chunk_gdn_reference(*ours_inputs(x, l2), chunk_size=8,
                                     initial_state=x["initial_state"])
    check("kda chunk vs hf kimi chunk: out", out, want_out)
    check("kda chunk vs hf kimi chunk: state", final, want_state)


@pytest.mark.parametrize("seq_len", [1, 4])
@pytest.mark.parametrize("activation", [None, "silu"])
def test_conv_update_matches_hf(seq_len, activation):
    gen = torch.Generator().manual_seed(seq_len)
    x = torch.randn(2, 6, seq_len, generator=gen)
    state = torch.randn(2, 6, 4, generator=gen)
    weight, bias = torch.randn(6, 4, generator=gen), torch.randn(6, generator=gen)
    out, new_state = causal_conv1d_update_reference(x, state, weight, bias, activation)
    hf_state = state.clone()  # HF writes the new state in place
    want = hf_causal_conv1d_update(x, hf_state, weight, bias, activation)
    check("conv update vs hf: out", out, want)
    assert torch.equal(new_state, hf_state)


def test_report_worst_errors():
    """Runs last in this file: prints the worst relative error of every comparison (-s)."""
    for name, err in sorted(WORST.items()):
        print(f"{name:<50} {err:.3g}")
    assert all(err <= LIMIT for err in WORST.values())
