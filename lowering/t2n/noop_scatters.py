"""Scatters that write back what their base already holds are their base (``noop_scatters``).

Qwen3.5's mRoPE builds its cos / sin table as ``freqs[0]`` with two strided slices
overwritten from ``freqs[1]`` and ``freqs[2]`` (``f[..., 1:33:3] = freqs[1, ..., 1:33:3]``).
For text, the three rows come from ``position_ids.expand(3, -1, -1)``: they are the same
values, so both writes are no-ops. Functionalized, each write is a ``slice_scatter`` under a
``select_scatter``; torch-to-nnef can only spell a strided scatter one position at a time
(fixes.unit_step_slice_scatters: ~32 slices and a 32-input concat each), ~130 slices per
call, every one a GPU launch under tract's CUDA runtime.

The proof is structural and exact: a tensor is *uniform* along an axis when every index
along it holds the same values (an axis of size 1, broadcast by ``expand``, and what
element-wise ops, casts, unsqueezes and slices make of such tensors); two selects of a
uniform tensor along that axis are the same values, whatever their indices. A scatter is
removed only when its source provably equals its base's own slice; otherwise it stays (for
instance mRoPE with 3-D position ids whose rows differ).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

aten = torch.ops.aten
_COPIES = {aten.clone.default, aten.alias.default}  # same values as their input
# traced_sizes.py turns an expand to symbolic sizes into the Tensor method
_EXPANDS = (aten.expand.default, "expand")


def _rank(node: fx.Node) -> Optional[int]:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return val.dim() if isinstance(val, torch.Tensor) else None


def _size(node: fx.Node, dim: int):
    return node.meta["val"].shape[dim]


def _same_shape(a, b) -> bool:
    """Shapes provably equal (symbolic sizes compared without adding a guard)."""
    if _rank(a) is None or _rank(b) is None:
        return False
    sa, sb = a.meta["val"].shape, b.meta["val"].shape
    return len(sa) == len(sb) and all(statically_known_true(x == y) for x, y in zip(sa, sb))


def _arg(node: fx.Node, index: int, name: str, default):
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def _pointwise(node: fx.Node) -> bool:
    """An element-wise op of its tensor arguments (a cast is one): equal inputs along an axis
    give equal outputs. Seeded random ops are not."""
    tags = getattr(node.target, "tags", ())
    return torch.Tag.pointwise in tags and torch.Tag.nondeterministic_seeded not in tags \
        and not any(isinstance(v, fx.Node) for v in node.kwargs.values())


def uniform(node: fx.Node, dim: int) -> bool:
    """Whether every index of ``node`` along ``dim`` (non-negative) holds the same values."""
    rank = _rank(node)
    if rank is None or not 0 <= dim < rank:
        return False
    size = _size(node, dim)
    if isinstance(size, int) and size == 1:  # (a symbolic size is never compared: no guard)
        return True
    source = node.args[0] if node.args else None
    if node.target in _EXPANDS:
        return _broadcast_uniform(source, dim, rank)
    if node.target is aten.slice.Tensor or node.target in _COPIES or \
            node.target is aten._to_copy.default:
        return uniform(source, dim)
    if node.target is aten.unsqueeze.default:
        at = node.args[1] % rank
        return dim == at or uniform(source, dim - (dim > at))
    if _pointwise(node):
        return all(_broadcast_uniform(arg, dim, rank) for arg in node.args
                   if isinstance(arg, fx.Node))
    return False


def _broadcast_uniform(operand, dim: int, rank: int) -> bool:
    """Whether ``operand``, broadcast from the right to ``rank`` axes, is uniform along
    ``dim`` (an axis it does not have, or has of size 1, is)."""
    own = _rank(operand)
    if own is None:
        return False
    dim -= rank - own
    return dim < 0 or uniform(operand, dim)


def _window(node: fx.Node, dim_at: int, size) -> tuple:
    """(dim, positions) of a slice or slice_scatter whose dim argument is at ``dim_at``."""
    rank = _rank(node.args[0])
    dim = _arg(node, dim_at, "dim", 0) % rank
    start = _arg(node, dim_at + 1, "start", None)
    end = _arg(node, dim_at + 2, "end", None)
    step = _arg(node, dim_at + 3, "step", 1)
    start = 0 if start is None else start
    if isinstance(size, int) and all(isinstance(v, (int, type(None))) for v in (start, end, step)):
        return dim, range(*slice(start, end, step).indices(size))
    return dim, (start, end, step)


def _peel(node):
    """The node whose values ``node`` has: through value-preserving copies, and through
    ``copy(dst, src)`` of src's own shape."""
    while isinstance(node, fx.Node):
        if node.target in _COPIES:
            node = node.args[0]
        elif node.target is aten.copy.default and _same_shape(node, node.args[1]):
            node = node.args[1]
        else:
            return node
    return node


