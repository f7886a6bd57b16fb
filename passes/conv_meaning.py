"""Rule: a causal conv1d update becomes one ``gdn_fx::causal_conv1d_update`` node, recognized
by what it computes, whatever ops spell it (transformers' conv1d, unfold, shifted
multiply-adds, roll, einsum, channel-last, K - 1 states, a fresh cache's prefill, ...).

Found by structure (cheaply): a depthwise weight ``w`` [C, K] or [C, 1, K] (a parameter or
buffer), a candidate output ``o`` computed from it ([B, C, T], [B, T, C] or [B, C]), a state
``S`` [B, C, W] or [B, W, C] with W = K or K - 1 that the region reads or that a copy writes
into (an input, a buffer, a clone of one, a fresh cache's zeros; or none, when the program
only hands the new state out), and an ``x`` shaped like ``o`` that it reads. The region is
what lies between them and ``o``: the ancestors of ``o`` and of the state's writes (in-place
writes into S or its views, a state-shaped value the program hands out or copies elsewhere)
that are computed from S, w or x, plus every in-place write into those values; it reads
nothing else but a [C] bias and constants.

Decided by meaning: the region is cut out as a small graph and run in float64 at random x, S,
w and bias, next to the op's own kernel

    full = cat(S or zeros, x) (padded with one zero sample in front when W = K - 1)
    out  = act(bias + sum_k w[:, k] * full[..., t + 1 + k])        t = 0 .. T - 1
    new  = full[..., -W:]

under every layout the shapes allow (x, S and o channel-first or channel-last, x and o 2-D at
T = 1; with or without the bias; SiLU or no activation; the state's history or a zero one).
The region fuses when, for one layout, o and every value it hands out (the new state: S after
the run, or the state-shaped values read outside) agree to 1e-9 relative at two points, and
then also at the traced dtypes (float64 sees no rounding: a state must land bit for bit, the
output within translation validation's bound) and at every length its symbolic sizes can
change at (``_lengths``). Otherwise the nearest layout says what is off, a common slip named.

The rewrite (rebuild.py) emits ``causal_conv1d_update`` where the region's operands are all
ready (an operand computed from the inputs alone moves there), with transposes, zeros for a
zero history, the zero sample of a K - 1 state and the slice back outside the node; the
region's nodes go, an in-place state write becomes one ``copy_(S, new_state)``, a copy of a
state value stays and copies ``new_state``.
"""

from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass, field, replace
from typing import Optional

import sympy
import torch
import torch.nn.functional as F
from torch import fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from gdn_fx import ops  # noqa: F401  (registers torch.ops.gdn_fx.*, used below)
from gdn_fx.passes.evaluator import (SEEDS, TOLERANCE, Float64, Sampler, Verdict,
                                     copy_constant, evaluable, nearest, op_name, rel,
                                     wide_problem)
from gdn_fx.passes.program import (ASSERT_META, ATEN, add_node, base_of, dtype, fake_mode_of,
                                   is_mutation, is_pure, is_zeros, positions, reachable, shape,
                                   val, view_writes)
from gdn_fx.passes.rebuild import Fusion
from gdn_fx.passes.result import Miss, NoMatch
from gdn_fx.passes.validate import BOUNDS

NAME = "causal_conv1d_update"
CONV_OP = torch.ops.gdn_fx.causal_conv1d_update.default
FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
MAX_KERNEL = 16
BACK = 60   # nodes before the weight's first reader where the region may start
AHEAD = 60  # nodes after it where the output may be
TAIL = 40   # nodes after the output where the state may be written
CANDIDATES = 12  # output candidates tried per weight, latest first
XS = 3  # x candidates tried per output, latest first
OUTS = ("bct", "btc", "bc")  # the layouts of x and the output
WRITES = (ATEN.copy_.default, ATEN.copy.default)
CONVS = (ATEN.conv1d.default, ATEN.conv1d.padding, ATEN.convolution.default)
END = 2 ** 62  # slice ends at or beyond this mean "to the end"


@dataclass
class Layout:
    x: str  # "bct" | "btc" | "bc"
    state: str  # "cw" | "wc"
    out: str  # "bct" | "btc" | "bc"
    bias: bool
    activation: Optional[str]
    zero: bool = False  # zero history (a fresh cache): the op reads zeros, not the state
    exits: dict = field(default_factory=dict)  # exit -> ("state", "cw"/"wc") | ("out", l)


@dataclass
class Region:
    """A candidate: its nodes (graph order) and the leaves it reads."""

    out: fx.Node
    state: Optional[fx.Node]  # None: the graph neither reads nor writes one (zero history)
    weight: fx.Node
    x: fx.Node
    bias: Optional[fx.Node]
    nodes: list
    consts: list
    exits: list  # region nodes read outside it, other than ``out``
    state_written: bool  # the region writes S in place
    width: int  # W
    kernel: int


# --- finding candidates ------------------------------------------------------------------

def _is(dim, value: int) -> bool:
    """``dim`` is the int ``value`` (a symbolic size is not: comparing would add a guard)."""
    return type(dim) is int and dim == value


def _same(a, b) -> bool:
    """Two sizes equal for every value of their symbols (adds no guard)."""
    return statically_known_true(a == b)


def _is_leaf(node: fx.Node) -> bool:
    return node.op in ("placeholder", "get_attr")


