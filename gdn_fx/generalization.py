"""``gdn_fx.generalize``: one program generic in S and P from programs traced at fixed lengths.

    def trace(S, P):                      # the user's own export call, at S new tokens, P past
        return torch.export.export(model, model.example(S, P))
    gen = gdn_fx.generalize(trace)        # traces at DEFAULT_POINTS, collapses, aligns, fits
    gen.export_nnef("m.nnef.tgz")         # symbolic S (>= 1) and P (>= 0) in NNEF

A program exported at a fixed sequence length S and past length P holds both as integer
literals in every reshape, slice, arange, mask and expand outside the fused nodes (and, before
collapsing, as the number of unrolled steps). Traced at several (S, P) and collapsed, the
programs of a model that does not branch on the lengths have the same nodes in the same order;
only those literals differ. Each literal that differs is fitted as ``a*S + b*P + c`` (integer
coefficients, solved on the first three points, checked at every other one), and becomes
integer arithmetic over ``sym_size`` of the input axes that carry S and P. The program is then
re-exported with torch.export dynamic dims on those axes: what comes out is an ordinary
symbolic program, the kind ``gdn_fx.hf.generator`` writes, and goes through the same
``export_nnef(dynamic_axes=..., symbol_min={"P": 0})``.

Refused (GeneralizeRefused, naming the node): programs whose nodes differ between points (a
branch on the length, e.g. transformers' ``S == 1`` decode branch: trace at S >= 2 and the
multi-token branch serves S = 1 too where it carries the states), literals that fit no affine
form, a float literal or a constant tensor that changes with the length, a loop left unrolled
(its node count grows with S), and a window (see below).

Windows. A model that keeps the last W positions (a sliding-window attention, a rolling cache)
computes the same thing at every traced length shorter than W, and another thing past it. By
structure: a slice whose literal bound lies beyond the extent it slices at a traced point, on
an axis that follows the lengths (``x[:, :, -W:]`` of a cache never as long as W), is refused
naming the node and W. By running: the generic program is checked against ``trace`` called at
one more point, whose S + P lies past every integer literal of the graph that may be a length
(slice bounds, integer scalars of comparisons and of arithmetic on integer tensors such as
positions, ``arange`` and ``full`` arguments) and past ``FAR_MIN``; a window the trace hid
from the graph (``min(P, W)`` computed in Python) shows there. A mask built from a constant
and the positions (transformers' sliding-window mask over a cache that keeps every token)
computes the window in the graph itself, generic in S and P: it passes that check.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.export import Dim

from gdn_fx.errors import GeneralizeRefused, UsageError

# (S, P) points: the first three fit (affinely independent), the others check. S >= 2 and
# P >= 2 everywhere: torch.export specializes sizes of 0 and 1, and transformers branches
# on S == 1.
DEFAULT_POINTS = ((3, 4), (5, 4), (3, 7), (6, 9))
# The far point of the check lies past this S + P and past every length-like literal: a window
# the trace spelled in Python (no literal left in the graph) shows only when it is reached.
FAR_MIN = 512
# Integer literals above this are sentinels (a slice end of 2**63 - 1), not lengths.
LENGTH_CAP = 1 << 20
Point = tuple[int, int]
Affine = tuple[int, int, int]  # (a, b, c): a*S + b*P + c
SYMBOLS = ("S", "P")
ATEN = torch.ops.aten


@dataclass(frozen=True)
class Site:
    """An integer literal that follows the lengths: where it is and what it computes."""

    node: str  # node name in the generalized graph (before the re-export)
    path: tuple  # position inside (args, kwargs)
    values: tuple  # its value at each point
    affine: Affine

    def __str__(self) -> str:
        return f"{self.node}{list(self.path)}: {_spell(self.affine)}"


@dataclass
class Generalized:
    """A program symbolic in S and P, and what it took to make it (see the module doc)."""

    program: torch.export.ExportedProgram
    input_names: list  # the program's user-input names, in order
    axes: dict  # {input name: {axis: "S" | "P"}}
    sites: list = field(default_factory=list)  # the literals made symbolic
    points: tuple = ()
    counts: dict = field(default_factory=dict)  # fused nodes (gdn_fx.collapse counts)
    example_inputs: tuple = ()  # the base point's inputs (flat)
    far: Optional[Point] = None  # the point past every length-like literal it was checked at

    def dynamic_axes(self, input_names: Optional[Sequence[str]] = None) -> dict:
        """``dynamic_axes`` for export_nnef, keyed by ``input_names`` (NNEF names, in input
        order) or by the program's own input names."""
        names = list(input_names) if input_names is not None else self.input_names
        if len(names) != len(self.input_names):
            raise UsageError(f"{len(names)} input names for {len(self.input_names)} inputs")
        rename = dict(zip(self.input_names, names))
        return {rename[name]: dict(axes) for name, axes in self.axes.items()}

    def export_nnef(self, path: Union[str, Path], *,
                    input_names: Optional[Sequence[str]] = None,
                    output_names: Optional[Sequence[str]] = None, **kwargs) -> Path:
        """The program as NNEF with symbolic S (>= 1) and P (>= 0): ``gdn_fx.export_nnef``
        with this program's dynamic axes (other keywords pass through)."""
        from gdn_fx.export import export_nnef
        from gdn_fx.lowering.options import ExportOptions

        options = ExportOptions.of(kwargs.pop("options", None), **kwargs)
        options = ExportOptions.of(options, symbol_min={"P": 0, **options.symbol_min})
        return export_nnef(self.program, path, dynamic_axes=self.dynamic_axes(input_names),
                           input_names=input_names, output_names=output_names,
                           options=options)

    def decode_program(self) -> torch.export.ExportedProgram:
        """The program re-traced at S = 1 (P still symbolic): the same computation with static
        sizes, so that the lowering table may take its decode candidates (the reason
        ``gdn_fx.hf.generator`` writes a decode graph)."""
        module = _plain_module(self.program.module())
        args = [x if axis is None else x.narrow(axis, 0, 1) for x, axis in
                zip(self.example_inputs, (next((a for a, s in axes.items() if s == "S"), None)
                                          for axes in self._flat_axes()))]
        past = Dim.DYNAMIC(min=0)
        shapes = [{a: past for a, s in axes.items() if s == "P"} or None
                  for axes in self._flat_axes()]
        return torch.export.export(module, tuple(args), strict=False,
                                   dynamic_shapes=tuple(shapes))

    def _flat_axes(self) -> list:
        return [self.axes.get(name, {}) for name in self.input_names]


