"""NNEF text of the chunked (WY) gated-delta form, for GDN (one decay per head) gates.

Per chunk of C steps, with gamma the cumulative log decay inside the chunk, E[i, j] =
exp(gamma_i - gamma_j) for i >= j (0 above the diagonal) and A = strict_lower(beta_row *
(k k^T) * E), the delta-rule updates of the chunk solve (I + A) delta = beta (v - e^gamma k S).
A is nilpotent (A^C = 0), so with T = (I + A)^-1 = (I - A)(I + A^2)(I + A^4)...(I + A^(C/2))
the chunk is, from the state S entering it:

    U = (T * beta_col) v                W = (T * (beta e^gamma)_col) k
    delta = U - W S                     o = e^gamma_row * (q S) + (q k^T * E) delta
    S' = e^gamma_C S + k^T (e^(gamma_C - gamma) * delta)

The cumulative log decays are held in two exact parts (``gate_lines``: the gate clamped at
-1024, its integer ceiling and the rest), and every e^(gamma_i - gamma_j) is taken part by part
(``pair_decay``), so a reset gate (-1e9, -inf: decay 0) neither rounds away the small gates
after it nor makes a NaN (docs/FACTS.md, "Reset gates").

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
from gdn_fx.lowering.node_facts import ScanFacts
from gdn_fx.ops import GATE_FLOOR

CHUNK_INPUTS = ("q", "rq", "k", "v", "e", "tt", "br", "egc", "egr", "rk", "rkr", "r", "ac")
CHUNK_SOURCES = ("qq", "rqq", "kk", "vv", "e", "tt", "br", "egc", "egr", "rk", "rkr", "r", "ac")
CONSTANTS = ("cum", "neg", "strict", "eyeh", "eyec", "zero4", "zero3", "scale")
RANK = 5  # [n chunks, B*Hk, G or 1, rows, columns]
FLAT_RANK = 4  # [n chunks, B*Hv, rows, columns]: no G axis (``flat``, where G = 1)


def flat_layout(facts: ScanFacts, flat: bool) -> bool:
    """Whether the text is written without the G axis: asked for (``flat``) and one value head
    per key head. Asked for by "split", whose chunk loop body holds the prologue: tract
    0.23.9's Scan declutter tries an axis removal for every unit axis of every body node at
    every pass (docs/FACTS.md), and a unit G axis on every tensor made up most of the load
    time of its body."""
    return flat and facts.groups == 1


def layout_rank(facts: ScanFacts, flat: bool) -> int:
    """The rank of the laid-out tensors: FLAT_RANK without the G axis, else RANK."""
    return FLAT_RANK if flat_layout(facts, flat) else RANK


def _last_two(rank: int) -> str:
    """The permutation that swaps the last two of ``rank`` axes."""
    return str(list(range(rank - 2)) + [rank - 1, rank - 2])


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


def leaf_rank(chunk: int, leaf: int, rank: int = RANK) -> int:
    """Rank of the leaf blocks (and of the ``eyeh`` constant): ``rank`` plus one per halving."""
    while chunk > leaf:
        chunk, rank = chunk // 2, rank + 1
    return rank


def inverse_part_lines(chunk: int, leaf: int, rank: int = RANK) -> list[str]:
    """For every chunk at once (tensors of ``rank``): 1/|k| from the diagonal of k k^T, the
    pair decays E and T = (I + A)^-1. Batched over chunks: these many small ops then run
    once."""
    eps = common.literal(common.L2NORM_EPS)
    return ["kkt = matmul(kk, kk, transposeB = true);",
            f"rk = rsqrt(add(sum_reduce(mul(kkt, eyec), axes = [{rank - 1}]), {eps}));",
            f"rkr = transpose(rk, axes = {_last_two(rank)});",
            f"e = {pair_decay('c', 'r', 'neg')};",
            "a = mul(mul(kkt, mul(e, strict)), mul(bc, mul(rk, rkr)));",
            *block_inverse_lines("a", "tt", chunk, rank, leaf)]


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


def _heads_first(name: str, source: str, rank_tail: int, facts: ScanFacts,
                 flat: bool = False) -> str:
    """[B, n, C, H, ...] -> [n, B*Hk, G or 1, C, ...] (the value-side split when G given);
    ``flat`` (G = 1): [n, B*H, C, ...]. Batch 1 is spelled without the batch axis: tract
    makes each permutation a chain of axis moves (one GPU copy each), and moving the unit
    batch axis costs a copy too."""
    hk, g = facts.key_heads, facts.groups
    if facts.batch == 1:
        return _heads_first_one(name, source, rank_tail, facts, flat)
    if flat:
        axes = "[1, 0, 3, 2]" if rank_tail == 3 else "[1, 0, 3, 2, 4]"
        return (f"{name} = reshape(transpose({source}, axes = {axes}), shape = [-1],"
                " axis_start = 1, axis_count = 2);")
    if rank_tail == 1:  # q, k: [B, n, C, Hk, Dk]
        return (f"{name} = unsqueeze(reshape(transpose({source}, axes = [1, 0, 3, 2, 4]),"
                " shape = [-1], axis_start = 1, axis_count = 2), axes = [2]);")
    split = f"reshape({source}, shape = [{hk}, {g}], axis_start = 3, axis_count = 1)"
    axes = "[1, 0, 3, 4, 2, 5]" if rank_tail == 2 else "[1, 0, 3, 4, 2]"
    return (f"{name} = reshape(transpose({split}, axes = {axes}), shape = [-1],"
            " axis_start = 1, axis_count = 2);")


def _heads_first_one(name: str, source: str, rank_tail: int, facts: ScanFacts,
                     flat: bool) -> str:
    """``_heads_first`` at batch 1: the batch axis dropped, C moved behind the heads (one
    axis move), the layout's unit G axis added where it has one."""
    one = f"squeeze({source}, axes = [0])"  # [n, C, H, ...]
    if flat:
        axes = "[0, 2, 1]" if rank_tail == 3 else "[0, 2, 1, 3]"
        return f"{name} = transpose({one}, axes = {axes});"
    if rank_tail == 1:  # q, k: [n, C, Hk, Dk] -> [n, Hk, 1, C, Dk]
        return f"{name} = unsqueeze(transpose({one}, axes = [0, 2, 1, 3]), axes = [2]);"
    split = f"reshape({one}, shape = [{facts.key_heads}, {facts.groups}], axis_start = 2," \
            " axis_count = 1)"  # [n, C, Hk, G(, Dv)]
    axes = "[0, 2, 3, 1, 4]" if rank_tail == 2 else "[0, 2, 3, 1]"
    return f"{name} = transpose({split}, axes = {axes});"