def weight_seeds(graph: fx.Graph) -> list:
    """Depthwise-looking weights: [C, K] or [C, 1, K] leaves, 2 <= K <= 16, not yet fused."""
    seeds = []
    for node in graph.nodes:
        dims = shape(node)
        if not _is_leaf(node) or dims is None or dtype(node) not in FLOATS:
            continue
        if not all(type(d) is int for d in dims) or not node.users:
            continue
        if not (len(dims) == 2 or len(dims) == 3 and dims[1] == 1):
            continue
        if 2 <= dims[-1] <= MAX_KERNEL and \
                not any(u.target is CONV_OP for u in _near_users(node, 4)):
            seeds.append(node)
    return seeds


def _forward(starts, limit: int, order: dict) -> set:
    return reachable(starts, lambda node: [u for u in node.users
                                           if u.op != "output" and order[u] <= limit])


def _backward(sinks, within: set) -> set:
    return reachable([s for s in sinks if s in within],
                     lambda node: [a for a in node.all_input_nodes if a in within])


def _kinds(dims, channels: int, kinds) -> list:
    """The kinds of ``kinds`` that put ``channels`` where ``dims`` has it."""
    where = {"bc": (2, 1), "bct": (3, 1), "cw": (3, 1), "btc": (3, 2), "wc": (3, 2)}
    return [k for k in kinds if dims is not None and len(dims) == where[k][0]
            and _is(dims[where[k][1]], channels)]


def _seq(dims, layout):
    return {"bct": lambda: dims[2], "btc": lambda: dims[1], "bc": lambda: 1}[layout]()


def _out_candidates(weight: fx.Node, order: dict) -> list:
    """Nodes computed from the weight shaped like an output, latest first; those computed
    from another matrix (a projection after the conv, whose width may be C too) last."""
    channels, kernel = shape(weight)[0], shape(weight)[-1]
    first = min(order[u] for u in weight.users)
    near = _forward([weight], first + AHEAD, order) - {weight}
    found = [n for n in near if n.op == "call_function" and dtype(n) in FLOATS
             and _kinds(shape(n), channels, OUTS)]
    foreign = [n for n in near if any(
        _is_leaf(a) and a is not weight and len(shape(a) or ()) > 1
        and not _state_like(a, channels, kernel) for a in n.all_input_nodes)]
    later = reachable(foreign, lambda n: [u for u in n.users if u in near])
    found.sort(key=lambda n: (n in later, -order[n]))
    return found[:CANDIDATES]


def _state_like(node: fx.Node, channels: int, kernel: int) -> bool:
    dims = shape(node)
    return dtype(node) in FLOATS and any(
        _is(dims[2 if kind == "cw" else 1], kernel) or _is(dims[2 if kind == "cw" else 1],
                                                            kernel - 1)
        for kind in _kinds(dims, channels, ("cw", "wc")))


def _x_like(node: fx.Node, out: fx.Node, channels: int) -> bool:
    """Shaped like an x the update of ``out`` reads: its channels, as many samples."""
    dims, out_dims = shape(node), shape(out)
    return dtype(node) in FLOATS and any(
        _same(_seq(dims, xk), _seq(out_dims, ok)) for xk in _kinds(dims, channels, OUTS)
        for ok in _kinds(out_dims, channels, OUTS))


def _inputs_of(out: fx.Node, weight: fx.Node, nodes: list, order: dict) -> list:
    """(state, x) pairs a region ending at ``out`` may have: state-shaped nodes it reads or
    that a copy writes into (a leaf, a clone, a fresh cache's zeros), latest first; for
    each, nodes shaped like x it reads that neither the weight, the state nor a bias computes,
    latest first."""
    channels, kernel = shape(weight)[0], shape(weight)[-1]
    lo = max(min(order[u] for u in weight.users) - BACK, 0)

    def back(node):
        if node is not out and (_is_leaf(node) or order[node] < lo):
            return []
        return [a for a in node.all_input_nodes + view_writes(base_of(node)) if a is not weight]

    seen = reachable([out], back) - {out}
    written = {base_of(n.args[0]) for n in nodes[lo:order[out] + TAIL] if n.target in WRITES}
    pairs = []
    for state in sorted((n for n in seen | written if _state_like(n, channels, kernel)),
                        key=order.__getitem__, reverse=True):
        own = _forward([weight, state], order[out], order)
        xs = [n for n in seen - own if _x_like(n, out, channels) and _bias_chain(n, channels)
              is None]
        pairs += [(state, x) for x in sorted(xs, key=order.__getitem__, reverse=True)[:XS]]
    # last, no state: a zero history whose new state the program hands out (core aten's
    # buffer mutation is an output, with no write in the graph)
    own = _forward([weight], order[out], order)
    xs = [n for n in seen - own if _x_like(n, out, channels) and _bias_chain(n, channels) is None]
    return pairs + [(None, x) for x in sorted(xs, key=order.__getitem__, reverse=True)[:XS]]


def _bias_chain(node: fx.Node, channels: int) -> Optional[list]:
    """``node`` computed from one [C] leaf by one-input ops: the chain (leaf first), else None."""
    chain = [node]
    while not _is_leaf(chain[0]):
        inputs = chain[0].all_input_nodes
        if chain[0].op != "call_function" or len(inputs) != 1 or len(chain) > 6:
            return None
        chain.insert(0, inputs[0])
    if list(shape(chain[0]) or []) != [channels]:
        return None
    return chain


