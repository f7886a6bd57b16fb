"""One matrix product, tract's kernels beside llama.cpp's: GFLOP/s on one thread.

What `bench_llama.py` leaves to tract, measured on the smallest graph that shows it:
``y = x W^T`` with W [N, K] = 4096 x 14336 (llama.cpp's own perf case, test-backend-ops'
``MUL_MAT(m=4096, n=M, k=14336)``) at M = 1 row (a decode step: the weight streams from
memory), M = 128 (the Generator's prefill chunk; tract only) and M = 512 (a prefill), in each
weight format:

- tract: a torch ``Linear`` exported by ``gdn_fx.export_nnef`` (one ``linear`` of one variable,
  nothing else: ``--show`` prints its graph.nnef, the minimal reproduction), weights f32,
  f16 (``--weights f16``: f32 activations), f16 operands (the model in f16, ``--dtype f16``)
  and q4_0; median of ``--calls`` calls on one thread (tract 0.23.9's matmuls take one);
- llama.cpp: ``test-backend-ops perf -o MUL_MAT`` of the same shape with f32 activations
  (type_a f32 / f16 / q4_0), built from the sources bench_llama.py builds (``--llama-dir``,
  its own build folder ``build-tests``); its CPU backend takes hardware_concurrency / 2 threads,
  printed in the table (1 on a 2-core machine).

    .venv/bin/python bench/bench_kernels.py                        # both engines
    .venv/bin/python bench/bench_kernels.py --no-llama --show      # tract only, and its NNEF
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

N, K = 4096, 14336
ROWS = (1, 128, 512)  # 128: the Generator's prefill chunk (llama.cpp's perf cases lack it)
# tract format -> (how it is exported, llama.cpp's type_a for the same weight bytes)
FORMATS = {"f32": ("f32", "f32"), "f16 weights": ("f16", "f16"),
           "f16 operands": ("f16 model", None), "q4_0": ("q4_0", "q4_0")}


def tract_seconds(fmt: str, rows: int, folder: Path, calls: int, show: bool) -> float:
    """Median seconds of one tract call of the product with ``rows`` rows, its weight exported
    as ``fmt`` ("f32", "f16", "q4_0": ``weights=``; "f16 model": the Linear in f16)."""
    import numpy as np
    import torch
    import tract

    import gdn_fx

    weights, model_dtype = (fmt, torch.float32) if fmt != "f16 model" else ("f32", torch.float16)
    linear = torch.nn.Linear(K, N, bias=False).to(model_dtype)
    x = torch.randn(rows, K, dtype=model_dtype)
    path = folder / f"linear_{fmt.replace(' ', '_')}_{rows}.nnef.tgz"
    gdn_fx.export_nnef(torch.export.export(linear, (x,)), path, input_names=["x"],
                       output_names=["y"], weights=weights)
    if show and rows == ROWS[0]:
        graph = common.graph_text(path)
        common.emit(f"graph.nnef of {fmt} (its graph):\n```\n"
                    f"{graph[graph.index('graph network'):].strip()}\n```")
    runnable = tract.nnef().with_tract_transformers().load(str(path)).into_runnable()
    array = np.ascontiguousarray(x.numpy())
    return common.median_seconds(lambda: runnable.run([array]), calls)


def build_tests(root: Path) -> Path:
    """test-backend-ops built under ``root`` beside bench_llama's llama.cpp (same flags)."""
    import bench_llama

    root = root.expanduser().resolve()
    binary = root / "build-tests" / "bin" / "test-backend-ops"
    if binary.exists():
        return binary
    src = root / f"llama_cpp_python-{bench_llama.LLAMA_CPP_PYTHON}" / "vendor" / "llama.cpp"
    if not src.exists():
        bench_llama.build_llama(root)  # downloads and unpacks the sdist
    flags = [f for f in bench_llama.cmake_flags() if "BUILD_TESTS" not in f]
    subprocess.run(["cmake", "-S", str(src), "-B", str(binary.parents[1]), *flags,
                    "-DLLAMA_BUILD_TESTS=ON"], check=True, capture_output=True)
    subprocess.run(["cmake", "--build", str(binary.parents[1]), "-j", str(os.cpu_count() or 1),
                    "--target", "test-backend-ops"], check=True, capture_output=True)
    return binary


# "  MUL_MAT(type_a=q4_0,type_b=f32,m=4096,n=512,k=14336,...):   12 runs - 85000.00 us/run - ..."
PERF_LINE = re.compile(r"MUL_MAT\(type_a=(\w+),type_b=f32,m=4096,n=(\d+),k=14336,.*?\):"
                       r"\s+\d+ runs -\s+([\d.]+) us/run")


def llama_seconds(binary: Path) -> dict:
    """{(type_a, rows): seconds} of llama.cpp's perf cases of this shape."""
    types = "|".join(t for _, t in FORMATS.values() if t)
    rows = "|".join(map(str, ROWS))
    done = subprocess.run([str(binary), "perf", "-b", "CPU", "-o", "MUL_MAT", "-p",
                           f"type_a=({types}),type_b=f32,m=4096,n=({rows}),k=14336,"],
                          capture_output=True, text=True, check=True)
    found = {(m.group(1), int(m.group(2))): float(m.group(3)) * 1e-6
             for m in PERF_LINE.finditer(done.stdout)}
    if not found:
        raise RuntimeError(f"no MUL_MAT line in test-backend-ops' output:\n{done.stdout[-2000:]}")
    return found


def main() -> None:
    parser = common.parser(__doc__.splitlines()[0])
    parser.add_argument("--llama-dir", type=Path, default=Path("~/.cache/gdn_fx_llama"))
    parser.add_argument("--no-llama", action="store_true", help="tract only")
    parser.add_argument("--show", action="store_true", help="print each graph.nnef")
    parser.add_argument("--calls", type=int, default=5, help="timed calls per cell")
    args = parser.parse_args()
    common.silence_warnings()
    folder = common.workdir(args, "kernels")
    theirs = {} if args.no_llama else llama_seconds(build_tests(args.llama_dir))
    threads = max(1, (os.cpu_count() or 2) // 2)
    table = []
    for name, (fmt, type_a) in FORMATS.items():
        for rows in ROWS:
            ours = tract_seconds(fmt, rows, folder, args.calls, args.show)
            other = theirs.get((type_a, rows))
            flops = 2 * rows * N * K
            table.append([name, rows, common.ms(ours), f"{flops / ours / 1e9:.1f}",
                          type_a or "-", common.ms(other),
                          None if other is None else f"{flops / other / 1e9:.1f}",
                          None if other is None else f"{ours / other:.2f}x"])
    common.emit(common.header(
        f"One product x [M, {K}] @ W^T, W [{N}, {K}]: tract against llama.cpp",
        f"tract: median of {args.calls} calls, one thread; llama.cpp: test-backend-ops perf, "
        f"CPU backend, {threads} thread(s)"))
    common.emit(common.markdown(
        ["tract weights", "M", "tract ms", "tract GFLOP/s", "llama.cpp type_a", "llama.cpp ms",
         "llama.cpp GFLOP/s", "tract / llama.cpp"], table))


if __name__ == "__main__":
    main()
