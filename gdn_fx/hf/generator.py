"""Generation-ready NNEF: one artifact for prefill and decode at any length and any past.

    files = export_generator(tiny_model("qwen3_5"), "out/q.nnef.tgz")
    gen = Generator(files.main, files.decode)            # decode None: one graph, one State
    result = gen.generate(prompt_ids, max_new_tokens=64)  # greedy
    check = check_generation(model, result)               # against transformers' generate

The artifact's inputs are ``input_ids [B, S]`` (S >= 1), then every cached tensor in
DecodeStep's order: attention keys/values ``[B, Hkv, P, D]`` (P >= 0, the same P for all),
conv and recurrent states (fixed shapes); its outputs are the logits (last position unless
``all_logits``), then each new state in the order of the inputs it replaces. A first prefill
runs at P = 0 with zero states.

Why reify and symbolic S and P: a program traced at fixed lengths holds them as literals in
every reshape, mask and position outside the linear-attention layers. Reified, transformers'
rule and conv calls are the fused ops and nothing unrolls, so torch.export keeps S and P
symbolic; transformers' ``S == 1`` tests are decided for the multi-token branch, which carries
the given states (the state-carrying path at every S, also at S = 1).

Why one graph (issue 31): tract reads every weight into memory of its own, so a second graph
holds a second copy of the weights, in the file and after loading. Under a symbolic S the
lowering table gives the delta-rule scans ``split`` (lowering/gdn_split.py): the loop over
chunks for the whole chunks, then a loop of matmul steps for the tokens left, so S = 1 costs
one step (no chunk) and S = 512 eight chunk iterations (no step); the conv updates get
``portable`` (K multiply-adds, the decode choice too). The main graph serves decode.

``decode=True`` still writes the pair of earlier releases: ``X.decode.nnef.tgz`` beside
``X.nnef.tgz``, the same program at S = 1 (P symbolic) lowered with the decode candidates
(``matmul_step``, ``portable``), same inputs and outputs, kept when it computes what the main
graph would (:func:`decode_problem`). Before ``split`` it was needed for speed: no candidate
serving every S was within 1.25x of the best at both S = 1 and S = 512 (``chunked`` 5.8x the
best at S = 1, ``matmul`` 3.8x at S = 512, on a Qwen3.5-sized layer). Under CUDA it is the
faster prefill: the pair's main graph never runs decode (``serves_decode=False``), so its scans
take ``chunked_window`` (the batched chunks of a 512-token window, on the GPU) where the one
graph steps the native kernel token by token; the main graph then declares 512 tokens a call
(``gdn_fx_max_tokens``), which the Generator cuts prompts to (docs/lowering.md, "Generation on
the GPU").
"""

from __future__ import annotations

import copy
import numbers
import re
import shutil
import sys
import tarfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Optional, Sequence, Union

import numpy as np
import torch
from torch import nn
from torch.export import Dim

from gdn_fx.errors import (ArtifactError, ArtifactMismatch, InputUnsupported, MissingFile,
                           UnsupportedModel, UsageError)
from gdn_fx.hf.attention import grouped_attention
from gdn_fx.hf.decode import DecodeStep
from gdn_fx.hf.dropins import reify
from gdn_fx.hf.nnef import (DECODE, FINGERPRINT, VOCAB, declare_bound, fingerprint,
                            fused_counts, place, prepare_for_nnef, stamp_properties, staging,
                            vocabulary_size)
from gdn_fx.lowering.target import MAX_TOKENS

EXAMPLE_SEQ, EXAMPLE_PAST = 3, 4  # >= 2: torch.export specializes dims whose example is 0 or 1
# tract against eager, per output, for an f16 model (f32 models: 1e-4): four f16 ulps of the
# output's largest value (seen: 1.1e-3 on a recurrent state of the tiny qwen3_5 in f16).
F16_BOUND = 4e-3
# Logits of a whole generation against transformers: f16 models accumulate f16 rounding over
# the steps (tract and torch round differently), so their bound is wider.
LOGITS_BOUND = {torch.float32: 1e-4, torch.float16: 1e-2}
# GeneratorFiles.decode_note of a one-graph export (the default).
NOT_ASKED = "not asked for: one graph serves every S"


def model_dtype(model: nn.Module) -> torch.dtype:
    """The dtype of the model's floating-point weights (its first parameter's)."""
    return next(model.parameters()).dtype


@dataclass(frozen=True)
class GeneratorFiles:
    """What :func:`export_generator` wrote: the graph for every S, and the S = 1 graph
    (None unless asked for with ``decode=True`` and kept)."""

    main: Path
    decode: Optional[Path]
    input_names: tuple
    output_names: tuple
    decode_note: str = ""  # why no decode graph was kept, when none was


def decode_path(path: Union[str, Path]) -> Path:
    """``X.decode.nnef.tgz`` for ``X.nnef.tgz`` (the same rule for .nnef.tar and .nnef)."""
    path = Path(path)
    for suffix in (".nnef.tgz", ".nnef.tar", ".nnef"):
        if path.name.endswith(suffix):
            return path.with_name(path.name[: -len(suffix)] + ".decode" + suffix)
    raise UsageError(f"NNEF path {path} must end with .nnef.tgz, .nnef.tar or .nnef")


def export_program(step: DecodeStep) -> torch.export.ExportedProgram:
    """The reified step exported with symbolic S (>= 1) and P (>= 0), its attention computed
    on the key/value heads (:func:`gdn_fx.hf.attention.grouped_attention`)."""
    args = step.example_inputs(seq_len=EXAMPLE_SEQ, past_len=EXAMPLE_PAST)
    try:
        with reify(step.model), grouped_attention():
            program = torch.export.export(step, args, strict=False,
                                          dynamic_shapes=step.generator_shapes())
    except torch._dynamo.exc.UserError as error:  # the model bounds S or P (sliding windows)
        bounds = [line.strip("- ").strip() for line in str(error).splitlines()
                  if line.strip().startswith("- Not all values")]
        more = f" (and {len(bounds) - 1} more guards)" if len(bounds) > 1 else ""
        raise UnsupportedModel("the model does not compute for every S >= 1 and P >= 0: "
                               + (bounds or str(error).splitlines())[0] + more) from None
    counts = fused_counts(program)
    if counts != step.expected_fusions:
        raise UnsupportedModel(f"the reified export holds {counts} fused nodes, expected "
                               f"{step.expected_fusions}")
    return program