def build_region(out: fx.Node, state: fx.Node, weight: fx.Node, x: fx.Node,
                 order: dict) -> Region:
    """The candidate region between (S, w, x) and ``out``; NoMatch when it reads other
    tensors."""
    channels, kernel = shape(weight)[0], shape(weight)[-1]
    limit = order[out] + TAIL
    near = _forward([n for n in (state, weight, x) if n is not None], limit, order)
    # a buffer made from literals (empty, zeros) that the region writes S or x into
    made = {base_of(n.args[0]) for n in near if is_mutation(n)}
    made = [m for m in made if m not in near and evaluable(m) and m.op == "call_function"]
    if made:
        near |= _forward(made, limit, order)
    # in-place writes into S (directly or through a view) and state values handed out
    writes = [n for n in near if is_mutation(n) and base_of(n.args[0]) is state]
    sinks = [out] + writes + [n for n in near if _hands_out_state(n, state, channels, kernel)]
    if len(sinks) == 1 and state is None:
        raise NoMatch("no state: a causal conv without a cache is no update", node=out)
    nodes = _backward(sinks, near)
    while True:  # in-place writes into the region's own values belong to it
        more = [n for n in near if n not in nodes and is_mutation(n)
                and (base_of(n.args[0]) in nodes or base_of(n.args[0]) is state)]
        if not more:
            break
        nodes |= _backward(more, near)
    nodes -= {state, weight, x}
    weight = _flat(weight, nodes)
    bias, consts = _leaves(nodes, (state, weight, x), channels, order, out)
    ordered = sorted(nodes, key=order.__getitem__)
    exits = [n for n in ordered if n is not out and any(
        u not in nodes and u.target is not ASSERT_META for u in n.users)]
    for node in ordered:
        if is_mutation(node):
            target = base_of(node.args[0])
            if target is not state and target not in nodes:
                raise NoMatch(f"{node.name} writes {target.name} in place, which is neither "
                              "the state nor the region's own", node=node)
    return Region(out, state, weight, x, bias, ordered, consts, exits,
                  any(is_mutation(n) and base_of(n.args[0]) is state for n in ordered),
                  _width(state, channels, kernel) if state is not None else kernel, kernel)


def _flat(weight: fx.Node, nodes: set) -> fx.Node:
    """The region's one reader of a [C, 1, K] weight when it squeezes it to [C, K] (taken out
    of the region: the op reads it as it is), else the weight."""
    readers = [n for n in nodes if weight in n.all_input_nodes]
    flat = readers[0] if len(readers) == 1 else None
    if flat is None or flat.target not in (ATEN.squeeze.dim, ATEN.squeeze.dims) \
            or len(shape(flat)) != 2:
        return weight
    nodes.discard(flat)
    return flat


def _leaves(nodes: set, given: tuple, channels: int, order: dict, out: fx.Node) -> tuple:
    """(bias, constants) the region reads besides ``given``; adds a bias's casts to
    ``nodes``; NoMatch when it reads another tensor."""
    bias, consts = None, []
    for node in sorted(nodes, key=order.__getitem__):
        for arg in node.all_input_nodes:
            if arg in nodes or arg in given:
                continue
            chain = _bias_chain(arg, channels)
            if chain is not None and (bias is None or bias is chain[0]):
                bias = chain[0]
                nodes |= set(chain[1:])
            elif evaluable(arg):
                consts.append(arg)
            else:
                raise NoMatch(f"the region reads {arg.name} besides x, the state and the "
                              "weight", node=out)
    return bias, consts


def _hands_out_state(node: fx.Node, state: Optional[fx.Node], channels: int, kernel: int
                     ) -> bool:
    """A state-shaped value the program returns, or copies into another tensor (a functional
    copy itself stays outside: it reads the value the fused node hands out)."""
    dims, want = shape(node), shape(state)
    if node.target is ATEN.copy.default or dims is None or len(dims) != 3:
        return False
    if want is None and not _state_like(node, channels, kernel) or want is not None and not any(
            all(map(_same, dims, order)) for order in (want, (want[0], want[2], want[1]))):
        return False
    for user in node.users:
        if user.op == "output":
            return True
        if user.target in WRITES and len(user.args) > 1 and user.args[1] is node:
            return True
    return False


def _width(state: fx.Node, channels: int, kernel: int) -> int:
    dims = shape(state)
    return dims[2] if _is(dims[1], channels) and dims[2] in (kernel - 1, kernel) else dims[1]


# --- deciding by evaluation ------------------------------------------------------------------

def cut_out(region: Region) -> fx.GraphModule:
    """(x, S, w[, bias]) -> (out, S, exits...)."""
    graph = fx.Graph()
    env = {region.x: graph.placeholder("x"), region.state: graph.placeholder("state"),
           region.weight: graph.placeholder("weight")}  # a state of None: read by nothing
    if region.bias is not None:
        env[region.bias] = graph.placeholder("bias")
    for const in region.consts:
        copy_constant(graph, const, env)
    for node in region.nodes:
        env[node] = graph.node_copy(node, lambda n: env[n])
    graph.output((env[region.out], env[region.state], *[env[e] for e in region.exits]))
    owner = region.out.graph.owning_module or torch.nn.Module()
    return fx.GraphModule(owner, graph)


def _fused(region: Region, layout: Layout, x, s, w, b) -> tuple:
    """(out, new state), channel-first, that the fused node computes from the region's
    operands (the op's own kernel: float64 at float64 inputs, else in their dtypes)."""
    s = _to_first(s, layout.state)
    s = torch.zeros_like(s) if layout.zero else s
    if region.width == region.kernel - 1:  # a K - 1 state: one zero sample in front
        s = F.pad(s, [1, 0])
    out, new = CONV_OP(_to_first(x, layout.x), s, w.reshape(w.shape[0], -1),
                       b if layout.bias else None, layout.activation)
    return out, new[..., new.shape[-1] - region.width:]


