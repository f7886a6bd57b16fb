"""The main job: a transformers hybrid, exported, collapsed, lowered to NNEF and run in tract.

    report = run(Job(family="qwen3_5"), say=print)

Each stage is timed; the report keeps what a person checks: node counts before and after,
fusions against the expected count, near-misses, lowering decisions, NNEF size, and the
relative error of every tract output against the eager model.
"""

from __future__ import annotations

import json
import contextlib
import gc
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence, Union

import torch

from gdn_fx import ops  # noqa: F401  (registers torch.ops.gdn_fx.*, counted below)



@dataclass
class Job:
    """What to export. ``family`` names a built-in tiny config; ``config`` a config.json."""

    family: Optional[str] = "qwen3_5"
    config: Optional[Path] = None
    model_dir: Optional[Path] = None  # a transformers checkpoint folder (save_pretrained)
    out: Path = Path("out/model.nnef.tgz")
    seq_len: int = 1
    dynamic_seq: bool = False
    dtype: str = "f32"
    seed: int = 0
    weights: str = "f32"  # how the NNEF stores the weights: f32, f16, q4_0 (export_nnef)
    # generation-ready artifact: "reify" (export_generator) or "generalize" (plain exports at
    # fixed (S, P), collapsed and generalized: gdn_fx.hf.generalized)
    route: str = "reify"
    runtime: str = "cpu"  # the tract runtime the NNEF is lowered for: cpu or cuda (export_nnef)
    # weights read from model_dir's safetensors as written (hf/checkpoint.py); "auto": so where
    # the checkpoint's layout allows it, else loaded in memory (the CLI's default for --model)
    stream: Union[bool, str] = False
    # generation-ready artifact: also write the S = 1 graph beside it (the pair of earlier
    # releases; by default one graph serves every S: one copy of the weights)
    decode_graph: bool = False
    # generation-ready artifact: the batched graph of B slots (gdn_fx.hf.batch) instead
    batch: Optional[int] = None


@dataclass
class Report:
    """What the job did and measured."""

    model: str
    nodes_before: int = 0
    nodes_after: int = 0
    counts: dict = field(default_factory=dict)
    expected: dict = field(default_factory=dict)
    misses: list = field(default_factory=list)
    decisions: list = field(default_factory=list)
    nnef_path: Optional[Path] = None
    nnef_ops: int = 0
    nnef_bytes: int = 0
    errors: dict = field(default_factory=dict)  # output name -> relative error
    tolerances: dict = field(default_factory=dict)  # output name -> bound (1e-4 f32, 1e-3 f16)
    checks: dict = field(default_factory=dict)  # seq len -> max relative error (dynamic S)
    checks_ok: bool = True
    seconds: dict = field(default_factory=dict)
    checked_on: str = "cpu"  # the tract runtime the check ran on (and why, when not the target's)

    @property
    def ok(self) -> bool:
        within = all(e <= self.tolerances[name] for name, e in self.errors.items())
        return self.counts == self.expected and within and self.checks_ok


def build_model(job: Job) -> tuple[torch.nn.Module, str]:
    """The model to export (random weights) and a name for it."""
    from gdn_fx.hf import tiny_model
    from gdn_fx.hf.configs import DTYPES

    if job.model_dir is not None:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(job.model_dir, dtype=DTYPES[job.dtype])
        return model.eval(), f"{model.config.model_type} from {job.model_dir}"
    if job.config is not None:
        from transformers import AutoConfig, AutoModelForCausalLM

        torch.manual_seed(job.seed)
        values = json.loads(Path(job.config).read_text())
        config = AutoConfig.for_model(**values)
        model = AutoModelForCausalLM.from_config(config).eval().to(DTYPES[job.dtype])
        return model, f"{config.model_type} from {job.config}"
    return tiny_model(job.family, dtype=DTYPES[job.dtype], seed=job.seed), f"tiny {job.family}"


def require_fusions(model: torch.nn.Module, name: str) -> None:
    """Refuse, before any export work, a model with nothing gdn-fx fuses (e.g. a Llama), or
    one whose sizes depend on values (a sparse-attention indexer: glm5_next, qwen4_exp),
    which every route would trace for seconds to minutes before failing."""
    from gdn_fx.errors import UnsupportedModel
    from gdn_fx.hf import DecodeStep
    from gdn_fx.hf.indexers import require_static_sizes

    require_static_sizes(model, name)  # first: it runs nothing, DecodeStep probes the model
    if not any(DecodeStep(model).expected_fusions.values()):
        raise UnsupportedModel(f"nothing to fuse: {name} ({type(model).__name__}) has no "
                               "linear-attention or causal-conv layers")


