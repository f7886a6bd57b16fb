"""Candidate "split" for gated_linear_scan: ONE graph that serves decode (S = 1) and prefill.

For a sequence of S tokens, with W = ``SCAN_CHUNK * PER_STEP`` the tokens one iteration of
the chunk loop takes (64), the operands are padded by W identity tokens (zero q, k, v and log
gate: the state kept exactly) and cut at L = floor((S + W - 2) / W) * W:

- tokens [0, L): the chunked form of "chunked" (linear_chunked.py), whole iterations: every
  token but a lone last one (S mod W = 1), the identity tokens up to L with them;
- token L: ONE step of "matmul_step" (linear_matmul.py) from the state the chunks end with,
  the last token where S mod W = 1 (a decode step: zero chunk iterations and one step), an
  identity token otherwise;
- the outputs joined and cut at S.

Every size is a plain expression of S (no minimum, no product of two sizes: with either,
tract 0.23.9 took 4-8x longer to load the layer, and computed (71 - r) / 64 as 2 at S = 1, a
floor division of a sum split term by term), and the step is no loop. The price: 2 to 6 new
tokens take a chunk iteration where steps were cheaper (S = 2: 3.7 ms against 1.4 at
Falcon-H1-0.5B's layer core); the gain: a prompt's tail is never up to 63 steps (S = 63: 4.0
ms against 31, S = 100: 7.9 against 21.7; S = 1: 0.84 against 0.94, S = 512: 1.01x;
docs/lowering.md). Trap (tract 0.23.9: a ``tract_core_scan`` that runs ZERO iterations
returns a scalar for its ``last`` state; docs/FACTS.md): at S = 1 the chunk loop runs none,
so its state is read from its state after every iteration with the initial state in front
(right at zero iterations).

The state-independent chunk terms are computed before the chunk loop, for all chunks at
once: at S = 1 they run on empty tensors (~40 small ops). It accepts what "chunked" accepts
(one log decay per value head; f16/f32/f64 operands) and is the measured choice for a
symbolic S on the CPU in a graph that serves decode. A graph that never decodes (a main /
decode pair's main graph) takes "chunked"; a static S "matmul_step", "chunked_unrolled" or
"chunked".
"""

from __future__ import annotations

from typing import Optional

from gdn_fx.lowering import gdn_fast_common as common
from gdn_fx.lowering import gdn_split, linear_chunked, linear_matmul
from gdn_fx.lowering.node_facts import LINEAR_OPERANDS, LinearFacts
from gdn_fx.lowering.nnef_emit import EmitContext
from gdn_fx.lowering.target import Target

WHOLE = linear_chunked.SCAN_CHUNK * linear_chunked.PER_STEP  # tokens per chunk iteration
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
    """The top fragment: the operands padded by one iteration of identity tokens; the chunks
    over [0, L) of them (L whole iterations, module docstring), one step on token L from the
    state the chunks end with; the outputs joined and cut at S; the state moved into the
    loops' layout and back."""
    consts = ", ".join(linear_chunked.CONSTANTS)
    lines = common.dims_lines() + [f"whole = (n + {WHOLE - 2}) / {WHOLE} * {WHOLE};"]
    for name in OPERANDS:
        lines += [common.padded_line(f"{name}p", name, str(WHOLE), *common.pad_tail(facts, name)),
                  f"{name}1 = slice({name}p, axes = [1], begin = [0], end = [whole]);",
                  f"{name}2 = slice({name}p, axes = [1], begin = [whole], end = [whole + 1]);"]
    args = ", ".join(f"squeeze({s}, axes = [1])" for s in linear_matmul.STEP_INPUTS)
    return lines + [
        linear_matmul.state_in_line(facts, "st", "s0"),
        linear_chunked.flat_line("st0", "st"),
        f"(o1, fin1) = gdn_fx_linear_chunks{suffix}(q1, k1, v1, g1, st0, {consts});",
        linear_chunked.unflat_line(facts, "s1", "fin1"),
        *linear_matmul.prologue_lines(facts, "q2", "k2", "v2", "g2"),
        f"(fin2, y) = gdn_fx_linear_step{suffix}(s1, {args});",
        f"o2 = reshape(unsqueeze(squeeze(y, axes = [3]), axes = [1]), shape = [-1, {facts.dv}],"
        " axis_start = 2, axis_count = 2);",
        "out = slice(concat([o1, o2], axis = 1), axes = [1], begin = [0], end = [n]);",
        linear_matmul.state_out_line("final", "fin2")]


def definitions(facts: LinearFacts, suffix: str) -> str:
    """Every fragment of one node configuration: the chunks (with their per-iteration
    states), the step, and the top fragment joining them."""
    chunks = linear_chunked.chunks_definitions(facts, linear_chunked.SCAN_CHUNK, 0, suffix,
                                               pad="0", states=True)
    step = linear_matmul.step_fragment(facts, suffix)
    top = common.fragment_text(f"gdn_fx_linear_split{suffix}",
                               ["q", "k", "v", "g", "s0", *linear_chunked.CONSTANTS],
                               ["out", "final"], split_lines(facts, suffix))
    return "\n".join([chunks, step, top])


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