def decode_program(program: torch.export.ExportedProgram,
                   step: DecodeStep) -> torch.export.ExportedProgram:
    """``program`` re-traced at S = 1, P still symbolic.

    The program, not the model, is re-traced: transformers' ``S == 1`` branches were decided
    for the multi-token path when it was exported, so the decode graph computes exactly what
    the main graph computes at S = 1; only its sizes become static, which lets the lowering
    table take its decode candidates for the fused nodes.
    """
    module = program.module()
    for name in ("train", "eval"):  # ep.module()'s overrides refuse to be traced
        module.__dict__.pop(name, None)
    args = step.example_inputs(seq_len=1, past_len=EXAMPLE_PAST)
    # Dim.DYNAMIC, not a named Dim: at a static S GQA's repeat_kv adds a guard
    # (min(a*P + a, 2a*P + 2a) == a*P + a) that holds for every P but a named Dim refuses.
    past = Dim.DYNAMIC(min=0)
    shapes = (None, *({s.past_axis: past} if s.past_axis is not None else None
                      for s in step.specs))
    return torch.export.export(module, args, strict=False, dynamic_shapes=shapes)


def export_generator(model: nn.Module, path: Union[str, Path], *, decode: bool = False,
                     all_logits: bool = False,
                     say: Callable[[str], None] = lambda line: None,
                     batch: Optional[int] = None, options=None, **fields) -> GeneratorFiles:
    """Write ``model`` (a transformers hybrid causal LM) as a generation-ready NNEF.

    ``options`` / ``fields``: the export options (``gdn_fx.lowering.options.ExportOptions``:
    weights, choose, tract_version, runtime), as in ``gdn_fx.export_nnef``. ``runtime`` is the
    tract runtime the graphs are lowered for: "cpu" (the default) or "cuda" (the lowering
    table's CUDA order and device checks; the NNEF records it, ``tract_check.read_runtime``).
    Run a "cuda" export with ``Generator(..., runtime="cuda")``; the file computes the same on
    either runtime. A batched export lowers for the CPU only.

    ``batch=B`` writes the batched graph instead (``gdn_fx.hf.batch``: B sequences of their
    own pasts per call, run by ``BatchGenerator``; one graph, no decode graph); the default
    None writes the one-sequence graph described here.

    ``path`` serves every S (prefill, and decode too: one copy of the weights); with
    ``decode=True`` an S = 1 graph is also written beside it as ``decode_path(path)``, the
    pair of earlier releases (see the module doc). The
    model is prepared for NNEF in place (``prepare_for_nnef``). ``weights`` ("f32", "f16",
    "q4_0") is how both graphs store the weights, as in ``gdn_fx.export_nnef``; with
    compressed weights the decode graph is kept when it computes what the main graph computes
    (both in tract), since neither matches the f32 model to 1e-4. Raises UnsupportedModel
    when a layer is not reified, ExportRefused (from export_nnef) for what cannot follow S
    and P, UsageError for an unknown ``weights``.

    Both graphs are written and checked in a hidden folder beside ``path`` and moved into
    place at the end (:func:`place_graphs`), so an error leaves nothing at ``path``; each
    carries the tract property ``gdn_fx_fingerprint`` (config, weights and their storage),
    which :class:`Generator` compares before it runs a pair.
    """
    options = generator_options(options, fields)
    if batch is not None:
        from gdn_fx.hf.batch import export_batched

        if decode:
            raise UsageError("a batched export (batch=B) is one graph: decode=True does not "
                             "apply to it")
        return export_batched(model, path, batch, all_logits=all_logits, say=say,
                              options=options)
    weights = options.weights
    path = Path(path)
    step = DecodeStep(prepare_for_nnef(model), last_logits=not all_logits, whole_windows=True)
    past = {s.name: {s.past_axis: "P"} for s in step.specs if s.past_axis is not None}
    say(f"export the reified step (symbolic S and P) -> {path}")
    program = export_program(step)
    finals = [path, decode_path(path)]
    # a pair's main graph never runs decode's one-token calls (lowering/target.py)
    main_options = options.of(options, serves_decode=not decode)
    jobs = [(program, {"input_ids": {1: "S"}, **past}, main_options)]
    if decode:
        jobs.append((decode_program(program, step), past, options))
    names = dict(input_names=step.input_names, output_names=step.output_names)
    with staging(path) as folder:  # nothing at path until both graphs are written and checked
        written = [_write_graph(exported, folder / f"graph{i}.nnef", finals[i], axes, names,
                                graph_options, say)
                   for i, (exported, axes, graph_options) in enumerate(jobs)]
        note = decode_problem(written[1], written[0], step, weights) if decode \
            else NOT_ASKED
        if note and decode:
            say(f"decode graph dropped: {note}; the main graph serves decode")
        kept = finals[:1] if note else finals
        place_graphs(written[:len(kept)], kept, model, weights)
    return GeneratorFiles(path, None if note else finals[1], tuple(step.input_names),
                          tuple(step.output_names), note)


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


