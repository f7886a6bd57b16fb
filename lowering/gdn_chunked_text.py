"""NNEF text of the chunked (WY) gated-delta form, for GDN (one decay per head) gates.

Per chunk of C steps, with gamma the cumulative log decay inside the chunk, E[i, j] =
exp(gamma_i - gamma_j) for i >= j (0 above the diagonal) and A = strict_lower(beta_row *
(k k^T) * E), the delta-rule updates of the chunk solve (I + A) delta = beta (v - e^gamma k S).
A is nilpotent (A^C = 0), so with T = (I + A)^-1 = (I - A)(I + A^2)(I + A^4)...(I + A^(C/2))
the chunk is, from the state S entering it:

    U = (T * beta_col) v                W = (T * (beta e^gamma)_col) k
    delta = U - W S                     o = e^gamma_row * (q S) + (q k^T * E) delta
    S' = e^gamma_C S + k^T (e^(gamma_C - gamma) * delta)

T is built by 2x2 blocks: the two diagonal blocks (C/2 wide) are inverted together (again by
blocks, down to a leaf width where the product above takes over), the off-diagonal one is
-T22 A21 T11. Everything is exact algebra: no triangular solve (NNEF has none), no
approximation. q and k arrive raw: their l2norm is folded into row and column scalings of
small tensors (1/|k| is read off the diagonal of k k^T).

k k^T, E and T are computed for all chunks at once (their many small ops then run once, on a
leading chunk axis); the rest runs chunk after chunk: a tract_core_scan, or written out for a
static S.

Layouts: M = B * Hk merges batch and key heads; G is the GQA factor. Keys and queries are
[.., M, 1, C, Dk] and meet the G value heads of their key head by broadcasting (never
repeated); values, gates, states are [.., M, G, ...]. The sequence is zero-padded to whole
chunks (zero keys and beta, zero log decay: the padded steps leave the state as it is) and the
output sliced back; the pad is computed at run time from the sequence length, so a symbolic S
is served by the same text.
"""

from __future__ import annotations

from gdn_fx.lowering import gdn_fast_common as common
from gdn_fx.lowering.facts import ScanFacts

CHUNK_INPUTS = ("q", "rq", "k", "v", "e", "tt", "br", "egc", "egr", "rk", "rkr", "r", "ac")
CHUNK_SOURCES = ("qq", "rqq", "kk", "vv", "e", "tt", "br", "egc", "egr", "rk", "rkr", "r", "ac")
CONSTANTS = ("cum", "neg", "strict", "eyeh", "eyec", "zero4", "zero3", "scale")
RANK = 5  # [n chunks, B*Hk, G or 1, rows, columns]


def inverse_lines(source: str, result: str, size: int, eye: str, tag: str) -> list[str]:
    """``result = (I + source)^-1`` for a strictly lower ``source`` of width ``size``: the
    product (I - A)(I + A^2)...(I + A^(size/2)), log2(size) factors, 2 log2(size) - 2 matmuls."""
    lines = [f"{tag}t0 = sub({eye}, {source});", f"{tag}p1 = {source};"]
    power, i = 2, 0
    while power < size:
        lines += [f"{tag}p{i + 2} = matmul({tag}p{i + 1}, {tag}p{i + 1});",
                  f"{tag}t{i + 1} = add({tag}t{i}, matmul({tag}t{i}, {tag}p{i + 2}));"]
        power, i = power * 2, i + 1
    return lines + [f"{result} = copy({tag}t{i});"]


