"""The lowering's one entry point: a program with fused gdn_fx nodes -> an NNEF file.

``write_nnef`` owns the sequence, in this order: make the program traceable by torch-to-nnef
(t2n/traceable.py), refuse what tract cannot run right (loops kept as one higher-order node;
bfloat16; dynamic axes the program cannot follow, t2n/dynamic_axes.py), apply the fixes
(t2n/fixes.py), plan one candidate per fused node (plan.py over table.py), turn the fused
nodes into bridge ops that carry their candidate (t2n/bridge.py), and trace and write with
torch-to-nnef, whose extension handlers (t2n/plugin.py) emit each candidate.
"""

from __future__ import annotations

import contextlib
import io
import logging
import sys
import time
from pathlib import Path
from typing import Mapping, Optional, Sequence, Union

import torch

from gdn_fx.errors import ExportRefused, InternalError, LoweringUnsupported, UsageError
from gdn_fx.lowering.options import ExportOptions
from gdn_fx.lowering.plan import fallbacks, max_tokens, plan, summary
from gdn_fx.lowering.t2n import traceable as prog
from gdn_fx.lowering.t2n.placeholders import active as active_placeholders
from gdn_fx.lowering.t2n.placeholders import labels, streamed_writes
from gdn_fx.lowering.t2n.bridge import to_bridge
from gdn_fx.lowering.t2n.dynamic_axes import frozen_axes, refuse_frozen_axes
from gdn_fx.lowering.t2n.fixes import POSITION_SYMBOL_MAX, apply_fixes
from gdn_fx.lowering.t2n.moe_ffn import FUSED, fuse_moe_blocks, split_choice
from gdn_fx.lowering.t2n.offline_target import offline_tract_target
from gdn_fx.lowering.t2n.scan_reset import needs_reset, reset_cumsum_scans
from gdn_fx.lowering.t2n.unused_inputs import (declare_unused, drop_unused, rewrite_graph_file,
                                               unused_inputs)
from gdn_fx.lowering.t2n.weights import apply_weights
from gdn_fx.lowering.target import DYNAMIC_ATTRIBUTE, MAX_TOKENS, RUNTIME_ATTRIBUTE, Target
from gdn_fx.passes.hop import describe, loop_hops

PLUGIN = "gdn_fx.lowering.t2n.plugin"


def write_nnef(program, path: Union[str, Path], *,
               dynamic_axes: Optional[Mapping] = None,
               input_names: Optional[Sequence[str]] = None,
               output_names: Optional[Sequence[str]] = None,
               options: Optional[ExportOptions] = None, **fields) -> Path:
    """Write ``program`` as tract NNEF; the arguments are ``gdn_fx.export_nnef``'s."""
    options = ExportOptions.of(options, **fields)
    path = Path(path)
    writer_path, compression = _writer_settings(path)
    module = prog.traceable_module(program)
    names = list(input_names) if input_names is not None else prog.input_names(module)
    # Sizes may differ from the traced ones at run time only where a declared dynamic axis is
    # static in the program; axes the program holds symbolic are vouched for by torch.export,
    # and its static sizes then stay what they are (a decode graph's S = 1 beside a symbolic P).
    frozen = frozen_axes(module, dynamic_axes, names)
    target = options.target(dynamic=bool(frozen))
    _refuse_loop_hops(module)
    prog.refuse_bfloat16(module)
    moe, choose = split_choice(options.choose)  # choose["transformers_moe"], not a table entry
    if moe == FUSED:  # before the fixes: else plain (moe.py)
        fuse_moe_blocks(module, target)
    fixed = apply_fixes(module)
    _refuse_specialized_axes(frozen, frozen_axes(module, dynamic_axes, names))
    if dynamic_axes:
        refuse_frozen_axes(module, dynamic_axes, names)
    decisions = plan(module, target, choose)  # logs every decision and rejection
    to_bridge(module, {d.node: d.candidate for d in decisions})
    stored = apply_weights(module, options.weights)  # t2n/weights.py: f32, f16 or q4_0
    return _write(module, writer_path, compression, target, dynamic_axes, decisions,
                  names, list(output_names) if output_names else None, options.symbol_min,
                  stored.summary(),
                  POSITION_SYMBOL_MAX if "float_position_compares" in fixed else None)


