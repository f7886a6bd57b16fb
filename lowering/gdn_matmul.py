"""Candidates "matmul_step" and "matmul" for gated_delta_scan: the decode step written with one
batched matmul.

With a = exp(g_t) and the OLD state S, one step is

    [kv; qS] = [a*k; a*q] S              (both readouts from ONE matmul of the old state)
    delta = beta * (v - kv)
    y = qS + (q . k) delta               (= q^T S' without reading S' again)
    S' = a * S + k delta^T

so the state is read by one matmul and written once. The two readout rows are pulled out of
the matmul result with 0/1 masks and ``sum_reduce`` (slicing the result makes tract split the
matmul and repack the state, docs/FACTS.md "tract 0.23.9: traps"). The decay rides on the
rows: a scalar per value head for GDN gates, one per key channel for KDA gates, so both gate
kinds are served (the rows are per value head either way: they are a*k, not a repeat of k).
GQA: the state keeps the contract layout [B, Hv, Dk, Dv] (reshaping the input state would
copy it); the per-key-head terms (k as a column, q.k) meet their G value heads by
broadcasting in [B, Hk, G, ...] views of the small per-step tensors, so nothing is repeated.

"matmul_step" writes the step once: it serves S = 1 with no symbolic axis in the export.
"matmul" makes it the body of a ``tract_core_scan`` over the sequence with
``reset_every_turn = 1``: any S, symbolic too. Every operand is cast to f32 (f64 when q or the
state is f64) first, as the op's kernel does; f16 models therefore carry an f32 state.
bfloat16 is refused (no such dtype in tract).
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from gdn_fx.lowering import gdn_fast_common as common
from gdn_fx.lowering.node_facts import ScanFacts, portable_dtype_reason
from gdn_fx.lowering.nnef_emit import EmitContext
from gdn_fx.lowering.target import Target

STEP_INPUTS = ("rows", "qk", "kcol", "v", "beta", "decay")


def check(facts: ScanFacts, target: Target) -> Optional[str]:
    """Why the scan of matmul steps can not serve this node (None: it can)."""
    return portable_dtype_reason(facts)


def check_step(facts: ScanFacts, target: Target) -> Optional[str]:
    """Why one matmul step can not serve this node: it needs S = 1 for sure."""
    if target.dynamic:
        return "the export declares symbolic axes: S may differ from 1 at run time"
    if facts.seq != 1:
        return "one decode step serves S = 1; node has " + (
            "a symbolic S" if facts.seq is None else f"S={facts.seq}")
    return portable_dtype_reason(facts)


def _gate_lines(facts: ScanFacts) -> list[str]:
    """Readout rows a*[k; q] per value head, and the decay of the state, per gate kind."""
    hk, g = facts.key_heads, facts.groups
    # KDA: a [B, S, Hk, G, Dk] scales key channels; GDN: a [B, S, Hk, G] one per value head.
    row, col = ("[4]", "[5]") if facts.kda else ("[4, 5]", "[4, 5]")
    return [f"a = exp(reshape(g, shape = [{hk}, {g}], axis_start = 2, axis_count = 1));",
            "rows_k = unsqueeze(concat([unsqueeze(kn, axes = [3]), unsqueeze(qs, axes = [3])],"
            " axis = 3), axes = [3]);",
            f"rows = reshape(mul(rows_k, unsqueeze(a, axes = {row})), shape = [-1],"
            " axis_start = 2, axis_count = 2);",
            f"decay = reshape(unsqueeze(a, axes = {col}), shape = [-1], axis_start = 2,"
            " axis_count = 2);"]


def _prologue(facts: ScanFacts, suffix: str) -> list[str]:
    """Everything that does not depend on the state, for all steps at once. Per value head:
    rows [B, S, Hv, 2, Dk], decay [B, S, Hv, 1 or Dk, 1], v [B, S, Hv, 1, Dv], beta
    [B, S, Hv, 1, 1]; per key head (met by broadcasting): q.k [B, S, Hk, 1, 1, 1], k as a
    column [B, S, Hk, 1, Dk, 1]."""
    return common.prologue_lines(facts, suffix) + _gate_lines(facts) + [
        "qk = unsqueeze(sum_reduce(mul(qs, kn), axes = [3]), axes = [4, 5]);",
        "kcol = unsqueeze(unsqueeze(kn, axes = [3]), axes = [5]);",
        "v5 = unsqueeze(v, axes = [3]);",
        "b5 = unsqueeze(beta, axes = [3, 4]);"]


def _step_lines(facts: ScanFacts) -> list[str]:
    """One step on per-step tensors (no sequence axis); state [B, Hv, Dk, Dv] as given. The
    state-sized tensors stay in that layout (a reshape of the input state would copy it); the
    per-key-head terms meet their value heads in [B, Hk, G, ...] views of small tensors.

    The update k delta^T is a matmul of a column by a row (K = 1): written as ``mul`` of the
    two broadcasts, tract 0.23.9 ran its generic broadcasting Mul, 0.35 ms of a 0.61 ms step
    on a 16 x 128 layer (0.11 ms as a matmul). Adding the decayed state to the matmul's result
    instead of the other way round makes tract fuse the add into the matmul: 0.28 ms."""
    hk, g = facts.key_heads, facts.groups
    return ["p = matmul(rows, state);",
            "kv = sum_reduce(mul(p, mk0), axes = [2]);",
            "qsv = sum_reduce(mul(p, mk1), axes = [2]);",
            "delta = mul(sub(v, kv), beta);",
            f"delta5 = reshape(delta, shape = [{hk}, {g}], axis_start = 1, axis_count = 1);",
            "y = add(qsv, reshape(mul(qk, delta5), shape = [-1], axis_start = 1,"
            " axis_count = 2));",
            "update = reshape(matmul(kcol, delta5), shape = [-1], axis_start = 1,"
            " axis_count = 2);",
            "new_state = add(mul(state, decay), update);"]


def _loop_lines(suffix: str, single: bool) -> list[str]:
    """Run the step once (single) or as a tract_core_scan over the sequence axis (axis 1).
    The 0/1 masks enter the loop whole: a broadcast constant scanned by tract_core_scan makes
    tract 0.23.9 fail."""
    sources = ("rows", "qk", "kcol", "v5", "b5", "decay")
    if single:
        args = ", ".join(f"squeeze({s}, axes = [1])" for s in sources)
        return [f"(final, y1) = gdn_fx_matmul_step{suffix}(s0, {args}, mk0, mk1);",
                "y5 = unsqueeze(y1, axes = [1]);"]
    scans = ", ".join(f'("{name}_t", {s}, 1, 1)' for name, s in zip(STEP_INPUTS, sources))
    return [f'(final, y5) = tract_core_scan(body = "gdn_fx_matmul_scan_step{suffix}",',
            f"    scan = [{scans}],",
            '    full = [("mk0", mk0), ("mk1", mk1)], state = [("state", s0, "new_state")],',
            '    output = [("new_state", "last", 0, 1), ("y_t", "full", 1, 1)],',
            "    skip = 0, reset_every_turn = 1);"]


def fragment_definitions(facts: ScanFacts, single: bool, suffix: str) -> str:
    """The NNEF fragments of one node configuration (names end in ``suffix``)."""
    step = common.fragment_text(f"gdn_fx_matmul_step{suffix}",
                                ["state", *STEP_INPUTS, "mk0", "mk1"], ["new_state", "y"],
                                _step_lines(facts))
    args = ", ".join(f"squeeze({name}_t, axes = [1])" for name in STEP_INPUTS)
    scan_step = common.fragment_text(
        f"gdn_fx_matmul_scan_step{suffix}",
        ["state", *(f"{n}_t" for n in STEP_INPUTS), "mk0", "mk1"], ["new_state", "y_t"],
        [f"(new_state, y) = gdn_fx_matmul_step{suffix}(state, {args}, mk0, mk1);",
         "y_t = unsqueeze(y, axes = [1]);"])
    main = _prologue(facts, suffix) + _loop_lines(suffix, single) + [
        "out = squeeze(y5, axes = [3]);"]
    top = common.fragment_text(f"gdn_fx_matmul{suffix}",
                               ["q", "k", "v", "g", "beta", "s0", "mk0", "mk1", "scale"],
                               ["out", "final"], main)
    parts = [common.l2norm_fragment(suffix), step] + ([] if single else [scan_step]) + [top]
    return "\n".join(parts)


def emit(ctx: EmitContext) -> list:
    """Write the scan of matmul steps for one node; returns the fragments it needs."""
    return _emit(ctx, single=False)


def emit_step(ctx: EmitContext) -> list:
    """Write one matmul step (S = 1) for one node; returns the fragments it needs."""
    return _emit(ctx, single=True)


def masks(ctx: EmitContext, work: str) -> list:
    """The 0/1 masks that pull the two readout rows out of the step's matmul result."""
    return [common.variable(ctx, f"mask{i}", np.eye(2)[i].reshape(1, 1, 2, 1), work)
            for i in range(2)]


def _emit(ctx: EmitContext, single: bool) -> list:
    facts = ctx.facts
    work = common.work_dtype(facts)
    operands = common.prepared_operands(ctx, work)
    name, frag = common.fragment(
        "gdn_fx_matmul", lambda suffix: fragment_definitions(facts, single, suffix))
    out = ctx.tensor("out", facts.shapes["v"], work)
    final = ctx.tensor("final_state", facts.shapes["initial_state"], work)
    ctx.apply_multi(name, operands + masks(ctx, work) + [common.scale_variable(ctx, work)],
                    (out, final))
    common.finish_outputs(ctx, out, final)
    return [frag]