def block_inverse_lines(source: str, result: str, size: int, rank: int, leaf: int,
                        tag: str = "b") -> list[str]:
    """``result = (I + source)^-1`` over the last two axes of a rank-``rank`` tensor, by 2x2
    blocks: the two diagonal blocks are inverted together (stacked on a new axis, recursively
    down to width ``leaf``, where the product form takes over), the off-diagonal block is
    -T22 A21 T11. The leaf identity is the constant ``eyeh`` of rank ``rank`` + levels."""
    if size <= leaf:
        return inverse_lines(source, result, size, "eyeh", f"{tag}i")
    h, rows, cols = size // 2, rank - 2, rank - 1
    pad = ", ".join(["(0, 0)"] * (rank - 1) + [f"(0, {h})"])
    return [f"{tag}11 = slice({source}, axes = [{rows}, {cols}], begin = [0, 0],"
            f" end = [{h}, {h}]);",
            f"{tag}22 = slice({source}, axes = [{rows}, {cols}], begin = [{h}, {h}],"
            f" end = [{size}, {size}]);",
            f"{tag}21 = slice({source}, axes = [{rows}, {cols}], begin = [{h}, 0],"
            f" end = [{size}, {h}]);",
            f"{tag}d = concat([unsqueeze({tag}11, axes = [{rows}]),"
            f" unsqueeze({tag}22, axes = [{rows}])], axis = {rows});",
            *block_inverse_lines(f"{tag}d", f"{tag}td", h, rank + 1, leaf, tag + "b"),
            f"{tag}t11 = squeeze(slice({tag}td, axes = [{rows}], begin = [0], end = [1]),"
            f" axes = [{rows}]);",
            f"{tag}t22 = squeeze(slice({tag}td, axes = [{rows}], begin = [1], end = [2]),"
            f" axes = [{rows}]);",
            f"{tag}x21 = neg(matmul({tag}t22, matmul({tag}21, {tag}t11)));",
            f"{result} = concat([pad({tag}t11, padding = [{pad}]),"
            f" concat([{tag}x21, {tag}t22], axis = {cols})], axis = {rows});"]


def leaf_rank(chunk: int, leaf: int) -> int:
    """Rank of the leaf blocks (and of the ``eyeh`` constant): RANK plus one per halving."""
    rank = RANK
    while chunk > leaf:
        chunk, rank = chunk // 2, rank + 1
    return rank


def inverse_part_lines(chunk: int, leaf: int) -> list[str]:
    """For every chunk at once (rank-5 tensors): 1/|k| from the diagonal of k k^T, the pair
    decays E and T = (I + A)^-1. Batched over chunks: these many small ops then run once."""
    eps = common.literal(common.L2NORM_EPS)
    return ["kkt = matmul(kk, kk, transposeB = true);",
            f"rk = rsqrt(add(sum_reduce(mul(kkt, eyec), axes = [4]), {eps}));",
            "rkr = transpose(rk, axes = [0, 1, 2, 4, 3]);",
            "e = exp(add(sub(gc, gr), neg));",
            "a = mul(mul(kkt, mul(e, strict)), mul(bc, mul(rk, rkr)));",
            *block_inverse_lines("a", "tt", chunk, RANK, leaf)]


def chunk_lines() -> list[str]:
    """One chunk from the state entering it (see the module docstring). q and k arrive RAW:
    their l2norm is folded into row/column scalings of small tensors (rq = scale / |q|,
    rk = 1 / |k|)."""
    return ["qkt = mul(matmul(q, k, transposeB = true), mul(rq, rkr));",
            "tb = mul(tt, br);",
            "u = matmul(tb, v);",
            "w = matmul(mul(tb, mul(egr, rkr)), k);",
            "d = sub(u, matmul(w, state));",
            "o = add(mul(mul(egc, rq), matmul(q, state)), matmul(mul(qkt, e), d));",
            "new_state = add(mul(state, ac),"
            " matmul(k, mul(mul(r, rk), d), transposeA = true));"]


