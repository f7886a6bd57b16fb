"""Candidate "split" for gated_delta_scan: ONE graph that serves decode (S = 1) and prefill.

For a sequence of S tokens, with W = ``SCAN_CHUNK * SCAN_CHUNKS_PER_STEP`` the tokens one
iteration of the chunk loop takes (64), the operands are padded by W identity tokens (zero
q, k, v, beta and log decay: the state kept exactly) and cut at L = floor((S + W - 2) / W) * W:

- tokens [0, L): the chunked (WY) form, the loop over chunks of "chunked"
  (gdn_chunked_text.py), whole iterations: every token but a lone last one (S mod W = 1),
  the identity tokens up to L with them;
- token L: ONE matmul step (gdn_matmul.py's "matmul_step") from the state the chunks end
  with: the last token where S mod W = 1 (a decode step: zero chunk iterations), an identity
  token otherwise;
- the outputs joined and cut at S.

So a generation-ready artifact needs no second graph at S = 1 (issue 31), and a prompt's tail
is never a loop of up to 63 steps: on a Qwen3.5-sized layer core (16 heads of 128, f32, one
thread, 2026-12-08) S = 63 took 7.7 ms against 54 with the tail in steps, S = 100 14.3
against 36.4, S = 1 1.15 against 1.22, S = 65 and 512 within 3 %; 2 to 7 tokens pay one chunk
iteration (S = 2: 6.9 ms against 1.8). Every size is a plain expression of S: a minimum or a
product of two sizes made tract 0.23.9 load a layer 4-8x slower (the linear op's split, same
plan).

The chunk loop scans the padded operands, W tokens an iteration: its body does the whole of
chunked's work for them (layout, l2norm scalings, k k^T, pair decays, the inverse T, the two
chunks, the layout back), so a loop of zero iterations runs none of it.

Trap (tract 0.23.9): a ``tract_core_scan`` that runs ZERO iterations returns a scalar, not its
initial state, for its state (``last``) output (at S = 1 here). Guard: the loop gives the
state after EVERY iteration (a ``full`` output, right at zero iterations: [0, ...]); the
initial state is put in front of them and the one after the last iteration sliced out (row
c = L / W of the B-row blocks): two copies of the state.

It accepts what "chunked" accepts (GDN gate, q/k l2norm in the node, f16/f32 operands) and
refuses the rest with chunked's reason (KDA gates, qk_l2norm=False: "matmul" serves them),
and f64 arithmetic (refused when the guards were ``select``s, which refused f64 against the f32
scalar; not re-examined: "chunked" serves f64, no f64 model is deployed). It is the
measured choice for a symbolic S on the CPU; a static S takes "matmul_step" (S = 1),
"chunked_unrolled" or "chunked" (``suits``), and under the CUDA runtime (not measured there)
the CPU fallback stays "chunked".
"""

from __future__ import annotations

from typing import Optional

from gdn_fx.lowering import gdn_chunked, gdn_matmul
from gdn_fx.lowering import gdn_chunked_text as text
from gdn_fx.lowering import gdn_fast_common as common
from gdn_fx.lowering.node_facts import ScanFacts
from gdn_fx.lowering.nnef_emit import EmitContext
from gdn_fx.lowering.target import Target

WHOLE = gdn_chunked.SCAN_CHUNK * gdn_chunked.SCAN_CHUNKS_PER_STEP  # tokens per chunk iteration
OPERANDS = ("q", "k", "v", "g", "beta")


def check(facts: ScanFacts, target: Target) -> Optional[str]:
    """Why chunks-then-steps can not serve this node (None: it can): chunked's reasons, and
    f64 arithmetic (the scalar a scan of zero iterations returns is f32, which ``select``
    refuses to meet an f64 state)."""
    reason = gdn_chunked.shared_reason(facts)
    if reason is None and common.work_dtype(facts) == "f64":
        return ("f64 operands: tract 0.23.9's scan of zero iterations returns an f32 scalar "
                "for its state, which can not be selected against an f64 one; 'chunked' "
                "serves f64")
    return reason


def suits(facts: ScanFacts, target: Target) -> Optional[str]:
    """Why "split" is not the measured choice for this node (None: it is): a symbolic S on
    the CPU runtime."""
    if target.runtime != "cpu":
        return (f"not measured under tract's {target.runtime} runtime; 'chunked' is the "
                "loop kept there")
    if not target.dynamic and facts.seq is not None:
        return (f"static S={facts.seq}: 'matmul_step', 'chunked_unrolled' or 'chunked' is "
                "written for it")
    return None


BODY_PARAMS = ["s0", *OPERANDS, *text.CONSTANTS]


