"""The GDN candidates on tract's CUDA runtime: one Qwen3.5-sized layer core, side by side.

B = 1, 16 heads, Dk = Dv = 128, q/k/v/beta f16 with an f32 log decay and an f32 state (the
native operator's CUDA kernel takes exactly that), S = 1, 64, 512, 4096. Every candidate that
tract can run under its CUDA runtime is exported for each S (forced with ``choose``), loaded
with ``tract.runtime_for_name("cuda").prepare``, checked against the float64 recurrence
(gdn_fx/reference.py, on the f16-rounded inputs) and timed round-robin in one run; the native
operator on all-f32 operands (which has no CUDA kernel) is timed too where it is not too slow.
tract's profiler (``Runnable.profile_json``) splits each call into GPU ops (Cuda*, Gpu*),
host/device transfers (DeviceSync*, which also wait for the GPU) and CPU ops (the rest: a
path tract runs on the CPU shows here). "I/O floor" reads the same inputs and writes outputs
of the same shapes with a few elementwise ops: what moving the tensors costs per call.

The NNEF files are written where torch-to-nnef is installed, the timing runs where the GPU is
(the device machine has neither torch-to-nnef nor this machine's GPU-less tract):

    .venv/bin/python bench/bench_cuda.py --prepare .gpu/nnef       # here: NNEF files + manifest
    python3 bench/bench_cuda.py --run .gpu/nnef --profiles p.json   # on the GPU machine
    .venv/bin/python bench/bench_cuda.py --run .gpu/nnef --runtime cpu --lengths 1 64  # CPU

``--probe`` also times the native operator on the dtype sets, widths and batches its CUDA
kernel might take (CUDA against CPU: a ratio near 1 means tract ran it on the CPU).
Every path of one S runs on the same tract tensors on the host. ``--pinned`` adds rows for
native, chunked_parallel and the I/O floor on a second set of those tensors whose buffers
(from 1 MiB) are page-locked (cudaHostRegister), timed in the same rotation; ``--trace``
writes one call's GPU kernels and copies in order, ``--samples`` every per-round time.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Callable, Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

import common  # noqa: E402

LENGTHS = (1, 64, 512, 4096)
TOLERANCE = 2e-3  # issue 19's bound for f16 operands against the float64 reference
NAMES = common.CORE_INPUTS
# Candidates per S: every one tract can run on CUDA that the table lets serve the shape.
PATHS = {1: ("native", "matmul_step", "chunked", "matmul"),
         64: ("native", "chunked_parallel", "chunked_unrolled", "chunked", "matmul"),
         512: ("native", "chunked_parallel", "chunked_unrolled", "chunked", "matmul"),
         4096: ("native", "chunked_parallel", "chunked")}
F32_NATIVE_UP_TO = 512  # the CPU operator takes ~2.6 s at S = 4096: left out there
# (label, heads, width, batch, dtype of q/k/v/beta, dtype of the state) the probe tries
PROBES = (("f16, f32 state", 16, 128, 1, "f16", "f32"),
          ("f16, f16 state", 16, 128, 1, "f16", "f16"),
          ("all f32", 16, 128, 1, "f32", "f32"),
          ("f16, width 64", 16, 64, 1, "f16", "f32"),
          ("f16, batch 2", 16, 128, 2, "f16", "f32"))
PROBE_SEQ = 64
# "chunked_parallel" variants (largest chunk), exported for these S
VARIANTS = (64, 128, 256)
LEAF_VARIANTS = (8, 16, 32)  # the block inverse's leaf width (the module's LEAF is the table's)
VARIANT_LENGTHS = (512, 4096)
# Lengths between the measured ones where the native kernel and "chunked_parallel" cross
CROSSING = (128, 256)
DTYPES = {"f16": torch.float16, "f32": torch.float32}


class Fused(nn.Module):
    """The fused op with the native operator's flags (so every candidate may serve it)."""

    def forward(self, q, k, v, g, beta, s0):
        return torch.ops.gdn_fx.gated_delta_scan(q, k, v, g, beta, s0,
                                                 scale=q.shape[-1] ** -0.5, qk_l2norm=True)


