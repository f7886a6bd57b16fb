"""The rewrite shared by every gated-delta rule: one ``gated_delta_scan`` node for a region.

Whatever the region looked like (an unrolled loop, a chunked computation), it reads sources
that ``operands.scan_operands`` traced back to model-level tensors, it produces the outputs
of all T steps in one tensor (head-major [B, H, T, Dv] or time-major [B, T, H, Dv]) and a final
state. The fused node is emitted where the region began and stands in for both.
"""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass, field
from typing import Optional

import sympy
import torch
from torch import fx
from torch.utils._sympy.functions import FloorDiv

from gdn_fx import ops  # noqa: F401  (registers torch.ops.gdn_fx.*, used below)
from gdn_fx.passes.operands import Operands
from gdn_fx.errors import GdnFxError
from gdn_fx.passes.program import (ATEN, add_node, copy_meta, dtype, in_mode, no_guards,
                                   same_sizes, shape, size_expr, val)
from gdn_fx.passes.rebuild import Fusion
from gdn_fx.passes.result import NoMatch

NAME = "gated_delta_scan"  # the op every GDN rule fuses into: counts and near-misses say so
SCAN = torch.ops.gdn_fx.gated_delta_scan.default
LINEAR_NAME = "gated_linear_scan"  # a loop without the delta erase (layouts.Layout.delta)
LINEAR = torch.ops.gdn_fx.gated_linear_scan.default


def op_of(ops: Operands) -> tuple:
    """(op, its name, its operands' names, its keyword arguments) for these operands."""
    if ops.delta:
        return SCAN, NAME, ("q", "k", "v", "g", "beta", "state"), \
            dict(scale=ops.scale, qk_l2norm=ops.qk_l2norm)
    return LINEAR, LINEAR_NAME, ("q", "k", "v", "g", "state"), dict(scale=ops.scale)


@dataclass
class ScanRegion:
    """What a rule found: the nodes it replaces and the two values it stands in for."""

    nodes: set  # computed nodes of the region (not copied into the new graph)
    value: fx.Node  # all T outputs: step outputs [B, H, Dv] stacked along ``axis``
    axis: int  # time axis of ``value`` (2 head-major, 1 time-major, or any other)
    final: Optional[fx.Node]  # the final state (None when the region does not produce it)
    meta_source: fx.Node  # a node whose stack trace / module path the new nodes inherit
    erase: list = field(default_factory=list)  # side-effect nodes (in-place writes) to drop
    # (aten op, extra args) steps from the op's [B, T, H, Dv] output / [B, H, Dk, Dv] state to
    # the region's value / final state (layouts.py); None: the output's time axis is moved to
    # ``axis`` by one permute, and the state is the op's.
    out_steps: Optional[list] = None
    final_steps: list = field(default_factory=list)


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
    """The fused node, emitted where the region began, standing in for its output and state.

    Raises NoMatch when the operands break the op's contract or the op's output, moved to the
    region's time axis, would not have the region's shape.
    """
    _check_contract(region, ops, mode)
    _check_sizes(region, ops)
    replace = {region.value: "value"}
    if region.final is not None:
        replace[region.final] = "final"
    if region.axis == 2:  # readers that transpose the head-major value back read `out`
        replace.update({u: "out" for u in region.value.users if _swaps_axes_1_2(u)})

    def emit(graph: fx.Graph, env) -> dict:
        with no_guards(mode):
            return _emit(graph, env, region, ops, mode)

    drop = region.nodes | set(region.erase)
    # Emit at the region's first node that follows every operand (HF's chunked rule makes its
    # zero state halfway through the region).
    ready = max(order[n] for n in ops.nodes.values())
    anchor = min((n for n in drop if order[n] > ready), key=order.__getitem__)
    return Fusion(region.meta_source.name, anchor, emit, set(ops.nodes.values()), replace, drop,
                  op=op_of(ops)[1])


def _emit(graph: fx.Graph, env, region: ScanRegion, ops: Operands, mode) -> dict:
    sizes = _size_args(graph, env, ops, mode)
    scan, _, names, kwargs = op_of(ops)
    args = [_time_major(graph, _apply(graph, env(ops.nodes[name]), ops.adapters.get(name),
                                      mode, sizes), name in ops.to_time_major, mode)
            for name in names]
    fused = add_node(graph, scan, tuple(args), kwargs, mode)
    out = add_node(graph, operator.getitem, (fused, 0), mode=mode)
    final = _apply(graph, add_node(graph, operator.getitem, (fused, 1), mode=mode),
                   region.final_steps, mode, sizes)
    value = _time_to(graph, out, region.axis, mode) if region.out_steps is None else \
        _apply(graph, out, region.out_steps, mode, sizes)
    copy_meta(region.meta_source, (fused, out, final, value))
    return {"out": out, "final": final, "value": value}


def _check_contract(region: ScanRegion, ops: Operands, mode) -> None:
    """Run the op's contract check and fake kernel on the operands' metadata, so that a
    region the op cannot take (a gate broadcast over heads, ...) is a near-miss, not an error."""
    fakes = {}
    scan, _, names, kwargs = op_of(ops)
    for name in names:
        value = in_mode(val(ops.nodes[name]), mode)
        if not isinstance(value, torch.Tensor):
            raise NoMatch(f"operand '{name}' ({ops.nodes[name]}) is not a tensor")
        fakes[name] = value
    with mode, no_guards(mode):
        try:
            for name, steps in ops.adapters.items():
                for op, extra in steps:
                    fakes[name] = op(fakes[name], *extra)
            for name in ops.to_time_major:
                fakes[name] = fakes[name].transpose(1, 2)
            out, _ = scan(*[fakes[name] for name in names], **kwargs)
            for op, extra in region.out_steps or ():
                out = op(out, *extra)
        except (GdnFxError, RuntimeError) as err:
            raise NoMatch(f"the op cannot take these operands: {err}", node=region.meta_source)
    dims = list(out.shape)
    if region.out_steps is None:
        dims.insert(region.axis, dims.pop(1))
    if not same_sizes(dims, shape(region.value)):
        raise NoMatch(f"the op's output, time on axis {region.axis}, would be {dims}; the "
                      f"region's is {list(shape(region.value))}", node=region.value)