def _padded(name: str, source: str, pad: str, tail: str, zero: str, chunk: int) -> list[str]:
    """``name`` = ``source`` [B, S, ...] zero-padded to whole chunks, as [B, n, C, ...]."""
    if pad == "0":
        padded = source
    else:
        padded = (f"concat([{source}, tract_core_broadcast({zero}, shape = [b, {pad}{tail}])],"
                  " axis = 1)")
    return [f"{name} = reshape({padded}, shape = [-1, {chunk}], axis_start = 1, axis_count = 1);"]


def prepare_lines(facts: ScanFacts, chunk: int, pad: str, suffix: str,
                  flat: bool = False, normalized_qk: bool = False) -> list[str]:
    """Prologue: normalize/scale, pad, chunk and lay out every operand; the gate terms.
    ``flat``: without the G axis where G = 1 (``flat_layout``). ``normalized_qk``: q and k
    are normalized before they are padded (``qq`` is q scale / |q|, ``kk`` is k / |k|, and
    there is no ``rqq``): one operand fewer to pad and lay out, and no norm folded into the
    chunk terms, for a text that reads q and k only normalized."""
    hk, hv, dk, dv = facts.key_heads, facts.value_heads, facts.dk, facts.dv
    rank = layout_rank(facts, flat)
    flat = rank == FLAT_RANK
    lines = common.dims_lines() + [
        f"rqs = mul(rsqrt(add(sum_reduce(mul(q, q), axes = [3]), "
        f"{common.literal(common.L2NORM_EPS)})), scale);"]
    norms = ([] if normalized_qk else [("rqp", "rqs", f", {hk}, 1", "zero4")])
    if normalized_qk:
        eps = common.literal(common.L2NORM_EPS)
        lines += ["qs = mul(q, rqs);",
                  f"kn = mul(k, rsqrt(add(sum_reduce(mul(k, k), axes = [3]), {eps})));"]
    q, k = ("qs", "kn") if normalized_qk else ("q", "k")
    operands = [("qp", q, f", {hk}, {dk}", "zero4"), *norms,
                ("kp", k, f", {hk}, {dk}", "zero4"), ("vp", "v", f", {hv}, {dv}", "zero4"),
                ("gp", "g", f", {hv}", "zero3"), ("bp", "beta", f", {hv}", "zero3")]
    layouts = [("qq", "qp", 1), *([] if normalized_qk else [("rqq", "rqp", 1)]),
               ("kk", "kp", 1), ("vv", "vp", 2), ("gg", "gp", 3), ("bb", "bp", 3)]
    for name, source, tail, zero in operands:
        lines += _padded(name, source, pad, tail, zero, chunk)
    lines += [_heads_first(name, source, tail, facts, flat) for name, source, tail in layouts]
    rows, cols = rank - 2, rank - 1
    state = ("reshape(s0, shape = [-1], axis_start = 0, axis_count = 2)" if flat else
             f"reshape(s0, shape = [-1, {facts.groups}], axis_start = 0, axis_count = 2)")
    return lines + gate_lines(chunk, rank) + [
        f"br = unsqueeze(bb, axes = [{rows}]);",
        f"bc = unsqueeze(bb, axes = [{cols}]);",
        f"st0 = {state};"]


