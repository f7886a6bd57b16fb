"""Shared harness of the benchmarks: interleaved timing, markdown tables, the programs measured.

The machines are shared and noisy, so every comparison is made inside ONE run: the things
compared are sampled round-robin (the starting candidate rotates each round), each sample is
the mean of enough calls to last ``min_time``, and a ratio is the median over rounds of the
per-round ratio (paired samples, so a slow spell hits both sides of a ratio alike).

Nothing here asserts a speed: benchmarks print tables, tests never time anything.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import re
import shlex
import statistics
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Optional, Sequence

import numpy as np
import torch
from torch import nn

# Qwen3.5's linear-attention layer core: 16 value heads of width 128 (keys too), one sequence.
HEADS, WIDTH, BATCH = 16, 128, 1
GDN_OP, CONV_OP = "gated_delta_scan", "causal_conv1d_update"
CORE_INPUTS = ["q", "k", "v", "g", "beta", "s0"]
CORE_OUTPUTS = ["out", "state"]


# --- command line and headers ---------------------------------------------------------------

def pin_allocator() -> str:
    """Keep glibc from returning large blocks to the kernel between calls, for this process.

    By default glibc serves blocks past a moving threshold with fresh mmaps, so a call that
    allocates big temporaries page-faults them in again, by an amount that depends on the
    process's history: torch's eager chunk rule (S = 500) ran at a median of 62-67 ms in four
    processes and 72-91 ms in three others. Pinned (53-70 ms in eight, none as slow), both
    engines reuse their memory (torch at its fastest: the comparisons are conservative)."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        mmap_threshold, trim_threshold, one_gib = -3, -1, 1 << 30
        done = libc.mallopt(mmap_threshold, one_gib) and libc.mallopt(trim_threshold, one_gib)
    except (OSError, AttributeError):
        done = 0
    return "glibc mmap/trim thresholds pinned at 1 GiB" if done else "allocator as found"


# Every benchmark script imports this module: its process is pinned from the start, unless
# it measures memory as users meet it (child(..., pinned=False)): pinned, every block under
# 1 GiB comes from the heap and stays there, so a peak RSS reads higher than unpinned.
UNPINNED = "GDN_FX_BENCH_UNPINNED"
ALLOCATOR = "allocator as found" if os.environ.get(UNPINNED) else pin_allocator()


def parser(description: str) -> argparse.ArgumentParser:
    """The options every benchmark script takes (--quick, --rounds, --workdir)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: small sizes, 1-2 rounds")
    ap.add_argument("--rounds", type=int, default=None,
                    help="timing rounds (default: 7 full, 2 quick)")
    ap.add_argument("--workdir", type=Path, default=None,
                    help="where NNEF files go (default: a fresh temporary folder)")
    return ap


def rounds_for(args: argparse.Namespace, full: int = 7, quick: int = 2) -> int:
    return args.rounds if args.rounds is not None else (quick if args.quick else full)


def workdir(args: argparse.Namespace, name: str) -> Path:
    """A folder for the NNEF files of one script (kept only when --workdir is given)."""
    if args.workdir is not None:
        folder = args.workdir / name
        folder.mkdir(parents=True, exist_ok=True)
        return folder
    import atexit
    import shutil
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix=f"gdn_fx_{name}_"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


def command_line() -> str:
    """The exact command that runs this script, as typed from the repository root."""
    python = os.path.relpath(sys.executable) if sys.executable.startswith(os.getcwd()) else \
        sys.executable
    return shlex.join([python, *sys.argv])


def versions() -> str:
    from importlib.metadata import PackageNotFoundError, version

    found = []
    for name in ("torch", "transformers", "torch_to_nnef", "tract"):
        try:
            found.append(f"{name} {version(name)}")
        except PackageNotFoundError:
            found.append(f"{name} (absent)")
    return ", ".join(found)


def header(title: str, measured: str) -> str:
    """The lines above a table: what was measured, on what machine, by which command."""
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return "\n".join([
        f"### {title}",
        "",
        f"Measured: {measured}",
        f"Machine: nproc {os.cpu_count()}, torch threads {torch.get_num_threads()}, "
        f"load average {load}; {ALLOCATOR}; {versions()}",
        f"Command: `{command_line()}`",
        "",
    ])


def markdown(columns: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A markdown table; cells are str()-ed, None prints as '-'."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join("-" if c is None else str(c) for c in row) + " |")
    return "\n".join(lines)


def emit(text: str) -> None:
    print(text, flush=True)


# --- number formatting ----------------------------------------------------------------------

def ms(seconds: Optional[float]) -> Optional[str]:
    """Seconds as milliseconds with 3 significant digits."""
    if seconds is None or math.isnan(seconds):
        return None
    value = seconds * 1e3
    return f"{value:.3g}" if value < 1000 else f"{value:,.0f}"


def ratio(value: Optional[float]) -> Optional[str]:
    if value is None or math.isnan(value):
        return None
    return f"{value:.3g}x"


def percent(value: Optional[float]) -> Optional[str]:
    return None if value is None else f"{100 * value:.2g}%"


# --- timing ---------------------------------------------------------------------------------

def once(fn: Callable[[], object]) -> tuple[float, object]:
    """(seconds, result) of one call."""
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def _per_call(fn: Callable[[], object], number: int) -> float:
    start = time.perf_counter()
    for _ in range(number):
        fn()
    return (time.perf_counter() - start) / number


def calibrate(fn: Callable[[], object], min_time: float, warmup: int) -> int:
    """Calls per sample so that one sample lasts about ``min_time`` (after ``warmup`` calls)."""
    seconds = 0.0
    for _ in range(max(1, warmup)):
        seconds, _ = once(fn)
    return max(1, min(10_000, math.ceil(min_time / max(seconds, 1e-7))))


def median_of(values) -> float:
    return statistics.median(list(values))


def median_seconds(call: Callable[[], object], calls: int, warmup: int = 3) -> float:
    """The median seconds of ``calls`` single calls, after ``warmup`` untimed ones."""
    for _ in range(warmup):
        call()
    return median_of(once(call)[0] for _ in range(calls))


@dataclass
class Samples:
    """Per-round seconds-per-call of each candidate, sampled round-robin."""

    rounds: dict[str, list[float]]

    def median(self, name: str) -> float:
        return statistics.median(self.rounds[name])

    def ratio(self, name: str, reference: str) -> float:
        """Median over rounds of (name / reference), each round's pair measured together."""
        pairs = zip(self.rounds[name], self.rounds[reference])
        return statistics.median(a / b for a, b in pairs)

    def fastest(self, names: Optional[Sequence[str]] = None) -> str:
        return min(names or self.rounds, key=self.median)