def _refuse_specialized_axes(before: list, after: list) -> None:
    """InternalError when a declared axis the program held symbolic became static while the
    module was rewritten: a rewrite compared a symbolic size with an int (a guard torch's
    ShapeEnv keeps), the symbol is now its example extent in every node, and the lowering would
    be planned for that extent while the NNEF declares a symbol (tract refuses the file, or
    computes wrongly at other extents)."""
    specialized = sorted(set(after) - set(before))
    if specialized:
        raise InternalError(f"the export's symbolic axes {specialized} (input, axis) became "
                            "static while the program was rewritten for torch-to-nnef (a "
                            "guard on a symbolic size); nothing was written")


def _refuse_loop_hops(module) -> None:
    """A loop kept as one higher-order node (torch's ``scan``, ``while_loop``): torch-to-nnef
    traces with torch.jit, which has no kernel for it and fails deep inside its trace."""
    found = loop_hops(module.graph)
    if found:
        more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
        raise LoweringUnsupported(
            f"{describe(found[0])}{more}: a loop kept as one higher-order node, which no gdn_fx "
            "rule fused and torch-to-nnef cannot trace; write the loop in Python (torch.export "
            "unrolls it and gdn_fx.collapse fuses it) or call gdn_fx's ops directly")


def _writer_settings(path: Path) -> tuple[Path, Optional[int]]:
    """(path handed to torch-to-nnef, compression level) for a folder, .tar or .tgz target."""
    name = path.name
    if name.endswith(".nnef"):
        return path, None
    if name.endswith(".nnef.tgz"):
        return path, 0
    if name.endswith(".nnef.tar"):
        return path.with_name(name[: -len(".tar")]), 0
    raise UsageError(f"NNEF path {path} must end with .nnef (a folder), .nnef.tar or .nnef.tgz")


T2N_RECURSION = 50_000


@contextlib.contextmanager
def _deep_graph_walks():
    """torch-to-nnef 0.24.12 walks each dynamic value's users recursively
    (``nnef_graph.forward_clean_values_for_dyn_axes``): a 24-layer Qwen3.5-sized model in f16
    with symbolic S and P needs more than Python's default 1000 frames. Those are pure-Python
    frames: from Python 3.11 on they take no C stack, so a high limit for the call is safe."""
    old = sys.getrecursionlimit()
    sys.setrecursionlimit(max(old, T2N_RECURSION))
    try:
        yield
    finally:
        sys.setrecursionlimit(old)


class _PacedCollector:
    """Stands for the ``gc`` module inside torch-to-nnef's writer, which runs a full
    ``gc.collect()`` after every quantized tensor it writes. Each walks the whole heap: 34
    of them were 8.2 of the 15.4 s of a tiny model's q4_0 write (a process holding one
    model); in a process holding more they cost more. Here a full collection runs only once
    at least FULL_COLLECTION_PACE times its own last cost has passed since the last one
    (at most ~1/5 of the write spent collecting; as often as before where collections are
    cheap), a young one otherwise: what a write leaves in a reference cycle is freed a
    little later, never kept."""

    def __init__(self, real):
        self._real, self._next, self._cost = real, 0.0, 0.0

    def collect(self, generation: int = 2) -> int:
        now = time.perf_counter()
        if generation < 2 or now < self._next:
            return self._real.collect(min(generation, 1))
        found = self._real.collect(generation)
        self._cost = time.perf_counter() - now
        self._next = now + FULL_COLLECTION_PACE * self._cost
        return found

    def __getattr__(self, name):
        return getattr(self._real, name)


