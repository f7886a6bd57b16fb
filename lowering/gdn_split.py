"""Candidate "split" for gated_delta_scan: ONE graph that serves decode (S = 1) and prefill.

For a sequence of S tokens, with W = ``SCAN_CHUNK * SCAN_CHUNKS_PER_STEP`` the tokens one
iteration of the chunk loop takes (64) and M = floor(S / W) * W:

- tokens [0, M): the chunked (WY) form, the loop over chunks of "chunked"
  (gdn_chunked_text.py), with nothing to pad;
- tokens [M, S): a ``tract_core_scan`` of matmul steps, the loop of "matmul" (gdn_matmul.py),
  started from the state the chunks end with.

At S = 1 that is zero chunks and one step (the decode cost of "matmul"); at S = 512 eight
iterations of chunks and no step (the prefill cost of "chunked", without its padding). So a
generation-ready artifact needs no second graph at S = 1 (issue 31). The two parts reuse the
fragments of those candidates, written once under one digest.

Trap (tract 0.23.9): a ``tract_core_scan`` that runs ZERO iterations returns a scalar, not its
initial state, for its state (``last``) output. Either part may run zero iterations (S < W;
S a multiple of W), so each part's final state is chosen by ``select`` on whether it ran:
the condition is computed from the part's length (a [n] vector of ones summed, > 0), which
tract evaluates at run time.

It accepts what "chunked" accepts (GDN gate, q/k l2norm in the node, f16/f32 operands) and
refuses the rest with chunked's reason (KDA gates, qk_l2norm=False: "matmul" serves them),
and f64 arithmetic: the scalar that scan of zero iterations returns is an f32 one whatever
the state's dtype, and ``select`` refuses to meet it with an f64 state ("chunked" serves f64;
no f64 model is deployed). It is the
measured choice for a symbolic S on the CPU; a static S takes "matmul_step" (S = 1),
"chunked_unrolled" or "chunked" (``suits``), and under the CUDA runtime (not measured there)
the CPU fallback stays "chunked".
"""

from __future__ import annotations

from typing import Optional

from gdn_fx.lowering import gdn_chunked, gdn_matmul
from gdn_fx.lowering import gdn_chunked_text as text
from gdn_fx.lowering import gdn_fast_common as common
from gdn_fx.lowering.facts import ScanFacts
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


def _ran_lines(name: str, length: str) -> list[str]:
    """``name``: a boolean scalar, true when ``length`` (a dim expression) is > 0."""
    return [f"{name}_ones = tract_core_broadcast(ones1, shape = [{length}]);",
            f"{name} = gt(sum_reduce({name}_ones, axes = [0]), 0.5);"]


def split_lines(suffix: str) -> list[str]:
    """The top fragment: cut at M, chunks over [0, M), steps over [M, S), the state guarded
    where a part runs zero iterations."""
    lines = common.dims_lines() + [f"m = n / {WHOLE} * {WHOLE};"]
    for name in OPERANDS:
        lines += [f"{name}1 = slice({name}, axes = [1], begin = [0], end = [m]);",
                  f"{name}2 = slice({name}, axes = [1], begin = [m], end = [n]);"]
    consts = ", ".join(text.CONSTANTS)
    lines += [*_ran_lines("ran1", "m"),
              f"(o1, s1) = gdn_fx_chunked{suffix}(q1, k1, v1, g1, beta1, s0, {consts}, ran1);",
              f"(o2, f2) = gdn_fx_matmul{suffix}(q2, k2, v2, g2, beta2, s1, mk0, mk1, scale);",
              *_ran_lines("ran2", "n - m"),
              "final = select(ran2, f2, s1);",
              "out = concat([o1, o2], axis = 1);"]
    return lines


PARAMS = ["q", "k", "v", "g", "beta", "s0", *text.CONSTANTS, "mk0", "mk1", "ones1"]


def definitions(facts: ScanFacts, suffix: str) -> str:
    """Every fragment of one node configuration: chunked's loop (nothing to pad), matmul's
    loop of steps, and the top fragment joining them."""
    chunked = text.definitions(facts, gdn_chunked.SCAN_CHUNK, 0, suffix,
                               gdn_chunked.SCAN_CHUNKS_PER_STEP, gdn_chunked.LEAF,
                               guarded=True)
    steps = gdn_matmul.fragment_definitions(facts, single=False, suffix=suffix)
    top = common.fragment_text(f"gdn_fx_split{suffix}", PARAMS, ["out", "final"],
                               split_lines(suffix))
    return "\n".join([chunked, steps, top])


def emit(ctx: EmitContext) -> list:
    """Write chunks then steps for one node; returns the fragments it needs."""
    import numpy as np

    facts = ctx.facts
    work = common.work_dtype(facts)
    operands = common.prepared_operands(ctx, work)
    values = gdn_chunked.constants(gdn_chunked.SCAN_CHUNK, gdn_chunked.LEAF)
    consts = [common.scale_variable(ctx, work) if name == "scale" else
              common.variable(ctx, name, values[name], work) for name in text.CONSTANTS]
    ones = common.variable(ctx, "ones1", np.ones((1,)), "f32")
    name, frag = common.fragment("gdn_fx_split", lambda suffix: definitions(facts, suffix))
    out = ctx.tensor("out", facts.shapes["v"], work)
    final = ctx.tensor("final_state", facts.shapes["initial_state"], work)
    ctx.apply_multi(name, operands + consts + gdn_matmul.masks(ctx, work) + [ones],
                    (out, final))
    common.finish_outputs(ctx, out, final)
    return [frag]