def _heads_first(name: str, source: str, rank_tail: int, facts: ScanFacts) -> str:
    """[B, n, C, H, ...] -> [n, B*Hk, G or 1, C, ...] (the value-side split when G given)."""
    hk, g = facts.key_heads, facts.groups
    if rank_tail == 1:  # q, k: [B, n, C, Hk, Dk]
        return (f"{name} = unsqueeze(reshape(transpose({source}, axes = [1, 0, 3, 2, 4]),"
                " shape = [-1], axis_start = 1, axis_count = 2), axes = [2]);")
    split = f"reshape({source}, shape = [{hk}, {g}], axis_start = 3, axis_count = 1)"
    axes = "[1, 0, 3, 4, 2, 5]" if rank_tail == 2 else "[1, 0, 3, 4, 2]"
    return (f"{name} = reshape(transpose({split}, axes = {axes}), shape = [-1],"
            " axis_start = 1, axis_count = 2);")


def _padded(name: str, source: str, pad: str, tail: str, zero: str, chunk: int) -> list[str]:
    """``name`` = ``source`` [B, S, ...] zero-padded to whole chunks, as [B, n, C, ...]."""
    if pad == "0":
        padded = source
    else:
        padded = (f"concat([{source}, tract_core_broadcast({zero}, shape = [b, {pad}{tail}])],"
                  " axis = 1)")
    return [f"{name} = reshape({padded}, shape = [-1, {chunk}], axis_start = 1, axis_count = 1);"]


def prepare_lines(facts: ScanFacts, chunk: int, pad: str, suffix: str) -> list[str]:
    """Prologue: normalize/scale, pad, chunk and lay out every operand; the gate terms."""
    hk, hv, dk, dv = facts.key_heads, facts.value_heads, facts.dk, facts.dv
    lines = common.dims_lines() + [
        f"rqs = mul(rsqrt(add(sum_reduce(mul(q, q), axes = [3]), "
        f"{common.literal(common.L2NORM_EPS)})), scale);"]
    for name, source, tail, zero in (("qp", "q", f", {hk}, {dk}", "zero4"),
                                     ("rqp", "rqs", f", {hk}, 1", "zero4"),
                                     ("kp", "k", f", {hk}, {dk}", "zero4"),
                                     ("vp", "v", f", {hv}, {dv}", "zero4"),
                                     ("gp", "g", f", {hv}", "zero3"),
                                     ("bp", "beta", f", {hv}", "zero3")):
        lines += _padded(name, source, pad, tail, zero, chunk)
    lines += [_heads_first("qq", "qp", 1, facts), _heads_first("rqq", "rqp", 1, facts),
              _heads_first("kk", "kp", 1, facts),
              _heads_first("vv", "vp", 2, facts), _heads_first("gg", "gp", 3, facts),
              _heads_first("bb", "bp", 3, facts)]
    return lines + [
        "gr = matmul(unsqueeze(gg, axes = [3]), cum);",  # cumulative sums, as rows
        "gc = transpose(gr, axes = [0, 1, 2, 4, 3]);",
        "br = unsqueeze(bb, axes = [3]);",
        "bc = unsqueeze(bb, axes = [4]);",
        "egr = exp(gr);",
        "egc = exp(gc);",
        f"glast = slice(gc, axes = [3], begin = [{chunk - 1}], end = [{chunk}]);",
        "r = exp(sub(glast, gc));",
        "ac = exp(glast);",
        f"st0 = reshape(s0, shape = [-1, {facts.groups}], axis_start = 0, axis_count = 2);"]


def finish_lines(facts: ScanFacts, fin: str = "fin") -> list[str]:
    """Chunk outputs [n, M, G, C, Dv] back to [B, S, Hv, Dv]; the final state ``fin`` to the
    contract."""
    hk = facts.key_heads
    return [f"o6 = transpose(reshape(oo, shape = [-1, {hk}], axis_start = 1, axis_count = 1),"
            " axes = [1, 0, 4, 2, 3, 5]);",
            "o4 = reshape(reshape(o6, shape = [-1], axis_start = 1, axis_count = 2),"
            " shape = [-1], axis_start = 2, axis_count = 2);",
            "out = slice(o4, axes = [1], begin = [0], end = [n]);",
            f"final = reshape({fin}, shape = [-1, {facts.value_heads}], axis_start = 0,"
            " axis_count = 2);"]


