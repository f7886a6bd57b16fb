"""Generation-ready NNEF: one artifact for prefill and decode at any length and any past.

    files = export_generator(tiny_model("qwen3_5"), "out/q.nnef.tgz")
    gen = Generator(files.main, files.decode)            # tract, one State per graph, kept
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

Why a pair of graphs: under a symbolic S the lowering table must pick a candidate that serves
every S. On a Qwen3.5-sized layer (bench/bench_tract.py) none is within 1.25x of the best at
both S = 1 and S = 512: ``chunked`` is 5.8x the best at S = 1, ``matmul`` 3.8x at S = 512. So
``X.decode.nnef.tgz`` beside ``X.nnef.tgz`` is the same model at S = 1 (P symbolic), lowered
with the decode candidates; same inputs, same outputs.
"""

from __future__ import annotations

import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Optional, Sequence, Union

import numpy as np
import torch
from torch import nn
from torch.export import Dim

from gdn_fx.errors import UnsupportedModel, UsageError
from gdn_fx.hf.attention import grouped_attention
from gdn_fx.hf.decode import DecodeStep
from gdn_fx.hf.dropins import reify
from gdn_fx.hf.nnef import fused_counts, prepare_for_nnef

EXAMPLE_SEQ, EXAMPLE_PAST = 3, 4  # >= 2: torch.export specializes dims whose example is 0 or 1
# tract against eager, per output, for an f16 model (f32 models: 1e-4): four f16 ulps of the
# output's largest value (seen: 1.1e-3 on a recurrent state of the tiny qwen3_5 in f16).
F16_BOUND = 4e-3
# Logits of a whole generation against transformers: f16 models accumulate f16 rounding over
# the steps (tract and torch round differently), so their bound is wider.
LOGITS_BOUND = {torch.float32: 1e-4, torch.float16: 1e-2}


def model_dtype(model: nn.Module) -> torch.dtype:
    """The dtype of the model's floating-point weights (its first parameter's)."""
    return next(model.parameters()).dtype


@dataclass(frozen=True)
class GeneratorFiles:
    """What :func:`export_generator` wrote: the graph for every S, and the S = 1 graph."""

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
        raise UnsupportedModel("the model does not compute for every S >= 1 and P >= 0: "
                               + "; ".join(bounds or [str(error).splitlines()[0]])) from None
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


def export_generator(model: nn.Module, path: Union[str, Path], *, decode: bool = True,
                     all_logits: bool = False, tract_version: str = "0.23.9",
                     choose: Optional[Mapping] = None,
                     say: Callable[[str], None] = lambda line: None,
                     weights: str = "f32") -> GeneratorFiles:
    """Write ``model`` (a transformers hybrid causal LM) as a generation-ready NNEF.

    ``path`` serves every S (prefill, and decode too); with ``decode`` (the default) the S = 1
    graph is written beside it as ``decode_path(path)`` (see the module doc for why). The
    model is prepared for NNEF in place (``prepare_for_nnef``). ``weights`` ("f32", "f16",
    "q4_0") is how both graphs store the weights, as in ``gdn_fx.export_nnef``; with
    compressed weights the decode graph is kept when it computes what the main graph computes
    (both in tract), since neither matches the f32 model to 1e-4. Raises UnsupportedModel
    when a layer is not reified, ExportRefused (from export_nnef) for what cannot follow S
    and P, UsageError for an unknown ``weights``.
    """
    from gdn_fx.lowering.t2n.weights import check_format

    check_format(weights)
    from gdn_fx.export import export_nnef

    step = DecodeStep(prepare_for_nnef(model), last_logits=not all_logits, whole_windows=True)
    past = {s.name: {s.past_axis: "P"} for s in step.specs if s.past_axis is not None}
    say(f"export the reified step (symbolic S and P) -> {path}")
    program = export_program(step)
    jobs = [(Path(path), program, {"input_ids": {1: "S"}, **past})]
    if decode:
        jobs.append((decode_path(path), decode_program(program, step), past))
    written = []
    for target, exported, axes in jobs:
        say(f"write {target}")
        written.append(export_nnef(exported, target, tract_version=tract_version,
                                   dynamic_axes=axes, input_names=step.input_names,
                                   output_names=step.output_names, choose=choose,
                                   symbol_min={"P": 0}, weights=weights))
    note = decode_problem(written[1], written[0], step, weights) if decode else "not asked for"
    if note and decode:
        say(f"decode graph dropped: {note}; the main graph serves decode")
        written[1].unlink()
    return GeneratorFiles(written[0], None if note else written[1], tuple(step.input_names),
                          tuple(step.output_names), note)


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
        lines = [line for line in str(error).splitlines() if line.strip()]
        return f"tract fails on it: {' / '.join(lines[:3])[:300]}"
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


