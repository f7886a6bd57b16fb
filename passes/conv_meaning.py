"""The conv update recognized by what it computes, whatever ops spell it.

Found by structure (cheaply): a depthwise weight ``w`` [C, K] or [C, 1, K] (a parameter or
buffer) read near a state ``S`` [B, C, W] or [B, W, C] with W = K or K - 1 (an input or
buffer). The candidate region is what lies between them and a candidate output ``o`` (a node
computed from ``w`` shaped [B, C, T], [B, T, C] or [B, C]): the ancestors of ``o`` and of the
state's writes (in-place writes into S or its views, a state-shaped value the program hands
out or copies elsewhere) that are computed from S, w or a [C] bias, plus every in-place write
into those values. What else the region reads is x ([B, C, T], [B, T, C] or [B, C]) and
constants.

Decided by meaning: the region is cut out as a small graph and run in float64 at random x, S,
w and bias, next to the update

    full = cat(S, x) (S padded with one zero sample in front when W = K - 1)
    out  = act(bias + sum_k w[:, k] * full[..., t + 1 + k])        t = 0 .. T - 1
    new  = full[..., -W:]

under every layout the shapes allow (x, S and o channel-first or channel-last, x and o 2-D at
T = 1; with or without the bias; SiLU or no activation). The region fuses when, for one layout,
o and every value it hands out (the new state: S after the run, or the state-shaped values read
outside) agree to 1e-9 relative at two points. Otherwise the nearest layout says what is off.

The rewrite (rebuild.py) emits ``causal_conv1d_update`` where the region's operands are all
ready, with transposes, the zero sample of a K - 1 state and the slice back outside the node;
the region's nodes go, an in-place state write becomes one ``copy_(S, new_state)``.
"""

from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass, field, replace
from typing import Optional

import torch
import torch.nn.functional as F
from torch import fx

from gdn_fx.passes.program import (ASSERT_META, ATEN, add_node, base_of, dtype, fake_mode_of,
                                   is_mutation, positions, reachable, shape, view_writes)
from gdn_fx.passes.rebuild import Fusion
from gdn_fx.passes.result import Miss, NoMatch
from gdn_fx.passes.evaluator import (TOLERANCE, Sampler, Verdict, copy_constant, evaluable,
                                     nearest, rel)

NAME = "causal_conv1d_update"
CONV_OP = torch.ops.gdn_fx.causal_conv1d_update.default
FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
MAX_KERNEL = 16
BACK = 60   # nodes before the weight's first reader where the region may start
AHEAD = 60  # nodes after it where the output may be
TAIL = 40   # nodes after the output where the state may be written
CANDIDATES = 12  # output candidates tried per weight, latest first


@dataclass
class Layout:
    x: str  # "bct" | "btc" | "bc"
    state: str  # "cw" | "wc"
    out: str  # "bct" | "btc" | "bc"
    bias: bool
    activation: Optional[str]
    exits: dict = field(default_factory=dict)  # exit -> ("state", "cw"/"wc") | ("out", l)


@dataclass
class Region:
    """A candidate: its nodes (graph order) and the leaves it reads."""

    out: fx.Node
    state: fx.Node
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

def _static(dims) -> bool:
    return dims is not None and all(isinstance(d, int) for d in dims)


def _is_leaf(node: fx.Node) -> bool:
    return node.op in ("placeholder", "get_attr")


def weight_seeds(graph: fx.Graph, claimed: frozenset = frozenset()) -> list:
    """Depthwise-looking weights: [C, K] or [C, 1, K] leaves, 2 <= K <= 16, not yet fused
    (by an earlier collapse, or by the structural rule's plans on ``claimed`` convs)."""
    seeds = []
    for node in graph.nodes:
        if not _is_leaf(node):
            continue
        dims = shape(node)
        if not _static(dims) or dtype(node) not in FLOATS:
            continue
        if not (len(dims) == 2 or len(dims) == 3 and dims[1] == 1):
            continue
        if not 2 <= dims[-1] <= MAX_KERNEL or not node.users:
            continue
        if any(u.target is CONV_OP or u in claimed for u in _near_users(node, 4)):
            continue
        seeds.append(node)
    return seeds


def _forward(starts, limit: int, order: dict) -> set:
    return reachable(starts, lambda node: [u for u in node.users
                                           if u.op != "output" and order[u] <= limit])


def _backward(sinks, within: set) -> set:
    return reachable([s for s in sinks if s in within],
                     lambda node: [a for a in node.all_input_nodes if a in within])