def generalize(trace: Callable[[int, int], Any], points: Sequence[Point] = DEFAULT_POINTS, *,
               collapse: bool = True, verify: bool = True) -> Generalized:
    """One program symbolic in S and P from ``trace(S, P)`` at each of ``points``.

    ``trace`` returns an ExportedProgram (the user's own ``torch.export.export`` call) whose
    example inputs are those of the point. Each program is collapsed (``gdn_fx.collapse``;
    ``collapse=False`` takes them as they are), the graphs are aligned node by node, and
    every integer literal that differs between points is fitted as ``a*S + b*P + c`` on the
    first three points and checked at the others; each input axis whose extent differs must
    be S or P itself. With ``verify``, the generalized program is run on the last point's
    inputs and compared with that point's own program.

    Raises GeneralizeRefused naming the node (see the module doc), UsageError for unusable
    points or traces.
    """
    points = [tuple(int(v) for v in p) for p in points]
    _check_points(points)
    programs, counts = [], {}
    for point in points:
        program = trace(*point)
        if not isinstance(program, torch.export.ExportedProgram):
            raise UsageError(f"trace{point} returned {type(program).__name__}, not an "
                             "ExportedProgram")
        if collapse:
            from gdn_fx.passes import collapse as run_collapse

            result = run_collapse(program)
            program, counts = result.program, dict(result.counts)
        programs.append(program)
    modules = [_plain_module(p.module()) for p in programs]
    inputs = [_flat_inputs(p) for p in programs]
    axes = _input_axes(modules[0], inputs, points)
    sites = _align(modules, points)
    _refuse_windows(modules, points, sites)
    lengths = length_literals(modules[0].graph, sites)
    _substitute(modules[0], sites, axes)
    args, kwargs = programs[0].example_inputs
    generic = _reexport(modules[0], args, kwargs, axes)
    carried = {symbol for found in axes.values() for symbol in found.values()}
    far = far_point(points, lengths, "P" if "P" in carried else "S")
    if verify:
        _verify(generic, programs[-1], points[-1])
        _verify_far(generic, trace, far, lengths)
    names = [n.name for n in _placeholders(modules[0])]
    return Generalized(generic, names, {names[i]: a for i, a in axes.items()}, sites,
                       tuple(points), counts, tuple(inputs[0]), far if verify else None)


