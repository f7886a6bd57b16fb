"""tract speed: every lowering candidate and the unrolled graph, beside torch eager, in one run.

Two workloads, each at several lengths S:

- core: one Qwen3.5-sized GDN layer core (B=1, 16 heads, Dk=Dv=128), transformers' recurrent
  rule with ``use_qk_l2norm_in_kernel=True`` and an initial state, f32;
- model: a whole tiny qwen3_5 causal LM step (gdn_fx.hf.tiny_model + DecodeStep with the
  recurrent rule, so a prefill unrolls and collapses), f32, the model's default (SDPA)
  attention.

For every path: ``tract.nnef().with_tract_transformers().load(path)`` time, ``into_runnable()``
time and ``run([...])`` time; torch eager runs the recurrent and the chunk rule with one
thread. Run times are sampled round-robin over all paths; ratios are medians of per-round
ratios. Each tract path's outputs are checked against a float64 oracle (WRONG past 1e-4).

    .venv/bin/python bench/bench_tract.py                  # core S=1,8,64,256,512; model 1..256
    .venv/bin/python bench/bench_tract.py --quick          # S=1,8
    .venv/bin/python bench/bench_tract.py --part core --lengths 1 64
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import common  # noqa: E402

LENGTHS = {"core": ((1, 8, 64, 256, 512), (1, 8)), "model": ((1, 8, 64, 256), (1, 8))}
# Unrolled graphs load super-linearly in tract (docs/FACTS.md: S=256 ~38 s, S=512 ~300 s + 25 s),
# and torch-to-nnef writes them super-linearly too (bench_nnef: S=64 ~35 s, S=256 ~20 min).
UNROLLED_MAX = {"core": 256, "model": 64}
SLOW_LOAD = 5.0  # seconds: a path whose first load takes longer is loaded once only
TOLERANCE = 1e-4
CLASSES = (("decode (S=1)", 1, 1), ("short prefill (S=8-64)", 8, 64),
           ("long prefill (S>=256)", 256, 1 << 30))
MODEL_FAMILY = "qwen3_5"


@dataclass
class Case:
    """What one length of one workload measures."""

    seq: int
    inputs: tuple
    want: tuple  # float64 oracle outputs
    eager: dict[str, Callable[[], object]]
    collapsed: object
    unrolled: Optional[object]  # None: skipped (load time)
    input_names: list
    output_names: Optional[list] = None


@dataclass
class TractPath:
    """One NNEF path (a forced candidate, or the unrolled graph) through tract."""

    name: str
    written: common.Written
    loaded: Optional[common.Loaded] = None
    loads: list = field(default_factory=list)  # (load s, into_runnable s) per round
    error: Optional[float] = None
    failure: Optional[str] = None


# --- building the cases -----------------------------------------------------------------------

def core_case(seq: int, unrolled_max: int) -> Case:
    import gdn_fx

    inputs = common.core_inputs(seq)
    recurrent, chunk = common.Core("recurrent"), common.Core("chunk")
    want = core_oracle(inputs)
    program = common.export_core(seq)
    eager = {"torch eager recurrent": lambda: _no_grad(recurrent, inputs),
             "torch eager chunk": lambda: _no_grad(chunk, inputs)}
    unrolled = program if seq <= unrolled_max else None
    return Case(seq, inputs, want, eager, gdn_fx.collapse(program).program, unrolled,
                common.CORE_INPUTS, common.CORE_OUTPUTS)


def core_oracle(inputs: tuple) -> tuple:
    """The layer core in float64 (transformers' rule casts to f32 inside, so it cannot be the
    oracle): gdn_fx's token-by-token reference, itself tested against transformers."""
    from gdn_fx.reference import l2norm, recurrent_delta_rule_reference

    q, k, v, g, beta, s0 = (x.double() for x in inputs)
    with torch.no_grad():
        return recurrent_delta_rule_reference(l2norm(q), l2norm(k), v, g, beta,
                                              initial_state=s0)


def _no_grad(fn: Callable, args: tuple) -> object:
    with torch.no_grad():
        return fn(*args)


def model_case(seq: int, unrolled_max: int) -> Case:
    import gdn_fx
    from gdn_fx.hf import DecodeStep, tiny_model

    def step(dtype, rule):
        return DecodeStep(tiny_model(MODEL_FAMILY, dtype=dtype), rule=rule)

    recurrent, auto = step(torch.float32, "recurrent"), step(torch.float32, "auto")
    inputs = recurrent.example_inputs(seq_len=seq)
    oracle = step(torch.float64, "recurrent")
    states = (x.to(spec.dtype) for x, spec in zip(inputs[1:], oracle.specs))
    want = oracle.eager(inputs[0], *states)
    program = torch.export.export(recurrent, inputs)
    eager = {"torch eager recurrent": lambda: recurrent.eager(*inputs),
             "torch eager auto (chunk if S>1)": lambda: auto.eager(*inputs)}
    unrolled = program if seq <= unrolled_max else None
    return Case(seq, inputs, want, eager, gdn_fx.collapse(program).program, unrolled,
                recurrent.input_names, recurrent.output_names)


