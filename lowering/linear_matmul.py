"""Candidates "matmul_step" and "matmul" for gated_linear_scan: the step written with matmuls.

With a = exp(g_t) (one per value head, or one per key channel) one step is

    S' = a S + k v^T          y = scale q^T S'

The state runs VALUE-first with the G value heads of a key head one under the other,
[B, Hk, G, Dv, Dk] (the contract's [B, Hv, Dk, Dv] is moved once, in and out): the write
v k^T is then ONE matmul of a column by a row (K = 1) per key head, [G Dv, 1] x [1, Dk], and
the readout one [G Dv, Dk] x [Dk, 1] matmul of the new state. Value-first because
transformers keeps a Mamba2 state so ([B, H, P, N]): the drop-in's transpose into the
contract and the move into this layout cancel in tract, where a loop's state cannot have its
moves folded into the products (the Falcon-H1-0.5B one graph lost ~0.55 ms a layer a token to
four copies of the state with the key-first layout [B, Hk, Dk, G, Dv]; docs/lowering.md,
"gated_linear_scan"). Written as a broadcasting ``mul``, tract 0.23.9 runs the outer product
as its generic broadcasting Mul, 3x slower than the matmul (docs/FACTS.md, "tract 0.23.9:
traps"). The decayed state is added to the update, not the other way round (tract fuses an
add into a matmul's result as a slow AddUnicast). A reset gate (-inf, -1e4) makes a = 0: the
decayed state is exactly 0 (never NaN while the state is finite).

"matmul_step" writes the step once: S = 1 with no symbolic axis in the export. "matmul" runs
it in a ``tract_core_scan`` over the sequence with ``reset_every_turn = 1`` (a reused tract
State restarts from its input state), one step an iteration, its readout written TWICE into an
output of two positions an iteration (``COPIES``), every other position dropped after the loop.
With one position, tract 0.23.9's Scan declutter pulls the readout out of the loop (it moves an
output's last op out unless the output takes more than one position an iteration), stores the
state of every step and packs them all for one big matmul: 1.85x slower at S = 64. Two steps
an iteration blocked it too, but an odd S then ran one identity step more: a symbolic-S graph
decoded in 1.33 ms against 0.77 with the copies (bench/bench_linear_scan.py's layer).
Any S, symbolic too, every gate kind: the generic fallback. Arithmetic in f32 (f64 when q or
the state is f64), as the op's kernel; bfloat16 is refused (no such dtype in tract).
"""

from __future__ import annotations

from typing import Optional

from gdn_fx.lowering import gdn_fast_common as common
from gdn_fx.lowering.node_facts import LINEAR_OPERANDS, LinearFacts, portable_dtype_reason
from gdn_fx.lowering.nnef_emit import EmitContext
from gdn_fx.lowering.target import Target

STEP_INPUTS = ("qcol", "krow", "vcol", "decay")
COPIES = 2  # positions the readout output takes an iteration (the module docstring says why)
PARAMS = ["q", "k", "v", "g", "s0", "scale"]


def check(facts: LinearFacts, target: Target) -> Optional[str]:
    """Why the scan of matmul steps can not serve this node (None: it can)."""
    return portable_dtype_reason(facts)


def check_step(facts: LinearFacts, target: Target) -> Optional[str]:
    """Why one matmul step can not serve this node: it needs S = 1 for sure."""
    if target.dynamic:
        return "the export declares symbolic axes: S may differ from 1 at run time"
    if facts.seq != 1:
        return "one step serves S = 1; node has " + (
            "a symbolic S" if facts.seq is None else f"S={facts.seq}")
    return portable_dtype_reason(facts)


def state_in_line(facts: LinearFacts, name: str, source: str) -> str:
    """NNEF: the contract's state [B, Hv, Dk, Dv] in the loop layout [B, Hk, G, Dv, Dk]."""
    return (f"{name} = reshape(transpose({source}, axes = [0, 1, 3, 2]),"
            f" shape = [{facts.key_heads}, {facts.groups}], axis_start = 1, axis_count = 1);")


def state_out_line(name: str, source: str) -> str:
    """NNEF: a state in the loop layout back in the contract's [B, Hv, Dk, Dv]."""
    return (f"{name} = transpose(reshape({source}, shape = [-1], axis_start = 1,"
            " axis_count = 2), axes = [0, 1, 3, 2]);")


def prologue_lines(facts: LinearFacts, q: str, k: str, v: str, g: str) -> list[str]:
    """Everything that does not read the state, for all steps at once, per key head: q as a
    column [B, S, Hk, Dk, 1] (times the scale), k as a row [B, S, Hk, 1, Dk], the values of
    its G heads as one column [B, S, Hk, G Dv, 1], the decay [B, S, Hk, G, 1, 1 or Dk]."""
    hk, groups = facts.key_heads, facts.groups
    return [f"qcol = unsqueeze(mul({q}, scale), axes = [4]);",
            f"krow = unsqueeze({k}, axes = [3]);",
            f"vcol = unsqueeze(reshape({v}, shape = [{hk}, -1], axis_start = 2,"
            " axis_count = 2), axes = [4]);",
            f"a = exp(reshape({g}, shape = [{hk}, {groups}], axis_start = 2, axis_count = 1));",
            f"decay = unsqueeze(a, axes = {'[4]' if facts.per_key else '[4, 5]'});"]


