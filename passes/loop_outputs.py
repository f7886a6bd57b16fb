"""How an unrolled loop gathers its per-step outputs out_t into one [.., T, ..] tensor.

Four encodings reach us, one per way of exporting ``buf[:, :, t] = out_t`` or a stack:
    in-place:  copy_(select(buf, axis, t), out_t)                    (training IR, make_fx)
    scatter:   buf' = select_scatter(buf, copy(select(buf, axis, t), out_t), axis, t)
    where:     buf' = where(arange(T) == t, expand(unsqueeze(copy(..), axis)), buf)  (core aten)
    stack:     stack([out_0, ..., out_T-1], axis)  or  cat([unsqueeze(out_t, axis)...], axis)
               or cat([out_t...], axis) of values with a size-1 axis there (bmm outputs)
    one step:  unsqueeze(out_0, axis) (a decode step's "stack of one")
A buffer position is a select, or a size-1 slice ``buf[:, t:t+1]`` (slice_scatter to write),
maybe through full slices ``buf[:, :]`` (and the slice_scatters writing them back) that
torch.export adds when sizes are symbolic.
Every position 0..T-1 must be written exactly once, in order, so the buffer's initial content
never shows; the gathered value is then exactly the fused op's output along ``axis``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from torch import fx

from gdn_fx.passes.program import (ASSERT_META, ATEN, BIG, full_slice, mutates, same_sizes,
                                   shape, unsliced)
from gdn_fx.passes.result import NoMatch

STACKS = (ATEN.stack.default, ATEN.cat.default)


@dataclass
class Gathered:
    """The node holding all T outputs, its time axis, and write nodes to erase first."""

    value: fx.Node
    axis: int
    erase: list = field(default_factory=list)  # in-place writes: no data edge, erase explicitly


def gather(outs: list[fx.Node], order: dict) -> Gathered:
    """Recognize how ``outs`` (out_0..out_T-1) are gathered; raise NoMatch with the reason."""
    first = _only_user(outs[0], 0)
    if first.target is ATEN.unsqueeze.default and len(outs) == 1 and not (
            len(first.users) == 1 and next(iter(first.users)).target in STACKS):
        return Gathered(first, first.args[1] % len(shape(first)))
    if first.target is ATEN.unsqueeze.default and len(first.users) == 1:
        first = next(iter(first.users))  # core aten spells stack as cat of unsqueezes
    if first.target in STACKS:
        return _stacked(outs, first)
    if first.target is ATEN.copy_.default:
        return _in_place(outs, order)
    if first.target is ATEN.copy.default:
        return _functional(outs)
    raise NoMatch(f"the output of step 0 goes to {first.name}, not to a buffer write or a stack",
                  node=first, step=0)


def _only_user(node: fx.Node, step: int) -> fx.Node:
    if len(node.users) != 1:
        raise NoMatch(f"the step output {node.name} has {len(node.users)} users, expected one "
                      "write", node=node, step=step)
    return next(iter(node.users))


def _position(node: fx.Node) -> Optional[int]:
    """t for select(buf, axis, t) or slice(buf, axis, t, t + 1), else None."""
    if node.target is ATEN.select.int:
        return node.args[2]
    if node.target is ATEN.slice.Tensor and len(node.args) >= 4 and \
            (len(node.args) < 5 or node.args[4] == 1) and node.args[3] == node.args[2] + 1:
        return node.args[2]
    return None


def _time_select(node, buf, axis, t, step) -> int:
    """Check ``node`` is buffer position t along ``axis``; return the axis (normalized)."""
    if _position(node) is None or unsliced(node.args[0]) is not buf:
        raise NoMatch(f"step {step} writes through {node.name}, not a position of the buffer",
                      node=node, step=step)
    dim, index = node.args[1] % len(shape(buf)), _position(node)
    if index != t or (axis is not None and dim != axis):
        raise NoMatch(f"writes buffer position {index} on axis {dim}, expected {t} on {axis}",
                      node=node, step=step)
    return dim


def _in_place(outs: list[fx.Node], order: dict) -> Gathered:
    buf, axis, erase = None, None, []
    for t, out in enumerate(outs):
        write = _only_user(out, t)
        if write.target is not ATEN.copy_.default or write.args[1] is not out or write.users:
            raise NoMatch(f"step {t} output is not written with copy_", node=write, step=t)
        view = write.args[0]
        buf = unsliced(view.args[0]) if buf is None else buf
        axis = _time_select(view, buf, axis, t, t)
        if len(view.users) != 1:
            raise NoMatch("the buffer slice is read besides the write", node=view, step=t)
        erase += [write, view] + _only_slices(view.args[0])
    _check_buffer(buf, axis, len(outs))
    _check_fresh(buf)
    last = max(order[n] for n in erase)
    erased = set(erase)  # a buffer has one user per step: a list lookup here is quadratic
    early = [u for u in buf.users if u not in erased and order[u] < last]
    if early:
        raise NoMatch(f"{early[0].name} reads the output buffer before the loop has filled it",
                      node=early[0])
    mutating = [u for u in buf.users if u not in erased and mutates(u)]
    if mutating:
        raise NoMatch(f"{mutating[0].name} writes the output buffer after the loop",
                      node=mutating[0])
    return Gathered(buf, axis, erase)


# Ops that allocate a new tensor, and ops whose result may share memory with their input.
FRESH = (ATEN.zeros.default, ATEN.empty.memory_format, ATEN.new_zeros.default,
         ATEN.new_empty.default, ATEN.zeros_like.default, ATEN.empty_like.default,
         ATEN.full.default, ATEN.new_full.default, ATEN.full_like.default, ATEN.ones.default,
         ATEN.ones_like.default, ATEN.new_ones.default, ATEN.empty_strided.default,
         ATEN.clone.default)
ALIASES = (ATEN.to.dtype, ATEN.to.device, ATEN.to.dtype_layout, ATEN.to.other,
           ATEN.alias.default, ATEN.detach.default)


def _check_fresh(buf: fx.Node) -> None:
    """In-place writes into ``buf`` reach whatever shares its memory, and only ``buf``'s own
    readers are rewired to the fused output: the buffer must be a fresh allocation (through
    casts that may alias it) that nothing else reads, not a view of a tensor read elsewhere."""
    node = buf
    while node.target in ALIASES:
        base = node.args[0]
        others = [u for u in base.users if u is not node and u.target is not ASSERT_META]
        if others:
            raise NoMatch(f"the output buffer {buf.name} aliases {base.name}, which "
                          f"{others[0].name} also reads: writes through it would not reach "
                          "the fused output's readers", node=buf)
        node = base
    if node.target not in FRESH:
        raise NoMatch(f"the loop writes its outputs through {buf.name} "
                      f"({getattr(node.target, '__name__', node.target)}), a view of another "
                      "tensor; the fused node would not write that tensor", node=buf)


def _check_buffer(buf: fx.Node, axis: int, length: int) -> None:
    if buf.op != "call_function":
        raise NoMatch(f"the output buffer {buf.name} is a graph input; writing it is a side "
                      "effect the fused node would drop", node=buf)
    if shape(buf)[axis] != length:
        raise NoMatch(f"the output buffer has {shape(buf)[axis]} positions on axis {axis}, the "
                      f"loop writes {length}", node=buf)


def _functional(outs: list[fx.Node]) -> Gathered:
    buf, axis = None, None
    for t, out in enumerate(outs):
        copy = _only_user(out, t)
        view = copy.args[0]
        if copy.target is not ATEN.copy.default or copy.args[1] is not out:
            raise NoMatch(f"step {t} output is not written with copy", node=copy, step=t)
        buf = unsliced(view.args[0]) if buf is None else buf
        axis = _time_select(view, buf, axis, t, t)
        if t == 0:
            _check_buffer(buf, axis, len(outs))
        buf = _next_buffer(copy, buf, axis, t, len(outs))
    return Gathered(buf, axis)


def _next_buffer(copy: fx.Node, buf: fx.Node, axis: int, t: int, length: int) -> fx.Node:
    """The buffer value after step t's write (select_scatter or the core-aten where form)."""
    user = _only_user(copy, t)
    if user.target in SCATTERS:
        if unsliced(user.args[0]) is not buf or user.args[2] % len(shape(buf)) != axis \
                or user.args[3] != t:
            raise NoMatch(f"{user.name} writes another buffer or position", node=user, step=t)
        nxt = user
    else:
        nxt = _where_write(user, buf, axis, t, length)
    nxt = _whole(nxt, buf)
    if t < length - 1:
        readers = _readers(nxt)
        positions = [u for u in readers if _position(u) is not None]
        writes = [u for u in readers if _writes(u, nxt)]
        if len(positions) != 1 or not writes or len(positions) + len(writes) != len(readers):
            raise NoMatch(f"the buffer after step {t} is read outside the loop", node=nxt, step=t)
    return nxt


