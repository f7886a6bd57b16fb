""""split"'s chunk loop body in three layouts: load and run time of one Qwen3.5-sized GDN
layer core (B = 1, 16 key and 16 value heads, Dk = Dv = 128, f32), ONE graph of symbolic S run
at S = 1, 64 and 512.

Why (docs/facts/tract.md, "tract: loading and graphs"): tract 0.23.9's Scan declutter tries an
axis removal for every unit axis of every node of a scan body at every pass. The layouts:

- "merged" (the default): no G axis where G = 1 (rank-4 tensors, gdn_chunked_text.flat_layout)
  and the body's two chunks sliced out of one merged (chunk x heads) axis
  (``unrolled_loop_lines(rows=)``);
- "unit chunk axis": no G axis, each chunk's 13 operands sliced off a unit chunk axis (the text
  of 2026-12-06 to 12-07);
- "grouped": a unit G axis on every tensor too (the text before 2026-12-06).

The same math: the run time should not move, the load should. Each layout is exported,
checked against the float64 recurrence, loaded ``--loads`` times (alternating), and timed
round-robin.

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
def layout(name: str):
    """The text in layout ``name`` while inside (see the module doc)."""
    from gdn_fx.lowering import gdn_chunked_text as text

    kept_flat, kept_loop = text.flat_layout, text.unrolled_loop_lines
    if name != "merged":
        text.unrolled_loop_lines = lambda chunks, suffix, rows=0: kept_loop(chunks, suffix)
    if name == "grouped":
        text.flat_layout = lambda facts, flat: False
    try:
        yield
    finally:
        text.flat_layout, text.unrolled_loop_lines = kept_flat, kept_loop


LAYOUTS = ("merged", "unit chunk axis", "grouped")


def export(layer: Layer, folder: Path, name: str) -> Path:
    program = torch.export.export(Fused(), layer.inputs(4))
    with layout(name):
        return _export(program, folder / f"{name.replace(' ', '_')}.nnef", name,
                       {"*": "split"}, dynamic=True)


def main() -> None:
    ap = common.parser(__doc__.splitlines()[0])
    ap.add_argument("--loads", type=int, default=5, help="loads of each layout (alternating)")
    args = ap.parse_args()
    common.silence_warnings()
    layer = Layer(2, 16) if args.quick else Layer(16, 128)
    folder = common.workdir(args, "split_layout")
    rounds = common.rounds_for(args, full=9, quick=2)
    files = {name: export(layer, folder, name) for name in LAYOUTS}
    loads = {name: [] for name in files}
    for _ in range(args.loads):
        for name, path in files.items():
            loaded = common.tract_load(path)
            loads[name].append(loaded.load + loaded.optimize)
    common.emit(common.header("split: load of one layer core, by body layout",
                              f"median of {args.loads} loads each, alternating"))
    common.emit(common.markdown(["layout", "load + into_runnable ms"],
                                [[name, common.ms(statistics.median(v))]
                                 for name, v in loads.items()]) + "\n")
    for seq in LENGTHS:
        inputs = layer.inputs(seq, seed=seq)
        want = oracle(inputs)
        paths = [tract_path(f"split {name}", path, inputs, want) for name, path in files.items()]
        table(f"split at S = {seq} ({layer.heads} heads of {layer.width})", paths,
              ["split unit chunk axis"], rounds)


if __name__ == "__main__":
    main()