def _timed(report: Report, stage: str, say: Callable, what: str):
    class _Stage:
        def __enter__(self):
            say(f"[{stage}] {what} ...")
            self.start = time.perf_counter()

        def __exit__(self, *exc):
            report.seconds[stage] = time.perf_counter() - self.start
            if exc[0] is None:
                say(f"[{stage}] done in {report.seconds[stage]:.2f} s")
    return _Stage()


def run(job: Job, say: Callable[[str], None] = print) -> Report:
    """Run the whole job; ``say`` receives progress lines."""
    import gdn_fx
    from gdn_fx.hf import DecodeStep, prepare_for_nnef

    model, name = build_model(job)
    prepare_for_nnef(model)
    require_fusions(model, name)
    if job.dynamic_seq and job.weights != "f32":
        from gdn_fx.errors import UsageError

        raise UsageError("--weights f16 / q4_0 applies to the generation-ready export and to "
                         "--seq-len steps, not to --dynamic-seq")
    if job.dynamic_seq:  # the model's own rules, swapped for the fused ops by reify
        return _run_dynamic(job, DecodeStep(model), name, say)
    # A static multi-token step through the recurrent rule: its unrolled loop collapses.
    step = DecodeStep(model, rule="recurrent" if job.seq_len > 1 else "auto")
    args = step.example_inputs(seq_len=job.seq_len)
    report = Report(model=f"{name}, {job.dtype}, S={job.seq_len}", expected=step.expected_fusions)
    with _timed(report, "export", say, f"torch.export of the step at S={job.seq_len} "
                f"(unrolled loops cost ~0.07 s per token per layer)"):
        program = torch.export.export(step, args, strict=False)
    with _timed(report, "collapse", say, "gdn_fx.collapse"):
        result = gdn_fx.collapse(program)
    report.nodes_before = _calls(program)
    report.nodes_after = _calls(result.program)
    report.counts = {k: result.counts.get(k, 0) for k in report.expected}
    report.misses = [str(m) for m in result.misses]
    _lower(job, step, result.program, report, say)
    return report


def _run_dynamic(job: Job, step, name: str, say: Callable) -> Report:
    """Symbolic S: reify, export with a dynamic sequence axis, check tract at several S.

    A static export bakes S into reshapes and masks (export_nnef refuses to make such an axis
    symbolic), so this road traces the model with symbolic shapes instead of collapsing.
    """
    from gdn_fx.hf import check_dynamic, export_dynamic

    seq_len = max(job.seq_len, 2)  # transformers branches on S == 1
    report = Report(model=f"{name}, {job.dtype}, symbolic S (traced at {seq_len})",
                    expected=step.expected_fusions)
    with _timed(report, "export", say, "reify + torch.export with a dynamic sequence axis"):
        program = export_dynamic(step, seq_len)
    report.nodes_before = report.nodes_after = _calls(program)
    report.counts = {k: _count(program, k) for k in report.expected}
    _lower(job, step, program, report, say, {"input_ids": {1: "S"}}, seq_len)
    for length, found in check_dynamic(step, report.nnef_path, (3, 50)).items():
        report.checks[length] = max(found.errors)
        report.checks_ok = report.checks_ok and found.ok
    return report


@dataclass
class GeneratorReport:
    """What the generator job wrote and how its tract generation compared with transformers."""

    model: str
    files: object = None  # gdn_fx.hf.generator.GeneratorFiles
    expected: dict = field(default_factory=dict)
    counts: dict = field(default_factory=dict)
    decisions: dict = field(default_factory=dict)  # file -> {node: candidate}
    check: object = None  # GenerationCheck, or None when not checked
    rates: str = ""
    seconds: dict = field(default_factory=dict)
    checked_on: str = "cpu"  # the tract runtime the check ran on (and why, when not the target's)

    @property
    def ok(self) -> bool:
        return self.counts == self.expected and (self.check is None or self.check.ok)


CHECK_PROMPT, CHECK_TOKENS = 12, 16  # the export's own check: a short greedy generation