# --- points, inputs and the affine fit ------------------------------------------------------

def _check_points(points: list) -> None:
    if len(points) < 4:
        raise UsageError(f"generalize needs at least 4 points (3 to fit, 1 to check), got "
                         f"{points}")
    if _det3(points[:3]) == 0:
        raise UsageError(f"the first three points {points[:3]} must be affinely independent "
                         "(e.g. (3, 4), (5, 4), (3, 7)) to fit a*S + b*P + c")


def _det3(points) -> int:
    (s0, p0), (s1, p1), (s2, p2) = points
    return (s1 - s0) * (p2 - p0) - (s2 - s0) * (p1 - p0)


def fit_affine(points: Sequence[Point], values: Sequence[int]) -> Optional[Affine]:
    """Integer (a, b, c) with ``a*S + b*P + c == value`` at every point (solved on the first
    three, checked at the rest), else None."""
    (s0, p0), (s1, p1), (s2, p2) = points[:3]
    v0, v1, v2 = values[:3]
    det = Fraction(_det3(points[:3]))
    a = ((v1 - v0) * (p2 - p0) - (v2 - v0) * (p1 - p0)) / det
    b = ((s1 - s0) * (v2 - v0) - (s2 - s0) * (v1 - v0)) / det
    c = v0 - a * s0 - b * p0
    if any(x.denominator != 1 for x in (a, b, c)):
        return None
    a, b, c = int(a), int(b), int(c)
    if any(a * s + b * p + c != v for (s, p), v in zip(points, values)):
        return None
    return a, b, c


def _spell(affine: Affine) -> str:
    terms = [f"{k}*{s}" if k not in (1, -1) else ("-" if k < 0 else "") + s
             for k, s in zip(affine[:2], SYMBOLS) if k]
    text = " + ".join(terms).replace("+ -", "- ")
    c = affine[2]
    return (text + (f" + {c}" if c > 0 else f" - {-c}" if c < 0 else "")) or str(c)


def _flat_inputs(program: torch.export.ExportedProgram) -> list:
    if program.example_inputs is None:
        raise UsageError("the traced program keeps no example inputs (torch.export.load?): "
                         "trace must return torch.export.export's own result")
    args, kwargs = program.example_inputs
    return pytree.tree_leaves((args, kwargs))


def _placeholders(module: fx.GraphModule) -> list:
    return [n for n in module.graph.nodes if n.op == "placeholder"]


def _input_axes(module: fx.GraphModule, inputs: list, points: list) -> dict:
    """{flat input index: {axis: "S" | "P"}} for every input axis whose extent differs."""
    names = [n.name for n in _placeholders(module)]
    found: dict = {}
    for index, tensors in enumerate(zip(*inputs)):
        if not isinstance(tensors[0], torch.Tensor):
            continue
        ranks = {t.dim() for t in tensors}
        if len(ranks) != 1:
            raise GeneralizeRefused(f"input '{names[index]}' has rank {sorted(ranks)} at "
                                    "different points")
        for axis in range(tensors[0].dim()):
            extents = [int(t.shape[axis]) for t in tensors]
            if len(set(extents)) == 1:
                continue
            affine = fit_affine(points, extents)
            symbol = {(1, 0, 0): "S", (0, 1, 0): "P"}.get(affine)
            if symbol is None:
                raise GeneralizeRefused(
                    f"input '{names[index]}' axis {axis} has extents {extents} at {points}: "
                    "generalize needs each input axis that changes to be S or P itself")
            found.setdefault(index, {})[axis] = symbol
    return found