def _out_candidates(weight: fx.Node, order: dict, channels: int) -> list:
    first = min(order[u] for u in weight.users)
    near = _forward([weight], first + AHEAD, order) - {weight}
    found = []
    for node in near:
        dims = shape(node)
        if node.op != "call_function" or not _static(dims) or dtype(node) not in FLOATS:
            continue
        if len(dims) == 3 and channels in dims[1:] or len(dims) == 2 and dims[1] == channels:
            found.append(node)
    found.sort(key=order.__getitem__, reverse=True)
    return found[:CANDIDATES]


def _state_candidates(out: fx.Node, weight: fx.Node, order: dict, channels: int,
                      kernel: int) -> list:
    first = min(order[u] for u in weight.users)
    lo = first - BACK
    seen, todo, found = set(), [out], []
    while todo:
        node = todo.pop()
        for arg in node.all_input_nodes + view_writes(base_of(node)):
            if arg in seen or arg is weight:
                continue
            seen.add(arg)
            if _is_leaf(arg):
                dims = shape(arg)
                if _static(dims) and len(dims) == 3 and dtype(arg) in FLOATS and (
                        dims[1] == channels and dims[2] in (kernel - 1, kernel)
                        or dims[2] == channels and dims[1] in (kernel - 1, kernel)):
                    found.append(arg)
            elif order[arg] >= lo:
                todo.append(arg)
    found.sort(key=order.__getitem__)
    return found


def _bias_chain(node: fx.Node, channels: int) -> Optional[list]:
    """``node`` computed from one [C] leaf by one-input ops: the chain (leaf first), else None."""
    chain = [node]
    while not _is_leaf(chain[0]):
        inputs = chain[0].all_input_nodes
        if chain[0].op != "call_function" or len(inputs) != 1 or len(chain) > 6:
            return None
        chain.insert(0, inputs[0])
    if shape(chain[0]) != (channels,) and list(shape(chain[0]) or []) != [channels]:
        return None
    return chain


def build_region(out: fx.Node, state: fx.Node, weight: fx.Node, order: dict) -> Region:
    """The candidate region between (S, w) and ``out``; NoMatch when it reads other tensors."""
    channels, kernel = shape(weight)[0], shape(weight)[-1]
    limit = order[out] + TAIL
    near = _forward([state, weight], limit, order)
    # a buffer made from literals (empty, zeros) that the region writes S or x into
    made = {base_of(n.args[0]) for n in near if is_mutation(n)}
    made = [m for m in made if m not in near and evaluable(m) and m.op == "call_function"]
    if made:
        near |= _forward(made, limit, order)
    # in-place writes into S (directly or through a view) and state values handed out
    writes = [n for n in near if is_mutation(n) and base_of(n.args[0]) is state]
    sinks = [out] + writes + [n for n in near if _hands_out_state(n, state)]
    nodes = _backward(sinks, near)
    while True:  # in-place writes into the region's own values belong to it
        more = [n for n in near if n not in nodes and is_mutation(n)
                and (base_of(n.args[0]) in nodes or base_of(n.args[0]) is state)]
        if not more:
            break
        nodes |= _backward(more, near)
    nodes -= {state, weight}
    bias, consts, xs = None, [], []
    for node in sorted(nodes, key=order.__getitem__):
        for arg in node.all_input_nodes:
            if arg in nodes or arg is state or arg is weight:
                continue
            chain = _bias_chain(arg, channels)
            if chain is not None and (bias is None or bias is chain[0]):
                bias = chain[0]
                nodes |= set(chain[1:])
            elif evaluable(arg):
                consts.append(arg)
            elif arg not in xs:
                xs.append(arg)
    xs = [x for x in xs if x not in nodes]
    if len(xs) != 1:
        names = ", ".join(x.name for x in xs) or "nothing"
        raise NoMatch(f"the region between state {state.name} and weight {weight.name} reads "
                      f"{names} besides them; an update reads one input x", node=out)
    x = xs[0]
    ordered = sorted(nodes, key=order.__getitem__)
    kinds = {dtype(n) for n in ordered + [x, state, weight] + ([bias] if bias else [])
             if isinstance(dtype(n), torch.dtype) and dtype(n).is_floating_point}
    if len(kinds) > 1:  # float64 cannot see rounding: mixed precision stays structural
        raise NoMatch(f"the region computes in {sorted(map(str, kinds))}; by meaning only "
                      "one dtype throughout", node=out)
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
                  _width(state, channels, kernel), kernel)


