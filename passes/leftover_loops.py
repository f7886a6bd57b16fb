"""Loops no rule fused: a near-miss for each, so that zero fusions explain themselves.

An unrolled loop over time reads its sources one position at a time: ``select(x, axis, t)``
for t = 0..T-1, the same T and axis for q, k, v, the gate and beta. Whatever the body computes,
that structure survives tracing; when it is still in the graph after every rule has run, no
rule recognized the loop, and the user is told where it is instead of getting silence.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import fx

from gdn_fx.passes.program import shape
from gdn_fx.passes.result import Miss

ATEN = torch.ops.aten
MIN_SOURCES = 3  # a delta-rule step reads at least q, k, v (and usually g, beta) per step


def leftover_loops(graph: fx.Graph, rule: str) -> list[Miss]:
    """One near-miss per group of tensors read position by position along one axis."""
    reads = defaultdict(dict)  # (source, axis) -> {t: select node}
    for node in graph.nodes:
        if node.target is ATEN.select.int and isinstance(node.args[0], fx.Node):
            dims = shape(node.args[0])
            index = node.args[2]
            if dims and isinstance(index, int) and index >= 0:
                reads[(node.args[0], node.args[1] % len(dims))][index] = node
    loops = defaultdict(list)  # (axis, T) -> sources read at every position 0..T-1
    for (source, axis), at in reads.items():
        length = shape(source)[axis]
        if length >= 2 and sorted(at) == list(range(length)):
            loops[(axis, length)].append((source, at[0]))
    return [_miss(rule, axis, length, found) for (axis, length), found in loops.items()
            if len(found) >= MIN_SOURCES]


def _miss(rule: str, axis: int, length: int, found: list) -> Miss:
    names = ", ".join(source.name for source, _ in found[:6])
    first = found[0][1]
    return Miss(rule, f"a {length}-step loop reads {names} one position at a time along axis "
                      f"{axis}, but no rule recognized its step; it is left unrolled",
                node=first.name)
