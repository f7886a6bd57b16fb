"""Find unrolled loops over time by structure, whatever ops their steps use.

A Python loop ``for t in range(T)`` traced by torch.export leaves two marks that no spelling
of the body removes:

- *time reads*: each tensor the loop walks is read one position at a time, ``x[:, :, t]``
  (select), ``x[:, t:t+1]`` (a size-1 slice), ``x.narrow(1, t, 1)``, ``x.unbind(1)[t]``,
  ``x.split(1, 1)[t]``, ``x.tensor_split(T, 1)[t]``, ``x.index_select(1, i)`` or ``x[:, i]``
  with ``i`` a literal index tensor of one element; the time axis's size is static, the
  others may be symbolic;
- a *carried state*: step t's result S_{t+1} is computed from S_t and step t's reads only.

This module finds both and cuts the loop into steps: step t's body is everything between its
inputs (S_t, the time reads at index t, loop invariants) and its outputs (S_{t+1}, the value
o_t the loop gathers into a buffer or a stack). It says nothing about what a step computes:
step_meaning.py decides that by evaluating the bodies.

Every node of a loop's window gets a tag, the largest time index it depends on; a step's body
is found by walking back from its outputs and stopping at nodes tagged with an earlier step
(there must be exactly one: the incoming state) or untagged (invariants).
"""

from __future__ import annotations

import operator
from collections import defaultdict
from dataclasses import dataclass, field
from typing import NamedTuple, Optional

import torch
from torch import fx

from gdn_fx.passes.program import (ATEN, dtype, literal, mutates, reachable, same_sizes, shape,
                                   static_int, unsliced)
from gdn_fx.passes.result import NoMatch

SPLITS = (ATEN.split.Tensor, ATEN.split_with_sizes.default, ATEN.unbind.int,
          ATEN.tensor_split.sections, ATEN.tensor_split.indices)
WRITES = (ATEN.copy_.default, ATEN.copy.default)  # buffer writes: copy(buffer slice, value)
MULS = (ATEN.mul.Tensor, ATEN.mul_.Tensor)  # a state times a decay (either order)
MARGIN = 48  # nodes past the last step's first time read that still belong to the loop


class TimeRead(NamedTuple):  # (a frozen dataclass took 1 us to make, on every read)
    """``node`` reads position ``t`` of ``source`` along ``axis`` (keepdim for a slice)."""

    source: fx.Node
    axis: int
    t: int
    keepdim: bool


# Every view torch keeps in some IR that reads one position: x[:, t] (select), x[:, t:t+1]
# (slice), x.narrow(1, t, 1), pieces of unbind / split / tensor_split, and x.index_select(1,
# i) or x[:, i] with i a literal index tensor of one element (index_select, index).
READS = (ATEN.select.int, ATEN.slice.Tensor, ATEN.narrow.default, ATEN.index_select.default,
         ATEN.index.Tensor, operator.getitem)
READ_TARGETS = frozenset(READS)  # a set: find_clusters screens every node of the graph


def time_read(node: fx.Node) -> Optional[TimeRead]:
    """The position a node reads, when it reads one position of a tensor along one axis."""
    if node.op != "call_function" or node.target not in READS:
        return None
    target, args = node.target, node.args
    if target is ATEN.select.int:
        return _read(args[0], args[1], args[2], False)
    if target is ATEN.slice.Tensor and len(args) >= 4:
        return _slice_read(args)
    if target is ATEN.narrow.default:  # narrow(x, axis, start, length)
        return _read(args[0], args[1], args[2], True) if args[3] == 1 else None
    if target in (ATEN.index_select.default, ATEN.index.Tensor):
        return _index_read(node)
    if target is operator.getitem and isinstance(args[0], fx.Node):
        return _piece_read(args[0], args[1])
    return None


def _slice_read(args: tuple) -> Optional[TimeRead]:
    step = args[4] if len(args) > 4 else 1
    src, axis, start, end = args[:4]
    dims = shape(src)
    if step != 1 or dims is None or not all(isinstance(x, int) for x in (axis, start, end)):
        return None
    size = static_int(dims[axis])
    if size is None:
        return None
    start = start + size if start < 0 else start
    end = min(end + size if end < 0 else end, size)
    return _read(src, axis, start, True) if end - start == 1 else None