# --- measuring one case -----------------------------------------------------------------------

def write_paths(case: Case, folder: Path) -> list[TractPath]:
    """One NNEF per gated_delta_scan candidate (forced) and the unrolled graph."""
    paths = []
    for name in common.candidates(common.GDN_OP):
        written = common.write_nnef(case.collapsed, folder / f"s{case.seq}_{name}.nnef.tgz",
                                    name, {common.GDN_OP: name}, case.input_names,
                                    case.output_names)
        paths.append(TractPath(name, written))
    if case.unrolled is not None:
        written = common.write_nnef(case.unrolled, folder / f"s{case.seq}_unrolled.nnef.tgz",
                                    "unrolled", None, case.input_names, case.output_names)
        paths.append(TractPath("unrolled", written))
    return paths


def load_paths(paths: list[TractPath], rounds: int) -> None:
    """Load + into_runnable each written path, round-robin; a slow loader is loaded once."""
    for r in range(rounds):
        for path in paths:
            if path.written.path is None or path.failure or (r and _slow(path)):
                continue
            try:
                path.loaded = common.tract_load(path.written.path)
            except Exception as exc:  # noqa: BLE001  (the table says why)
                path.failure = f"tract: {type(exc).__name__}: {common.first_line(exc)}"
                continue
            path.loads.append((path.loaded.load, path.loaded.optimize))


def _slow(path: TractPath) -> bool:
    return bool(path.loads) and sum(path.loads[0]) > SLOW_LOAD


def check_paths(paths: list[TractPath], case: Case, arrays: list) -> None:
    for path in paths:
        if path.loaded is None:
            continue
        try:
            path.error = common.rel_error(path.loaded.runnable, arrays, case.want)
        except Exception as exc:  # noqa: BLE001
            path.failure = f"tract run: {type(exc).__name__}: {common.first_line(exc)}"
            path.loaded = None


@dataclass(frozen=True)
class Timed:
    """A correct tract path's run time at one length, and its ratios to the eager references."""

    seq: int
    name: str
    seconds: float
    ratios: tuple


def measure(case: Case, folder: Path, rounds: int,
            load_rounds: int) -> tuple[list[list], list[Timed]]:
    """Rows of one length (eager references first, then each tract path), and the timings of
    the tract paths that ran correctly."""
    arrays = common.numpy_inputs(case.inputs)
    paths = write_paths(case, folder)
    load_paths(paths, load_rounds)
    check_paths(paths, case, arrays)
    calls = dict(case.eager)
    calls.update({p.name: common.tract_call(p.loaded.runnable, arrays)
                  for p in paths if p.loaded is not None})
    samples = common.interleave(calls, rounds)
    eager_error = _eager_error(case)
    refs = list(case.eager)
    rows = [_row(case.seq, name, None, samples, refs, eager_error.get(name)) for name in refs]
    rows += [_row(case.seq, p.name, p, samples, refs, p.error) for p in paths]
    timed = [Timed(case.seq, p.name, samples.median(p.name),
                   tuple(samples.ratio(p.name, ref) for ref in refs))
             for p in paths if p.loaded is not None and p.error <= TOLERANCE]
    return rows, timed


def _eager_error(case: Case) -> dict[str, float]:
    from gdn_fx.tract_check import relative_error

    found = {}
    for name, call in case.eager.items():
        got = common.flat_tensors(call())
        found[name] = max(relative_error(g.detach().numpy(), w) for g, w in zip(got, case.want))
    return found


def _row(seq: int, name: str, path: Optional[TractPath], samples: common.Samples,
         refs: list, error: Optional[float]) -> list:
    load = optimize = None
    if path is not None:
        if path.loaded is None:
            why = path.failure or f"not written: {path.written.error}"
            return [seq, name, *[None] * (3 + len(refs)), why]
        load = common.median_of(p[0] for p in path.loads)
        optimize = common.median_of(p[1] for p in path.loads)
    ratios = [common.ratio(samples.ratio(name, ref)) for ref in refs]
    return [seq, name, common.ms(load), common.ms(optimize), common.ms(samples.median(name)),
            *ratios, common.error_cell(error, TOLERANCE)]


