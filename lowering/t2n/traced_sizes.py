"""Symbolic sizes that torch.jit.trace (torch-to-nnef's tracer) records as computations.

A program exported with a dynamic dimension (``torch.export`` with ``dynamic_shapes``) computes
its shape-dependent sizes from ``aten.sym_size.int`` nodes: ``view(x, [1, s, -1, 16])``,
``arange(s)``, ``slice(x, 2, -s)``. Run under torch.jit.trace, ``sym_size.int`` returns a plain
int and every size becomes a literal of the trace-time length: the NNEF then refuses other
lengths or, worse, computes wrongly at them. ``Tensor.size(d)`` instead returns a traced value
under torch.jit.trace, and the Python-level ops that take sizes (``Tensor.reshape``,
``Tensor.expand``, ``torch.arange``, indexing) record it as a computation, which torch-to-nnef
turns into tract shape arithmetic over the NNEF symbol.

:func:`trace_sizes` respells a program that way; an op taking a symbolic size that it does not
know is refused (ExportRefused naming the node), never frozen.
"""

from __future__ import annotations

import operator
from typing import Any, Optional

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from gdn_fx.errors import ExportRefused

aten = torch.ops.aten


def dynamic_slice(x: torch.Tensor, dim: int, start: Optional[Any] = None,
                  end: Optional[Any] = None, step: int = 1) -> torch.Tensor:
    """``aten.slice.Tensor`` spelled as indexing, so that traced start/end stay traced."""
    index = (slice(None),) * (dim % x.dim()) + (slice(start, end, step),)
    return x[index]


def traced_arange(*args, **kwargs) -> torch.Tensor:
    kwargs.pop("pin_memory", None)  # torch.arange's Python signature has no pin_memory
    return torch.arange(*args, **kwargs)


# aten overloads that take sizes -> (fx op, target) recording traced sizes.
SPELLINGS = {
    aten.view.default: ("call_method", "reshape"),
    aten.reshape.default: ("call_method", "reshape"),
    aten._unsafe_view.default: ("call_method", "reshape"),
    aten.expand.default: ("call_method", "expand"),
    aten.arange.default: ("call_function", traced_arange),
    aten.arange.start: ("call_function", traced_arange),
    aten.arange.start_step: ("call_function", traced_arange),
    aten.slice.Tensor: ("call_function", dynamic_slice),
    aten.new_empty.default: ("call_method", "new_empty"),
    aten.new_zeros.default: ("call_method", "new_zeros"),
    aten.new_ones.default: ("call_method", "new_ones"),
    aten.zeros.default: ("call_function", torch.zeros),
    aten.ones.default: ("call_function", torch.ones),
    aten.full.default: ("call_function", torch.full),
    # A tensor plus a size (positions ``arange(S) + P``, a mask's ``arange(S) + offset``):
    # under jit.trace a traced size is a 0-d tensor, so the Python operator records it.
    aten.add.Tensor: ("call_function", operator.add),
    aten.sub.Tensor: ("call_function", operator.sub),
    aten.mul.Tensor: ("call_function", operator.mul),
}
# Size arithmetic torch.export leaves as Python calls; they work on traced sizes as they are.
SIZE_ARITHMETIC = {operator.add, operator.sub, operator.mul, operator.neg, operator.floordiv,
                   operator.mod}
# Runtime checks of the dynamic dims' ranges; tract gets ``tract_assert S >= 1`` instead.
ASSERTIONS = {aten._assert_scalar.default, aten.sym_constrain_range_for_size.default}


def _reads(node: fx.Node) -> list[fx.Node]:
    found: list[fx.Node] = []
    fx.node.map_arg((node.args, node.kwargs), found.append)
    return found


def _drop_assertions(graph: fx.Graph) -> None:
    """Erase the range assertions and the size comparisons only they read."""
    todo = [n for n in graph.nodes if n.target in ASSERTIONS]
    while todo:
        node = todo.pop()
        if node.users or node.op != "call_function":
            continue
        sources = _reads(node)
        graph.erase_node(node)
        todo.extend(sources)


def _respell(node: fx.Node, sizes: set) -> None:
    """Give ``node``, which reads a symbolic size, a spelling jit.trace records dynamically."""
    if node.target is aten.sym_size.int:
        node.op, node.target = "call_method", "size"
    elif node.target in SIZE_ARITHMETIC:
        pass
    elif node.target in SPELLINGS:
        node.op, node.target = SPELLINGS[node.target]
    else:
        names = ", ".join(n.name for n in _reads(node) if n in sizes)
        raise ExportRefused(
            f"node '{node.name}' ({node.target}) takes the symbolic size(s) {names}: gdn-fx "
            "knows no spelling of it that torch.jit.trace records dynamically, and a frozen "
            "size would be wrong at other lengths")


def refuse_data_dependent_sizes(graph: fx.Graph) -> None:
    """Raise ExportRefused at the first node whose output size depends on tensor VALUES.

    torch.export gives such sizes unbacked symbols (``u0``): a boolean-mask index
    ``x[:, mask]``, ``nonzero``, ``.item()`` used as a size. NNEF shapes can follow input
    shapes only, and torch-to-nnef would freeze (or misread) them.
    """
    for node in graph.nodes:
        val = node.meta.get("val")
        unbacked = free_unbacked_symbols(val) if val is not None else set()
        if unbacked:
            shown = list(val.shape) if isinstance(val, torch.Tensor) else val
            raise ExportRefused(
                f"node '{node.name}' ({node.target}) has the data-dependent size {shown} "
                f"(symbol(s) {', '.join(sorted(map(str, unbacked)))}: it depends on tensor "
                "values, e.g. a boolean-mask index x[:, mask]); NNEF shapes can follow input "
                "shapes only")


def trace_sizes(module: fx.GraphModule) -> int:
    """Respell, in place, every node computing or reading a symbolic size (see module doc).

    Refuses data-dependent sizes first (refuse_data_dependent_sizes). Returns how many nodes
    were respelled (0 for a program with static shapes).
    """
    graph = module.graph
    refuse_data_dependent_sizes(graph)
    _drop_assertions(graph)
    sizes: set = set()
    count = 0
    for node in graph.nodes:
        symbolic = isinstance(node.meta.get("val"), torch.SymInt)
        if node.op != "call_function" or not (symbolic or any(r in sizes for r in _reads(node))):
            continue
        if symbolic:
            sizes.add(node)
        _respell(node, sizes)
        count += 1
    if count:
        module.recompile()
    return count