def _to_first(value, layout, back: bool = False):
    """``value`` in ``layout`` as channel-first [B, C, T] (``back``: the other way)."""
    if layout in ("btc", "wc"):
        return value.transpose(1, 2)
    if layout == "bc":
        return value.squeeze(-1) if back else value.unsqueeze(-1)
    return value


def _from_first(value, layout):
    return _to_first(value, layout, back=True)


def _rel(a, b) -> float:
    """evaluator.rel of tensors of one shape (inf for other shapes: a transposed state, and
    for a value that is no tensor: a region exit that is a list, as Mamba1's split)."""
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor) or \
            a.shape != b.shape:
        return float("inf")
    return rel(a, b)


def _sizes(node: fx.Node, at: Optional[dict] = None) -> list:
    """``node``'s shape at concrete sizes: each symbol at ``at``'s value, else its hint."""
    return [dim if type(dim) is int else int(sympy.sympify(dim.node.expr).xreplace(
        at or {}).xreplace(dim.node.shape_env.backed_var_to_val)) for dim in shape(node)]


def _operands(region: Region) -> list:
    return [n for n in (region.x, region.state, region.weight, region.bias) if n is not None]


def _draw(region: Region, gen, at: Optional[dict] = None) -> list:
    """x, the state, the weight and the bias, drawn in float64."""
    batch, channels = _sizes(region.x, at)[0], shape(region.weight)[0]
    dims = [_sizes(region.x, at), _sizes(region.state, at) if region.state is not None
            else [batch, channels, region.width], _sizes(region.weight)]
    drawn = [torch.rand(d, generator=gen, dtype=torch.float64) * 2 - 1 for d in dims]
    if region.bias is not None:
        drawn.append(torch.rand(_sizes(region.bias), generator=gen, dtype=torch.float64) - .5)
    return drawn


def _layouts(region: Region) -> list:
    """Every reading of the operands the shapes allow; the zero history (a fresh cache: the
    op reads zeros) after the state's own."""
    channels, kernel = shape(region.weight)[0], region.kernel
    x_dims, s_dims, o_dims = shape(region.x), shape(region.state), shape(region.out)
    s_dims = s_dims or (x_dims[0], channels, kernel)
    states = [k for k in _kinds(s_dims, channels, ("cw", "wc"))
              if s_dims[2 if k == "cw" else 1] in (kernel - 1, kernel)]
    biases = (True, False) if region.bias is not None else (False,)
    return [Layout(xl, sl, ol, bias, act, zero) for zero, xl, sl, ol, bias, act in
            itertools.product((False, True) if region.state is not None else (True,),
                              _kinds(x_dims, channels, OUTS), states,
                              _kinds(o_dims, channels, OUTS), biases, (None, "silu"))
            if _same(_seq(o_dims, ol), _seq(x_dims, xl)) and _same(x_dims[0], s_dims[0])]


def decide(region: Region) -> Verdict:
    """The layout under which the region is the update, or the nearest miss."""
    listed = [n for n in region.exits if not isinstance(n.meta.get("val"), torch.Tensor)]
    if listed:  # (Mamba1's split of the conv's output into x, B, C, dt: no update's value)
        return Verdict(reason=f"its value {listed[0].name} ({op_name(listed[0])}, not one "
                       "tensor) is read outside it; the update hands out its output and state "
                       "only", region=region)
    module = cut_out(region)
    sampler = Sampler(module, module.graph, lambda gen: _draw(region, gen), "conv",
                      narrowing=True)  # _native runs it at its traced dtypes
    try:  # with points that reach both sides of each clamp, where... (evaluator.py)
        points = sampler.points()
    except NoMatch as miss:
        return Verdict(reason=miss.reason, region=region)
    except Exception as error:  # noqa: BLE001 (a region that does not run is no update)
        return Verdict(reason=f"the region does not run on its own: {error}", region=region)
    verdicts = [_score(region, layout, points) for layout in _layouts(region)]
    best = nearest(verdicts)
    if best.region is None:
        return Verdict(reason="no layout of x, state and output fits their shapes")
    if best.layout is None:
        best = min(verdicts, key=_rank)
        best.reason = sampler.named(best.reason)
        return best
    problem = _wide(region, best.layout, sampler) or _native(region, best.layout, module) or \
        _lengths(region, best.layout, module)
    if problem:
        return Verdict(None, best.out_error, best.state_error, best.layout, problem, region)
    return best


def _wide(region: Region, layout: Layout, sampler: Sampler) -> str:
    """Why the region, the update under ``layout`` at the ordinary points, is not it over the
    wide domain or breaks its linearity (evaluator.py): the new state is linear in (x,
    state) jointly, and so is the output, bias included, without an activation; ''."""
    kinds = ["linear", "linear", "plain"] + (["linear"] if region.bias is not None else [])
    exits = [i + 2 for i, node in enumerate(region.exits)
             if layout.activation is None or layout.exits.get(node, ("state",))[0] != "out"]
    outputs = ([0] if layout.activation is None else []) + \
        ([1] if region.state_written else []) + exits

    def error(points) -> float:
        verdict = _score(region, layout, points)
        return 0.0 if verdict.layout is not None else verdict.error

    linear = [0, 1] + ([3] if region.bias is not None else [])
    return wide_problem(sampler, kinds, error, linear, outputs)