# --- report -------------------------------------------------------------------------------

def columns(refs: list[str]) -> list[str]:
    return ["S", "path", "load ms", "into_runnable ms", "run ms",
            *[f"run / {ref}" for ref in refs], "rel. err vs oracle"]


def fastest_by_class(timed: list[Timed]) -> list[list]:
    """For each shape class and length in it: the fastest correct lowering candidate (the
    unrolled graph is not one: it is what collapse removes), and the next one's time over it."""
    out = []
    for label, low, high in CLASSES:
        for seq in sorted({t.seq for t in timed if low <= t.seq <= high}):
            ranked = sorted((t for t in timed if t.seq == seq and t.name != "unrolled"),
                            key=lambda t: t.seconds)
            if not ranked:
                continue
            best = ranked[0]
            margin = (f"{ranked[1].name} {ranked[1].seconds / best.seconds:.3g}x"
                      if len(ranked) > 1 else None)
            out.append([label, seq, best.name, common.ms(best.seconds),
                        *map(common.ratio, best.ratios), margin])
    return out


def report(workload: str, rows: list[list], timed: list[Timed], refs: list[str],
           measured: str) -> None:
    common.emit(common.header(f"tract vs torch eager: {workload}", measured))
    common.emit(common.markdown(columns(refs) if rows else ["S"], rows))
    common.emit("")
    common.emit(common.markdown(["shape class", "S", "fastest candidate", "run ms",
                                 *[f"/ {ref}" for ref in refs], "next candidate / fastest"],
                                fastest_by_class(timed)))
    common.emit("")


DESCRIPTION = {
    "core": (core_case, "one GDN layer core: transformers' recurrent rule (B=1, H=16, "
             "Dk=Dv=128, l2norm in kernel, initial state), f32; oracle: the recurrence in "
             "float64 (gdn_fx.reference)"),
    "model": (model_case, f"a whole tiny {MODEL_FAMILY} step (gdn_fx.hf DecodeStep, recurrent "
              "rule, SDPA attention, 3 GDN layers + 1 attention layer, Dk=Dv=16), f32; the "
              "candidate is forced on the gated_delta_scan nodes, conv updates take the table's "
              "default; oracle: the same model in float64 (transformers still runs its delta "
              "rule in f32 inside)"),
}


def run_workload(workload: str, lengths, unrolled_max: int, folder: Path, rounds: int,
                 load_rounds: int) -> None:
    build, what = DESCRIPTION[workload]
    rows, timed, refs, skipped = [], [], [], []
    for seq in lengths:
        case = build(seq, unrolled_max)
        refs = list(case.eager)
        if case.unrolled is None:
            skipped.append(seq)
        found, times = measure(case, folder, rounds, load_rounds)
        rows += found
        timed += times
        del case
    note = (f" The unrolled graph is skipped at S={', '.join(map(str, skipped))} (above "
            f"--unrolled-max {unrolled_max}: torch-to-nnef writes and tract loads unrolled graphs "
            "super-linearly, ~20 min to write at S=256, minutes to load at S=512)."
            if skipped else "")
    report(workload, rows, timed, refs,
           f"{what}. load / into_runnable: median of up to {load_rounds} loads (one if the "
           f"first takes > {SLOW_LOAD:.0f} s); run: median over {rounds} interleaved rounds; "
           f"tract candidates forced with export_nnef(choose=...).{note}")


def main(argv=None) -> None:
    ap = common.parser(__doc__.splitlines()[0])
    ap.add_argument("--part", choices=("core", "model", "both"), default="both")
    ap.add_argument("--lengths", type=int, nargs="+", default=None)
    ap.add_argument("--unrolled-max", type=int, default=None,
                    help="longest S for which the unrolled graph is measured (default: "
                         + ", ".join(f"{k} {v}" for k, v in UNROLLED_MAX.items()) + ")")
    args = ap.parse_args(argv)
    common.silence_warnings()
    torch.set_num_threads(1)  # torch eager on one thread, as the issue asks
    folder = common.workdir(args, "tract")
    rounds = common.rounds_for(args)
    load_rounds = 1 if args.quick else 3
    for workload in ("core", "model") if args.part == "both" else (args.part,):
        full, quick = LENGTHS[workload]
        lengths = args.lengths or (quick if args.quick else full)
        unrolled_max = UNROLLED_MAX[workload] if args.unrolled_max is None else args.unrolled_max
        run_workload(workload, lengths, unrolled_max, folder, rounds, load_rounds)


if __name__ == "__main__":
    main()