def _hands_out_state(node: fx.Node, state: fx.Node) -> bool:
    """A state-shaped value the program returns, or copies into another tensor."""
    if shape(node) is None or sorted(shape(node)) != sorted(shape(state)):
        return False
    for user in node.users:
        if user.op == "output":
            return True
        if user.target in (ATEN.copy_.default, ATEN.copy.default) and len(user.args) > 1 \
                and user.args[1] is node:
            return True
    return False


def _width(state: fx.Node, channels: int, kernel: int) -> int:
    dims = shape(state)
    return dims[2] if dims[1] == channels and dims[2] in (kernel - 1, kernel) else dims[1]


# --- deciding by evaluation ------------------------------------------------------------------

def cut_out(region: Region) -> fx.GraphModule:
    """(x, S, w[, bias]) -> (out, S, exits...)."""
    graph = fx.Graph()
    env = {region.x: graph.placeholder("x"), region.state: graph.placeholder("state"),
           region.weight: graph.placeholder("weight")}
    if region.bias is not None:
        env[region.bias] = graph.placeholder("bias")
    for const in region.consts:
        copy_constant(graph, const, env)
    for node in region.nodes:
        env[node] = graph.node_copy(node, lambda n: env[n])
    graph.output((env[region.out], env[region.state], *[env[e] for e in region.exits]))
    owner = region.out.graph.owning_module or torch.nn.Module()
    return fx.GraphModule(owner, graph)


def update64(x, s, w, b, activation):
    """The update in float64, channel-first: x [B, C, T], s [B, C, W], w [C, K]."""
    kernel, width, seq = w.shape[-1], s.shape[-1], x.shape[-1]
    full = torch.cat([s, x], dim=-1)
    padded = torch.cat([full.new_zeros(*full.shape[:2], max(kernel - width, 0)), full], -1)
    start = padded.shape[-1] - seq - kernel + 1
    out = sum(w[:, k, None] * padded[..., start + k: start + k + seq] for k in range(kernel))
    if b is not None:
        out = out + b[:, None]
    if activation == "silu":
        out = F.silu(out)
    return out, full[..., full.shape[-1] - width:]


def _to_first(value, layout, back: bool = False):
    """``value`` in ``layout`` as channel-first [B, C, T] (``back``: the other way)."""
    if layout in ("btc", "wc"):
        return value.transpose(1, 2)
    if layout == "bc":
        return value.squeeze(-1) if back else value.unsqueeze(-1)
    return value


def _from_first(value, layout):
    return _to_first(value, layout, back=True)


def _layouts(dims: tuple, channels: int, kinds) -> list:
    """The kinds of ``kinds`` that put ``channels`` where ``dims`` has it."""
    where = {"bc": (2, 1), "bct": (3, 1), "cw": (3, 1), "btc": (3, 2), "wc": (3, 2)}
    return [k for k in kinds if len(dims) == where[k][0] and dims[where[k][1]] == channels]


def _seq(dims, layout) -> int:
    return {"bct": lambda: dims[2], "btc": lambda: dims[1], "bc": lambda: 1}[layout]()


def _rel(a, b) -> float:
    """evaluator.rel of tensors of one shape (inf for other shapes: a transposed state)."""
    return rel(a, b) if a.shape == b.shape else float("inf")


def decide(region: Region) -> Verdict:
    """The layout under which the region is the update, or the nearest miss."""
    module = cut_out(region)
    channels, kernel = shape(region.weight)[0], region.kernel

    def draw(gen):
        args = [torch.rand(shape(n), generator=gen, dtype=torch.float64) * 2 - 1
                for n in (region.x, region.state, region.weight)]
        if region.bias is not None:
            args.append(torch.rand(shape(region.bias), generator=gen, dtype=torch.float64) - .5)
        return args

    sampler = Sampler(module, module.graph, draw, "conv")
    try:  # with points that reach both sides of each clamp, where... (evaluator.py)
        points = sampler.points()
    except NoMatch as miss:
        return Verdict(reason=miss.reason, region=region)
    except Exception as error:  # noqa: BLE001 (a region that does not run is no update)
        return Verdict(reason=f"the region does not run on its own: {error}", region=region)
    x_kinds = _layouts(shape(region.x), channels, ("bct", "btc", "bc"))
    s_kinds = [k for k in _layouts(shape(region.state), channels, ("cw", "wc"))
               if shape(region.state)[2 if k == "cw" else 1] in (kernel - 1, kernel)]
    o_kinds = _layouts(shape(region.out), channels, ("bct", "btc", "bc"))
    biases = (True, False) if region.bias is not None else (False,)
    layouts = [Layout(xl, sl, ol, bias, act) for xl, sl, ol, bias, act in itertools.product(
        x_kinds, s_kinds, o_kinds, biases, (None, "silu"))
        if _seq(shape(region.out), ol) == _seq(shape(region.x), xl)
        and shape(region.x)[0] == shape(region.state)[0]]
    best = nearest(_score(region, layout, points) for layout in layouts)
    if best.region is None:
        return Verdict(reason="no layout of x, state and output fits their shapes")
    if best.layout is None:
        best.reason = sampler.named(best.reason)
    return best