def interleave(calls: Mapping[str, Callable[[], object]], rounds: int, warmup: int = 2,
               min_time: float = 0.05) -> Samples:
    """Time each callable round-robin: ``rounds`` samples each, starting point rotating."""
    names = list(calls)
    numbers = {name: calibrate(calls[name], min_time, warmup) for name in names}
    samples: dict[str, list[float]] = {name: [] for name in names}
    gc.collect()
    for r in range(rounds):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            samples[name].append(_per_call(calls[name], numbers[name]))
    return Samples(samples)


# --- the layer core: transformers' own rules -------------------------------------------------

class Core(nn.Module):
    """One GDN layer core as Qwen3.5 runs it: transformers' recurrent (or chunk) delta rule with
    l2-normalised q/k in the kernel, an initial state given, the final state returned."""

    def __init__(self, rule: str = "recurrent"):
        super().__init__()
        from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

        rules = {"recurrent": hf.torch_recurrent_gated_delta_rule,
                 "chunk": hf.torch_chunk_gated_delta_rule}
        self.rule = rules[rule]

    def forward(self, q, k, v, g, beta, s0):
        return self.rule(q, k, v, g, beta, initial_state=s0, output_final_state=True,
                         use_qk_l2norm_in_kernel=True)


def core_inputs(seq: int, heads: int = HEADS, width: int = WIDTH, batch: int = BATCH,
                seed: int = 0) -> tuple[torch.Tensor, ...]:
    """q, k, v [B,S,H,D], g (log decay) and beta [B,S,H], s0 [B,H,D,D], f32, realistic ranges."""
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen)

    g = torch.nn.functional.logsigmoid(rnd(batch, seq, heads) + 3.0)  # decays near 1, as trained
    beta = torch.sigmoid(rnd(batch, seq, heads))
    return (rnd(batch, seq, heads, width), rnd(batch, seq, heads, width),
            rnd(batch, seq, heads, width), g, beta, 0.1 * rnd(batch, heads, width, width))


def export_core(seq: int) -> torch.export.ExportedProgram:
    """The recurrent rule at length ``seq`` through torch.export (training IR, unrolled)."""
    return torch.export.export(Core("recurrent"), core_inputs(seq))


def flat_tensors(outputs) -> list[torch.Tensor]:
    """The tensor leaves of a (nested) output, in order."""
    leaves = torch.utils._pytree.tree_leaves(outputs)
    return [x for x in leaves if isinstance(x, torch.Tensor)]


