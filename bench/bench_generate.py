"""Whole-model generation: gdn-fx's generation-ready artifact in tract against torch eager.

The model is Qwen3.5-0.8B-shaped (hidden 1024, 24 layers of which 18 GDN, GDN 16 + 16 heads of
128, attention 8 / 2 heads of 256, FFN 3584, vocab 248,320, tied embeddings, f32, random
weights), built from its config. One thread everywhere. Each engine runs in a fresh
subprocess (so its peak memory is its own), alternately, ``--rounds`` times; figures are
medians over rounds. Floors, measured in the same run: weight bytes / this machine's memory
bandwidth (one thread, a numpy sum over 1 GiB) for decode, and matmul FLOPs / tract's matmul
peak (a 512 x 1024 x 4096 product in tract) for prefill.

    .venv/bin/python bench/bench_generate.py              # the 0.8B shape (~15 min)
    .venv/bin/python bench/bench_generate.py --quick      # 4 layers, vocab 32k (~2 min)
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

LIN, FULL = "linear_attention", "full_attention"
SHAPE = dict(vocab_size=248320, hidden_size=1024, num_attention_heads=8, num_key_value_heads=2,
             head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16,
             linear_key_head_dim=128, linear_value_head_dim=128, intermediate_size=3584,
             num_hidden_layers=24, layer_types=[LIN, LIN, LIN, FULL] * 6,
             tie_word_embeddings=True)
QUICK = dict(SHAPE, vocab_size=32000, num_hidden_layers=4, layer_types=[LIN, LIN, LIN, FULL])
PAST, PREFILL, DECODE_STEPS = 512, 512, 8


def build(shape: dict):
    from gdn_fx.hf import tiny_model

    return tiny_model("qwen3_5", **shape)


# --- what each subprocess runs ------------------------------------------------------------

def run_tract(main: str, decode: str) -> dict:
    """Load the artifact, prefill PREFILL tokens, decode DECODE_STEPS after PAST tokens."""
    import numpy as np

    from gdn_fx.hf.generator import Generator

    start = time.perf_counter()
    gen = Generator(main, decode or None)
    load = time.perf_counter() - start
    ids = np.arange(3, 3 + PREFILL, dtype=np.int64)[None] % 1000 + 3
    zeros = [z.copy() for z in gen.zero_states]
    prefill = []
    for _ in range(2):
        start = time.perf_counter()
        logits, caches = gen.step(gen.main, ids, zeros)
        prefill.append(time.perf_counter() - start)
    steps = []
    for _ in range(DECODE_STEPS):  # continuing from the PAST-token prefill above
        token = np.array([[int(logits[0].argmax())]], dtype=np.int64)
        start = time.perf_counter()
        logits, caches = gen.step(gen.decode, token, caches)
        steps.append(time.perf_counter() - start)
    return dict(load=load, prefill=min(prefill), decode=statistics.median(steps[1:]))


def run_torch(shape: dict) -> dict:
    import torch
    from transformers import DynamicCache

    model = build(shape)
    ids = (torch.arange(3, 3 + PREFILL) % 1000 + 3)[None]
    prefill, steps = [], []
    with torch.no_grad():
        for _ in range(2):
            cache = DynamicCache(config=model.config)
            start = time.perf_counter()
            logits = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1).logits
            prefill.append(time.perf_counter() - start)
        for _ in range(DECODE_STEPS):
            token = logits[:, -1].argmax(-1, keepdim=True)
            start = time.perf_counter()
            logits = model(input_ids=token, cache=cache, use_cache=True).logits
            steps.append(time.perf_counter() - start)
    return dict(load=0.0, prefill=min(prefill), decode=statistics.median(steps[1:]))


def peak_rss() -> int:
    """This process's peak resident memory in bytes (VmHWM: unlike getrusage's ru_maxrss,
    which Linux carries across execve, it starts afresh with the process's own image)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def bandwidth() -> float:
    """Bytes per second one thread reads (numpy sum over 1 GiB, best of 5)."""
    import numpy as np

    data = np.ones(1 << 28, dtype=np.float32)
    best = min(_seconds(data.sum) for _ in range(5))
    return data.nbytes / best


