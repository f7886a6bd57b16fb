"""Whole-model generation on tract's CUDA runtime against torch eager on the same GPU.

Two parts, in one run on the GPU machine:
- the tiny qwen3_5 and qwen3_next families in f16, exported with
  ``export_generator(..., runtime="cuda")``: 32 greedy tokens from
  ``Generator(..., runtime="cuda")`` against transformers' greedy ``generate`` (computed where
  the export is written, on the CPU in f16: every token, every step's logits within the f16
  bound ``LOGITS_BOUND``);
- the Qwen3.5-0.8B shape in f16 (bench_generate.SHAPE): load, prefill of PREFILL tokens in one
  call from empty caches, decode ms/token after PAST tokens; torch eager (transformers, f16,
  the same shape, on the GPU) timed the same way in the same process. tract's profile of one
  decode and one prefill call names every op it runs on the CPU (not Cuda*/Gpu*/DeviceSync*).

The 0.8B shape is exported as the table's choices (the conv update as tract's conv op,
"depthwise", one launch), with ``--big-portable`` also with the conv update forced to the
multiply-adds ("conv portable", which tract's slice push-up cuts in three; the CUDA choice
before 2026-12-06), and as the main / decode pair ("pair": the main graph's scans "chunked_window", the batched chunks of a 512-token
window; the S = 1 decode graph beside it keeps the native kernel). Prefill is timed at PREFILL
and at SHORT tokens, each in one call.
``--baseline FILE ...`` times 0.8B artifacts another revision wrote (same script,
``prepare_big`` run there) in the same process, after this revision's.

The 0.8B artifact's large weights are a random block of BLOCK values repeated (the tgz then
compresses ~1000:1 and travels to the GPU machine); timing does not depend on the values.
torch eager gets its own random weights. The files are written where torch-to-nnef is, the
timing runs where the GPU is:

    .venv/bin/python bench/bench_cuda_generate.py --prepare .gpu/gen       # here
    python3 bench/bench_cuda_generate.py --run .gpu/gen --out $OUT          # on the GPU machine
        [--baseline .gpu/base/qwen35_08b_f16.nnef.tgz]
    .venv/bin/python bench/bench_cuda_generate.py --prepare .gpu/gen --tiny-only
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import cuda_pool  # noqa: E402

FAMILIES = ("qwen3_5", "qwen3_next")
PROMPT, NEW_TOKENS = 37, 32
PAST = PREFILL = 512
DECODE_STEPS, PREFILL_RUNS = 24, 3
BLOCK = 8191  # values repeated in a large weight: 16 KiB of f16, inside deflate's 32 KiB window
BIG = "qwen35_08b_f16.nnef.tgz"
# the main / decode pair: the main graph's scans "chunked_window" (prefill), the decode
# graph beside it (the S = 1 program: the native kernel)
PAIR = "qwen35_08b_f16.pair.nnef.tgz"
SHORT = 128  # a shorter prompt, prefilled in one call too
# the 0.8B artifacts: the table's choices (the conv update as tract's conv op, "depthwise"),
# and the conv update forced to the multiply-adds ("portable", the CUDA choice before 12-06)
PORTABLE = {"causal_conv1d_update": "portable"}  # the conv update's CUDA choice before 12-06
# the 0.8B artifacts timed side by side (--big-portable adds "conv portable": four archives
# with the wheel overflow the 64 MiB a device call carries)
BIGS = {"": (BIG, None), "pair": (PAIR, None)}
RUNTIME = "cuda"  # --runtime cpu: a dry run of --run on a machine without a GPU


# --- prepare (needs torch-to-nnef) ---------------------------------------------------------

def prompt_ids(length: int = PROMPT, seed: int = 1) -> list:
    from gdn_fx.hf.configs import SAFE_TOKEN_RANGE

    low, high = SAFE_TOKEN_RANGE
    return torch.randint(low, high, (length,),
                         generator=torch.Generator().manual_seed(seed)).tolist()


def hf_reference(model, prompt: list, tokens: int) -> dict:
    """transformers' greedy generate: the new tokens and each step's raw logits."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens,
                             min_new_tokens=0, do_sample=False, eos_token_id=None,
                             pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    return dict(prompt=np.array(prompt), tokens=out.sequences[0, ids.shape[1]:].numpy(),
                logits=torch.stack([s[0] for s in out.logits]).float().numpy())


