"""Absorb the loop's prologue into the fused node's operands.

The loop reads prepared tensors: q/k repeat-interleaved for GQA, transposed to head-major,
cast to f32, l2-normalized, q scaled. The fused op does all of that itself, so each operand is
traced back through those steps to the model-level tensor. A step is absorbed only where the op
reproduces it exactly (an up-cast to f32 that the op also does, an l2norm with eps 1e-6 on an
f32 value, ...); otherwise the operand stops there and the node stays in the graph, unchanged.
Peeling never deletes anything: nodes left without users are removed by dead-code elimination.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import fx

from gdn_fx.passes.program import ATEN, dtype, shape

L2NORM_EPS = 1e-6
LOW_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
EXACT = (torch.float32, torch.float64)  # dtypes in which the op computes as the graph did


@dataclass
class Operands:
    """The fused node's operands; names in ``to_time_major`` need a [0, 2, 1, ...] permute."""

    nodes: dict
    scale: float = 1.0
    qk_l2norm: bool = False
    to_time_major: set = field(default_factory=set)
    adapters: dict = field(default_factory=dict)  # name -> [(aten op, extra args)] applied first
    delta: bool = True  # gated_delta_scan's operands (else gated_linear_scan's: no beta)


def scan_operands(sources: dict, state: fx.Node, head_major: bool,
                  scale: Optional[float] = None, delta: bool = True) -> Operands:
    """Trace each source of the loop back through what the fused op can absorb.

    ``head_major``: the sources are [B, H, T, ...] (else [B, T, H, ...]); ``scale`` is given
    when the region itself scales q (else a scale in the prologue is peeled).
    """
    src = dict(sources)
    q, peeled = _peel_scale(src["q"]) if scale is None else (src["q"], scale)
    qn, kn = _l2norm(q), _l2norm(src["k"])
    l2 = delta and qn is not None and kn is not None  # gated_linear_scan normalizes nothing
    nodes = {**src, "q": qn if l2 else q, "k": kn if l2 else src["k"]}
    nodes = {name: _peel_casts(node) for name, node in nodes.items()}
    ops = Operands(nodes, peeled, l2, delta=delta)
    if head_major:  # find (or later insert) the transpose back to time-major
        for name, node in nodes.items():
            inner = _transposed(node)
            if inner is None:
                ops.to_time_major.add(name)
            else:
                nodes[name] = _peel_casts(inner)
    if not ops.to_time_major & {"q", "k"}:
        _peel_repeats(nodes)
    if "g" not in ops.to_time_major:  # a per-head gate expanded over keys
        nodes["g"] = _scalar_gate(nodes["g"]) or nodes["g"]
    ops.nodes["state"] = _peel_casts(state, up=False)
    return ops


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _peel_scale(node: fx.Node) -> tuple[fx.Node, float]:
    """q * c or q / c, computed in f32: absorbed as the op's scale."""
    if node.target in (ATEN.mul.Tensor, ATEN.div.Tensor) and _number(node.args[1]) \
            and isinstance(node.args[0], fx.Node) and dtype(node) in EXACT:
        c = float(node.args[1])
        return node.args[0], (c if node.target is ATEN.mul.Tensor else 1.0 / c)
    return node, 1.0


def _l2norm(node: fx.Node) -> Optional[fx.Node]:
    """x for x * rsqrt(sum(x*x, -1, keepdim) + 1e-6) or x / sqrt(...), computed in f32."""
    if dtype(node) not in EXACT or len(node.args) != 2:
        return None
    x, norm = node.args
    if node.target is ATEN.mul.Tensor and getattr(x, "target", None) is ATEN.rsqrt.default:
        x, norm = norm, x
    root = {ATEN.mul.Tensor: ATEN.rsqrt.default, ATEN.div.Tensor: ATEN.sqrt.default}
    if root.get(node.target) is None or getattr(norm, "target", None) is not root[node.target]:
        return None
    return x if _sum_of_squares_plus_eps(norm.args[0], x) else None