def _index_read(node: fx.Node) -> Optional[TimeRead]:
    """x.index_select(axis, i), or x[..., i] (index with one index tensor, None elsewhere),
    where i is a literal of one integer: a 1-element index keeps the axis, a 0-d one drops
    it."""
    src, axis, index = node.args if node.target is ATEN.index_select.default else \
        (node.args[0], *_one_index(node.args[1]))
    found = literal(index) if isinstance(index, fx.Node) else None
    if found is None or found.numel() != 1 or found.dtype.is_floating_point or \
            found.dtype in (torch.bool, torch.uint8):  # (masks, not positions)
        return None
    keep = node.target is ATEN.index_select.default or found.dim() > 0
    return _read(src, axis, int(found.reshape(())), keep)


def _one_index(indices) -> tuple:
    """(axis, index) of an index list holding one index tensor (None elsewhere)."""
    given = [(i, x) for i, x in enumerate(indices or ()) if x is not None]
    return given[0] if len(given) == 1 else (None, None)


def _piece_read(parent: fx.Node, index) -> Optional[TimeRead]:
    """Piece ``index`` of an unbind, or of a split / tensor_split into pieces of size 1."""
    if parent.op != "call_function" or parent.target not in SPLITS or not _unit_split(parent):
        return None
    if parent.target is ATEN.unbind.int:
        axis = parent.args[1] if len(parent.args) > 1 else parent.kwargs.get("dim", 0)
    else:
        axis = parent.args[2] if len(parent.args) > 2 else parent.kwargs.get("dim", 0)
    return _read(parent.args[0], axis, index, parent.target is not ATEN.unbind.int)


def _unit_split(node: fx.Node) -> bool:
    """unbind, or a split (or tensor_split) into pieces of size 1."""
    if node.target is ATEN.unbind.int:
        return True
    sizes = node.args[1] if len(node.args) > 1 else None
    if node.target is ATEN.split.Tensor:
        return sizes == 1
    if node.target is ATEN.split_with_sizes.default:
        return isinstance(sizes, (list, tuple)) and all(s == 1 for s in sizes)
    dims, axis = shape(node.args[0]), node.args[2] if len(node.args) > 2 else 0
    size = static_int(dims[axis]) if dims is not None and isinstance(axis, int) else None
    if size is None:
        return False
    if node.target is ATEN.tensor_split.sections:  # n sections of a size-n axis
        return sizes == size
    return list(sizes) == list(range(1, size))  # cut before every position


def _read(src, axis, t, keepdim) -> Optional[TimeRead]:
    """A read of position ``t`` along ``axis``, whose size must be static (a loop unrolled
    over it); the other sizes may be symbolic (a dynamic batch). A source seen through full
    slices (``x[:, :]``, which torch.export writes when sizes are symbolic) is the tensor
    itself."""
    if not isinstance(src, fx.Node) or not isinstance(t, int) or not isinstance(axis, int):
        return None
    src = unsliced(src)
    dims = shape(src)
    if not dims:
        return None
    axis %= len(dims)
    size = static_int(dims[axis])
    if size is None:
        return None
    t = t + size if t < 0 else t
    return TimeRead(src, axis, t, keepdim) if 0 <= t < size else None


def _is_write_target(node: fx.Node) -> bool:
    """A read that only serves as the destination of buffer writes (or of in-place ops) is
    not a read. (Run on every read of the graph: the common answer, no, comes first.)"""
    if not node.users:
        return False
    for user in node.users:
        if not user.args or user.args[0] is not node:
            return False
        if user.target not in WRITES and not mutates(user):
            return False
    return True


@dataclass
class Step:
    """One step of a found loop: its inputs, outputs and the body between them."""

    t: int
    state_in: fx.Node
    state_out: Optional[fx.Node]  # None: the last step's new state is not computed
    out: fx.Node  # o_t, the value the loop gathers
    reads: dict  # group (source, axis) -> [time-read nodes at index t]
    body: list  # computed nodes, in graph order
    consts: list = field(default_factory=list)  # untagged inputs other than the state


@dataclass
class Loop:
    """A loop found by structure: T steps along a carried state."""

    length: int
    groups: list  # (source, axis) read position by position, in order of first read
    steps: list  # Step, t = 0..T-1


