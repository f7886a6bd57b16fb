"""A symbolic sequence axis: fused nodes traced at S=4 must run right at S = 1, 2, 7, 33, 100.

And the other side of it: a graph that still holds an unrolled recurrence is refused, since
tract would be silently wrong past the traced length (docs/FACTS.md, "torch-to-nnef 0.24.12").
"""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3_5.modeling_qwen3_5 import torch_recurrent_gated_delta_rule as hf_rule

import gdn_fx.passes
from gdn_fx import tract_check
from gdn_fx.errors import ExportRefused
from gdn_fx.export import export_nnef
from lowering_programs import (SCAN_NAMES, ConvModule, ScanModule, conv_inputs,
                                   scan_inputs)

LENGTHS = (1, 2, 7, 33, 100)
SEQ_AXIS = {name: {1: "S"} for name in SCAN_NAMES[:5]}
NATIVE_OR_SCAN = {"forbid": ["matmul_step", "chunked_unrolled", "split", "chunked", "matmul"]}


def _check_lengths(written, module, make_inputs) -> list[str]:
    runnable = tract_check.load(written)
    report = []
    for s in LENGTHS:
        args = make_inputs(s)
        comparison = tract_check.compare(runnable, module(*args), args)
        report.append(f"S={s}: {comparison}")
        assert comparison.ok, report[-1]
    return report


@pytest.mark.parametrize("candidate", ["native", "scan"])
def test_scan_symbolic_sequence(candidate, tmp_path):
    module = ScanModule(16 ** -0.5)
    shape = dict(b=2, hk=2, groups=2, dk=16, dv=16)
    program = torch.export.export(module, scan_inputs(s=4, **shape))
    written = export_nnef(program, tmp_path / "dyn.nnef", dynamic_axes=SEQ_AXIS,
                          choose={"*": candidate})
    assert tract_check.read_decisions(written) == {"gated_delta_scan": candidate}
    assert "tract_symbol S" in tract_check.nnef_text(written)
    print(_check_lengths(written, module, lambda s: scan_inputs(s=s, seed=s, **shape)))


@pytest.mark.parametrize("candidate", ["native", "portable", "depthwise"])
def test_conv_symbolic_sequence(candidate, tmp_path):
    module = ConvModule(6, 4, False, "silu")
    program = torch.export.export(module, conv_inputs(2, 6, 4, 4))
    written = export_nnef(program, tmp_path / "dyn.nnef", dynamic_axes={"x": {2: "S"}},
                          choose={"*": candidate})
    assert tract_check.read_decisions(written) == {"causal_conv1d_update": candidate}
    print(_check_lengths(written, module, lambda s: conv_inputs(2, 6, s, 4, seed=s)))


def test_program_exported_with_a_symbolic_dim(tmp_path):
    """torch.export with Dim("S"): the node's S is symbolic, so the one-step operator of
    0.23.5 is ruled out while 0.23.9's serves (the matmul-form candidates forbidden); the
    export runs at every length. By default a symbolic S takes the chunks then the steps
    ("split")."""
    from gdn_fx.lowering import plan_lowering

    seq = torch.export.Dim("S", min=1, max=4096)
    module = ScanModule(16 ** -0.5)
    program = torch.export.export(module, scan_inputs(s=4, groups=2),
                                  dynamic_shapes=({1: seq},) * 5 + (None,))
    assert [d.candidate for d in plan_lowering(program)] == ["split"]
    old = plan_lowering(program, tract_version="0.23.5", choose=NATIVE_OR_SCAN)[0]
    assert old.candidate == "scan" and "symbolic S" in dict(old.rejected)["native"]
    written = export_nnef(program, tmp_path / "dim.nnef", dynamic_axes=SEQ_AXIS,
                          choose=NATIVE_OR_SCAN)
    assert tract_check.read_decisions(written) == {"gated_delta_scan": "native"}
    print(_check_lengths(written, module, lambda s: scan_inputs(s=s, groups=2, seed=s)))


class HfLoop(torch.nn.Module):
    """transformers' own recurrent rule: torch.export unrolls its loop at the traced S."""

    def forward(self, q, k, v, g, beta, s0):
        return hf_rule(q, k, v, g, beta, s0, True, True)


def _hf_inputs(s: int) -> tuple:
    return scan_inputs(b=1, s=s, hk=2, dk=16, dv=16, seed=s)


def _needs(name: str) -> None:
    if not hasattr(gdn_fx.passes, name):
        pytest.skip(f"gdn_fx.passes.{name} is not written yet (passes package)")


@pytest.mark.parametrize("candidate", ["native", "scan"])
def test_collapsed_hf_loop_symbolic_sequence(candidate, tmp_path):
    """End to end: HF's loop traced at S=4, collapsed, exported with a symbolic S; the oracle
    is HF's own function run eagerly at each length."""
    _needs("collapse")
    result = gdn_fx.passes.collapse(torch.export.export(HfLoop(), _hf_inputs(4)))
    assert result.counts.get("gated_delta_scan") == 1, result
    written = export_nnef(result.program, tmp_path / "hf.nnef", dynamic_axes=SEQ_AXIS,
                          choose={"*": candidate})
    assert list(tract_check.read_decisions(written).values()) == [candidate]
    print(_check_lengths(written, HfLoop(), _hf_inputs))


def test_unrolled_loop_with_symbolic_axis_is_refused(tmp_path):
    _needs("find_unrolled")
    program = torch.export.export(HfLoop(), _hf_inputs(4))
    with pytest.raises(ExportRefused, match="unrolled"):
        export_nnef(program, tmp_path / "bad.nnef", dynamic_axes=SEQ_AXIS)
    assert not (tmp_path / "bad.nnef").exists()


def test_refusal_hook_reads_find_unrolled(tmp_path, monkeypatch):
    """The hook itself, independent of the detector: any finding refuses dynamic axes only."""
    calls = []

    def fake_find(gm):
        calls.append(gm)
        return ["a fake unrolled loop"]

    monkeypatch.setattr(gdn_fx.passes, "find_unrolled", fake_find, raising=False)
    program = torch.export.export(ScanModule(0.3), scan_inputs())
    with pytest.raises(ExportRefused, match="a fake unrolled loop"):
        export_nnef(program, tmp_path / "a.nnef", dynamic_axes=SEQ_AXIS)
    assert calls and calls[0] is program  # find_unrolled takes the program (passes/__init__.py)
    export_nnef(program, tmp_path / "b.nnef")  # static shapes: nothing to refuse
    assert len(calls) == 1