def gate_lines(chunk: int, rank: int) -> list[str]:
    """The gate terms from the laid-out log gates ``gg`` [.., C], each exact across a reset
    (docs/FACTS.md, "Reset gates"). The gate is clamped at GATE_FLOOR (``gq``: e^-1024 is 0,
    no decay changes, no -inf meets a 0 in the cumulative-sum matmuls) and split into its
    ceiling ``gw`` and the rest ``gf`` (gdn_fx.ops.gate_parts); their cumulative sums as rows
    (``wr``, ``fr``) and columns (``wc``, ``fc``) serve the decays between two positions
    (``pair_decay``: part by part, so the small gates after a reset never round against it).
    The rest needs no split: e^gamma_t (``egr``, ``egc``; ``ac`` = e^gamma_C) is 0 wherever a
    reset is at or before t, however it rounds, and e^(gamma_C - gamma_j) (``rr`` as rows,
    ``r`` as columns) is read off the sums of the gates AFTER j (``strict``: one matmul), which
    meet a reset only where the decay is 0."""
    rows, cols = rank - 2, rank - 1
    floor = common.literal(GATE_FLOOR)

    def column(row: str) -> str:  # the unit axis moved by reshapes (a transpose is a copy on
        # the GPU)
        return f"unsqueeze(squeeze({row}, axes = [{rows}]), axes = [{cols}])"

    lines = [f"gq = max(gg, {floor});", "gw = ceil(gq);", "gf = sub(gq, gw);"]
    for part in ("w", "f"):
        lines += [f"{part}r = matmul(unsqueeze(g{part}, axes = [{rows}]), cum);",
                  f"{part}c = {column(f'{part}r')};"]
    return lines + ["egr = exp(add(fr, wr));",
                    f"egc = {column('egr')};",
                    f"ac = slice(egc, axes = [{rows}], begin = [{chunk - 1}], end = [{chunk}]);",
                    f"rr = exp(matmul(unsqueeze(gq, axes = [{rows}]), strict));",
                    f"r = {column('rr')};"]


def pair_decay(late: str, early: str, mask: str = "") -> str:
    """The NNEF expression e^(gamma_late - gamma_early) (+ ``mask``, an additive 0 / -inf
    mask), the difference taken part by part (``gate_lines``): ``late`` and ``early`` name the
    forms of the parts ("c" columns, "r" rows, or block stacks "cb16", "rb16" ...)."""
    diff = f"add(sub(f{late}, f{early}), sub(w{late}, w{early}))"
    return f"exp(add({diff}, {mask}))" if mask else f"exp({diff})"