def with_stored_weights(model: nn.Module, path: Union[str, Path]) -> nn.Module:
    """A copy of ``model`` holding the weights as the export at ``path`` stores them (f16
    rounded, Q4_0 dequantized; ``tract_check.stored_parameters``): the model tract runs, to
    check a compressed export against transformers. A product's own Q4_0 copy of a table
    the embedding also reads (label ``<name>_q4_0``) unties it in the copy."""
    import copy

    from gdn_fx import tract_check

    twin = copy.deepcopy(model)
    stored = tract_check.stored_parameters(path)
    prefix = "model."  # DecodeStep holds the model as its attribute ``model``
    own_copies = {}
    with torch.no_grad():
        for label, values in stored.items():
            name = label[len(prefix):] if label.startswith(prefix) else label
            if name.endswith("_q4_0"):
                own_copies[name[: -len("_q4_0")]] = values
                continue
            try:
                param = twin.get_parameter(name)
            except AttributeError:  # a constant of the graph, not a parameter
                continue
            if tuple(param.shape) == values.shape:
                param.copy_(torch.from_numpy(values).to(param.dtype))
        for name, values in own_copies.items():
            owner, _, field = name.rpartition(".")
            setattr(twin.get_submodule(owner), field, nn.Parameter(
                torch.from_numpy(values).to(model_dtype(model)), requires_grad=False))
    return twin


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


class Generator:
    """Greedy decoding in tract over a generator artifact (and its decode graph, if given).

    One tract State per graph is spawned once and kept across calls, as an application runs
    it; the cache travels as explicit tensors from one call's outputs to the next's inputs.
    A prompt longer than ``prefill_chunk`` tokens is fed in calls of that many (the artifact
    serves every S and P, so this computes the same): by default the longest chunk that keeps
    every projection's activations within the L2 cache (:func:`prefill_chunk`); ``None`` feeds
    the whole prompt in one call.
    """

    def __init__(self, main: Union[str, Path], decode: Optional[Union[str, Path]] = None,
                 prefill_chunk: Union[int, str, None] = "auto"):
        from gdn_fx import tract_check

        self.main = tract_check.load(main).spawn_state()
        self.decode = tract_check.load(decode).spawn_state() if decode else self.main
        text = tract_check.nnef_text(main)  # read once: in a .tgz it follows the weights
        self.zero_states = _zero_states(text)
        if prefill_chunk == "auto":
            prefill_chunk = auto_prefill_chunk(text)
        if prefill_chunk is not None and prefill_chunk < 1:
            raise UsageError(f"prefill_chunk must be >= 1 (or None), got {prefill_chunk}")
        self.prefill_chunk = prefill_chunk

    def step(self, state, ids: np.ndarray, caches: list) -> tuple[np.ndarray, list]:
        """One call: (last-position logits [B, V] as numpy, new caches as tract Tensors).

        ``caches``: numpy arrays or the tract Tensors of the previous call, which go back in
        as they are: tract does not consume its inputs, and turning ~33 MB of caches (the 0.8B
        shape at P = 512) into numpy and back cost ~10 of a q4_0 decode step's ~117 ms.
        ``Tensor.to_numpy()`` gives one as an array."""
        outputs = state.run([ids, *caches])
        return outputs[0].to_numpy()[:, -1], outputs[1:]

    def prefill(self, ids: np.ndarray, caches: list) -> tuple[np.ndarray, list]:
        """``ids`` [B, S] after ``caches``, in calls of at most ``prefill_chunk`` tokens."""
        chunk = self.prefill_chunk or ids.shape[1]
        for start in range(0, ids.shape[1], chunk):
            piece = ids[:, start:start + chunk]
            logits, caches = self.step(self.decode if piece.shape[1] == 1 else self.main,
                                       piece, caches)
        return logits, caches

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int,
                 progress: bool = False) -> GenerationResult:
        """Greedy continuation of ``prompt_ids`` (batch 1) by ``max_new_tokens`` tokens."""
        result = GenerationResult(list(prompt_ids))
        start = time.perf_counter()
        logits, caches = self.prefill(np.array([prompt_ids], dtype=np.int64),
                                      [z.copy() for z in self.zero_states])
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