def _sum_of_squares_plus_eps(node: fx.Node, x: fx.Node) -> bool:
    if node.target is not ATEN.add.Tensor or not _number(node.args[1]):
        return False
    if abs(node.args[1] - L2NORM_EPS) > 1e-12:
        return False
    total = node.args[0]
    if total.target is not ATEN.sum.dim_IntList or len(total.args) < 3 or not total.args[2]:
        return False
    last = len(shape(x)) - 1
    if [d % (last + 1) for d in total.args[1]] != [last]:
        return False
    square = total.args[0]
    return square.target is ATEN.mul.Tensor and square.args[0] is x and square.args[1] is x


def _cast_source(node: fx.Node) -> Optional[fx.Node]:
    """The input of a dtype cast, device move or copy that keeps the value."""
    target = node.target
    if target in (ATEN.clone.default, ATEN.alias.default, ATEN.contiguous.default):
        return node.args[0]
    if target in (ATEN.to.dtype, ATEN.to.device, ATEN.to.dtype_layout, ATEN._to_copy.default):
        return node.args[0] if isinstance(node.args[0], fx.Node) else None
    return None


def _peel_casts(node: fx.Node, up: bool = True) -> fx.Node:
    """Skip same-dtype copies and (``up``) up-casts to f32 from f16/bf16/f32 (the op casts so
    itself)."""
    while (inner := _cast_source(node)) is not None and shape(inner) == shape(node) and (
            dtype(inner) == dtype(node)
            or up and dtype(node) == torch.float32 and dtype(inner) in LOW_FLOATS):
        node = inner
    return node


def _transposed(node: fx.Node) -> Optional[fx.Node]:
    """x for transpose(x, 1, 2) or permute(x, [0, 2, 1, ...])."""
    rank = len(shape(node))
    if node.target is ATEN.transpose.int:
        dims = sorted(d % rank for d in node.args[1:3])
        return node.args[0] if dims == [1, 2] else None
    if node.target is ATEN.permute.default:
        want = [0, 2, 1] + list(range(3, rank))
        return node.args[0] if [d % rank for d in node.args[1]] == want else None
    return None


def _peel_repeats(nodes: dict) -> None:
    """Absorb a GQA repeat_interleave on the head axis of q and k (both, same factor)."""
    q, k = _repeated(nodes["q"]), _repeated(nodes["k"])
    if q is not None and k is not None and q[1] == k[1]:
        nodes["q"], nodes["k"] = _peel_casts(q[0]), _peel_casts(k[0])


def _repeated(node: fx.Node) -> Optional[tuple[fx.Node, int]]:
    """(x, G) for x.repeat_interleave(G, dim=2) on [B, T, H, D], in either spelling."""
    if node.target is ATEN.repeat_interleave.self_int:
        if node.args[2] % 4 == 2 and _number(node.args[1]):
            return node.args[0], int(node.args[1])
        return None
    if node.target is not ATEN.view.default:  # core aten: view(clone(expand(unsqueeze(x, 3))))
        return None
    inner = node.args[0].args[0] if node.args[0].target is ATEN.clone.default else node.args[0]
    unsq = inner.args[0] if inner.target is ATEN.expand.default else None
    if unsq is None or unsq.target is not ATEN.unsqueeze.default or unsq.args[1] % 5 != 3:
        return None
    b, t, h, d = shape(unsq.args[0])
    groups = list(inner.args[1])[3]
    ok = list(inner.args[1]) == [b, t, h, groups, d] and list(node.args[1]) == [b, t, h * groups, d]
    return (unsq.args[0], groups) if ok else None


def _scalar_gate(node: fx.Node) -> Optional[fx.Node]:
    """g for g.unsqueeze(-1).expand(B, T, H, Dk): a per-head gate broadcast over keys."""
    if node.target is not ATEN.expand.default:
        return None
    unsq = node.args[0]
    if unsq.target is ATEN.unsqueeze.default and unsq.args[1] % 4 == 3:
        return unsq.args[0]
    return None
