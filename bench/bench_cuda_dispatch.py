"""What one op costs tract's CUDA runtime on the host: the floor under a decode step.

A decode step of the Qwen3.5-0.8B shape is ~1150 GPU ops doing ~3.2 ms of GPU work, and takes
12-20 ms (bench/RESULTS.md): each op pays a host cost before its kernel runs. This measures
that cost alone: chains of N ops on a tiny tensor ([1, WIDTH], so the GPU work is negligible),
for two N, in one process; the cost per op is the slope (t(N_LONG) - t(N_SHORT)) /
(N_LONG - N_SHORT), which leaves out the call's fixed cost (inputs up, outputs down). Chains:

- "add / mul": element-wise ops with the input, add and mul in turn (one kernel each);
- "add / mul, reshape": each followed by a reshape, [1, W] <-> [32, W / 32] (tract's AxisOp);
- "add / mul, transpose": each followed by a transpose of [32, W / 32] (GpuMoveAxis);
- "matmul": [1, W] x [W, W]^T in f16 (a GEMV, the decode step's projections).

torch eager runs the same chains on the same GPU in the same process (its per-op cost, for
scale); tract's CPU runtime too. The NNEF files are written here by this script (plain NNEF
text, no torch-to-nnef), so the whole run happens on the GPU machine:

    python3 bench/bench_cuda_dispatch.py --out $OUT          # on the GPU machine
    .venv/bin/python bench/bench_cuda_dispatch.py --runtimes cpu   # a dry run anywhere
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402

import common  # noqa: E402

WIDTH = 1024
N_SHORT, N_LONG = 64, 512
REPEATS = 7  # calls timed per chain; the median is kept
HEADER = "version 1.0;\nextension tract_registry tract_core;\n"

# chain name -> (dtype, the ops from "a" to "b"; x is the input, xr the input as [1, W],
# xs as [32, W / 32]; op add at even steps, mul at odd ones): each step reads the input and
# the ops alternate, so tract can not fold the chain away (it folds a chain of adds)
CHAINS = {
    "add / mul f32": ("F32", "{b} = {op}({a}, xr);"),
    "add / mul f16": ("F16", "{b} = {op}({a}, xr);"),
    "add / mul, transpose": ("F32", "{b} = transpose({op}({a}, xs), axes = [1, 0]);"),
    "add / mul, reshape": ("F32", "{b} = reshape({op}({a}, {x}), shape = [{shape}]);"),
    "matmul f16": ("F16", "{b} = matmul({a}, w, transposeB = true);"),
}
WEIGHT = f"w = variable<scalar>(label = \"w\", shape = [{WIDTH}, {WIDTH}]);"


def chain_text(name: str, count: int) -> str:
    """An NNEF graph of ``count`` steps of chain ``name`` applied one after the other."""
    dtype, line = CHAINS[name]
    square = f"32, {WIDTH // 32}"
    body = [f"x = tract_core_external(shape = [1, {WIDTH}], datum_type = \"{dtype}\");",
            "xr = copy(x);", f"xs = reshape(x, shape = [{square}]);",
            *([WEIGHT] if reads_weight(name) else [])]
    previous = "xs" if "transpose" in name else "xr"
    for i in range(count):
        shape, x = (square, "xr") if i % 2 == 0 else (f"1, {WIDTH}", "xs")
        body.append(line.format(a=previous, b=f"y{i}", shape=shape, x=x,
                                op="add" if i % 2 == 0 else "mul"))
        previous = f"y{i}"
    return HEADER + "graph chain(x) -> (y) {\n  " + "\n  ".join(body) + \
        f"\n  y = reshape({previous}, shape = [1, {WIDTH}]);\n}}\n"


def write_chain(folder: Path, name: str, count: int) -> Path:
    """The chain as an NNEF folder (graph.nnef, and the weight of the matmul chain)."""
    path = folder / f"{name.replace(' ', '_')}_{count}.nnef"
    path.mkdir(parents=True, exist_ok=True)
    (path / "graph.nnef").write_text(chain_text(name, count))
    if reads_weight(name):
        weight = (np.random.default_rng(0).standard_normal((WIDTH, WIDTH)) / WIDTH ** 0.5)
        tract_dat(path / "w.dat", weight.astype(np.float16))
    return path


def reads_weight(name: str) -> bool:
    """Whether chain ``name`` multiplies by the weight ``w`` (then declared and written)."""
    return "w," in CHAINS[name][1]


def tract_dat(path: Path, array: np.ndarray) -> None:
    """An NNEF tensor file (the Khronos binary: 128-byte header, then the data), f16 only."""
    header = bytearray(128)
    header[0:2] = b"\x4e\xef"
    header[2], header[3] = 1, 0  # version 1.0
    data = array.tobytes()
    header[4:8] = len(data).to_bytes(4, "little")
    header[8:12] = array.ndim.to_bytes(4, "little")
    for i, size in enumerate(array.shape):
        header[12 + 4 * i:16 + 4 * i] = size.to_bytes(4, "little")
    header[44:48] = (16).to_bytes(4, "little")  # bits per item
    header[48:52] = (0).to_bytes(4, "little")  # quantization: float
    path.write_bytes(bytes(header) + data)


def load(path: Path, runtime: str):
    import tract

    model = tract.nnef().load(str(path))
    return model.into_runnable() if runtime == "cpu" else \
        tract.runtime_for_name(runtime).prepare(model)


def median_call(call, repeats: int = REPEATS) -> float:
    return common.median_seconds(call, repeats, warmup=2)


def tract_per_op(folder: Path, name: str, runtime: str) -> dict:
    """Seconds per call at N_SHORT and N_LONG steps, the slope per step, and how many ops
    the runnable of the long chain has (tract's profile: the chain was not folded away)."""
    dtype = np.float16 if CHAINS[name][0] == "F16" else np.float32
    x = (np.random.default_rng(1).standard_normal((1, WIDTH)) / 8).astype(dtype)
    times, ops = {}, 0
    for count in (N_SHORT, N_LONG):
        runnable = load(write_chain(folder, name, count), runtime)
        times[count] = median_call(lambda: runnable.run([x])[0].to_numpy())
        nodes = json.loads(runnable.profile_json([x]))["nodes"]
        ops = sum(1 for node in nodes if not node.get("op_name", "").startswith("Const"))
    return dict(short=times[N_SHORT], long=times[N_LONG], ops=ops,
                per_op=(times[N_LONG] - times[N_SHORT]) / (N_LONG - N_SHORT))


def torch_per_op(name: str) -> dict:
    """The same chain in torch eager on the GPU (synchronised at the end of each call)."""
    import torch

    dtype = torch.float16 if CHAINS[name][0] == "F16" else torch.float32
    xr = (torch.randn(1, WIDTH, device="cuda") / 8).to(dtype)
    xs = xr.reshape(32, WIDTH // 32)
    w = (torch.randn(WIDTH, WIDTH, device="cuda") / WIDTH ** 0.5).half()

    def step(y, i):
        other = xs if "transpose" in name or (name.endswith("reshape") and i % 2) else xr
        if name == "matmul f16":
            return y @ w.t()
        y = y + other if i % 2 == 0 else y * other
        if name.endswith("transpose"):
            return y.t().contiguous()
        if name.endswith("reshape"):
            return y.reshape(32, -1) if i % 2 == 0 else y.reshape(1, -1)
        return y

    def chain(count):
        def call():
            y = xs if "transpose" in name else xr
            for i in range(count):
                y = step(y, i)
            torch.cuda.synchronize()
        return call

    times = {count: median_call(chain(count)) for count in (N_SHORT, N_LONG)}
    return dict(short=times[N_SHORT], long=times[N_LONG],
                per_op=(times[N_LONG] - times[N_SHORT]) / (N_LONG - N_SHORT))


def census(path: Path, runtime: str, tokens: int, past: int = 0) -> dict:
    """One NNEF file's call on ``runtime`` at S = ``tokens``: how many ops of each kind it
    runs (tract's profile), their summed profile time, and the call's median time. Inputs
    are random (token ids below 1000), shaped by the file's input facts: the symbol S is
    ``tokens``, any other (a generation graph's past P) ``past``."""
    import tract

    model = tract.nnef().with_tract_transformers().load(str(path))
    runnable = model.into_runnable() if runtime == "cpu" else \
        tract.runtime_for_name(runtime).prepare(model)
    rng = np.random.default_rng(0)
    arrays = []
    for fact in runnable.input_facts():
        *dims, dtype = str(fact).split(",")
        shape = [int(d) if d.isdigit() else tokens if d == "S" else past for d in dims]
        arrays.append(rng.integers(0, 1000, shape) if dtype == "i64" else
                      (rng.standard_normal(shape) / 4).astype({"f16": np.float16,
                                                               "f32": np.float32}[dtype]))
    call_s = median_call(lambda: [t.to_numpy() for t in runnable.run(arrays)])
    kinds: dict = {}
    for node in json.loads(runnable.profile_json(arrays))["nodes"]:
        name = node.get("op_name", "?")
        if name.startswith("Const"):
            continue
        count, secs = kinds.get(name, (0, 0.0))
        kinds[name] = (count + 1, secs + (node.get("secs_per_iter") or 0.0))
    ops = sum(count for count, _ in kinds.values())
    top = sorted(kinds.items(), key=lambda item: -item[1][0])[:8]
    return dict(call_ms=call_s * 1e3, ops=ops, profile_ms=sum(t for _, t in kinds.values()) * 1e3,
                kinds={k: [c, round(t * 1e3, 3)] for k, (c, t) in top})


def census_table(rows: dict) -> str:
    lines = ["| file | S | call ms (median) | ops | profile ms | ops by kind (most first) |",
             "|---|---|---|---|---|---|"]
    for (name, tokens), row in rows.items():
        kinds = ", ".join(f"{k} x{c}" for k, (c, _) in row["kinds"].items())
        lines.append(f"| {name} | {tokens} | {row['call_ms']:.2f} | {row['ops']} | "
                     f"{row['profile_ms']:.2f} | {kinds} |")
    return "\n".join(lines)


def table(results: dict) -> str:
    engines = list(results)
    lines = [f"| chain of {N_SHORT} and {N_LONG} steps, [1, {WIDTH}] | "
             + " | ".join(f"{e}: us per step" for e in engines) + " |",
             "|---|" + "---|" * len(engines)]
    for name in CHAINS:
        cells = []
        for engine in engines:
            row = results[engine].get(name)
            cells.append("-" if row is None else row["error"] if "error" in row else
                         f"{row['per_op'] * 1e6:.1f}" + (f" ({row['ops']} ops)" if "ops" in row
                                                        else ""))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runtimes", nargs="+", default=["cuda", "cpu"])
    parser.add_argument("--torch", action="store_true", help="time torch eager on the GPU too")
    parser.add_argument("--pool", action="store_true",
                        help="time the cuda chains again with freed memory kept in the driver's "
                             "pool (bench/cuda_pool.py)")
    parser.add_argument("--out", type=Path, help="where the JSON of every time is written")
    parser.add_argument("--census", type=Path, nargs="*", default=[],
                        help="NNEF files whose calls are counted op by op, on the first runtime "
                             "(instead of the chains)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[512, 128],
                        help="S for --census (every symbol of the file's inputs)")
    args = parser.parse_args()
    if args.census:
        rows = {(f"{path.parent.name}/{path.name}", tokens):
                census(path, args.runtimes[0], tokens) for path in args.census
                for tokens in args.tokens}
        print(census_table(rows))
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "census.json").write_text(
                json.dumps({f"{n} S={t}": row for (n, t), row in rows.items()}, indent=1))
        return
    results: dict = {}
    settings = [(runtime, None) for runtime in args.runtimes]
    if args.pool and "cuda" in args.runtimes:
        settings += [("cuda", "kept"), ("cuda", "released")]
    with tempfile.TemporaryDirectory() as tmp:
        for runtime, pool in settings:
            label = f"tract {runtime}" + (f", pool {pool}" if pool else "")
            if pool:
                import cuda_pool

                cuda_pool.set_release_threshold(cuda_pool.KEEP_ALL if pool == "kept" else 0)
            results[label] = {}
            for name in CHAINS:
                try:
                    results[label][name] = tract_per_op(Path(tmp), name, runtime)
                except Exception as exc:  # a chain tract refuses is shown, not fatal
                    results[label][name] = {"error": str(exc).splitlines()[0][:80]}
            print(table({label: results[label]}), flush=True)
    if args.torch:
        results["torch eager"] = {name: torch_per_op(name) for name in CHAINS}
    print(table(results))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "dispatch.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