def _score(region: Region, layout: Layout, draws) -> Verdict:
    worst_out, worst_state, roles, detail = 0.0, 0.0, {}, {}
    for before, got in draws:
        x, s, w = before[0], before[1], before[2]
        b = before[3] if layout.bias else None
        ref_out, ref_new = _fused(region, layout, x, s, w, b)
        want_out = _from_first(ref_out, layout.out)
        out, s_after, exits = got[0], got[1], got[2:]
        worst_out = max(worst_out, _rel(out, want_out))
        detail.setdefault("out", (out, ref_out, x, s, w, b))
        if region.state_written:
            worst_state = max(worst_state, _rel(s_after, _from_first(ref_new, layout.state)))
            detail.setdefault("state", (s_after, layout.state, x, s))
        for node, value in zip(region.exits, exits):
            role = _exit_role(value, want_out, ref_new, layout)
            if role is None:
                errs = [_rel(value, _from_first(ref_new, k)) for k in ("cw", "wc")]
                worst_state = max(worst_state, min(errs))
                detail.setdefault("state", (value, "cw" if errs[0] <= errs[1] else "wc", x, s))
            elif roles.get(node, role) != role:
                worst_state = max(worst_state, 1.0)
            else:
                roles[node] = role
    if not region.state_written and not any(r[0] == "state" for r in roles.values()) \
            and worst_state <= TOLERANCE:
        return Verdict(None, worst_out + 1.0, 0.0, layout, region=region,
                       reason=f"the region reads state {getattr(region.state, 'name', None)} "
                              "but writes no new state")
    if worst_out <= TOLERANCE and worst_state <= TOLERANCE:
        return Verdict(replace(layout, exits=roles), worst_out, worst_state, region=region)
    reason, slip = _explain(region, layout, worst_out, worst_state, detail)
    return Verdict(None, worst_out, worst_state, layout, reason, region, partial=slip)


# x, the state and the bias scaled so for the second run at the traced dtypes: large enough
# that a cast down to f16 inside an f32 region overflows (past ~1e3), small enough that a
# region traced in f16 holds its output (K taps of 4e3 stay below 65504)
NATIVE_WIDE = 4e3


def _native(region: Region, layout: Layout, module: fx.GraphModule) -> str:
    """Why the fused node would not hand out what the region does in its own dtypes ('' when
    it would): float64 sees no rounding, so the region also runs at the traced dtypes beside
    the op, at the ordinary draws and at them scaled by NATIVE_WIDE; every state value must
    agree bit for bit where it lands, the output within translation validation's bound."""
    for scale in (1.0, NATIVE_WIDE):
        problem = _native_at(region, layout, module, scale)
        if problem:
            return problem
    return ""


def _native_at(region: Region, layout: Layout, module: fx.GraphModule, scale: float) -> str:
    gen = torch.Generator().manual_seed(SEEDS["conv"])
    drawn = _draw(region, gen)
    drawn = [v if i == 2 else v * scale for i, v in enumerate(drawn)]  # the weight as drawn
    args = [v.to(dtype(n or region.x)) for v, n in zip(drawn, (
        region.x, region.state, region.weight, region.bias))]
    try:
        got = module(*[a.clone() for a in args])
    except Exception as error:  # noqa: BLE001 (a region that does not run is no update)
        return f"the region does not run in its traced dtypes: {error}"
    out, new = _fused(region, layout, *args[:3], args[3] if len(args) > 3 else None)
    made = {"out": _from_first(out, layout.out).to(dtype(region.out))}
    for role, kind in set(layout.exits.values()):
        made[role, kind] = _from_first(out if role == "out" else new, kind)
    pairs = [(region.out, got[0], made["out"], [dtype(region.out)])]
    if region.state_written:
        pairs.append((region.state, got[1], _from_first(new, layout.state), [dtype(region.state)]))
    pairs += [(n, v, made[layout.exits[n]], _lands(n)) for n, v in zip(region.exits, got[2:])]
    for node, value, fused, kinds in pairs:
        for kind in kinds:
            ok = (_rel(value.to(kind).double(), fused.to(kind).double()) <= BOUNDS[kind]
                  if node is region.out or layout.exits.get(node, ("",))[0] == "out"
                  else torch.equal(value.to(kind), fused.to(kind)))
            if not ok:
                return (f"in {kind} (as traced) the fused node would not hand out "
                        f"{node.name}'s value: the region rounds where the op does not")
    return ""


def _lands(node: fx.Node) -> list:
    """The dtypes a state value lands in: those of the tensors copies write it into, when only
    copies read it (they cast); else its own."""
    users = [u for u in node.users if u.target is not ASSERT_META]
    if users and all(u.target in WRITES and u.args[1] is node for u in users):
        return [dtype(u.args[0]) for u in users]
    return [dtype(node)]


def _lengths(region: Region, layout: Layout, module: fx.GraphModule) -> str:
    """Why the region, decided at the traced sizes, is not the update at some other value of
    its symbolic sizes ('' when it is the update at all of them).

    Every size the region computes must be affine in its symbols (S + K - 1, not S // 4):
    then, between two lengths where no two of those sizes swap order or cross zero (the roots
    of their differences), each slice, pad and view does the same thing with offsets affine
    in S, and two lengths there that agree with the op fix those offsets. So the region is
    run at the first two lengths of every such interval of each symbol's range (small ones:
    a range's far end may be a long context), the other symbols at their traced values."""
    dims = [d for n in region.nodes + _operands(region) for d in _dims(n) if type(d) is not int]
    sizes = {d.node.expr for d in dims}
    symbols = set().union(*(e.free_symbols for e in sizes))
    for expr in sizes:
        if not expr.is_polynomial(*symbols) or sympy.Poly(expr, *symbols).total_degree() > 1:
            return f"the region computes a size {expr} that is not affine in {sorted(symbols)}"
    gen = torch.Generator().manual_seed(SEEDS["conv"])
    for symbol, value in _critical(sizes, symbols, dims[0].node.shape_env if dims else None):
        if value is None:
            return f"no range is known for its size {symbol}"
        try:
            inputs = _draw(region, gen, {symbol: sympy.Integer(value)})
            got = Float64(module, graph=module.graph).run(*[t.clone() for t in inputs])
        except Exception:  # noqa: BLE001 (a length the region cannot run at is no update)
            got = None
        if got is None or _score(region, layout, [(inputs, got)]).layout is None:
            return f"it is the update at the traced sizes but not at {symbol} = {value}"
    return ""


