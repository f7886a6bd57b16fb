"""The ``gdn-fx`` command: demo, export, generate, diff."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import warnings
from pathlib import Path
from typing import Optional, Sequence

from gdn_fx.cli_text import INTERRUPTED  # noqa: F401  (the CLI's exit status on Ctrl-C)


EXAMPLES = {
    None: """examples:
  gdn-fx demo
  gdn-fx export --family qwen3_5 --out out/q.nnef.tgz
  gdn-fx generate --nnef out/m.nnef.tgz --model CHECKPOINT_DIR --prompt "Once upon a time"
  gdn-fx diff a.pt2 b.pt2
Run "gdn-fx COMMAND --help" for a command's options.""",
    "demo": """examples:
  gdn-fx demo --out out/demo.nnef.tgz
  gdn-fx demo --text      # checkpoint + tokenizer made offline, export, text generation""",
    "export": """examples:
  gdn-fx export --family qwen3_5 --out out/q.nnef.tgz     # one graph: every S, decode too
  gdn-fx export --family qwen3_5 --out out/q.nnef.tgz --decode-graph  # + q.decode.nnef.tgz
  gdn-fx export --model CHECKPOINT_DIR --out out/m.nnef.tgz --weights q4_0
  gdn-fx export --family qwen3_5 --out out/q8.nnef.tgz --batch 8   # 8 sequences per call
  gdn-fx export --config config.json --seq-len 8 --out out/step.nnef.tgz

{families}
The files are written beside --out under a hidden temporary name and renamed at the end:
an error leaves nothing at --out.""",
    "generate": """examples:
  gdn-fx generate --nnef out/m.nnef.tgz --model CHECKPOINT_DIR --prompt "Once upon a time"
  echo "Hello" | gdn-fx generate --nnef out/m.nnef.tgz --prompt - --chat
  gdn-fx generate --nnef out/m.nnef.tgz --prompt-file p.txt --temperature 0.8 --top-p 0.95 \\
      --seed 1 --stop "\\n\\n" --json
  gdn-fx generate --nnef out/q.nnef.tgz --prompt-ids 1,2,3 --max-new-tokens 16
  gdn-fx generate --nnef out/q.nnef.tgz --prompt-ids 1,2,3 --check --family qwen3_5

A text prompt needs the tokenizer: --model's folder, or the X.text folder that
"gdn-fx export --model DIR" writes beside X.nnef.tgz. The answer goes to stdout as it is
decoded, the rates (prefill and decode tokens/s, time to first token) to stderr.

That folder is the checkpoint the run follows on every path, as transformers' generate does:
the EOS ids of generation_config.json, the context of config.json (max_position_embeddings:
a prompt that fills it is refused, an answer it cuts says so), the length of
generation_config.json (max_new_tokens, else max_length: the prompt and the answer
together, else transformers' default of 20 new tokens) and its sampling (do_sample,
temperature, top_k, top_p, min_p, repetition_penalty), unless a flag overrides it
(--max-new-tokens; --greedy: greedy). The sampling and the length used are said on stderr
("[sampling] ...", "[length] ..."). Ctrl-C stops the answer where it is (status 130).

The decode graph beside --nnef (X.decode.nnef.tgz, written by "export --decode-graph") is
used when there is one; it must carry the main graph's fingerprint. Without it the one graph
serves decode.""",
    "diff": """examples:
  gdn-fx diff a.pt2 b.pt2
  gdn-fx diff out/a.nnef.tgz out/b.nnef.tgz""",
}


class _Parser(argparse.ArgumentParser):
    """A subcommand's parser whose epilog is filled in when its help is printed
    (``fill``: name -> a function giving the text): the export help's family list needs
    transformers, which neither ``gdn-fx --help`` nor ``generate`` should import."""

    fill: dict = {}

    def format_help(self) -> str:
        if self.fill:
            template = self.epilog
            self.epilog = template.format(**{name: make() for name, make in self.fill.items()})
            try:
                return super().format_help()
            finally:
                self.epilog = template
        return super().format_help()


