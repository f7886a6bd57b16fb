"""Run every benchmark in bench/ and print their markdown tables (``make bench``).

    .venv/bin/python bench/run_all.py                 # full mode (long: tens of minutes)
    .venv/bin/python bench/run_all.py --quick         # smoke run: small sizes, 1-2 rounds
    .venv/bin/python bench/run_all.py --only tract conv --out bench.md

Each script runs in its own process (its own torch thread setting, no shared caches) with the
same interpreter; its tables go to stdout (and to --out), the libraries' chatter on stderr goes
to a log file whose tail is shown when a script fails. A script that is not there yet
(bench_gdn_fast.py) is skipped with a note.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional, TextIO

HERE = Path(__file__).resolve().parent
# (short name, script): the order tables are printed in.
SCRIPTS = (
    ("pass", "bench_pass.py"),
    ("nnef", "bench_nnef.py"),
    ("tract", "bench_tract.py"),
    ("conv", "bench_conv.py"),
    ("moe", "bench_moe.py"),
    ("gdn_fast", "bench_gdn_fast.py"),
    ("linear_scan", "bench_linear_scan.py"),
    ("generate", "bench_generate.py"),
    ("upper_state", "bench_upper_state.py"),
)


def arguments(argv: Optional[list]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smoke run of every script")
    ap.add_argument("--only", nargs="+", choices=[name for name, _ in SCRIPTS],
                    help="run only these benchmarks")
    ap.add_argument("--out", type=Path, help="also write the tables to this markdown file")
    return ap.parse_args(argv)


def run_script(script: Path, quick: bool, sink: list[TextIO], logs: Path) -> int:
    """Run one script, echo its stdout to every sink; returns its exit code."""
    command = [sys.executable, str(script.relative_to(Path.cwd()) if script.is_relative_to(
        Path.cwd()) else script)] + (["--quick"] if quick else [])
    log = logs / f"{script.stem}.log"
    start = time.perf_counter()
    with open(log, "w") as err:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=err, text=True)
        for line in process.stdout:
            write(sink, line)
        code = process.wait()
    took = time.perf_counter() - start
    if code:
        tail = log.read_text().splitlines()[-15:]
        write(sink, f"\n**{script.name} FAILED** (exit {code}, {took:.0f} s): "
                    f"`{shlex.join(command)}`; log {log}\n\n    " + "\n    ".join(tail) + "\n")
    else:
        write(sink, f"_{script.name}: {took:.0f} s; library messages in {log}_\n\n")
    return code


def write(sink: list[TextIO], text: str) -> None:
    for stream in sink:
        stream.write(text)
        stream.flush()


def main(argv: Optional[list] = None) -> int:
    args = arguments(argv)
    logs = Path(tempfile.mkdtemp(prefix="gdn_fx_bench_logs_"))
    out = open(args.out, "w") if args.out else None
    sink = [sys.stdout] + ([out] if out else [])
    mode = "quick (smoke)" if args.quick else "full"
    python = os.path.relpath(sys.executable) if sys.executable.startswith(os.getcwd()) else \
        sys.executable
    write(sink, f"# gdn-fx benchmarks ({mode})\n\nCommand: `{shlex.join([python, *sys.argv])}` "
                f"(cwd {os.getcwd()}), {time.strftime('%Y-%m-%d %H:%M')}\n\n")
    failed = []
    for name, filename in SCRIPTS:
        if args.only and name not in args.only:
            continue
        script = HERE / filename
        if not script.exists():
            write(sink, f"_{filename}: not present, skipped._\n\n")
            continue
        if run_script(script, args.quick, sink, logs):
            failed.append(filename)
    if out:
        out.close()
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