def inputs(seq: int, heads: int = common.HEADS, width: int = common.WIDTH, batch: int = 1,
           operands: str = "f16", state: str = "f32") -> tuple:
    """The benchmark inputs (seeded by S): q/k/v/beta in ``operands``, g f32, s0 ``state``."""
    q, k, v, g, beta, s0 = common.core_inputs(seq, heads, width, batch, seed=seq)
    low = DTYPES[operands]
    return q.to(low), k.to(low), v.to(low), g, beta.to(low), s0.to(DTYPES[state])


_ORACLES: dict[tuple, tuple] = {}


def oracle(args: Sequence[torch.Tensor]) -> tuple:
    """float64 recurrence on the inputs as given (f16 values widened exactly), on the GPU when
    torch has one (the 4096-step loop is slow on the CPU), results back on the CPU; kept for
    the next path with the same inputs."""
    key = tuple((tuple(a.shape), str(a.dtype), float(a.double().sum())) for a in args)
    if key not in _ORACLES:
        _ORACLES[key] = _oracle(args)
    return _ORACLES[key]


def _oracle(args: Sequence[torch.Tensor]) -> tuple:
    from gdn_fx.reference import l2norm, recurrent_delta_rule_reference

    device = "cuda" if torch.cuda.is_available() else "cpu"
    q, k, v, g, beta, s0 = (x.to(device, torch.float64) for x in args)
    out = recurrent_delta_rule_reference(l2norm(q), l2norm(k), v, g, beta,
                                         scale=q.shape[-1] ** -0.5, initial_state=s0)
    return tuple(x.cpu() for x in out)


# --- prepare: NNEF files and a manifest (needs torch-to-nnef) --------------------------------

class IoFloor(nn.Module):
    """Reads every input and writes outputs of the core's shapes and dtypes with a few
    elementwise ops: what moving the tensors in and out of the GPU costs per call."""

    def forward(self, q, k, v, g, beta, s0):
        out = (q.float() + k.float() + v.float()) * beta.float()[..., None] + g[..., None]
        return out, s0 * 1.5


def gdn_fx_export(program, path: Path) -> str:
    import gdn_fx

    return str(gdn_fx.export_nnef(program, path, input_names=NAMES, runtime="cuda"))


def _export(args: tuple, path: Path, choose: Optional[dict]) -> str:
    import gdn_fx

    program = torch.export.export(Fused(), args)
    return str(gdn_fx.export_nnef(program, path, choose=choose, input_names=NAMES,
                                  runtime="cuda"))


def _table_choice(args: tuple) -> str:
    """The candidate the table picks for the CUDA runtime (with its note, if any)."""
    from gdn_fx.lowering import plan_lowering

    (decision,) = plan_lowering(torch.export.export(Fused(), args), runtime="cuda")
    return decision.candidate + (f" ({decision.note})" if decision.note else "")


def variant_entries(folder: Path, lengths: Sequence[int]) -> list[dict]:
    """"chunked_parallel" with other chunk sizes and leaf widths (the module's knobs, set
    for one export each), and native against "chunked_parallel" at the CROSSING lengths."""
    from gdn_fx.lowering import gdn_chunked_parallel as cp

    entries = []
    for seq in [s for s in VARIANT_LENGTHS if s in lengths]:
        for chunk in [c for c in VARIANTS if c != cp.chunk_for(seq)]:  # the table's: its row
            kept = cp.CHUNK, cp.LONG_CHUNK
            cp.CHUNK = cp.LONG_CHUNK = chunk
            try:
                path = _export(inputs(seq), folder / f"cp_{chunk}_s{seq}.nnef",
                               {"*": "chunked_parallel"})
            finally:
                cp.CHUNK, cp.LONG_CHUNK = kept
            entries.append(dict(kind="bench", seq=seq, path=path, table="-",
                                name=f"chunked_parallel C={chunk}"))
    for seq in [s for s in VARIANT_LENGTHS if s in lengths]:
        for leaf in [w for w in LEAF_VARIANTS if w != cp.LEAF]:
            kept = cp.LEAF
            cp.LEAF = leaf
            try:
                path = _export(inputs(seq), folder / f"cp_leaf{leaf}_s{seq}.nnef",
                               {"*": "chunked_parallel"})
            finally:
                cp.LEAF = kept
            entries.append(dict(kind="bench", seq=seq, path=path, table="-",
                                name=f"chunked_parallel leaf {leaf}"))
    for seq in [s for s in VARIANT_LENGTHS if s in lengths]:
        program = torch.export.export(IoFloor(), inputs(seq))
        path = gdn_fx_export(program, folder / f"io_floor_s{seq}.nnef")
        entries.append(dict(kind="bench", seq=seq, path=path, table="-",
                            name="I/O floor (same inputs/outputs, elementwise only)"))
    for seq in [s for s in CROSSING if s in lengths]:
        for name in ("native", "chunked_parallel"):
            path = _export(inputs(seq), folder / f"{name}_s{seq}.nnef", {"*": name})
            entries.append(dict(kind="bench", seq=seq, name=name, path=path,
                                table=_table_choice(inputs(seq))))
    return entries