# --- alignment ------------------------------------------------------------------------------

def _leaves(value: Any, path: tuple = ()) -> Iterator[tuple[tuple, Any]]:
    """(path, leaf) of a node's (args, kwargs), descending into lists, tuples and dicts."""
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _leaves(item, path + (i,))
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _leaves(item, path + (key,))
    else:
        yield path, value


def _skeleton(node: fx.Node, order: dict) -> tuple:
    """What a node is with its integer literals blanked: op, target, the shape of its
    arguments, and the position (in graph order) of every node it reads."""
    def blank(leaf):
        if isinstance(leaf, fx.Node):
            return ("node", order[leaf])
        if isinstance(leaf, int) and not isinstance(leaf, bool):
            return ("int",)
        if isinstance(leaf, float):
            return ("float",)
        return ("literal", repr(leaf))

    target = node.target if isinstance(node.target, str) else getattr(
        node.target, "__qualname__", repr(node.target))
    leaves = tuple((path, blank(leaf)) for path, leaf in _leaves((node.args, node.kwargs)))
    return node.op, str(target), leaves


def _where(node: fx.Node) -> str:
    target = node.target if isinstance(node.target, str) else getattr(
        node.target, "__name__", str(node.target))
    return f"'{node.name}' ({target})"


def _refuse_structure(modules: list, points: list, index: int, first: int) -> None:
    from gdn_fx.diff import graph_diff

    a, b = list(modules[0].graph.nodes), list(modules[index].graph.nodes)
    here = _where(a[first]) if first < len(a) else "the end of the graph"
    there = _where(b[first]) if first < len(b) else "the end of the graph"
    delta = graph_diff(modules[0].graph, modules[index].graph).op_delta()
    moved = "; ".join(f"{t}: {x} -> {y}" for t, (x, y) in list(delta.items())[:4])
    raise GeneralizeRefused(
        f"the program differs between (S, P) = {points[0]} and {points[index]} from node "
        f"{first} on: {here} vs {there} ({len(a)} vs {len(b)} nodes"
        f"{'; ' + moved if moved else ''}): it branches on the lengths or keeps a loop "
        "unrolled, so no single program serves both")


def _constant(module: fx.GraphModule, node: fx.Node) -> Any:
    value: Any = module
    for part in node.target.split("."):
        value = getattr(value, part)
    return value


def _same_constant(x: Any, y: Any) -> bool:
    if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
        return x is y or (x.shape == y.shape and x.dtype == y.dtype and torch.equal(x, y))
    return True  # submodules: compared by the nodes that call them


def _align(modules: list, points: list) -> list:
    """The literal sites that differ between points, fitted; refuses as the module doc says."""
    graphs = [list(m.graph.nodes) for m in modules]
    orders = [{n: i for i, n in enumerate(g)} for g in graphs]
    skeletons = [[_skeleton(n, o) for n in g] for g, o in zip(graphs, orders)]
    for index in range(1, len(modules)):
        mine, theirs = skeletons[0], skeletons[index]
        first = next((i for i, (x, y) in enumerate(zip(mine, theirs)) if x != y),
                     None if len(mine) == len(theirs) else min(len(mine), len(theirs)))
        if first is not None:
            _refuse_structure(modules, points, index, first)
    sites = []
    for position, node in enumerate(graphs[0]):
        peers = [g[position] for g in graphs]
        if node.op == "get_attr" and not all(
                _same_constant(_constant(modules[0], node), _constant(m, p))
                for m, p in zip(modules[1:], peers[1:])):
            raise GeneralizeRefused(f"constant {_where(node)} differs between points: it was "
                                    "computed at trace time from the lengths")
        sites += _node_sites(node, peers, points)
    return sites


