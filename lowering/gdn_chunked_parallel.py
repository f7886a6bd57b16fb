"""Candidate "chunked_parallel" for gated_delta_scan: the chunked (WY) form with every chunk
computed at once and the chunk-to-chunk state pass as a log-depth prefix of affine maps.

Written for tract's CUDA runtime (static S): every op is a batched kernel over all chunks, no
loop (tract_core_scan runs on the CPU there), and the number of kernels grows with log2 of the
chunk count instead of the chunk count.

With the chunk terms of gdn_chunked_text.py (U, W, the decays), chunk c maps the state S_c
entering it to

    S_{c+1} = M_c S_c + B_c,   M_c = e^gamma_C I - K_r^T W,   B_c = K_r^T U,

K_r = diag(e^(gamma_C - gamma) / |k|) k. The states after every chunk are the inclusive prefix
compositions of these maps: log2(n) levels (Hillis-Steele), each two batched matmuls,
(M, B)[c] <- (M[c] M[c-d], M[c] B[c-d] + B[c]) for c >= d. S_0 is folded into B_0, so the
prefix B is the state itself, and M_0 need not be zeroed: an update at shift d multiplies by
M[c] only for c >= d, whose span starts after chunk 0, so a wrong "M" of a span reaching
chunk 0 never multiplies a state. Then every chunk's output comes from the state entering
it, batched over chunks, as in the sequential form.

Cost against the sequential form: log2(n) products of [Dk, Dk] by [Dk, Dk + Dv] per chunk
(the M products) instead of one [C, Dk] by [Dk, Dv]: more arithmetic, far fewer kernels.
It serves what "chunked_unrolled" serves (GDN gates, q/k l2norm in the node), any static S.

Measured on an H200 (bench/bench_cuda.py, Qwen3.5 layer core, f16 q/k/v/beta, f32 state):
State.run 14.5 ms at S = 4096 against 58 ms for the native CUDA kernel, 3.2 against 6.6 ms
at S = 512; relative error 1e-6 against float64. Chunks above 128 would need rank-9
tensors for the block inverse (NNEF's limit is 8 with leaves of 16).
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from gdn_fx.lowering import gdn_chunked, gdn_chunked_text as text
from gdn_fx.lowering import gdn_fast_common as common
from gdn_fx.lowering.facts import ScanFacts
from gdn_fx.lowering.nnef_emit import EmitContext
from gdn_fx.lowering.target import Target

CONSTANTS = text.CONSTANTS + ("eyek",)
# Chunk sizes measured on an H200 (bench/bench_cuda.py): 64 is faster up to S = 512 (2.8 ms
# against 3.3 with 128), 128 at S = 4096 (12.8 ms against 14.7 with 64); shorter S take the
# next power of two (as "chunked_unrolled").
CHUNK = 64
LONG_CHUNK = 128
LONG_FROM = 2048  # S from which LONG_CHUNK is taken
# "prefix" (log-depth) or "sequential" (one matmul per chunk: 13.3 / 16.8 ms at S = 4096
# against 12.8 / 14.7 for the prefix, chunks of 128 / 64)
STATE_PASS = "prefix"


def chunk_for(seq: int) -> int:
    """The chunk a static S is cut into."""
    return chunk_size(seq, LONG_CHUNK if seq >= LONG_FROM else CHUNK)


def chunk_size(seq: int, largest: int) -> int:
    """``largest``, or the next power of two >= S (at least 2) below it."""
    size = 2
    while size < min(seq, largest):
        size *= 2
    return size


def check(facts: ScanFacts, target: Target) -> Optional[str]:
    """Why the batched chunks can not serve this node (None: they can): static S only."""
    if target.dynamic or facts.seq is None:
        return "the batched chunks need a static S; the export has symbolic axes"
    return gdn_chunked.shared_reason(facts)


def suits(facts: ScanFacts, target: Target) -> Optional[str]:
    """Measured for the CUDA runtime; on the CPU the sequential chunk pass does less work.
    S = 1 is one step: "matmul_step" (or the native kernel) does far less."""
    if facts.seq == 1:
        return "S = 1 is one step: 'matmul_step' computes it without chunk terms"
    if target.runtime != "cuda":
        return ("written for the CUDA runtime: on the CPU the sequential chunk pass "
                "('chunked_unrolled', 'chunked') does log2(chunks) times less state arithmetic")
    return None


def chunk_terms_lines() -> list[str]:
    """Per chunk, batched over all chunks: U, W, q k^T, and the affine map (M, B)."""
    return ["qkt = mul(matmul(qq, kk, transposeB = true), mul(rqq, rkr));",
            "tb = mul(tt, br);",
            "u = matmul(tb, vv);",
            "w = matmul(mul(tb, mul(egr, rkr)), kk);",
            "kr = mul(kk, mul(r, rk));",
            "mm = sub(mul(ac, eyek), matmul(kr, w, transposeA = true));",
            "bb = matmul(kr, u, transposeA = true);"]


def _rows(name: str, begin: int, end: int) -> str:
    return f"slice({name}, axes = [0], begin = [{begin}], end = [{end}])"


def prefix_lines(chunks: int) -> list[str]:
    """The inclusive prefix of the chunk maps, S_0 folded into B_0; ``p{i}`` ends holding the
    state after every chunk. The last level needs no M."""
    lines = [f"p0 = concat([add(matmul({_rows('mm', 0, 1)}, unsqueeze(st0, axes = [0])),"
             f" {_rows('bb', 0, 1)}), {_rows('bb', 1, chunks)}], axis = 0);" if chunks > 1
             else "p0 = add(matmul(mm, unsqueeze(st0, axes = [0])), bb);",
             "m0 = copy(mm);"]
    shift, level = 1, 0
    while shift < chunks:
        m, p, hi = f"m{level}", f"p{level}", _rows(f"m{level}", shift, chunks)
        lines.append(f"p{level + 1} = concat([{_rows(p, 0, shift)}, add(matmul({hi},"
                     f" {_rows(p, 0, chunks - shift)}), {_rows(p, shift, chunks)})], axis = 0);")
        if shift * 2 < chunks:
            lines.append(f"m{level + 1} = concat([{_rows(m, 0, shift)}, matmul({hi},"
                         f" {_rows(m, 0, chunks - shift)})], axis = 0);")
        shift, level = shift * 2, level + 1
    return lines + [f"states = copy(p{level});"]


def sequential_lines(chunks: int) -> list[str]:
    """The same states, one chunk map after the other (one matmul and one add per chunk)."""
    lines = [f"p0 = add(matmul({_rows('mm', 0, 1)}, unsqueeze(st0, axes = [0])),"
             f" {_rows('bb', 0, 1)});"]
    for c in range(1, chunks):
        lines.append(f"p{c} = add(matmul({_rows('mm', c, c + 1)}, p{c - 1}),"
                     f" {_rows('bb', c, c + 1)});")
    return lines + [f"states = concat([{', '.join(f'p{c}' for c in range(chunks))}], axis = 0);"]


def output_lines(chunks: int) -> list[str]:
    """Every chunk's output from the state entering it, batched; the final state."""
    entering = ("unsqueeze(st0, axes = [0])" if chunks == 1 else
                f"concat([unsqueeze(st0, axes = [0]), {_rows('states', 0, chunks - 1)}],"
                " axis = 0)")
    return [f"sin = {entering};",
            "d = sub(u, matmul(w, sin));",
            "oo = add(mul(mul(egc, rqq), matmul(qq, sin)), matmul(mul(qkt, e), d));",
            f"fin = squeeze({_rows('states', chunks - 1, chunks)}, axes = [0]);"]