def _write_graph(program, folder: Path, final: Path, axes: Mapping, names: Mapping,
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
    from gdn_fx import tract_check

    common = {FINGERPRINT: fingerprint(model, weights), VOCAB: str(vocabulary_size(model))}
    decode = finals[1].name if len(finals) > 1 else ""
    stamp_properties(written[0], {**common, DECODE: decode})
    window = tract_check.read_max_tokens(written[0])
    if window is not None:  # a windowed main graph: its bound on the token axis, for tract
        declare_bound(written[0], "S", window)
    for folder in written[1:]:
        stamp_properties(folder, common)
    for folder, final in reversed(list(zip(written, finals))):
        if folder is written[0] and not decode:
            _remove(decode_path(final))
        place(folder, final)


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def decode_problem(path: Path, main: Path, step: DecodeStep, weights: str = "f32") -> str:
    """Why tract cannot serve decode from the S = 1 graph ``path`` in place of the ``main``
    graph ('' when it can): it is run at P = 0 and 5 and checked against ``_reference``.

    The S = 1 graph is a second trace with other static sizes, which meets other tract
    optimizer paths (seen: an axes assertion in kimi_linear's MoE router); it is kept only
    when tract loads it and it computes what the model does."""
    from gdn_fx import tract_check

    try:
        runnable = tract_check.load(path)
        reference = _reference(step, main, weights)
        for past in (0, 5):
            args = step.example_inputs(seq_len=1, past_len=past)
            want, bound = reference(args)
            found = tract_check.compare(runnable, want, args, tolerance=bound)
            bad = found.failures()
            if bad:
                return (f"at P = {past} it differs from eager in {len(bad)} of "
                        f"{len(found.errors)} outputs: {', '.join(bad)}")[:600]
    except Exception as error:  # noqa: BLE001 (tract's errors: any failure drops the graph)
        return f"tract fails on it: {tract_check.error_text(error, 600)}"
    return ""


def _reference(step: DecodeStep, main: Path, weights: str) -> Callable:
    """``args -> (want, bounds)`` that the decode graph is checked against, per model kind:
    - compressed weights: the main graph's outputs in tract (neither matches the f32 model to
      1e-4; the decode graph must compute what the graph it replaces computes);
    - an f16 model: ``f16_reference``;
    - otherwise: eager, at the dtype's own tolerance."""
    from gdn_fx import tract_check

    if weights != "f32":
        graph = tract_check.load(main)
        return lambda args: ([torch.from_numpy(x) for x in tract_check.run(graph, args)], None)
    if model_dtype(step.model) == torch.float16:
        graph, twin = tract_check.load(main), f32_twin(step)
        return lambda args: f16_reference(graph, twin, args)
    return lambda args: (step.eager(*args), None)


def f32_twin(step: DecodeStep) -> DecodeStep:
    """``step`` over a copy of its model with the same weights in f32."""
    model = step.model
    twin = type(model)(model.config).to(torch.float32).eval()
    twin.load_state_dict({name: value.float() if value.is_floating_point() else value
                          for name, value in model.state_dict().items()})
    return DecodeStep(prepare_for_nnef(twin), step.rule, step.last_logits, step.whole_windows)


def f16_reference(main, twin: DecodeStep, args: Sequence[torch.Tensor]
                  ) -> tuple[list[torch.Tensor], list[float]]:
    """What the decode graph of an f16 model is checked against: the outputs of ``twin``
    (the same weights computed in f32) in each output's dtype, and per output a bound of
    twice the ``main`` graph's own error against them, at least F16_BOUND and at most the
    f16 logits bound of a whole generation (a main graph gone wrong widens nothing past it).
    The decode graph replaces the main graph at S = 1: it must be as accurate as that graph.

    A fixed bound does not scale: f16 rounding grows with depth. At the 0.8B shape (24
    layers), torch's own f16 eager is up to 5e-3 from the f32 twin, the main graph in tract
    up to 6e-3, and against eager at 4e-3 the decode graph was dropped though no less
    accurate. Mistakes of the lowering itself are what an f32 model's check at 1e-4 finds:
    f16 and f32 models take the same lowering code."""
    from gdn_fx import tract_check

    exact = twin.eager(*(a.float() if a.is_floating_point() else a for a in args))
    served = tract_check.run(main, args)
    want = [e.to(torch.from_numpy(s).dtype) for e, s in zip(exact, served)]
    bounds = [min(LOGITS_BOUND[torch.float16],
                  max(F16_BOUND, 2 * tract_check.relative_error(s, e)))
              for s, e in zip(served, exact)]
    return want, bounds


def with_stored_weights(model: nn.Module, path: Union[str, Path],
                        in_place: bool = False) -> nn.Module:
    """A copy of ``model`` (``model`` itself with ``in_place``: no second copy of a large
    model) holding the weights as the export at ``path`` stores them (f16 rounded, Q4_0
    dequantized; ``tract_check.iter_stored_parameters``, read one at a time): the model tract
    runs, to check a compressed export against transformers. A product's own Q4_0 copy of a
    table the embedding also reads (label ``<name>_q4_0``) unties it in the copy."""
    from gdn_fx import tract_check

    twin = model if in_place else copy.deepcopy(model)
    prefix = "model."  # DecodeStep holds the model as its attribute ``model``
    shared = {}  # name -> the tied parameter a product's own copy replaced under that name
    with torch.no_grad(), warnings.catch_warnings():
        # f32 values are read-only views of the file's bytes: only read (copied) here
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        for label, values in tract_check.iter_stored_parameters(path):
            name = label[len(prefix):] if label.startswith(prefix) else label
            if name.endswith("_q4_0"):  # set at once: memory holds it once, as the model will
                name = name[: -len("_q4_0")]
                shared[name] = twin.get_parameter(name)
                owner, _, field = name.rpartition(".")
                setattr(twin.get_submodule(owner), field, nn.Parameter(
                    torch.from_numpy(values).to(model_dtype(model)), requires_grad=False))
                continue
            try:  # the table under a name whose product took its own copy: the shared one
                param = shared[name] if name in shared else twin.get_parameter(name)
            except AttributeError:  # a constant of the graph, not a parameter
                continue
            if tuple(param.shape) != values.shape:
                continue
            if param.numel() > 1 and not any(param.stride()):  # a placeholder (hf/stream.py)
                replace_parameter(twin, param, nn.Parameter(
                    torch.from_numpy(values).to(param.dtype), requires_grad=False))
            else:
                param.copy_(torch.from_numpy(values))
            del values  # one stored weight in memory at a time
    return twin


def replace_parameter(model: nn.Module, old: nn.Parameter, new: nn.Parameter) -> None:
    """``new`` wherever ``model`` holds ``old`` (every module of a tied table)."""
    for module in model.modules():
        for key, param in module._parameters.items():
            if param is old:
                module._parameters[key] = new


# --- running it in tract ------------------------------------------------------------------

@dataclass
class GenerationResult:
    """Greedy tokens and per-step last-position logits, with the time each phase took."""

    prompt: list
    tokens: list = field(default_factory=list)
    logits: list = field(default_factory=list)  # one [vocab] array per generated token
    prefill_s: float = 0.0
    decode_s: float = 0.0

    def rates(self) -> str:
        prefill = len(self.prompt) / self.prefill_s if self.prefill_s else float("nan")
        steps = len(self.tokens) - 1
        decode = steps / self.decode_s if self.decode_s and steps else float("nan")
        return (f"prefill {len(self.prompt)} tokens in {self.prefill_s * 1e3:.1f} ms "
                f"({prefill:.1f} tokens/s); decode {steps} tokens in "
                f"{self.decode_s * 1e3:.1f} ms ({decode:.1f} tokens/s)")


class UnverifiedPair(UserWarning):
    """A main / decode pair without fingerprints (exported before gdn-fx stamped its graphs,
    or written by hand with ``export_nnef``): their shapes are
    checked, whether they hold the same weights cannot be. Warned, not refused: such pairs
    were checked against each other when they were written (``decode_problem``)."""


@dataclass(frozen=True)
class LoadedGraph:
    """One NNEF graph as tract loaded it, with what the Generator checks before each call:
    its declared inputs (name, dims, datum type), the bounds it asserts on its symbols
    (``extension tract_assert S >= 1``) and gdn-fx's tract properties."""

    path: Path
    runnable: object
    text: str  # graph.nnef
    inputs: tuple  # ((name, (dim, ...), datum), ...): dims are ints or symbol expressions
    bounds: tuple  # ((symbol, operator, value), ...)
    properties: dict  # gdn_fx_* properties: fingerprint, vocab, decode
    logits_width: int  # the last axis of the first output (the vocabulary, for old exports)
    input_names: tuple = ()  # every input as tract names them (also those not declared above)

    @property
    def fingerprint(self) -> Optional[str]:
        return self.properties.get(FINGERPRINT)

    @property
    def max_tokens(self) -> Optional[int]:
        """The most tokens one call may take (a windowed candidate's), None: no bound."""
        window = self.properties.get(MAX_TOKENS, "")
        return int(window) if window.isdigit() else None

    def describe(self, index: int) -> str:
        name, dims, datum = self.inputs[index]
        return f"{name} [{', '.join(map(str, dims))}] {datum}"


_ASSERT = re.compile(r"extension tract_assert (\w+) *(>=|<=|>|<|==) *(-?\d+);")
_COMPARE = {">=": lambda a, b: a >= b, "<=": lambda a, b: a <= b, ">": lambda a, b: a > b,
            "<": lambda a, b: a < b, "==": lambda a, b: a == b}


# tract-transformers' model transform that folds each `cat(past, new)` read by a graph output
# (an attention cache) into a stateful DynKeyValueCache op: the State keeps that cache (on the
# GPU under tract's CUDA runtime) and the graph loses those inputs and outputs.
KV_IN_STATE = "detect_kv_cache"


def load_graph(path: Union[str, Path], runtime: str = "cpu",
               kv_in_state: bool = False) -> LoadedGraph:
    """Load ``path`` in tract for ``runtime`` ("cpu", or "cuda": prepared by tract's CUDA
    runtime) and read its declarations; one-line errors (MissingFile, ArtifactError) for a
    file that is not there or that tract cannot load (truncated, not NNEF): tract's own
    reason, first lines only; RuntimeUnavailable, with tract's reason, where tract has no
    such runtime. ``kv_in_state``: the attention caches are folded into the State
    (``KV_IN_STATE``); the graph's ``inputs`` are then the ones left."""
    import tract

    from gdn_fx import tract_check

    path = Path(path)
    if not path.exists():
        raise MissingFile(f"NNEF {path} does not exist")
    try:
        names: list = []
        runnable = tract_check.load(path, runtime, (KV_IN_STATE,) if kv_in_state else (),
                                    names)
        text = tract_check.nnef_text(path)
    except (tract.TractError, OSError, EOFError, tarfile.TarError, UnicodeDecodeError) as error:
        raise ArtifactError(f"tract cannot load {path}: {_first_lines(error)}") from None
    inputs = tuple((name, tuple(_dim(d) for d in dims.split(",")), datum)
                   for name, dims, datum in EXTERNAL.findall(text) if name in names)
    bounds = tuple((sym, op, int(value)) for sym, op, value in _ASSERT.findall(text))
    properties = {key: value for key, value in _PROPERTY.findall(text)}
    logits = str(runnable.output_fact(0)).split(",")
    width = int(logits[-2]) if len(logits) >= 2 and logits[-2].isdigit() else 0
    return LoadedGraph(path, runnable, text, inputs, bounds, properties, width, tuple(names))


_PROPERTY = re.compile(r'\(\s*"(gdn_fx_\w+)"\s*,\s*"([^"]*)"\s*\)')


def _dim(text: str) -> Union[int, str]:
    text = text.strip()
    return int(text) if text.lstrip("-").isdigit() else text


def _first_lines(error: BaseException) -> str:
    """An error's text without tract's stack backtrace, on one line: its whole chain of
    causes, the root cause kept when it is long (``tract_check.error_text``)."""
    from gdn_fx import tract_check

    return tract_check.error_text(error)


# DecodeStep's attention caches (gdn_fx.hf.states.KINDS: key, value, indexer_key), whose
# past axis is P in a generation-ready export and a number in a one-step export.
PAST_INPUT = re.compile(r"(key|value|indexer_key)_\d+")
WRITES_ONE = "`gdn-fx export` without --seq-len writes one"


def generation_problem(graph: LoadedGraph) -> str:
    """Why ``graph`` is not the main graph of a generation-ready export ('' when it is): it
    must take ``input_ids [B, S]`` (i64, S symbolic) first, then its caches, attention caches
    over a symbolic past, and give the logits and one new state per cache. A one-step
    export (--seq-len N, --dynamic-seq), an export's decode graph alone or an NNEF of
    another program would run wrong or fail inside tract (a Rust backtrace)."""
    if not graph.inputs:  # none declared as gdn-fx declares its inputs (tract_core_external)
        if not graph.input_names:
            return "it takes no inputs"
        return (f"its first input is {graph.input_names[0]} "
                f"({graph.runnable.input_fact(0)}), where a generation-ready export takes "
                "input_ids [B, S] i64, then its caches (an NNEF of another program)")
    name, dims, datum = graph.inputs[0]
    if name != "input_ids" or len(dims) != 2 or datum != "i64":
        return (f"its first input is {graph.describe(0)}, where a generation-ready export "
                "takes input_ids [B, S] i64, then its caches (an NNEF of another program)")
    tokens = dims[1]
    if isinstance(tokens, int):
        if graph.fingerprint and DECODE not in graph.properties:
            return (f"it is the decode graph of an export (input_ids [{dims[0]}, {tokens}]): "
                    "give the main graph it was written beside")
        return (f"it takes {tokens} token(s) per call after a past of fixed length "
                f"(input_ids [{dims[0]}, {tokens}]): a one-step export (gdn-fx export "
                f"--seq-len {tokens})")
    fixed = [index for index, (name, dims, _) in enumerate(graph.inputs)
             if PAST_INPUT.fullmatch(name) and all(isinstance(d, int) for d in dims)]
    if fixed:
        return (f"its caches hold a past of fixed length ({graph.describe(fixed[0])}): a "
                "one-step export with a symbolic sequence (gdn-fx export --seq-len N "
                "--dynamic-seq)")
    try:
        outputs = graph.runnable.output_count()
    except Exception:  # noqa: BLE001 (a runtime's runnable without the count: not checked)
        return ""
    if outputs != len(graph.inputs):
        return (f"it gives {outputs} outputs for {len(graph.inputs)} inputs, where a "
                "generation-ready export gives the logits and one new state per cache")
    return ""


def check_pair(main: LoadedGraph, decode: LoadedGraph) -> None:
    """Refuse (ArtifactMismatch, one line) a decode graph that is not the main graph's: other
    fingerprints (other weights, config or weight storage), or other declared inputs than
    the main graph's at S = 1 (a model of other shapes: tract would fail mid-run, "Clashing
    resolution for expression"). A pair where neither graph has a fingerprint (exports
    before fingerprints) is let through with an UnverifiedPair warning: its shapes are
    checked, its weights cannot be."""
    if main.fingerprint != decode.fingerprint:
        if main.fingerprint and decode.fingerprint:
            raise ArtifactMismatch(
                f"the decode graph {decode.path} is not from the export of {main.path}: "
                f"fingerprints {decode.fingerprint[:19]}... and {main.fingerprint[:19]}... "
                "differ (other weights or config); re-export both, or let the main graph "
                "serve decode (gdn-fx generate --no-decode)")
        has, lacks = (main, decode) if main.fingerprint else (decode, main)
        raise ArtifactMismatch(f"{has.path} carries a fingerprint and {lacks.path} none: "
                               "not the two graphs of one export; re-export both")
    if len(decode.inputs) and len(decode.inputs[0][1]) == 2 and \
            not isinstance(decode.inputs[0][1][1], int):
        same = Path(decode.path).resolve() == Path(main.path).resolve()
        what = ("the main graph itself" if same else
                f"a main graph (it takes {decode.describe(0)}), not an S = 1 decode graph")
        raise ArtifactMismatch(f"the decode graph {decode.path} is {what}: leave it out "
                               "(Generator(main); one graph serves prefill and decode)")
    _check_same_inputs(main, decode)
    if main.fingerprint is None:
        warnings.warn(f"{main.path} and {decode.path} carry no fingerprint (written before "
                      "gdn-fx stamped its graphs, or not by export_generator / "
                      "export_generalized): their shapes match, whether they hold the same "
                      "weights cannot be checked", UnverifiedPair, stacklevel=3)


def _check_same_inputs(main: LoadedGraph, decode: LoadedGraph) -> None:
    """The decode graph must declare the main graph's inputs, ``input_ids`` at S = 1."""
    if len(main.inputs) != len(decode.inputs) or not main.inputs:
        raise ArtifactMismatch(f"the decode graph {decode.path} has {len(decode.inputs)} "
                               f"inputs, the main graph {main.path} {len(main.inputs)}: "
                               "graphs of other models")
    for index, (want, got) in enumerate(zip(main.inputs, decode.inputs)):
        if index == 0:  # input_ids [B, S] against [B, 1]
            want = (want[0], want[1][:-1] + (1,), want[2])
        if want != got:
            name, dims, datum = want
            expected = f"{name} [{', '.join(map(str, dims))}] {datum}"
            raise ArtifactMismatch(
                f"the decode graph {decode.path} declares {decode.describe(index)}, where "
                f"the main graph {main.path} needs {expected}: graphs of other shapes; "
                "re-export both")
    if main.logits_width != decode.logits_width:
        raise ArtifactMismatch(f"the decode graph {decode.path} gives {decode.logits_width} "
                               f"logits, the main graph {main.path} {main.logits_width}")


def prompt_list(prompt_ids, serves: str = "") -> list:
    """``prompt_ids`` (token ids: a list, array or tensor; ``[[...]]`` for a batch of one) as
    a list of ints. UsageError for anything but a non-empty list of ints; InputUnsupported
    for several prompts (a one-sequence artifact serves one; ``serves`` names it in the
    message, e.g. " for x.nnef.tgz, a one-sequence export")."""
    if isinstance(prompt_ids, (torch.Tensor, np.ndarray)):
        prompt_ids = prompt_ids.tolist()
    if isinstance(prompt_ids, (str, bytes, Mapping)) or not hasattr(prompt_ids, "__iter__"):
        raise UsageError(f"prompt_ids must be a list of token ids, got "
                         f"{type(prompt_ids).__name__}")
    items = list(prompt_ids)
    if items and all(isinstance(x, (list, tuple)) for x in items):
        if len(items) > 1:
            raise InputUnsupported(f"batching is not supported yet: got {len(items)} prompts"
                                   f"{serves or ' for a one-sequence export'}, which serves "
                                   "one sequence per call: call "
                                   "generate once per prompt, or export with `gdn-fx export "
                                   "--batch N` (export_generator(..., batch=N)), whose "
                                   "BatchGenerator serves N sequences per call")
        items = list(items[0])
    for index, item in enumerate(items):
        if isinstance(item, bool) or not isinstance(item, numbers.Integral):
            raise UsageError(f"prompt_ids[{index}] is {item!r}, not a token id (an int)")
    if not items:
        raise UsageError("prompt_ids is empty: give at least one token id")
    return items


class Generator:
    """Greedy decoding in tract over a generator artifact (and its decode graph, if given).

    ``runtime`` is the tract runtime that runs the graphs: "cpu", or "cuda" (prepared with
    ``tract.runtime_for_name("cuda")``; RuntimeUnavailable, with tract's reason, where there
    is none); either runs any export, best the one lowered for it (``export_generator(...,
    runtime=)``); on "cuda" the default prompt chunk is the whole prompt (the L2 rule is a CPU
    matmul's, and every GPU call pays a fixed cost). ``kv_in_state=True`` (one graph only)
    folds the attention caches into the tract State (``KV_IN_STATE``): they stay there, on the
    GPU under CUDA, instead of travelling in and out on every call; the caches passed and
    returned are then the other states (conv, recurrent), and a call on numpy caches (a new
    sequence: the zero states) starts a fresh State.

    One tract State per graph is spawned once and kept across calls, as an application runs
    it; the cache travels as explicit tensors from one call's outputs to the next's inputs.
    A prompt longer than ``prefill_chunk`` tokens is fed in calls of that many (the artifact
    serves every S and P, so this computes the same): by default the longest chunk that keeps
    every projection's activations within the L2 cache (:func:`prefill_chunk`); ``None`` feeds
    the whole prompt in one call. A main graph that takes at most W tokens a call
    (``gdn_fx_max_tokens``: the CUDA pair's ``chunked_window``) caps the chunk at W.

    Nothing reaches tract unchecked: a decode graph not from the main graph's export is
    refused (:func:`check_pair`), and every call's token ids must lie in ``[0, vocab)`` (an id
    outside makes tract's gather panic and abort the process), with the batch and lengths the
    graphs declare; each refusal is one GdnFxError line.
    """

    def __init__(self, main: Union[str, Path], decode: Optional[Union[str, Path]] = None,
                 prefill_chunk: Union[int, str, None] = "auto", runtime: str = "cpu",
                 kv_in_state: bool = False):
        from gdn_fx.lowering.target import check_runtime

        self.runtime = check_runtime(runtime)
        if kv_in_state and decode:
            raise UsageError("kv_in_state keeps the attention caches in one tract State: it "
                             "takes one graph, not a main / decode pair")
        self.main_graph = load_graph(main, runtime, kv_in_state)
        if self.main_graph.properties.get("gdn_fx_batch"):  # gdn_fx.hf.batch.BATCH
            raise ArtifactError(f"{main} is a batched artifact (B = "
                                f"{self.main_graph.properties['gdn_fx_batch']}): run it with "
                                "gdn_fx.hf.batch.BatchGenerator")
        problem = generation_problem(self.main_graph)
        if problem:
            raise ArtifactError(f"{main} is not a generation-ready export: {problem}; "
                                f"{WRITES_ONE}")
        self.decode_graph = load_graph(decode, runtime) if decode else self.main_graph
        if decode:
            check_pair(self.main_graph, self.decode_graph)
        self.main = self.main_graph.runnable.spawn_state()
        self.decode = self.decode_graph.runnable.spawn_state() if decode else self.main
        text = self.main_graph.text
        kept = {name for name, _, _ in self.main_graph.inputs}
        self.zero_states = [zero for (name, _, _), zero in
                            zip(EXTERNAL.findall(text)[1:], _zero_states(text)) if name in kept]
        # caches the State holds (folded attention caches): a call on numpy caches starts a
        # new sequence, so it needs a State holding none
        self.kv_in_state = len(kept) < len(EXTERNAL.findall(text))
        vocab = self.main_graph.properties.get(VOCAB, "")
        self.vocab = int(vocab) if vocab.isdigit() else self.main_graph.logits_width
        if prefill_chunk == "auto":  # the lowering knows its scans' step (lowering/prefill.py)
            from gdn_fx.lowering.prefill import auto_prefill_chunk

            prefill_chunk = auto_prefill_chunk(text) if runtime == "cpu" else None
        if prefill_chunk is not None and (isinstance(prefill_chunk, bool) or not isinstance(
                prefill_chunk, numbers.Integral) or prefill_chunk < 1):
            raise UsageError(f"prefill_chunk must be an int >= 1 (or None), got "
                             f"{prefill_chunk!r}")
        window = self.main_graph.max_tokens  # a windowed main graph: calls of at most that
        if window is not None:
            prefill_chunk = min(prefill_chunk or window, window)
        self.prefill_chunk = prefill_chunk

    @classmethod
    def open(cls, main: Union[str, Path], use_decode: bool = True,
             prefill_chunk: Union[int, str, None] = "auto",
             runtime: str = "cpu", kv_in_state: bool = False) -> "Generator":
        """The export at ``main`` with the decode graph written beside it
        (``decode_path(main)``), as ``gdn-fx generate`` runs it. ArtifactError when the
        export had a decode graph (its main graph says so) that is not there; with
        ``use_decode=False`` the main graph serves decode."""
        decode = decode_path(main)
        if use_decode and decode.exists():
            return cls(main, decode, prefill_chunk, runtime, kv_in_state)
        generator = cls(main, None, prefill_chunk, runtime, kv_in_state)
        declared = generator.main_graph.properties.get(DECODE)
        if use_decode and declared:
            raise ArtifactError(f"{main} was exported with a decode graph (written as "
                                f"{declared}) and {decode} is missing: put it there, "
                                "re-export, or let the main graph serve decode (gdn-fx "
                                "generate --no-decode, Generator(main))")
        return generator

    def fork(self) -> "Generator":
        """A Generator over the same loaded graphs with tract States of its own: one per
        thread (a State is the scratch memory a call writes; the loaded model, tract's
        Runnable, is shared read-only, so a fork costs no second copy of the weights). tract's
        package calls its C library through ctypes, which releases the GIL for each call:
        forks in several threads run on several cores (gdn_fx.parallel)."""
        twin = copy.copy(self)
        twin.main = self.main_graph.runnable.spawn_state()
        twin.decode = twin.main if self.decode is self.main else \
            self.decode_graph.runnable.spawn_state()
        return twin

    def _graph_of(self, state) -> LoadedGraph:
        return self.decode_graph if state is self.decode else self.main_graph

    def check_ids(self, ids: np.ndarray, graph: Optional[LoadedGraph] = None,
                  prompt: bool = False) -> np.ndarray:
        """``ids`` as the int64 ``[B, S]`` that ``graph`` (default: the main graph) takes,
        else a one-line error: InputUnsupported for a batch other than the declared one,
        UsageError for another S, an S outside the asserted bounds, or an id outside
        ``[0, vocab)``. ``prompt``: ``ids`` is a whole prompt, fed in calls of at most
        ``prefill_chunk`` tokens: the longest call is checked against the bounds."""
        graph = graph or self.main_graph
        ids = np.asarray(ids)
        if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer):
            raise UsageError(f"token ids must be an integer array [batch, tokens], got "
                             f"{ids.dtype} of shape {list(ids.shape)}")
        batch, length = graph.inputs[0][1] if len(graph.inputs[0][1]) == 2 else (None, None)
        if isinstance(batch, int) and ids.shape[0] != batch:
            raise InputUnsupported(f"batching is not supported yet: {graph.path} is a "
                                   f"one-sequence export ({batch} sequence per call), got "
                                   f"{ids.shape[0]}; `gdn-fx export --batch N` writes one "
                                   "that serves N (gdn_fx.hf.batch.BatchGenerator)")
        if isinstance(length, int) and ids.shape[1] != length:
            raise UsageError(f"{graph.path} takes {length} token(s) per call, got "
                             f"{ids.shape[1]}")
        if isinstance(length, str):
            longest = min(ids.shape[1], self.prefill_chunk or ids.shape[1]) if prompt \
                else ids.shape[1]
            self.check_lengths({length: longest}, graph)
        bad = np.flatnonzero((ids < 0) | (ids >= self.vocab))
        if bad.size:
            value = ids.reshape(-1)[bad[0]]
            raise UsageError(f"token id {value} (position {bad[0]}) is outside the "
                             f"vocabulary [0, {self.vocab}) of {graph.path}")
        return ids.astype(np.int64, copy=False)

    def check_lengths(self, values: Mapping[str, int],
                      graph: Optional[LoadedGraph] = None) -> None:
        """UsageError unless every bound ``graph`` (default: the main graph) asserts on these
        symbols holds (e.g. ``{"S": 5, "P": 12}`` against ``S >= 1``, ``P >= 0``)."""
        check_bounds(values, graph or self.main_graph)

    def step(self, state, ids: np.ndarray, caches: list) -> tuple[np.ndarray, list]:
        """One call: (last-position logits [B, V] as numpy, new caches as tract Tensors).

        ``caches``: numpy arrays or the tract Tensors of the previous call, which go back in
        as they are: tract does not consume its inputs, and turning ~33 MB of caches (the 0.8B
        shape at P = 512) into numpy and back cost ~10 of a q4_0 decode step's ~117 ms.
        ``Tensor.to_numpy()`` gives one as an array. ``ids`` and numpy caches are checked
        against the graph's declarations first (:meth:`check_ids`)."""
        graph = self._graph_of(state)
        ids = self.check_ids(ids, graph)
        _check_caches(caches, graph)
        if self.kv_in_state and any(isinstance(c, np.ndarray) for c in caches):
            state = self.main = self.decode = self.main_graph.runnable.spawn_state()
        outputs = _run(state, [ids, *caches], graph)
        return outputs[0].to_numpy()[:, -1], outputs[1:]

    def prefill(self, ids: np.ndarray, caches: list) -> tuple[np.ndarray, list]:
        """``ids`` [B, S] after ``caches``, in calls of at most ``prefill_chunk`` tokens."""
        ids = self.check_ids(ids, prompt=True)
        chunk = self.prefill_chunk or ids.shape[1]
        for start in range(0, ids.shape[1], chunk):
            piece = ids[:, start:start + chunk]
            logits, caches = self.step(self.decode if piece.shape[1] == 1 else self.main,
                                       piece, caches)
        return logits, caches

    def stream(self, prompt, **options):
        """Text or token ids in, one ``gdn_fx.streaming.Piece`` (token, printable text) out
        per token as it is chosen: ``gdn_fx.streaming.stream(self, prompt, **options)``
        (``tokenizer``, ``max_new_tokens``, ``sampling``, ``eos``, ``stop``, ``chat``,
        ``context``); the returned stream's ``summary`` has the rates once it ends."""
        from gdn_fx.streaming import stream

        return stream(self, prompt, **options)

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int,
                 progress: bool = False) -> GenerationResult:
        """Greedy continuation of ``prompt_ids`` (batch 1) by ``max_new_tokens`` tokens.
        Refused in one line before tract runs: several prompts (InputUnsupported), an empty
        prompt, an id outside ``[0, vocab)``, ``max_new_tokens < 1``, a past longer than the
        graphs declare (UsageError)."""
        prompt = prompt_list(prompt_ids, f" for {self.main_graph.path}, a one-sequence "
                             "export")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, numbers.Integral) \
                or max_new_tokens < 1:
            raise UsageError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
        ids = self.check_ids(np.array([_in_vocabulary(prompt, self.vocab)], dtype=np.int64),
                             prompt=True)
        self.check_lengths({"P": len(prompt) + max_new_tokens - 2})  # the last call's past
        result = GenerationResult(list(prompt))
        start = time.perf_counter()
        logits, caches = self.prefill(ids, [z.copy() for z in self.zero_states])
        result.prefill_s = time.perf_counter() - start
        start = time.perf_counter()
        for count in range(max_new_tokens):
            token = int(logits[0].argmax())
            result.tokens.append(token)
            result.logits.append(logits[0])
            if progress:
                _progress(count + 1, max_new_tokens)
            if count + 1 < max_new_tokens:
                logits, caches = self.step(self.decode, np.array([[token]], dtype=np.int64),
                                           caches)
        result.decode_s = time.perf_counter() - start
        if progress:
            print(file=sys.stderr)
        return result


