"""The rewrite shared by every gated-delta rule: one ``gated_delta_scan`` node for a region.

Whatever the region looked like (an unrolled loop, a chunked computation), it reads sources
that ``operands.scan_operands`` traced back to model-level tensors, it produces the outputs
of all T steps in one tensor (head-major [B, H, T, Dv] or time-major [B, T, H, Dv]) and a final
state. The fused node is emitted where the region began and stands in for both.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import fx

from gdn_fx.passes.operands import Operands
from gdn_fx.passes.program import add_node, dtype, shape
from gdn_fx.passes.rebuild import Fusion
from gdn_fx.passes.result import NoMatch

SCAN = torch.ops.gdn_fx.gated_delta_scan.default
ATEN = torch.ops.aten


@dataclass
class ScanRegion:
    """What a rule found: the nodes it replaces and the two values it stands in for."""

    nodes: set  # computed nodes of the region (not copied into the new graph)
    value: fx.Node  # all T outputs
    axis: int  # time axis of ``value``: 2 head-major, 1 time-major
    final: Optional[fx.Node]  # the final state (None when the region does not produce it)
    meta_source: fx.Node  # a node whose stack trace / module path the new nodes inherit
    erase: list = field(default_factory=list)  # side-effect nodes (in-place writes) to drop


def check_dtypes(region: ScanRegion, ops: Operands) -> None:
    """The op's dtypes must be the region's: out promoted from (q, state), state kept."""
    state_in = ops.nodes["state"]
    if region.final is not None and dtype(state_in) != dtype(region.final):
        raise NoMatch(f"the region turns a {dtype(state_in)} state into {dtype(region.final)}",
                      node=region.final)
    out_dtype = torch.promote_types(dtype(ops.nodes["q"]), dtype(state_in))
    if out_dtype != dtype(region.value):
        raise NoMatch(f"the region's output is {dtype(region.value)}, the op would give "
                      f"{out_dtype}", node=region.value)


def plan_scan(region: ScanRegion, ops: Operands, order: dict, mode) -> Fusion:
    """The fused node, emitted where the region began, standing in for its output and state."""
    replace = {region.value: "value"}
    if region.final is not None:
        replace[region.final] = "final"
    if region.axis == 2:  # readers that transpose the head-major value back read `out`
        replace.update({u: "out" for u in region.value.users if _swaps_axes_1_2(u)})

    def emit(graph: fx.Graph, env) -> dict:
        args = [_time_major(graph, env(ops.nodes[name]), name in ops.to_time_major, mode)
                for name in ("q", "k", "v", "g", "beta")]
        fused = add_node(graph, SCAN, (*args, env(ops.nodes["state"])),
                         dict(scale=ops.scale, qk_l2norm=ops.qk_l2norm), mode)
        out = add_node(graph, operator.getitem, (fused, 0), mode=mode)
        final = add_node(graph, operator.getitem, (fused, 1), mode=mode)
        value = out if region.axis == 1 else _permute(graph, out, mode)
        _copy_meta(region.meta_source, (fused, out, final, value))
        return {"out": out, "final": final, "value": value}

    drop = region.nodes | set(region.erase)
    # Emit at the region's first node that follows every operand (HF's chunked rule makes its
    # zero state halfway through the region).
    ready = max(order[n] for n in ops.nodes.values())
    anchor = min((n for n in drop if order[n] > ready), key=order.__getitem__)
    return Fusion(anchor, emit, set(ops.nodes.values()), replace, drop)


def _swaps_axes_1_2(node: fx.Node) -> bool:
    if node.target is ATEN.transpose.int:
        return sorted(d % 4 for d in node.args[1:3]) == [1, 2]
    return node.target is ATEN.permute.default and [d % 4 for d in node.args[1]] == [0, 2, 1, 3]


def _time_major(graph: fx.Graph, node: fx.Node, needed: bool, mode) -> fx.Node:
    return _permute(graph, node, mode) if needed else node


def _permute(graph: fx.Graph, node: fx.Node, mode) -> fx.Node:
    """Swap axes 1 and 2 (head-major <-> time-major) with a core-aten permute."""
    rank = len(shape(node))
    return add_node(graph, ATEN.permute.default, (node, [0, 2, 1] + list(range(3, rank))),
                    mode=mode)


def _copy_meta(source: fx.Node, nodes) -> None:
    for node in nodes:
        for key in ("nn_module_stack", "stack_trace", "source_fn_stack"):
            if key in source.meta:
                node.meta[key] = source.meta[key]