def count_nodes(program) -> int:
    graph = program.graph if hasattr(program, "graph") else program.graph_module.graph
    return len(graph.nodes)


def silence_warnings() -> None:
    """Quiet the libraries' per-call notices (torch-to-nnef version notes, FLA fallbacks)."""
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    for name in ("torch_to_nnef", "transformers", "gdn_fx", "torch._export", "torch.export"):
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
    except ImportError:
        pass


# --- lowering candidates and NNEF files ------------------------------------------------------

def candidates(op: str) -> tuple[str, ...]:
    """The candidate names of ``op`` in the lowering table, in table order (read each run, so
    a candidate added to the table is benchmarked without touching the benchmarks)."""
    from gdn_fx.lowering.table import candidate_names

    return candidate_names()[op]


@dataclass
class Written:
    """An NNEF file written for one path (a candidate or the unrolled graph), or why not."""

    name: str
    path: Optional[Path]
    write_seconds: float = float("nan")
    error: Optional[str] = None


def write_nnef(program, path: Path, name: str, choose: Optional[dict] = None,
               input_names: Optional[list] = None,
               output_names: Optional[list] = None) -> Written:
    """export_nnef with one candidate forced (or the un-collapsed program when choose is None);
    a refusal is recorded, not raised, so one broken candidate does not stop a benchmark."""
    import gdn_fx

    try:
        seconds, written = once(lambda: gdn_fx.export_nnef(
            program, path, choose=choose, input_names=input_names, output_names=output_names))
    except Exception as exc:  # noqa: BLE001  (the table shows why this path is missing)
        return Written(name, None, error=f"{type(exc).__name__}: {refusal(exc, name)}")
    return Written(name, Path(written), seconds)


def refusal(exc: BaseException, name: str) -> str:
    """The reason a forced candidate gave (LoweringUnsupported lists every candidate's reason
    after the node's description), else the error's first line."""
    text = " ".join(str(exc).split())
    found = re.search(rf"\b{re.escape(name)}: (.*?)(?:; \w+: |\)$)", text)
    if found and "choose forces" not in found.group(1):
        return first_line(RuntimeError(found.group(1)))
    return first_line(exc)


def first_line(exc: BaseException, limit: int = 160) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def graph_text(path: Path) -> str:
    from gdn_fx.tract_check import nnef_text

    return nnef_text(path)


_STATEMENT = re.compile(r"^\s*[\w\s,\[\]()]+?=\s*([A-Za-z_][\w:]*)\s*[<(]", re.MULTILINE)


def nnef_ops(text: str) -> tuple[int, int, int]:
    """(operations in the main graph body, of which ``variable``s, operations inside fragment
    definitions) of a graph.nnef text. Fragments are written once, whatever the length."""
    start = re.search(r"^graph ", text, re.MULTILINE)
    cut = start.start() if start else 0
    names = _STATEMENT.findall(text[cut:])
    fragment_ops = len(_STATEMENT.findall(text[:cut]))
    return len(names), sum(1 for n in names if n == "variable"), fragment_ops


def archive_bytes(path: Path) -> tuple[int, int]:
    """(file size on disk, uncompressed bytes of all members) of an NNEF archive or folder."""
    if path.is_dir():
        sizes = [p.stat().st_size for p in path.rglob("*") if p.is_file()]
        return sum(sizes), sum(sizes)
    with tarfile.open(path) as archive:
        members = sum(m.size for m in archive.getmembers() if m.isfile())
    return path.stat().st_size, members


