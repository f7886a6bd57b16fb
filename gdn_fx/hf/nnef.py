"""Whole transformers hybrids to NNEF: model preparation, the dynamic-length export, and the
files of an export (a fingerprint of weights and config, written beside the target first).

    model = prepare_for_nnef(tiny_model("qwen3_5_moe"))
    step = DecodeStep(model)
    program = export_dynamic(step, seq_len=8)            # reified, symbolic sequence axis
    path = export_nnef_dynamic(step, "prefill.nnef.tgz")  # the same, written as NNEF
    errors = check_dynamic(step, path, lengths=(3, 8, 50))  # tract vs eager at each length
    with staging("out/q.nnef.tgz") as folder:            # a hidden folder beside the target
        written = export_nnef(program, folder / "q.nnef")  # an NNEF folder, not yet archived
        stamp_properties(written, {FINGERPRINT: fingerprint(model)})   # a tract property
        place(written, Path("out/q.nnef.tgz"))            # archived, renamed into place

Why the dynamic export goes through :func:`~gdn_fx.hf.reify` and not through collapse: a
program exported at a fixed length (even collapsed) holds that length as literals in every
reshape, slice and arange, so no NNEF symbol can stand for it. Reified, the model exports with
``torch.export`` and a dynamic sequence dim (the per-token loops are gone), and its sizes stay
symbolic computations all the way into the NNEF (gdn_fx.lowering.t2n.traced_sizes).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Mapping, Optional, Sequence, Union

import torch
from torch import nn

from gdn_fx import ops  # noqa: F401  (registers torch.ops.gdn_fx.*, used below)
from gdn_fx.contract import DECODE, FINGERPRINT, VOCAB
from gdn_fx.errors import UnsupportedModel, UsageError
from gdn_fx.hf.decode import DecodeStep
from gdn_fx.hf.dropins import reify
from gdn_fx.runtime.artifact import decode_path
from gdn_fx.runtime.engine import read_max_tokens

SEQ_AXIS = {"input_ids": {1: "S"}}  # the NNEF symbol of the number of new tokens
# transformers' MoE kernel that torch-to-nnef can trace (see prepare_for_nnef).
EXPERTS_FOR_NNEF = "batched_mm"


def prepare_for_nnef(model: nn.Module) -> nn.Module:
    """Make ``model`` (in place) traceable by torch-to-nnef; returns it.

    transformers' default MoE kernel (``grouped_mm``) runs the experts through its own custom
    op ``transformers::grouped_mm_fallback``, which torch-to-nnef has no handler for; the
    ``batched_mm`` kernel computes the same with a gather of each token's expert weights and
    batched matmuls, all plain aten ops. Models without experts are left as they are.
    Optional since ``export_nnef`` spells the custom op as plain ops itself
    (``gdn_fx.lowering.t2n.moe``); the generation exports still call it (one graph less to
    rewrite).
    """
    setter = getattr(model, "set_experts_implementation", None)
    if setter is not None:
        setter(EXPERTS_FOR_NNEF)
    return model


def fused_counts(program: torch.export.ExportedProgram) -> dict[str, int]:
    """Fused nodes per op name, as ``DecodeStep.expected_fusions`` lists them (the linear
    scan only where there is one)."""
    counts = {"gated_delta_scan": 0, "gated_linear_scan": 0, "causal_conv1d_update": 0}
    for node in program.graph.nodes:
        for name in counts:
            if node.target is getattr(torch.ops.gdn_fx, name).default:
                counts[name] += 1
    if not counts["gated_linear_scan"]:
        del counts["gated_linear_scan"]
    return counts


def export_dynamic(step: DecodeStep, seq_len: int = 8, min_seq: int = 2,
                   max_seq: Optional[int] = None) -> torch.export.ExportedProgram:
    """``torch.export`` of the reified ``step`` with a dynamic number of new tokens.

    Traced at ``seq_len`` new tokens, valid for any count in ``[min_seq, max_seq]`` (min 2:
    transformers takes another branch at one token; export decode separately). Raises
    UnsupportedModel when the program does not hold exactly ``step.expected_fusions``.
    """
    if step.rule != "auto":
        raise UsageError("export_dynamic needs DecodeStep(model, rule='auto'): reified rules "
                         "already run every step as one scan")
    args = step.example_inputs(seq_len=seq_len)
    with reify(step.model):
        program = torch.export.export(step, args, strict=False,
                                      dynamic_shapes=step.dynamic_shapes(min_seq, max_seq))
    counts = fused_counts(program)
    if counts != step.expected_fusions:
        raise UnsupportedModel(f"reified export holds {counts} fused nodes, expected "
                               f"{step.expected_fusions}")
    return program


def export_nnef_dynamic(step: DecodeStep, path: Union[str, Path], seq_len: int = 8,
                        min_seq: int = 2, max_seq: Optional[int] = None,
                        options=None, **fields) -> Path:
    """Write ``step`` as NNEF whose sequence axis is the symbol ``S`` (see module doc).

    ``input_ids`` is ``[batch, S]``; states keep their shapes, attention caches grow by S.
    ``options`` / ``fields``: the export options, as in ``gdn_fx.export_nnef``. Verify the
    result at several lengths with :func:`check_dynamic`. Returns the path written.
    """
    from gdn_fx.export import export_nnef

    program = export_dynamic(step, seq_len, min_seq, max_seq)
    return export_nnef(program, path, dynamic_axes=SEQ_AXIS, input_names=step.input_names,
                       output_names=step.output_names, options=options, **fields)


def check_dynamic(step: DecodeStep, path: Union[str, Path],
                  lengths: Sequence[int] = (3, 8, 50)) -> dict:
    """{length: Comparison} of tract running ``path`` against ``step.eager`` (transformers'
    own functions, not reified) at each number of new tokens."""
    from gdn_fx import tract_check

    runnable = tract_check.load(path)
    found = {}
    for length in lengths:
        args = step.example_inputs(seq_len=length)
        found[length] = tract_check.compare(runnable, step.eager(*args), args)
    return found


# --- the files of an export: fingerprint, staging, properties, placement --------------------

GRAPH_FILE = "graph.nnef"
# torch-to-nnef writes the properties as a literal list in this fragment of graph.nnef.
# Values are one-line strings (one may hold "[GCC ...]"): the list ends at a line "  ];".
_PROPERTIES_END = re.compile(r"(properties = \[.*?)(\n\s*\];)", re.DOTALL)


def fingerprint(model: nn.Module, weights: str = "f32") -> str:
    """One sha256 over the model's config and every state_dict entry (name, shape, dtype and
    bytes) and the weight storage format: the same value for every graph of one export.

    Computed from memory while the export is written (the files are never read back); the
    config's bookkeeping fields (``_name_or_path``, ``transformers_version``...) are left
    out, so a checkpoint re-saved elsewhere or by another release keeps its fingerprint."""
    digest = hashlib.sha256()
    config = {k: v for k, v in model.config.to_dict().items()
              if not k.startswith("_") and k != "transformers_version"}
    record = {"config": config, "weights": weights}
    digest.update(json.dumps(record, sort_keys=True, default=str).encode())
    from gdn_fx.lowering.t2n.placeholders import resolve  # a streamed export's placeholders

    for name, tensor in model.state_dict().items():
        tensor = resolve(tensor).detach().cpu().contiguous()
        digest.update(f"\n{name} {tuple(tensor.shape)} {tensor.dtype}\n".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy())  # no copy
    return "sha256:" + digest.hexdigest()


def vocabulary_size(model: nn.Module) -> int:
    """How many token ids the model's input embedding has rows for."""
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") \
        else None
    if embeddings is not None and getattr(embeddings, "weight", None) is not None:
        return int(embeddings.weight.shape[0])
    return int(model.config.vocab_size)