SCATTERS = (ATEN.select_scatter.default, ATEN.slice_scatter.default)


def _writes(user: fx.Node, buf: fx.Node) -> bool:
    """``user`` writes into ``buf`` (a scatter or core aten's where), seen through slices."""
    if user.target in SCATTERS:
        return unsliced(user.args[0]) is buf
    return user.target is ATEN.where.self and unsliced(user.args[2]) is buf


def _whole(node: fx.Node, buf: fx.Node) -> fx.Node:
    """The buffer written as a whole: ``slice_scatter(buf, node)`` over every position of
    an axis, one per full slice ``buf[:, :]`` the write went through (torch.export writes
    them when sizes are symbolic), else ``node``."""
    while len(node.users) == 1:
        user = next(iter(node.users))
        if user.target is not ATEN.slice_scatter.default or user.args[1] is not node or \
                unsliced(user.args[0]) is not buf or not full_slice_args(user):
            break
        node = user
    return node


def full_slice_args(scatter: fx.Node) -> bool:
    """A slice_scatter whose slice covers its whole axis."""
    start, end, step = (list(scatter.args[3:]) + [0, None, 1][len(scatter.args) - 3:])[:3]
    return start in (0, None) and step == 1 and (end is None or (type(end) is int and
                                                                 end >= BIG))


