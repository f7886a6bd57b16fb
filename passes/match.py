"""Lockstep matching of a traced pattern graph against a program graph, with reasons.

A pattern is a plain torch function traced through torch.export; matching walks the pattern
from one anchor output back to its placeholders, comparing op targets and argument structure.
Structural differences stop the match (with a reason naming the node). Literal differences do
not stop it: they are recorded as defects, so a region that is right in shape but wrong in a
constant (a sum over the wrong dim) still explains itself. Dims are compared after
normalization by rank, so ``sum(x, [2])`` on a rank-4 tensor equals ``sum(x, [-2])``.

Select indices are bindings, not literals: every ``select`` in one match must read the same
index (the timestep), which the caller checks against the loop.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import fx

from gdn_fx.errors import InternalError
from gdn_fx.passes.program import is_pure, reachable, shape
from gdn_fx.passes.result import NoMatch

ATEN = torch.ops.aten
COMMUTATIVE = {ATEN.add.Tensor, ATEN.mul.Tensor}
SELECT = ATEN.select.int


def op_name(target: Any) -> str:
    """A short printable name for a node target (``aten.sum.dim_IntList``)."""
    return str(target).replace("torch.ops.", "") if not isinstance(target, str) else target


@dataclass
class Pattern:
    """A traced pattern: its graph, named outputs and the output the match starts from."""

    name: str
    graph: fx.Graph
    outputs: dict  # output name -> pattern node
    anchor: str  # the output from which every pattern node is reachable backwards
    select_index_is_time: bool = False  # a step pattern: every select reads the same index t

    def targets(self) -> set:
        """The op overloads the pattern calls."""
        return {n.target for n in self.graph.nodes if n.op == "call_function"}


@dataclass
class Match:
    """Pattern-node -> graph-node mapping, placeholder bindings, literal defects."""

    pattern: Pattern
    nodes: dict = field(default_factory=dict)  # pattern node -> graph node
    index: Optional[int] = None  # the time index all selects read
    defects: list = field(default_factory=list)  # (reason, graph node)
    bindings: dict = field(default_factory=dict)  # placeholder name -> graph node
    missing: list = field(default_factory=list)  # pattern nodes found nowhere (see match_at)

    def bound(self, name: str) -> Optional[fx.Node]:
        """The graph node bound to the pattern placeholder ``name`` (None if not bound)."""
        return self.bindings.get(name)

    def out(self, name: str) -> fx.Node:
        """The graph node matched to the pattern output ``name``."""
        return self.nodes[self.pattern.outputs[name]]

    def computed(self) -> list[fx.Node]:
        """Matched graph nodes that the pattern computes (everything but its inputs)."""
        return [n for p, n in self.nodes.items() if p.op != "placeholder"]

    def inner(self) -> list[fx.Node]:
        """Matched graph nodes that are neither placeholders nor outputs."""
        outs = set(self.pattern.outputs.values())
        return [n for p, n in self.nodes.items() if p.op != "placeholder" and p not in outs]


def _rank_for_dims(node: fx.Node) -> Optional[int]:
    """The rank a node's dim arguments are taken modulo (unsqueeze counts its new axis)."""
    ref = node if node.target is ATEN.unsqueeze.default else node.args[0]
    dims = shape(ref)
    return len(dims) if dims is not None else None


def _normalize_dims(value: Any, rank: Optional[int]) -> Any:
    if rank is None or rank == 0:
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return value % rank
    if isinstance(value, (list, tuple)) and all(isinstance(v, int) for v in value):
        return sorted(v % rank for v in value)
    return value


_NO_DEFAULT = object()


@functools.cache
def _schema_args(target: Any) -> tuple:
    """(name, default) per schema argument; reading schemas is slow, so once per op."""
    return tuple((a.name, a.default_value if a.has_default_value() else _NO_DEFAULT)
                 for a in target._schema.arguments)


def _spelled_args(node: fx.Node) -> dict:
    """The arguments as written, by schema name where the schema names them."""
    names = _schema_names(node.target)
    out = {names[i] if i < len(names) else str(i): a for i, a in enumerate(node.args)}
    out.update(node.kwargs)
    return out


@functools.cache
def _schema_names(target: Any) -> tuple:
    schema = getattr(target, "_schema", None)
    return tuple(a.name for a in schema.arguments) if schema is not None else ()


def _all_args(node: fx.Node) -> dict:
    """Every argument by schema name, defaults filled in (exports differ in what they spell)."""
    if not hasattr(node.target, "_schema"):
        return {**{str(i): a for i, a in enumerate(node.args)}, **node.kwargs}
    out = {}
    for i, (name, default) in enumerate(_schema_args(node.target)):
        if i < len(node.args):
            out[name] = node.args[i]
        elif name in node.kwargs:
            out[name] = node.kwargs[name]
        elif default is not _NO_DEFAULT:
            out[name] = default
    return out


