"""Apply fusions by building a new graph from the nodes that survive them.

An unrolled loop is most of its graph (30 nodes a step, 15k at T = 512), so copying the graph
and then deleting the loop would cost more than finding it. Rules therefore plan fusions on the
original graph, read-only, and ``rebuild`` copies only what is still needed: each fusion emits
its new nodes where its region began, stands in for the region's results, and the region's
nodes and whatever only they used are left behind.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from torch import fx

from gdn_fx.errors import InternalError
from gdn_fx.passes.program import ASSERT_META, is_pure, reachable


Emit = Callable[[fx.Graph, Callable[[fx.Node], fx.Node]], dict]


@dataclass
class Fusion:
    """A planned rewrite of one region of a graph.

    ``emit(graph, env)`` adds the new nodes to ``graph`` (``env`` maps an original node to its
    copy; it may only read ``inputs``) and returns them by key; ``replace`` maps original nodes
    to those keys; ``drop`` holds the region's nodes, which are not copied; ``key`` names the
    region (a node of it) in near-misses and validation; ``hoist`` lists pure nodes after the
    anchor that the new nodes read (operands computed late): they are copied at the anchor,
    in that order, before ``emit`` runs, instead of where they stand.
    """

    key: str
    anchor: fx.Node
    emit: Emit
    inputs: set = field(default_factory=set)
    replace: dict = field(default_factory=dict)
    drop: set = field(default_factory=set)
    hoist: list = field(default_factory=list)
    op: str = ""  # the op it makes where not its rule's (a gated linear loop: counts)


def rebuild(graph: fx.Graph, fusions: list[Fusion]) -> fx.Graph:
    """A new graph: ``graph`` with every fusion applied; ``graph`` itself is not modified."""
    gone = _left_behind(graph, fusions)
    at = {}
    for fusion in fusions:
        at.setdefault(fusion.anchor, []).append(fusion)
    hoisted = {n for fusion in fusions for n in fusion.hoist}
    new, env = fx.Graph(), {}
    for node in graph.nodes:
        for fusion in at.get(node, ()):
            for early in fusion.hoist:  # two fusions may move the same operand: once
                if early not in env:
                    env[early] = new.node_copy(early, env.__getitem__)
            made = fusion.emit(new, env.__getitem__)
            env.update({old: made[key] for old, key in fusion.replace.items()})
        if node not in gone and node not in hoisted:
            env[node] = new.node_copy(node, env.__getitem__)
    return new


def _left_behind(graph: fx.Graph, fusions: list[Fusion]) -> set:
    """Dropped and replaced nodes, and the pure nodes only they (or metadata asserts) read."""
    gone, needed = set(), set()
    for fusion in fusions:
        overlap = gone & (fusion.drop | set(fusion.replace))
        if overlap:  # two rules (or one rule twice) claimed the same region: a bug
            raise InternalError(f"fusions overlap at {sorted(n.name for n in overlap)[:5]}")
        gone |= fusion.drop | set(fusion.replace)
        needed |= fusion.inputs | set(fusion.hoist)
    for node in reversed(graph.nodes):
        if node in gone or node in needed or node.op != "call_function" \
                or node.target is ASSERT_META:
            continue
        readers = [u for u in node.users if u.target is not ASSERT_META]
        if readers and all(u in gone for u in readers) and is_pure(node):
            gone.add(node)
    for node in graph.nodes:  # dead code hanging off the region goes with it
        if node not in gone and any(i in gone for i in node.all_input_nodes) and is_dead(node):
            gone.add(node)
    gone |= {n for n in graph.nodes if n.target is ASSERT_META and n.args[0] in gone}
    return gone


def is_dead(node: fx.Node) -> bool:
    """A pure node whose value, directly or through other pure nodes, reaches nothing."""
    return all(map(is_pure, reachable([node], lambda n: n.users if is_pure(n) else ())))