def _run(state, inputs: list, graph: LoadedGraph) -> list:
    """``state.run(inputs)``; a TractError (a graph that fails on inputs it declares) as a
    one-line ArtifactError with tract's chain of causes, not a Rust backtrace."""
    import tract

    try:
        return state.run(inputs)
    except tract.TractError as error:
        raise ArtifactError(f"tract fails running {graph.path}: {_first_lines(error)}"
                            ) from None


def _in_vocabulary(prompt: list, vocab: int) -> list:
    """``prompt`` unchanged, or UsageError naming the first id outside ``[0, vocab)`` (checked
    on Python ints: an id beyond int64 must not wrap around on the way to numpy)."""
    for index, token in enumerate(prompt):
        if not 0 <= token < vocab:
            raise UsageError(f"prompt id {token} (position {index}) is outside the vocabulary "
                             f"[0, {vocab})")
    return prompt


def _check_caches(caches: Sequence, graph: LoadedGraph) -> None:
    """As many caches as the graph declares after ``input_ids``, and each numpy array of
    the declared dtype and shape (a symbol takes one value across the caches); tract Tensors
    are outputs of an earlier call and pass as they are."""
    declared = graph.inputs[1:]
    if len(caches) != len(declared):
        raise UsageError(f"{graph.path} takes {len(declared)} caches after input_ids, got "
                         f"{len(caches)}")
    symbols: dict = {}
    for (name, dims, datum), cache in zip(declared, caches):
        if not isinstance(cache, np.ndarray):
            continue
        fits = cache.dtype == DATUM.get(datum) and cache.ndim == len(dims) and all(
            size == dim if isinstance(dim, int) else symbols.setdefault(dim, size) == size
            for size, dim in zip(cache.shape, dims))
        if not fits:
            raise UsageError(f"cache {name} is {cache.dtype} {list(cache.shape)}; {graph.path} "
                             f"declares [{', '.join(map(str, dims))}] {datum}")
    check_bounds(symbols, graph)