class _Walk:
    """One attempt to match ``pattern`` with its anchor at a graph node.

    The walk is a recursive descent written as generators: each step yields the sub-walks it
    needs and ``_drive`` runs them on an explicit stack, so a template with paths of ~1,500
    nodes needs no deeper Python recursion (NoMatch travels up the stack as an exception).
    """

    def __init__(self, pattern: Pattern):
        self.m = Match(pattern)

    def node(self, p: fx.Node, n: Any) -> None:
        """Match pattern node ``p`` at graph node ``n``; raises NoMatch."""
        _drive(self._node(p, n))

    def _node(self, p: fx.Node, n: Any):
        """None when ``p`` is settled at once, else the walk of its arguments (a generator);
        only nodes with arguments to walk cost a generator."""
        if p.op == "placeholder":
            return self._bind(p, n)
        if not isinstance(n, fx.Node) or n.op != "call_function":
            raise NoMatch(f"expected {op_name(p.target)}, found {n!r}", node=n)
        if p in self.m.nodes:
            if self.m.nodes[p] is not n:
                raise NoMatch(f"{op_name(p.target)} is read from two different nodes", node=n)
            return None
        if n in self.m.nodes.values():
            raise NoMatch(f"node is used for two pattern nodes ({op_name(p.target)})", node=n)
        if n.target != p.target:
            raise NoMatch(f"expected {op_name(p.target)}, found {op_name(n.target)}", node=n)
        self.m.nodes[p] = n
        return self._args(p, n)

    def _bind(self, p: fx.Node, n: Any) -> None:
        old = self.m.nodes.get(p)
        if old is not None and old is not n:
            raise NoMatch(f"operand '{p.name}' is read from {old.name} and {getattr(n, 'name', n)}",
                          node=n)
        self.m.nodes[p] = n
        self.m.bindings[p.target] = n

    def _args(self, p: fx.Node, n: fx.Node):
        if len(p.args) == len(n.args) and p.kwargs.keys() == n.kwargs.keys():
            p_args, n_args = _spelled_args(p), _spelled_args(n)  # the common, cheap case
        else:
            p_args, n_args = _all_args(p), _all_args(n)
        if p_args.keys() != n_args.keys():
            raise NoMatch(f"{op_name(n.target)} takes other arguments than the pattern", node=n)
        for name in [k for k in p_args if k not in ("self", "other")]:
            yield self._arg(p, n, name, p_args[name], n_args[name])
        if p.target in COMMUTATIVE:
            yield self._commutative(p, n, p_args, n_args)
            return
        for name in [k for k in p_args if k in ("self", "other")]:
            yield self._arg(p, n, name, p_args[name], n_args[name])

    def _commutative(self, p: fx.Node, n: fx.Node, p_args: dict, n_args: dict):
        """Operands in the written order, else swapped (``a * b`` is ``b * a``)."""
        saved = _snapshot(self.m)
        try:
            yield self._arg(p, n, "self", p_args["self"], n_args["self"])
            yield self._arg(p, n, "other", p_args["other"], n_args["other"])
        except NoMatch as first:
            _restore(self.m, saved)
            try:
                yield self._arg(p, n, "other", p_args["self"], n_args["other"])
                yield self._arg(p, n, "self", p_args["other"], n_args["self"])
            except NoMatch:
                raise first from None

    def _arg(self, p: fx.Node, n: fx.Node, name: str, pa: Any, na: Any):
        """Like ``_node``: None when settled (a literal), else a walk to finish."""
        if isinstance(pa, fx.Node):
            return self._node(pa, na)
        if isinstance(na, fx.Node):
            raise NoMatch(f"{op_name(n.target)} {name} is a tensor, expected {pa!r}", node=n)
        if isinstance(pa, (list, tuple)) and any(isinstance(x, fx.Node) for x in pa):
            if not isinstance(na, (list, tuple)) or len(pa) != len(na):
                raise NoMatch(f"{op_name(n.target)} {name} has another length", node=n)
            return self._items(p, n, name, pa, na)
        self._literal(p, n, name, pa, na)
        return None

    def _items(self, p: fx.Node, n: fx.Node, name: str, pa: Any, na: Any):
        for x, y in zip(pa, na):
            yield self._arg(p, n, name, x, y)

    def _literal(self, p: fx.Node, n: fx.Node, name: str, pa: Any, na: Any) -> None:
        if n.target is SELECT and name == "index" and self.m.pattern.select_index_is_time:
            if self.m.index is None:
                self.m.index = na
            elif self.m.index != na:
                self.m.defects.append((f"selects time index {na}, the step reads {self.m.index}",
                                       n))
            return
        if pa == na:
            return
        if name == "dim":
            pa, na = _normalize_dims(pa, _rank_for_dims(p)), _normalize_dims(na, _rank_for_dims(n))
        if pa != na and not _same_float(pa, na):
            self.m.defects.append((f"{op_name(n.target)} {name}={na!r}, expected {pa!r}", n))


