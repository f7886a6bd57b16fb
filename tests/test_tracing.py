"""gdn_fx.tracing: gdn-fx's own torch.export calls record no per-node stack traces (a cost
no reader of them pays back), leave torch's switch as they found it, and a program the user
exported with stack traces keeps them on the nodes a fusion makes."""

import torch
import torch.fx

import gdn_fx
from gdn_fx import tracing
from spellings import SPELLING


class Small(torch.nn.Module):
    def forward(self, x):
        return (x * 2).sin() + 1


def _traces(program) -> list:
    return [n.meta.get("stack_trace") for n in program.graph.nodes if n.op == "call_function"]


def test_own_exports_have_no_stack_traces_and_restore_the_switch(monkeypatch):
    x = torch.randn(3)
    for before in (False, True):
        monkeypatch.setattr(torch.fx.config, "do_not_emit_stack_traces", before)
        program = tracing.export(Small(), (x,))
        assert not any(_traces(program))
        assert torch.fx.config.do_not_emit_stack_traces is before
        torch.testing.assert_close(program.module()(x), Small()(x))
    monkeypatch.setattr(torch.fx.config, "do_not_emit_stack_traces", False)
    assert all(_traces(torch.export.export(Small(), (x,))))  # torch's default: recorded


def test_the_switch_is_restored_when_the_export_fails(monkeypatch):
    monkeypatch.setattr(torch.fx.config, "do_not_emit_stack_traces", False)

    class Fails(torch.nn.Module):
        def forward(self, x):
            raise ValueError("no")

    try:
        tracing.export(Fails(), (torch.randn(2),))
    except Exception:  # noqa: BLE001 (torch wraps it)
        pass
    assert torch.fx.config.do_not_emit_stack_traces is False


def test_a_fused_node_keeps_the_stack_trace_of_the_user_export(monkeypatch):
    monkeypatch.setattr(torch.fx.config, "do_not_emit_stack_traces", False)
    spelling = SPELLING[next(iter(SPELLING))]
    program = torch.export.export(spelling.module(), spelling.inputs())
    result = gdn_fx.collapse(program)
    fused = [n for n in result.program.graph.nodes
             if n.op == "call_function" and "gdn_fx" in str(n.target)]
    assert fused and all(n.meta.get("stack_trace") for n in fused)
