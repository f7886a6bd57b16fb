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

tract's optimizer splits an op whose output is read only through slices along one axis into
one op per piece (seen in its node names, ".split-..-over-.."): slicing the blocks out of A,
or the first and last chunk out of the chunk maps, turned every batched op above them back
into one op per block or chunk (649 nodes at S = 4096, 157 of them slices; 497 GPU kernels).
So here no tensor is read through slices alone: the block inverse works on whole [C, C]
matrices with masks (T <- T - T A_w T per doubling of the block width), a state pass level
shifts by a pad of one slice of a tensor that is also read whole, and the final state is
picked by a [1, n] row. At S = 4096: 264 nodes, 163 GPU kernels. Masked sums over small axes
were tried for the blocks and are slow on tract's CUDA runtime (reduce_sum_small: 9 of the
15 ms of kernel time at S = 4096); ranks above 5 fail there (binary ops merge to rank 5).

Measured on an H200 (bench/bench_cuda.py, Qwen3.5 layer core, f16 q/k/v/beta, f32 state,
State.run with the inputs on the host): 13.2 ms at S = 4096 against 53.4 ms for the native
CUDA kernel (14.1 for the sliced text before it, same run), 2.24 against 6.82 ms at S = 512;
relative error 1e-6 against float64. The ~5.9 ms upload of the 50 MB of inputs is in every
path's time (the native kernel's too); the GPU's own work is ~6.9 ms (GEMMs 1.8, pads and
copies 2.2, elementwise 1.7).
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from gdn_fx.lowering import gdn_chunked, gdn_chunked_text as text
from gdn_fx.lowering import gdn_fast_common as common
from gdn_fx.lowering.facts import ScanFacts
from gdn_fx.lowering.nnef_emit import EmitContext
from gdn_fx.lowering.target import Target

CONSTANTS = text.CONSTANTS + ("eyek", "bmasks", "first", "lastrow")
# Chunk sizes measured on an H200 (bench/bench_cuda.py, 18:05 run, State.run): at S = 512
# 128 is faster (2.24 ms against 2.53 with 64 and 2.51 with 256), at S = 4096 too (13.2 ms
# against 15.2 with 64 and 15.3 with 256); shorter S take the next power of two (as
# "chunked_unrolled"), S below 512 chunks of 64 (not measured against 128 there).
CHUNK = 64
LONG_CHUNK = 128
LONG_FROM = 512  # S from which LONG_CHUNK is taken
# "prefix" (log-depth) or "sequential" (one matmul per chunk; measured with the earlier
# sliced text only: 13.3 / 16.8 ms at S = 4096 against 12.8 / 14.7 for the prefix, chunks of
# 128 / 64)
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


def _shifted(name: str, shift: int, chunks: int) -> str:
    """``name`` moved ``shift`` chunks later along axis 0, zeros in front (no concat of
    pieces: see the module docstring on tract's slice splitting)."""
    return (f"pad({_rows(name, 0, chunks - shift)}, padding = [({shift}, 0), (0, 0), (0, 0),"
            " (0, 0), (0, 0)])")


def block_levels(chunk: int, leaf: int) -> list[int]:
    """The block widths the inverse doubles through: leaf, 2 leaf, ... below ``chunk``."""
    widths, width = [], min(chunk, leaf)
    while width < chunk:
        widths.append(width)
        width *= 2
    return widths


