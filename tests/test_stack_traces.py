"""A program the user exported with stack traces keeps them on the nodes a fusion makes (the
suite's own exports record none: tests/conftest.py switches them off for speed)."""

import torch
import torch.fx

import gdn_fx
from spellings import SPELLING


def test_a_fused_node_keeps_the_stack_trace_of_the_user_export(monkeypatch):
    monkeypatch.setattr(torch.fx.config, "do_not_emit_stack_traces", False)
    spelling = SPELLING[next(iter(SPELLING))]
    program = torch.export.export(spelling.module(), spelling.inputs())
    assert all(n.meta.get("stack_trace") for n in program.graph.nodes
               if n.op == "call_function")
    result = gdn_fx.collapse(program)
    fused = [n for n in result.program.graph.nodes
             if n.op == "call_function" and "gdn_fx" in str(n.target)]
    assert fused and all(n.meta.get("stack_trace") for n in fused)