@dataclass
class ModelSource:
    """Where the generation-ready export's model comes from: ``exporting()`` is the context the
    export runs in; ``reference(files)`` is the model the check compares with, built once
    tract's copy of the weights is gone; ``too_large`` why that reference would not fit."""

    model: torch.nn.Module
    name: str
    exporting: Callable = contextlib.nullcontext
    reference: Optional[Callable] = None
    too_large: Optional[str] = None


def _in_memory(job: Job) -> ModelSource:
    from gdn_fx.hf.generator import with_stored_weights

    model, name = build_model(job)
    # compressed weights: against transformers on the weights the NNEF stores
    return ModelSource(model, name, reference=lambda files: model if job.weights == "f32"
                       else with_stored_weights(model, files.main))


def _model_source(job: Job, say: Callable[[str], None]) -> ModelSource:
    """The streamed model of ``job.model_dir`` (gdn_fx.hf.checkpoint: the weights never in
    memory) where ``job.stream`` asks for it, else the model in memory; "auto" falls back to
    memory, said, where the checkpoint's layout is not one the streamed reader knows."""
    if job.stream:
        from gdn_fx.errors import CheckpointLayoutUnknown

        try:
            return streamed_source(job)
        except CheckpointLayoutUnknown as err:  # raised before any work
            if job.stream != "auto":
                raise
            say(f"[export] the weights are loaded in memory: {err}")
    return _in_memory(job)


def run_generator(job: Job, say: Callable[[str], None] = print,
                  check: bool = True) -> GeneratorReport:
    """Write the generation-ready artifact (gdn_fx.hf.generator) and, with ``check``,
    generate with it in tract and compare every token and logit with transformers."""
    from gdn_fx import tract_check
    from gdn_fx.hf import DecodeStep
    from gdn_fx.hf.generator import Generator, check_generation, export_generator

    source = _model_source(job, say)
    model = source.model
    require_fusions(model, source.name)
    report = GeneratorReport(model=f"{source.name}, {job.dtype}, symbolic S and P, "
                                   f"weights {job.weights}")
    job.out.parent.mkdir(parents=True, exist_ok=True)
    if job.route == "generalize":
        from gdn_fx.hf.generalized import export_generalized

        with _timed(report, "export", say, "torch.export at fixed (S, P), collapse, "
                    "generalize, NNEF"):
            files = export_generalized(model, job.out, say=say, weights=job.weights,
                                       decode=job.decode_graph)
    else:
        with _timed(report, "export", say, "reify, torch.export (symbolic S, P), NNEF"), \
                source.exporting():
            files = export_generator(model, job.out, say=say, weights=job.weights,
                                     decode=job.decode_graph, runtime=job.runtime,
                                     batch=job.batch)
    report.files = files
    report.expected = DecodeStep(model).expected_fusions
    report.decisions = {p: tract_check.read_decisions(p) for p in (files.main, files.decode)
                        if p is not None}
    lowered = report.decisions[files.main]  # one decision per fused node, named after its op
    report.counts = {op: sum(1 for n in lowered if re.fullmatch(rf"{op}(_\d+)?", n))
                     for op in report.expected}
    if not check:
        return report
    if source.too_large:
        say(f"[check] tract generate vs transformers: skipped ({source.too_large}; gdn-fx "
            "generate --check --model DIR runs it where it fits)")
        return report
    if job.batch is not None:
        return _check_batched(report, job, source.reference(files), say)
    prompt = _check_prompts(job.seed, [CHECK_PROMPT])[0]
    runtime, report.checked_on = _check_runtime(job.runtime)
    with _timed(report, "generate", say, f"tract ({runtime}): {CHECK_TOKENS} greedy "
                "tokens, compared with transformers' generate"):
        generator = Generator(files.main, files.decode, runtime=runtime)
        result = generator.generate(prompt, CHECK_TOKENS)
        del generator  # tract's copy of the weights goes before a streamed reference comes
        gc.collect()
        tract_check.release_freed_memory()
        report.check = check_generation(source.reference(files), result)
    report.rates = result.rates()
    return report


def _check_prompts(seed: int, lengths: Sequence[int]) -> list:
    """Random prompts (token ids in the tiny configs' safe range) of these lengths."""
    from gdn_fx.hf.configs import SAFE_TOKEN_RANGE

    low, high = SAFE_TOKEN_RANGE
    draw = torch.Generator().manual_seed(seed)
    return [torch.randint(low, high, (n,), generator=draw).tolist() for n in lengths]


