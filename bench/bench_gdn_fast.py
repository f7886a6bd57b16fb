"""The matmul-form GDN lowerings against tract's native operator, the unrolled step and torch.

Issue 9's figures, for one Qwen3.5-sized layer core (B=1, 16 heads, Dk=Dv=128, f32, q/k
l2-normalized in the kernel, scale 1/sqrt(Dk), an initial state):

- decode, S=1: each candidate of the lowering table (forced), the un-collapsed recurrent rule
  exported as is ("unrolled step"), torch eager (one thread). Ratios against the unrolled step
  and against the native operator.
- short prefill (S = 2..64 by default): which candidate serves short sequences best.
- prefill (S = 500 and 512 by default): the chunked candidates (static S: "chunked_unrolled";
  symbolic S: "chunked", ONE graph exported with a symbolic sequence axis and run at every
  length), "matmul", the native operator, torch's eager chunk rule (one thread).

Every path is timed round-robin in one run (the start rotates each round); a ratio is the
median over rounds of the per-round ratio, printed with its interquartile range, so a noisy
machine shows as a wide range. Every tract path is checked against the float64 recurrent
reference first (WRONG past 1e-4).

    .venv/bin/python bench/bench_gdn_fast.py                 # decode, short, prefill 500/512
    .venv/bin/python bench/bench_gdn_fast.py --quick         # smoke run: tiny layer, 2 rounds
    .venv/bin/python bench/bench_gdn_fast.py --parts prefill --lengths 512 --rounds 15
"""

from __future__ import annotations

import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from torch import nn  # noqa: E402

import common  # noqa: E402

TOLERANCE = 1e-4
NAMES = common.CORE_INPUTS
SEQ_AXES = {name: {1: "S"} for name in NAMES[:5]}
DECODE_PATHS = ("native", "scan", "matmul_step", "matmul", "chunked_unrolled", "chunked")
SHORT_PATHS = ("native", "matmul", "chunked_unrolled", "chunked")
PREFILL_PATHS = ("native", "matmul", "chunked_unrolled", "chunked")


@dataclass(frozen=True)
class Layer:
    """The benchmarked layer core."""

    heads: int
    width: int

    def inputs(self, seq: int, seed: int = 0) -> tuple:
        return common.core_inputs(seq, heads=self.heads, width=self.width, seed=seed)


class Fused(nn.Module):
    """The fused op with the native operator's flags (so every candidate may serve it)."""

    def forward(self, q, k, v, g, beta, s0):
        scale = q.shape[-1] ** -0.5
        return torch.ops.gdn_fx.gated_delta_scan(q, k, v, g, beta, s0, scale=scale,
                                                 qk_l2norm=True)


def oracle(inputs: Sequence[torch.Tensor]) -> tuple:
    """float64 recurrence on the same inputs (l2norm and scale as the kernel)."""
    from gdn_fx.reference import l2norm, recurrent_delta_rule_reference

    q, k, v, g, beta, s0 = (x.double() for x in inputs)
    return recurrent_delta_rule_reference(l2norm(q), l2norm(k), v, g, beta,
                                          scale=q.shape[-1] ** -0.5, initial_state=s0)


# --- paths: exported, loaded, checked ------------------------------------------------------

@dataclass
class Path_:
    """One timed path: a name, the call, its relative error (None for torch eager)."""

    name: str
    call: Callable[[], object]
    error: Optional[float] = None


def _export(program, path: Path, name: str, choose: Optional[dict],
            dynamic: bool = False) -> Path:
    import gdn_fx

    return Path(gdn_fx.export_nnef(program, path, choose=choose, input_names=NAMES,
                                   dynamic_axes=SEQ_AXES if dynamic else None))


def tract_path(name: str, nnef: Path, inputs: tuple, want: tuple) -> Path_:
    """Load ``nnef`` in tract, check it against ``want``, return the timed call."""
    runnable = common.tract_load(nnef).runnable
    arrays = common.numpy_inputs(inputs)
    return Path_(name, common.tract_call(runnable, arrays),
                 common.rel_error(runnable, arrays, want))


def candidate_paths(layer: Layer, seq: int, names: Sequence[str], folder: Path,
                    symbolic: Optional[Path] = None) -> list[Path_]:
    """Every candidate in ``names`` exported for static ``seq`` ("chunked" from the symbolic
    graph ``symbolic`` when given), loaded and checked."""
    inputs = layer.inputs(seq, seed=seq)
    want = oracle(inputs)
    program = torch.export.export(Fused(), inputs)
    paths = []
    for name in names:
        if name == "chunked" and symbolic is not None:
            nnef = symbolic
        else:
            nnef = _export(program, folder / f"{name}_s{seq}.nnef", name, {"*": name})
        paths.append(tract_path(name, nnef, inputs, want))
    return paths


def symbolic_chunked(layer: Layer, folder: Path) -> Path:
    """"chunked" exported ONCE with a symbolic sequence axis (traced at S=4)."""
    program = torch.export.export(Fused(), layer.inputs(4))
    return _export(program, folder / "chunked_symbolic.nnef", "chunked", {"*": "chunked"},
                   dynamic=True)