def finish_lines(facts: ScanFacts, fin: str = "fin", flat: bool = False) -> list[str]:
    """Chunk outputs [n, M, G, C, Dv] back to [B, S, Hv, Dv]; the final state ``fin`` to the
    contract (``flat`` as ``prepare_lines`` was given)."""
    hk, hv = facts.key_heads, facts.value_heads
    if flat_layout(facts, flat):  # [n, B*Hv, C, Dv], state [B*Hv, Dk, Dv]
        final = (f"final = reshape({fin}, shape = [-1, {hv}], axis_start = 0,"
                 " axis_count = 1);")
        if facts.batch == 1:
            return ["o4 = unsqueeze(reshape(transpose(oo, axes = [0, 2, 1, 3]), shape = [-1],"
                    " axis_start = 0, axis_count = 2), axes = [0]);",
                    "out = slice(o4, axes = [1], begin = [0], end = [n]);", final]
        return [f"o5 = transpose(reshape(oo, shape = [-1, {hk}], axis_start = 1,"
                " axis_count = 1), axes = [1, 0, 3, 2, 4]);",
                "o4 = reshape(o5, shape = [-1], axis_start = 1, axis_count = 2);",
                "out = slice(o4, axes = [1], begin = [0], end = [n]);", final]
    final = (f"final = reshape({fin}, shape = [-1, {hv}], axis_start = 0,"
             " axis_count = 2);")
    if facts.batch == 1:  # [n, Hk, G, C, Dv] -> [n, C, Hk, G, Dv]: one axis move
        return ["o4 = unsqueeze(reshape(reshape(transpose(oo, axes = [0, 3, 1, 2, 4]),"
                " shape = [-1], axis_start = 2, axis_count = 2), shape = [-1], axis_start = 0,"
                " axis_count = 2), axes = [0]);",
                "out = slice(o4, axes = [1], begin = [0], end = [n]);", final]
    return [f"o6 = transpose(reshape(oo, shape = [-1, {hk}], axis_start = 1, axis_count = 1),"
            " axes = [1, 0, 4, 2, 3, 5]);",
            "o4 = reshape(reshape(o6, shape = [-1], axis_start = 1, axis_count = 2),"
            " shape = [-1], axis_start = 2, axis_count = 2);",
            "out = slice(o4, axes = [1], begin = [0], end = [n]);", final]


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


def unrolled_loop_lines(chunks: int, suffix: str, rows: int = 0) -> list[str]:
    """The chunk recurrence written out for a static number of chunks.

    ``rows`` (the static extent of axis 1 of the laid-out tensors, B*Hk or B*Hv) merges the
    chunk axis into axis 1 before the chunks are sliced out: chunk c is then rows
    [c*rows, (c+1)*rows) of one axis, with no unit axis on the way. Asked for by
    "split", whose loop body holds these lines: tract 0.23.9's Scan declutter tries to remove
    every unit axis of every body node (docs/FACTS.md), and the 2 x 13 slices of a unit chunk
    axis made 40 % of the body's load time (0.28 -> 0.17 s a layer, 16 x 128)."""
    lines, state, outs = [], "st0", []
    if rows:
        lines += [f"{src}_m = reshape({src}, shape = [-1], axis_start = 0, axis_count = 2);"
                  for src in CHUNK_SOURCES]
    for c in range(chunks):
        if rows:
            args = ", ".join(f"slice({src}_m, axes = [0], begin = [{c * rows}],"
                             f" end = [{(c + 1) * rows}])" for src in CHUNK_SOURCES)
        else:
            args = ", ".join(f"squeeze(slice({src}, axes = [0], begin = [{c}], end = [{c + 1}]),"
                             " axes = [0])" for src in CHUNK_SOURCES)
        lines.append(f"(st{c + 1}, oc{c}) = gdn_fx_chunked_chunk{suffix}({state}, {args});")
        state = f"st{c + 1}"
        outs.append(f"oc{c}" if rows else f"unsqueeze(oc{c}, axes = [0])")
    joined = f"concat([{', '.join(outs)}], axis = 0)"
    if rows:
        joined = f"reshape({joined}, shape = [{chunks}, -1], axis_start = 0, axis_count = 1)"
    return lines + [f"oo = {joined};", f"fin = copy({state});"]


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