def prepare_tiny(folder: Path) -> dict:
    from gdn_fx.hf import tiny_model
    from gdn_fx.hf.generator import export_generator

    entries = {}
    for family in FAMILIES:
        model = tiny_model(family, dtype=torch.float16)
        files = export_generator(model, folder / f"{family}.nnef.tgz", runtime="cuda")
        # the same with the CPU's choice for a symbolic-S scan ("split"): the table's CUDA
        # choice, "chunked", runs on the CPU too there (no CUDA kernel takes width 16)
        export_generator(tiny_model(family, dtype=torch.float16),
                         folder / f"{family}.split.nnef.tgz", runtime="cuda",
                         choose={"*": "split"})
        export_generator(tiny_model(family, dtype=torch.float16),
                         folder / f"{family}.portable.nnef.tgz", runtime="cuda",
                         choose=PORTABLE)
        export_generator(tiny_model(family, dtype=torch.float16),  # "chunked_window" + decode
                         folder / f"{family}.pair.nnef.tgz", runtime="cuda", decode=True)
        np.savez(folder / f"{family}.ref.npz", **hf_reference(model, prompt_ids(), NEW_TOKENS))
        entries[family] = files.main.name
    return entries


def patterned(model) -> None:
    """Every weight over 64 Ki values becomes a random block of BLOCK values repeated (same
    scale as the initializer's), so that the archive compresses."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            if param.numel() > 1 << 16:
                block = torch.randn(BLOCK, generator=generator) * float(param.float().std())
                reps = -(-param.numel() // BLOCK)
                param.copy_(block.repeat(reps)[: param.numel()].view_as(param))


def prepare_big(folder: Path) -> list:
    from common import SHAPE

    from gdn_fx.hf import tiny_model
    from gdn_fx.hf.generator import export_generator

    model = tiny_model("qwen3_5", dtype=torch.float16, **SHAPE)
    patterned(model)
    for name, choose in BIGS.values():
        files = export_generator(model, folder / name, runtime="cuda", choose=choose,
                                 decode=name == PAIR, say=print)
        for path in filter(None, (files.main, files.decode)):
            recompress(path)
    return [name for name, _ in BIGS.values()]


def recompress(path: Path) -> None:
    """The archive gzipped at level 6 (gdn-fx writes it barely compressed, fast; the
    patterned weights then shrink ~100x: 1.5 GB to ~16 MB)."""
    import gzip
    import shutil

    staged = path.with_name(path.name + ".part")
    with gzip.open(path, "rb") as source, gzip.open(staged, "wb", compresslevel=6) as sink:
        shutil.copyfileobj(source, sink, 1 << 24)
    staged.replace(path)


# --- run (on the GPU machine) --------------------------------------------------------------

def op_split(runnable, inputs: list) -> dict:
    """tract's profile of one call: seconds per call on GPU ops, transfers and CPU ops, and
    the CPU ops by kind (count, seconds, a node name)."""
    nodes = json.loads(runnable.profile_json(inputs))["nodes"]
    split = {"gpu": 0.0, "transfer": 0.0, "cpu": 0.0}
    by_kind: dict = {"gpu": {}, "transfer": {}, "cpu": {}}
    for node in nodes:
        name, seconds = node.get("op_name", "?"), node.get("secs_per_iter") or 0.0
        kind = "gpu" if name.startswith(("Cuda", "Gpu")) else \
            "transfer" if name.startswith("DeviceSync") else "cpu"
        split[kind] += seconds
        count, total, example = by_kind[kind].get(name, (0, 0.0, node.get("node_name", "")))
        by_kind[kind][name] = (count + 1, total + seconds, example)
    for kind, ops in by_kind.items():
        split[f"{kind}_ops"] = {k: [c, round(t * 1e3, 4), e] for k, (c, t, e) in
                                sorted(ops.items(), key=lambda item: -item[1][1])}
    return split


def kernel_time(call) -> dict:
    """The GPU's own work in one call, through torch.profiler's CUPTI (it sees tract's
    kernels and copies): kernel count and summed milliseconds, copies likewise."""
    from torch.profiler import ProfilerActivity, profile

    call()  # warm
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        call()
        sync()
    kernels = copies = 0
    kernel_ms = copy_ms = 0.0
    for event in prof.events():
        if event.device_type.name != "CUDA":
            continue
        if "memcpy" in event.name.lower() or "memset" in event.name.lower():
            copies, copy_ms = copies + 1, copy_ms + event.device_time / 1e3
        else:
            kernels, kernel_ms = kernels + 1, kernel_ms + event.device_time / 1e3
    return dict(kernels=kernels, kernel_ms=kernel_ms, copies=copies, copy_ms=copy_ms)


def run_tiny(folder: Path, out: Path) -> list:
    from gdn_fx.hf.generator import LOGITS_BOUND, Generator

    rows = []
    for family, variant in [(f, v) for f in FAMILIES
                            for v in ("", ".kv", ".split", ".portable", ".pair")]:
        ref = np.load(folder / f"{family}.ref.npz")
        path = folder / f"{family}{variant.replace('.kv', '')}.nnef.tgz"
        if not path.exists():
            continue
        start = time.perf_counter()
        gen = Generator.open(path, runtime=RUNTIME, kv_in_state=variant == ".kv")
        load = time.perf_counter() - start
        try:
            result = gen.generate(ref["prompt"].tolist(), NEW_TOKENS)
        except Exception as error:  # noqa: BLE001 (tract's errors: said, the others run)
            text = " ".join(str(error).split("Stack backtrace")[0].split())[:600]
            print(f"{family}{variant}: tract fails: {text}", flush=True)
            rows.append(dict(family=family + variant, error=text))
            continue
        got = np.stack(result.logits).astype(np.float64)
        want = ref["logits"].astype(np.float64)
        worst = float(max(np.abs(g - w).max() / np.abs(w).max() for g, w in zip(got, want)))
        equal = result.tokens == ref["tokens"].tolist()
        np.savez(out / f"tract_{family}{variant}.npz", tokens=np.array(result.tokens), logits=got)
        ids = np.array([ref["prompt"].tolist()], dtype=np.int64)
        profile = op_split(gen.main_graph.runnable, [ids, *gen.zero_states])
        rows.append(dict(family=family + variant, load_s=load, tokens_equal=equal, worst_logits=worst,
                         bound=LOGITS_BOUND[torch.float16], rates=result.rates(),
                         profile=profile))
        print(f"{family}{variant}: tokens equal {equal}, logits {worst:.2e} "
              f"(bound {LOGITS_BOUND[torch.float16]}), load {load:.1f} s, {result.rates()}",
              flush=True)
    return rows


def time_tract(path: Path, kv_in_state: bool = False, transform: str = "") -> dict:
    """Load, prefill PREFILL tokens in one call (best and median of PREFILL_RUNS, fresh zero
    caches each), then DECODE_STEPS tokens after them (median, first step left out).
    ``kv_in_state``: the attention caches stay in tract's State (on the GPU), folded there by
    tract's "detect_kv_cache" transform (Generator(kv_in_state=True)). ``transform``: an
    experiment, another tract transform in its place ("transformers_detect_all": the same,
    then tract's rope / softmax / SDPA pattern rules), set on the module for this load."""
    from gdn_fx.runtime import artifact
    from gdn_fx.runtime.generator import Generator

    kept = artifact.KV_IN_STATE  # load_graph reads it there
    artifact.KV_IN_STATE = transform or kept
    free = device_free()
    try:
        start = time.perf_counter()
        gen = Generator.open(path, runtime=RUNTIME, prefill_chunk=None,
                             kv_in_state=kv_in_state)
    finally:
        artifact.KV_IN_STATE = kept
    load = time.perf_counter() - start
    held = (free - device_free()) / 1e9  # GPU memory the loaded graphs hold
    ids = (np.arange(PREFILL, dtype=np.int64)[None] % 1000) + 3
    runs, short = [], []
    for _ in range(PREFILL_RUNS):
        start = time.perf_counter()
        gen.step(gen.main, ids[:, :SHORT], [z.copy() for z in gen.zero_states])
        short.append(time.perf_counter() - start)
        start = time.perf_counter()
        logits, caches = gen.step(gen.main, ids, [z.copy() for z in gen.zero_states])
        runs.append(time.perf_counter() - start)
    steps = []
    for _ in range(DECODE_STEPS):
        token = np.array([[int(logits[0].argmax())]], dtype=np.int64)
        start = time.perf_counter()
        logits, caches = gen.step(gen.decode, token, caches)
        steps.append(time.perf_counter() - start)
    runnable = gen.main_graph.runnable
    # (the profiled and CUPTI calls repeat one decode step on the same inputs: with the
    # caches in the State each appends once more; the State is not reused after)
    kernels = dict(decode=guarded(kernel_time, lambda: gen.step(gen.decode, token, caches)),
                   prefill=guarded(kernel_time, lambda: gen.step(
                       gen.main, ids, [z.copy() for z in gen.zero_states])))
    return dict(kv_in_state=kv_in_state, transform=transform, kernels=kernels, load_s=load, prefill_s=min(runs), prefill_median_s=statistics.median(runs),
                short_s=min(short),
                decode_s=statistics.median(steps[1:]), finite=bool(np.isfinite(logits).all()),
                device_gb=held, decode_profile=op_split(gen.decode_graph.runnable,
                                                        [token, *caches]),
                prefill_profile=op_split(runnable, [ids, *gen.zero_states]))


def time_torch() -> dict:
    """torch eager (transformers, f16) on the GPU: prefill PREFILL tokens from an empty
    cache, then decode after them, each call synchronized."""
    from common import SHAPE

    from gdn_fx.hf import tiny_model

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = tiny_model("qwen3_5", dtype=torch.float16, **SHAPE).to(device)
    ids = ((torch.arange(PREFILL) % 1000) + 3)[None].to(device)
    runs, steps, short = [], [], []
    with torch.no_grad():
        for _ in range(PREFILL_RUNS):  # the model makes its own (hybrid) cache
            sync()
            start = time.perf_counter()
            model(input_ids=ids[:, :SHORT], use_cache=True, logits_to_keep=1)
            sync()
            short.append(time.perf_counter() - start)
            start = time.perf_counter()
            out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
            sync()
            runs.append(time.perf_counter() - start)
        logits, cache = out.logits, out.past_key_values
        for _ in range(DECODE_STEPS):
            token = logits[:, -1].argmax(-1, keepdim=True)
            sync()
            start = time.perf_counter()
            logits = model(input_ids=token, past_key_values=cache, use_cache=True).logits
            sync()
            steps.append(time.perf_counter() - start)
    return dict(prefill_s=min(runs), prefill_median_s=statistics.median(runs),
                short_s=min(short), decode_s=statistics.median(steps[1:]))


def device_free() -> float:
    """Free bytes on the GPU (the whole device's: tract's allocations count), 0 without one."""
    return torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else 0.0


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


GPU = "H200"  # the card the table names: run() sets it to the one the run found


def table(tract_times: dict, torch_times: dict, label: str = "") -> str:
    kv = ", attention caches in the State" if tract_times.get("kv_in_state") else ""
    kv += f" ({tract_times['transform']})" if tract_times.get("transform") else ""
    kv += f", {label}" if label else ""
    rows = [(f"tract CUDA, gdn-fx generator artifact (f16){kv}", tract_times),
            ("torch eager, transformers (f16)", torch_times)]
    lines = [f"| engine (Qwen3.5-0.8B shape, {GPU}) | decode ms/token at P = {PAST} | "
             f"prefill {PREFILL} tokens, ms (best / median of {PREFILL_RUNS}) | "
             f"prefill {SHORT} tokens, ms (best) |",
             "|---|---|---|---|"]
    for name, t in rows:
        if "decode_s" in t:
            lines.append(f"| {name} | {t['decode_s'] * 1e3:.2f} | {t['prefill_s'] * 1e3:.1f} / "
                         f"{t['prefill_median_s'] * 1e3:.1f} | {t.get('short_s', 0) * 1e3:.1f} |")
        else:
            lines.append(f"| {name} | failed: {t.get('error', '?')[:200]} | |")
    return "\n".join(lines)


def guarded(fn, *args) -> dict:
    try:
        return fn(*args)
    except Exception as error:  # noqa: BLE001 (one part failing must not lose the others)
        text = " ".join(str(error).split("Stack backtrace")[0].split())
        print(f"{fn.__name__} failed: {type(error).__name__}: {text[:800]}", flush=True)
        return {"error": f"{type(error).__name__}: {text[:800]}"}


def run(folder: Path, out: Path, parts: set, baselines: tuple = (), rounds: int = 1,
        pool: bool = False) -> None:
    """The parts asked for, on the artifacts of ``folder``; ``baselines``: more 0.8B
    artifacts (another revision's) timed in the same process after this revision's.
    ``rounds`` > 1: the 0.8B artifacts are timed again, in reverse order, then forward, ...
    (rows "<label> #2", ...), so that a drift of the machine shows against the order.
    ``pool``: the even rounds run with the driver's pool keeping freed memory
    (bench/cuda_pool.py), the odd ones with its default (released at each synchronization)."""
    out.mkdir(parents=True, exist_ok=True)
    global GPU
    found = dict(gpu=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
    GPU = found["gpu"] or "no GPU"
    if "tiny" in parts:
        found["tiny"] = guarded(run_tiny, folder, out)
    if "big" in parts and (folder / BIG).exists():
        found["tract"] = guarded(time_tract, folder / BIG)
        (out / "results.json").write_text(json.dumps(found, indent=1, default=str))
        found["torch"] = guarded(time_torch)
        print(table(found["tract"], found["torch"]), flush=True)
        others = [(label, folder / name) for label, (name, _) in BIGS.items() if label] + \
            [(f"baseline {path}", path) for path in baselines]
        for label, path in others:  # the same process and GPU: side by side with the above
            if path.exists():
                found[label] = guarded(time_tract, path)
                print(table(found[label], found["torch"], label), flush=True)
                (out / "results.json").write_text(json.dumps(found, indent=1, default=str))
        timed_rows = [("", folder / BIG), *others]
        for again in range(2, rounds + 1):
            order = timed_rows[::-1] if again % 2 == 0 else timed_rows
            for label, path in order:
                if path.exists():
                    key = f"{label or 'tract'} #{again}"
                    if pool:
                        kept = again % 2 == 0
                        key += " pool kept" if kept else " pool released"
                        print(key, cuda_pool.set_release_threshold(
                            cuda_pool.KEEP_ALL if kept else 0) or "threshold set", flush=True)
                    found[key] = guarded(time_tract, path)
                    print(table(found[key], found["torch"], key), flush=True)
                    (out / "results.json").write_text(json.dumps(found, indent=1, default=str))
    if "kv" in parts and (folder / BIG).exists():
        found["kv_on_device"] = guarded(time_tract, folder / BIG, True)
        print(table(found["kv_on_device"], found.get("torch", {})), flush=True)
        found["detect_all"] = guarded(time_tract, folder / BIG, True, "transformers_detect_all")
        print(table(found["detect_all"], found.get("torch", {})), flush=True)
    (out / "results.json").write_text(json.dumps(found, indent=1, default=str))
    timed = ["tract", "kv_on_device", "detect_all", *[k for k in found if k.startswith(
        ("conv", "baseline", "pair")) and "#" not in k]]
    for key in timed:
        for phase in ("decode_profile", "prefill_profile"):
            profile = found.get(key, {}).get(phase)
            if profile:
                ops = ", ".join(f"{k} x{c} {t:.3g} ms" for k, (c, t, _) in
                                list(profile["cpu_ops"].items())[:12])
                gpu = ", ".join(f"{k} x{c} {t:.3g} ms" for k, (c, t, _) in
                                list(profile["gpu_ops"].items())[:10])
                print(f"{key} {phase} gpu ops ({sum(c for c, _, _ in profile['gpu_ops'].values())}"
                      f"): {gpu}", flush=True)
                print(f"{key} {phase}: gpu {profile['gpu'] * 1e3:.2f} ms, transfer "
                      f"{profile['transfer'] * 1e3:.2f} ms, cpu {profile['cpu'] * 1e3:.2f} ms; "
                      f"cpu ops: {ops}", flush=True)
    for key in timed:
        if "kernels" in found.get(key, {}):
            print(f"{key} GPU work per call (CUPTI):", found[key]["kernels"],
                  f"load {found[key]['load_s']:.1f} s, GPU memory held "
                  f"{found[key]['device_gb']:.2f} GB", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prepare", type=Path, help="write the artifacts into this folder")
    parser.add_argument("--tiny-only", action="store_true", help="with --prepare: no 0.8B")
    parser.add_argument("--big-portable", action="store_true",
                        help="with --prepare: also the 0.8B with the conv update 'portable'")
    parser.add_argument("--run", type=Path, help="run the artifacts of this folder (GPU)")
    parser.add_argument("--out", type=Path, default=Path("out/cuda_generate"))
    parser.add_argument("--baseline", type=Path, nargs="*", default=[],
                        help="with --run: 0.8B artifacts of another revision, timed after")
    parser.add_argument("--runtime", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--rounds", type=int, default=1,
                        help="with --run: time the 0.8B artifacts this many times, "
                             "alternating their order")
    parser.add_argument("--pool", action="store_true",
                        help="with --rounds: even rounds keep freed memory in the driver's pool")
    parser.add_argument("--parts", nargs="+", default=["tiny", "big", "kv"],
                        choices=["tiny", "big", "kv"])
    args = parser.parse_args()
    if args.big_portable:
        BIGS["conv portable"] = ("qwen35_08b_f16.portable.nnef.tgz", PORTABLE)
    if args.prepare:
        args.prepare.mkdir(parents=True, exist_ok=True)
        manifest = dict(tiny=prepare_tiny(args.prepare))
        if not args.tiny_only:
            manifest["big"] = prepare_big(args.prepare)
        (args.prepare / "manifest.json").write_text(json.dumps(manifest, indent=1))
    if args.run:
        global RUNTIME
        RUNTIME = args.runtime
        run(args.run, args.out, set(args.parts), tuple(args.baseline), args.rounds, args.pool)


if __name__ == "__main__":
    main()