def tract_matmul_peak(folder: Path) -> float:
    """FLOP/s of tract on a [1, 512, 1024] x [1024, 4096] product (a model-sized matmul)."""
    import torch
    import tract

    import gdn_fx
    from gdn_fx import tract_check

    layer = torch.nn.Linear(1024, 4096, bias=False)
    x = torch.randn(1, 512, 1024)
    path = gdn_fx.export_nnef(torch.export.export(layer, (x,)), folder / "mm.nnef.tgz")
    state = tract_check.load(path).spawn_state()
    arg = [tract.Tensor.from_numpy(x.numpy())]
    state.run(arg)
    best = min(_seconds(lambda: state.run(arg)) for _ in range(5))
    return 2 * 512 * 1024 * 4096 / best


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _child(kind: str, *args: str) -> dict:
    """Run one engine in a fresh one-thread process; its figures and peak RSS."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TRACT_NUM_THREADS="1")
    code = (f"import sys, json; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
            "import torch; torch.set_num_threads(1); import bench_generate as b; "
            f"r = b.{kind}(*{list(args)!r}); "
            "r['peak_rss'] = b.peak_rss(); "
            "print('RESULT', json.dumps(r))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if not lines:
        raise RuntimeError(f"{kind} failed: {out.stderr[-2000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main(argv=None) -> None:
    import torch

    args = common.parser(__doc__.splitlines()[0]).parse_args(argv)
    common.silence_warnings()
    torch.set_num_threads(1)
    shape = QUICK if args.quick else SHAPE
    rounds = common.rounds_for(args, full=2, quick=1)
    folder = Path(args.workdir or tempfile.mkdtemp(prefix="gdn_fx_gen_"))
    from gdn_fx.hf.generator import export_generator

    model = build(shape)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    # Prefill matmuls: every weight but the embedding table once per token (the tied head
    # runs on the last position only); attention's own S^2 terms are small at S = 512.
    embedding = model.get_input_embeddings().weight.numel()
    flops_per_token = 2 * (sum(p.numel() for p in model.parameters()) - embedding)
    start = time.perf_counter()
    files = export_generator(model, folder / "model.nnef.tgz")
    export_s = time.perf_counter() - start
    del model
    sizes = sum(p.stat().st_size for p in (files.main, files.decode) if p is not None)
    measured = {"gdn-fx artifact in tract (f32)": [], "torch eager (f32)": []}
    for _ in range(rounds):
        measured["gdn-fx artifact in tract (f32)"].append(
            _child("run_tract", str(files.main), str(files.decode or "")))
        measured["torch eager (f32)"].append(_child("run_torch", shape))
    bw, peak = bandwidth(), tract_matmul_peak(folder)
    decode_floor = weight_bytes / bw
    prefill_floor = flops_per_token * PREFILL / peak
    rows = []
    for name, runs in measured.items():
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        tract_row = "tract" in name
        rows.append([name, common.ms(med["decode"]), common.ratio(med["decode"] / decode_floor),
                     common.ms(med["prefill"]), common.ratio(med["prefill"] / prefill_floor),
                     f"{export_s:.0f} s" if tract_row else "-",
                     common.human_bytes(sizes) if tract_row else "-",
                     f"{med['load']:.1f} s" if tract_row else "-",
                     common.human_bytes(int(med["peak_rss"]))])
    common.emit(common.header(
        "Whole-model generation: gdn-fx artifact in tract vs torch eager",
        f"Qwen3.5-shaped model ({sum(1 for t in shape['layer_types'] if t == LIN)} GDN + "
        f"{sum(1 for t in shape['layer_types'] if t == FULL)} attention layers, hidden "
        f"{shape['hidden_size']}, vocab {shape['vocab_size']}, {weight_bytes / 4e6:.0f} M "
        f"params, f32, tied), one thread; decode = median ms per token after {PAST} cached "
        f"tokens; prefill = {PREFILL} tokens from an empty cache; each engine in its own "
        f"process, {rounds} round(s)"))
    common.emit(common.markdown(
        ["path", "decode ms/token", "/ floor", f"prefill ms (S={PREFILL})", "/ floor",
         "export", "NNEF (both graphs)", "load", "peak RSS"], rows))
    common.emit(f"\nFloors: decode {decode_floor * 1e3:.0f} ms = {weight_bytes / 1e9:.2f} GB of "
                f"weights / {bw / 1e9:.1f} GB/s (one thread); prefill "
                f"{prefill_floor * 1e3:.0f} ms = {flops_per_token * PREFILL / 1e12:.2f} TFLOP / "
                f"{peak / 1e9:.1f} GFLOP/s (tract's matmul, one thread). Decode graph: "
                f"{'written' if files.decode else 'none: ' + files.decode_note}.\n")


if __name__ == "__main__":
    main()