def definitions(facts: ScanFacts, chunk: int, chunks: int, suffix: str,
                leaf: int = gdn_chunked.LEAF, state_pass: str = "prefix") -> str:
    """The one fragment of a node configuration (static S: ``chunks`` chunks of ``chunk``)."""
    pad = str(chunks * chunk - facts.seq)
    passes = prefix_lines if state_pass == "prefix" else sequential_lines
    main = (text.prepare_lines(facts, chunk, pad, suffix) + text.inverse_part_lines(chunk, leaf)
            + chunk_terms_lines() + passes(chunks) + output_lines(chunks)
            + text.finish_lines(facts))
    return common.fragment_text(f"gdn_fx_chunked_parallel{suffix}",
                                ["q", "k", "v", "g", "beta", "s0", *CONSTANTS],
                                ["out", "final"], main)


def emit(ctx: EmitContext) -> list:
    """Write the batched chunks for one node (static S); returns the fragments it needs."""
    facts = ctx.facts
    chunk, state_pass = chunk_for(facts.seq), STATE_PASS
    chunks = -(-facts.seq // chunk)
    work = common.work_dtype(facts)
    operands = common.prepared_operands(ctx, work)
    values = dict(gdn_chunked.constants(chunk, gdn_chunked.LEAF),
                  eyek=np.eye(facts.dk).reshape(1, 1, 1, facts.dk, facts.dk))
    consts = [common.scale_variable(ctx, work) if name == "scale" else
              common.variable(ctx, name, values[name], work) for name in CONSTANTS]
    name, frag = common.fragment(
        "gdn_fx_chunked_parallel",
        lambda suffix: definitions(facts, chunk, chunks, suffix, state_pass=state_pass))
    out = ctx.tensor("out", facts.shapes["v"], work)
    final = ctx.tensor("final_state", facts.shapes["initial_state"], work)
    ctx.apply_multi(name, operands + consts, (out, final))
    common.finish_outputs(ctx, out, final)
    return [frag]