@dataclass
class Cluster:
    """Time reads of one length whose positions overlap in the graph: one loop candidate."""

    length: int
    reads: dict  # read node -> TimeRead
    start: int  # graph positions [start, end) of the loop's window
    end: int
    last_use: int  # where the last position's read is first used


def find_clusters(graph: fx.Graph, order: dict) -> list[Cluster]:
    """Time reads grouped into loop candidates.

    Each tensor's reads are cut into episodes (a read of position 0 after later positions
    starts a new loop over the same tensor: a second layer). Episodes of one length whose
    reads interleave are one loop; single steps merge by window (their reads need not)."""
    by_group = defaultdict(list)
    for node in graph.nodes:
        if node.target not in READ_TARGETS:  # most nodes: no call, no attribute walk
            continue
        read = time_read(node)
        if read is not None and not _is_write_target(node):
            by_group[(read.source, read.axis)].append((node, read))
    spans = []
    for reads in by_group.values():
        for episode in _episodes(reads):
            length = static_int(shape(episode[0][1].source)[episode[0][1].axis])
            spans.append((length, dict(episode), *_window(dict(episode), order, length)))
    spans.sort(key=lambda s: (s[0], s[2]))
    clusters: list[Cluster] = []
    for length, reads, start, last_use, end in spans:
        prev = clusters[-1] if clusters else None
        bound = (prev.end if length == 1 else prev.last_use) if prev is not None else None
        if prev is not None and prev.length == length and start < bound:
            prev.reads.update(reads)
            prev.end, prev.last_use = max(prev.end, end), max(prev.last_use, last_use)
        else:
            clusters.append(Cluster(length, reads, start, end, last_use))
    return clusters


def _episodes(reads: list) -> list[list]:
    episodes, top = [], None
    for node, read in reads:
        if top is None or (read.t == 0 and top > 0):
            episodes.append([])
            top = 0
        episodes[-1].append((node, read))
        top = max(top, read.t)
    return episodes


def _window(reads: dict, order: dict, length: int) -> tuple[int, int, int]:
    """Graph positions of the loop: its first read, the first use of its last position's
    read, and some way past that (the last step's body)."""
    first_use = defaultdict(lambda: 10**12)
    for node, read in reads.items():
        first_use[read.t] = min(first_use[read.t], _first_use(node, order))
    start = min(order[n] for n in reads)
    last = max(first_use.values())
    span = (last - first_use[min(first_use)]) / max(length - 1, 1)
    return start, last, int(last + 3 * span) + MARGIN


# Ops that only reshape, move or cast: a read passed through them is not used yet (a loop
# may squeeze all its slices before it starts).
RESHAPES = {ATEN.squeeze.dims, ATEN.squeeze.dim, ATEN.squeeze.default, ATEN.unsqueeze.default,
            ATEN.view.default, ATEN.reshape.default, ATEN.expand.default, ATEN.permute.default,
            ATEN.transpose.int, ATEN.clone.default, ATEN.contiguous.default,
            ATEN._to_copy.default, ATEN.to.dtype, ATEN.alias.default}


def _first_use(node: fx.Node, order: dict) -> int:
    """Graph position of the first op that computes with ``node`` (through reshapes)."""
    best, todo = 10**12, [node]
    while todo:
        current = todo.pop()
        if not current.users:
            best = min(best, order[current] + 1)
        for user in current.users:
            if user.target in RESHAPES:
                todo.append(user)
            else:
                best = min(best, order[user])
    return best


def tag_window(nodes: list, cluster: Cluster) -> dict:
    """node -> the largest time index it depends on, for the nodes of the cluster's window."""
    tags, reads = {}, cluster.reads
    for node in nodes[cluster.start:cluster.end]:
        read = reads.get(node)
        if read is not None:
            tags[node] = read.t
            continue
        found = [tags[a] for a in node.all_input_nodes if a in tags]
        if found:
            tags[node] = max(found)
    return tags


GATHERS = (ATEN.stack.default, ATEN.cat.default)