def _apply(graph: fx.Graph, node: fx.Node, steps: Optional[list], mode, sizes=None) -> fx.Node:
    """``node`` through layout steps: each (aten op, extra args) adds one node; ``sizes``
    spells the symbolic sizes among the arguments as nodes (``_size_args``)."""
    for op, extra in steps or ():
        node = add_node(graph, op, (node, *(sizes(extra) if sizes else extra)), mode=mode)
    return node


# --- symbolic sizes in the layout's reshapes -----------------------------------------------

ARITHMETIC = {sympy.Mul: operator.mul, sympy.Add: operator.add, FloorDiv: operator.floordiv}


def _symbol_sources(ops: Operands) -> dict:
    """size expression -> (operand name, axis, divisor): an operand whose size on that axis is
    the expression (divisor 1), or, for a symbol, ``divisor`` times it (merged batch and heads
    [c * B, ..]: B is that size // c)."""
    found = {}
    for name, node in ops.nodes.items():
        for axis, size in enumerate(shape(node) or ()):
            expr = size_expr(size) if isinstance(size, torch.SymInt) else None
            if expr is None:
                continue
            found.setdefault(expr, (name, axis, 1))
            factor, rest = expr.as_coeff_Mul()
            if rest.is_Symbol and factor.is_Integer and factor > 1:
                found.setdefault(rest, (name, axis, int(factor)))
    return found


def _steps_sizes(region: ScanRegion, ops: Operands) -> list:
    """The symbolic sizes among the arguments of every layout step of the fusion."""
    steps = [s for name in ops.adapters for s in ops.adapters[name]]
    steps += list(region.out_steps or ()) + list(region.final_steps)
    found = []
    for _, extra in steps:
        found += [x for x in _flat(extra) if isinstance(x, torch.SymInt)]
    return found


def _flat(value) -> list:
    if isinstance(value, (list, tuple)):
        return [x for v in value for x in _flat(v)]
    return [value]


def _check_sizes(region: ScanRegion, ops: Operands) -> None:
    """Every symbolic size the layout's reshapes need can be spelled: each symbol is a size
    of an operand, combined by products, sums and floor divisions."""
    where = _symbol_sources(ops)
    for size in _steps_sizes(region, ops):
        expr = size_expr(size)
        if not _spellable(expr, where):
            raise NoMatch(f"the operands' reshapes need the size {expr}, which is not made of "
                          "sizes of the operands", node=region.meta_source)


def _spellable(expr, where: dict) -> bool:
    if expr.is_Integer or expr in where:
        return True
    return expr.func in ARITHMETIC and all(_spellable(a, where) for a in expr.args)


def _size_args(graph: fx.Graph, env, ops: Operands, mode):
    """A map of layout-step arguments to the new graph's: each symbolic size spelled as nodes
    (``sym_size`` of an operand that has its symbol, operator nodes for the arithmetic)."""
    where, made = _symbol_sources(ops), {}

    def size(expr):
        if expr.is_Integer:
            return int(expr)
        if expr not in made:
            if expr in where:
                name, axis, divisor = where[expr]
                made[expr] = add_node(graph, ATEN.sym_size.int, (env(ops.nodes[name]), axis),
                                      mode=mode)
                if divisor != 1:
                    made[expr] = add_node(graph, operator.floordiv, (made[expr], divisor),
                                          mode=mode)
            else:
                parts = [size(a) for a in expr.args]
                made[expr] = functools.reduce(
                    lambda a, b: add_node(graph, ARITHMETIC[expr.func], (a, b), mode=mode), parts)
        return made[expr]

    def mapped(value):
        if isinstance(value, torch.SymInt):
            return size(size_expr(value))
        if isinstance(value, (list, tuple)):
            return type(value)(mapped(v) for v in value)
        return value

    return mapped


def _time_to(graph: fx.Graph, out: fx.Node, axis: int, mode) -> fx.Node:
    """The op's time-major [B, T, H, Dv] output with its time axis moved to ``axis``."""
    if axis == 1:
        return out
    return add_node(graph, ATEN.permute.default, (out, time_order(axis)), mode=mode)


def time_order(axis: int) -> list:
    """The permutation that moves the time axis of the op's [B, T, H, Dv] output to ``axis``."""
    order = [0, 2, 3]
    order.insert(axis, 1)
    return order


def _swaps_axes_1_2(node: fx.Node) -> bool:
    if node.target is ATEN.transpose.int:
        return sorted(d % 4 for d in node.args[1:3]) == [1, 2]
    return node.target is ATEN.permute.default and [d % 4 for d in node.args[1]] == [0, 2, 1, 3]


def _time_major(graph: fx.Graph, node: fx.Node, needed: bool, mode) -> fx.Node:
    """``node`` with axes 1 and 2 swapped (head-major -> time-major) when ``needed``."""
    if not needed:
        return node
    axes = [0, 2, 1] + list(range(3, len(shape(node))))
    return add_node(graph, ATEN.permute.default, (node, axes), mode=mode)
