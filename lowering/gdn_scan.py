"""Candidate "scan" for gated_delta_scan: a portable ``tract_core_scan`` loop (fragments file
``fragments/gdn_fx_scan.nnef``).

It serves every node the op contract allows, on any tract with ``tract_core_scan``: GDN and
KDA gates, GQA (value heads split into (Hk, G) and broadcast against their key head; the
repeat is never materialized), any scale, with or without the q/k l2norm, any S (symbolic
too: nothing in the graph depends on the traced length), f16 operands with an f32 state.
Arithmetic runs in f32 (f64 when q or the state is f64), as the op's kernel does; the prologue
(casts, l2norm, scale, exp of the gate) runs once over the whole sequence, outside the loop.
The loop sets ``reset_every_turn = 1`` so a reused tract State restarts from its input state.

bfloat16 is refused: neither tract nor torch-to-nnef has that dtype.
"""

from __future__ import annotations

from typing import Optional

from gdn_fx.lowering.node_facts import ScanFacts, portable_dtype_reason
from gdn_fx.lowering.fragment_files import shipped
from gdn_fx.lowering.nnef_emit import EmitContext, promote
from gdn_fx.lowering.target import Target

FRAGMENT = "gdn_fx_scan"


def check(facts: ScanFacts, target: Target) -> Optional[str]:
    """Why the scan can not serve this node (None: it can)."""
    return portable_dtype_reason(facts)


def _prepared(ctx: EmitContext, work: str) -> dict:
    """Operands cast to the work dtype, q/k l2-normalized when the node asks for it."""
    ops = {name: ctx.cast(t, work, name) for name, t in ctx.operands.items()}
    if ctx.facts.qk_l2norm:
        for name in ("q", "k"):
            ops[name] = ctx.apply("gdn_fx_l2norm", [ops[name]], f"{name}_l2norm",
                                  ops[name].shape, work)
    return ops


def _decay(ctx: EmitContext, g, work: str):
    """exp(g) shaped [B, S, Hk, G, Dk or 1, 1] for the loop."""
    facts = ctx.facts
    b, s = facts.shapes["g"][:2]
    width = facts.dk if facts.kda else 1
    gate = "gdn_fx_gate_kda" if facts.kda else "gdn_fx_gate_gdn"
    return ctx.apply(gate, [g], "decay", (b, s, facts.key_heads, facts.groups, width, 1), work,
                     {"key_heads": facts.key_heads, "groups": facts.groups})


def emit(ctx: EmitContext) -> list:
    """Write the prologue, the loop and the output casts for one node."""
    facts = ctx.facts
    # As the op's eager kernel: f32, or f64 when q or the state is f64.
    work = promote("f32", facts.dtypes["q"], facts.dtypes["initial_state"])
    ops = _prepared(ctx, work)
    decay = _decay(ctx, ops["g"], work)
    out = ctx.tensor("out", facts.shapes["v"], work)
    final = ctx.tensor("final_state", facts.shapes["initial_state"], work)
    ctx.apply_multi(
        "gdn_fx_scan", [ops["q"], ops["k"], ops["v"], decay, ops["beta"], ops["initial_state"]],
        (out, final),
        {"scale": float(facts.scale), "key_heads": facts.key_heads, "groups": facts.groups})
    ctx.finish(0, out, promote(facts.dtypes["q"], facts.dtypes["initial_state"]))
    ctx.finish(1, final, facts.dtypes["initial_state"])
    return [shipped(FRAGMENT)]