FULL_COLLECTION_PACE = 5.0


@contextlib.contextmanager
def _paced_collections():
    """torch-to-nnef's writer collects through ``_PacedCollector`` during the call."""
    from torch_to_nnef.nnef_io import writer

    real = writer.gc
    writer.gc = _PacedCollector(real)
    try:
        yield
    finally:
        writer.gc = real


def _streamed(module, t2n_target):
    """A streamed export (t2n/placeholders.py): its placeholders written from their sources."""
    placeholders = active_placeholders()
    if placeholders is None:
        return contextlib.nullcontext()
    return streamed_writes(labels(module, placeholders), t2n_target)


def _write(module, writer_path: Path, compression: Optional[int], target: Target,
           dynamic_axes, decisions, input_names: list, output_names: Optional[list],
           symbol_min: Mapping[str, int], weights: str = "f32",
           symbol_max: Optional[int] = None) -> Path:
    """Trace the bridged module with torch-to-nnef (offline target) and write the NNEF.

    Inputs nothing reads are left out of what torch-to-nnef sees and declared afterwards, in
    their place (t2n/unused_inputs.py). ``symbol_max``: every symbol is declared at most
    that (the float32 position compares' bound, fixes.float_position_compares)."""
    from torch_to_nnef.exceptions import T2NErrorIoQuantity
    from torch_to_nnef.export import export_model_to_nnef

    unread = unused_inputs(module, input_names, prog.example_inputs(module), dynamic_axes)
    drop_unused(module)
    examples = prog.example_inputs(module)
    skipped = {u.name for u in unread}
    t2n_axes = {k: v for k, v in (dynamic_axes or {}).items() if k not in skipped}
    t2n_target = offline_tract_target(target.version_text, t2n_axes,
                                      {"gdn_fx_lowering": summary(decisions),
                                       "gdn_fx_weights": weights,
                                       RUNTIME_ATTRIBUTE: target.runtime,
                                       "gdn_fx_cpu_fallback": fallbacks(decisions),
                                       MAX_TOKENS: max_tokens(decisions)})
    setattr(t2n_target, DYNAMIC_ATTRIBUTE, target.dynamic)  # emission re-checks against it
    setattr(t2n_target, RUNTIME_ATTRIBUTE, target.runtime)
    # Symbols are extents (>= 1 unless told); without saying so tract keeps slower generic ops.
    symbols = sorted({str(s) for axes in (dynamic_axes or {}).values()
                      for s in (axes.values() if isinstance(axes, Mapping) else [])})
    # stdout: on an input-count mismatch torch-to-nnef prints the whole traced graph first.
    with torch.inference_mode(), _deep_graph_walks(), _paced_collections(), \
            _streamed(module, t2n_target), \
            contextlib.redirect_stdout(io.StringIO()):  # inference_mode: t2n's slicing needs it
        try:
            written = Path(export_model_to_nnef(
                module, examples, writer_path, t2n_target,
                input_names=[n for n in input_names if n not in skipped],
                output_names=output_names, compression_level=compression,
                log_level=logging.WARNING, load_extra_op_modules=[PLUGIN],
                strict_extra_imports=True,
                custom_extensions=[f"tract_assert {s} >= {symbol_min.get(s, 1)}"
                                   for s in symbols]
                + [f"tract_assert {s} <= {symbol_max}" for s in symbols if symbol_max]))
        except T2NErrorIoQuantity as error:
            raise ExportRefused(f"torch-to-nnef dropped program inputs or outputs it found "
                                f"unused after its own simplifications: "
                                f"{str(error).splitlines()[0]}") from None
    if unread:
        rewrite_graph_file(written, lambda text: declare_unused(text, unread, input_names))
    if needs_reset(written):  # torch-to-nnef's cumsum scan, else wrong on a reused State
        rewrite_graph_file(written, reset_cumsum_scans)
    return written
