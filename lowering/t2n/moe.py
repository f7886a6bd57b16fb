"""Mixture-of-experts ops of transformers that torch-to-nnef has no handler for, as plain ops.

transformers' default experts kernel (``grouped_mm``) sorts the (token, expert) pairs by
expert, counts them per expert with ``aten.histc``, and multiplies each expert's run of rows
by that expert's weight in its own custom op ``transformers::grouped_mm_fallback(input [R, I],
weight [E, I, O], offs [E])`` (``offs``: cumulative row counts; rows ``offs[e-1]:offs[e]``
belong to expert e). torch-to-nnef 0.24.12 stops at both ("Unable to extract operation from
transformers::grouped_mm_fallback"; no ``histc``). The fixes here spell them with ops it
exports, so a plain ``torch.export`` of such a model needs no preparation
(``gdn_fx.hf.prepare_for_nnef``, which switches the model to the ``batched_mm`` kernel, is
no longer required):

- ``grouped_mm_fallback``: row r's expert is the number of ``offs`` entries <= r; gather each
  row's expert weight and multiply row by row (``bmm``), as transformers' ``batched_mm``
  kernel does; rows at or past ``offs[-1]`` (which the fallback leaves zero) read a zero
  expert appended to the weights.
- ``histc`` with explicit bounds: compare each element's bin index with every bin and sum.
- the ``cumsum`` that turns those counts into offsets: a sum under a triangular mask
  (:func:`cumsum_by_mask` says why).

By default a routed block that proves itself becomes ONE ``tract_moe_ffn`` before these
fixes run (``moe_ffn.py``; 7x to 200x faster in tract, bench/bench_moe.py): what is left here is
a block that did not prove itself, one on a tract before 0.23.9, or every block under
``choose={"transformers_moe": "gathered_bmm"}``. The gather spelling copies one expert weight
matrix per (token, expert) row: ~6 GiB at S = 64 for a Qwen3.5-MoE-sized layer.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.fx as fx

from gdn_fx.errors import ExportRefused

aten = torch.ops.aten


def grouped_mm_op():
    """transformers' custom op, or None when transformers (or its MoE module) is absent."""
    namespace = getattr(torch.ops, "transformers", None)
    try:
        return namespace.grouped_mm_fallback.default if namespace is not None else None
    except (AttributeError, RuntimeError):  # torch.ops raises on unknown names
        return None


def grouped_mm_as_gathered_bmm(input: torch.Tensor, weight: torch.Tensor,
                               offs: torch.Tensor) -> torch.Tensor:
    """What ``transformers::grouped_mm_fallback`` computes, in plain ops (module doc)."""
    rows = torch.arange(input.shape[0], device=input.device).unsqueeze(1)  # [R, 1]
    expert = (offs.to(rows.dtype).unsqueeze(0) <= rows).to(rows.dtype).sum(dim=1)  # [R]
    # Rows at or past offs[-1] count every expert: they read an appended zero expert (no
    # clamp or select on the index: tract 0.23.9 fails to evaluate them in a decode graph).
    padded = torch.cat([weight, torch.zeros_like(weight[:1])], dim=0)  # [E + 1, I, O]
    picked = padded.index_select(0, expert)  # [R, I, O]
    return torch.bmm(input.unsqueeze(1), picked).squeeze(1)


def histc_by_comparison(x: torch.Tensor, bins: int = 100, min: float = 0.0,
                        max: float = 0.0) -> torch.Tensor:
    """``torch.histc(x, bins, min, max)`` for ``min < max``, in plain ops: each element's
    bin, ``floor((x - min) * bins / (max - min))`` with ``x == max`` in the last bin,
    compared with every bin; elements outside ``[min, max]`` are not counted."""
    flat = x.reshape(-1)
    position = torch.floor((flat - min) * bins / (max - min))
    # x == max counts in the last bin (a where, not clamp: torch-to-nnef writes clamp's bound
    # as an integer literal, which tract will not compare with a float)
    position = torch.where(flat == max, torch.full_like(flat, bins - 1), position)
    inside = (flat >= min) & (flat <= max)
    every = torch.arange(bins, device=x.device).to(flat.dtype)
    hits = (position.unsqueeze(1) == every.unsqueeze(0)) & inside.unsqueeze(1)
    return hits.to(x.dtype).sum(dim=0)


def cumsum_by_mask(x: torch.Tensor, dim: int, dtype: Optional[torch.dtype] = None
                   ) -> torch.Tensor:
    """``torch.cumsum(x, dim, dtype=dtype)`` as a sum under a lower-triangular mask.

    Why: torch-to-nnef 0.24.12 writes ``cumsum`` as its ``tract_cumsum`` fragment, a
    ``tract_core_scan`` with ``reset_every_turn = false``; a tract State that is run again
    then starts from the last run's sum (docs/FACTS.md, "tract 0.23.9: traps"), and the
    experts' offsets, hence every routed row, come out wrong from the second run on. The
    offsets run over the expert count only, so the n x n mask is small."""
    moved = x.movedim(dim, -1)
    size = moved.shape[-1]
    index = torch.arange(size, device=x.device)
    below = (index.unsqueeze(0) <= index.unsqueeze(1)).to(moved.dtype)  # [out, in]: in <= out
    summed = (moved.unsqueeze(-2) * below).sum(dim=-1).movedim(-1, dim)
    return summed.to(dtype) if dtype is not None else summed


def _offsets_without_scan(grouped: fx.Node) -> int:
    """Point the cumsum that makes a grouped_mm's offsets at :func:`cumsum_by_mask`."""
    offsets = grouped.args[2]
    if not isinstance(offsets, fx.Node) or offsets.target is not aten.cumsum.default:
        return 0
    dim = offsets.args[1] if len(offsets.args) > 1 else offsets.kwargs["dim"]
    offsets.target = cumsum_by_mask
    offsets.args, offsets.kwargs = (offsets.args[0], dim, offsets.kwargs.get("dtype")), {}
    return 1


def _histc_bounds(node: fx.Node) -> tuple:
    names = ("bins", "min", "max")
    defaults = (100, 0.0, 0.0)
    return tuple(node.args[i + 1] if len(node.args) > i + 1 else node.kwargs.get(n, d)
                 for i, (n, d) in enumerate(zip(names, defaults)))


def grouped_mm_as_plain_ops(module: fx.GraphModule) -> int:
    """Point every ``transformers::grouped_mm_fallback`` at :func:`grouped_mm_as_gathered_bmm`
    and every bounded ``aten.histc`` at :func:`histc_by_comparison`; how many changed.
    A ``histc`` whose range comes from the data (``min == max``) is refused: its bins would
    depend on values tract cannot see at export."""
    grouped = grouped_mm_op()
    count = 0
    for node in module.graph.nodes:
        if grouped is not None and node.target is grouped:
            count += 1 + _offsets_without_scan(node)
            node.target = grouped_mm_as_gathered_bmm
        elif node.target is aten.histc.default:
            bins, low, high = _histc_bounds(node)
            if not low < high:
                raise ExportRefused(f"node '{node.name}': aten.histc with min={low}, max={high} "
                                    "takes its range from the data; only explicit bounds "
                                    "(min < max) can be exported")
            node.target, node.args, node.kwargs = histc_by_comparison, \
                (node.args[0], bins, low, high), {}
            count += 1
    if count:
        module.graph.lint()
        module.recompile()
    return count
