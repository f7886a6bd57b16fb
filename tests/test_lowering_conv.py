"""causal_conv1d_update exported to NNEF, loaded AND run by tract, vs torch eager and HF.

Weights are module parameters with static shapes: exactly the setting in which tract 0.23.9
miscompiles a depthwise ``conv`` whose constant filter sits behind an unsqueeze (docs/FACTS.md,
"tract 0.23.9: traps").
"""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3_5.modeling_qwen3_5 import causal_conv1d_update as hf_conv_update

from gdn_fx import tract_check
from gdn_fx.export import export_nnef
from lowering_programs import (NATIVE_CONV, ConvModule, conv_inputs, export_checked,
                                   tolerance_for)

F16, F32 = torch.float16, torch.float32

# name: (channels, K, bias, activation, dtype, S, batch, forced, expected); unforced cases take
# the table's default: "depthwise" for S > 1, "portable" at S = 1 (native is last).
CASES = {
    "silu_f32_native": (6, 4, False, "silu", F32, 4, 2, "native", "native"),
    "silu_f16_native": (6, 4, False, "silu", F16, 1, 1, "native", "native"),
    "silu_k2_native": (5, 2, False, "silu", F32, 3, 2, "native", "native"),
    "silu_f32_depthwise": (6, 4, False, "silu", F32, 4, 2, None, "depthwise"),
    "silu_f16_depthwise": (6, 4, False, "silu", F16, 3, 2, None, "depthwise"),
    "silu_f32_portable": (6, 4, False, "silu", F32, 4, 2, "portable", "portable"),
    "silu_f16_portable": (6, 4, False, "silu", F16, 3, 2, "portable", "portable"),
    "silu_f16_portable_step": (6, 4, False, "silu", F16, 1, 1, None, "portable"),
    "bias_silu": (6, 4, True, "silu", F32, 4, 2, None, "depthwise"),
    "bias_silu_portable": (6, 4, True, "silu", F32, 4, 2, "portable", "portable"),
    "bias_no_activation": (6, 3, True, None, F32, 5, 2, None, "depthwise"),
    "bias_no_activation_portable": (6, 3, True, None, F32, 5, 2, "portable", "portable"),
    "no_activation": (7, 4, False, None, F32, 1, 1, None, "portable"),
    "no_activation_depthwise": (7, 4, False, None, F32, 2, 1, None, "depthwise"),
    "depthwise_step": (7, 4, False, None, F32, 1, 1, "depthwise", "depthwise"),
    "wide_kernel": (4, 6, False, "silu", F32, 2, 2, None, "depthwise"),
    "wide_kernel_portable": (4, 6, False, "silu", F32, 2, 2, "portable", "portable"),
    "kernel_one": (4, 1, True, "silu", F32, 3, 1, None, "depthwise"),
    "kernel_one_portable": (4, 1, True, "silu", F32, 3, 1, "portable", "portable"),
    "long_many_channels": (96, 4, False, "silu", F32, 64, 1, None, "depthwise"),
}


@pytest.mark.parametrize("case", CASES)
def test_conv_runs_in_tract(case, tmp_path):
    channels, kernel, bias, act, dtype, s, b, forced, expected = CASES[case]
    module = ConvModule(channels, kernel, bias, act, dtype)
    args = conv_inputs(b, channels, s, kernel, dtype)
    choose = {"causal_conv1d_update": forced} if forced else None
    decisions, comparison, text = export_checked(module, args, tmp_path / f"{case}.nnef",
                                                 tolerance_for(*args), choose=choose)
    print(f"{case}: emitted {decisions}; {comparison}")
    assert list(decisions.values()) == [expected]
    assert (NATIVE_CONV in text) == (expected == "native")
    assert (" conv(" in text) == (expected == "depthwise")
    assert comparison.ok, comparison


@pytest.mark.parametrize("forced", ["native", "portable", "depthwise"])
def test_conv_matches_transformers(forced, tmp_path):
    """Independent oracle: HF's own causal_conv1d_update (which mutates its state)."""
    channels, kernel = 8, 4
    module = ConvModule(channels, kernel, False, "silu")
    x, state = conv_inputs(2, channels, 3, kernel, seed=5)
    written = export_nnef(torch.export.export(module, (x, state)), tmp_path / "c.nnef",
                          choose={"*": forced})
    got_out, got_state = tract_check.run(written, (x, state))
    hf_state = state.clone()
    want = hf_conv_update(x, hf_state, module.weight.detach(), None, "silu")
    assert tract_check.relative_error(got_out, want) < 1e-5
    assert tract_check.relative_error(got_state, hf_state) == 0.0


def test_mixed_dtypes_follow_the_contract(tmp_path):
    """f32 x/state with an f16 weight: arithmetic in f16, out in x's dtype, state in its own."""
    module = ConvModule(6, 4, True, "silu", F16)
    args = conv_inputs(2, 6, 4, 4, F32)
    decisions, comparison, _ = export_checked(module, args, tmp_path / "mixed.nnef", 1e-3)
    assert list(decisions.values()) == ["depthwise"]
    assert comparison.ok, comparison


def test_a_new_candidate_is_one_table_entry(tmp_path, monkeypatch):
    """docs/contributing.md's checklist for a lowering candidate, followed with a toy one:
    a check and an emitter (here conv_portable's, under a new name), one Candidate line at
    the head of the table, its name in the CUDA order (check_orders, as at import). The
    export takes it and tract computes what eager does."""
    from gdn_fx.lowering import conv_portable, table

    toy = table.Candidate("toy_adds", conv_portable.check, conv_portable.emit)
    entries = {**table.TABLE, "causal_conv1d_update": (toy, *table.TABLE["causal_conv1d_update"])}
    order = {**table.CUDA_ORDER,
             "causal_conv1d_update": ("toy_adds", *table.CUDA_ORDER["causal_conv1d_update"])}
    table.check_orders(entries, order)
    monkeypatch.setattr(table, "TABLE", entries)
    monkeypatch.setattr(table, "CUDA_ORDER", order)
    module = ConvModule(8, 4, True, "silu")
    args = conv_inputs(1, 8, 5, 4)
    decisions, comparison, _ = export_checked(module, args, tmp_path / "toy.nnef",
                                              tolerance_for(*args))
    assert list(decisions.values()) == ["toy_adds"]
    assert comparison.ok, comparison
