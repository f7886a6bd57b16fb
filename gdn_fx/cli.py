"""The ``gdn-fx`` command: demo, export, generate, diff."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional, Sequence


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gdn-fx", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="tiny random Qwen3.5 decode step, end to end")
    demo.add_argument("--out", type=Path, default=Path("out/demo.nnef.tgz"))
    export = sub.add_parser(
        "export", help="a model as a generation-ready NNEF (symbolic S and P, prefill and "
        "decode), or with --seq-len one step at a fixed length")
    _model_source(export, required=True)
    export.add_argument("--out", type=Path, required=True, help="*.nnef.tgz, .nnef.tar or .nnef")
    export.add_argument("--seq-len", type=int, default=None,
                        help="export one step of this many new tokens instead (past fixed)")
    export.add_argument("--dynamic-seq", action="store_true",
                        help="with --seq-len: symbolic sequence axis (checked at S=3 and 50)")
    export.add_argument("--dtype", choices=("f32", "f16", "bf16"), default="f32")
    export.add_argument("--weights", choices=("f32", "f16", "q4_0"), default="f32",
                        help="how the NNEF stores the weights (f16: half size; q4_0: tract's "
                        "4-bit blocks for matmul weights); --check then compares with "
                        "transformers on the stored weights")
    export.add_argument("--runtime", choices=("cpu", "cuda"), default="cpu",
                        help="the tract runtime the NNEF is lowered for (the lowering table's "
                        "order and device checks follow it); with --seq-len or --dynamic-seq")
    export.add_argument("--generalize", action="store_true",
                        help="generation-ready route without reify: torch.export at fixed "
                        "(S, P), collapse, gdn_fx.generalize to symbolic S and P")
    export.add_argument("--no-check", action="store_true",
                        help="skip the short tract generation compared with transformers")
    generate = sub.add_parser("generate", help="greedy generation in tract from an export")
    generate.add_argument("--nnef", type=Path, required=True,
                          help="the export (its X.decode.nnef.tgz is used when present)")
    generate.add_argument("--prompt-ids", required=True, help="token ids, e.g. 1,2,3")
    generate.add_argument("--max-new-tokens", type=int, default=64)
    generate.add_argument("--prefill-chunk", type=int, default=None,
                          help="feed the prompt in calls of N tokens (default: the longest "
                          "chunk whose activations fit the L2 cache; 0: the whole prompt in "
                          "one call)")
    generate.add_argument("--check", action="store_true",
                          help="compare every token and logit with transformers' generate on "
                          "the model named by --family / --config / --model")
    _model_source(generate, required=False)
    diff = sub.add_parser("diff", help="structural diff of two programs (.pt2) or NNEF exports")
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


def _model_source(parser: argparse.ArgumentParser, required: bool) -> None:
    source = parser.add_mutually_exclusive_group(required=required)
    source.add_argument("--family", help="a built-in tiny config (see gdn_fx.hf.FAMILIES)")
    source.add_argument("--config", type=Path, help="a transformers config.json")
    source.add_argument("--model", type=Path, dest="model_dir",
                        help="a transformers checkpoint folder (config.json + weights)")
    parser.add_argument("--seed", type=int, default=0, help="weights seed for --family/--config")


def _export(job) -> int:
    from gdn_fx.pipeline import render, run

    report = run(job, say=lambda line: print(line, flush=True))
    print(render(report))
    return 0 if report.ok else 1


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``gdn-fx`` command; returns the exit status (2: refused input)."""
    from gdn_fx.errors import GdnFxError

    args = _parser().parse_args(argv)
    try:
        return _dispatch(args)
    except GdnFxError as err:  # a refusal with a reason, not a crash
        from gdn_fx.cli_checks import one_line

        print(one_line(err), file=sys.stderr)
        return 2


def _dispatch(args) -> int:
    from gdn_fx.cli_checks import check

    check(args)  # before any work: files, numbers, names (each refusal one line, status 2)
    if args.command == "diff":
        return _diff(args.a, args.b)
    from gdn_fx.pipeline import Job

    if args.command == "demo":
        return _export(Job(family="qwen3_5", out=args.out))
    if args.command == "generate":
        return _generate(args)
    job = Job(family=args.family, config=args.config, model_dir=args.model_dir, out=args.out,
              seq_len=args.seq_len or 1, dynamic_seq=args.dynamic_seq, dtype=args.dtype,
              seed=args.seed, weights=args.weights,
              route="generalize" if args.generalize else "reify", runtime=args.runtime)
    if args.seq_len is None and not args.dynamic_seq:
        from gdn_fx.pipeline import render_generator, run_generator

        report = run_generator(job, say=lambda line: print(line, flush=True),
                               check=not args.no_check)
        print(render_generator(report))
        return 0 if report.ok else 1
    return _export(job)


def _generate(args) -> int:
    """Greedy tokens in tract; with --check, against transformers on the same model."""
    from gdn_fx.errors import UsageError
    from gdn_fx.hf.generator import Generator, check_generation, decode_path
    from gdn_fx.pipeline import Job, build_model

    try:
        prompt = [int(t) for t in args.prompt_ids.split(",") if t.strip()]
    except ValueError:
        raise UsageError(f"--prompt-ids must be integers separated by commas, got "
                         f"{args.prompt_ids!r}") from None
    if not prompt:
        raise UsageError("--prompt-ids is empty")
    if args.check and not (args.family or args.config or args.model_dir):
        raise UsageError("--check needs the model: --family, --config or --model")
    if not args.nnef.exists():
        raise UsageError(f"--nnef {args.nnef} does not exist")
    decode = decode_path(args.nnef)
    chunk = "auto" if args.prefill_chunk is None else (args.prefill_chunk or None)
    generator = Generator(args.nnef, decode if decode.exists() else None, prefill_chunk=chunk)
    result = generator.generate(prompt, args.max_new_tokens, progress=True)
    print("tokens: " + ",".join(map(str, result.tokens)))
    print(f"tract: {result.rates()}")
    if not args.check:
        return 0
    model, name = build_model(Job(family=args.family, config=args.config,
                                  model_dir=args.model_dir, seed=args.seed))
    found = check_generation(model, result)
    print(f"check against transformers ({name}): {found}")
    print("OK" if found.ok else "NOT OK")
    return 0 if found.ok else 1


if __name__ == "__main__":
    sys.exit(main())