def _check_batched(report: GeneratorReport, job: Job, reference, say) -> GeneratorReport:
    """The batched export's own check: B + 1 prompts of different lengths through its B
    slots (so one slot is taken over mid-way), each against transformers' generate alone."""
    from gdn_fx.runtime.batch import BatchGenerator
    from gdn_fx.hf.generator import check_generation

    lengths = [CHECK_PROMPT - 3 * (i % 4) for i in range(job.batch + 1)]
    prompts = _check_prompts(job.seed, lengths)
    with _timed(report, "generate", say, f"tract (cpu): {len(prompts)} prompts through "
                f"{job.batch} slots, {CHECK_TOKENS} greedy tokens each, compared with "
                "transformers' generate"):
        generator = BatchGenerator(report.files.main)
        results = generator.generate(prompts, CHECK_TOKENS, keep_logits=True)
        report.check = BatchCheck([check_generation(reference, r) for r in results])
    report.rates = generator.stats.rates()
    return report


@dataclass
class BatchCheck:
    """Each prompt's GenerationCheck of a batched export's check."""

    checks: list

    @property
    def ok(self) -> bool:
        return all(found.ok for found in self.checks)

    def __str__(self) -> str:
        bad = [i for i, found in enumerate(self.checks) if not found.tokens_equal]
        tokens = (f"every token of {len(self.checks)} prompts equal" if not bad else
                  f"tokens differ for prompts {bad}")
        worst = max(found.worst_logits for found in self.checks)
        return (f"{tokens}; logits max relative error {worst:.2e} "
                f"(bound {self.checks[0].bound:g})")


def _lengths(path) -> str:
    """The token counts one call of the export at ``path`` takes."""
    from gdn_fx import tract_check

    window = tract_check.read_max_tokens(path)
    return "every S >= 1" if window is None else f"1 <= S <= {window} a call"


def render_generator(report: GeneratorReport) -> str:
    """The generator report as the lines the CLI prints."""
    files = report.files
    lines = [f"model: {report.model}",
             "fused: " + ", ".join(f"{k} {report.counts.get(k, 0)}/{n}"
                                   for k, n in report.expected.items()),
             f"nnef: {files.main} ({_lengths(files.main)}, P >= 0)"]
    if files.decode is not None:
        lines.append(f"nnef: {files.decode} (decode, S = 1, P >= 0)")
    else:
        lines.append(f"decode graph: none ({files.decode_note}); the main graph serves decode")
    lines.append(f"inputs: {', '.join(files.input_names)}")
    lines.append(f"outputs: {', '.join(files.output_names)}")
    for path, decided in report.decisions.items():
        lines.append(f"lowering of {Path(path).name}: " + ", ".join(
            f"{node} -> {candidate}" for node, candidate in decided.items()))
    if report.check is not None:
        on = "" if report.checked_on == "cpu" else f"; tract runtime {report.checked_on}"
        lines.append(f"tract generate vs transformers: {report.check}{on}")
        lines.append(f"tract speed: {report.rates}")
    lines.append("time: " + ", ".join(f"{k} {v:.2f} s" for k, v in report.seconds.items()))
    lines.append("OK" if report.ok else "NOT OK")
    return "\n".join(lines)


def _count(program, op: str) -> int:
    target = getattr(torch.ops.gdn_fx, op).default
    return sum(1 for n in program.graph_module.graph.nodes if n.target is target)


def _lower(job: Job, step, program, report: Report, say: Callable, dynamic=None,
           seq_len: int = None) -> None:
    import gdn_fx
    from gdn_fx import tract_check
    from gdn_fx.lowering import plan_lowering

    report.decisions = [str(d) for d in plan_lowering(program, dynamic_axes=dynamic,
                                                      runtime=job.runtime)]
    job.out.parent.mkdir(parents=True, exist_ok=True)
    with _timed(report, "nnef", say, f"NNEF through torch-to-nnef -> {job.out}"):
        path = gdn_fx.export_nnef(program, job.out, dynamic_axes=dynamic,
                                  input_names=step.input_names, output_names=step.output_names,
                                  weights=job.weights, runtime=job.runtime)
    report.nnef_path, report.nnef_bytes = path, path.stat().st_size
    report.nnef_ops = _nnef_ops(path)
    args = step.example_inputs(seq_len=seq_len or job.seq_len)
    # An f16 model computes in f16 upstream of every output, f32 states included.
    bound = 1e-3 if job.dtype == "f16" else None
    if job.weights != "f32":  # against the model holding the weights as the NNEF stores them
        from gdn_fx.hf import DecodeStep
        from gdn_fx.hf.generator import with_stored_weights

        step = DecodeStep(with_stored_weights(step.model, path), rule=step.rule)
    runtime, report.checked_on = _check_runtime(job.runtime)
    with _timed(report, "tract", say, f"tract ({runtime}): load, optimize, run, compare with "
                "eager"):
        found = tract_check.compare(path, step.eager(*args), args, tolerance=bound,
                                    runtime=runtime)
    report.errors = dict(zip(step.output_names, found.errors))
    report.tolerances = dict(zip(step.output_names, found.tolerances))


