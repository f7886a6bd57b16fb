"""Two roads to the same graph: reify-then-export and export-then-collapse.

Both must give the same fused nodes, in the same order, with the same operands: the same op
and flags, and operands that are the same values (same op reading the same model inputs,
same shape and dtype), up to copies/aliases that neither road's numerics depend on.
"""

from __future__ import annotations

import pytest
import torch
from torch import fx

import gdn_fx
from gdn_fx.diff import local_signature
from gdn_fx.hf import DecodeStep, reify, tiny_model

pytestmark = pytest.mark.slow  # whole-model exports (make test-fast skips them)

ALIASES = {torch.ops.aten.clone.default, torch.ops.aten.alias.default,
           torch.ops.aten.to.device, torch.ops.aten.to.dtype, torch.ops.aten._to_copy.default}


def _value(node):
    """Skip copies and same-dtype conversions: they do not change the value."""
    while isinstance(node, fx.Node) and node.target in ALIASES and \
            node.meta["val"].dtype == node.args[0].meta["val"].dtype:
        node = node.args[0]
    return node


def _inputs_reached(node: fx.Node) -> frozenset:
    seen, todo, found = set(), [node], set()
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        if current.op == "placeholder":
            found.add(current.target)
        todo.extend(current.all_input_nodes)
    return frozenset(found)


def _describe(arg):
    if not isinstance(arg, fx.Node):
        return arg
    value = _value(arg)
    val = value.meta["val"]
    return (local_signature(value), tuple(val.shape), val.dtype, _inputs_reached(value))


def fused_summary(program) -> list:
    nodes = [n for n in program.graph_module.graph.nodes
             if n.op == "call_function" and str(n.target).startswith("gdn_fx.")]
    return [(str(n.target), tuple(sorted(n.kwargs.items())), [_describe(a) for a in n.args])
            for n in nodes]


@pytest.mark.parametrize("family", ["qwen3_5", "kimi_linear", "lfm2"])
def test_reify_and_collapse_give_the_same_fused_nodes(family):
    model = tiny_model(family)
    step = DecodeStep(model)
    args = step.example_inputs(seq_len=1)
    collapsed = gdn_fx.collapse(torch.export.export(step, args, strict=False)).program
    with reify(model):
        reified = torch.export.export(step, args, strict=False)
    left, right = fused_summary(collapsed), fused_summary(reified)
    assert len(left) == sum(step.expected_fusions.values()) > 0
    for (op_a, kw_a, args_a), (op_b, kw_b, args_b) in zip(left, right):
        assert (op_a, len(args_a)) == (op_b, len(args_b))
        assert dict(kw_a) == pytest.approx(dict(kw_b))
        assert args_a == args_b, f"{op_a}: operands differ"
    assert len(left) == len(right)
    diff = gdn_fx.graph_diff(collapsed, reified)
    assert diff.op_delta().get("gdn_fx.gated_delta_scan.default") is None
    assert diff.op_delta().get("gdn_fx.causal_conv1d_update.default") is None
