""""split"'s chunk loop written without the G axis (the default where G = 1) or with it:
load and run time of one Qwen3.5-sized GDN layer core (B = 1, 16 key and 16 value heads,
Dk = Dv = 128, f32), ONE graph of symbolic S run at S = 1, 64 and 512.

Why (docs/FACTS.md, issue 31): tract 0.23.9's Scan declutter tries an axis removal for every
unit axis of every node of a scan body at every pass, and with one value head per key head
(G = 1) every tensor of split's chunk-loop body had a unit G axis; the text now drops it
there (rank-4 tensors, gdn_chunked_text.flat_layout). The same math: the run time should not
move, the load should. Each layout is exported, checked against the
float64 recurrence, loaded ``--loads`` times (alternating), and timed round-robin.

    .venv/bin/python bench/bench_split_layout.py               # 16 heads of 128
    .venv/bin/python bench/bench_split_layout.py --quick       # smoke run: tiny layer
"""

from __future__ import annotations

import statistics
import sys
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import common  # noqa: E402
import gdn_fx  # noqa: E402,F401  (registers torch.ops.gdn_fx)
from bench_gdn_fast import Fused, Layer, _export, oracle, table, tract_path  # noqa: E402

LENGTHS = (1, 64, 512)


@contextmanager
def grouped():
    """The text as it was before 2026-12-06: a unit G axis on every tensor."""
    from gdn_fx.lowering import gdn_chunked_text as text

    kept = text.flat_layout
    text.flat_layout = lambda facts, flat: False
    try:
        yield
    finally:
        text.flat_layout = kept


def export(layer: Layer, folder: Path, flat: bool) -> Path:
    program = torch.export.export(Fused(), layer.inputs(4))
    name = "flat" if flat else "grouped"
    if flat:
        return _export(program, folder / f"{name}.nnef", name, {"*": "split"}, dynamic=True)
    with grouped():
        return _export(program, folder / f"{name}.nnef", name, {"*": "split"}, dynamic=True)


def main() -> None:
    ap = common.parser(__doc__.splitlines()[0])
    ap.add_argument("--loads", type=int, default=5, help="loads of each layout (alternating)")
    args = ap.parse_args()
    common.silence_warnings()
    layer = Layer(2, 16) if args.quick else Layer(16, 128)
    folder = common.workdir(args, "split_layout")
    rounds = common.rounds_for(args, full=9, quick=2)
    files = {name: export(layer, folder, name == "flat") for name in ("flat", "grouped")}
    loads = {name: [] for name in files}
    for _ in range(args.loads):
        for name, path in files.items():
            loaded = common.tract_load(path)
            loads[name].append(loaded.load + loaded.optimize)
    common.emit(common.header("split: load of one layer core, with the G axis or without",
                              f"median of {args.loads} loads each, alternating"))
    common.emit(common.markdown(["layout", "load + into_runnable ms"],
                                [[name, common.ms(statistics.median(v))]
                                 for name, v in loads.items()]) + "\n")
    for seq in LENGTHS:
        inputs = layer.inputs(seq, seed=seq)
        want = oracle(inputs)
        paths = [tract_path(f"split {name}", path, inputs, want) for name, path in files.items()]
        table(f"split at S = {seq} ({layer.heads} heads of {layer.width})", paths,
              ["split grouped"], rounds)


if __name__ == "__main__":
    main()