def _drive(walk) -> None:
    """Run a generator-coded walk: each yielded value is a sub-walk (a generator, or None when
    the step finished without one) to finish before the yielding walk resumes; a NoMatch
    raised by a sub-walk is thrown into the walk that asked for it."""
    if walk is None or not hasattr(walk, "send"):
        return
    stack, error = [walk], None
    while stack:
        try:
            sub = stack[-1].throw(error) if error is not None else next(stack[-1])
        except StopIteration:
            stack.pop()
            error = None
            continue
        except NoMatch as raised:
            stack.pop()
            if not stack:
                raise
            error = raised
            continue
        error = None
        if sub is not None and hasattr(sub, "send"):
            stack.append(sub)


def _same_float(a: Any, b: Any) -> bool:
    return isinstance(a, float) and isinstance(b, float) and abs(a - b) <= 1e-12 * max(1, abs(a))


def match_at(pattern: Pattern, anchor: fx.Node, complete: bool = False) -> Match:
    """Match ``pattern`` with its anchor output at ``anchor``; raises NoMatch on structure.

    The walk goes backwards from the anchor. Pattern nodes it cannot reach (in-place writes,
    other outputs) are an error unless ``complete``: then they are searched forwards, among the
    users of what already matched, and those still missing are listed in ``Match.missing``.
    The returned Match may carry literal defects; it is a full structural match otherwise.
    A NoMatch raised here carries the partial match as ``partial``.
    """
    walk = _Walk(pattern)
    try:
        walk.node(pattern.outputs[pattern.anchor], anchor)
    except NoMatch as err:
        err.partial = walk.m
        raise
    missing = [p for p in pattern.graph.nodes if p.op == "call_function" and p not in walk.m.nodes]
    if missing and not complete:  # unreachable from the anchor: a pattern bug, not a graph one
        raise InternalError(f"pattern {pattern.name}: {missing} unreachable from the anchor")
    walk.m.missing = _complete_forward(walk, missing)
    return walk.m


def _complete_forward(walk: _Walk, missing: list) -> list:
    """Match the pattern nodes the backward walk missed, from the users of matched nodes.

    A node found this way has its other inputs matched backwards from it, so an in-place write
    (a sink) brings the whole computation of the value it writes.
    """
    left = list(missing)
    progress = True
    while left and progress:
        progress = False
        for p in list(left):
            if p in walk.m.nodes:  # matched meanwhile, as an input of another node
                left.remove(p)
                continue
            known = [i for i in p.all_input_nodes if i in walk.m.nodes]
            if known and _try_users(walk, p, walk.m.nodes[known[0]]):
                left.remove(p)
                progress = True
    return left


def _try_users(walk: _Walk, p: fx.Node, source: fx.Node) -> bool:
    """Match ``p`` to a user of ``source``: one without literal defects if there is one."""
    used = set(walk.m.nodes.values())
    candidates = [c for c in source.users if c.target == p.target and c not in used]
    fallback = None
    for candidate in candidates:
        saved = _snapshot(walk.m)
        try:
            walk.node(p, candidate)
        except NoMatch:
            _restore(walk.m, saved)
            continue
        if len(walk.m.defects) == len(saved[2]):
            return True
        fallback = fallback or candidate
        _restore(walk.m, saved)
    if fallback is not None:  # keep a defective match: its defects say what is wrong
        walk.node(p, fallback)
        return True
    return False


def _snapshot(m: Match) -> tuple:
    return dict(m.nodes), m.index, list(m.defects), dict(m.bindings)


def _restore(m: Match, saved: tuple) -> None:
    m.nodes, m.index, m.defects, m.bindings = (dict(saved[0]), saved[1], list(saved[2]),
                                               dict(saved[3]))


def order_problem(match: Match, order: dict) -> Optional[str]:
    """Why the matched nodes run in another order than the pattern's (None if they don't).

    With in-place writes, data edges do not say everything: a read of a buffer sees the writes
    placed before it. Same structure and same order means same meaning.
    """
    p_order = {p: i for i, p in enumerate(match.pattern.graph.nodes)}
    pairs = sorted(((order[n], p_order[p], p) for p, n in match.nodes.items()
                    if p.op == "call_function"), key=lambda x: x[0])
    for (_, a, pa), (_, b, pb) in zip(pairs, pairs[1:]):
        if b < a:
            return f"{op_name(pb.target)} runs before {op_name(pa.target)}, unlike the pattern"
    return None


def outside_users(match: Match) -> list[tuple[fx.Node, fx.Node]]:
    """(inner node, user) pairs where a matched inner value is read outside the match.

    Dead users (pure nodes whose results nobody reads) do not count: they go with the region.
    """
    inside = set(match.nodes.values())
    return [(n, u) for n in match.inner() for u in n.users if u not in inside and not is_dead(u)]


def is_dead(node: fx.Node) -> bool:
    """A pure node whose value, directly or through other pure nodes, reaches nothing."""
    return all(map(is_pure, reachable([node], lambda n: n.users if is_pure(n) else ())))