def _feeds_gather(node: fx.Node, single: bool) -> bool:
    """Whether the loop may gather ``node``: stacked, concatenated, written to a buffer (a
    single step's value may just be unsqueezed: a stack of one)."""
    for user in node.users:
        if single and user.target is ATEN.unsqueeze.default:
            return True
        if user.target in GATHERS:
            return True
        if user.target in WRITES and user.args[1] is node and time_read(user.args[0]):
            return True
        if user.target is ATEN.unsqueeze.default and len(user.users) == 1 \
                and next(iter(user.users)).target is ATEN.cat.default:
            return True
    return False


def step_candidates(cluster: Cluster, tags: dict, order: dict) -> list[list[fx.Node]]:
    """Candidate o_0..o_{T-1} lists, one per loop: for each t, a node tagged t that the loop
    gathers. Loops reading the same tensors share a cluster (two layers over one input); step
    t's value joins the chain whose step t-1 computed the state it reads. A single step may
    sit beside other size-1 reads: each gathered value there is a candidate."""
    found = defaultdict(list)
    for node, t in tags.items():
        if node not in cluster.reads and node.target not in WRITES and \
                _feeds_gather(node, cluster.length == 1):
            found[t].append(node)
    for t, nodes in found.items():  # o.unsqueeze(d) gathered: o is the step's value
        found[t] = [n for n in nodes if not (n.target is ATEN.unsqueeze.default
                                             and n.args[0] in nodes)]
    if not found:
        raise NoMatch("no step value is gathered into a buffer or a stack",
                      node=min(cluster.reads, key=order.__getitem__))
    chains = [[o] for o in found[0]]
    if not chains:
        raise NoMatch("step 0 gathers nothing", node=min(cluster.reads, key=order.__getitem__),
                      step=0)
    for t in range(1, cluster.length):
        taken = {}
        if len(chains) == 1 and len(found[t]) == 1:
            taken[0] = found[t]  # unambiguous; whether it reads the right state is step_meaning's
        for c in found[t] if not taken else ():
            chain = _linked(chains, c, t, tags, cluster)
            if chain is not None:
                taken.setdefault(chain, []).append(c)
        for i, chain in enumerate(chains):
            got = taken.get(i, [])
            if len(got) > 1 and t == cluster.length - 1:  # what follows may gather too
                got = [min(_like(got, chain[-1]), key=order.__getitem__)]
            if len(got) != 1:
                late = any(len(found[u]) > len(chains) for u in range(t + 1, cluster.length))
                why = (": its reads come after a later position's, the loop does not walk "
                       "time in order") if not got and late else ""
                what = ", ".join(n.name for n in got[:3]) or "nothing"
                raise NoMatch(f"step {t} gathers {what} from the state of step {t - 1}{why}; "
                              "a recurrence step gathers one value",
                              node=got[0] if got else chain[-1], step=t)
            chain.append(got[0])
    return chains


def _like(candidates: list, previous: fx.Node) -> list:
    """The candidates computed like the step before's value (op and shape), else all."""
    same = [c for c in candidates if c.target == previous.target and
            same_sizes(shape(c), shape(previous))]
    return same or candidates


def _linked(chains: list, node: fx.Node, t: int, tags: dict, cluster: Cluster):
    """The chain whose step t-1 computed the state ``node`` (gathered at step t) reads."""
    try:
        earlier = walk_body([node], t, tags, cluster)[2]
    except NoMatch:
        return None
    hits = []
    for i, chain in enumerate(chains):
        try:
            body = walk_body([chain[-1]], t - 1, tags, cluster)[0]
        except NoMatch:
            continue
        if any(e in body for e in earlier):
            hits.append(i)
    return hits[0] if len(hits) == 1 else None


def walk_body(roots: list, t: int, tags: dict, cluster: Cluster):
    """Step t's body: computed nodes from ``roots`` back to its inputs.

    Returns (body nodes, reads by group, earlier-step inputs, untagged inputs).
    """
    body, reads, earlier, consts = set(), defaultdict(list), [], []
    todo, seen, time_reads = list(roots), set(), cluster.reads
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        read = time_reads.get(node)
        if read is not None:
            if read.t != t:
                raise NoMatch(f"step {t} reads position {read.t} of {read.source.name}",
                              node=node, step=t)
            reads[(read.source, read.axis)].append(node)
            continue
        tag = tags.get(node)
        if tag is None:
            consts.append(node)
        elif tag < t:
            earlier.append(node)
        else:
            body.add(node)
            todo.extend(node.all_input_nodes)
    return body, dict(reads), earlier, consts


