"""Refuse dynamic axes a program can not follow (``refuse_frozen_axes``).

A program exported at a fixed extent of an axis (e.g. a prefill collapsed at S = 8) holds that
extent as literals in its reshapes, slices and aranges; torch-to-nnef can not make them
symbolic, and tract then refuses the NNEF at load ("reshape: 64*S should be equal to 128*S")
or, where nothing checks, computes wrongly at other extents. An axis the program already holds
symbolic (exported with torch.export dynamic shapes) is vouched for by torch.export.
"""

from __future__ import annotations

from typing import Mapping, Optional, Sequence

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

from gdn_fx.errors import ExportRefused, UsageError
from gdn_fx.lowering.node_facts import static_dim

ATEN = torch.ops.aten


class _Recording(fx.Interpreter):
    """An interpreter that remembers the node it is running (to name the one that fails) and
    the shape of every tensor it read or made."""

    current: Optional[fx.Node] = None

    def __init__(self, module: fx.GraphModule):
        super().__init__(module)
        self.shapes: dict = {}

    def run_node(self, n: fx.Node):
        self.current = n
        result = super().run_node(n)
        if isinstance(result, torch.Tensor):
            self.shapes[n] = tuple(result.shape)
        return result


def _axes(spec) -> dict:
    """``{axis: symbol}`` from a dynamic_axes entry (a mapping, or a list of axes)."""
    return dict(spec) if isinstance(spec, Mapping) else {a: f"axis{a}" for a in spec}


def _frozen_extents(module: fx.GraphModule, dynamic_axes: Mapping,
                    names: Sequence[str]) -> dict[str, list[tuple[str, fx.Node, int, int]]]:
    """{symbol: [(name, placeholder, axis, traced extent)]} for requested axes the program holds
    static (symbolic ones were exported dynamic: torch.export vouches for them)."""
    placeholders = dict(zip(names, (n for n in module.graph.nodes if n.op == "placeholder")))
    frozen: dict[str, list] = {}
    for name, spec in dynamic_axes.items():
        if name not in placeholders:
            raise UsageError(f"dynamic_axes names input {name!r}; the inputs are {list(names)}")
        node = placeholders[name]
        for axis, symbol in _axes(spec).items():
            extent = static_dim(node.meta["val"].shape[axis])
            if extent is not None:
                frozen.setdefault(str(symbol), []).append((name, node, axis, extent))
    return frozen


def frozen_axes(module: fx.GraphModule, dynamic_axes: Optional[Mapping],
                names: Sequence[str]) -> list[tuple[str, int]]:
    """(input name, axis) of each requested dynamic axis the program holds static."""
    return [(name, axis) for axes in _frozen_extents(module, dynamic_axes or {}, names).values()
            for name, _, axis, _ in axes]


def _hint(dim) -> int:
    extent = static_dim(dim)
    return extent if extent is not None else int(dim.node.hint)


