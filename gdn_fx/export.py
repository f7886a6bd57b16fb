"""``gdn_fx.export_nnef``: write a program holding fused gdn_fx nodes as NNEF for tract."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Mapping, Optional, Sequence, Union

import torch

from gdn_fx.errors import ExportRefused

PLUGIN = "gdn_fx.lowering.t2n_plugin"


def _refuse_unrolled(program) -> None:
    """A symbolic axis over a loop unrolled at the traced length would be silently wrong past
    that length (FACTS.md): refuse it."""
    from gdn_fx.passes import find_unrolled

    found = find_unrolled(program)
    if found:
        more = f" and {len(found) - 3} more" if len(found) > 3 else ""
        raise ExportRefused(f"dynamic axes over a graph frozen at its traced length "
                            f"({'; '.join(found[:3])}{more}): tract would be silently wrong "
                            "at other lengths; collapse it first (gdn_fx.collapse)")


def _writer_settings(path: Path) -> tuple[Path, Optional[int]]:
    """(path handed to torch-to-nnef, compression level) for a folder, .tar or .tgz target."""
    name = path.name
    if name.endswith(".nnef"):
        return path, None
    if name.endswith(".nnef.tgz"):
        return path, 0
    if name.endswith(".nnef.tar"):
        return path.with_name(name[: -len(".tar")]), 0
    raise ValueError(f"NNEF path {path} must end with .nnef (a folder), .nnef.tar or .nnef.tgz")


def export_nnef(program, path: Union[str, Path], *, tract_version: str = "0.23.9",
                dynamic_axes: Optional[Mapping[str, Mapping[int, str]]] = None,
                input_names: Optional[Sequence[str]] = None,
                output_names: Optional[Sequence[str]] = None,
                choose: Optional[Mapping] = None,
                symbol_min: Optional[Mapping[str, int]] = None) -> Path:
    """Write ``program`` (an ExportedProgram or GraphModule with gdn_fx nodes) as tract NNEF.

    Each ``gated_delta_scan`` / ``causal_conv1d_update`` node is lowered by the first
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

    Raises ShapeError / DTypeError naming the node and operand for operands that break an op
    contract, LoweringUnsupported when no candidate accepts a node, ExportRefused as above.
    Nothing is downloaded: torch-to-nnef's tract binary is never fetched nor run.
    Returns the path written.
    """
    from gdn_fx.lowering import program as prog
    from gdn_fx.lowering.bridge import to_bridge
    from gdn_fx.lowering.fixes import apply_fixes
    from gdn_fx.lowering.plan import plan
    from gdn_fx.lowering.target import Target

    path = Path(path)
    writer_path, compression = _writer_settings(path)
    from gdn_fx.lowering.dynamic_axes import frozen_axes, refuse_frozen_axes

    module = prog.traceable_module(program)
    names = list(input_names) if input_names is not None else prog.input_names(module)
    # Sizes may differ from the traced ones at run time only where a declared dynamic axis is
    # static in the program; axes the program holds symbolic are vouched for by torch.export,
    # and its static sizes then stay what they are (a decode graph's S = 1 beside a symbolic P).
    target = Target.parse(tract_version, dynamic=bool(frozen_axes(module, dynamic_axes, names)))
    prog.refuse_bfloat16(module)
    apply_fixes(module)
    if dynamic_axes:
        _refuse_unrolled(program)
        refuse_frozen_axes(module, dynamic_axes, names)
    decisions = plan(module, target, choose)  # logs every decision and rejection
    to_bridge(module, {d.node: d.candidate for d in decisions})
    return _write(module, writer_path, compression, target, dynamic_axes, decisions,
                  names, list(output_names) if output_names else None, symbol_min or {})


def _write(module, writer_path: Path, compression: Optional[int], target, dynamic_axes,
           decisions, input_names: list, output_names: Optional[list],
           symbol_min: Mapping[str, int]) -> Path:
    """Trace the bridged module with torch-to-nnef (offline target) and write the NNEF."""
    from torch_to_nnef.export import export_model_to_nnef

    from gdn_fx.lowering.offline_target import offline_tract_target
    from gdn_fx.lowering.plan import summary
    from gdn_fx.lowering.program import example_inputs

    from gdn_fx.lowering.target import DYNAMIC_ATTRIBUTE

    t2n_target = offline_tract_target(target.version_text, dynamic_axes,
                                      {"gdn_fx_lowering": summary(decisions)})
    setattr(t2n_target, DYNAMIC_ATTRIBUTE, target.dynamic)  # emission re-checks against it
    # Symbols are extents (>= 1); without saying so tract keeps slower generic ops (FACTS.md).
    symbols = sorted({str(s) for axes in (dynamic_axes or {}).values()
                      for s in (axes.values() if isinstance(axes, Mapping) else [])})
    with torch.inference_mode():  # torch-to-nnef's slicing needs it (FACTS.md)
        written = export_model_to_nnef(
            module, example_inputs(module), writer_path, t2n_target,
            input_names=input_names, output_names=output_names, compression_level=compression,
            log_level=logging.WARNING, load_extra_op_modules=[PLUGIN], strict_extra_imports=True,
            custom_extensions=[f"tract_assert {s} >= {symbol_min.get(s, 1)}" for s in symbols])
    return Path(written)