TINY_SEQ = 8


def tiny_model_entry(folder: Path) -> dict:
    """A whole tiny random Qwen3.5 step (f16, S = TINY_SEQ, collapsed) exported for CUDA, with
    its inputs and torch eager's outputs saved beside it (the GPU machine has no transformers
    of the right release to rebuild it)."""
    import gdn_fx
    from gdn_fx.hf import DecodeStep, prepare_for_nnef
    from gdn_fx.pipeline import Job, build_model

    model, name = build_model(Job(family="qwen3_5", dtype="f16"))
    step = DecodeStep(prepare_for_nnef(model), rule="recurrent")
    args = step.example_inputs(seq_len=TINY_SEQ)
    program = gdn_fx.collapse(torch.export.export(step, args, strict=False)).program
    path = gdn_fx.export_nnef(program, folder / "tiny_step.nnef", runtime="cuda",
                              input_names=step.input_names, output_names=step.output_names)
    want = common.flat_tensors(step.eager(*args))
    arrays = {f"in{i}": a.detach().numpy() for i, a in enumerate(args)}
    arrays.update({f"out{i}": w.detach().numpy() for i, w in enumerate(want)})
    np.savez(folder / "tiny_step.npz", **arrays)
    from gdn_fx import tract_check

    return dict(kind="tiny", seq=TINY_SEQ, name=f"{name}, f16, S={TINY_SEQ}", path=str(path),
                decisions=tract_check.read_decisions(path))


def tiny_model_check(entry: dict, folder: Path, runtime: str) -> str:
    """The tiny step in tract on ``runtime`` against torch eager (bound 1e-3, f16)."""
    from gdn_fx import tract_check

    saved = np.load(folder / "tiny_step.npz")
    args = [saved[k] for k in sorted((k for k in saved if k.startswith("in")),
                                     key=lambda k: int(k[2:]))]
    want = [torch.from_numpy(saved[k]) for k in sorted((k for k in saved if k.startswith("out")),
                                                       key=lambda k: int(k[3:]))]
    try:
        found = tract_check.compare(entry["path"], want, args, tolerance=1e-3, runtime=runtime)
    except Exception as exc:  # noqa: BLE001  (reported, not raised: the tables still print)
        return f"{entry['name']} on {runtime}: FAILED {type(exc).__name__}: {why(exc)}"
    verdict = "OK" if found.ok else "NOT OK"
    return (f"{entry['name']} on tract {runtime}, lowered as {entry['decisions']}: {found} "
            f"-> {verdict}")


def prepare(folder: Path, lengths: Sequence[int], probe: bool, tiny: bool,
            paths: Optional[Sequence[str]] = None) -> None:
    """Write every path's NNEF into ``folder`` and ``manifest.json`` describing them."""
    folder.mkdir(parents=True, exist_ok=True)
    entries = []
    for seq in [s for s in lengths if s in PATHS]:
        args = inputs(seq)
        choice = _table_choice(args)
        for name in [n for n in PATHS[seq] if paths is None or n in paths]:
            path = _export(args, folder / f"{name}_s{seq}.nnef", {"*": name})
            entries.append(dict(kind="bench", seq=seq, name=name, path=path, table=choice))
        if seq <= F32_NATIVE_UP_TO and (paths is None or "native_f32" in paths):
            path = _export(inputs(seq, operands="f32"), folder / f"native_f32_s{seq}.nnef",
                           {"*": "native"})
            entries.append(dict(kind="bench", seq=seq, name="native", path=path,
                                table=choice, operands="f32"))
    entries += variant_entries(folder, lengths)
    if tiny:
        entries.append(tiny_model_entry(folder))
    for label, heads, width, batch, operands, state in (PROBES if probe else ()):
        args = inputs(PROBE_SEQ, heads, width, batch, operands, state)
        path = _export(args, folder / f"probe_{len(entries)}.nnef", {"*": "native"})
        entries.append(dict(kind="probe", seq=PROBE_SEQ, name=label, path=path, heads=heads,
                            width=width, batch=batch, operands=operands, state=state))
    (folder / "manifest.json").write_text(json.dumps(entries, indent=1))
    common.emit(f"wrote {len(entries)} NNEF files and {folder / 'manifest.json'}")