def _node_sites(node: fx.Node, peers: list, points: list) -> list:
    leaves = [list(_leaves((p.args, p.kwargs))) for p in peers]
    found = []
    for column in zip(*leaves):
        path, value = column[0]
        values = tuple(v for _, v in column)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if len(set(values)) == 1:
            continue
        if isinstance(value, float):
            raise GeneralizeRefused(f"node {_where(node)} has a float literal that changes "
                                    f"with the lengths ({values} at {points}): only integer "
                                    "sizes can be made symbolic")
        affine = fit_affine(points, values)
        if affine is None:
            raise GeneralizeRefused(
                f"node {_where(node)}: the literal at {list(path)} takes {list(values)} at "
                f"(S, P) = {points}, which no a*S + b*P + c with integer a, b, c fits (fitted "
                f"on the first three points, checked at the others)")
        found.append(Site(node.name, path, values, affine))
    return found


# --- windows --------------------------------------------------------------------------------

# Ops whose integer scalars, on integer or boolean tensors (positions, masks), may be lengths.
POSITION_OPS = frozenset({"lt", "le", "gt", "ge", "eq", "ne", "add", "sub", "rsub", "mul",
                          "clamp", "clamp_min", "clamp_max", "remainder", "floor_divide"})
# Ops whose size arguments may be lengths: (op, index of the argument holding the sizes).
SIZE_ARGS = {"full": 0, "zeros": 0, "ones": 0, "empty": 0, "new_full": 1, "new_zeros": 1,
             "new_ones": 1, "new_empty": 1}


def _opname(node: fx.Node) -> str:
    packet = getattr(node.target, "overloadpacket", None)
    return packet.__name__ if packet is not None else ""


def _is_int(leaf: Any) -> bool:
    return isinstance(leaf, int) and not isinstance(leaf, bool) and 0 < abs(leaf) < LENGTH_CAP


def _slice_extent(node: fx.Node) -> Optional[int]:
    """The extent a slice node cuts along its axis (None when unknown or symbolic)."""
    source = node.args[0] if node.args else None
    val = source.meta.get("val") if isinstance(source, fx.Node) else None
    dim = node.args[1] if len(node.args) > 1 else 0
    if not isinstance(val, torch.Tensor) or not isinstance(dim, int):
        return None
    extent = val.shape[dim]
    return extent if isinstance(extent, int) else None


def _refuse_windows(modules: list, points: list, sites: list) -> None:
    """A slice whose literal bound W lies beyond the extent it cuts for some lengths but not
    for others: ``x[:, :, -W:]`` keeps everything while S + P < W and the last W past it.
    The extent is fitted as a*S + b*P + c over the points (the shortest is a + c, at S = 1,
    P = 0); a bound above it makes the program's meaning change with the lengths."""
    made = {(site.node, site.path) for site in sites}
    graphs = [list(m.graph.nodes) for m in modules]
    for position, node in enumerate(graphs[0]):
        if node.op != "call_function" or _opname(node) != "slice":
            continue
        extents = [_slice_extent(g[position]) for g in graphs]
        affine = None if None in extents else fit_affine(points, extents)
        if affine is None or affine[:2] == (0, 0) or min(affine[:2]) < 0:
            continue
        shortest = affine[0] + affine[2]
        for index in (2, 3):
            bound = node.args[index] if len(node.args) > index else None
            if (node.name, (0, index)) in made or not _is_int(bound) or abs(bound) <= shortest:
                continue
            what = {(2, True): "keeps the last", (2, False): "drops the first",
                    (3, True): "drops the last", (3, False): "keeps the first"}[index, bound < 0]
            raise GeneralizeRefused(
                f"node {_where(node)} {what} {abs(bound)} positions of an axis of "
                f"{_spell(affine)} ({extents} at (S, P) = {points}): a window of "
                f"{abs(bound)} positions, whose result changes where {_spell(affine)} "
                f"crosses {abs(bound)}; no single program serves every S and P (export with "
                "a fixed length, or keep the whole cache and mask the window)")


