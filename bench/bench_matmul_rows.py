"""Why batched decode stops scaling: one tract matmul ``x [M, K] @ W [K, N]`` against M rows.

A decode step of B sequences is B rows through every weight matrix. While the weights stream
from memory, B rows cost about what one costs; once the product turns compute-bound, the cost
grows with B. This times tract's matmul alone (the wheel runs it on one thread: docs/FACTS.md)
at M = 1, 2, 4, 8, 16 rows, for a matrix that streams from DRAM (the decode case: a model's
weights are far larger than the cache) and one that stays in L3, with the weights in f32 and
q4_0, and torch's f32 ``Linear`` on one thread beside it. "rows per time of one" is
M / (t_M / t_1): the most a batch of M can gain over one sequence in that product, which bounds
the aggregate decode speed-up of a batched artifact from above.

    .venv/bin/python bench/bench_matmul_rows.py
    .venv/bin/python bench/bench_matmul_rows.py --rows 1,8 --weights f32
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

# (name, K, N): the 0.8B shape's hidden width against its MLP width, and a wide one
MATRICES = (("DRAM-bound", 1024, 65536), ("L3-resident", 1024, 3584))


def _arguments(argv):
    parser = common.parser(__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,2,4,8,16", help="row counts M, e.g. 1,8")
    parser.add_argument("--weights", default="f32,q4_0", help="weight formats, e.g. f32")
    parser.add_argument("--calls", type=int, default=15, help="timed calls per sample")
    return parser.parse_args(argv)


def _tract_sampler(linear, rows: int, weights: str, folder: Path):
    import torch
    import tract

    import gdn_fx

    x = torch.randn(rows, linear.in_features)
    path = folder / f"mm_{linear.out_features}_{rows}_{weights}.nnef.tgz"
    gdn_fx.export_nnef(torch.export.export(linear, (x,)), path, input_names=["x"],
                       output_names=["y"], weights=weights)
    runnable = tract.nnef().with_tract_transformers().load(str(path)).into_runnable()
    array = x.numpy()
    return lambda: runnable.run([array])


def _torch_sampler(linear, rows: int):
    import torch

    x = torch.randn(rows, linear.in_features)

    def call():
        with torch.no_grad():
            linear(x)
    return call


def main(argv=None) -> None:
    import torch

    args = _arguments(argv)
    common.silence_warnings()
    torch.set_num_threads(1)
    rows_list = [int(r) for r in args.rows.split(",")]
    formats = args.weights.split(",")
    folder = common.workdir(args, "matmul_rows")
    table = []
    for name, k, n in MATRICES:
        linear = torch.nn.Linear(k, n, bias=False)
        eager = {m: common.median_seconds(_torch_sampler(linear, m), args.calls) for m in rows_list}
        for weights in formats:
            found = {}
            for m in rows_list:
                found[m] = common.median_seconds(_tract_sampler(linear, m, weights, folder),
                                           args.calls)
            one, eager_one = found[rows_list[0]], eager[rows_list[0]]
            for m in rows_list:
                t, e = found[m], eager[m]
                table.append([f"{name} {k}x{n} ({k * n * 4 / 2**20:.0f} MiB in f32)", weights, m,
                              common.ms(t), f"{2 * m * k * n / t / 1e9:.1f}", f"{t / one:.2f}x",
                              f"{m / (t / one):.2f}", common.ms(e), f"{m / (e / eager_one):.2f}"])
    common.emit(common.header("One tract matmul against its rows M (one thread)",
                              f"x [M, K] @ W [K, N], median of {args.calls} calls; torch: f32 "
                              "nn.Linear, torch.set_num_threads(1)"))
    common.emit(common.markdown(
        ["matrix", "tract weights", "M", "tract", "tract GFLOP/s", "tract time vs M = 1",
         "tract rows per time of one", "torch f32", "torch rows per time of one"], table))


if __name__ == "__main__":
    main()
