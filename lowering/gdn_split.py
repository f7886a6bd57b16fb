"""Candidate "split" for gated_delta_scan: ONE graph that serves decode (S = 1) and prefill.

For a sequence of S tokens, with W = ``SCAN_CHUNK * SCAN_CHUNKS_PER_STEP`` the tokens one
iteration of the chunk loop takes (64) and M = floor(S / W) * W:

- tokens [0, M): the chunked (WY) form, the loop over chunks of "chunked"
  (gdn_chunked_text.py), with nothing to pad;
- tokens [M, S): a ``tract_core_scan`` of matmul steps, the loop of "matmul" (gdn_matmul.py),
  started from the state the chunks end with.

At S = 1 that is zero chunks and one step (the decode cost of "matmul"); at S = 512 eight
iterations of chunks and no step (the prefill cost of "chunked", without its padding). So a
generation-ready artifact needs no second graph at S = 1 (issue 31).

The chunk loop scans the RAW operands, W tokens an iteration: its body does the whole of
chunked's work for them (layout, l2norm scalings, k k^T, pair decays, the inverse T, the two
chunks, the layout back), so a loop of zero iterations runs none of it. (Batched over all
chunks before the loop, as "chunked" does, those ~300 small ops ran on empty tensors at S = 1,
~0.3 ms; with the two guards below written as ``select``, 1.97 ms against matmul's 0.51 on a
16 x 128 layer, issue 31.)

Trap (tract 0.23.9): a ``tract_core_scan`` that runs ZERO iterations returns a scalar, not its
initial state, for its state (``last``) output. Either part may run zero iterations (S < W;
S a multiple of W). Guards, chosen because ``select`` on a state costs ~0.4 ms (tract's Iff):

- chunks: the loop gives the state after EVERY iteration (a ``full`` output, right at zero
  iterations: [0, ...]); the initial state is put in front of them and the one after the
  last iteration sliced out (row c = M / W of the B-row blocks): two copies of the state;
- steps: where S is a multiple of W, one identity step (zero k, q, v, beta and log decay:
  the state is kept exactly) is appended, so the loop never runs zero iterations, and its
  output row is sliced off. The pad's length is written ``n/W + 1 - (n + W-1)/W`` (1 or 0):
  written ``(W - r) / W`` it made tract's step loop twice as slow (measured, cause not
  examined).

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
    """The top fragment: cut at M, the chunk loop over [0, M) (its state after each
    iteration, s0 in front, the last sliced out), the steps over [M, S) with one identity
    step appended where S - M = 0 (its output row dropped); see the module docstring."""
    hk, hv, dk, dv = facts.key_heads, facts.value_heads, facts.dk, facts.dv
    lines = common.dims_lines() + [f"m = n / {WHOLE} * {WHOLE};", "r = n - m;",
                                   f"c = m / {WHOLE} * b;", "c1 = c + b;",
                                   f"p = n / {WHOLE} + 1 - (n + {WHOLE - 1}) / {WHOLE};"]
    for name in OPERANDS:
        lines += [f"{name}1 = slice({name}, axes = [1], begin = [0], end = [m]);",
                  f"{name}2 = slice({name}, axes = [1], begin = [m], end = [n]);"]
    scans = ", ".join(f'("{name}", {name}1, 1, {WHOLE})' for name in OPERANDS)
    full = ", ".join(f'("{name}", {name})' for name in text.CONSTANTS)
    lines += [f'(sts, o1) = tract_core_scan(body = "gdn_fx_split_chunks{suffix}",',
              f"    scan = [{scans}],",
              f"    full = [{full}], state = [(\"s0\", s0, \"final\")],",
              f'    output = [("states", "full", 0, 1), ("out", "full", 1, {WHOLE})],',
              "    skip = 0, reset_every_turn = 1);",
              "sall = concat([s0, reshape(sts, shape = [-1], axis_start = 0, axis_count = 2)],"
              " axis = 0);",
              "s1 = slice(sall, axes = [0], begin = [c], end = [c1]);"]
    for name, zero, tail in (("q", "zero4", f", {hk}, {dk}"), ("k", "zero4", f", {hk}, {dk}"),
                             ("v", "zero4", f", {hv}, {dv}"), ("g", "zero3", f", {hv}"),
                             ("beta", "zero3", f", {hv}")):
        lines.append(f"{name}3 = concat([{name}2, tract_core_broadcast({zero},"
                     f" shape = [b, p{tail}])], axis = 1);")
    lines += ["(o3, final) = gdn_fx_matmul" + suffix +
              "(q3, k3, v3, g3, beta3, s1, mk0, mk1, scale);",
              "o2 = slice(o3, axes = [1], begin = [0], end = [r]);",
              "out = concat([o1, o2], axis = 1);"]
    return lines


PARAMS = ["q", "k", "v", "g", "beta", "s0", *text.CONSTANTS, "mk0", "mk1"]


def definitions(facts: ScanFacts, suffix: str) -> str:
    """Every fragment of one node configuration: one chunk, the chunk loop's body, matmul's
    loop of steps, and the top fragment joining them."""
    chunk = common.fragment_text(f"gdn_fx_chunked_chunk{suffix}",
                                 ["state", *text.CHUNK_INPUTS], ["new_state", "o"],
                                 text.chunk_lines())
    body = common.fragment_text(f"gdn_fx_split_chunks{suffix}", BODY_PARAMS,
                                ["final", "out", "states"], body_lines(facts, suffix))
    steps = gdn_matmul.fragment_definitions(facts, single=False, suffix=suffix)
    top = common.fragment_text(f"gdn_fx_split{suffix}", PARAMS, ["out", "final"],
                               split_lines(facts, suffix))
    return "\n".join([chunk, body, steps, top])


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