def unrolled_step(layer: Layer, folder: Path) -> Path_:
    """transformers' recurrent rule at S=1, exported WITHOUT collapsing (the unrolled step)."""
    inputs = layer.inputs(1, seed=1)
    program = torch.export.export(common.Core("recurrent"), inputs)
    nnef = _export(program, folder / "unrolled_s1.nnef", "unrolled", None)
    return tract_path("unrolled step", nnef, inputs, oracle(inputs))


def eager_path(name: str, rule: str, inputs: tuple) -> Path_:
    core = common.Core(rule)
    return Path_(name, lambda: core(*inputs))


# --- timing and tables ---------------------------------------------------------------------

def quartiles(values: list[float]) -> tuple[float, float, float]:
    if len(values) < 2:
        return values[0], values[0], values[0]
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q2, q3


def ratio_cell(samples: common.Samples, name: str, reference: str) -> str:
    """Median per-round ratio with its interquartile range: ``0.71x [0.69, 0.74]``."""
    per_round = [a / b for a, b in zip(samples.rounds[name], samples.rounds[reference])]
    q1, q2, q3 = quartiles(per_round)
    return f"{q2:.3g}x [{q1:.3g}, {q3:.3g}]"


def table(title: str, paths: list[Path_], references: Sequence[str], rounds: int) -> None:
    """Time ``paths`` round-robin and print one markdown table."""
    samples = common.interleave({p.name: p.call for p in paths}, rounds)
    columns = ["path", "median ms"] + [f"vs {r}" for r in references] + ["rel. error"]
    rows = []
    for p in paths:
        cells = [ratio_cell(samples, p.name, r) for r in references]
        rows.append([p.name, common.ms(samples.median(p.name)), *cells,
                     common.error_cell(p.error, TOLERANCE)])
    common.emit(common.header(title, f"{rounds} interleaved rounds, median of per-round "
                                     "ratios [interquartile range]"))
    common.emit(common.markdown(columns, rows) + "\n")


def decode_part(layer: Layer, folder: Path, rounds: int) -> None:
    inputs = layer.inputs(1, seed=1)
    paths = [unrolled_step(layer, folder),
             *candidate_paths(layer, 1, DECODE_PATHS, folder, symbolic_chunked(layer, folder)),
             eager_path("torch recurrent (1 thread)", "recurrent", inputs)]
    table(f"Decode S=1 (B=1, {layer.heads} heads, Dk=Dv={layer.width}, f32)", paths,
          ["unrolled step", "native"], rounds)


def short_part(layer: Layer, lengths: Sequence[int], folder: Path, rounds: int) -> None:
    symbolic = symbolic_chunked(layer, folder)
    for seq in lengths:
        inputs = layer.inputs(seq, seed=seq)
        paths = [*candidate_paths(layer, seq, SHORT_PATHS, folder, symbolic),
                 eager_path("torch recurrent (1 thread)", "recurrent", inputs)]
        table(f"Short prefill S={seq} (B=1, {layer.heads} heads, Dk=Dv={layer.width}, f32)",
              paths, ["matmul", "native"], rounds)


def prefill_part(layer: Layer, lengths: Sequence[int], folder: Path, rounds: int) -> None:
    symbolic = symbolic_chunked(layer, folder)
    for seq in lengths:
        inputs = layer.inputs(seq, seed=seq)
        paths = [eager_path("torch chunk (1 thread)", "chunk", inputs),
                 *candidate_paths(layer, seq, PREFILL_PATHS, folder, symbolic)]
        table(f"Prefill S={seq} (B=1, {layer.heads} heads, Dk=Dv={layer.width}, f32)", paths,
              ["torch chunk (1 thread)", "native"], rounds)


def main() -> None:
    ap = common.parser(__doc__.splitlines()[0])
    ap.add_argument("--parts", nargs="+", default=["decode", "short", "prefill"],
                    choices=["decode", "short", "prefill"])
    ap.add_argument("--lengths", nargs="+", type=int, default=None,
                    help="prefill lengths (default 500 512; quick 70)")
    ap.add_argument("--short", nargs="+", type=int, default=None,
                    help="short prefill lengths (default 2 4 8 16 32 64; quick 4)")
    ap.add_argument("--heads", type=int, default=None, help="heads (default 16; quick 2)")
    ap.add_argument("--width", type=int, default=None, help="Dk = Dv (default 128; quick 16)")
    args = ap.parse_args()
    torch.set_num_threads(1)  # torch eager is compared on one thread, as tract runs
    common.silence_warnings()
    import gdn_fx  # noqa: F401  (registers torch.ops.gdn_fx)

    layer = Layer(args.heads or (2 if args.quick else 16),
                  args.width or (16 if args.quick else 128))
    rounds = common.rounds_for(args, full=9)
    folder = common.workdir(args, "gdn_fast")
    if "decode" in args.parts:
        decode_part(layer, folder, rounds)
    if "short" in args.parts:
        short_part(layer, args.short or ([4] if args.quick else [2, 4, 8, 16, 32, 64]), folder,
                   rounds)
    if "prefill" in args.parts:
        prefill_part(layer, args.lengths or ([70] if args.quick else [500, 512]), folder,
                     rounds)


if __name__ == "__main__":
    main()