def length_literals(graph: fx.Graph, sites: Sequence[Site] = ()) -> list:
    """(node name, value) of every integer literal of ``graph`` that may be a length: slice
    bounds, integer scalars of comparisons and arithmetic on integer or boolean tensors,
    ``arange`` arguments and ``full``-like sizes; the literals made symbolic (``sites``) and
    sentinels (``LENGTH_CAP`` and above) left out. Largest first."""
    made = {(site.node, site.path) for site in sites}
    found = []
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        name, val = _opname(node), node.meta.get("val")
        if name == "slice":
            leaves = [((0, i), node.args[i]) for i in (2, 3) if len(node.args) > i]
        elif name == "arange":
            leaves = list(_leaves((node.args,)))
        elif name in SIZE_ARGS and len(node.args) > SIZE_ARGS[name]:
            leaves = [((0, SIZE_ARGS[name]) + p, v)
                      for p, v in _leaves(node.args[SIZE_ARGS[name]])]
        elif name in POSITION_OPS and isinstance(val, torch.Tensor) and not (
                val.dtype.is_floating_point or val.dtype.is_complex):
            leaves = list(_leaves((node.args,)))
        else:
            continue
        found += [(node.name, abs(v)) for path, v in leaves
                  if _is_int(v) and (node.name, path) not in made]
    return sorted(found, key=lambda item: -item[1])


def far_point(points: Sequence[Point], lengths: Sequence[tuple], grow: str = "P") -> Point:
    """The point of the window check: S + P past every length-like literal and past FAR_MIN,
    reached by growing P from the first point (S where no input carries P: a longer S costs
    a longer trace where a loop is unrolled)."""
    seq, past = points[0]
    total = max([FAR_MIN] + [value + 2 for _, value in lengths])
    return (seq, total - seq) if grow == "P" else (total - past, past)


# --- the generic program --------------------------------------------------------------------

def _plain_module(module: fx.GraphModule) -> fx.GraphModule:
    """``ep.module()`` without what pins it to its traced shapes: the input-constraint hook
    and the ``_guards_fn`` node (a fresh GraphModule over the same graph and parameters)."""
    graph = module.graph
    for node in [n for n in graph.nodes if n.op == "call_module" and n.target == "_guards_fn"]:
        graph.erase_node(node)
    plain = fx.GraphModule(module, graph)
    plain.recompile()
    return plain


def _symbol_sources(module: fx.GraphModule, axes: dict) -> dict:
    """{"S": (placeholder, axis), "P": ...}: the first input axis carrying each symbol."""
    placeholders = _placeholders(module)
    sources: dict = {}
    for index in sorted(axes):
        for axis, symbol in sorted(axes[index].items()):
            sources.setdefault(symbol, (placeholders[index], axis))
    return sources


def _set_leaf(value: Any, path: tuple, new: Any) -> Any:
    if not path:
        return new
    head, rest = path[0], path[1:]
    if isinstance(value, dict):
        return {**value, head: _set_leaf(value[head], rest, new)}
    items = list(value)
    items[head] = _set_leaf(items[head], rest, new)
    return type(value)(items) if isinstance(value, tuple) else items


def _substitute(module: fx.GraphModule, sites: list, axes: dict) -> None:
    """Replace each site's literal by integer arithmetic over the inputs' sizes."""
    if not sites:
        return
    graph = module.graph
    sources = _symbol_sources(module, axes)
    nodes = {n.name: n for n in graph.nodes}
    anchor = next(n for n in graph.nodes if n.op not in ("placeholder", "get_attr"))
    made: dict = {}

    def size(symbol: str) -> fx.Node:
        if symbol not in made:
            if symbol not in sources:
                raise GeneralizeRefused(f"a literal follows {symbol}, but no input axis "
                                        f"carries {symbol}")
            made[symbol] = graph.call_function(ATEN.sym_size.int, sources[symbol])
        return made[symbol]

    def expression(affine: Affine) -> fx.Node:
        if affine not in made:
            total = None
            for k, symbol in zip(affine[:2], SYMBOLS):
                if k:
                    term = size(symbol) if k == 1 else graph.call_function(
                        operator.mul, (size(symbol), k))
                    total = term if total is None else graph.call_function(
                        operator.add, (total, term))
            if affine[2]:
                total = graph.call_function(operator.add, (total, affine[2]))
            made[affine] = total
        return made[affine]

    with graph.inserting_before(anchor):
        for site in sites:
            node = nodes[site.node]
            args, kwargs = _set_leaf((node.args, node.kwargs), site.path,
                                     expression(site.affine))
            node.args, node.kwargs = tuple(args), dict(kwargs)
    graph.lint()
    module.recompile()