def step_lines(facts: LinearFacts) -> list[str]:
    """One step on per-step tensors (no sequence axis): state [B, Hk, G, Dv, Dk], qcol
    [B, Hk, Dk, 1], krow [B, Hk, 1, Dk], vcol [B, Hk, G Dv, 1], decay [B, Hk, G, 1, 1 or Dk]
    -> the new state and y [B, Hk, G Dv, 1], read from the new state."""
    return [f"update = reshape(matmul(vcol, krow), shape = [{facts.groups}, {facts.dv}],"
            " axis_start = 2, axis_count = 1);",
            "new_state = add(mul(state, decay), update);",
            "y = matmul(reshape(new_state, shape = [-1], axis_start = 2, axis_count = 2),"
            " qcol);"]


def iteration_lines(suffix: str) -> list[str]:
    """The loop body: one step, its readout written COPIES times along the sequence axis."""
    args = ", ".join(f"squeeze({name}_t, axes = [1])" for name in STEP_INPUTS)
    copies = ", ".join(["unsqueeze(y, axes = [1])"] * COPIES)
    return [f"(new_state, y) = gdn_fx_linear_step{suffix}(state, {args});",
            f"y_t = concat([{copies}], axis = 1);"]


def loop_lines(suffix: str) -> list[str]:
    """The steps as a tract_core_scan over the sequence axis (axis 1) of the operands, from
    ``st``: ``fin`` and ``ys`` [B, S, Hk, G Dv, 1] (the first copy of each readout)."""
    scans = ", ".join(f'("{name}_t", {name}, 1, 1)' for name in STEP_INPUTS)
    return [f'(fin, yp) = tract_core_scan(body = "gdn_fx_linear_scan_step{suffix}",',
            f"    scan = [{scans}],",
            '    full = [], state = [("state", st, "new_state")],',
            f'    output = [("new_state", "last", 0, 1), ("y_t", "full", 1, {COPIES})],',
            "    skip = 0, reset_every_turn = 1);",
            f"yc = reshape(yp, shape = [-1, {COPIES}], axis_start = 1, axis_count = 1);",
            "ys = squeeze(slice(yc, axes = [2], begin = [0], end = [1]), axes = [2]);"]


def out_line(facts: LinearFacts) -> str:
    """NNEF: the readouts ``ys`` [B, S, Hk, G Dv, 1] as ``out`` [B, S, Hv, Dv]."""
    return (f"out = reshape(squeeze(ys, axes = [4]), shape = [-1, {facts.dv}], axis_start = 2,"
            " axis_count = 2);")


STEPS_PARAMS = ["q", "k", "v", "g", "st", "scale"]


def step_fragment(facts: LinearFacts, suffix: str) -> str:
    return common.fragment_text(f"gdn_fx_linear_step{suffix}", ["state", *STEP_INPUTS],
                                ["new_state", "y"], step_lines(facts))


def steps_definitions(facts: LinearFacts, suffix: str) -> str:
    """The step, the loop body and ``gdn_fx_linear_steps``: the loop on raw operands, the
    state in and out in the loop layout."""
    body = common.fragment_text(
        f"gdn_fx_linear_scan_step{suffix}", ["state", *(f"{n}_t" for n in STEP_INPUTS)],
        ["new_state", "y_t"], iteration_lines(suffix))
    lines = (prologue_lines(facts, "q", "k", "v", "g") + loop_lines(suffix)
             + [out_line(facts)])
    steps = common.fragment_text(f"gdn_fx_linear_steps{suffix}", STEPS_PARAMS,
                                 ["out", "fin"], lines)
    return "\n".join([step_fragment(facts, suffix), body, steps])


def definitions(facts: LinearFacts, single: bool, suffix: str) -> str:
    """The NNEF fragments of one node configuration (names end in ``suffix``)."""
    if single:
        args = ", ".join(f"squeeze({s}, axes = [1])" for s in STEP_INPUTS)
        parts = [step_fragment(facts, suffix)]
        main = prologue_lines(facts, "q", "k", "v", "g") + [
            f"(fin, y1) = gdn_fx_linear_step{suffix}(st, {args});",
            "ys = unsqueeze(y1, axes = [1]);", out_line(facts)]
    else:
        parts = [steps_definitions(facts, suffix)]
        main = [f"(out, fin) = gdn_fx_linear_steps{suffix}(q, k, v, g, st, scale);"]
    main = [state_in_line(facts, "st", "s0")] + main + [state_out_line("final", "fin")]
    parts.append(common.fragment_text(f"gdn_fx_linear_matmul{suffix}", PARAMS,
                                      ["out", "final"], main))
    return "\n".join(parts)


def emit(ctx: EmitContext) -> list:
    """Write the scan of matmul steps for one node; returns the fragments it needs."""
    return _emit(ctx, single=False)


def emit_step(ctx: EmitContext) -> list:
    """Write one matmul step (S = 1) for one node; returns the fragments it needs."""
    return _emit(ctx, single=True)


def _emit(ctx: EmitContext, single: bool) -> list:
    facts = ctx.facts
    work = common.work_dtype(facts)
    operands = common.prepared_operands(ctx, work, LINEAR_OPERANDS)
    name, frag = common.fragment("gdn_fx_linear_matmul",
                                 lambda suffix: definitions(facts, single, suffix))
    out = ctx.tensor("out", facts.shapes["v"], work)
    final = ctx.tensor("final_state", facts.shapes["initial_state"], work)
    ctx.apply_multi(name, operands + [common.scale_variable(ctx, work)], (out, final))
    common.finish_outputs(ctx, out, final)
    return [frag]