def same_values(a, b) -> bool:
    """Whether nodes ``a`` and ``b`` provably hold the same values."""
    a, b = _peel(a), _peel(b)
    if a is b:
        return True
    if _rank(a) is None or _rank(b) is None:  # not tensors with known shapes: not proven
        return False
    if _rebroadcast(a, b) or _rebroadcast(b, a):
        return True
    if a.target is not b.target:
        return False
    if a.target not in (aten.slice.Tensor, aten.select.int) or \
            _rank(a.args[0]) is None or _rank(b.args[0]) is None:
        return False
    if a.target is aten.slice.Tensor:
        size = _size(a.args[0], _arg(a, 1, "dim", 0) % _rank(a.args[0]))
        return _window(a, 1, size) == _window(b, 1, size) and same_values(a.args[0], b.args[0])
    rank = _rank(a.args[0])  # two selects
    dim_a, dim_b = a.args[1] % rank, b.args[1] % rank
    if dim_a != dim_b or not same_values(a.args[0], b.args[0]):
        return False
    return _index(a.args[2], a.args[0], dim_a) == _index(b.args[2], b.args[0], dim_a) \
        or uniform(_peel(a.args[0]), dim_a)


def _rebroadcast(a: fx.Node, b: fx.Node) -> bool:
    """Whether ``a = expand(unsqueeze(select(X, d, i), d))`` to b's shape with X holding b's
    values, uniform along d (run_decompositions spells select_scatter through it)."""
    if a.target not in _EXPANDS or not _same_shape(a, b):
        return False
    unsqueezed = a.args[0]
    if _rank(unsqueezed) is None or unsqueezed.target is not aten.unsqueeze.default:
        return False
    dim = unsqueezed.args[1] % _rank(unsqueezed)
    picked = _peel(unsqueezed.args[0])
    return _rank(picked) is not None and picked.target is aten.select.int and \
        _rank(picked.args[0]) is not None and \
        picked.args[1] % _rank(picked.args[0]) == dim and \
        same_values(picked.args[0], b) and uniform(_peel(picked.args[0]), dim)


def _writes_back(node: fx.Node) -> bool:
    """Whether scatter ``node``'s source equals what its base holds where it writes."""
    base, src = node.args[0], _peel(node.args[1])
    if _rank(src) is None or _rank(base) is None or not src.args or _rank(src.args[0]) is None:
        return False
    if node.target is aten.slice_scatter.default:
        size = _size(base, _arg(node, 2, "dim", 0) % _rank(base))
        return src.target is aten.slice.Tensor and \
            _window(node, 2, size) == _window(src, 1, size) and same_values(src.args[0], base)
    rank = _rank(base)
    if src.target is not aten.select.int or src.args[1] % rank != node.args[2] % rank:
        return False
    dim, index = node.args[2] % rank, node.args[3]  # select_scatter(base, src, dim, index)
    return same_values(src.args[0], base) and (
        _index(src.args[2], base, dim) == _index(index, base, dim)
        or uniform(_peel(base), dim))


def _index(index, node: fx.Node, dim: int):
    size = _size(node, dim)
    return index % size if isinstance(index, int) and isinstance(size, int) else index


def _kept_value(node: fx.Node) -> Optional[fx.Node]:
    """The operand ``node`` provably equals, if it is a scatter that writes back its base's
    values or a ``where`` choosing between equal values."""
    if _rank(node) is None:
        return None
    if node.target in (aten.slice_scatter.default, aten.select_scatter.default):
        return node.args[0] if _writes_back(node) else None
    if node.target is aten.where.self and all(isinstance(a, fx.Node) for a in node.args[1:]):
        chosen, other = node.args[1], node.args[2]
        if _same_shape(chosen, node) and same_values(chosen, other):
            return chosen
    return None


def noop_scatters(module: fx.GraphModule) -> int:
    """Replace each slice_scatter / select_scatter that writes back its base's own values by
    its base (in graph order, so that a scatter over a removed one is seen through)."""
    count = 0
    for node in list(module.graph.nodes):
        kept = _kept_value(node)
        if kept is None:
            continue
        node.replace_all_uses_with(kept)
        module.graph.erase_node(node)
        count += 1
    if count:
        module.graph.eliminate_dead_code()
    return count
