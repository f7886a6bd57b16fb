"""The ``gdn-fx`` command: demo, export, diff."""

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
    export = sub.add_parser("export", help="export one model family (or a config.json)")
    source = export.add_mutually_exclusive_group(required=True)
    source.add_argument("--family", help="a built-in tiny config (see gdn_fx.hf.FAMILIES)")
    source.add_argument("--config", type=Path, help="a transformers config.json")
    export.add_argument("--out", type=Path, required=True, help="*.nnef.tgz, .nnef.tar or .nnef")
    export.add_argument("--seq-len", type=int, default=1, help="new tokens per step (default 1)")
    export.add_argument("--dynamic-seq", action="store_true",
                        help="symbolic sequence axis in the NNEF (checked at S=3 and 50)")
    export.add_argument("--dtype", choices=("f32", "f16", "bf16"), default="f32")
    diff = sub.add_parser("diff", help="structural diff of two programs (.pt2) or NNEF exports")
    diff.add_argument("a", type=Path)
    diff.add_argument("b", type=Path)
    return parser


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
        print(f"gdn-fx: {type(err).__name__}: {err}", file=sys.stderr)
        return 2


def _dispatch(args) -> int:
    if args.command == "diff":
        from gdn_fx.diff import graph_diff, load_graph

        print(graph_diff(load_graph(args.a), load_graph(args.b)))
        return 0
    from gdn_fx.pipeline import Job

    if args.command == "demo":
        return _export(Job(family="qwen3_5", out=args.out))
    return _export(Job(family=args.family, config=args.config, out=args.out,
                       seq_len=args.seq_len, dynamic_seq=args.dynamic_seq, dtype=args.dtype))


if __name__ == "__main__":
    sys.exit(main())
