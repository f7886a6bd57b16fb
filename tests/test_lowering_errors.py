"""Bad input to export_nnef: every error names the node and the operand (or what is wrong)."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.fx as fx

from gdn_fx.errors import (DTypeError, GdnFxError, LoweringUnsupported, ShapeError,
                           UnsupportedProgram, UsageError)
from gdn_fx.export import export_nnef
from gdn_fx.lowering.options import TRACT_VERSION, ExportOptions
from lowering_programs import CONV, SCAN, SCAN_NAMES, ConvModule, ScanModule, scan_inputs


def _fused_graph(target, values: dict, literals=(), kwargs=None, meta=True) -> fx.GraphModule:
    """A hand-built graph around one fused node (torch.export would refuse bad operands)."""
    graph = fx.Graph()
    nodes = []
    for name, value in values.items():
        node = graph.placeholder(name)
        if meta:
            node.meta["val"] = value
        nodes.append(node)
    fused = graph.call_function(target, tuple(nodes) + tuple(literals), kwargs or {})
    outs = [graph.call_function(operator.getitem, (fused, i)) for i in range(2)]
    graph.output(tuple(outs))
    return fx.GraphModule(torch.nn.Module(), graph)


def _scan_graph(meta=True, **overrides) -> fx.GraphModule:
    values = dict(zip(SCAN_NAMES, scan_inputs()))
    values.update(overrides)
    return _fused_graph(SCAN.default, values, kwargs=dict(scale=0.25, qk_l2norm=True), meta=meta)


@pytest.mark.parametrize("operand, value, error", [
    ("v", torch.randn(2, 4, 2, 16), ShapeError),  # batch 2 against q's batch 1
    ("g", torch.randn(1, 4, 2, 5), ShapeError),
    ("s0", torch.randn(1, 2, 16, 8), ShapeError),
    ("beta", torch.ones(1, 4, 2, dtype=torch.int64), DTypeError),
])
def test_bad_scan_operand_names_node_and_operand(operand, value, error, tmp_path):
    contract_name = "initial_state" if operand == "s0" else operand
    with pytest.raises(error, match=rf"node 'gated_delta_scan.*'{contract_name}'"):
        export_nnef(_scan_graph(**{operand: value}), tmp_path / "bad.nnef")


def test_bad_conv_operand_names_node_and_operand(tmp_path):
    values = dict(x=torch.randn(2, 6, 4), state=torch.randn(2, 6, 3), w=torch.randn(6, 4))
    gm = _fused_graph(CONV.default, values, literals=(None, "silu"))
    with pytest.raises(ShapeError, match=r"node 'causal_conv1d_update.*'conv_state'"):
        export_nnef(gm, tmp_path / "bad.nnef")


def test_activation_outside_the_contract(tmp_path):
    values = dict(x=torch.randn(2, 6, 4), state=torch.randn(2, 6, 4), w=torch.randn(6, 4))
    gm = _fused_graph(CONV.default, values, literals=(None, "gelu"))
    with pytest.raises(LoweringUnsupported, match=r"node 'causal_conv1d_update.*gelu"):
        export_nnef(gm, tmp_path / "bad.nnef")


def test_missing_meta_names_the_operand(tmp_path):
    with pytest.raises(UnsupportedProgram, match="has no meta"):
        export_nnef(_scan_graph(meta=False), tmp_path / "bad.nnef")


def test_bfloat16_is_refused_naming_a_node(tmp_path):
    args = scan_inputs(dtype=torch.bfloat16, state_dtype=torch.bfloat16)
    program = torch.export.export(ScanModule(0.3), args)
    with pytest.raises(DTypeError, match=r"node 'q'.*bfloat16"):
        export_nnef(program, tmp_path / "bf16.nnef")


def test_forced_candidate_that_cannot_serve(tmp_path):
    args = scan_inputs(kda=True)
    program = torch.export.export(ScanModule(0.25), args)
    with pytest.raises(LoweringUnsupported, match=r"node 'gated_delta_scan'.*KDA"):
        export_nnef(program, tmp_path / "kda.nnef", choose={"*": "native"})


def test_choose_typo_is_refused(tmp_path):
    program = torch.export.export(ScanModule(0.25), scan_inputs())
    with pytest.raises(ValueError, match="gated_delta_scn"):
        export_nnef(program, tmp_path / "m.nnef", choose={"gated_delta_scn": "scan"})


@pytest.mark.parametrize("fields, message", [
    (dict(weigths="f16"), r"unknown export option weigths; the options are weights"),
    (dict(weights="bf16"), r"weights='bf16' is not a weight format; use one of f32, f16, q4_0"),
    (dict(runtime="metal"), r"metal"),
])
def test_bad_export_option_is_one_usage_error(fields, message, tmp_path):
    program = torch.export.export(ScanModule(0.25), scan_inputs())
    with pytest.raises(UsageError, match=message):
        export_nnef(program, tmp_path / "m.nnef", **fields)
    assert not (tmp_path / "m.nnef").exists()  # refused before anything is written


def test_options_record_and_keywords_agree():
    options = ExportOptions(weights="f16")
    assert ExportOptions.of(options, runtime="cpu") == ExportOptions.of(weights="f16")
    assert ExportOptions.of(options).weights == "f16"
    assert ExportOptions().tract_version == TRACT_VERSION


def test_not_a_program(tmp_path):
    with pytest.raises(UnsupportedProgram, match="ConvModule"):
        export_nnef(ConvModule(4, 4, False, "silu"), tmp_path / "m.nnef")


def test_bad_path_suffix(tmp_path):
    program = torch.export.export(ScanModule(0.25), scan_inputs())
    with pytest.raises(ValueError, match=r"\.nnef"):
        export_nnef(program, tmp_path / "m.onnx")


def test_errors_share_the_root():
    assert all(issubclass(e, GdnFxError) for e in
               (ShapeError, DTypeError, LoweringUnsupported, UnsupportedProgram))
