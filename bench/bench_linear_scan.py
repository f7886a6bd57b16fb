"""The gated_linear_scan lowerings, one Mamba2 layer core of Falcon-H1-0.5B, tract on one thread.

Falcon-H1-0.5B's Mamba2 mixer (its config: mamba_n_heads 24, mamba_d_head 64, mamba_d_state
128, mamba_n_groups 1) reaches the op as q = C, k = B [1, S, Hk = 1, Dk = 128], v = dt * x
[1, S, Hv = 24, Dv = 64] (G = 24 value heads per key head), g = dt * A [1, S, 24] (one log
decay per head), scale 1, a state [1, 24, 128, 64]. For each S (1, 64, 512 by default) every
candidate of the lowering table that accepts the static S is forced and timed, plus the
candidates that serve a symbolic S, each exported ONCE with a symbolic sequence axis and run at
every length, and the op's eager kernel (torch, one thread, ``fast_scan_kernel``: its chunked
form). Every tract path is checked against the float64 recurrence first (WRONG past 1e-4).

Paths are timed round-robin in one run; "vs matmul" is the median over rounds of the
per-round ratio to the static "matmul" loop, with its interquartile range. "load ms" is tract's
load + into_runnable of the graph.

    .venv/bin/python bench/bench_linear_scan.py                  # S = 1, 64, 512
    .venv/bin/python bench/bench_linear_scan.py --quick          # smoke run: tiny layer
    .venv/bin/python bench/bench_linear_scan.py --lengths 100 --rounds 15
    .venv/bin/python bench/bench_linear_scan.py --value-first      # as Mamba2's drop-in feeds it

``--value-first`` gives the state as transformers keeps a Mamba2 state, [1, 24, 64, 128]
(value-first), transposed into the op's key-first contract and the final state back, as
reify's drop-in does (gdn_fx/hf/ssm_dropins.py): where a lowering's own layout cancels those
moves, the copies are gone from the timings.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from torch import nn  # noqa: E402

import common  # noqa: E402
from bench_gdn_fast import quartiles  # noqa: E402

TOLERANCE = 1e-4
NAMES = ["q", "k", "v", "g", "s0"]
SEQ_AXES = {name: {1: "S"} for name in NAMES[:4]}
OP = "gated_linear_scan"
SYMBOLIC = ("split", "chunked", "matmul")  # the candidates that serve a symbolic S
REFERENCE = "matmul"


@dataclass(frozen=True)
class Layer:
    """The benchmarked layer core (Falcon-H1-0.5B's Mamba2 mixer by default)."""

    key_heads: int = 1
    groups: int = 24
    dk: int = 128
    dv: int = 64
    value_first: bool = False  # the state given [B, Hv, Dv, Dk] (--value-first)

    def inputs(self, seq: int, seed: int = 0) -> tuple:
        """q, k, v, g, s0 in ranges a trained Mamba2 gives: dt = softplus(.) around 0.01-0.1,
        A = -exp(A_log) in [-16, -1], so g = dt * A mostly in (-1.6, 0)."""
        gen = torch.Generator().manual_seed(seed)
        hv = self.key_heads * self.groups

        def rnd(*shape):
            return torch.randn(*shape, generator=gen)

        dt = nn.functional.softplus(rnd(1, seq, hv) - 3.0)
        a = -torch.exp(torch.rand(hv, generator=gen) * 2.77)
        x = rnd(1, seq, hv, self.dv)
        state = 0.1 * rnd(1, hv, self.dk, self.dv)
        if self.value_first:
            state = state.transpose(-1, -2).contiguous()
        return (rnd(1, seq, self.key_heads, self.dk), rnd(1, seq, self.key_heads, self.dk),
                dt.unsqueeze(-1) * x, dt * a, state)

    def __str__(self) -> str:
        first = ", state value-first" if self.value_first else ""
        return (f"B=1, Hk={self.key_heads}, G={self.groups}, Dk={self.dk}, Dv={self.dv}, "
                f"f32, scale 1{first}")


class Fused(nn.Module):
    """The fused op alone: its two outputs are the graph's (``value_first``: the state in
    and out transposed around it, as Mamba2's drop-in does)."""

    def __init__(self, value_first: bool = False):
        super().__init__()
        self.value_first = value_first

    def forward(self, q, k, v, g, s0):
        if not self.value_first:
            return torch.ops.gdn_fx.gated_linear_scan(q, k, v, g, s0, scale=1.0)
        out, final = torch.ops.gdn_fx.gated_linear_scan(q, k, v, g, s0.transpose(-1, -2),
                                                        scale=1.0)
        return out, final.transpose(-1, -2).contiguous()


def oracle(inputs: Sequence[torch.Tensor], value_first: bool = False) -> tuple:
    """The float64 recurrence on the same inputs."""
    from gdn_fx.reference import recurrent_linear_reference

    q, k, v, g, s0 = (x.double() for x in inputs)
    if not value_first:
        return recurrent_linear_reference(q, k, v, g, scale=1.0, initial_state=s0)
    out, final = recurrent_linear_reference(q, k, v, g, scale=1.0,
                                            initial_state=s0.transpose(-1, -2))
    return out, final.transpose(-1, -2)


@dataclass
class Timed:
    """One timed path: a name, the call, its relative error and load time (tract only)."""

    name: str
    call: Callable[[], object]
    error: Optional[float] = None
    load: Optional[float] = None


def _export(program, path: Path, name: str, dynamic: bool = False) -> Path:
    import gdn_fx

    return Path(gdn_fx.export_nnef(program, path, choose={OP: name}, input_names=NAMES,
                                   dynamic_axes=SEQ_AXES if dynamic else None))


def tract_path(name: str, nnef: Path, inputs: tuple, want: tuple) -> Timed:
    """Load ``nnef`` in tract, check it against ``want``, return the timed call."""
    loaded = common.tract_load(nnef)
    arrays = common.numpy_inputs(inputs)
    return Timed(name, common.tract_call(loaded.runnable, arrays),
                 common.rel_error(loaded.runnable, arrays, want), loaded.load + loaded.optimize)


def static_paths(layer: Layer, seq: int, inputs: tuple, want: tuple,
                 folder: Path) -> list[Timed]:
    """Every candidate that accepts the static ``seq``, forced."""
    from gdn_fx.lowering import plan_lowering

    program = torch.export.export(Fused(layer.value_first), inputs)
    paths = []
    for name in common.candidates(OP):
        try:
            plan_lowering(program, choose={OP: name})
        except Exception as exc:  # noqa: BLE001  (a candidate that refuses this S: no row)
            common.emit(f"- {name} at S={seq}: {common.refusal(exc, name)}")
            continue
        nnef = _export(program, folder / f"{name}_s{seq}.nnef", name)
        paths.append(tract_path(name, nnef, inputs, want))
    return paths


def symbolic_graphs(layer: Layer, folder: Path) -> dict[str, Path]:
    """Each candidate of SYMBOLIC exported once with a symbolic sequence axis (traced at 4)."""
    program = torch.export.export(Fused(layer.value_first), layer.inputs(4))
    return {name: _export(program, folder / f"{name}_symbolic.nnef", name, dynamic=True)
            for name in SYMBOLIC}


def eager_path(inputs: tuple, value_first: bool = False) -> Timed:
    """The op's eager kernel in its fast (chunked) form, as torch runs it on one thread."""
    from gdn_fx.ops import fast_scan_kernel

    def call():
        with fast_scan_kernel():
            return Fused(value_first)(*inputs)

    return Timed("torch eager op (1 thread)", call)


def ratio_cell(samples: common.Samples, name: str, reference: str) -> str:
    per_round = [a / b for a, b in zip(samples.rounds[name], samples.rounds[reference])]
    q1, q2, q3 = quartiles(per_round)
    return f"{q2:.3g}x [{q1:.3g}, {q3:.3g}]"


def table(title: str, paths: list[Timed], rounds: int) -> None:
    """Time ``paths`` round-robin and print one markdown table."""
    samples = common.interleave({p.name: p.call for p in paths}, rounds)
    columns = ["path", "median ms", f"vs {REFERENCE}", "load ms", "rel. error"]
    rows = [[p.name, common.ms(samples.median(p.name)), ratio_cell(samples, p.name, REFERENCE),
             common.ms(p.load), common.error_cell(p.error, TOLERANCE)] for p in paths]
    common.emit(common.header(title, f"{rounds} interleaved rounds, median of per-round "
                                     "ratios [interquartile range]"))
    common.emit(common.markdown(columns, rows) + "\n")


def length_part(layer: Layer, seq: int, symbolic: dict[str, Path], folder: Path,
                rounds: int) -> None:
    inputs = layer.inputs(seq, seed=seq)
    want = oracle(inputs, layer.value_first)
    paths = static_paths(layer, seq, inputs, want, folder)
    paths += [tract_path(f"{name} (symbolic S)", nnef, inputs, want)
              for name, nnef in symbolic.items()]
    paths.append(eager_path(inputs, layer.value_first))
    table(f"gated_linear_scan S={seq} ({layer})", paths, rounds)


def main() -> None:
    ap = common.parser(__doc__.splitlines()[0])
    ap.add_argument("--lengths", nargs="+", type=int, default=None,
                    help="sequence lengths (default 1 64 512; quick 1 70)")
    ap.add_argument("--value-first", action="store_true",
                    help="the state value-first, transposed around the op (module doc)")
    args = ap.parse_args()
    torch.set_num_threads(1)  # torch eager is compared on one thread, as tract runs
    common.silence_warnings()
    import gdn_fx  # noqa: F401  (registers torch.ops.gdn_fx)

    layer = Layer(1, 2, 16, 8, args.value_first) if args.quick else Layer(
        value_first=args.value_first)
    rounds = common.rounds_for(args, full=9)
    folder = common.workdir(args, "linear_scan")
    symbolic = symbolic_graphs(layer, folder)
    for seq in args.lengths or ([1, 70] if args.quick else [1, 64, 512]):
        length_part(layer, seq, symbolic, folder, rounds)


if __name__ == "__main__":
    main()
