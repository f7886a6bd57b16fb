"""Rule: a causal conv1d update becomes one ``gdn_fx::causal_conv1d_update`` node.

Search pattern (read by conv_patterns.py):
    full = cat(state, x) | pad(x, [Z, 0]) | x;    state <- full[..., -K:]
    out = act(conv1d(full.to(w.dtype), w.unsqueeze(1), bias, padding=P, groups=C)[..., window])
          .to(x.dtype)
Rewrite:  out, new_state = causal_conv1d_update(x, state or zeros, w, bias, act)
          out's readers -> out;  each state write of full[..., -K:] -> new_state (an in-place
          copy_ stays in place, a functional copy or a mutation output reads new_state).
Guards (each failure is a near-miss; the region stays as it was): a 1-D depthwise conv, stride
and dilation 1; a state of exactly K samples; at least one state write; the kept window is
output t reading x[t-K+1 .. t] after the history, for every S when S is symbolic; SiLU before
any cast and one dtype change at most on each side of the conv; the state writes get the same
bits; the operands exist (or can move) before the region starts.

A prefill with padding K-1 and no state (a fresh cache) starts from ZERO history, so it is the
update with a zero conv_state: HF pads x on the left to K samples when S < K, and writes the
last K samples of the padded x.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import fx

from gdn_fx.passes.conv_patterns import (
    TIME, ConvCall, Feed, conv_call, conv_nodes, dtype_changes, is_write, known,
    number, read_chain, read_feed, real_users, shorten_feed, single, slice_args, start_in,
    tails,
)
from gdn_fx.passes.conv_meaning import CONV_OP, NAME, plan_by_meaning
from gdn_fx.passes.program import (ATEN, add_node, copy_meta, dtype, fake_mode_of, is_zeros,
                                   mutates, positions, shape, val, writes_into)
from gdn_fx.passes.rebuild import Fusion
from gdn_fx.passes.result import Miss, NoMatch

WIDER = {torch.float16: (torch.float32, torch.float64), torch.bfloat16: (torch.float32,
         torch.float64), torch.float32: (torch.float64,)}
END_SENTINEL = 2 ** 62  # slice ends at or beyond this mean "to the end"


@dataclass
class Ending:
    """Where the fused output takes over: the last chain node it replaces."""

    node: fx.Node
    activation: Optional[str]
    nodes: list  # chain nodes up to ``node`` (a SiLU's sigmoid included)


@dataclass
class Plan:
    """Everything the rewrite needs, fixed by the checks."""

    conv: ConvCall
    feed: Feed
    tails: list
    ending: Ending
    first: fx.Node  # the fused node goes right before it
    weight: fx.Node  # [C, K], or the conv's [C, 1, K] weight when ``squeeze``
    squeeze: bool
    zeros: Optional[fx.Node] = None  # a zero state the graph already holds
    zero_dtype: Optional[torch.dtype] = None  # else one is made in this dtype
    hoist: list = field(default_factory=list)  # pure operand nodes to move before ``first``


def plan_conv_updates(graph: fx.Graph) -> tuple[list[Fusion], list[Miss]]:
    """The rule: every causal conv1d update, first by the structural pattern (a fusion's key
    names the conv node), then, for the regions no pattern took, by what they compute
    (conv_meaning.py: unfold, shifted multiply-adds, roll, channel-last, K - 1 states, ...;
    a key names the region's output node)."""
    fusions, misses, missed = _plan_patterns(graph)
    claimed = frozenset(n for n in conv_nodes(graph) if n.name in {f.key for f in fusions})
    by_meaning, more, moot = plan_by_meaning(graph, missed, claimed)
    misses = [m for m in misses if m.node not in moot]
    return fusions + by_meaning, misses + more


def _plan_patterns(graph: fx.Graph) -> tuple[list[Fusion], list[Miss], set]:
    """The structural rule: (fusions, near-misses, names of the convs that got one)."""
    fusions, misses, missed = [], [], set()
    order, mode = positions(graph), None
    for node in conv_nodes(graph):
        try:
            plan = _plan(node, order)
        except NoMatch as err:
            misses.append(Miss(NAME, err.reason, node=err.node))
            missed.add(node.name)
            continue
        if plan is not None:
            mode = mode or fake_mode_of(graph)
            fusions.append(_fusion(plan, mode))
    return fusions, misses, missed


def find_conv_updates(graph: fx.Graph) -> list[str]:
    """Conv updates left in ``graph`` whose output slice freezes S.

    A static export spells the update's ``[..., -S:]`` (and the prefill's ``[..., :K+S]``) with
    the traced S as a literal: run at another length, the graph keeps the wrong window. Fused
    nodes and symbolic slices are fine and are not listed.
    """
    found = []
    for node in conv_nodes(graph):
        if not _is_candidate(node):
            continue
        for link in read_chain(node):
            if link.kind == "slice" and _frozen(link.node):
                found.append(f"conv update at node {node.name} was not collapsed: "
                             f"{link.node.name} keeps [{_bounds(link.node)}] of the time axis, "
                             "a bound fixed at the traced sequence length")
    return found


def _frozen(node: fx.Node) -> bool:
    """A time slice with a literal bound counted from the end, or a literal end index."""
    dim, start, end, _ = slice_args(node)
    if dim % 3 != TIME:
        return False
    from_end = isinstance(start, int) and start < 0
    return from_end or (isinstance(end, int) and 0 < end < END_SENTINEL)


def _bounds(node: fx.Node) -> str:
    _, start, end, _ = slice_args(node)
    start = "" if start in (None, 0) else start
    end = "" if end is None or isinstance(end, int) and end >= END_SENTINEL else end
    return f"{start}:{end}"


def _width(conv: ConvCall) -> Optional[int]:
    dims = shape(conv.weight)
    return dims[-1] if dims is not None and len(dims) == 3 else None


def _is_candidate(node: fx.Node) -> bool:
    """A conv that reads a cat on the time axis, or whose input's last K samples are kept."""
    conv = conv_call(node)
    width = _width(conv)
    if width is None:
        return False
    feed = read_feed(conv.input)
    return feed.kind == "cat" or bool(tails(feed, width))


def _plan(node: fx.Node, order: dict) -> Optional[Plan]:
    """The guard ladder. None: not a conv update at all; NoMatch: a near-miss."""
    if not _is_candidate(node):
        return None
    conv = conv_call(node)
    width = _width(conv)
    _check_geometry(conv)
    _check_depthwise(conv, width)
    feed = read_feed(conv.input)
    _check_feed(feed, conv, width)
    ending, feed = _settle_output(conv, feed, width)
    found = tails(feed, width)
    if not found:
        raise NoMatch(f"nothing keeps the last {width} samples of {feed.full.name}: there is no "
                      "state write", node=feed.full)
    zero_dtype = None if feed.state is not None else dtype(found[0])
    _check_state_writes(feed, conv, found, zero_dtype)
    return _place(conv, feed, found, ending, zero_dtype, order)


# --- the conv itself -----------------------------------------------------------------------

def _check_geometry(conv: ConvCall) -> None:
    node = conv.node
    if conv.transposed or single(conv.output_padding) != 0:
        raise NoMatch("the conv is transposed", node=node)
    if single(conv.stride) != 1 or single(conv.dilation) != 1:
        raise NoMatch(f"the conv has stride {conv.stride} and dilation {conv.dilation}; a "
                      "causal update needs 1 and 1", node=node)
    padding = single(conv.padding)
    if padding == "same" or not isinstance(padding, int) and padding != "valid":
        raise NoMatch(f"the conv has padding {conv.padding!r}; a causal update pads with a "
                      "fixed number of samples", node=node)


def _padding(conv: ConvCall) -> int:
    padding = single(conv.padding)
    return 0 if padding == "valid" else padding


def _check_depthwise(conv: ConvCall, width: int) -> None:
    channels = shape(conv.input)[1]
    out_channels, per_group = shape(conv.weight)[:2]
    if conv.groups != channels or per_group != 1 or out_channels != channels:
        raise NoMatch(f"the conv is not depthwise: groups {conv.groups}, weight "
                      f"{list(shape(conv.weight))} over {channels} channels; an update "
                      f"convolves each channel alone (weight [{channels}, 1, {width}])",
                      node=conv.node)


# --- what the conv reads -------------------------------------------------------------------

def _check_feed(feed: Feed, conv: ConvCall, width: int) -> None:
    full = feed.full
    if feed.kind == "cat" and len(full.args[0]) != 2:
        raise NoMatch(f"the conv reads a cat of {len(full.args[0])} tensors; an update reads "
                      "cat(state, x)", node=full)
    if feed.kind == "pad" and feed.zeros is None:
        raise NoMatch(f"the conv reads {full.name} = pad({list(full.args[1])}, ...); only zeros "
                      "on the left of the time axis give a zero history", node=full)
    if dtype_changes(feed.nodes) > 1:
        raise NoMatch("the conv input is cast twice on the way from the concatenation",
                      node=feed.nodes[-1])
    batch, channels = shape(conv.input)[:2]
    x_shape = shape(feed.x)
    if x_shape is None or len(x_shape) != 3 or not known(x_shape[1] == channels):
        raise NoMatch(f"x has shape {_listed(x_shape)}, expected [B, {channels}, S]",
                      node=feed.x)
    if feed.state is not None:
        got = shape(feed.state)
        want = [batch, channels, width]
        if got is None or len(got) != 3 or not all(known(g == w) for g, w in zip(got, want)):
            raise NoMatch(f"the conv state has shape {_listed(got)}; a kernel of {width} needs "
                          f"exactly {width} samples: {_listed(want)}", node=feed.state)


def _listed(dims) -> str:
    return "None" if dims is None else str(list(dims))


def _history(feed: Feed) -> int:
    """Samples before x in ``full``: the state's K, or the zeros of a fresh cache."""
    return shape(feed.state)[TIME] if feed.state is not None else feed.zeros


# --- what comes out ------------------------------------------------------------------------

def _settle_output(conv: ConvCall, feed: Feed, width: int) -> tuple[Ending, Feed]:
    """The last chain node that is the update's output, and the feed that makes x match it."""
    seq = shape(feed.x)[TIME]
    start = _history(feed) + _padding(conv) - width + 1
    if feed.state is None and not known(start >= 0):
        raise NoMatch(f"the conv sees {_history(feed)} + {_padding(conv)} zero samples before "
                      f"x; a causal window of {width} needs {width - 1}", node=conv.node)
    endings, window = _endings(conv, start, seq)
    for ending in reversed(endings):
        settled = _match_x(feed, ending)
        if settled is not None:
            return ending, settled
    if endings:
        raise NoMatch(f"the update's output is {dtype(endings[-1].node)}, x is "
                      f"{dtype(feed.x)}: the graph does not cast back", node=endings[-1].node)
    raise NoMatch(f"the output keeps conv positions {_span(*window)} of "
                  f"{shape(conv.node)[TIME]}; an update of {seq} samples keeps "
                  f"{_span(start, seq)}", node=conv.node)


def _span(offset, length) -> str:
    if offset is None:
        return "a window the rule cannot follow"
    if isinstance(offset, int) and isinstance(length, int):
        return f"[{offset}, {offset + length})"
    return f"[{offset}, {offset} + {length})"


def _endings(conv: ConvCall, start, seq) -> tuple[list[Ending], tuple]:
    """Chain nodes where the kept window is the update's, and the final window walked."""
    window = (0, shape(conv.node)[TIME])
    activation, casts, nodes, endings = None, 0, [], []
    prev = conv.node
    if _fits(window, start, seq):
        endings.append(Ending(conv.node, None, []))
    for link in read_chain(conv.node):
        if link.kind == "slice":
            window = _sliced(window, link.node)
        elif link.kind == "silu":
            if activation or casts:  # SiLU after a cast runs in another dtype than the op's
                break
            activation = "silu"
        elif dtype(link.node) != dtype(prev):
            casts += 1
        if window is None or casts > 1:
            break
        nodes += link.extra + [link.node]
        prev = link.node
        if _fits(window, start, seq):
            endings.append(Ending(link.node, activation, list(nodes)))
    return endings, window or (None, None)


def _sliced(window: tuple, node: fx.Node) -> Optional[tuple]:
    """(offset, kept) after a slice, or None for a slice the window cannot follow."""
    dim, begin, _, step = slice_args(node)
    offset = start_in(number(begin), window[1])
    if dim % 3 != TIME or step != 1 or offset is None:
        return None
    return window[0] + offset, shape(node)[TIME]


def _fits(window: tuple, start, seq) -> bool:
    return known(window[0] == start) and known(window[1] == seq)


def _match_x(feed: Feed, ending: Ending) -> Optional[Feed]:
    """The feed whose x has the output's dtype (a zero history may start at a later cast)."""
    want = dtype(ending.node)
    if feed.kind != "x":
        return feed if dtype(feed.x) == want else None
    for index, node in enumerate(feed.nodes):
        if dtype(node) == want:
            return shorten_feed(feed, index)
    return None


# --- the state writes ----------------------------------------------------------------------

def _lossless(source: torch.dtype, target: torch.dtype) -> bool:
    return source == target or target in WIDER.get(source, ())


def _check_state_writes(feed: Feed, conv: ConvCall, found: list, zero_dtype) -> None:
    """The op's new_state, written where the graph wrote ``full[..., -K:]``, has its bits.

    The op keeps cat(state, x).to(w.dtype)[..., -K:].to(state.dtype): a tail taken before the
    cast must survive the round trip through the weight's dtype.
    """
    weight, full = dtype(conv.weight), dtype(feed.full)
    state = dtype(feed.state) if feed.state is not None else zero_dtype
    for tail in found:
        kept = dtype(tail)
        if kept != weight and not _lossless(full, weight):
            raise NoMatch(f"the state write keeps {full} samples the op rounds through the "
                          f"weight's {weight}", node=tail)
        for user in real_users(tail):
            if writes_into(user, tail):
                raise NoMatch(f"{user.name} writes into the kept samples in place", node=user)
            if is_write(user, tail):
                ok = dtype(user.args[0]) == state or _lossless(kept, state)
            else:
                ok = kept == state
            if not ok:
                raise NoMatch(f"{user.name} reads the {kept} samples; the op's new state is "
                              f"{state}", node=user)


# --- where the fused node goes -------------------------------------------------------------

def _place(conv: ConvCall, feed: Feed, found: list, ending: Ending, zero_dtype,
           order: dict) -> Plan:
    """Fix the insertion point, the weight operand, a zero state and what must move."""
    region = feed.made + found + [conv.node] + ending.nodes
    first = min(region, key=order.__getitem__)
    plan = Plan(conv, feed, found, ending, first, *_weight_operand(conv), zero_dtype=zero_dtype)
    for operand in (plan.weight, conv.bias, feed.x, feed.state):
        _hoistable(operand, first, order, plan.hoist)
    _check_unwritten(plan, order)
    if feed.state is None:
        plan.zeros = _zero_state(plan, order)
    return plan


def _weight_operand(conv: ConvCall) -> tuple[fx.Node, bool]:
    """w for the conv's ``w.unsqueeze(1)``; else the [C, 1, K] weight, squeezed at rewrite."""
    weight = conv.weight
    if weight.target is ATEN.unsqueeze.default and weight.args[1] % 3 == 1:
        inner = weight.args[0]
        if shape(inner) is not None and len(shape(inner)) == 2:
            return inner, False
    return weight, True


def _hoistable(node, first: fx.Node, order: dict, plan: list) -> None:
    """Collect the pure nodes that must move before ``first`` for ``node`` to be ready."""
    if not isinstance(node, fx.Node) or order[node] < order[first] or node in plan:
        return
    if node.op == "get_attr":  # make_fx reads constants right where they are used
        plan.append(node)
        return
    if node.op != "call_function" or node.is_impure() or mutates(node):
        raise NoMatch(f"operand {node.name} is computed after the region starts at "
                      f"{first.name} and cannot move", node=node)
    for source in node.all_input_nodes:
        _hoistable(source, first, order, plan)
    plan.append(node)


def _check_unwritten(plan: Plan, order: dict) -> None:
    """What the conv and the state writes read later must not change after the fused read."""
    watched = plan.feed.made + ([plan.feed.x] if plan.feed.kind == "x" else [])
    readers = [plan.conv.node] + [u for t in plan.tails for u in real_users(t)]
    stop = max(order[n] for n in readers)
    for node in watched:
        for user in node.users:
            if writes_into(user, node) and order[plan.first] <= order[user] <= stop:
                raise NoMatch(f"{user.name} writes {node.name} in place while the region reads "
                              "it", node=user)


def _zero_state(plan: Plan, order: dict) -> Optional[fx.Node]:
    """The zero tensor a fresh cache wrote into, when it is ready and untouched; else None."""
    for tail in plan.tails:
        for user in real_users(tail):
            target = user.args[0] if is_write(user, tail) else None
            if is_zeros(target) and dtype(target) == plan.zero_dtype \
                    and shape(target) == shape(tail) and order[target] < order[plan.first] \
                    and not any(writes_into(u, target) and order[u] < order[plan.first]
                                for u in target.users):
                return target
    return None


# --- the rewrite ---------------------------------------------------------------------------

def _fusion(plan: Plan, mode) -> Fusion:
    """The fused node at the region's first node (its late operands moved there); the output
    and every kept tail of ``full`` are read from it. An in-place state write stays and
    copies ``new_state``; the conv and what only it read are left behind."""
    conv = plan.conv

    def emit(graph: fx.Graph, env) -> dict:
        weight = env(plan.weight)
        if plan.squeeze:
            weight = add_node(graph, ATEN.squeeze.dims, (weight, [1]), mode=mode)
        state = plan.feed.state or plan.zeros
        state = env(state) if state is not None else _make_zeros(graph, plan, env, mode)
        bias = env(conv.bias) if isinstance(conv.bias, fx.Node) else conv.bias
        fused = add_node(graph, CONV_OP, (env(plan.feed.x), state, weight, bias,
                                          plan.ending.activation), mode=mode)
        out = add_node(graph, operator.getitem, (fused, 0), mode=mode)
        new_state = add_node(graph, operator.getitem, (fused, 1), mode=mode)
        copy_meta(conv.node, (fused, out, new_state))
        return {"out": out, "new_state": new_state}

    replace = {plan.ending.node: "out"}
    replace.update({tail: "new_state" for tail in plan.tails})
    inputs = {n for n in (plan.weight, conv.bias, plan.feed.x, plan.feed.state, plan.zeros)
              if isinstance(n, fx.Node)}
    return Fusion(conv.node.name, plan.first, emit, inputs, replace, hoist=list(plan.hoist))


def _make_zeros(graph: fx.Graph, plan: Plan, env, mode) -> fx.Node:
    """zeros([B, C, K]) like x, sizes read from x where they are symbolic."""
    x = plan.feed.x
    sizes = []
    for axis, size in enumerate(shape(x)[:2]):
        symbolic = isinstance(size, torch.SymInt)
        sizes.append(add_node(graph, ATEN.sym_size.int, (env(x), axis), mode=mode) if symbolic
                     else size)
    sizes.append(_width(plan.conv))
    return add_node(graph, ATEN.zeros.default, (sizes,),
                    dict(dtype=plan.zero_dtype, device=val(x).device), mode=mode)