@contextlib.contextmanager
def staging(path: Union[str, Path]) -> Iterator[Path]:
    """A fresh hidden folder beside ``path`` (same file system: moving out of it is a rename),
    removed on exit with whatever is left in it: an export interrupted by an error leaves
    nothing at ``path`` or beside it that looks finished."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".partial",
                                   dir=path.parent))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def stamp_properties(folder: Path, properties: Mapping[str, str]) -> None:
    """Add ``properties`` (tract string properties) to the graph.nnef of the NNEF folder
    ``folder``; tract keeps them in the loaded model (``model.property(key)``)."""
    graph = Path(folder) / GRAPH_FILE
    text = graph.read_text()
    entries = "".join(f',\n    ("{key}", "{_nnef_string(value)}")'
                      for key, value in properties.items())
    stamped, count = _PROPERTIES_END.subn(lambda m: m.group(1) + entries + m.group(2), text, 1)
    if count != 1:  # torch-to-nnef always writes the fragment: a change of its format
        from gdn_fx.errors import InternalError

        raise InternalError(f"no tract_core_properties list in {graph}")
    graph.write_text(stamped)


_LAST_ASSERT = re.compile(r"(extension tract_assert [^;]*;\n)(?!extension tract_assert)")


def declare_bound(folder: Path, symbol: str, most: int) -> None:
    """Declare ``symbol <= most`` to tract in the graph.nnef of the NNEF folder ``folder``,
    after its other assertions (tract does not check it at run time: it tells a reader, and
    the Generator, what the graph takes)."""
    graph = Path(folder) / GRAPH_FILE
    text = graph.read_text()
    line = f"extension tract_assert {symbol} <= {most};\n"
    declared, count = _LAST_ASSERT.subn(lambda m: m.group(1) + line, text, 1)
    if count != 1:  # write.py declares every symbol >= its minimum: a change of that
        from gdn_fx.errors import InternalError

        raise InternalError(f"no tract_assert line in {graph}")
    graph.write_text(declared)


def _nnef_string(value: str) -> str:
    """``value`` as the body of an NNEF string literal (one line, no double quote)."""
    return " ".join(str(value).split()).replace("\\", "/").replace('"', "'")


def place(folder: Path, final: Path) -> Path:
    """Move the NNEF folder ``folder`` (in a :func:`staging` folder) to ``final``: as it is for
    ``*.nnef``, else archived (``.nnef.tar``; ``.nnef.tgz``: gzip level 0, as torch-to-nnef
    writes it) with graph.nnef first, so that reading the graph text stops before the
    weights. The archive is built in the staging folder and renamed into place."""
    final = Path(final)
    if final.name.endswith(".nnef"):
        if final.is_dir():
            shutil.rmtree(final)
        os.replace(folder, final)
        return final
    archive = folder.with_name(folder.name + ".archive")
    gz = final.name.endswith(".tgz")
    files = sorted((p for p in folder.rglob("*") if p.is_file()),
                   key=lambda p: (p.name != GRAPH_FILE, p.relative_to(folder).as_posix()))
    with tarfile.open(archive, "w:gz" if gz else "w", **({"compresslevel": 0} if gz else {})
                      ) as tar:
        for file in files:
            tar.add(file, arcname=file.relative_to(folder).as_posix(), recursive=False)
    os.replace(archive, final)
    return final


# --- the files of a generation-ready export ----------------------------------------------

@dataclass(frozen=True)
class GeneratorFiles:
    """What :func:`export_generator` wrote: the graph for every S, and the S = 1 graph
    (None unless asked for with ``decode=True`` and kept)."""

    main: Path
    decode: Optional[Path]
    input_names: tuple
    output_names: tuple
    decode_note: str = ""  # why no decode graph was kept, when none was


def generator_options(options, fields: Mapping, cpu_only: str = ""):
    """The export options of a generation-ready export: P may be 0 (no past). ``cpu_only``
    names a route that lowers for the CPU runtime only (its ops are not checked on tract's
    CUDA runtime): another runtime is then a UsageError."""
    from gdn_fx.lowering.options import ExportOptions

    options = ExportOptions.of(options, **fields)
    if cpu_only and options.runtime != "cpu":
        raise UsageError(f"runtime={options.runtime!r}: {cpu_only} lowers for the CPU "
                         "runtime only")
    return ExportOptions.of(options, symbol_min={"P": 0, **options.symbol_min})


def write_graph(program, folder: Path, final: Path, axes: Mapping, names: Mapping,
                 options, say: Callable[[str], None]) -> Path:
    from gdn_fx.export import export_nnef

    say(f"write {final}")
    return export_nnef(program, folder, dynamic_axes=axes, options=options, **names)


def place_graphs(written: Sequence[Path], finals: Sequence[Path], model: nn.Module,
                 weights: str = "f32") -> None:
    """Stamp the NNEF folders ``written`` (a main graph, then its decode graph if kept) with
    the export's fingerprint (:func:`~gdn_fx.hf.nnef.fingerprint`), the vocabulary size and,
    in the main graph, the decode graph's file name; then move them to ``finals``: the decode
    graph first, the main graph last (a main graph in place means a complete pair). A decode
    graph of an earlier export at ``decode_path(finals[0])`` is removed when none is kept:
    it would not match the new main graph. A main graph whose candidates take at most W
    tokens a call (``gdn_fx_max_tokens``) also declares ``S <= W`` to tract."""
    common = {FINGERPRINT: fingerprint(model, weights), VOCAB: str(vocabulary_size(model))}
    decode = finals[1].name if len(finals) > 1 else ""
    stamp_properties(written[0], {**common, DECODE: decode})
    window = read_max_tokens(written[0])
    if window is not None:  # a windowed main graph: its bound on the token axis, for tract
        declare_bound(written[0], "S", window)
    for folder in written[1:]:
        stamp_properties(folder, common)
    for folder, final in reversed(list(zip(written, finals))):
        if folder is written[0] and not decode:
            remove(decode_path(final))
        place(folder, final)


def remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()
