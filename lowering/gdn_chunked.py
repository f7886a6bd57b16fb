"""Candidates "chunked" and "chunked_unrolled" for gated_delta_scan: the chunked (WY) prefill
form in plain NNEF (algebra in gdn_chunked_text.py).

- "chunked": the chunk recurrence is a ``tract_core_scan`` over chunks (``reset_every_turn =
  1``), ``SCAN_CHUNKS_PER_STEP`` chunks of ``SCAN_CHUNK`` per iteration; the sequence is padded
  to whole iterations at run time, so any S is served, symbolic too.
- "chunked_unrolled": the chunks are written out; static S only, at most
  ``MAX_UNROLLED_CHUNKS`` chunks (graph size and load time grow with the count).

Both serve GDN gates (one decay per head) with GQA (keys meet their value heads by
broadcasting), any scale, f16/f32/f64 operands (arithmetic in f32, f64 when q or the state is
f64; f16 models keep an f32 state), when the node l2-normalizes q and k itself. They refuse:
- KDA gates: a per-key decay makes the chunk's pair decays a [C, C, Dk] tensor, or a product
  exp(gamma) * exp(-gamma) that overflows for strong decays;
- qk_l2norm=False: nothing then bounds beta * |k|^2, and the product form of (I + A)^-1 (powers
  of A up to A^(C/4)) loses f32 precision when it exceeds 1 (measured 4e-4 relative error with
  raw random keys, against ~3e-7 normalized).
"matmul" serves both.

Sizes (bench/bench_gdn_fast.py and A/B runs on a busy 2-core machine): the loop takes 2 chunks
of 32 per iteration (beat 1 x 64 and 2 x 64: with one chunk per iteration tract pulls q S out
of the loop and stores every chunk's state); the unrolled form takes chunks of 64, shrunk to
the next power of two >= S for short S (S = 8: one chunk of 8, ~5x faster than chunks of 64).
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from gdn_fx.lowering import gdn_chunked_text as text
from gdn_fx.lowering import gdn_fast_common as common
from gdn_fx.lowering.node_facts import ScanFacts, portable_dtype_reason
from gdn_fx.lowering.nnef_emit import EmitContext
from gdn_fx.lowering.scan_chunks import SCAN_CHUNK, SCAN_CHUNKS_PER_STEP
from gdn_fx.lowering.target import Target

CHUNK = 64
# tract's load time grows super-linearly with the chunks written out (busy 2-core machine,
# 16 heads of 128: 8 chunks ~2 s, 16 ~15 s, 32 ~60 s); past this count "chunked" loops.
MAX_UNROLLED_CHUNKS = 16
LEAF = 16  # diagonal blocks of this width are inverted by the product form


def shared_reason(facts: ScanFacts) -> Optional[str]:
    if facts.kda:
        return ("KDA (per-key) gate: the chunked form needs a [C, C, Dk] decay per chunk; "
                "'matmul' serves KDA")
    if not facts.qk_l2norm:
        return ("qk_l2norm=False: keys of unbounded norm make the chunk inverse lose f32 "
                "precision; 'matmul' serves it")
    return portable_dtype_reason(facts)


def check(facts: ScanFacts, target: Target) -> Optional[str]:
    """Why the scan-over-chunks form can not serve this node (None: it can)."""
    return shared_reason(facts)


def check_unrolled(facts: ScanFacts, target: Target) -> Optional[str]:
    """Why the unrolled chunks can not serve this node (None: they can)."""
    if target.dynamic or facts.seq is None:
        return "unrolled chunks need a static S; the export has symbolic axes"
    chunks = -(-facts.seq // chunk_size(facts.seq))
    if chunks > MAX_UNROLLED_CHUNKS:
        return (f"S={facts.seq} is {chunks} chunks of {CHUNK}, more than the "
                f"{MAX_UNROLLED_CHUNKS} written out at most; 'chunked' loops over them")
    return shared_reason(facts)


def chunk_size(seq: int) -> int:
    """The unrolled form's chunk: CHUNK, or the next power of two >= S (at least 2) below."""
    size = 2
    while size < min(seq, CHUNK):
        size *= 2
    return size


def constants(chunk: int, leaf: int, rank: int = text.RANK) -> dict[str, np.ndarray]:
    """The masks and helpers the text reads, at the rank of the tensors they meet (``rank``:
    text.FLAT_RANK for the text without the G axis)."""
    upper = np.triu(np.ones((chunk, chunk)))
    width = min(chunk, leaf)
    leaves = text.leaf_rank(chunk, leaf, rank)
    square = (1,) * (rank - 2) + (chunk, chunk)
    return {"cum": upper.reshape(square),  # row @ cum = running sums
            "neg": np.where(np.triu(np.ones((chunk, chunk)), 1) > 0, -np.inf,
                            0.0).reshape(square),
            "strict": np.tril(np.ones((chunk, chunk)), -1).reshape(square),
            "eyeh": np.eye(width).reshape((1,) * (leaves - 2) + (width, width)),
            "eyec": np.eye(chunk).reshape(square),
            "zero4": np.zeros((1, 1, 1, 1)),
            "zero3": np.zeros((1, 1, 1))}


def emit(ctx: EmitContext) -> list:
    """Write the scan over chunks for one node; returns the fragments it needs."""
    return _emit(ctx, SCAN_CHUNK, unrolled_chunks=0)


def emit_unrolled(ctx: EmitContext) -> list:
    """Write the unrolled chunks for one node (static S); returns the fragments it needs."""
    chunk = chunk_size(ctx.facts.seq)
    return _emit(ctx, chunk, unrolled_chunks=-(-ctx.facts.seq // chunk))


def _emit(ctx: EmitContext, chunk: int, unrolled_chunks: int) -> list:
    facts = ctx.facts
    work = common.work_dtype(facts)
    operands = common.prepared_operands(ctx, work)
    values = constants(chunk, LEAF)
    consts = [common.scale_variable(ctx, work) if name == "scale" else
              common.variable(ctx, name, values[name], work) for name in text.CONSTANTS]
    name, frag = common.fragment(
        "gdn_fx_chunked",
        lambda suffix: text.definitions(facts, chunk, unrolled_chunks, suffix,
                                        SCAN_CHUNKS_PER_STEP, LEAF))
    out = ctx.tensor("out", facts.shapes["v"], work)
    final = ctx.tensor("final_state", facts.shapes["initial_state"], work)
    ctx.apply_multi(name, operands + consts, (out, final))
    common.finish_outputs(ctx, out, final)
    return [frag]