def state_like(node: fx.Node, like: Optional[fx.Node] = None) -> bool:
    """A floating tensor of rank >= 2 (of ``like``'s shape and dtype when given)."""
    dims, kind = shape(node), dtype(node)
    if dims is None or kind is None or not kind.is_floating_point or len(dims) < 2:
        return False
    return like is None or (same_sizes(dims, shape(like)) and kind == dtype(like))


def descendants_in(start: fx.Node, tags: dict, t: int) -> set:
    """Nodes tagged ``t`` reachable forward from ``start``."""
    return reachable([start], lambda node: [u for u in node.users if tags.get(u) == t]) - {start}


def cut_steps(cluster: Cluster, tags: dict, outs: list, order: dict) -> Loop:
    """The loop's steps, walked from the last one back: each step's incoming state is the one
    input it takes from an earlier step (step 0's: a state-like invariant)."""
    length = cluster.length
    steps: list[Optional[Step]] = [None] * length
    state_out = None  # S_{t+1}, known once step t+1 has been walked
    for t in reversed(range(length)):
        roots = [outs[t]] + ([state_out] if state_out is not None else [])
        body, reads, earlier, consts = walk_body(roots, t, tags, cluster)
        state_in = _incoming_state(t, earlier, consts, state_out or outs[t], body)
        if state_in is state_out:
            raise NoMatch(f"step {t} hands on the state it received ({state_in.name}): the "
                          "state edge skips the step's own update", node=state_in, step=t)
        state_in, consts = take_decays(state_in, t, tags, body, reads, consts)
        reads = {g: sorted(nodes, key=order.__getitem__) for g, nodes in reads.items()}
        steps[t] = Step(t, state_in, state_out, outs[t], reads,
                        sorted(body, key=order.__getitem__), consts)
        state_out = state_in
    groups = sorted({g for s in steps for g in s.reads}, key=lambda g: order[g[0]])
    return Loop(length, groups, steps)


def _incoming_state(t: int, earlier: list, consts: list, like: fx.Node, body: set) -> fx.Node:
    if t > 0:
        if len(earlier) != 1:
            what = ", ".join(n.name for n in earlier[:3]) or "nothing"
            raise NoMatch(f"step {t} takes {what} from earlier steps; a recurrence step takes "
                          "one state", node=earlier[0] if earlier else None, step=t)
        return earlier[0]
    if earlier:
        raise NoMatch(f"step 0 reads {earlier[0].name}, computed by a later step",
                      node=earlier[0], step=0)
    shaped = [c for c in consts if state_like(c)]
    if len(shaped) > 1:  # the state and a decay from before the loop: the state's shape
        shaped = [c for c in shaped if state_like(c, like)] or shaped
    if len(shaped) != 1:
        what = ", ".join(n.name for n in shaped[:3]) or "none"
        raise NoMatch(f"step 0 reads {len(shaped)} matrix-shaped values from before the loop "
                      f"({what}); a recurrence step reads one initial state", node=like, step=0)
    return shaped[0]


def take_decays(state_in: fx.Node, t: int, tags: dict, body: set, reads: dict, consts: list
                ) -> tuple[fx.Node, list]:
    """(the state step t receives, its other inputs from outside): a product S * decay
    with a decay from outside the loop, left with the step before by the tags, is this
    step's (``body`` gains it); every decay from outside the step is read whole (``reads``
    gains it, keyed by the value it views)."""
    found = undecayed(state_in, t, tags)
    if found is not None:
        state_in, decayed = found
        body.add(decayed)
        consts = consts + [a for a in decayed.all_input_nodes if a is not state_in]
    consts = [c for c in consts if c is not state_in]
    for decay in _invariant_decays(consts, state_in):
        reads.setdefault((invariant_root(decay), None), []).append(decay)
        consts.remove(decay)
    return state_in, consts


def _invariant_decays(consts: list, state: fx.Node) -> list:
    """Values from outside the step that it multiplies its state by, the same at every
    position (a per-head constant, buffer or parameter, or a view of one: retention's,
    lightning's decays). They are read as inputs of the step (a group of axis None, keyed
    by the value they view), so that the step is decided for any decay, not the traced one."""
    return [c for c in consts if dtype(c) is not None and dtype(c).is_floating_point
            and shape(c) and not same_sizes(shape(c), shape(state))
            and any(u.target in MULS and state in u.args for u in c.users)]