# tract 0.23.9 computes a matmul whose row count is symbolic (S) at ~150 GFLOP/s on this
# machine while its packed activations (rows x inner dim x itemsize) fit the L2 cache, and at
# 40-66 GFLOP/s beyond (measured: a 1024-wide product slows from 26 ms at S = 508 to 65 ms at
# S = 511; 3584-wide between S = 140 and 146; 2 MiB of L2): docs/FACTS.md, "tract 0.23.9:
# traps", symbolic-S matmul.
_L2_FALLBACK = 1 << 20
_WEIGHT = re.compile(r"label = '[^']*\.weight', shape = \[(\d+), (\d+)\]\)")


def auto_prefill_chunk(graph_text: str, l2_bytes: Optional[int] = None) -> int:
    """The longest prompt chunk whose f32 activations, in the widest projection of the
    artifact whose graph.nnef is ``graph_text`` (``tract_check.nnef_text``),
    fit the L2 cache (this machine's, from sysfs): a multiple of the chunked delta-rule scan's
    step (64 tokens: a call's S is padded to it), or of 16 below one step; 16 to 512. f16
    models get the same chunk (conservative: their activations take half the bytes)."""
    from gdn_fx.lowering.gdn_chunked import SCAN_CHUNK, SCAN_CHUNKS_PER_STEP

    widths = [int(inner) for _, inner in _WEIGHT.findall(graph_text)]  # torch Linear: [out, in]
    rows = (l2_bytes or _l2_bytes()) // (4 * max(widths or [1]))
    step = SCAN_CHUNK * SCAN_CHUNKS_PER_STEP if rows >= SCAN_CHUNK * SCAN_CHUNKS_PER_STEP else 16
    return int(min(512, max(16, rows // step * step)))


def _l2_bytes() -> int:
    """This CPU's L2 size in bytes (Linux sysfs; 1 MiB where it cannot be read)."""
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            if (index / "level").read_text().strip() == "2":
                size = (index / "size").read_text().strip().upper()
                return int(size.rstrip("KM")) << (20 if size.endswith("M") else 10)
        except (OSError, ValueError):
            continue
    return _L2_FALLBACK


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
    worst_logits: float  # max over steps of max|tract - hf| / max|hf|
    bound: float
    hf_tokens: list

    @property
    def ok(self) -> bool:
        return self.tokens_equal and self.worst_logits <= self.bound

    def __str__(self) -> str:
        tokens = "every token equal" if self.tokens_equal else (
            f"tokens differ from position {self.first_difference}")
        return (f"{tokens} ({len(self.hf_tokens)} tokens); logits max relative error "
                f"{self.worst_logits:.2e} (bound {self.bound:g})")


def check_generation(model: nn.Module, result: GenerationResult,
                     bound: Optional[float] = None) -> GenerationCheck:
    """Run transformers' own greedy ``generate`` from ``result.prompt`` and compare every
    token and every step's logits (raw, before any logits processor) within ``bound``
    (default: LOGITS_BOUND for the model's dtype)."""
    bound = bound if bound is not None else LOGITS_BOUND.get(model_dtype(model), 1e-4)
    prompt = torch.tensor([result.prompt])
    with torch.no_grad():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt),
                             max_new_tokens=len(result.tokens), min_new_tokens=0,
                             do_sample=False, eos_token_id=None, pad_token_id=0,
                             output_logits=True, return_dict_in_generate=True)
    hf_tokens = out.sequences[0, prompt.shape[1]:].tolist()
    worst = 0.0
    for got, want in zip(result.logits, out.logits):
        want = want[0].double().numpy()
        got = got.astype(np.float64)
        error = float(np.abs(got - want).max() / np.abs(want).max())
        worst = max(worst, error if np.isfinite(error) else float("inf"))  # NaN fails too
    differ = [i for i, (a, b) in enumerate(zip(result.tokens, hf_tokens)) if a != b]
    equal = not differ and len(hf_tokens) == len(result.tokens)
    return GenerationCheck(equal, differ[0] if differ else None, worst, bound, hf_tokens)
