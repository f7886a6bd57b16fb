"""Running a cut-out region in float64, at points that reach both sides of every switch.

The meaning rules (step_meaning.py, chunk_meaning.py, conv_meaning.py) decide what a region
computes by cutting it out as a small graph and running it in float64 at drawn points beside
a reference. This module is what they share:

- ``Float64`` runs a region graph with every floating dtype it names widened to float64;
- ``evaluable`` / ``copy_constant``: the values a region computes from literals alone, and
  how they are copied into the cut-out graph;
- ``covering_points``: the extra points a region needs when it holds an operation whose
  result switches on data values;
- ``Sampler``: a region's points (drawn inputs and its float64 outputs there, the covering
  ones included), and ``Verdict``: what every rule decides, the layout that fits or the
  nearest and its errors. A rule brings only its region, its draws, its reference and its
  layouts.

Why the last one: an operation such as clamp, where, maximum, relu, abs, sign or a
comparison computes one function on one side of a threshold and another on the other side.
Random draws that never reach the threshold (a state clamped at +-20 while draws stay in
[-1, 1]) cannot tell the region from the reference on the side they do reach, and a region
that equals the delta rule only below the threshold would fuse. So every such operation
whose switch depends on the region's inputs must be SEEN ON BOTH SIDES by the points the
region is scored at: the inputs are scaled (each alone, then all together, by growing and
shrinking powers of 4) until every switch has been crossed, and those scaled points join the
scored ones. The references have no switches of their own, so a region passes only where
its switches change nothing (``where(c, S, S)``). A switch no scaling reaches, and an
operation that rounds or selects by value (floor, max over an axis, sort, ...), make the
region not the op: the near-miss names the node. A region with no switch costs one scan of
its nodes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import fx

from gdn_fx.passes.program import mutates
from gdn_fx.passes.result import NoMatch

FLOATS = (torch.float16, torch.bfloat16, torch.float32)
TOLERANCE = 1e-9  # a region is its op where it agrees to this, relative, in float64
POINTS = 2  # random points a region is scored at (and those that reach its switches)
# One seed per rule: every decision reproducible, the rules' draws independent of each other.
SEEDS = {"step": 1201, "chunk": 1515, "conv": 1501}
# Input scales tried, in this order, until every switch is seen on both sides: near 1 first
# (the smallest change of the region's values that crosses a threshold), up to 4^8 and down
# to 4^-12 (thresholds at 1e4, and at an epsilon of 1e-6), each with both signs (a gate of
# two entries drawn positive crosses clamp(min=-5) only when flipped).
LADDER = (-1.0,) + tuple(sign * 4.0 ** (s * i) for i in range(1, 13) for s in (1, -1)
                         if s * i <= 8 for sign in (1, -1))


@dataclass
class Verdict:
    """What a meaning rule decided of a region: the layout under which it computes the op
    (``layout``, with its measured output scale), else the ``nearest`` one and how far off
    it is (worst relative errors over the points, float64) and why (``reason``: slips
    named, switches; ``node``: the node it is about, when not the region's output).
    ``region``: the rule's record of what it cut; ``partial``: the nearest agrees on part
    of the region (a chunked region's first positions)."""

    layout: Any = None
    out_error: float = float("inf")
    state_error: float = float("inf")
    nearest: Any = None
    reason: str = ""
    region: Any = None
    partial: bool = False
    node: Optional[str] = None

    @property
    def error(self) -> float:
        return self.out_error + self.state_error

    def off_by(self, state: Optional[str] = "new state") -> str:
        """The nearest miss's distance, in words (``state``: what the state output is
        called; None for a region that hands out none)."""
        if state is not None and self.out_error == float("inf") and \
                math.isfinite(self.state_error):  # a far-off state: the output not scored
            return f"the nearest differs by {self.state_error:.2g} in the {state} " \
                   "(relative, float64)"
        text = f"the nearest differs by {self.out_error:.2g} in the output"
        if state is not None:
            text += f" and {self.state_error:.2g} in the {state}"
        return text + " (relative, float64)"


def nearest(verdicts) -> Verdict:
    """The first verdict that fits, else the least wrong (the first of equals; where none is
    finitely wrong, the one whose state is least wrong: a rule stops scoring the output of a
    far-off state; an empty ``Verdict()`` when none has a finite error at all); the verdicts
    are made one at a time, none after a fit."""
    best, closest = Verdict(), Verdict()
    for verdict in verdicts:
        if verdict.layout is not None:
            return verdict
        if verdict.error < best.error:
            best = verdict
        if verdict.state_error < closest.state_error:
            closest = verdict
    return best if best.nearest is not None or closest.nearest is None else closest


class Sampler:
    """The points a region is scored at: inputs drawn by ``draw(gen)`` (the rule's seeded
    generator) and the region's float64 outputs there (run on copies: the inputs stay as
    drawn); ``points`` adds the ones that reach both sides of its switches."""

    def __init__(self, owner: torch.nn.Module, graph: fx.Graph, draw: Callable, rule: str,
                 narrowing: bool = False):
        self.owner, self.graph, self.draw = owner, graph, draw
        # whether the rule checks roundings at the traced dtypes itself (the conv rule):
        # then a cast down to f16 / bf16 is evaluated in float64 like the rest
        self.narrowing = narrowing
        self.seed = SEEDS[rule]
        self.gen = torch.Generator().manual_seed(self.seed)
        self.switches = switches(graph)
        self.first: Optional[list] = None

    def run(self, inputs: list):
        """The region's float64 outputs at ``inputs`` (run on copies); NoMatch naming the
        node where it turns data into integers (no float64 run can show what that does)."""
        return Float64(self.owner, graph=self.graph, strict=True,
                       narrowing=self.narrowing).run(*[x.clone() for x in inputs])

    def point(self) -> tuple:
        inputs = self.draw(self.gen)
        self.first = self.first or inputs
        return inputs, self.run(inputs)

    def shapes(self) -> list:
        """Inputs of the region's shapes (its first drawn point)."""
        return self.first if self.first is not None else self.draw(torch.Generator())

    def points(self, count: int = POINTS) -> list:
        """``count`` drawn points and the covering ones (NoMatch as ``covering_points``)."""
        drawn = [self.point() for _ in range(count)]
        return drawn + covering_points(self.owner, self.graph, drawn[0][0], self.switches)

    def named(self, reason: str = "") -> str:
        """``reason`` with what the region's switches add to a near-miss."""
        return "; ".join(filter(None, (reason, named(self.switches))))


def fitted_scale(got: torch.Tensor, ref: torch.Tensor) -> float:
    """The c that makes c * ref nearest ``got`` (least squares): an output scaled by a
    constant (q's 1/sqrt(Dk) folded in) is the op's with that scale."""
    return (got * ref).sum().item() / max((ref * ref).sum().item(), 1e-300)


def exact_scale(scale: float, nodes) -> float:
    """The float literal of ``nodes`` (or its reciprocal) that a fitted ``scale`` is within
    rounding of, else ``scale``: a fitted 0.25000000000000006 is the graph's 0.25, so that
    exports at other lengths agree on the op's scale bit for bit (generalization needs it)."""
    for node in sorted(nodes, key=lambda n: n.name):
        for arg in node.args:
            if isinstance(arg, float) and arg and math.isfinite(arg):
                for c in (arg, 1.0 / arg):
                    if abs(c - scale) <= TOLERANCE * abs(c):
                        return c
    return scale


def one_scale(scales: list, tolerance: float = TOLERANCE) -> bool:
    """Whether every point gave the same, nonzero scale (a constant, not a function of the
    inputs)."""
    return scales[0] != 0 and \
        abs(scales[0] - scales[-1]) <= tolerance * max(abs(scales[0]), 1e-30)


class Float64(fx.Interpreter):
    """Runs a graph with every floating dtype it names replaced by float64 (the meaning
    rules evaluate regions so, to tell the rule's value from rounding). ``strict``: a value
    computed from the inputs that is an integer, or a float narrower than what it was
    computed from, raises NoMatch naming the node (no float64 run shows what it rounds
    away); ``rounding``: such a narrower float is rounded as traced instead (translation
    validation compares whole programs so)."""

    def __init__(self, *args, strict: bool = False, rounding: bool = False,
                 narrowing: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.data = _data_nodes(self.graph) if strict else set()
        self.narrowing = narrowing  # strict, but a cast down to f16 / bf16 allowed
        # the casts down to f16 / bf16, which round (and overflow) as traced
        self.rounding = {n: low for n in self.graph.nodes if (low := _narrowed(n))} \
            if rounding else {}

    def run_node(self, n):
        result = super().run_node(n)
        if n in self.rounding and isinstance(result, torch.Tensor):
            return result.to(self.rounding[n]).double()
        if n in self.data and isinstance(result, torch.Tensor):
            lost = (None if self.narrowing else _narrowed(n)) if result.is_floating_point() \
                else None if result.dtype is torch.bool else result.dtype
            if lost is not None:
                raise NoMatch(f"node {n.name} ({op_name(n)}) turns data values into {lost}: "
                              "float64 does not show what that rounds away, and the op has "
                              "no such step", node=n)
        return result

    def get_attr(self, target, args, kwargs):
        value = super().get_attr(target, args, kwargs)  # a module's weight, as traced
        return value.double() if isinstance(value, torch.Tensor) and \
            value.is_floating_point() else value

    def call_function(self, target, args, kwargs):
        args = tuple(_wide(a) for a in args)
        kwargs = {k: _wide(v) for k, v in kwargs.items()}
        result = super().call_function(target, args, kwargs)
        if isinstance(result, torch.Tensor) and result.is_floating_point() and \
                result.dtype is not torch.float64 and not _has_tensor((args, kwargs)):
            result = result.double()  # a factory in the default dtype (zeros without dtype=)
        return result


def _narrowed(node: fx.Node) -> Optional[torch.dtype]:
    """The float dtype ``node`` rounds its data into, as traced, when it is narrower than
    one of its floating inputs' (an f32 state through f16 and back); None otherwise (also
    where the trace recorded no dtypes)."""
    out = _traced_dtype(node)
    if out is None or not out.is_floating_point:
        return None
    for arg in node.all_input_nodes:
        before = _traced_dtype(arg)
        if before is not None and before.is_floating_point and \
                torch.finfo(out).bits < torch.finfo(before).bits:
            return out
    return None


def _traced_dtype(node: fx.Node) -> Optional[torch.dtype]:
    value = node.meta.get("val")
    return value.dtype if isinstance(value, torch.Tensor) else None


def _data_nodes(graph: fx.Graph) -> set:
    """The nodes computed from the graph's inputs (its placeholders)."""
    data = set()
    for node in graph.nodes:
        if node.op == "placeholder" or (node.op in ("call_function", "call_method") and
                                        any(a in data for a in node.all_input_nodes)):
            data.add(node)
    return data


def _wide(value):
    return torch.float64 if isinstance(value, torch.dtype) and value in FLOATS else value


def _has_tensor(value) -> bool:
    """Whether a call's arguments hold a tensor (aten arguments nest in lists and tuples
    only; torch's pytree walk costs ~10x this on a region of 10^3 calls)."""
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, (list, tuple)):
        return any(_has_tensor(v) for v in value)
    if isinstance(value, dict):
        return any(_has_tensor(v) for v in value.values())
    return False


def evaluable(node: fx.Node, depth: int = 0) -> bool:
    """A value computed from nothing but literals and module attributes (zeros, full, ...)."""
    if node.op == "get_attr":
        return True
    if node.op != "call_function" or depth > 8:
        return False
    return all(evaluable(a, depth + 1) for a in node.all_input_nodes)


def copy_constant(graph: fx.Graph, node: fx.Node, env: dict) -> None:
    """Copy ``node`` (``evaluable``) and what it is computed from into ``graph``."""
    if node in env:
        return
    for inner in node.all_input_nodes:
        copy_constant(graph, inner, env)
    env[node] = graph.node_copy(node, lambda n: env[n])


# --- switches ------------------------------------------------------------------------------

def _at(args, kwargs, index: int, name: str, default=None):
    if name in kwargs:
        return kwargs[name]
    return args[index] if len(args) > index else default


def _bounds(*names_at):
    """Predicates x < bound for each bound the call gives (clamp's min and max, ...)."""
    def tests(args, kwargs, result):
        found = [_at(args, kwargs, i, name, default) for name, i, default in names_at]
        return [args[0] < b for b in found if b is not None]
    return tests


def _fixed(*bounds):
    """Predicates x < bound for an activation's own fixed bounds (relu6's 0 and 6, ...)."""
    return lambda args, kwargs, result: [args[0] < b for b in bounds]


def _sign(args, kwargs, result):
    return [args[0] > 0]


def _shrink(args, kwargs, result):
    lambd = _at(args, kwargs, 1, "lambd", 0.5)
    return [args[0] > lambd, args[0] < -lambd]


def _pair(args, kwargs, result):
    return [torch.as_tensor(args[0]) < torch.as_tensor(args[1])]


def _condition(index: int):
    return lambda args, kwargs, result: [torch.as_tensor(args[index]).bool()]


# The operand that selects, for the operations that choose between values by a mask: they
# switch on data only when the mask is made from the data (transformers' chunk form masks
# with a literal triu).
CONDITION_AT = {"where": 0, "masked_fill": 1, "masked_scatter": 1}


def _result(args, kwargs, result):
    return [result.bool()]


# Each operation whose result switches on a value of its operands, with the predicates that
# tell which side an element is on (each must come out both True and False somewhere).
SWITCHES: dict[str, Callable] = {
    "clamp": _bounds(("min", 1, None), ("max", 2, None)),
    "clip": _bounds(("min", 1, None), ("max", 2, None)),
    "clamp_min": _bounds(("min", 1, None)),
    "clamp_max": _bounds(("max", 1, None)),
    "hardtanh": _bounds(("min_val", 1, -1.0), ("max_val", 2, 1.0)),
    "relu6": _fixed(0.0, 6.0), "hardsigmoid": _fixed(-3.0, 3.0), "hardswish": _fixed(-3.0, 3.0),
    "threshold": _bounds(("threshold", 1, None)),
    "relu": _sign, "leaky_relu": _sign, "elu": _sign, "celu": _sign, "selu": _sign,
    "rrelu": _sign, "prelu": _sign, "abs": _sign, "sign": _sign, "sgn": _sign,
    "heaviside": _sign,
    "softshrink": _shrink, "hardshrink": _shrink,
    "minimum": _pair, "maximum": _pair, "fmin": _pair, "fmax": _pair,
    **{name: _condition(index) for name, index in CONDITION_AT.items()},
    "gt": _result, "lt": _result, "ge": _result, "le": _result, "eq": _result, "ne": _result,
    "greater": _result, "less": _result, "greater_equal": _result, "less_equal": _result,
    "logical_and": _result, "logical_or": _result, "logical_xor": _result,
    "logical_not": _result,
}
# Operations that round or select by value: no scaling shows both sides of them, and the
# ops have none, so a region holding one on its inputs' values is not the op.
SELECTS = frozenset({
    "floor", "ceil", "round", "trunc", "fix", "frac", "remainder", "fmod", "floor_divide",
    "nan_to_num", "isnan", "isinf", "isfinite", "isposinf", "isneginf", "signbit",
    "amax", "amin", "argmax", "argmin", "aminmax", "sort", "argsort", "msort", "topk",
    "kthvalue", "median", "nanmedian", "mode", "cummax", "cummin", "bucketize",
    "searchsorted", "histc", "unique", "unique_consecutive", "nonzero", "masked_select",
})


def op_name(node: fx.Node) -> str:
    """The operation's base name: aten.clamp_.default, torch.clamp and Tensor.clamp_ are
    all 'clamp'."""
    target = node.target
    packet = getattr(target, "overloadpacket", None)
    name = getattr(packet, "__name__", None) or getattr(target, "__name__", None) or \
        (target if isinstance(target, str) else "")
    name = name.split(".")[-1]
    return name[:-1] if name.endswith("_") and not name.endswith("__") else name


def _tests_of(node: fx.Node) -> Optional[Callable]:
    """The predicates of a switching ``node``; None for one that does not switch. max / min
    with two tensors are the elementwise maximum / minimum; over an axis they select."""
    name = op_name(node)
    if name in ("max", "min"):
        tensors = [a for a in node.args if isinstance(a, fx.Node)]
        return _pair if len(tensors) == 2 else _selects
    if name in SELECTS:
        return _selects
    if name in SWITCHES:
        return SWITCHES[name]
    value = node.meta.get("val")
    if isinstance(value, torch.Tensor) and value.dtype is torch.bool:
        return _result  # a bool made from the data by some other operation
    return None


def _selects(args, kwargs, result):
    raise AssertionError("selecting operations are refused before running")


def switches(graph: fx.Graph) -> dict:
    """The nodes of a region graph whose result switches on data values reached from its
    inputs (its placeholders), each with its predicates. Literal-made masks do not count."""
    data, found = _data_nodes(graph), {}
    for node in graph.nodes:
        if node in data and node.op != "placeholder":
            tests = _tests_of(node)
            if tests is not None and _selects_by_data(node, data):
                found[node] = tests
    return found


def named(found: dict) -> str:
    """What a near-miss says of a failing region's switches ('' when it has none)."""
    if not found:
        return ""
    nodes = ", ".join(f"{n.name} ({op_name(n)})" for n in list(found)[:3])
    return (f"it holds {nodes}, which switch on data values; it was also run at inputs "
            "scaled to reach both sides of each")


def _selects_by_data(node: fx.Node, data: set) -> bool:
    index = CONDITION_AT.get(op_name(node))
    if index is None:
        return True
    mask = node.args[index] if len(node.args) > index else None
    return isinstance(mask, fx.Node) and mask in data


def _refuse_selecting(found: dict) -> None:
    for node, tests in found.items():
        if tests is _selects:
            raise NoMatch(f"node {node.name} ({op_name(node)}) rounds or selects by value; "
                          "the op has no such step", node=node)


class _Sides(Float64):
    """Float64 that records, for each watched node, which sides each of its predicates took:
    ``seen[node]`` is one set per predicate, of the values (True, False) it came out."""

    def __init__(self, owner, graph, watched: dict, seen: dict):
        super().__init__(owner, graph=graph)
        self.watched, self.seen = watched, seen

    def run_node(self, n):
        tests = self.watched.get(n)
        if tests is None:
            return super().run_node(n)
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        if mutates(n):  # clamp_ overwrites its input: the sides are those of the input as it was
            args = (args[0].clone(), *args[1:])
        result = super().run_node(n)
        preds = tests(args, kwargs, result)
        sides = self.seen.setdefault(n, [set() for _ in preds])
        for side, pred in zip(sides, preds):
            side.update({True} if pred.all() else {False} if not pred.any() else {True, False})
        return result


def covering_points(owner: torch.nn.Module, graph: fx.Graph, inputs: list,
                    found: Optional[dict] = None) -> list:
    """Extra (inputs, outputs) points at which, together with ``inputs``, every switch of
    ``graph`` (``switches``) is seen on both sides; [] for a region without switches.
    Raises NoMatch naming the node when an operation rounds or selects by value, or when no
    scaling of the inputs reaches both sides of a switch (the region is then not the op)."""
    found = switches(graph) if found is None else found
    if not found:
        return []
    _refuse_selecting(found)
    seen: dict = {}
    _run(owner, graph, found, seen, inputs)
    extra = []
    for factor in LADDER:
        # one input alone first: scaling them all lets the largest term (a state grown by
        # exp(64 g)) swamp the difference a clamp on v makes
        for subset in [[i] for i in range(len(inputs))] + [range(len(inputs))]:
            if not _uncovered(found, seen):
                return extra
            scaled = [x * factor if i in subset else x for i, x in enumerate(inputs)]
            trial: dict = {}
            outputs = _run(owner, graph, found, trial, scaled)
            if outputs is not None and _merge(trial, seen):
                extra.append((scaled, outputs))
    node = next(iter(_uncovered(found, seen)), None)
    if node is None:
        return extra
    raise NoMatch(f"node {node.name} ({op_name(node)}) switches on data values, and no "
                  f"scaling of the inputs (+-4^-12 .. +-4^8) reaches both of its sides: the "
                  "region equals no op on the side the draws do not reach", node=node)


def _run(owner, graph, found: dict, seen: dict, inputs: list):
    """The region's outputs at ``inputs`` (run on copies), recording the sides in ``seen``;
    None when it fails or hands out a value that is not finite (no side counts then)."""
    try:
        outputs = _Sides(owner, graph, found, seen).run(*[x.clone() for x in inputs])
    except Exception:  # noqa: BLE001 (a scaling the region cannot run at proves nothing)
        seen.clear()
        return None
    if not all(bool(t.isfinite().all()) for t in _tensors(outputs)):
        seen.clear()
        return None
    return outputs


def _tensors(value) -> list:
    if isinstance(value, torch.Tensor):
        return [value] if value.is_floating_point() else []
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _uncovered(found: dict, seen: dict) -> list:
    """The switches not yet seen on both sides of every predicate (also those not run)."""
    return [n for n in found if n not in seen or any(len(s) < 2 for s in seen[n])]


def _merge(trial: dict, seen: dict) -> bool:
    """Add ``trial``'s sides to ``seen``; whether it saw one that ``seen`` had not."""
    added = False
    for node, sides in trial.items():
        known = seen.setdefault(node, [set() for _ in sides])
        for have, new in zip(known, sides):
            added = added or not new <= have
            have.update(new)
    return added


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|: the relative error every meaning rule compares with its
    tolerance. inf when the shapes differ or either holds a value that is not finite."""
    if a.numel() != b.numel() or not a.is_floating_point() or not b.is_floating_point():
        return float("inf")  # a bool or integer result is no value of the op
    error = (a.reshape(b.shape) - b).abs().max().item() / max(b.abs().max().item(), 1e-30) \
        if b.numel() else 0.0
    return error if math.isfinite(error) else float("inf")


# --- the wide domain and the laws ----------------------------------------------------------
#
# The switch coverage above finds thresholds only in the operations it names. What decides
# instead, for any operation: the references are exact in float64 for every input, so a
# region that is the op agrees with them wherever it is drawn, and the op obeys laws that
# a cap, floor or wrap-around breaks. So, once a layout fits at the ordinary points, the
# region is drawn again over many decades of magnitude by the role each input plays under
# that layout (``wide_points``), scored against the reference there, and run at its
# linear inputs scaled by extreme factors (``law_problem``). A threshold anywhere between
# 1e-6 and 1e6 of an input (the draws) or between 2^-300 and 2^300 of the state and values
# (the laws) shows, whatever operation spells it.

# Per-tensor magnitudes, rotated across the draws by the tensor's position so that each
# tensor meets each of them and a large state meets a tiny value (and the other way
# round); None: each element's magnitude log-uniform over the whole range.
# 0.0: the tensor is all zeros (a fresh state: 0/0 there is NaN where the op is not).
WIDE_MAGNITUDES = (1e6, 1e-6, None, 0.0)
WIDE_DRAWS = len(WIDE_MAGNITUDES)
DECADES = (-6.0, 6.0)
KEY_LEVELS = (1.0, 1.0, 1.0, 1e-6)  # the keys' level at each draw (``wide_draw``)
# Exact in binary (scaling by them rounds nothing): a linear region gives a * f(x) for f(a x)
LAW_FACTORS = (2.0 ** 300, -(2.0 ** -300))
RESET = -1e4  # a log gate that empties the state (exp(-1e4) is 0 in float64)


def wide_draw(kind: str, dims, gen: torch.Generator, rotation: int, draw: int = 0
              ) -> torch.Tensor:
    """One input of kind ``kind`` over the wide domain, float64.

    linear / free: both signs, magnitude ``WIDE_MAGNITUDES[rotation]`` (for the
    log-uniform one, one element in 8 exactly zero); key: a key that keeps the recurrence
    contractive (beta |k|^2 <= 2, past which the rule itself blows up along a sequence and
    no two spellings agree), at ``KEY_LEVELS[draw]`` of that (full keys but in the last draw:
    a tiny key hides what k^T S and beta do); gate: log gates -1e-6 .. -100
    log-uniformly, one element in 8 a reset and one exactly 0; decay: exp of one, half of
    the elements negated (every value in [-1, 1] a decay can take); beta: all
    of [0, 2] (FLA lets beta reach 2: negative eigenvalues), one element in 8 at each of 0,
    1 and 2; plain: uniform [-1, 1]."""
    dims = list(dims)
    unit = torch.rand(dims, generator=gen, dtype=torch.float64)
    if kind == "plain":
        return unit * 2 - 1
    pick = torch.rand(dims, generator=gen, dtype=torch.float64)  # which elements take an end
    if kind == "beta":
        ends = torch.where(pick < 0.125, 0.0, torch.where(pick < 0.25, 1.0, 2.0))
        return _one_end(torch.where(pick < 0.375, ends, unit * 2), (2.0, 0.0, 1.0), draw)
    if kind in ("gate", "decay"):
        gate = -(10.0 ** (unit * 8 - 6))
        gate = torch.where(pick < 0.125, RESET, torch.where(pick < 0.25, 0.0, gate))
        gate = _one_end(gate, (0.0, RESET), draw)
        if kind == "gate":
            return gate
        # a decay the loop multiplies by may have either sign (negative eigenvalues, signed
        # linear RNNs): half the elements negative, -1 and 1 met through the gate's 0
        flip = torch.rand(dims, generator=gen, dtype=torch.float64) < 0.5
        return torch.where(flip, -gate.exp(), gate.exp())
    signs = torch.rand(dims, generator=gen, dtype=torch.float64) * 2 - 1
    if kind == "key":
        width = max(dims + [1])  # at least the key's width, wherever its axis lies
        return signs * (KEY_LEVELS[draw % len(KEY_LEVELS)] / width ** 0.5)
    magnitude = WIDE_MAGNITUDES[rotation % len(WIDE_MAGNITUDES)]
    if magnitude is None:
        lo, hi = DECADES
        spread = signs.sign() * 10.0 ** (unit * (hi - lo) + lo)
        return torch.where(pick < 0.125, 0.0, spread)
    return signs * magnitude


def _one_end(x: torch.Tensor, ends: tuple, draw: int) -> torch.Tensor:
    """``x`` with one element at an end of its domain, chosen by the draw: however few
    elements a tensor has (a merged batch of two gates), each end is met across the
    draws, not by chance."""
    if x.numel():
        x.view(-1)[draw % x.numel()] = ends[draw % len(ends)]
    return x


def wide_points(sampler: "Sampler", kinds: list, draws: int = WIDE_DRAWS) -> list:
    """(inputs, float64 outputs) at ``draws`` draws over the wide domain, inputs of the
    shapes of ``sampler``'s first point and the kinds ``kinds`` (one per input). NoMatch
    naming the node when the region holds a value float64 cannot carry."""
    dims = [list(x.shape) for x in sampler.shapes()]
    gen = torch.Generator().manual_seed(sampler.seed + 7)
    points = []
    for d in range(draws):
        inputs = [wide_draw(kind or "plain", shape_, gen, d + i, d) for i, (kind, shape_) in
                  enumerate(zip(kinds, dims))]
        points.append((inputs, sampler.run(inputs)))
    return points


def law_problem(sampler: "Sampler", point, linear: list, outputs: list) -> str:
    """Why the region breaks the op's linearity: scaling the inputs at ``linear`` together
    by each of ``LAW_FACTORS`` must scale each output at ``outputs`` by the same factor
    ('' when it does). ``point``: (inputs, outputs) of the region."""
    inputs, base = point
    base = list(base) if isinstance(base, (tuple, list)) else [base]
    for factor in LAW_FACTORS:
        scaled = [x * factor if i in linear else x for i, x in enumerate(inputs)]
        got = sampler.run(scaled)
        got = list(got) if isinstance(got, (tuple, list)) else [got]
        for index in outputs:
            if got[index] is None or base[index] is None:
                continue
            # back at the base's scale (exact: a power of two), so rel's floor of 1e-30
            # under its denominator does not hide a difference at 2^-300
            error = rel(got[index] / factor, base[index])
            if not error <= TOLERANCE:
                return (f"it is not linear in its state and values, as the op is: scaling "
                        f"them by {factor:.3g} scales output {index} by another factor "
                        f"(off by {error:.2g}, relative)")
    return ""


def wide_problem(sampler: "Sampler", kinds: list, score: Callable, linear: list,
                 outputs: list) -> str:
    """Why the region, which fits the op at the ordinary points, is not the op over the
    wide domain ('' when it is): ``score(points)`` is the rule's worst relative error
    against its reference (under the layout that fitted); the laws as ``law_problem``."""
    try:
        points = wide_points(sampler, kinds)
    except NoMatch:
        raise
    except Exception as error:  # noqa: BLE001 (a region that fails where the op does not)
        return f"it fails on inputs drawn over many decades: {type(error).__name__}"
    if not score(points) <= TOLERANCE:  # all at once (a rule scores points together)
        for point in points:
            error = score([point])
            if not error <= TOLERANCE:
                return (f"it differs from the op by {error:.2g} (relative) on inputs drawn "
                        f"over many decades ({_describe_draw(kinds, point[0])})")
    return law_problem(sampler, points[0], linear, outputs)


def _describe_draw(kinds: list, inputs: list) -> str:
    parts = []
    for kind, x in zip(kinds, inputs):
        if x.numel() and kind in ("linear", "free", "gate"):
            parts.append(f"{kind} up to {x.abs().max().item():.0e}")
    return ", ".join(parts)
