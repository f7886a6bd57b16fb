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
(``gdn_fx_max_tokens``), which the Generator cuts prompts to (docs/cuda.md).
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path
from typing import Callable, Optional, Sequence, Union

import torch
from torch import nn
from torch.export import Dim

from gdn_fx.errors import UnsupportedModel, UsageError
from gdn_fx.hf.attention import grouped_attention
from gdn_fx.hf.decode import DecodeStep
from gdn_fx.hf.dropins import reify
from gdn_fx.hf.indexers import require_static_sizes
from gdn_fx.hf.nnef import (DECODE, FINGERPRINT, VOCAB, GeneratorFiles,  # noqa: F401
                            declare_bound, fingerprint, fused_counts, generator_options, place,
                            place_graphs, prepare_for_nnef, stamp_properties, staging,
                            vocabulary_size, write_graph)
# Running and checking it: gdn_fx.runtime (tract and numpy only) and generation_check; the
# names stay importable from here, the path earlier releases documented.
from gdn_fx.hf.generation_check import (LOGITS_BOUND, GenerationCheck,  # noqa: F401
                                        check_generation, model_dtype, router_near_ties)
from gdn_fx.runtime.artifact import (DATUM, EXTERNAL, KV_IN_STATE, PAST_INPUT,  # noqa: F401
                                     WRITES_ONE, LoadedGraph, UnverifiedPair, check_bounds,
                                     check_pair, decode_path, generation_problem, load_graph,
                                     prompt_list, zero_states)
from gdn_fx.runtime.artifact import _in_vocabulary  # noqa: F401
from gdn_fx.runtime.generator import GenerationResult, Generator  # noqa: F401

EXAMPLE_SEQ, EXAMPLE_PAST = 3, 4  # >= 2: torch.export specializes dims whose example is 0 or 1
# tract against eager, per output, for an f16 model (f32 models: 1e-4): four f16 ulps of the
# output's largest value (seen: 1.1e-3 on a recurrent state of the tiny qwen3_5 in f16).
F16_BOUND = 4e-3
# GeneratorFiles.decode_note of a one-graph export (the default).
NOT_ASKED = "not asked for: one graph serves every S"


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
    when a layer is not reified, ExportRefused for what cannot follow S and P (before any
    tracing for a sparse-attention indexer, gdn_fx.hf.indexers; else from export_nnef),
    UsageError for an unknown ``weights``.

    Both graphs are written and checked in a hidden folder beside ``path`` and moved into
    place at the end (:func:`place_graphs`), so an error leaves nothing at ``path``; each
    carries the tract property ``gdn_fx_fingerprint`` (config, weights and their storage),
    which :class:`Generator` compares before it runs a pair.
    """
    options = generator_options(options, fields)
    require_static_sizes(model)  # an indexer: refused now, not after the trace
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
        written = [write_graph(exported, folder / f"graph{i}.nnef", finals[i], axes, names,
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
            if param.numel() > 1 and not any(param.stride()):  # a placeholder (hf/checkpoint.py)
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