def _score(region: Region, layout: Layout, draws) -> Verdict:
    worst_out, worst_state, roles, detail = 0.0, 0.0, {}, {}
    for before, got in draws:
        x, s, w = before[0], before[1], before[2]
        b = before[3] if layout.bias else None
        ref_out, ref_new = update64(_to_first(x, layout.x), _to_first(s, layout.state),
                                    w.reshape(w.shape[0], -1), b, layout.activation)
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
                       reason=f"the region reads state {region.state.name} but writes no new "
                              "state")
    if worst_out <= TOLERANCE and worst_state <= TOLERANCE:
        return Verdict(replace(layout, exits=roles), worst_out, worst_state, region=region)
    return Verdict(None, worst_out, worst_state, layout, region=region,
                   reason=_explain(region, layout, worst_out, worst_state, detail))


def _exit_role(value, want_out, ref_new, layout):
    if isinstance(value, torch.Tensor):
        if _rel(value, want_out) <= TOLERANCE:
            return ("out", layout.out)
        for kind in ("cw", "wc"):
            if _rel(value, _from_first(ref_new, kind)) <= TOLERANCE:
                return ("state", kind)
    return None


def _explain(region, layout, worst_out, worst_state, detail) -> str:
    """What is off, with the common slips named."""
    parts = []
    if worst_out > TOLERANCE and "out" in detail:
        out, ref_out, x, s, w, b = detail["out"]
        got = _to_first(out, layout.out)
        slips = {
            "its taps are in reverse order": update64(_to_first(x, layout.x),
                                                      _to_first(s, layout.state),
                                                      w.reshape(w.shape[0], -1).flip(-1), b,
                                                      layout.activation)[0],
        }
        if b is not None and layout.activation == "silu":
            slips["the bias is added after the activation, not before"] = update64(
                _to_first(x, layout.x), _to_first(s, layout.state), w.reshape(w.shape[0], -1),
                None, "silu")[0] + b[:, None]
        named = [why for why, value in slips.items() if _rel(got, value) <= 1e-6]
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
        parts.append(f"the new state differs from the last {width} samples of cat(state, x) "
                     f"by {worst_state:.3g} relative" + (f" ({named[0]})" if named else ""))
    return "; ".join(parts) or "the region does not compute a conv update"


# --- the rule ------------------------------------------------------------------------------

def find_updates(graph: fx.Graph, claimed: frozenset = frozenset()) -> tuple[list, list]:
    """(proven regions, near-misses with the region's nodes) for every unfused weight
    (``claimed``: convs the structural rule plans to fuse)."""
    order = positions(graph)
    proven, misses, taken = [], [], set()
    for weight in weight_seeds(graph, claimed):
        channels, kernel = shape(weight)[0], shape(weight)[-1]
        found, closest = None, None
        for out in _out_candidates(weight, order, channels):
            if out in taken:
                continue
            for state in _state_candidates(out, weight, order, channels, kernel):
                verdict = _verdict(out, state, weight, order, taken)
                if verdict is None:
                    continue
                if verdict.layout is not None:
                    found = verdict
                    break
                if closest is None or verdict.error < closest.error or (
                        closest.region is None and verdict.region is not None):
                    closest = verdict
            if found is not None:
                break
        if found is not None:
            proven.append(found)
            taken |= set(found.region.nodes)
        elif closest is not None:
            misses.append(_miss(weight, closest))
    return proven, misses