# --- run: load for a runtime, check, time ----------------------------------------------------

def load(path: str, runtime: str):
    from gdn_fx import tract_check

    return tract_check.load(path, runtime)


_TENSORS: dict[tuple, list] = {}  # one set of host tensors per input set, shared by paths


def host_tensors(arrays: list[np.ndarray], pinned: bool = False) -> list:
    """The tract tensors every path of these inputs runs on (the same objects for all of
    them, so no path gets luckier host memory). ``pinned``: a second set whose large
    buffers (>= 1 MiB) are page-locked with cudaHostRegister (portable), so the driver
    copies them to the GPU by DMA instead of through its pageable staging buffer; the
    inputs' values are the same."""
    import tract

    key = tuple((a.shape, a.dtype.str, a.tobytes()[:64]) for a in arrays) + (pinned,)
    if key not in _TENSORS:
        tensors = [tract.Tensor.from_numpy(a) for a in arrays]
        if pinned:
            for tensor, array in zip(tensors, arrays):
                if array.nbytes >= 1 << 20:
                    _page_lock(tensor, array.nbytes)
        _TENSORS[key] = tensors
    return _TENSORS[key]


def _page_lock(tensor, nbytes: int) -> None:
    """cudaHostRegister on the tract tensor's own host buffer (tract_tensor_as_bytes)."""
    _, _, data = tensor._parts()
    address = data if isinstance(data, int) else data.value
    error = torch.cuda.cudart().cudaHostRegister(address, nbytes, 1)  # cudaHostRegisterPortable
    if int(error) != 0:
        raise RuntimeError(f"cudaHostRegister failed: {error}")


def timed_calls(runnable, arrays: list[np.ndarray],
                pinned: bool = False) -> tuple[Callable, Callable, float]:
    """(State.run alone: one State kept, inputs already tract tensors on the host (one set
    shared by every path), so every call uploads them and waits for the outputs on the host,
    the same for every path; the same call with both outputs read back to numpy; the largest
    difference between that State's answer and a fresh run's, which must be 0 for the
    timing to be of the verified path)."""
    tensors = host_tensors(arrays, pinned)
    state = runnable.spawn_state()
    fresh = [t.to_numpy() for t in runnable.run(arrays)]
    kept = [t.to_numpy() for t in state.run(tensors)]
    drift = max(float(np.abs(a.astype(np.float64) - b).max()) for a, b in zip(kept, fresh))
    return ((lambda: state.run(tensors)),
            (lambda: [t.to_numpy() for t in state.run(tensors)]), drift)


def profile_split(runnable, arrays: list[np.ndarray]) -> tuple[dict, str]:
    """({"cuda": s, "transfer": s, "cpu": s} per call, the three slowest CPU op kinds) from
    tract's profiler: its ops named Cuda* and Gpu* (slices, concats, axis moves) are GPU ops,
    DeviceSync* move tensors between host and device (and wait for the GPU's queue), the
    rest run on the CPU. The times are tract's own per-op wall times on the host: for a GPU
    op that is mostly its launch, the GPU's work shows in the next DeviceSync."""
    nodes = json.loads(runnable.profile_json(arrays))["nodes"]
    split = {"cuda": 0.0, "transfer": 0.0, "cpu": 0.0}
    host: dict[str, float] = {}
    for node in nodes:  # nodes inside fragments/loops may carry no time of their own
        name, seconds = node.get("op_name", "?"), node.get("secs_per_iter") or 0.0
        kind = "cuda" if name.startswith(("Cuda", "Gpu")) else \
            "transfer" if name.startswith("DeviceSync") else "cpu"
        split[kind] += seconds
        if kind == "cpu":
            host[name] = host.get(name, 0.0) + seconds
    top = sorted(host.items(), key=lambda item: -item[1])[:3]
    return split, ", ".join(f"{k} {v * 1e3:.3g} ms" for k, v in top)