def scan_loop_lines(per_step: int, suffix: str) -> list[str]:
    """The chunk recurrence as a tract_core_scan over the chunk axis (axis 0), ``per_step``
    chunks per iteration."""
    scans = ", ".join(f'("{name}_c", {src}, 0, {per_step})'
                      for name, src in zip(CHUNK_INPUTS, CHUNK_SOURCES))
    return [f'(fin, oo) = tract_core_scan(body = "gdn_fx_chunked_scan_step{suffix}",',
            f"    scan = [{scans}],",
            '    full = [], state = [("state", st0, "new_state")],',
            f'    output = [("new_state", "last", 0, 1), ("o_c", "full", 0, {per_step})],',
            "    skip = 0, reset_every_turn = 1);"]


def scan_step_lines(per_step: int, suffix: str) -> list[str]:
    """The loop body: ``per_step`` chunks one after the other. Their outputs leave the body
    through a concat along the scanned axis, which tract 0.23.9 does not pull out of the loop
    (with one chunk it pulls q S out and materializes the state of every chunk: slower)."""
    lines, state = [], "state"
    for i in range(per_step):
        args = ", ".join(f"squeeze(slice({name}_c, axes = [0], begin = [{i}], end = [{i + 1}]),"
                         " axes = [0])" for name in CHUNK_INPUTS)
        after = "new_state" if i == per_step - 1 else f"mid{i}"
        lines.append(f"({after}, o{i}) = gdn_fx_chunked_chunk{suffix}({state}, {args});")
        state = after
    outs = ", ".join(f"unsqueeze(o{i}, axes = [0])" for i in range(per_step))
    return lines + [f"o_c = concat([{outs}], axis = 0);"]


def unrolled_loop_lines(chunks: int, suffix: str) -> list[str]:
    """The chunk recurrence written out for a static number of chunks."""
    lines, state, outs = [], "st0", []
    for c in range(chunks):
        args = ", ".join(f"squeeze(slice({src}, axes = [0], begin = [{c}], end = [{c + 1}]),"
                         " axes = [0])" for src in CHUNK_SOURCES)
        lines.append(f"(st{c + 1}, oc{c}) = gdn_fx_chunked_chunk{suffix}({state}, {args});")
        state = f"st{c + 1}"
        outs.append(f"unsqueeze(oc{c}, axes = [0])")
    return lines + [f"oo = concat([{', '.join(outs)}], axis = 0);", f"fin = copy({state});"]


def definitions(facts: ScanFacts, chunk: int, unrolled_chunks: int, suffix: str,
                per_step: int = 2, leaf: int = 16) -> str:
    """Every fragment of one node configuration; ``unrolled_chunks`` 0 means the scan form
    (``per_step`` chunks per iteration) with a run-time pad, else that many chunks written out
    (static S)."""
    parts = [common.fragment_text(f"gdn_fx_chunked_chunk{suffix}", ["state", *CHUNK_INPUTS],
                                  ["new_state", "o"], chunk_lines())]
    if unrolled_chunks:
        pad = str(unrolled_chunks * chunk - facts.seq)
        loop = unrolled_loop_lines(unrolled_chunks, suffix)
    else:
        whole = chunk * per_step
        pad = f"(n + {whole - 1}) / {whole} * {whole} - n"
        loop = scan_loop_lines(per_step, suffix)
        parts.append(common.fragment_text(
            f"gdn_fx_chunked_scan_step{suffix}",
            ["state", *(f"{n}_c" for n in CHUNK_INPUTS)],
            ["new_state", "o_c"], scan_step_lines(per_step, suffix)))
    main = (prepare_lines(facts, chunk, pad, suffix) + inverse_part_lines(chunk, leaf) + loop
            + finish_lines(facts, "fin"))
    parts.append(common.fragment_text(f"gdn_fx_chunked{suffix}",
                                      ["q", "k", "v", "g", "beta", "s0", *CONSTANTS],
                                      ["out", "final"], main))
    return "\n".join(parts)
