"""Export time of whole models: the tiny demo model and the Qwen3.5-0.8B-shaped one, this tree
against another revision side by side.

Each round exports the model afresh in a fresh one-thread process (``export_generator``, the
one-graph artifact the CLI writes by default: transformers' modules are reified, so no
collapse runs) and times it; rounds alternate between this tree and ``--against REV``
(installed by ``common.install_revision``), so each ratio is taken on the same machine state. The 0.8B shape (``common.SHAPE``, random weights, f32) is exported
with 4 layers by default (``--layers``): the pass and the writer cost per layer, the vocab
table once.

    .venv/bin/python bench/bench_export.py --against 4d9b686          # tiny and 0.8b-4-layer
    .venv/bin/python bench/bench_export.py --models tiny --rounds 3
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402


def one_export(model: str, layers: str) -> dict:
    """Export ``model`` once in this process; the wall seconds it took."""
    from gdn_fx.hf.configs import tiny_model
    from gdn_fx.hf.generator import export_generator

    common.silence_warnings()
    if model == "tiny":
        built = tiny_model("qwen3_5")
    else:
        n = int(layers)
        shape = dict(common.SHAPE, num_hidden_layers=n,
                     layer_types=(common.SHAPE["layer_types"] * n)[:n])
        built = tiny_model("qwen3_5", **shape)
    with tempfile.TemporaryDirectory() as folder:
        start = time.perf_counter()
        export_generator(built, Path(folder) / "m.nnef.tgz")
        return {"export_s": time.perf_counter() - start}


def main() -> None:
    parser = common.parser(__doc__)
    parser.add_argument("--models", nargs="+", default=["tiny", "0.8b"])
    parser.add_argument("--layers", default="4")
    parser.add_argument("--against", default=None)
    args = parser.parse_args()
    models = ["tiny"] if args.quick else args.models
    sites = {"this": None}
    if args.against:
        sites[args.against] = common.install_revision(args.against)
    times: dict = {}
    for _ in range(common.rounds_for(args, full=2, quick=1)):
        for model in models:
            for name, site in sites.items():
                got = common.child("one_export", model, args.layers, module="bench_export",
                                   site=site)
                times.setdefault((model, name), []).append(got)
    columns = ["model", "tree", "export s (median)", "each round", "this / other"]
    rows, base = [], {}
    for (model, name), runs in times.items():
        seconds = [r["export_s"] for r in runs]
        base.setdefault(model, statistics.median(seconds))
        label = model if model == "tiny" else f"0.8b shape, {args.layers} layers"
        rows.append([label, name, f"{statistics.median(seconds):.2f}",
                     ", ".join(f"{x:.2f}" for x in seconds),
                     common.ratio(base[model] / statistics.median(seconds))])
    common.emit(common.header("Export time of whole models",
                              "export_generator wall time, fresh one-thread processes, trees "
                              "alternating") + common.markdown(columns, rows))


if __name__ == "__main__":
    main()