def _dims(node: fx.Node) -> list:
    value = val(node)
    return [value] if isinstance(value, torch.SymInt) else list(shape(node) or ())


def _critical(sizes: set, symbols: set, env) -> list:
    """(symbol, value) pairs: each symbol's lowest two values, its traced value and the
    lengths around the roots of the differences of two sizes (or of a size and 0), in its
    range."""
    found = []
    for symbol in sorted(symbols, key=str):
        if symbol not in env.var_to_range or symbol not in env.backed_var_to_val:
            return [(symbol, None)]  # no range or no traced value: no length is proven
        low, high = env.var_to_range[symbol].lower, env.var_to_range[symbol].upper
        roots = {r for a in sizes | {sympy.Integer(0)} for b in sizes
                 if (a - b).free_symbols == {symbol} for r in sympy.solve(a - b, symbol)}
        values = {low, low + 1, env.backed_var_to_val[symbol]} | {
            sympy.floor(r) + d for r in roots for d in (-1, 0, 1, 2)}
        found += [(symbol, int(v)) for v in sorted(values) if low <= v <= high]
    return found


def _exit_role(value, want_out, ref_new, layout):
    if isinstance(value, torch.Tensor):
        if _rel(value, want_out) <= TOLERANCE:
            return ("out", layout.out)
        for kind in ("cw", "wc"):
            if _rel(value, _from_first(ref_new, kind)) <= TOLERANCE:
                return ("state", kind)
    return None


def _shifted(region: Region, layout: Layout, x, s, w, b, by: int):
    """The update's output, channel-first, with every window ``by`` samples later (zeros
    past either end of cat(state, x))."""
    first = _to_first(s, layout.state)
    full = torch.cat([torch.zeros_like(first) if layout.zero else first,
                      _to_first(x, layout.x)], -1)
    zeros = full.new_zeros(*full.shape[:2], abs(by))
    full = torch.cat([full[..., by:], zeros] if by > 0 else [zeros, full[..., :by]], -1)
    plain = replace(layout, x="bct", state="cw", zero=False)
    return _fused(region, plain, full[..., region.width:], full[..., :region.width], w, b)[0]


def _explain(region, layout, worst_out, worst_state, detail) -> tuple[str, bool]:
    """What is off, and whether a common slip explains it (named in the words)."""
    parts, slipped = [], False
    if worst_out > TOLERANCE and "out" in detail:
        out, ref_out, x, s, w, b = detail["out"]
        got = _to_first(out, layout.out)
        slips = {"its taps are in reverse order":
                 _fused(region, layout, x, s, w.reshape(w.shape[0], -1).flip(-1), b)[0]}
        slips.update({f"its windows are {abs(d)} sample{'s' * (abs(d) > 1)} "
                      + ("late: it reads samples after t" if d > 0 else "early"):
                      _shifted(region, layout, x, s, w, b, d) for d in (1, -1, 2, -2)})
        if b is not None and layout.activation == "silu":
            slips["the bias is added after the activation, not before"] = _fused(
                region, replace(layout, bias=False), x, s, w, None)[0] + b[:, None]
        named = [why for why, value in slips.items() if _rel(got, value) <= 1e-6]
        slipped = slipped or bool(named)
        parts.append(f"the output differs from the causal conv of cat(state, x) by "
                     f"{worst_out:.3g} relative" + (f" ({named[0]})" if named else ""))
    if worst_state > TOLERANCE and "state" in detail:
        value, kind, x, s = detail["state"]
        full = torch.cat([_to_first(s, layout.state), _to_first(x, layout.x)], -1)
        width = region.width
        got = _to_first(value, kind) if value.dim() == 3 else value
        slips = {f"it keeps the window {early} sample{'s' * (early > 1)} early":
                 full[..., full.shape[-1] - width - early:][..., :width]
                 for early in (1, 2) if full.shape[-1] - width - early >= 0}
        slips["the activation is applied to the kept samples"] = F.silu(
            full[..., full.shape[-1] - width:])
        named = [why for why, v in slips.items() if v.shape == got.shape
                 and _rel(got, v) <= 1e-6]
        slipped = slipped or bool(named)
        parts.append(f"the new state differs from the last {width} samples of cat(state, x) "
                     f"by {worst_state:.3g} relative" + (f" ({named[0]})" if named else ""))
    return "; ".join(parts) or "the region does not compute a conv update", slipped


# --- the rule ------------------------------------------------------------------------------

def plan_conv_updates(graph: fx.Graph) -> tuple[list[Fusion], list[Miss]]:
    """The rule: a fusion for every conv update found by meaning, a near-miss for each weight
    whose nearest region is not one."""
    proven, misses = find_updates(graph)
    order, mode = positions(graph), fake_mode_of(graph) if proven else None
    return [_fusion(verdict, order, mode) for verdict in proven], misses