def _readers(node: fx.Node) -> list:
    """The users of ``node``, seen through full slices."""
    found = []
    for user in node.users:
        found += _readers(user) if full_slice(user) else [user]
    return found


def _only_slices(view_source: fx.Node) -> list:
    """The full slices between a buffer and one write's view, when only that view reads
    them (erased with it)."""
    found = []
    while full_slice(view_source) and len(view_source.users) == 1:
        found.append(view_source)
        view_source = view_source.args[0]
    return found


def _where_write(unsq: fx.Node, buf: fx.Node, axis: int, t: int, length: int) -> fx.Node:
    """where(arange(0, T).view(..) == t, expand(unsqueeze(copy, axis)), buf)."""
    if unsq.target is not ATEN.unsqueeze.default or unsq.args[1] % len(shape(buf)) != axis:
        raise NoMatch("the step output is not scattered into the buffer", node=unsq, step=t)
    expand = _only_user(unsq, t)
    where = _only_user(expand, t) if expand.target is ATEN.expand.default else expand
    if (where.target is not ATEN.where.self or where.args[1] is not expand
            or unsliced(where.args[2]) is not buf):
        raise NoMatch("the step output is not merged with where", node=where, step=t)
    if _where_position(where.args[0], axis, len(shape(buf))) != (t, length):
        raise NoMatch(f"the where mask does not select position {t} of {length}", node=where,
                      step=t)
    return where


def _where_position(mask: fx.Node, axis: int, rank: int) -> Optional[tuple]:
    """(t, T) for eq(view(arange(0, T, 1), [.. -1 at axis ..]), t), else None."""
    if mask.target is not ATEN.eq.Scalar:
        return None
    view = mask.args[0]
    if view.target is not ATEN.view.default:
        return None
    arange = view.args[0]
    want_view = [-1 if i == axis else 1 for i in range(rank)]
    if arange.target is not ATEN.arange.start_step or list(view.args[1]) != want_view:
        return None
    start, end = arange.args[0], arange.args[1]
    step = arange.args[2] if len(arange.args) > 2 else 1
    if start != 0 or step != 1:
        return None
    return mask.args[1], end


def _stacked(outs: list[fx.Node], node: fx.Node) -> Gathered:
    items = list(node.args[0])
    rank = len(shape(node))
    axis = (node.args[1] if len(node.args) > 1 else 0) % rank
    if node.target is ATEN.cat.default and items == list(outs):
        try:
            node, axis = _cat_then_view(node, outs)  # stack decomposed as view(cat(outs))
        except NoMatch:
            if not all(shape(o)[axis] == 1 for o in outs):  # else size-1 values, concatenated
                raise
    elif node.target is ATEN.cat.default:
        items = [_unsqueezed(item, axis) for item in items]
    if items != list(outs):
        raise NoMatch("the stacked values are not the step outputs 0..T-1 in order", node=node)
    for t, out in enumerate(outs):
        _only_user(out, t)
    return Gathered(node, axis)


def _cat_then_view(cat: fx.Node, outs: list[fx.Node]) -> tuple[fx.Node, int]:
    """view(cat(outs, d), s[:d] + [T] + s[d:]) is stack(outs, d)."""
    each = list(shape(outs[0]))
    axis = (cat.args[1] if len(cat.args) > 1 else 0) % len(each)
    view = next(iter(cat.users)) if len(cat.users) == 1 else None
    stacked = each[:axis] + [len(outs)] + each[axis:]
    if view is None or view.target is not ATEN.view.default or \
            not same_sizes(list(view.args[1]), stacked):
        raise NoMatch("the step outputs are concatenated, not stacked", node=cat)
    return view, axis


def _unsqueezed(node: fx.Node, axis: int) -> Optional[fx.Node]:
    """x for unsqueeze(x, axis) read only by the cat, else None."""
    if (node.target is ATEN.unsqueeze.default and len(node.users) == 1
            and node.args[1] % len(shape(node)) == axis):
        return node.args[0]
    return None
