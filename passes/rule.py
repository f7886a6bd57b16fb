"""The interface every rule has: plan fusions on a graph it only reads.

A rule finds its regions, proves what it can without running the program, and returns one
:class:`~gdn_fx.passes.rebuild.Fusion` per region it would rewrite and a near-miss per region
it would not. ``collapse`` (passes/__init__.py) does the rest in one place for every rule:
it rebuilds the graph with the fusions, runs translation validation on the result, drops the
fusions that fail with a near-miss each, and hands the rebuilt graph to the next rule.

To add a rule: a class with ``name`` (its own, distinct), ``op`` (the op it fuses into: the
key of ``CollapseResult.counts`` and of its near-misses), ``plan`` and ``unrolled`` (what it
would fuse, found by structure alone, for ``find_unrolled``), listed in
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
    op: str

    def plan(self, graph: fx.Graph) -> tuple[list[Fusion], list[Miss]]:
        ...

    def unrolled(self, graph: fx.Graph) -> list[str]:
        """What in ``graph`` is frozen at the traced length that this rule is about."""
        ...