def find_updates(graph: fx.Graph) -> tuple[list, list]:
    """(proven regions, near-misses) for every unfused weight."""
    nodes = list(graph.nodes)
    order = positions(graph)
    proven, misses, taken = [], [], set()
    for weight in weight_seeds(graph):
        found, closest = None, None
        for out in _out_candidates(weight, order):
            if out not in taken:
                found, closest = _first_fit(out, weight, nodes, order, taken, closest)
            if found is not None:
                break
        if found is not None:
            proven.append(found)
            taken |= set(found.region.nodes)
        elif closest is not None:
            misses.append(_miss(weight, closest))
    return proven, misses + _mixing(graph)


def _mixing(graph: fx.Graph) -> list[Miss]:
    """Near-misses for the 1-D convs that feed a state but mix channels (no weight of theirs
    is depthwise, so no region was cut around them)."""
    return [Miss(NAME, f"conv update: {conv.name} convolves across channels (weight "
                       f"{list(shape(conv.args[1]))}); an update convolves each channel alone",
                 node=conv.name) for conv in graph.nodes
            if _conv1d(conv) and shape(conv.args[1])[1] != 1 and _feeds_a_state(conv)]


def _first_fit(out: fx.Node, weight: fx.Node, nodes: list, order: dict, taken: set,
               closest: Optional[Verdict]) -> tuple:
    """(the first region ending at ``out`` that is the update, or None; the nearest miss so
    far)."""
    for state, x in _inputs_of(out, weight, nodes, order):
        verdict = _verdict(out, state, weight, x, order, taken)
        if verdict is None:
            continue
        if verdict.layout is not None:
            return verdict, closest
        if closest is None or _rank(verdict) < _rank(closest):
            closest = verdict
    return None, closest


def _rank(verdict: Verdict) -> tuple:
    """Misses nearest first: one about a region, one a common slip explains (``partial``: it
    names it), the least wrong."""
    return verdict.region is None, not verdict.partial, verdict.error


def _verdict(out: fx.Node, state: fx.Node, weight: fx.Node, x: fx.Node, order: dict,
             taken: set) -> Optional[Verdict]:
    """The verdict on the region between (``state``, ``weight``, ``x``) and ``out``; None when
    nothing there is shaped like an update (or it is a proven region's)."""
    try:
        region = build_region(out, state, weight, x, order)
    except NoMatch:  # not shaped like an update: silent
        return None
    if taken & set(region.nodes) or not region.nodes:
        return None
    verdict = decide(region)
    if verdict.region is None:
        return None  # no layout fits the shapes: not an update
    if verdict.layout is not None:
        try:
            _check_placement(region, order)
        except NoMatch as err:
            return Verdict(reason=err.reason, node=err.node)
    return verdict


def _miss(weight: fx.Node, verdict: Verdict) -> Miss:
    region = verdict.region
    return Miss(NAME, f"conv update by meaning (weight {weight.name}): {verdict.reason}",
                node=region.out.name if region is not None else verdict.node)


def _near_users(node: fx.Node, depth: int) -> set:
    found = set()
    for user in node.users:
        found.add(user)
        if depth > 1:
            found |= _near_users(user, depth - 1)
    return found


def _anchor(region: Region, order: dict) -> fx.Node:
    """The region's first node after its operands are ready (one computed from the inputs
    alone moves there: make_fx reads attributes right where they are used, a model squeezes
    its weight late)."""
    ready = max((order[n] for n in _operands(region) if not _movable(n)), default=-1)
    return next(n for n in region.nodes if order[n] > ready)


def _movable(node: fx.Node, depth: int = 0) -> bool:
    """Computed by pure calls from inputs and attributes that nothing writes (it can move)."""
    if _is_leaf(node):
        return not view_writes(node)
    return depth < 4 and is_pure(node) and all(
        _movable(a, depth + 1) for a in node.all_input_nodes)


def _check_placement(region: Region, order: dict) -> None:
    """The fused node can stand where its operands are ready and the region begins."""
    anchor = order[_anchor(region, order)]
    if any(order[n] < anchor and is_mutation(n) for n in region.nodes):
        raise NoMatch(f"x ({region.x.name}) is computed after the region starts writing",
                      node=region.x)
    inside = set(region.nodes)
    last = max(order[n] for n in region.nodes)
    for node in [region.out] + region.exits:
        for user in node.users:
            if user not in inside and order[user] < anchor:
                raise NoMatch(f"{user.name} reads {node.name} before x is ready", node=user)
            if user not in inside and is_mutation(user) and user.args[0] is node:
                raise NoMatch(f"{user.name} writes the region's value {node.name} in place",
                              node=user)
    if region.state_written:
        for user in region.state.users:
            if user not in inside and anchor <= order[user] <= last:
                raise NoMatch(f"{user.name} reads the state while the region updates it",
                              node=user)


def _fusion(verdict: Verdict, order: dict, mode) -> Fusion:
    region, layout = verdict.region, verdict.layout
    anchor = _anchor(region, order)
    own_zeros = is_zeros(region.state) and not any(  # a fresh cache's, unwritten until then
        is_mutation(u) and order[u] < order[anchor] for u in region.state.users)

    def emit(graph: fx.Graph, env) -> dict:
        def op(target, *args, **kwargs):
            return add_node(graph, target, args, kwargs, mode=mode)

        fused = op(CONV_OP, *_operands_in(op, env, region, layout, own_zeros),
                   layout.activation)
        out, new = op(operator.getitem, fused, 0), op(operator.getitem, fused, 1)
        if region.width == region.kernel - 1:
            new = op(ATEN.slice.Tensor, new, 2, 1, region.kernel)
        made = {"out": _finish(op, out, layout.out, dtype(region.out))}
        for node, (role, kind) in layout.exits.items():  # a copy casts what it writes itself
            want = dtype(node) if role == "out" or _lands(node) == [dtype(node)] else None
            made[node.name] = _finish(op, out if role == "out" else new, kind, want)
        if region.state_written:
            value = _finish(op, new, layout.state, dtype(region.state))
            op(ATEN.copy_.default, env(region.state), value)
        return made

    replace = {region.out: "out"}
    replace.update({node: node.name for node in layout.exits})
    late = sorted(reachable([n for n in _operands(region) if order[n] > order[anchor]],
                            lambda n: [a for a in n.all_input_nodes if order[a] > order[anchor]]),
                  key=order.__getitem__)
    return Fusion(region.out.name, anchor, emit, inputs=set(_operands(region)),
                  replace=replace, drop=set(region.nodes), hoist=late)