def block_masks(chunk: int, leaf: int) -> np.ndarray:
    """[1, 1, levels + 1, C, C]: the leaf blocks' diagonal, then per width w of block_levels
    the blocks (rows in the second half, columns in the first half of each 2w block)."""
    rows, cols = np.indices((chunk, chunk))
    width = min(chunk, leaf)
    masks = [rows // width == cols // width]
    for w in block_levels(chunk, leaf):
        masks.append((rows // (2 * w) == cols // (2 * w)) & (rows // w > cols // w))
    return np.stack(masks).astype(np.float64)[None, None]


def inverse_part_lines(chunk: int, leaf: int) -> list[str]:
    """1/|k|, the pair decays E and A as in the sequential form (gdn_chunked_text.py), then
    T = (I + A)^-1 by blocks, on whole [C, C] matrices with masks (no slices): the leaf
    blocks' inverse by the product form (A masked to its diagonal leaf blocks is nilpotent
    of their width), then per doubling of the block width w, T <- T - T A_w T with A_w the
    lower-left w-blocks of each 2w block (exactly the 2x2 block step, T21 = -T22 A21 T11)."""
    pairs = text.inverse_part_lines(chunk, chunk)[:5]  # kkt, rk, rkr, e, a
    assert pairs[-1].startswith("a = "), pairs

    def mask(i: int) -> str:
        return f"slice(bmasks, axes = [2], begin = [{i}], end = [{i + 1}])"

    lines = pairs + [f"al = mul(a, {mask(0)});",
                     *text.inverse_lines("al", "tb0", min(chunk, leaf), "eyeh", "bi")]
    for i, _ in enumerate(block_levels(chunk, leaf)):
        lines.append(f"tb{i + 1} = sub(tb{i}, matmul(tb{i}, matmul(mul(a, {mask(i + 1)}),"
                     f" tb{i})));")
    return lines + [f"tt = copy(tb{len(block_levels(chunk, leaf))});"]


def prefix_lines(chunks: int) -> list[str]:
    """The inclusive prefix of the chunk maps, S_0 folded into B_0; ``states`` ends holding
    the state after every chunk. Each level is one batched update of every chunk from the
    chunks ``shift`` before it (zeros in front: chunks c < shift keep their value, and a
    span's M that reaches before chunk 0 only ever multiplies those zeros). The last level
    needs no M."""
    lines = ["p0 = add(bb, mul(first, matmul(" + _rows("mm", 0, 1)
             + ", unsqueeze(st0, axes = [0]))));", "m0 = copy(mm);"]
    shift, level = 1, 0
    while shift < chunks:
        m, p = f"m{level}", f"p{level}"
        lines.append(f"p{level + 1} = add({p}, matmul({m}, {_shifted(p, shift, chunks)}));")
        if shift * 2 < chunks:
            lines.append(f"m{level + 1} = matmul({m}, {_shifted(m, shift, chunks)});")
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


def output_lines(facts: ScanFacts, chunks: int) -> list[str]:
    """Every chunk's output from the state entering it, batched; the final state picked by a
    [1, n] row (a matmul: ``states`` is then read whole as well as through a slice, and a
    reduction over the chunk axis is slow on tract's CUDA runtime)."""
    if chunks == 1:
        entering, fin = "unsqueeze(st0, axes = [0])", "squeeze(states, axes = [0])"
    else:
        entering = (f"add({_shifted('states', 1, chunks)},"
                    " mul(first, unsqueeze(st0, axes = [0])))")
        fin = (f"reshape(matmul(lastrow, reshape(states, shape = [{chunks}, -1])),"
               f" shape = [-1, {facts.groups}, {facts.dk}, {facts.dv}])")
    return [f"sin = {entering};",
            "d = sub(u, matmul(w, sin));",
            "oo = add(mul(mul(egc, rqq), matmul(qq, sin)), matmul(mul(qkt, e), d));",
            f"fin = {fin};"]


def definitions(facts: ScanFacts, chunk: int, chunks: int, suffix: str,
                leaf: int = gdn_chunked.LEAF, state_pass: str = "prefix") -> str:
    """The one fragment of a node configuration (static S: ``chunks`` chunks of ``chunk``)."""
    pad = str(chunks * chunk - facts.seq)
    passes = prefix_lines if state_pass == "prefix" else sequential_lines
    main = (text.prepare_lines(facts, chunk, pad, suffix)
            + inverse_part_lines(chunk, leaf) + chunk_terms_lines()
            + passes(chunks) + output_lines(facts, chunks) + text.finish_lines(facts))
    return common.fragment_text(f"gdn_fx_chunked_parallel{suffix}",
                                ["q", "k", "v", "g", "beta", "s0", *CONSTANTS],
                                ["out", "final"], main)


def constants(facts: ScanFacts, chunk: int, chunks: int) -> dict[str, np.ndarray]:
    """The helpers this form reads beyond the sequential form's: the [C, C] identity as the
    leaf identity, the [Dk, Dk] identity, the block masks, the first chunk's mask, the row
    picking the last chunk."""
    first, last = np.zeros((chunks, 1, 1, 1, 1)), np.zeros((1, chunks))
    first[0], last[0, -1] = 1.0, 1.0
    return dict(eyeh=np.eye(chunk).reshape(1, 1, 1, chunk, chunk),
                eyek=np.eye(facts.dk).reshape(1, 1, 1, facts.dk, facts.dk),
                bmasks=block_masks(chunk, gdn_chunked.LEAF), first=first, lastrow=last)


def emit(ctx: EmitContext) -> list:
    """Write the batched chunks for one node (static S); returns the fragments it needs."""
    facts = ctx.facts
    chunk, state_pass = chunk_for(facts.seq), STATE_PASS
    chunks = -(-facts.seq // chunk)
    work = common.work_dtype(facts)
    operands = common.prepared_operands(ctx, work)
    values = gdn_chunked.constants(chunk, gdn_chunked.LEAF)
    values.update(constants(facts, chunk, chunks))
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