def check_bounds(values: Mapping[str, int], graph: LoadedGraph) -> None:
    """UsageError unless every bound that ``graph`` asserts on the symbols of ``values``
    holds (symbols ``values`` does not name are not checked)."""
    for symbol, operator, bound in graph.bounds:
        if symbol in values and not _COMPARE[operator](values[symbol], bound):
            raise UsageError(f"{symbol} = {values[symbol]} is outside what {graph.path} "
                             f"declares ({symbol} {operator} {bound})")


def _progress(done: int, total: int, width: int = 30) -> None:
    filled = width * done // total
    print(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} tokens", end="",
          file=sys.stderr, flush=True)


EXTERNAL = re.compile(r"(\w+) = tract_core_external\(shape = \[([^\]]*)\], "
                      r"datum_type = '(\w+)'\)")
DATUM = {"f32": np.float32, "f16": np.float16, "f64": np.float64, "i64": np.int64}


def _zero_states(graph_text: str) -> list:
    """Zero caches for a first prefill, from the NNEF's input declarations (every input after
    ``input_ids``): P = 0 for attention caches, zeros of their shape for the other states."""
    found = EXTERNAL.findall(graph_text)
    zeros = []
    for name, dims, datum in found[1:]:
        shape = [0 if d.strip() == "P" else int(d) for d in dims.split(",")]
        zeros.append(np.zeros(shape, dtype=DATUM[datum]))
    return zeros


