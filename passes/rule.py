"""What every rule is: plan fusions on a graph it only reads.

A rule finds its regions, proves what it can without running the program, and returns one
:class:`~gdn_fx.passes.rebuild.Fusion` per region it would rewrite and a near-miss per region
it would not. ``collapse`` (passes/__init__.py) does the rest in one place for every rule:
it rebuilds the graph with the fusions, runs translation validation on the result, drops the
fusions that fail with a near-miss each, and hands the rebuilt graph to the next rule.

To add a rule: its ``plan`` and ``unrolled`` functions in a module of its own, and one
``Rule`` entry in ``passes/__init__.RULES``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from torch import fx

from gdn_fx.passes.rebuild import Fusion
from gdn_fx.passes.result import Miss


@dataclass(frozen=True)
class Rule:
    """``name``: the rule's own (distinct); ``op``: the op it fuses into (the key of
    ``CollapseResult.counts`` and of its near-misses); ``plan(graph) -> (fusions,
    near-misses)``, ``graph`` never modified; ``unrolled(graph)``: what in ``graph`` is frozen
    at the traced length that this rule is about, found by structure alone (for
    ``find_unrolled``)."""

    name: str
    op: str
    plan: Callable[[fx.Graph], tuple[list[Fusion], list[Miss]]]
    unrolled: Callable[[fx.Graph], list[str]]