def body_lines(facts: ScanFacts, suffix: str) -> list[str]:
    """One iteration of the chunk loop: W = 64 raw tokens [B, W, ...] and the state entering
    them (contract layout) -> their output [B, W, Hv, Dv], the state leaving them, and that
    state again with a leading axis (the loop's per-iteration ``full`` output). Written
    without the G axis where G = 1 (tract's load time: gdn_chunked_text.flat_layout)."""
    chunk, rank = gdn_chunked.SCAN_CHUNK, text.layout_rank(facts, True)
    # the chunks' rows of one merged axis (unrolled_loop_lines) at batch 1, which the text
    # takes as static (gdn_chunked_text._heads_first); a batch that may be symbolic keeps the
    # unit chunk axis (tract 0.23.9 could not type slices of a B * H axis)
    heads = facts.value_heads if text.flat_layout(facts, True) else facts.key_heads
    rows = heads if facts.batch == 1 else 0
    return (text.prepare_lines(facts, chunk, "0", suffix, flat=True)
            + text.inverse_part_lines(chunk, gdn_chunked.LEAF, rank)
            + text.unrolled_loop_lines(gdn_chunked.SCAN_CHUNKS_PER_STEP, suffix, rows)
            + text.finish_lines(facts, "fin", flat=True)
            + ["states = unsqueeze(final, axes = [0]);"])


def split_lines(facts: ScanFacts, suffix: str) -> list[str]:
    """The top fragment: the operands padded by one iteration of identity tokens; the chunk
    loop over [0, L) of them (its state after each iteration, s0 in front, the last sliced
    out), ONE step on token L from that state; the outputs joined and cut at S (the module
    docstring)."""
    lines = common.dims_lines() + [f"whole = (n + {WHOLE - 2}) / {WHOLE} * {WHOLE};",
                                   f"c = whole / {WHOLE} * b;", "c1 = c + b;"]
    for name in OPERANDS:
        lines += [common.padded_line(f"{name}p", name, str(WHOLE), *common.pad_tail(facts, name)),
                  f"{name}1 = slice({name}p, axes = [1], begin = [0], end = [whole]);",
                  f"{name}2 = slice({name}p, axes = [1], begin = [whole], end = [whole + 1]);"]
    scans = ", ".join(f'("{name}", {name}1, 1, {WHOLE})' for name in OPERANDS)
    full = ", ".join(f'("{name}", {name})' for name in text.CONSTANTS)
    return lines + [
        f'(sts, o1) = tract_core_scan(body = "gdn_fx_split_chunks{suffix}",',
        f"    scan = [{scans}],",
        f"    full = [{full}], state = [(\"s0\", s0, \"final\")],",
        f'    output = [("states", "full", 0, 1), ("out", "full", 1, {WHOLE})],',
        "    skip = 0, reset_every_turn = 1);",
        "sall = concat([s0, reshape(sts, shape = [-1], axis_start = 0, axis_count = 2)],"
        " axis = 0);",
        "s1 = slice(sall, axes = [0], begin = [c], end = [c1]);",
        f"(o2, final) = gdn_fx_matmul{suffix}(q2, k2, v2, g2, beta2, s1, mk0, mk1, scale);",
        "out = slice(concat([o1, o2], axis = 1), axes = [1], begin = [0], end = [n]);"]


PARAMS = ["q", "k", "v", "g", "beta", "s0", *text.CONSTANTS, "mk0", "mk1"]


def definitions(facts: ScanFacts, suffix: str) -> str:
    """Every fragment of one node configuration: one chunk, the chunk loop's body, matmul's
    one step, and the top fragment joining them."""
    chunk = common.fragment_text(f"gdn_fx_chunked_chunk{suffix}",
                                 ["state", *text.CHUNK_INPUTS], ["new_state", "o"],
                                 text.chunk_lines())
    body = common.fragment_text(f"gdn_fx_split_chunks{suffix}", BODY_PARAMS,
                                ["final", "out", "states"], body_lines(facts, suffix))
    step = gdn_matmul.fragment_definitions(facts, single=True, suffix=suffix)
    top = common.fragment_text(f"gdn_fx_split{suffix}", PARAMS, ["out", "final"],
                               split_lines(facts, suffix))
    return "\n".join([chunk, body, step, top])


def emit(ctx: EmitContext) -> list:
    """Write chunks then steps for one node; returns the fragments it needs."""
    facts = ctx.facts
    work = common.work_dtype(facts)
    operands = common.prepared_operands(ctx, work)
    values = gdn_chunked.constants(gdn_chunked.SCAN_CHUNK, gdn_chunked.LEAF,
                                   text.layout_rank(facts, True))
    consts = [common.scale_variable(ctx, work) if name == "scale" else
              common.variable(ctx, name, values[name], work) for name in text.CONSTANTS]
    name, frag = common.fragment("gdn_fx_split", lambda suffix: definitions(facts, suffix))
    out = ctx.tensor("out", facts.shapes["v"], work)
    final = ctx.tensor("final_state", facts.shapes["initial_state"], work)
    ctx.apply_multi(name, operands + consts + gdn_matmul.masks(ctx, work),
                    (out, final))
    common.finish_outputs(ctx, out, final)
    return [frag]
