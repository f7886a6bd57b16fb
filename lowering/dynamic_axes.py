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

from gdn_fx.errors import ExportRefused
from gdn_fx.lowering.facts import static_dim


class _Recording(fx.Interpreter):
    """An interpreter that remembers the node it is running (to name the one that fails)."""

    current: Optional[fx.Node] = None

    def run_node(self, n: fx.Node):
        self.current = n
        return super().run_node(n)


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
            raise ValueError(f"dynamic_axes names input {name!r}; the inputs are {list(names)}")
        node = placeholders[name]
        for axis, symbol in _axes(spec).items():
            extent = static_dim(node.meta["val"].shape[axis])
            if extent is not None:
                frozen.setdefault(str(symbol), []).append((name, node, axis, extent))
    return frozen


def _hint(dim) -> int:
    extent = static_dim(dim)
    return extent if extent is not None else int(dim.node.hint)


def _fails_at(module: fx.GraphModule, extents: dict) -> Optional[tuple[str, str]]:
    """(node name, error) of the first node that fails with the placeholders' given axes
    changed (``{(placeholder, axis): extent}``), run on fake tensors; None if all run."""
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
        return where, str(error).strip().splitlines()[0]
    return None


def refuse_frozen_axes(module: fx.GraphModule, dynamic_axes: Optional[Mapping],
                       names: Sequence[str]) -> None:
    """Raise ExportRefused when a requested dynamic axis is one the program can not follow.

    ``names`` are the NNEF input names, in placeholder order. Each requested axis the program
    holds static is tried at two other extents on fake tensors (all axes sharing a symbol
    change together); the first node that fails is named. Unrolled recurrences, which do not
    fail but ignore the extra steps, are export_nnef's find_unrolled check.
    """
    for symbol, axes in _frozen_extents(module, dynamic_axes or {}, names).items():
        for grow in (1, axes[0][3] + 3):
            changed = {(node, axis): extent + grow for _, node, axis, extent in axes}
            failure = _fails_at(module, changed)
            if failure is not None:
                name, _, axis, extent = axes[0]
                raise ExportRefused(
                    f"dynamic axis {axis} ('{symbol}') of input '{name}': the program was "
                    f"exported with it fixed at {extent} and does not compute at "
                    f"{extent + grow} (node '{failure[0]}': {failure[1]}). Export it with a "
                    "dynamic dim instead (torch.export dynamic_shapes over a reified model; "
                    "gdn_fx.hf.export_nnef_dynamic for transformers models)")