# --- checking it against transformers -------------------------------------------------------

@dataclass(frozen=True)
class GenerationCheck:
    """tract's greedy generation against transformers' ``generate`` on the same model."""

    tokens_equal: bool
    first_difference: Optional[int]  # index of the first differing token
    worst_logits: float  # max over the compared steps of max|tract - hf| / max|hf|
    bound: float
    hf_tokens: list
    tied: tuple = ()  # steps at a router near-tie: compared by token only (router_near_ties)

    @property
    def ok(self) -> bool:
        return self.tokens_equal and self.worst_logits <= self.bound

    def __str__(self) -> str:
        tokens = "every token equal" if self.tokens_equal else (
            f"tokens differ from position {self.first_difference}")
        tied = (f"; steps {list(self.tied)} at a router near-tie compared by token only"
                if self.tied else "")
        return (f"{tokens} ({len(self.hf_tokens)} tokens); logits max relative error "
                f"{self.worst_logits:.2e} (bound {self.bound:g}){tied}")


def router_near_ties(model: nn.Module, sequence: Sequence[int], margin: float) -> list:
    """Positions of ``sequence`` where some top-k router of ``model`` nearly ties: its k-th
    and (k+1)-th largest logits lie within ``margin`` of the row's largest |logit|. There a
    rounding difference (f16) may route to another expert, and the logits jump by far more
    than the rounding bound while both sides are right to their precision. Only the routers
    known to take the top k of their logits are read: transformers' ``*TopKRouter`` modules
    (qwen3_next, qwen3_5_moe), whose forward returns the router logits first."""
    routers = [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")
               and isinstance(getattr(m, "top_k", None), int)]
    if not routers:
        return []
    gaps = []

    def record(module, inputs, output):
        logits = (output[0] if isinstance(output, tuple) else output).float()
        if logits.dim() != 2 or logits.shape[-1] <= module.top_k:
            return  # not the [tokens, experts] logits this reads: no tie known there
        top = logits.topk(module.top_k + 1, dim=-1).values
        gaps.append((top[:, -2] - top[:, -1]) / logits.abs().amax(-1).clamp_min(1e-30))

    hooks = [router.register_forward_hook(record) for router in routers]
    try:
        with torch.no_grad():
            model(torch.tensor([list(sequence)]))
    finally:
        for hook in hooks:
            hook.remove()
    if not gaps:
        return []
    closest = torch.stack(gaps).amin(0)
    return [int(i) for i in torch.nonzero(closest < margin).flatten()]