def _reexport(module: fx.GraphModule, args: tuple, kwargs: dict,
              axes: dict) -> torch.export.ExportedProgram:
    dims = {"S": Dim("S", min=1), "P": Dim("P", min=0)}
    leaves, spec = pytree.tree_flatten((args, kwargs))
    shapes = [{a: dims[s] for a, s in axes[i].items()} if i in axes else None
              for i in range(len(leaves))]
    shape_args, shape_kwargs = pytree.tree_unflatten(shapes, spec)
    if shape_kwargs:
        raise UsageError("generalize takes programs exported with positional inputs only")
    try:
        return torch.export.export(module, tuple(args), strict=False,
                                   dynamic_shapes=tuple(shape_args))
    except Exception as error:  # noqa: BLE001 (torch.export's own errors: say where it was)
        lines = [line for line in str(error).splitlines() if line.strip()]
        raise GeneralizeRefused("the generalized program does not export with symbolic S "
                                f"and P: {' / '.join(lines[:4])[:600]}") from None


def _mismatch(generic: torch.export.ExportedProgram,
              program: torch.export.ExportedProgram) -> Optional[str]:
    """None when ``generic`` computes what ``program`` does on ``program``'s example inputs,
    else which output differs and by how much."""
    args, kwargs = program.example_inputs
    with torch.no_grad():
        want = pytree.tree_leaves(program.module()(*args, **kwargs))
        got = pytree.tree_leaves(generic.module()(*args, **kwargs))
    for index, (g, w) in enumerate(zip(got, want)):
        if not isinstance(w, torch.Tensor):
            continue
        if g.shape != w.shape:
            return f"output {index} {tuple(g.shape)} vs {tuple(w.shape)}"
        scale = float(w.double().abs().max()) if w.numel() else 0.0
        diff = float((g.double() - w.double()).abs().max()) if w.numel() else 0.0
        if diff > 1e-4 * max(scale, 1e-30):
            return f"output {index} {tuple(w.shape)}, max difference {diff:.3g}"
    return None


def _verify(generic: torch.export.ExportedProgram, program: torch.export.ExportedProgram,
            point: Point) -> None:
    wrong = _mismatch(generic, program)
    if wrong:
        raise GeneralizeRefused(
            f"the generalized program differs at the held-back point (S, P) = {point} "
            f"from that point's own program: {wrong}")


def _verify_far(generic: torch.export.ExportedProgram, trace: Callable, far: Point,
                lengths: list) -> None:
    """The window check (module doc): ``trace`` at ``far`` against the generic program."""
    first = {value: name for name, value in reversed(lengths)}  # one node per value
    named = ", ".join(f"{value} of node '{first[value]}'" for value in list(first)[::-1][:3])
    literal = (f"every length-like literal ({named})" if lengths
               else "the traced lengths (the graph holds no length-like literal)")
    try:
        program = trace(*far)
        wrong = _mismatch(generic, program)
    except Exception as error:  # noqa: BLE001 (the user's trace or model: say what it said)
        first = next((line for line in str(error).splitlines() if line.strip()), "")
        raise GeneralizeRefused(
            f"the check at (S, P) = {far}, past {literal}, failed: {type(error).__name__}: "
            f"{first[:300]}") from None
    if wrong:
        raise GeneralizeRefused(
            f"the generalized program differs at (S, P) = {far}, past {literal}, from the "
            f"program traced there: {wrong}; the result depends on the length through a "
            "window the traced lengths never reached, so no single program serves every S "
            "and P")
