"""The interface every rule has: plan fusions on a graph it only reads.

A rule finds its regions, proves what it can without running the program, and returns one
:class:`~gdn_fx.passes.rebuild.Fusion` per region it would rewrite and a near-miss per region
it would not. ``collapse`` (passes/__init__.py) does the rest in one place for every rule:
it rebuilds the graph with the fusions, runs translation validation on the result, drops the
fusions that fail with a near-miss each, and hands the rebuilt graph to the next rule.

To add a rule: a class with ``name`` (the op it fuses into) and ``plan``, listed in
``passes/__init__.RULES``.
"""

from __future__ import annotations

from typing import Protocol

from torch import fx

from gdn_fx.passes.rebuild import Fusion
from gdn_fx.passes.result import Miss


class Rule(Protocol):
    """``plan(graph) -> (fusions, near-misses)``; ``graph`` is never modified."""

    name: str

    def plan(self, graph: fx.Graph) -> tuple[list[Fusion], list[Miss]]:
        ...