def _check_runtime(runtime: str) -> tuple[str, str]:
    """(the runtime the check runs on, how the report says it): the export's own runtime,
    or the CPU runtime, saying why, when this machine has no such runtime (the NNEF is the
    same file: what the CPU computes is what it must compute)."""
    from gdn_fx import tract_check

    missing = tract_check.runtime_unavailable(runtime)
    if missing is None:
        return runtime, runtime
    return "cpu", f"cpu, not {runtime} ({missing})"


def _calls(program) -> int:
    return sum(1 for n in program.graph_module.graph.nodes if n.op == "call_function")


def _nnef_ops(path: Path) -> int:
    from gdn_fx.diff import nnef_graph

    return sum(1 for _, d in nnef_graph(path).nodes(data=True) if d["op"] == "call_function")


def render(report: Report) -> str:
    """The report as the lines the CLI prints."""
    lines = [f"model: {report.model}",
             f"graph: {report.nodes_before} -> {report.nodes_after} call_function nodes",
             "fused: " + ", ".join(f"{k} {report.counts.get(k, 0)}/{n}"
                                   for k, n in report.expected.items())]
    lines += [f"  near-miss: {m}" for m in report.misses]
    lines += ["lowering:"] + [f"  {d}" for d in report.decisions]
    lines.append(f"nnef: {report.nnef_path} ({report.nnef_ops} ops, {report.nnef_bytes} bytes)")
    worst = max(report.errors.values(), default=0.0)
    lines.append(f"tract vs eager: max relative error {worst:.2e} over "
                 f"{len(report.errors)} outputs (bound {max(report.tolerances.values()):g})"
                 f"; tract runtime {report.checked_on}")
    lines += [f"  {name}: {err:.2e}" for name, err in report.errors.items()]
    lines += [f"tract at S={s}: max relative error {e:.2e}" for s, e in report.checks.items()]
    lines.append("time: " + ", ".join(f"{k} {v:.2f} s" for k, v in report.seconds.items()))
    lines.append("OK" if report.ok else "NOT OK")
    return "\n".join(lines)


def streamed_source(job):
    """The streamed model of ``job.model_dir`` for :func:`run_generator`: matrices
    as placeholders, written from the checkpoint inside ``exporting()``; the check's reference
    is ``stored_reference`` (what ``gdn-fx generate --check --model DIR`` compares with),
    skipped where it would not fit. CheckpointLayoutUnknown before any work for a parameter
    the reader does not know."""
    from gdn_fx.errors import UsageError
    from gdn_fx.hf.configs import DTYPES
    from gdn_fx.hf.nnef import prepare_for_nnef
    from gdn_fx.hf.checkpoint import (_reference_too_large, placeholder_model,
                                  stored_reference, streaming)

    if job.model_dir is None:
        raise UsageError("--stream reads a checkpoint folder: give --model DIR")
    if job.route != "reify" or getattr(job, "decode_graph", False):
        raise UsageError("--stream writes the one-graph reify export (no --generalize, no "
                         "--decode-graph)")
    dtype = DTYPES[job.dtype]
    model, placeholders = placeholder_model(job.model_dir, dtype)
    prepare_for_nnef(model)  # the default MoE kernel refuses placeholders' zero strides
    return ModelSource(
        model, f"{model.config.model_type} from {job.model_dir} (streamed)",
        exporting=lambda: streaming(placeholders),
        reference=lambda files: stored_reference(job.model_dir, files.main, dtype).eval(),
        too_large=_reference_too_large(model, dtype))
