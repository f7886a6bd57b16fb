"""Candidate "split" for gated_linear_scan: ONE graph that serves decode (S = 1) and prefill.

For a sequence of S tokens, with W = ``SCAN_CHUNK * PER_STEP`` the tokens one iteration of
the chunk loop takes (64) and M = floor(S / W) * W:

- tokens [0, M): the chunked form of "chunked" (linear_chunked.py), nothing to pad;
- tokens [M, S): the step loop of "matmul" (linear_matmul.py), from the state the chunks
  end with.

At S = 1 that is zero chunks and one step, about the decode
cost of "matmul" (the chunked form pads one token to 64: 3-4x slower at Falcon-H1-0.5B's
shape); at S = 512 eight iterations of chunks and no step. It is gdn_split.py's plan, and
meets the same trap (tract 0.23.9: a ``tract_core_scan`` that runs ZERO iterations returns a
scalar for its ``last`` state; docs/FACTS.md) with the same two guards: the chunk loop's
state is read from its state after every iteration with the initial state in front (right
at zero iterations), and where no token is left for the steps, one identity step (zero
q, k, v and log gate: the state kept exactly) is appended, its output dropped.

The state-independent chunk terms are computed before the chunk loop, for all chunks at
once: at S < 64 they run on empty tensors (~40 small ops). It accepts what "chunked" accepts
(one log decay per value head; f16/f32/f64 operands) and is the measured choice for a
symbolic S on the CPU in a graph that serves decode (docs/lowering.md: at S = 1 it takes
about half the time of "chunked"; from S = 64 on "chunked" is faster, mostly the
identity step where S is a multiple of 64 and the copies of the chunk loop's states).
A graph that never decodes (a main / decode pair's main graph) takes "chunked"; a static S
"matmul_step", "chunked_unrolled" or "chunked".
"""

from __future__ import annotations

from typing import Optional

from gdn_fx.lowering import gdn_fast_common as common
from gdn_fx.lowering import gdn_split, linear_chunked, linear_matmul
from gdn_fx.lowering.node_facts import LINEAR_OPERANDS, LinearFacts
from gdn_fx.lowering.nnef_emit import EmitContext
from gdn_fx.lowering.target import Target

WHOLE = linear_chunked.SCAN_CHUNK * linear_chunked.PER_STEP  # tokens per chunk iteration
# the steps' pad (n = S - M here, 0..63): one identity step where n = 0 ((n + 63) / 64 is 0
# then, 1 otherwise), so that the step loop never runs zero iterations
STEPS_PAD = f"1 - (n + {WHOLE - 1}) / {WHOLE}"
OPERANDS = ("q", "k", "v", "g")


def check(facts: LinearFacts, target: Target) -> Optional[str]:
    """Why chunks-then-steps can not serve this node (None: it can): chunked's reasons."""
    return linear_chunked.check(facts, target)


def suits(facts: LinearFacts, target: Target) -> Optional[str]:
    """Why "split" is not the measured choice for this node (None: it is): the delta op's
    reasons (a symbolic S on the CPU runtime), and a graph that also serves decode."""
    reason = gdn_split.suits(facts, target)
    if reason is None and not target.serves_decode:
        return ("the graph never runs decode's one-token calls: 'chunked' is faster from "
                "S = 64 on (bench/bench_linear_scan.py)")
    return reason


def split_lines(facts: LinearFacts, suffix: str) -> list[str]:
    """The top fragment: cut at M, the chunks over [0, M), the steps over [M, S) from the
    state the chunks end with, the state moved into the loops' layout and back."""
    consts = ", ".join(linear_chunked.CONSTANTS)
    lines = common.dims_lines() + [f"m = n / {WHOLE} * {WHOLE};"]
    for name in OPERANDS:
        lines += [f"{name}1 = slice({name}, axes = [1], begin = [0], end = [m]);",
                  f"{name}2 = slice({name}, axes = [1], begin = [m], end = [n]);"]
    return lines + [
        linear_matmul.state_in_line(facts, "st", "s0"),
        linear_chunked.flat_line("st0", "st"),
        f"(o1, fin1) = gdn_fx_linear_chunks{suffix}(q1, k1, v1, g1, st0, {consts});",
        linear_chunked.unflat_line(facts, "s1", "fin1"),
        f"(o2, fin2) = gdn_fx_linear_steps{suffix}(q2, k2, v2, g2, s1, scale, zero4, zero3);",
        "out = concat([o1, o2], axis = 1);",
        linear_matmul.state_out_line("final", "fin2")]


def definitions(facts: LinearFacts, suffix: str) -> str:
    """Every fragment of one node configuration: the chunks (with their per-iteration
    states), the steps, and the top fragment joining them."""
    chunks = linear_chunked.chunks_definitions(facts, linear_chunked.SCAN_CHUNK, 0, suffix,
                                               pad="0", states=True)
    steps = linear_matmul.steps_definitions(facts, suffix, STEPS_PAD)
    top = common.fragment_text(f"gdn_fx_linear_split{suffix}",
                               ["q", "k", "v", "g", "s0", *linear_chunked.CONSTANTS],
                               ["out", "final"], split_lines(facts, suffix))
    return "\n".join([chunks, steps, top])


def emit(ctx: EmitContext) -> list:
    """Write chunks then steps for one node; returns the fragments it needs."""
    facts = ctx.facts
    work = common.work_dtype(facts)
    operands = common.prepared_operands(ctx, work, LINEAR_OPERANDS)
    consts = linear_chunked.constant_tensors(ctx, linear_chunked.SCAN_CHUNK, work)
    name, frag = common.fragment("gdn_fx_linear_split", lambda suffix: definitions(facts, suffix))
    out = ctx.tensor("out", facts.shapes["v"], work)
    final = ctx.tensor("final_state", facts.shapes["initial_state"], work)
    ctx.apply_multi(name, operands + consts, (out, final))
    common.finish_outputs(ctx, out, final)
    return [frag]