def _operands_in(op, env, region: Region, layout: Layout, own_zeros: bool) -> tuple:
    """(x, state, weight, bias) as the op reads them: channel-first, the state K samples long
    (zeros for a zero history: the graph's own when it has them ready), the weight [C, K]."""
    x = env(region.x)
    if layout.x == "btc":
        x = op(ATEN.transpose.int, x, 1, 2)
    elif layout.x == "bc":
        x = op(ATEN.unsqueeze.default, x, -1)
    state, like = region.state, region.state or region.x  # no state: zeros like x
    if layout.zero and not own_zeros:
        state = op(ATEN.zeros.default, [_size(op, x, 0), shape(region.weight)[0], region.width],
                   dtype=dtype(like), device=val(like).device)
    else:
        state = env(state)
        if layout.state == "wc":
            state = op(ATEN.transpose.int, state, 1, 2)
    if region.width == region.kernel - 1:
        state = op(ATEN.constant_pad_nd.default, state, [1, 0], 0.0)
    weight = env(region.weight)
    if len(shape(region.weight)) == 3:
        weight = op(ATEN.squeeze.dims, weight, [1])
    return x, state, weight, env(region.bias) if layout.bias else None


def _size(op, x: fx.Node, axis: int):
    size = shape(x)[axis]
    return size if type(size) is int else op(ATEN.sym_size.int, x, axis)


def _finish(op, value, kind, want):
    if kind in ("btc", "wc"):
        value = op(ATEN.contiguous.default, op(ATEN.transpose.int, value, 1, 2))
    elif kind == "bc":
        value = op(ATEN.squeeze.dims, value, [-1])
    if want is not None and dtype(value) != want:
        value = op(ATEN._to_copy.default, value, dtype=want)
    return value


# --- what is frozen at the traced length ---------------------------------------------------

def find_conv_updates(graph: fx.Graph) -> list[str]:
    """Conv updates left in ``graph`` whose output slice freezes S.

    A static export spells the update's ``[..., -S:]`` (and the prefill's ``[..., :K+S]``) with
    the traced S as a literal: run at another length, the graph keeps the wrong window. Found
    by structure: a 1-D conv that reads a cat on the time axis, or whose input's last K samples
    are kept (a state write), then a time slice with a literal bound among what follows it
    (the same batch and channels). Fused nodes and symbolic slices are fine and not listed.
    """
    found = []
    for conv in graph.nodes:
        if _conv1d(conv) and _feeds_a_state(conv):
            found += [f"conv update at node {conv.name} was not collapsed: {node.name} keeps "
                      f"[{_bounds(node)}] of the time axis, a bound fixed at the traced "
                      "sequence length" for node in _after(conv) if _bounds(node)]
    return found


def _conv1d(node: fx.Node) -> bool:
    """A convolution of a [B, C, T] input by a [C_out, C_in / groups, K] weight."""
    return node.target in CONVS and len(shape(node.args[0]) or ()) == 3 and \
        len(shape(node.args[1]) or ()) == 3


def _feeds_a_state(conv: fx.Node) -> bool:
    """The conv reads (through casts) a cat on the time axis, or samples a slice keeps."""
    kernel, node = shape(conv.args[1])[-1], conv.args[0]
    while node.op == "call_function" and len(node.all_input_nodes) == 1 \
            and _same_shape(node.all_input_nodes[0], node):
        if any(u.target is ATEN.slice.Tensor and _same(shape(u)[-1], kernel) for u in node.users):
            return True
        node = node.all_input_nodes[0]
    return node.target is ATEN.cat.default and list(node.args[1:2]) in ([2], [-1]) or any(
        u.target is ATEN.slice.Tensor and _same(shape(u)[-1], kernel) for u in node.users)


def _same_shape(a, b) -> bool:
    dims, want = shape(a), shape(b)
    return dims is not None and len(dims) == len(want) and all(map(_same, dims, want))


def _after(conv: fx.Node) -> set:
    """What follows the conv with its batch and channels (slices, SiLU, casts)."""
    keep = shape(conv)[:2]
    return reachable([conv], lambda n: [u for u in n.users if len(shape(u) or ()) == 3
                                        and all(map(_same, shape(u)[:2], keep))]) - {conv}


def _bounds(node: fx.Node) -> str:
    """'start:end' of a time slice with a literal bound counted from the end or a literal
    end; '' for any other node."""
    if node.target is not ATEN.slice.Tensor or list(node.args[1:2]) not in ([2], [-1]):
        return ""
    start, end = (list(node.args[2:4]) + [None, None])[:2]
    if not (type(start) is int and start < 0 or type(end) is int and 0 < end < END):
        return ""
    start = "" if start in (None, 0) else start
    return f"{start}:{'' if end is None or type(end) is int and end >= END else end}"