# views that keep the elements in order: the decay read is its root reshaped
ORDERED_VIEWS = (ATEN.unsqueeze.default, ATEN.view.default, ATEN.reshape.default,
                 ATEN._unsafe_view.default)


def invariant_root(node: fx.Node) -> fx.Node:
    """The value ``node`` views through unsqueezes, views and full slices (``decay[None, :,
    None, None]`` written in the loop is a view of ``decay`` per step)."""
    while node.target in ORDERED_VIEWS or _full_slice(node):
        node = node.args[0]
    return node


def invariant_shapes(root: fx.Node) -> tuple[list, list]:
    """(the shape a step reads ``root`` in, the shape it is drawn in for the step): the view
    the state is multiplied by, [1, H, 1, 1] say, and that with the state's batch axes (each
    entry its own draw: a decay shared by them is one case) and its own last two, aligned to
    the state's rank."""
    todo = [root]
    while todo:
        node = todo.pop()
        for user in node.users:
            if user.target in MULS and shape(user) is not None:
                own, state = list(shape(node)), list(shape(user))
                aligned = [1] * (len(state) - len(own)) + own
                return own, state[:-2] + aligned[-2:]
            if user.target in ORDERED_VIEWS or _full_slice(user):
                todo.append(user)
    raise NoMatch(f"{root.name} is read as a decay but never multiplies the state", node=root)


def _full_slice(node: fx.Node) -> bool:
    if node.target is not ATEN.slice.Tensor:
        return False
    dims = shape(node.args[0])
    return dims is not None and same_sizes(dims, shape(node)) and (
        len(node.args) < 5 or node.args[4] == 1)


def undecayed(state: fx.Node, t: int, tags: dict):
    """(S, S * decay) where the state a step receives is S * decay with a decay from
    outside the loop, computed with the step before it (tags take the largest time index a
    node depends on: a decay the same at every position leaves the product with the step
    that made S, or before the loop for step 0) and read by this step only; None when it
    is not."""
    if state.target not in MULS or len(state.args) != 2 or any(
            tags.get(u) != t for u in state.users):
        return None
    for s, decay in (state.args, state.args[::-1]):
        if isinstance(s, fx.Node) and isinstance(decay, fx.Node) and \
                same_sizes(shape(s), shape(state)) and tags.get(decay) is None and \
                tags.get(s) == (t - 1 if t else None) and not same_sizes(shape(decay),
                                                                         shape(state)):
            return s, state
    return None


# --- a step at concrete sizes ----------------------------------------------------------------
# A loop whose batch (or heads, or widths) is symbolic is decided at concrete sizes: its
# step is copied into a small graph of its own where every size is a number (each symbol at
# a given value) and run there, as a step of a static loop is. Its time axis is static.

def symbols(nodes) -> set:
    """The symbols in the sizes of ``nodes``' values."""
    found = set()
    for node in nodes:
        for size in shape(node) or ():
            if isinstance(size, torch.SymInt):
                found |= size.node.expr.free_symbols
    return found


def size_points(step: Step, groups: list) -> list[dict]:
    """Values of the symbols in the step's sizes to decide it at: the traced ones (the
    hints), then each one larger (or smaller, where its range ends there) so that a region
    whose meaning changes with the size shows; [] when every size is static."""
    found = symbols([step.state_in, step.out] + [source for source, _ in groups])
    if not found:
        return []
    env = next(s for n in [step.state_in] + [g[0] for g in groups] for s in shape(n) or ()
               if isinstance(s, torch.SymInt)).node.shape_env
    hints, moved = {}, {}
    for symbol in found:
        value = env.backed_var_to_val.get(symbol)
        if value is None:
            raise NoMatch(f"the size {symbol} of the loop's tensors depends on data; the "
                          "step cannot be run at a size", node=step.out, step=step.t)
        bounds = env.var_to_range.get(symbol)
        hints[symbol] = int(value)
        moved[symbol] = int(value) + 1 if bounds is None or value + 1 <= bounds.upper \
            else max(int(value) - 1, int(bounds.lower))
    return [hints] + ([moved] if moved != hints else [])