def why(exc: BaseException, limit: int = 500) -> str:
    """An error on one line: tract's causes too, without its stack backtrace."""
    text = " ".join(str(exc).split("Stack backtrace")[0].split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


PINNED = ", pinned inputs"
PINNED_PATHS = ("native", "chunked_parallel", "I/O floor (same inputs/outputs, elementwise only)")


def measure(entry: dict, runtime: str, profiles: dict, pinned: bool = False) -> dict:
    """Load, check and make the timed call of one manifest entry (errors recorded)."""
    result = dict(entry)
    try:
        args = _entry_inputs(entry)
        arrays = common.numpy_inputs(args)
        seconds, runnable = common.once(lambda: load(entry["path"], runtime))
        result["load_s"] = seconds
        result["run"], result["call"], result["drift"] = timed_calls(runnable, arrays)
        result["error"] = common.rel_error(runnable, arrays, oracle(args))
        if pinned and runtime == "cuda" and entry["kind"] == "bench" and (
                entry["name"] in PINNED_PATHS and entry.get("operands", "f16") == "f16"):
            try:
                result["pinned_run"], result["pinned_call"], pinned_drift = timed_calls(
                    runnable, arrays, pinned=True)
                result["drift"] = max(result["drift"], pinned_drift)
            except Exception as exc:  # noqa: BLE001  (the pageable row still stands)
                result["host_ops"] = f"pinned inputs failed: {type(exc).__name__}: {why(exc)}"
    except Exception as exc:  # noqa: BLE001  (the table shows why this path is missing)
        result["failed"] = f"{type(exc).__name__}: {why(exc)}"
        return result
    if runtime == "cuda":
        try:
            profiles[Path(entry["path"]).name] = runnable.profile_json(arrays)
            result["split"], result["host_ops"] = profile_split(runnable, arrays)
        except Exception as exc:  # noqa: BLE001  (a path can run where the profiler fails)
            result["host_ops"] = f"profiler failed: {type(exc).__name__}: {why(exc)}"
    return result


def _entry_inputs(entry: dict) -> tuple:
    if entry["kind"] == "probe":
        return inputs(entry["seq"], entry["heads"], entry["width"], entry["batch"],
                      entry["operands"], entry["state"])
    return inputs(entry["seq"], operands=entry.get("operands", "f16"))


def label(entry: dict) -> str:
    return entry["name"] + (" (all f32)" if entry.get("operands") == "f32" else "")


RUN = " (run alone)"
SAMPLES: dict[int, dict[str, list[float]]] = {}  # --samples: per S, per timed call, ms per round


def bench_table(seq: int, results: list[dict], rounds: int) -> str:
    """Time the paths of one S round-robin (State.run alone and the call with the outputs
    read back, all in one rotation); one markdown table with ratios to native."""
    ok = [r for r in results if "call" in r]
    calls = {label(r): r["call"] for r in ok}
    calls.update({label(r) + RUN: r["run"] for r in ok})
    calls.update({label(r) + PINNED: r["pinned_call"] for r in ok if "pinned_call" in r})
    calls.update({label(r) + PINNED + RUN: r["pinned_run"] for r in ok if "pinned_run" in r})
    samples = common.interleave(calls, rounds, min_time=0.2)
    rows = []
    for r in results:
        if "call" not in r:
            rows.append([label(r)] + [None] * 10 + [r["failed"]])
            continue
        for name in [label(r)] + ([label(r) + PINNED] if "pinned_call" in r else []):
            # tract's profile was taken on the pageable inputs: not repeated for pinned rows
            split = {} if name.endswith(PINNED) else r.get("split", {})
            native = "native" + (PINNED if name.endswith(PINNED) else "")
            native = native if native in samples.rounds else None
            rows.append([name, common.ms(samples.median(name + RUN)),
                         common.ms(samples.median(name)),
                         common.ratio(samples.ratio(name + RUN, native + RUN)) if native else None,
                         common.ratio(samples.ratio(name, native)) if native else None,
                         common.error_cell(r["error"], TOLERANCE),
                         common.ms(split.get("cuda")), common.ms(split.get("transfer")),
                         common.ms(split.get("cpu")), f"{r['load_s']:.2g}", f"{r['drift']:.1g}",
                         "" if name.endswith(PINNED) else r.get("host_ops") or ""])
    chosen = next((r["table"] for r in results if r["table"] != "-"), "-")
    columns = ["path", "run alone ms", "with read-back ms", "vs native (run alone)",
               "vs native (with read-back)", "rel. error",
               "GPU ops ms", "transfers+waits ms", "CPU ops ms", "load s", "State drift",
               "slowest CPU ops (profiler)"]
    SAMPLES[seq] = {name: [t * 1e3 for t in times] for name, times in samples.rounds.items()}
    return f"**S = {seq}** (the table's choice for CUDA: {chosen})\n\n" + \
        common.markdown(columns, rows) + "\n"


KERNEL_CALLS = 3


TRACES: dict[str, list] = {}  # --trace: per file, one call's kernels and copies in order


def kernel_profile(entry: dict, pinned: bool = False) -> str:
    """What the GPU itself does in one State.run: tract's kernels and copies as CUDA's
    profiling interface (CUPTI, through torch.profiler, which records every context of the
    process) sees them, per call (KERNEL_CALLS calls averaged): the kernel count, kernel
    time, host-to-device and device-to-host copy time, and the kernels that take longest."""
    from torch.profiler import ProfilerActivity, profile

    run = entry["pinned_run" if pinned else "run"]
    run()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(KERNEL_CALLS):
            run()
    with tempfile.TemporaryDirectory() as folder:
        trace = Path(folder) / "trace.json"
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text()).get("traceEvents", [])
    kernels: dict[str, list[float]] = {}
    copies = {"HtoD": 0.0, "DtoH": 0.0, "other": 0.0}
    gpu = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                 key=lambda e: e.get("ts", 0.0))
    TRACES[Path(entry["path"]).name + (PINNED if pinned else "")] = [
        (e.get("name", "")[:90], e.get("ts"), e.get("dur"))
        for e in gpu[: len(gpu) // KERNEL_CALLS]]
    for event in events:
        cat, name, dur = event.get("cat", ""), event.get("name", ""), event.get("dur", 0.0)
        if cat == "kernel":
            kernels.setdefault(name.split("(")[0][:60], []).append(dur)
        elif cat in ("gpu_memcpy", "gpu_memset"):
            side = "HtoD" if "HtoD" in name else "DtoH" if "DtoH" in name else "other"
            copies[side] += dur
    count = sum(len(d) for d in kernels.values()) / KERNEL_CALLS
    busy = sum(sum(d) for d in kernels.values()) / KERNEL_CALLS / 1e3
    top = sorted(kernels.items(), key=lambda item: -sum(item[1]))[:5]
    tops = ", ".join(f"{k} x{len(d) // KERNEL_CALLS} {sum(d) / KERNEL_CALLS / 1e3:.3g} ms"
                     for k, d in top)
    return (f"- {label(entry) + (PINNED if pinned else '')}, S = {entry['seq']}: {count:.0f} "
            f"kernels, {busy:.3g} ms of "
            f"kernel time, copies in {copies['HtoD'] / KERNEL_CALLS / 1e3:.3g} ms, out "
            f"{copies['DtoH'] / KERNEL_CALLS / 1e3:.3g} ms, other "
            f"{copies['other'] / KERNEL_CALLS / 1e3:.3g} ms per call; longest: {tops}")


def probe_table(results: list[dict], cpu_results: list[dict], rounds: int) -> str:
    """The native operator under CUDA and on the CPU runtime, per dtype set / width / batch."""
    rows = []
    for gpu, cpu in zip(results, cpu_results):
        if "call" not in gpu or "call" not in cpu:
            rows.append([gpu["name"], None, None, None, gpu.get("failed") or cpu.get("failed")])
            continue
        samples = common.interleave({"cuda": gpu["call"], "cpu": cpu["call"]}, rounds)
        split = gpu.get("split", {})
        rows.append([gpu["name"], common.ms(samples.median("cuda")),
                     common.ms(samples.median("cpu")), common.ratio(samples.ratio("cpu", "cuda")),
                     common.ms(split.get("cuda")), common.ms(split.get("cpu")),
                     gpu.get("host_ops") or ""])
    columns = ["native operator, S = 64", "CUDA ms", "CPU runtime ms", "CPU / CUDA",
               "GPU ops ms (profiler)", "CPU ops ms (profiler)", "slowest CPU ops"]
    return common.markdown(columns, rows) + "\n"


def run(folder: Path, runtime: str, lengths: Sequence[int], rounds: int,
        profiles_out: Optional[Path], kernels: bool = False,
        trace_out: Optional[Path] = None, pinned: bool = False,
        samples_out: Optional[Path] = None) -> None:
    manifest = json.loads((folder / "manifest.json").read_text())
    for entry in manifest:
        entry["path"] = str(folder / Path(entry["path"]).name)  # written on another machine
    profiles: dict[str, str] = {}
    common.emit(common.header(f"GDN layer core on tract's {runtime} runtime (B=1, 16 heads, "
                              "Dk=Dv=128, f16 q/k/v/beta, f32 gate and state)",
                              f"{rounds} interleaved rounds per S; State.run on tract "
                              "tensors held on the host, alone and with to_numpy of both "
                              "outputs; error = max relative error vs the float64 "
                              "recurrence"))
    for seq in sorted({e["seq"] for e in manifest if e["kind"] == "bench"} & set(lengths)):
        results = [measure(e, runtime, profiles, pinned) for e in manifest
                   if e["kind"] == "bench" and e["seq"] == seq]
        common.emit(bench_table(seq, results, rounds))
        for r in results:
            if "failed" in r:
                common.emit(f"- {label(r)}: {r['failed']}")
        if kernels and runtime == "cuda":
            common.emit(f"GPU work per call (S = {seq}):\n")
            for r in (r for r in results if "run" in r):
                for locked in [False] + ([True] if "pinned_run" in r else []):
                    try:
                        common.emit(kernel_profile(r, locked))
                    except Exception as exc:  # noqa: BLE001  (the timings above still stand)
                        common.emit(f"- {label(r)}: kernel profile failed: {why(exc)}")
            common.emit("")
    for entry in (e for e in manifest if e["kind"] == "tiny"):
        common.emit(tiny_model_check(entry, folder, runtime) + "\n")
    probes = [e for e in manifest if e["kind"] == "probe"]
    if probes and runtime == "cuda":
        gpu = [measure(e, "cuda", profiles) for e in probes]
        cpu = [measure(e, "cpu", {}) for e in probes]
        common.emit(probe_table(gpu, cpu, rounds))
    if profiles_out is not None:
        profiles_out.write_text(json.dumps(profiles))
    if trace_out is not None:
        trace_out.write_text(json.dumps(TRACES))
    if samples_out is not None:
        samples_out.write_text(json.dumps(SAMPLES))


def main() -> None:
    ap = common.parser(__doc__.splitlines()[0])
    ap.add_argument("--prepare", type=Path, help="write the NNEF files and manifest here")
    ap.add_argument("--run", type=Path, help="time the files of this folder's manifest")
    ap.add_argument("--runtime", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--lengths", nargs="+", type=int, default=list(LENGTHS + CROSSING),
                    choices=list(LENGTHS + CROSSING))
    ap.add_argument("--probe", action="store_true",
                    help="with --prepare: also the native operator's dtype/width/batch probe")
    ap.add_argument("--paths", nargs="+", default=None,
                    help="with --prepare: only these candidates (native_f32: the all-f32 "
                    "native operator); default every one")
    ap.add_argument("--tiny", action="store_true",
                    help="with --prepare: also a whole tiny Qwen3.5 step (f16) for the check")
    ap.add_argument("--profiles", type=Path, help="with --run: write tract's profiles here")
    ap.add_argument("--kernels", action="store_true",
                    help="with --run on CUDA: also each path's GPU kernels and copies per call "
                    "(CUPTI through torch.profiler)")
    ap.add_argument("--trace", type=Path,
                    help="with --kernels: write one call's GPU kernels and copies per path, in "
                    "order (name, start us, duration us), to this JSON file")
    ap.add_argument("--pinned", action="store_true",
                    help="with --run on CUDA: also time native, chunked_parallel and the I/O "
                    "floor on page-locked host inputs (cudaHostRegister), in the same rotation")
    ap.add_argument("--samples", type=Path,
                    help="with --run: write every timed call's per-round times (ms) here")
    args = ap.parse_args()
    common.silence_warnings()
    import gdn_fx  # noqa: F401  (registers torch.ops.gdn_fx)

    if args.prepare is None and args.run is None:
        ap.error("give --prepare DIR (here) and/or --run DIR (where the GPU is)")
    if args.prepare is not None:
        prepare(args.prepare, args.lengths, args.probe, args.tiny, args.paths)
    if args.run is not None:
        run(args.run, args.runtime, args.lengths, common.rounds_for(args, full=7),
            args.profiles, args.kernels, args.trace, args.pinned, args.samples)


if __name__ == "__main__":
    main()