def human_bytes(count: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if count < 1024 or unit == "GiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return str(count)


# --- tract -----------------------------------------------------------------------------------

@dataclass
class Loaded:
    """A tract runnable and what it cost to get it (seconds)."""

    runnable: object
    load: float
    optimize: float


def tract_load(path: Path) -> Loaded:
    """``tract.nnef().with_tract_transformers().load(path)`` then ``into_runnable()``, timed."""
    import tract

    nnef = tract.nnef().with_tract_transformers()
    load_seconds, model = once(lambda: nnef.load(str(path)))
    optimize_seconds, runnable = once(model.into_runnable)
    return Loaded(runnable, load_seconds, optimize_seconds)


def numpy_inputs(tensors: Sequence[torch.Tensor]) -> list[np.ndarray]:
    return [t.detach().contiguous().numpy() for t in tensors]


def tract_call(runnable, arrays: list[np.ndarray]) -> Callable[[], object]:
    """A no-argument call running ``runnable`` on fixed inputs (the timed unit), as an
    application runs a model: one State kept across calls, inputs already tract tensors.
    (``runnable.run(numpy)`` would also time a new State and a numpy-to-tract copy of every
    input per call: ~0.15 ms, a fifth of a decode step.) The kept State must answer exactly as a
    fresh one, twice: else it is refused here, so what is timed is what was verified."""
    import tract

    tensors = [tract.Tensor.from_numpy(a) for a in arrays]
    state = runnable.spawn_state()
    fresh = [t.to_numpy() for t in runnable.run(arrays)]
    for _ in range(2):
        kept = [t.to_numpy() for t in state.run(tensors)]
        if not all(np.array_equal(a, b, equal_nan=True) for a, b in zip(kept, fresh)):
            raise RuntimeError("a tract State run twice differs from a fresh run")
    return lambda: state.run(tensors)


def rel_error(runnable, arrays: list[np.ndarray], want: Sequence[torch.Tensor]) -> float:
    """Largest relative error (max|tract - torch| / max|torch|) over the outputs."""
    from gdn_fx.tract_check import relative_error

    got = [t.to_numpy() for t in runnable.run(arrays)]
    return max(relative_error(g, w) for g, w in zip(got, want))


def error_cell(error: Optional[float], tolerance: float = 1e-4) -> Optional[str]:
    """The relative error, flagged WRONG past ``tolerance`` (a fast wrong path is no path)."""
    if error is None:
        return None
    return f"{error:.1e}" + ("" if error <= tolerance else " WRONG")


# --- the Qwen3.5-0.8B shape and one-thread child processes (bench_generate, peer, ...) -------

LIN, FULL = "linear_attention", "full_attention"
SHAPE = dict(vocab_size=248320, hidden_size=1024, num_attention_heads=8, num_key_value_heads=2,
             head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16,
             linear_key_head_dim=128, linear_value_head_dim=128, intermediate_size=3584,
             num_hidden_layers=24, layer_types=[LIN, LIN, LIN, FULL] * 6,
             tie_word_embeddings=True)
QUICK = dict(SHAPE, vocab_size=32000, num_hidden_layers=4, layer_types=[LIN, LIN, LIN, FULL])


def child(kind: str, *args: str, module: str = "bench_generate", pinned: bool = True,
          site: Optional[Path] = None, threads: int = 1, torch: bool = True) -> dict:
    """Run one engine (``module``'s function ``kind``) in a fresh process of ``threads``
    threads (one by default); its figures and peak RSS (``pinned=False``: glibc as users have
    it, see ALLOCATOR). ``site``: a folder whose gdn_fx is imported instead of this tree's
    (another revision's, installed there by ``install_revision``). ``torch=False``: a process
    that imports neither torch nor this module (``module`` must not either: tract_run), as a
    deployment of the torch-free runtime runs."""
    count = str(threads)
    env = dict(os.environ, OMP_NUM_THREADS=count, MKL_NUM_THREADS=count,
               TRACT_NUM_THREADS=count, RAYON_NUM_THREADS=count)  # tract's binary reads rayon's
    if site is not None:  # ahead of the editable install's finder, which comes last
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")]))
    if not pinned:
        env[UNPINNED] = "1"
    setup = "import torch; torch.set_num_threads(1); import common; " if torch else ""
    code = (f"import sys, json; sys.path.insert(0, {str(Path(__file__).parent)!r}); {setup}"
            f"import tract_run, {module} as m; "
            f"r = m.{kind}(*{list(args)!r}); "
            "r = r if isinstance(r, dict) else {'value': r}; "
            "r['peak_rss'] = tract_run.peak_rss(); "
            "print('RESULT', json.dumps(r))")
    # python -c puts its folder first on sys.path: from the repository root that is this
    # tree's gdn_fx, whatever PYTHONPATH says
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         cwd=site)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if not lines:
        raise RuntimeError(f"{kind} failed: {out.stderr[-2000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def install_revision(revision: str) -> Path:
    """gdn_fx as it was at git ``revision``, installed into a fresh folder (for ``child``'s
    ``site``): side by side with this tree in one run."""
    import tempfile

    root = Path(__file__).resolve().parent.parent
    folder = Path(tempfile.mkdtemp(prefix="gdn_fx_rev_"))
    tree, site = folder / "tree", folder / "site"
    tree.mkdir()
    archive = subprocess.run(["git", "-C", str(root), "archive", revision], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                    "--no-build-isolation", "--target", str(site), str(tree)], check=True)
    return site