def concrete(size, at: dict) -> Optional[int]:
    """A size (int or SymInt) with each symbol at its value in ``at``, or at its traced
    value where ``at`` has none (a size from outside the loop's tensors); None where one
    has neither (a size that depends on data)."""
    if type(size) is int:
        return size
    value = size.node.expr.xreplace(at)  # the symbol itself gives the int in ``at``
    if not isinstance(value, int) and value.free_symbols:
        value = value.xreplace(size.node.shape_env.backed_var_to_val)
    return int(value) if isinstance(value, int) or getattr(value, "is_Integer", False) \
        else None


def concrete_step(step: Step, final: Optional[fx.Node], groups: list, at: dict) -> tuple:
    """(step, final, groups) of the step copied into a graph of its own at the sizes ``at``:
    the state and each walked tensor a placeholder of concrete shape, each time read a
    select or size-1 slice of it, the body copied with every size it reads from outside
    (``sym_size`` and arithmetic on it) a number. A tensor it reads from outside is copied
    where it is computed from literals and sizes, else kept as a placeholder (which the
    meaning rule refuses by name, as for a static loop)."""
    graph = fx.Graph(owning_module=step.state_in.graph.owning_module)
    env = {step.state_in: _placeholder(graph, step.state_in, at)}
    twins = {g: (_placeholder(graph, g[0], at), g[1]) for g in groups}
    reads = {}
    for group, nodes in step.reads.items():
        source, axis = twins.get(group) or (_placeholder(graph, group[0], at), group[1])
        for node in nodes:
            env[node] = source if axis is None else \
                _twin_read(graph, node, source, axis, step.t, at)
        reads[(source, axis)] = [env[n] for n in nodes]
    consts = [c for c in (_twin_const(graph, c, env, at) for c in step.consts)
              if isinstance(c, fx.Node)]
    for node in step.body:
        env[node] = graph.node_copy(node, env.__getitem__)
    twin = Step(step.t, env[step.state_in], env.get(step.state_out), env[step.out], reads,
                [env[n] for n in step.body], consts)
    return twin, env.get(final), [twins[g] for g in groups]


def _placeholder(graph: fx.Graph, node: fx.Node, at: dict) -> fx.Node:
    place = graph.placeholder(node.name)
    place.meta["val"] = _concrete_value(node, at)
    return place


def _concrete_value(node: fx.Node, at: dict):
    value = node.meta.get("val")
    dims = [concrete(d, at) for d in value.shape]
    if None in dims:
        raise NoMatch(f"{node.name} has a size that depends on data", node=node)
    return torch.empty(dims, dtype=value.dtype, device="meta")


def _twin_read(graph: fx.Graph, node: fx.Node, source: fx.Node, axis: int, t: int, at):
    keep = time_read(node).keepdim
    read = graph.call_function(ATEN.slice.Tensor, (source, axis, t, t + 1)) if keep else \
        graph.call_function(ATEN.select.int, (source, axis, t))
    read.meta["val"] = _concrete_value(node, at)
    return read


def _twin_const(graph: fx.Graph, node: fx.Node, env: dict, at: dict, depth: int = 0):
    """A value the step reads from outside, at the sizes ``at``: a size as a number, a
    tensor computed from literals and sizes copied, any other tensor a placeholder."""
    if node in env:
        return env[node]
    value = node.meta.get("val")
    if isinstance(value, torch.SymInt):
        env[node] = concrete(value, at)
        if env[node] is None:
            raise NoMatch(f"{node.name} is a size that depends on data", node=node)
    elif node.op == "get_attr" or (node.op == "call_function" and depth < 8 and all(
            _computed(graph, a, env, at, depth) for a in node.all_input_nodes)):
        env[node] = graph.node_copy(node, env.__getitem__)
    elif isinstance(value, torch.Tensor):
        env[node] = _placeholder(graph, node, at)
    else:
        raise NoMatch(f"the step reads {node.name}, which is neither a tensor nor a size",
                      node=node)
    return env[node]


def _computed(graph: fx.Graph, node: fx.Node, env: dict, at: dict, depth: int) -> bool:
    """Whether ``node`` is copied as a literal or a size (not stood for by a placeholder)."""
    twin = _twin_const(graph, node, env, at, depth + 1)
    return not (isinstance(twin, fx.Node) and twin.op == "placeholder")
