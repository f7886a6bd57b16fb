"""Candidates "chunked" and "chunked_unrolled" for gated_linear_scan: the chunked form for
gates of one decay per value head (Mamba2's SSD, lightning, retention, simple GLA).

Per chunk of C steps, with gamma the cumulative log decay inside the chunk and E[i, j] =
exp(gamma_i - gamma_j) for i >= j (0 above the diagonal), from the state S entering it:

    o = e^gamma_row * (q S) + (q k^T * E) v           (q already times the scale)
    S' = e^gamma_C S + k^T (e^(gamma_C - gamma) * v)

It is gated_delta_scan's chunk (gdn_chunked_text.py) without the WY inverse: no erase, so
every term but q S and the state pass is independent of the state. Those terms (q k^T, E, the
intra-chunk product, each chunk's own contribution D = k^T (e^(gamma_C - gamma) v)) are
computed for all chunks at once; the loop over chunks is then two ops: y = q S, S' = e^gamma_C
S + D. The gate terms are gdn_chunked_text's (``gate_lines``, ``pair_decay``): the log gate
clamped at -1024 and split into its integer ceiling and the rest, every decay between two
positions taken part by part, so a reset gate (-inf, -1e4) neither rounds the small gates after
it away nor makes a NaN (docs/FACTS.md, "Reset gates").

Layout: M = B * Hk. The state runs as [M, G Dv, Dk] (the G value heads of a key head one
under the other, value-first; the same memory as linear_matmul's step layout
[B, Hk, G, Dv, Dk], so "split" hands it from one loop to the other by reshapes): q S^T and
(r v)^T k are then one [C, Dk] x [Dk, G Dv] and one [G Dv, C] x [C, Dk] matmul per key head
and chunk, not G small ones (Mamba2: Hk = 1, G = 24). The intra-chunk product needs one
[C, C] matrix per value head ([n, M, G, C, C]); q k^T is one per key head, met by
broadcasting.

- "chunked": the loop is a ``tract_core_scan`` over chunks of ``SCAN_CHUNK``, ``PER_STEP``
  an iteration (``reset_every_turn = 1``); the sequence is zero-padded to whole iterations
  at run time (zero k, v, q and log gate: the padded steps keep the state), so any S is
  served, symbolic too.
- "chunked_unrolled": the chunks written out, for a static S; chunks of ``CHUNK``, shrunk to
  the next power of two >= S for short S, at most ``MAX_UNROLLED_CHUNKS`` chunks.

Per-key-channel gates are refused (the decays become a [C, C, Dk] tensor per chunk, or an
exp product that overflows): "matmul" serves them. f16/f32/f64 operands, arithmetic in f32
(f64 when q or the state is f64).
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from gdn_fx.lowering import gdn_chunked, linear_matmul
from gdn_fx.lowering import gdn_chunked_text as text
from gdn_fx.lowering import gdn_fast_common as common
from gdn_fx.lowering.node_facts import LINEAR_OPERANDS, LinearFacts, portable_dtype_reason
from gdn_fx.lowering.nnef_emit import EmitContext
from gdn_fx.lowering.target import Target

CHUNK = gdn_chunked.CHUNK  # 64 tokens a chunk ("chunked_unrolled" shrinks it for short S)
SCAN_CHUNK = 32  # tokens of one chunk of the loop ("chunked")
PER_STEP = 2  # chunks one iteration of the loop takes (scan_step_lines says why not 1)
MAX_UNROLLED_CHUNKS = 16  # tract's load time grows with the chunks written out
RANK = 5  # [n chunks, M, G, rows, columns]: the rank of the gate terms and masks
CONSTANTS = ("cum", "neg", "strict", "zero4", "zero3", "ones", "scale")
LOOP_INPUTS = ("qq", "acs", "dd")  # per chunk: q, e^gamma_C, the chunk's own contribution


def check(facts: LinearFacts, target: Target) -> Optional[str]:
    """Why the scan over chunks can not serve this node (None: it can)."""
    if facts.per_key:
        return ("gate per key channel: the chunked form needs a [C, C, Dk] decay per chunk; "
                "'matmul' serves it")
    return portable_dtype_reason(facts)


def check_unrolled(facts: LinearFacts, target: Target) -> Optional[str]:
    """Why the unrolled chunks can not serve this node (None: they can)."""
    if target.dynamic or facts.seq is None:
        return "unrolled chunks need a static S; the export has symbolic axes"
    chunks = -(-facts.seq // gdn_chunked.chunk_size(facts.seq))
    if chunks > MAX_UNROLLED_CHUNKS:
        return (f"S={facts.seq} is {chunks} chunks of {CHUNK}, more than the "
                f"{MAX_UNROLLED_CHUNKS} written out at most; 'chunked' loops over them")
    return check(facts, target)


def _heads_first(name: str, source: str, axes: str) -> str:
    """[B, n, ...] transposed by ``axes`` to [n, B, Hk, ...], B and Hk merged into M."""
    return (f"{name} = reshape(transpose({source}, axes = {axes}), shape = [-1],"
            " axis_start = 1, axis_count = 2);")


def prepare_lines(facts: LinearFacts, chunk: int, pad: str) -> list[str]:
    """Pad, chunk and lay out every operand: qq, kk [n, M, C, Dk]; v as vm [n, M, C, G, Dv]
    and vh [n, M, G, C, Dv]; the log gates gg [n, M, G, C]."""
    split = f"shape = [{facts.key_heads}, {facts.groups}], axis_start = 3, axis_count = 1"
    return common.dims_lines() + [
        "qs = mul(q, scale);",
        common.padded_line("qp", "qs", pad, *common.pad_tail(facts, "q"), chunk),
        common.padded_line("kp", "k", pad, *common.pad_tail(facts, "k"), chunk),
        common.padded_line("vp", "v", pad, *common.pad_tail(facts, "v"), chunk),
        common.padded_line("gp", "g", pad, *common.pad_tail(facts, "g"), chunk),
        _heads_first("qq", "qp", "[1, 0, 3, 2, 4]"),
        _heads_first("kk", "kp", "[1, 0, 3, 2, 4]"),
        f"vs = reshape(vp, {split});",  # [B, n, C, Hk, G, Dv]
        _heads_first("vm", "vs", "[1, 0, 3, 2, 4, 5]"),
        _heads_first("vh", "vs", "[1, 0, 3, 4, 2, 5]"),
        _heads_first("gg", f"reshape(gp, {split})", "[1, 0, 3, 4, 2]")]


def chunk_terms_lines(chunk: int) -> list[str]:
    """Every state-independent term, for all chunks at once: the gate terms, the intra-chunk
    output ``intra`` [n, M, C, G, Dv], the row decays ``ec`` [n, M, C, G, 1], the chunk decay
    ``acs`` [n, M, G Dv, 1] (``ones``: one per value row) and each chunk's own
    contribution ``dd`` [n, M, G Dv, Dk]."""
    swap = "axes = [0, 1, 3, 2, 4]"  # [.., G, C, x] <-> [.., C, G, x]
    return text.gate_lines(chunk, RANK) + [
        f"e = {text.pair_decay('c', 'r', 'neg')};",
        "qkt = unsqueeze(matmul(qq, kk, transposeB = true), axes = [2]);",
        f"intra = transpose(matmul(mul(qkt, e), vh), {swap});",
        f"ec = transpose(egc, {swap});",
        "acs = reshape(mul(ac, ones), shape = [-1], axis_start = 2, axis_count = 2);",
        f"rv = reshape(mul(vm, transpose(r, {swap})), shape = [-1], axis_start = 3,"
        " axis_count = 2);",
        "dd = matmul(rv, kk, transposeA = true);"]


def pass_lines() -> list[str]:
    """One chunk of the state pass: q S^T from the state entering it (y [M, C, G Dv]) and the
    state leaving it (the decay and the chunk's own contribution added)."""
    return ["y = matmul(q, state, transposeB = true);",
            "new_state = add(mul(state, ac), d);"]


def _chunk_args(c: int, source: str = "{name}") -> str:
    """The pass's per-chunk arguments: chunk ``c`` of each loop input."""
    return ", ".join(f"squeeze(slice({source.format(name=name)}, axes = [0], begin = [{c}],"
                     f" end = [{c + 1}]), axes = [0])" for name in LOOP_INPUTS)


def pass_chain_lines(chunks: int, suffix: str, source: str, state: str,
                     last: str) -> list[str]:
    """``chunks`` passes one after the other from ``state`` (the last state named ``last``),
    their outputs stacked on a leading axis as ``ys``."""
    lines, outs = [], []
    for c in range(chunks):
        after = last if c == chunks - 1 else f"st{c + 1}"
        lines.append(f"({after}, y{c}) = gdn_fx_linear_pass{suffix}({state},"
                     f" {_chunk_args(c, source)});")
        outs.append(f"unsqueeze(y{c}, axes = [0])")
        state = after
    return lines + [f"ys = concat([{', '.join(outs)}], axis = 0);"]


def unrolled_loop_lines(chunks: int, suffix: str) -> list[str]:
    """The state pass written out for a static number of chunks: ``yy`` and ``fin``."""
    return pass_chain_lines(chunks, suffix, "{name}", "st0", "fin") + ["yy = copy(ys);"]


def scan_loop_lines(per_step: int, suffix: str, states: bool = False) -> list[str]:
    """The state pass as a tract_core_scan over the chunk axis (axis 0), ``per_step`` chunks
    an iteration: ``yy`` and ``fin``. ``states``: ``fin`` is read from the state after every
    iteration with ``st0`` in front, right at zero iterations too (tract 0.23.9 returns a
    scalar for the ``last`` state of a scan that ran zero times: docs/FACTS.md)."""
    scans = ", ".join(f'("{name}_c", {name}, 0, {per_step})' for name in LOOP_INPUTS)
    last = '("sts", "full", 0, 1)' if states else '("new_state", "last", 0, 1)'
    lines = [f'({"sts" if states else "fin"}, yy) = tract_core_scan('
             f'body = "gdn_fx_linear_chunk_step{suffix}",',
             f"    scan = [{scans}],",
             '    full = [], state = [("state", st0, "new_state")],',
             f'    output = [{last}, ("ys", "full", 0, {per_step})],',
             "    skip = 0, reset_every_turn = 1);"]
    if states:
        lines += [f"c = n / {SCAN_CHUNK * per_step};", "c1 = c + 1;",
                  "fin = squeeze(slice(concat([unsqueeze(st0, axes = [0]), sts], axis = 0),"
                  " axes = [0], begin = [c], end = [c1]), axes = [0]);"]
    return lines


def scan_step_lines(per_step: int, suffix: str, states: bool = False) -> list[str]:
    """The loop body: ``per_step`` passes one after the other. Their outputs leave through a
    concat: with one pass an iteration (its output a product of the state entering it),
    tract 0.23.9 did not finish loading (its Scan declutter pulls q S out of the body;
    stopped after 5 minutes, a 2-chunk sequence of 8-wide heads). ``states``: the state
    after the iteration leaves too, with a leading axis."""
    lines = pass_chain_lines(per_step, suffix, "{name}_c", "state", "new_state")
    return lines + (["sts = unsqueeze(new_state, axes = [0]);"] if states else [])


def finish_lines(facts: LinearFacts) -> list[str]:
    """The chunk outputs (q S times the row decays, plus the intra-chunk term) back to
    [B, S, Hv, Dv]."""
    hk, g, dv = facts.key_heads, facts.groups, facts.dv
    return [f"o = add(mul(reshape(yy, shape = [{g}, {dv}], axis_start = 3, axis_count = 1),"
            " ec), intra);",  # [n, M, C, G, Dv]
            f"o6 = transpose(reshape(o, shape = [-1, {hk}], axis_start = 1, axis_count = 1),"
            " axes = [1, 0, 3, 2, 4, 5]);",  # [B, n, C, Hk, G, Dv]
            "o4 = reshape(reshape(o6, shape = [-1], axis_start = 3, axis_count = 2),"
            " shape = [-1], axis_start = 1, axis_count = 2);",
            "out = slice(o4, axes = [1], begin = [0], end = [n]);"]


def flat_line(name: str, source: str) -> str:
    """NNEF: a state in the step loop's layout [B, Hk, G, Dv, Dk] (linear_matmul) as the
    chunk pass's [M, G Dv, Dk]: the same memory, merged axes."""
    return (f"{name} = reshape(reshape({source}, shape = [-1], axis_start = 0, axis_count = 2),"
            " shape = [-1], axis_start = 1, axis_count = 2);")


def unflat_line(facts: LinearFacts, name: str, source: str) -> str:
    """NNEF: the chunk pass's state [M, G Dv, Dk] back in the step loop's layout."""
    return (f"{name} = reshape(reshape({source}, shape = [{facts.groups}, {facts.dv}],"
            f" axis_start = 1, axis_count = 1), shape = [-1, {facts.key_heads}],"
            " axis_start = 0, axis_count = 1);")


def chunks_definitions(facts: LinearFacts, chunk: int, unrolled_chunks: int, suffix: str,
                       pad: str = "", states: bool = False) -> str:
    """The pass, the loop body and ``gdn_fx_linear_chunks`` (raw q, k, v, g and the state
    ``st0`` [M, Dk, G Dv] -> out [B, S, Hv, Dv] and ``fin``): ``unrolled_chunks`` 0 means
    the scan over chunks (PER_STEP an iteration) with a run-time pad (or ``pad``), else
    that many chunks written out (static S)."""
    parts = [common.fragment_text(f"gdn_fx_linear_pass{suffix}", ["state", "q", "ac", "d"],
                                  ["new_state", "y"], pass_lines())]
    if unrolled_chunks:
        pad = str(unrolled_chunks * chunk - facts.seq)
        loop = unrolled_loop_lines(unrolled_chunks, suffix)
    else:
        whole = chunk * PER_STEP
        pad = pad or f"(n + {whole - 1}) / {whole} * {whole} - n"
        loop = scan_loop_lines(PER_STEP, suffix, states)
        parts.append(common.fragment_text(
            f"gdn_fx_linear_chunk_step{suffix}", ["state", *(f"{n}_c" for n in LOOP_INPUTS)],
            ["new_state", "ys", *(["sts"] if states else [])],
            scan_step_lines(PER_STEP, suffix, states)))
    main = (prepare_lines(facts, chunk, pad) + chunk_terms_lines(chunk) + loop
            + finish_lines(facts))
    parts.append(common.fragment_text(f"gdn_fx_linear_chunks{suffix}",
                                      ["q", "k", "v", "g", "st0", *CONSTANTS],
                                      ["out", "fin"], main))
    return "\n".join(parts)


def definitions(facts: LinearFacts, chunk: int, unrolled_chunks: int, suffix: str) -> str:
    """Every fragment of one node configuration (``chunks_definitions``), and the node's
    own: the state moved into the pass's layout and back."""
    consts = ", ".join(CONSTANTS)
    main = [linear_matmul.state_in_line(facts, "st", "s0"), flat_line("st0", "st"),
            f"(out, fin) = gdn_fx_linear_chunks{suffix}(q, k, v, g, st0, {consts});",
            unflat_line(facts, "fin5", "fin"), linear_matmul.state_out_line("final", "fin5")]
    top = common.fragment_text(f"gdn_fx_linear_chunked{suffix}",
                               ["q", "k", "v", "g", "s0", *CONSTANTS], ["out", "final"], main)
    return "\n".join([chunks_definitions(facts, chunk, unrolled_chunks, suffix), top])


def constant_tensors(ctx: EmitContext, chunk: int, work: str) -> list:
    """The constants the chunk text reads (``CONSTANTS``), as NNEF variables."""
    values = {**gdn_chunked.constants(chunk, gdn_chunked.LEAF, RANK),
              "ones": np.ones((1, 1, 1, ctx.facts.dv, 1))}  # e^gamma_C for every value row
    return [common.scale_variable(ctx, work) if name == "scale" else
            common.variable(ctx, name, values[name], work) for name in CONSTANTS]


def emit(ctx: EmitContext) -> list:
    """Write the scan over chunks for one node; returns the fragments it needs."""
    return _emit(ctx, SCAN_CHUNK, unrolled_chunks=0)


def emit_unrolled(ctx: EmitContext) -> list:
    """Write the unrolled chunks for one node (static S); returns the fragments it needs."""
    chunk = gdn_chunked.chunk_size(ctx.facts.seq)
    return _emit(ctx, chunk, unrolled_chunks=-(-ctx.facts.seq // chunk))


def _emit(ctx: EmitContext, chunk: int, unrolled_chunks: int) -> list:
    facts = ctx.facts
    work = common.work_dtype(facts)
    operands = common.prepared_operands(ctx, work, LINEAR_OPERANDS)
    name, frag = common.fragment(
        "gdn_fx_linear_chunked",
        lambda suffix: definitions(facts, chunk, unrolled_chunks, suffix))
    out = ctx.tensor("out", facts.shapes["v"], work)
    final = ctx.tensor("final_state", facts.shapes["initial_state"], work)
    ctx.apply_multi(name, operands + constant_tensors(ctx, chunk, work), (out, final))
    common.finish_outputs(ctx, out, final)
    return [frag]