def _verdict(out: fx.Node, state: fx.Node, weight: fx.Node, order: dict,
             taken: set) -> Optional[Verdict]:
    """The verdict on the region between (``state``, ``weight``) and ``out``; None when
    nothing there is shaped like an update (or it is a proven region's)."""
    try:
        region = build_region(out, state, weight, order)
    except NoMatch:  # not shaped like an update: silent
        return None
    if taken & set(region.nodes):
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


def _miss(weight: fx.Node, verdict: Verdict) -> tuple:
    """(the near-miss, the names of the nodes it is about)."""
    region = verdict.region
    nodes = {n.name for n in _near_users(weight, 3)}
    if region is not None:
        nodes |= {n.name for n in region.nodes} | {region.state.name}
    return (Miss(NAME, f"conv update by meaning (weight {weight.name}): {verdict.reason}",
                 node=region.out.name if region is not None else verdict.node), nodes)


def _near_users(node: fx.Node, depth: int) -> set:
    found = set()
    for user in node.users:
        found.add(user)
        if depth > 1:
            found |= _near_users(user, depth - 1)
    return found


def _anchor(region: Region, order: dict) -> fx.Node:
    ready = max(order[n] for n in (region.x, region.state, region.weight, region.bias)
                if n is not None)
    return next(n for n in region.nodes if order[n] > ready)


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


def plan_by_meaning(graph: fx.Graph, missed: set, claimed: frozenset
                    ) -> tuple[list[Fusion], list[Miss], set]:
    """Fusions for every conv update found by meaning; near-misses for the regions that are
    not.

    ``missed``: names of the convs the structural rule left with a near-miss; a weight one of
    them reads keeps that near-miss (it is more specific) instead of adding its own.
    ``claimed``: the convs the structural rule fuses (their weights are not tried). Returns
    (fusions, near-misses, names of the nodes of the regions fused: an old near-miss there is
    moot).
    """
    proven, found_misses = find_updates(graph, claimed)
    misses = [miss for miss, nodes in found_misses if not nodes & missed]
    fusions, moot, mode = [], set(), None
    order = positions(graph)
    for verdict in proven:
        mode = mode or fake_mode_of(graph)
        fusions.append(_fusion(verdict, order, mode))
        region = verdict.region
        moot |= {n.name for n in region.nodes + [region.state, region.x]}
    return fusions, misses, moot


def _fusion(verdict: Verdict, order: dict, mode) -> Fusion:
    region, layout = verdict.region, verdict.layout
    kernel, width = region.kernel, region.width

    def emit(graph: fx.Graph, env) -> dict:
        def op(target, *args, **kwargs):
            return add_node(graph, target, args, kwargs, mode=mode)

        x = env(region.x)
        if layout.x == "btc":
            x = op(ATEN.transpose.int, x, 1, 2)
        elif layout.x == "bc":
            x = op(ATEN.unsqueeze.default, x, -1)
        state = env(region.state)
        if layout.state == "wc":
            state = op(ATEN.transpose.int, state, 1, 2)
        if width == kernel - 1:
            state = op(ATEN.constant_pad_nd.default, state, [1, 0], 0.0)
        weight = env(region.weight)
        if len(shape(region.weight)) == 3:
            weight = op(ATEN.squeeze.dims, weight, [1])
        bias = env(region.bias) if layout.bias else None
        fused = op(CONV_OP, x, state, weight, bias, layout.activation)
        out = op(operator.getitem, fused, 0)
        new = op(operator.getitem, fused, 1)
        if width == kernel - 1:
            new = op(ATEN.slice.Tensor, new, 2, 1, kernel)
        made = {"out": _finish(op, out, layout.out, dtype(region.out))}
        for node, (role, kind) in layout.exits.items():
            source = out if role == "out" else new
            made[node.name] = _finish(op, source, kind, dtype(node))
        if region.state_written:
            value = _finish(op, new, layout.state, dtype(region.state))
            op(ATEN.copy_.default, env(region.state), value)
        return made

    replace = {region.out: "out"}
    replace.update({node: node.name for node in layout.exits})
    return Fusion(region.out.name, _anchor(region, order), emit,
                  inputs={n for n in (region.x, region.state, region.weight, region.bias) if n},
                  replace=replace, drop=set(region.nodes))


def _finish(op, value, kind, want):
    if kind in ("btc", "wc"):
        value = op(ATEN.contiguous.default, op(ATEN.transpose.int, value, 1, 2))
    elif kind == "bc":
        value = op(ATEN.squeeze.dims, value, [-1])
    if dtype(value) != want:
        value = op(ATEN._to_copy.default, value, dtype=want)
    return value
