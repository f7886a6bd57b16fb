"""``gdn_fx.export_nnef``: write a program holding fused gdn_fx nodes as NNEF for tract.

The public face: it checks what only the passes can say (a loop they would have fused is still
unrolled) and hands the program to ``gdn_fx.lowering.write_nnef``, which owns the sequence
from there (refusals, fixes, lowering plan, torch-to-nnef, the file).
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Optional, Sequence, Union

from gdn_fx.errors import ExportRefused


def _refuse_unrolled(program) -> None:
    """A symbolic axis over a loop unrolled at the traced length would be silently wrong past
    that length: refuse it, saying which loop (the lowering refuses it too, by structure)."""
    from gdn_fx.passes import find_unrolled

    found = find_unrolled(program)
    if found:
        more = f" and {len(found) - 3} more" if len(found) > 3 else ""
        raise ExportRefused(f"dynamic axes over a graph frozen at its traced length "
                            f"({'; '.join(found[:3])}{more}): tract would be silently wrong "
                            "at other lengths; collapse it first (gdn_fx.collapse)")


def export_nnef(program, path: Union[str, Path], *,
                dynamic_axes: Optional[Mapping[str, Mapping[int, str]]] = None,
                input_names: Optional[Sequence[str]] = None,
                output_names: Optional[Sequence[str]] = None,
                options=None, **fields) -> Path:
    """Write ``program`` (an ExportedProgram or GraphModule with gdn_fx nodes) as tract NNEF.

    ``options`` is a ``gdn_fx.lowering.options.ExportOptions`` (tract_version, choose,
    symbol_min, weights, runtime: below); its fields may also be given as keywords
    (``weights="q4_0"``), which override the record's.

    Each ``gated_delta_scan`` / ``gated_linear_scan`` / ``causal_conv1d_update`` node is
    lowered by the first
    candidate of the lowering table (gdn_fx.lowering.table) that accepts it on tract
    ``tract_version``; every decision and rejection is logged on logger "gdn_fx.lowering" and
    recorded in the NNEF's tract properties (key "gdn_fx_lowering", read it back with
    ``gdn_fx.tract_check.read_decisions``). ``gdn_fx.lowering.plan_lowering`` shows the
    decisions without exporting.

    path: ``*.nnef`` writes a folder, ``*.nnef.tar`` / ``*.nnef.tgz`` an archive.
    dynamic_axes: ``{input_name: {axis: symbol}}``, e.g. ``{"q": {1: "S"}, ...}`` for a
        symbolic sequence axis (each symbol is declared >= 1 to tract). Refused
        (ExportRefused) when the graph still holds a loop frozen at the traced length
        (``gdn_fx.find_unrolled``), or when an axis the program holds fixed does not compute
        at two other lengths (a reshape to a literal size, ...): export such models with
        symbolic shapes instead (``gdn_fx.hf.export_nnef_dynamic``).
        Each symbol is declared to tract as ``>= 1``, or ``>= symbol_min[symbol]`` (e.g.
        ``{"P": 0}`` for a past length that may be 0).
    input_names / output_names: NNEF names; inputs default to the program's placeholder names.
    choose: force or forbid candidates: keys ``"*"``, an op name or a fused node name map to
        one candidate name to force; ``"forbid"`` maps to a list of names (everywhere) or to a
        dict of such keys to lists. Examples: ``{"*": "scan"}``,
        ``{"gated_delta_scan_1": "native"}``, ``{"forbid": ["native"]}``. A forced candidate
        that does not accept its node raises LoweringUnsupported.
    weights: how the program's parameters are stored (gdn_fx.lowering.t2n.weights):
        ``"f32"`` (the default) as the program holds them; ``"f16"``: every floating-point
        parameter stored in f16 and cast back to its dtype where it is read (half the file;
        the arithmetic stays in the program's dtype on the weights rounded to f16 once); ``"q4_0"``: every 2-D weight of a matrix product
        over its last axis (``linear``, ``x @ W.t()``, a tied lm_head with its embedding)
        whose last axis is a multiple of 32 in tract's Q4_0 (blocks of 32 weights with one
        f16 scale, min-max calibrated: 18 bytes per 32 weights, 9/64 of f32; tract multiplies
        by the dequantized weights), the other parameters as they are. The format is
        recorded in the NNEF's tract properties (key "gdn_fx_weights"). Another value raises
        UsageError.

    runtime: the tract runtime the NNEF is for, ``"cpu"`` (the default) or ``"cuda"``
        (``tract.runtime_for_name("cuda")``): the lowering table's order and device checks
        follow it (gdn_fx.lowering.table, CUDA_ORDER). A candidate tract would run on the CPU
        under CUDA is taken only when nothing that stays on the GPU serves the node, with a
        warning on logger "gdn_fx.lowering"; the NNEF records the runtime (property
        "gdn_fx_runtime", ``gdn_fx.tract_check.read_runtime``) and such nodes
        ("gdn_fx_cpu_fallback"). Another value raises UsageError.

    An input that no node reads stays an input of the NNEF, at its place, with its shape
    and dtype (tract ignores its value).

    Raises ShapeError / DTypeError naming the node and operand for operands that break an op
    contract, LoweringUnsupported when no candidate accepts a node, ExportRefused as above.
    Nothing is downloaded: torch-to-nnef's tract binary is never fetched nor run.
    Returns the path written.
    """
    from gdn_fx.lowering import write_nnef
    from gdn_fx.lowering.options import ExportOptions

    options = ExportOptions.of(options, **fields)  # a bad option fails before any work
    if dynamic_axes:
        _refuse_unrolled(program)
    return write_nnef(program, path, dynamic_axes=dynamic_axes, input_names=input_names,
                      output_names=output_names, options=options)