def check_generation(model: nn.Module, result: GenerationResult,
                     bound: Optional[float] = None) -> GenerationCheck:
    """Run transformers' own greedy ``generate`` from ``result.prompt`` and compare every
    token and every step's logits (raw, before any logits processor) within ``bound``
    (default: LOGITS_BOUND for the model's dtype). Steps whose last position is a router
    near-tie (:func:`router_near_ties` within ``bound``) are compared by token only, and
    said in the check; every step counts when more than half of them would be left out."""
    bound = bound if bound is not None else LOGITS_BOUND.get(model_dtype(model), 1e-4)
    prompt = torch.tensor([result.prompt])
    with torch.no_grad():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt),
                             max_new_tokens=len(result.tokens), min_new_tokens=0,
                             do_sample=False, eos_token_id=None, pad_token_id=0,
                             repetition_penalty=1.0, output_logits=True,
                             return_dict_in_generate=True)
    hf_tokens = out.sequences[0, prompt.shape[1]:].tolist()
    steps = min(len(result.logits), len(out.logits))
    tied = ()
    if steps:
        ties = set(router_near_ties(model, list(result.prompt) + hf_tokens[:steps - 1], bound))
        tied = tuple(j for j in range(steps) if len(result.prompt) - 1 + j in ties)
        if 2 * len(tied) > steps:
            tied = ()
    worst = 0.0
    for step, (got, want) in enumerate(zip(result.logits, out.logits)):
        if step in tied:
            continue
        want = want[0].double().numpy()
        got = got.astype(np.float64)
        error = float(np.abs(got - want).max() / np.abs(want).max())
        worst = max(worst, error if np.isfinite(error) else float("inf"))  # NaN fails too
    differ = [i for i, (a, b) in enumerate(zip(result.tokens, hf_tokens)) if a != b]
    equal = not differ and len(hf_tokens) == len(result.tokens)
    return GenerationCheck(equal, differ[0] if differ else None, worst, bound, hf_tokens, tied)