def _subparser(sub, name: str, help_text: str, **fill) -> argparse.ArgumentParser:
    parser = sub.add_parser(name, help=help_text, description=help_text,
                            epilog=EXAMPLES[name],
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.fill = fill
    return parser


# What the exporter imports beyond the runtime (pyproject's "export" extra): a runtime-only
# install (`pip install gdn-fx`) generates from an artifact; the rest says what to install.
EXPORT_MODULES = ("torch", "transformers", "torch_to_nnef", "networkx")
EXPORT_INSTALL = 'pip install "gdn-fx[export]"'


def missing_export_modules() -> list:
    """The exporter's modules this Python cannot import (found without importing them)."""
    import importlib.util

    missing = []
    for name in EXPORT_MODULES:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing.append(name)
    return missing


def _needs_exporter(args) -> str:
    """What of this command line needs the exporter's packages ("" when nothing does)."""
    if args.command in ("export", "demo", "diff"):
        return args.command
    if args.command == "generate":
        for flag in ("check", "family"):
            if getattr(args, flag, None):
                return f"generate --{flag}"
    return ""


def _exporter_missing(what: str, missing: Sequence[str]) -> str:
    """The one line that says what to install."""
    names = ", ".join(name.replace("_", "-") for name in missing)
    return (f"gdn-fx: {what} needs the exporter's packages ({names} not installed): "
            f"{EXPORT_INSTALL}")


def _families() -> str:
    """The --family names as the export help lists them (wrapped), with those the installed
    transformers lacks named apart; without the exporter's packages, what to install."""
    import textwrap

    try:
        import transformers

        from gdn_fx.hf.configs import FAMILIES, available_families
    except ImportError:
        text = ("families (--family): listed here once the exporter's packages are "
                f"installed ({EXPORT_INSTALL})")
        return "\n".join(textwrap.wrap(text, 90, subsequent_indent="  "))
    here = available_families()
    text = "families (--family): " + ", ".join(here)
    missing = [f for f in FAMILIES if f not in here]
    if missing:
        text += (f"; not in the installed transformers {transformers.__version__}: "
                 + ", ".join(missing))
    return "\n".join(textwrap.wrap(text, 90, subsequent_indent="  "))


def reference(width: int = 92) -> str:
    """Every command's ``--help``, as markdown: docs/cli-reference.md, written by ``make
    docs`` and compared with the parser by tests/test_docs.py (it cannot go stale)."""
    parser = _parser()
    sections = ["# CLI reference\n\nWhat `gdn-fx COMMAND --help` prints (written by `make docs` "
                "from the parser itself).\n"]
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, sub in [("gdn-fx", parser), *commands.choices.items()]:
        sub.formatter_class = _fixed_width(sub.formatter_class, width)
        title = name if name == "gdn-fx" else f"gdn-fx {name}"
        sections.append(f"## {title}\n\n```text\n{sub.format_help().rstrip()}\n```\n")
    return "\n".join(sections)


def _fixed_width(formatter, width: int):
    """``formatter`` at ``width`` columns, whatever the terminal is."""
    return lambda prog: formatter(prog, width=width)


def _parser() -> argparse.ArgumentParser:
    from gdn_fx.cli_text import add_text_arguments

    parser = argparse.ArgumentParser(prog="gdn-fx", description=__doc__, epilog=EXAMPLES[None],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    demo = _subparser(sub, "demo", "tiny random Qwen3.5 decode step, end to end")
    demo.add_argument("--out", type=Path, default=Path("out/demo.nnef.tgz"))
    demo.add_argument("--text", action="store_true",
                      help="the generation demo: a tiny checkpoint with a tokenizer made "
                      "offline, exported generation-ready, answering a text prompt in tract")
    export = _subparser(
        sub, "export", "a model as a generation-ready NNEF (symbolic S and P, prefill and "
        "decode), or with --seq-len one step at a fixed length", families=_families)
    _model_source(export, required=True)
    export.add_argument("--out", type=Path, required=True, help="*.nnef.tgz, .nnef.tar or .nnef")
    export.add_argument("--seq-len", type=int, default=None,
                        help="export one step of this many new tokens instead (past fixed)")
    export.add_argument("--dynamic-seq", action="store_true",
                        help="with --seq-len: symbolic sequence axis (checked at S=3 and 50)")
    export.add_argument("--dtype", choices=("f32", "f16", "bf16"), default="f32",
                        help="the model's arithmetic (f16: f16 in tract; on a CPU --weights f16 "
                        "gives the same file size and runs faster: docs/limits.md)")
    export.add_argument("--weights", choices=("f32", "f16", "q4_0"), default="f32",
                        help="how the NNEF stores the weights (f16: half size; q4_0: tract's "
                        "4-bit blocks for matmul weights); --check then compares with "
                        "transformers on the stored weights")
    export.add_argument("--runtime", choices=("cpu", "cuda"), default="cpu",
                        help="the tract runtime the NNEF is lowered for (the lowering table's "
                        "order and device checks follow it); not with --generalize, --stream")
    export.add_argument("--generalize", action="store_true",
                        help="generation-ready route without reify: torch.export at fixed "
                        "(S, P), collapse, gdn_fx.generalize to symbolic S and P")
    export.add_argument("--decode-graph", action="store_true",
                        help="also write the S = 1 graph X.decode.nnef.tgz (a second copy of "
                        "the weights; by default the one graph serves decode, its scans "
                        "taking one step at S = 1); with --runtime cuda the main graph then "
                        "prefills 512-token windows on the GPU (chunked_window: ~2x faster "
                        "prefill than the one graph's native kernel)")
    export.add_argument("--stream", action="store_true",
                        help="with --model (its default where the export allows it): trace "
                        "without the weights and write each one from the safetensors files, "
                        "converted on the way (memory does not grow with the model's f32 "
                        "size); the check then runs on the weights the file stores")
    export.add_argument("--in-memory", action="store_true",
                        help="with --model: load the checkpoint with transformers in --dtype "
                        "and export that (the route --generalize, --decode-graph, --batch and "
                        "--runtime cuda take)")
    export.add_argument("--batch", type=int, default=None, metavar="B",
                        help="the batched graph instead: B sequences of their own past lengths "
                        "per call (inputs position_ids and past_mask beside input_ids), run by "
                        "generate --prompts-file F --batch B (gdn_fx.hf.batch; CPU runtime, "
                        "not with --generalize, --decode-graph, --stream)")
    export.add_argument("--no-check", action="store_true",
                        help="skip the short tract generation compared with transformers")
    generate = _subparser(sub, "generate", "generation in tract from an export: text or "
                          "token ids in, the answer streamed out")
    generate.add_argument("--nnef", type=Path, required=True,
                          help="the export (its X.decode.nnef.tgz is used when present)")
    add_text_arguments(generate)
    generate.add_argument("--max-new-tokens", type=int, default=None, metavar="N",
                          help="new tokens at most (default: the checkpoint's "
                          "generation_config.json, as transformers' generate takes it: its "
                          "max_new_tokens, else its max_length minus the prompt, else "
                          "transformers' default of 20; said on stderr as [length])")
    generate.add_argument("--prefill-chunk", type=int, default=None,
                          help="feed the prompt in calls of N tokens (default: the longest "
                          "chunk whose activations fit the L2 cache; 0: the whole prompt in "
                          "one call)")
    generate.add_argument("--runtime", choices=("cpu", "cuda"), default="cpu",
                          help="the tract runtime that runs the export (cuda: tract's CUDA "
                          "runtime; the default prompt chunk is then the whole prompt)")
    generate.add_argument("--kv-in-state", action="store_true",
                          help="keep the attention caches inside tract's State (on the GPU "
                          "under --runtime cuda) instead of passing them in and out each call")
    generate.add_argument("--no-decode", action="store_true",
                          help="let the main graph serve decode (ignore X.decode.nnef.tgz)")
    generate.add_argument("--check", action="store_true",
                          help="compare every token and logit with transformers' generate on "
                          "the model named by --family / --config / --model, holding the "
                          "weights as --nnef stores them (f16 rounded, Q4_0 dequantized)")
    _model_source(generate, required=False, seed_flag="--weights-seed")
    diff = _subparser(sub, "diff", "structural diff of two programs (.pt2) or NNEF exports")
    diff.add_argument("a", type=Path)
    diff.add_argument("b", type=Path)
    return parser


def _diff(a: Path, b: Path) -> int:
    """The structural diff; for two saved programs also whether they compute the same (run on
    the same random inputs, as collapse's translation validation does)."""
    import torch

    from gdn_fx.diff import graph_diff, load_graph
    from gdn_fx.errors import UsageError
    from gdn_fx.passes import compare_programs

    for path in (a, b):
        if not path.exists():
            raise UsageError(f"{path} does not exist")
    first, second = load_graph(a), load_graph(b)
    print(graph_diff(first, second))
    programs = all(isinstance(p, torch.export.ExportedProgram) for p in (first, second))
    if programs:
        reason = compare_programs(first, second)
        print("computes the same: yes" if reason is None else f"computes the same: NO, {reason}")
    return 0


def _model_source(parser: argparse.ArgumentParser, required: bool,
                  seed_flag: str = "--seed") -> None:
    source = parser.add_mutually_exclusive_group(required=required)
    source.add_argument("--family", help="a built-in tiny config (gdn_fx.hf.FAMILIES; "
                        "listed below)")
    source.add_argument("--config", type=Path, help="a transformers config.json")
    source.add_argument("--model", type=Path, dest="model_dir",
                        help="a transformers checkpoint folder (config.json + weights)")
    # generate's --seed is the sampling seed: there the weights seed is --weights-seed.
    parser.add_argument(seed_flag, type=int, default=0, dest="seed",
                        help="weights seed for --family/--config")


def _export(job) -> int:
    from gdn_fx.pipeline import render, run

    with _staged(job) as (staged, say):
        report = run(staged, say=say)
        if report.ok:
            report.nnef_path = _move_in(staged.out, job.out)
        print(_unstaged(render(report), staged, job))
        _not_kept(report.ok, job.out)
    return 0 if report.ok else 1


@contextlib.contextmanager
def _staged(job):
    """(a copy of ``job`` writing into a hidden folder beside ``job.out``, a ``say`` that
    prints its progress lines with the final paths); the folder and whatever is left in it
    are removed at the end, also on an error: nothing at --out looks like a finished export
    unless the command moved it there (:func:`_move_in`)."""
    import dataclasses

    from gdn_fx.hf.nnef import staging

    with staging(job.out) as folder:
        staged = dataclasses.replace(job, out=folder / job.out.name)
        yield staged, lambda line: print(_unstaged(line, staged, job), flush=True)


@contextlib.contextmanager
def _pair_warnings_in_one_line(spell=lambda text: text):
    """The Generator's UnverifiedPair warnings printed as one ``gdn-fx: warning:`` line each
    (paths through ``spell``), as errors are; other warnings go out as they would have."""
    from gdn_fx.runtime.artifact import UnverifiedPair

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UnverifiedPair)
        yield
    for warning in caught:
        if issubclass(warning.category, UnverifiedPair):
            print(f"gdn-fx: warning: {spell(str(warning.message))}", file=sys.stderr)
        else:
            warnings.showwarning(warning.message, warning.category, warning.filename,
                                 warning.lineno)


def _unstaged(text: str, staged, job) -> str:
    """``text`` with the staged paths spelled as the final ones."""
    final = "" if str(job.out.parent) == "." else str(job.out.parent) + os.sep
    return text.replace(str(staged.out.parent) + os.sep, final)


def _move_in(staged: Path, final: Path) -> Path:
    """Rename the staged export (and its decode graph, when there is one) to ``final``: the
    decode graph first, the main graph last; a decode graph of an earlier export at the
    final place goes when this export has none (it would not match)."""
    import shutil

    from gdn_fx.hf.generator import decode_path

    for source, target in ((decode_path(staged), decode_path(final)), (staged, final)):
        if target.is_dir():
            shutil.rmtree(target)
        elif target.exists():
            target.unlink()
        if source.exists():
            os.replace(source, target)
    return final


def _not_kept(ok: bool, out: Path) -> None:
    if not ok:
        print(f"not written to {out}: the export failed its check (--no-check writes an "
              "unchecked generation-ready export)")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``gdn-fx`` command; returns the exit status (2: refused input)."""
    try:
        from gdn_fx.errors import GdnFxError

        args = _parser().parse_args(argv)
        what = _needs_exporter(args)
        missing = missing_export_modules() if what else []
        if missing:  # a runtime-only install: one line saying what to install
            print(_exporter_missing(what, missing), file=sys.stderr)
            return 2
        try:
            return _dispatch(args)
        except GdnFxError as err:  # a refusal with a reason, not a crash
            from gdn_fx.cli_checks import one_line

            print(one_line(err), file=sys.stderr)
            return 2
        except ImportError as err:  # an exporter's module reached where none was expected
            name = (getattr(err, "name", None) or "").split(".")[0]
            if name not in EXPORT_MODULES:
                raise
            print(_exporter_missing(args.command, [name]), file=sys.stderr)
            return 2
    except KeyboardInterrupt:  # Ctrl-C (also while the imports load): one line, no traceback
        sys.stdout.flush()
        print("gdn-fx: interrupted (Ctrl-C)", file=sys.stderr, flush=True)
        return INTERRUPTED




def _dispatch(args) -> int:
    from gdn_fx.cli_checks import check

    check(args)  # before any work: files, numbers, names (each refusal one line, status 2)
    if args.command == "diff":
        return _diff(args.a, args.b)
    if args.command == "generate":  # the runtime: no torch unless --check asks for it
        return _generate(args)
    from gdn_fx.pipeline import Job

    if args.command == "demo" and args.text:
        from gdn_fx.demo_text import run_demo

        return run_demo(args.out)
    if args.command == "demo":
        return _export(Job(family="qwen3_5", out=args.out))
    job = Job(family=args.family, config=args.config, model_dir=args.model_dir, out=args.out,
              seq_len=args.seq_len or 1, dynamic_seq=args.dynamic_seq, dtype=args.dtype,
              seed=args.seed, weights=args.weights,
              route="generalize" if args.generalize else "reify", runtime=args.runtime,
              decode_graph=args.decode_graph, stream=_streams(args), batch=args.batch)
    if args.seq_len is None and not args.dynamic_seq:
        return _export_generator(job, check=not args.no_check)
    return _export(job)


# Options of the generation-ready export that need the model's weights in memory.
IN_MEMORY_ONLY = ("generalize", "decode_graph", "batch", "runtime")


def _in_memory_for(args) -> list[str]:
    """The options given that only the in-memory route takes."""
    return [f"--{flag.replace('_', '-')}" for flag in IN_MEMORY_ONLY
            if getattr(args, flag) not in (None, False, "cpu")]


def _streams(args):
    """How the export reads --model DIR's weights: streamed with --stream (True); by default
    for the generation-ready export, where no option needs them in memory, "auto" (streamed
    where the checkpoint's layout allows it: the in-memory route holds the whole model in f32,
    12x a bf16 checkpoint at the 0.8B shape, docs/FACTS.md); else in memory (False)."""
    if args.command != "export" or args.model_dir is None or args.in_memory:
        return False
    if args.stream or args.seq_len is not None or args.dynamic_seq:
        return args.stream
    needs = _in_memory_for(args)
    if needs:
        print(f"export: {args.model_dir} is loaded in memory ({', '.join(needs)} takes the "
              "in-memory route; without it the weights are streamed)")
    return "auto" if not needs else False


def _export_generator(job, check: bool) -> int:
    """The generation-ready export, written beside --out and moved in when it is OK."""
    import dataclasses

    from gdn_fx.hf.generator import decode_path
    from gdn_fx.pipeline import render_generator, run_generator

    with _staged(job) as (staged, say):
        with _pair_warnings_in_one_line(lambda text: _unstaged(text, staged, job)):
            report = run_generator(staged, say=say, check=check)
        if report.ok:
            files = report.files
            main = _move_in(files.main, job.out)
            decode = None if files.decode is None else decode_path(main)
            report.files = dataclasses.replace(files, main=main, decode=decode)
            _carry_text_files(job)
        print(_unstaged(render_generator(report), staged, job))
        _not_kept(report.ok, job.out)
    return 0 if report.ok else 1


def _carry_text_files(job) -> None:
    """The checkpoint's tokenizer and generation config beside the export (X.text), so that
    ``generate --prompt TEXT`` needs no --model; nothing when the folder holds no tokenizer."""
    from gdn_fx.runtime.text import save_text_files

    if job.model_dir is not None:
        carried = save_text_files(job.model_dir, job.out)
        if carried is not None:
            print(f"text: {carried} (tokenizer, generation config: generate --prompt TEXT "
                  "reads them)")


def _generate(args) -> int:
    """Tokens in tract, as transformers' generate gives them for the checkpoint (its EOS ids,
    context and sampling); token ids in and out (gdn_fx.cli_text.generate_ids), or text
    prompts, sampling flags, stop strings and --json (gdn_fx.cli_text.generate_text); with
    --check, against transformers on the same model."""
    from gdn_fx.cli_text import generate_ids, generate_text, uses_text_path

    run = generate_text if uses_text_path(args) else generate_ids
    with _pair_warnings_in_one_line():
        return run(args)


if __name__ == "__main__":
    sys.exit(main())