def _run_at(module: fx.GraphModule, extents: dict) -> tuple[Optional[tuple[str, str]], dict]:
    """Run on fake tensors with the placeholders' given axes changed (``{(placeholder, axis):
    extent}``): ((node name, error) of the first node that fails, or None; node shapes)."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    inputs = []
    for node in (n for n in module.graph.nodes if n.op == "placeholder"):
        shape = [_hint(d) for d in node.meta["val"].shape]
        for (where, axis), extent in extents.items():
            if where is node:
                shape[axis] = extent
        inputs.append(mode.from_tensor(torch.empty(shape, dtype=node.meta["val"].dtype)))
    runner = _Recording(module)
    try:
        with mode:
            runner.run(*inputs)
    except Exception as error:  # noqa: BLE001 (any failure means "does not compute there")
        where = runner.current.name if runner.current is not None else "?"
        return (where, str(error).strip().splitlines()[0]), runner.shapes
    return None, runner.shapes


END = 2 ** 62  # slice ends at or beyond this mean "to the end"
POSITIONAL = (ATEN.select.int, ATEN.select_scatter.default, ATEN.slice.Tensor,
              ATEN.slice_scatter.default, ATEN.unbind.int, ATEN.split.Tensor,
              ATEN.split_with_sizes.default, ATEN.narrow.default)


def _literal_position(node: fx.Node) -> Optional[tuple[int, str]]:
    """(axis, what) when ``node`` reads or writes its input at a position counted from the
    start along an axis (a select at t >= 0, a slice ending at a fixed index, an unbind or
    split into a fixed number of pieces), else None."""
    target, args = node.target, node.args
    value = node.args[0].meta.get("val")
    if target not in POSITIONAL or not isinstance(value, torch.Tensor):
        return None
    rank = value.dim()
    if target in (ATEN.select.int, ATEN.select_scatter.default):
        dim, index = (args[1], args[2]) if target is ATEN.select.int else (args[2], args[3])
        if isinstance(index, int) and index >= 0:
            return dim % rank, f"position {index}"
    elif target in (ATEN.slice.Tensor, ATEN.slice_scatter.default):
        rest = list(args[1:]) if target is ATEN.slice.Tensor else list(args[2:])
        dim, _, end = (rest + [0, None, None])[:3]
        if isinstance(end, int) and 0 <= end < END:
            return dim % rank, f"a slice ending at {end}"
    elif target in (ATEN.unbind.int, ATEN.split.Tensor, ATEN.split_with_sizes.default,
                    ATEN.narrow.default):
        dim = args[1] if target in (ATEN.unbind.int, ATEN.narrow.default) else (
            args[2] if len(args) > 2 else 0)
        return dim % rank, "a fixed number of pieces"
    return None


def _positional_reads(module: fx.GraphModule, grown: dict) -> Optional[tuple[fx.Node, str]]:
    """The first node that reads an axis whose extent follows the dynamic axis at a position
    counted from its start: an unrolled loop (recognized or not) walks such an axis with
    literal indices and would silently ignore the positions it never names."""
    for node in module.graph.nodes:
        if node.op != "call_function" or not node.args or not isinstance(node.args[0], fx.Node):
            continue
        found = _literal_position(node)
        source = node.args[0]
        if found is None or source not in grown or "val" not in source.meta:
            continue
        axis, what = found
        traced = [_hint(d) for d in source.meta["val"].shape]
        if grown[source][axis] != traced[axis]:
            return node, f"{what} of axis {axis} of {source.name} (traced extent {traced[axis]})"
    return None


def refuse_frozen_axes(module: fx.GraphModule, dynamic_axes: Optional[Mapping],
                       names: Sequence[str]) -> None:
    """Raise ExportRefused when a requested dynamic axis is one the program can not follow.

    ``names`` are the NNEF input names, in placeholder order. Each requested axis the program
    holds static is tried at two other extents on fake tensors (all axes sharing a symbol
    change together); the first node that fails is named. Unrolled recurrences, which do not
    fail but ignore the extra steps, are refused by structure: a node that reads an axis
    following the dynamic one at a position counted from its start (whatever computes it).
    """
    for symbol, axes in _frozen_extents(module, dynamic_axes or {}, names).items():
        for grow in (1, axes[0][3] + 3):
            changed = {(node, axis): extent + grow for _, node, axis, extent in axes}
            failure, shapes = _run_at(module, changed)
            positional = _positional_reads(module, shapes) if failure is None else None
            if positional is not None:
                name, _, axis, extent = axes[0]
                raise ExportRefused(
                    f"dynamic axis {axis} ('{symbol}') of input '{name}': node "
                    f"'{positional[0].name}' reads {positional[1]}, a position fixed at the "
                    "traced length (an unrolled loop?): at other lengths the NNEF would "
                    "ignore the positions it never names. Collapse the loop "
                    "(gdn_fx.collapse) or export with a dynamic dim")
            if failure is not None:
                name, _, axis, extent = axes[0]
                raise ExportRefused(
                    f"dynamic axis {axis} ('{symbol}') of input '{name}': the program was "
                    f"exported with it fixed at {extent} and does not compute at "
                    f"{extent + grow} (node '{failure[0]}': {failure[1]}). Export it with a "
                    "dynamic dim instead (torch.export dynamic_shapes over a reified model; "
                    "gdn_fx.hf.export_nnef_dynamic for transformers models)")
