"""Whole-model generation: gdn-fx's generation-ready artifact in tract against torch eager.

The model is Qwen3.5-0.8B-shaped (hidden 1024, 24 layers of which 18 GDN, GDN 16 + 16 heads of
128, attention 8 / 2 heads of 256, FFN 3584, vocab 248,320, tied embeddings, f32, random
weights), built from its config. One thread everywhere. Each engine runs in a fresh
subprocess (so its peak memory is its own), alternately, ``--rounds`` times; figures are
medians over rounds. Floors per format, measured in the same run: the larger of weight bytes /
this machine's memory bandwidth (one thread, a numpy sum over 1 GiB) and matmul FLOPs / tract's
matmul peak in that format (a [rows, 1024] x [1024, 4096] product in tract, one row for decode,
512 for prefill). torch's f32 peak on the same product is printed beside it: prefill is mostly
matmuls, so that ratio bounds how far tract's prefill can get ahead of torch's.

    .venv/bin/python bench/bench_generate.py              # the 0.8B shape (~15 min)
    .venv/bin/python bench/bench_generate.py --quick      # 4 layers, vocab 32k (~2 min)
    .venv/bin/python bench/bench_generate.py --formats f16   # only the f16 artifact
    .venv/bin/python bench/bench_generate.py --formats q4_0  # f32 model, Q4_0 matmul weights
    .venv/bin/python bench/bench_generate.py --quick --formats f32 --no-peer --pair
        # the one-graph artifact (the default export) beside the pair of earlier releases
        # (export_generator(decode=True): + X.decode.nnef.tgz, a second copy of the weights)
    .venv/bin/python bench/bench_generate.py --workdir W --reuse ...
        # the exports W holds from an earlier run, cut short, are measured, not redone
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
import peer  # noqa: E402
from tract_run import DECODE_STEPS, PREFILL  # noqa: E402
from common import FULL, LIN, QUICK, SHAPE, child as _child  # noqa: E402

PAST = 512  # decode depth: the decode steps follow a prefill of PREFILL = PAST tokens
PEER = "torch-to-nnef-llm 0.24.12 artifact in tract (f32)"


# name -> (the model's dtype: its compute, export_nnef's weights=): f16 is the model in f16;
# q4_0 is the f32 model with its matmul weights stored as tract's Q4_0 blocks.
FORMATS = {"f32": ("float32", "f32"), "f16": ("float16", "f32"), "q4_0": ("float32", "q4_0"),
           "f16_weights": ("float32", "f16")}  # f32 model, weights stored f16 (--weights f16)


def build(shape: dict, dtype: str = "float32"):
    import torch

    from gdn_fx.hf import tiny_model

    return tiny_model("qwen3_5", dtype=getattr(torch, dtype), **shape)


# --- what each subprocess runs ------------------------------------------------------------

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


def bandwidth() -> float:
    """Bytes per second one thread reads (numpy sum over 1 GiB, best of 5)."""
    import numpy as np

    data = np.ones(1 << 28, dtype=np.float32)
    best = min(_seconds(data.sum) for _ in range(5))
    return data.nbytes / best


def tract_matmul_peak(folder: str, fmt: str, rows: int) -> float:
    """FLOP/s of tract on a [1, rows, 1024] x [1024, 4096] product (a model-sized matmul)
    with ``fmt``'s compute dtype and stored weights (best of many calls)."""
    import torch
    import tract

    import gdn_fx
    from gdn_fx import tract_check

    dtype, weights = FORMATS[fmt]
    layer = torch.nn.Linear(1024, 4096, bias=False).to(getattr(torch, dtype))
    x = torch.randn(1, rows, 1024, dtype=layer.weight.dtype)
    path = gdn_fx.export_nnef(torch.export.export(layer, (x,)),
                              Path(folder) / f"mm_{fmt}_{rows}.nnef.tgz", weights=weights)
    state = tract_check.load(path).spawn_state()
    arg = [tract.Tensor.from_numpy(x.numpy())]
    state.run(arg)
    repeat = max(1, 256 // rows)  # calls per timing: a one-row product takes ~1 ms
    best = min(_seconds(lambda: [state.run(arg) for _ in range(repeat)]) for _ in range(5))
    return 2 * rows * 1024 * 4096 * repeat / best


def torch_matmul_peak(rows: int) -> float:
    """FLOP/s of torch eager (f32, one thread) on the product tract_matmul_peak times: how
    far tract's f32 kernels are from torch's on this machine (prefill is mostly matmuls)."""
    import torch

    layer = torch.nn.Linear(1024, 4096, bias=False)
    x = torch.randn(1, rows, 1024)
    repeat = max(1, 256 // rows)
    with torch.no_grad():
        layer(x)
        best = min(_seconds(lambda: [layer(x) for _ in range(repeat)]) for _ in range(5))
    return 2 * rows * 1024 * 4096 * repeat / best


def peaks(formats, folder: Path) -> dict:
    """{fmt: (peak at one row, peak at PREFILL rows)}, each in its own one-thread process."""
    return {fmt: tuple(_child("tract_matmul_peak", str(folder), fmt, rows)["value"]
                       for rows in (1, PREFILL)) for fmt in formats}


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main(argv=None) -> None:
    import torch

    parser = common.parser(__doc__.splitlines()[0])
    parser.add_argument("--formats", nargs="+", choices=list(FORMATS), default=list(FORMATS))
    parser.add_argument("--peer-from", type=Path, default=None,
                        help="reuse the peer's export made into this --workdir by an earlier "
                        "run (bench/peer.py; its 0.8B export takes ~15-30 min)")
    parser.add_argument("--no-peer", action="store_true", help="leave the peer out")
    parser.add_argument("--reuse", action="store_true",
                        help="keep the artifacts an earlier run wrote into --workdir (each "
                        "export leaves its figures beside it in a .json): resumes a run cut "
                        "short, e.g. on a machine that limits one command to 10 minutes")
    parser.add_argument("--pair", action="store_true",
                        help="also export each format as the pair of earlier releases (the "
                        "main graph + its S = 1 decode graph, decode=True) and measure it "
                        "beside the one-graph artifact")
    args = parser.parse_args(argv)
    common.silence_warnings()
    torch.set_num_threads(1)
    shape = QUICK if args.quick else SHAPE
    rounds = common.rounds_for(args, full=2, quick=1)
    folder = Path(args.workdir or tempfile.mkdtemp(prefix="gdn_fx_gen_"))
    folder.mkdir(parents=True, exist_ok=True)
    artifacts, notes = {}, []
    labels = [(fmt, "") for fmt in args.formats]
    labels += [(fmt, "pair") for fmt in args.formats] if args.pair else []
    for fmt, pair in labels:  # each export in its own process: its memory is returned after
        label = f"{fmt} {pair}".strip()
        record = folder / f"model_{fmt}{'_pair' if pair else ''}.json"
        if not (args.reuse and record.exists()):
            record.write_text(json.dumps(_child("export_format", shape, fmt, str(folder),
                                                pair)))
        artifacts[label] = json.loads(record.read_text())
        notes.append(f"{label}: decode graph "
                     f"{'written' if artifacts[label]['decode'] else 'none'}")
    measured = {f"gdn-fx artifact in tract ({fmt})": [] for fmt in artifacts}
    measured["torch eager (f32)"] = []
    peer_art = _peer_export(args, shape, folder, notes)
    if peer_art.get("main"):
        measured[PEER] = []
    for _ in range(rounds):
        for fmt, art in artifacts.items():
            measured[f"gdn-fx artifact in tract ({fmt})"].append(
                _child("run_tract", art["main"], art["decode"], module="tract_run"))
        measured["torch eager (f32)"].append(_child("run_torch", shape))
        if PEER in measured:  # prefill in the chunks the Generator used above, and whole
            chunk = measured[f"gdn-fx artifact in tract ({args.formats[0]})"][-1]["chunk"]
            measured[PEER].append(_child("peer.run_peer", peer_art["main"], str(chunk or "")))
    bw, peak = bandwidth(), peaks(sorted(set(args.formats) | {"f32"}), folder)
    torch_peak = [_child("torch_matmul_peak", rows)["value"] for rows in (1, PREFILL)]
    first = artifacts[args.formats[0]]
    rows = [_row(name, runs, {"f32": peer_art} if name == PEER else artifacts, first, bw,
                 peak) for name, runs in measured.items()]
    chunks = sorted({r["chunk"] for runs in measured.values() for r in runs if "chunk" in r})
    common.emit(common.header(
        "Whole-model generation: gdn-fx artifact in tract vs torch eager",
        f"Qwen3.5-shaped model ({sum(1 for t in shape['layer_types'] if t == LIN)} GDN + "
        f"{sum(1 for t in shape['layer_types'] if t == FULL)} attention layers, hidden "
        f"{shape['hidden_size']}, vocab {shape['vocab_size']}, {first['params'] / 1e6:.0f} M "
        f"params, tied, random weights), one thread; decode = median ms per token after "
        f"{PAST} cached tokens; prefill = {PREFILL} tokens from an empty cache, in the "
        f"Generator's automatic chunks ({', '.join(map(str, chunks))} tokens) and in one "
        f"call; each engine in its own process, {rounds} round(s); floors per row: the row's "
        "larger of weight bytes / memory bandwidth and matmul FLOPs / tract's matmul peak "
        "in the row's format (one row for decode, 512 rows for prefill)"))
    common.emit(common.markdown(
        ["path", "decode ms/token", "/ floor", f"prefill ms (S={PREFILL})", "/ floor",
         "prefill in one call", "export", "NNEF (all its graphs)", "load", "RSS added by load",
         "peak RSS"], rows))
    flops = first["flops_per_token"]
    common.emit(f"\nFloors measured in this run: memory bandwidth {bw / 1e9:.1f} GB/s (one "
                f"thread); tract's matmul peak, 1 / {PREFILL} rows: " + ", ".join(
                    f"{fmt} {one / 1e9:.1f} / {many / 1e9:.1f} GFLOP/s"
                    for fmt, (one, many) in peak.items())
                + f" (torch f32 on the same product: {torch_peak[0] / 1e9:.1f} / "
                f"{torch_peak[1] / 1e9:.1f})"
                + f"; matmul FLOPs {2 * first['params'] / 1e9:.2f} G per decode token, "
                f"{flops * PREFILL / 1e9:.0f} G per prefill. {'; '.join(notes)}.\n")


def _peer_export(args, shape: dict, folder: Path, notes: list) -> dict:
    """The peer's artifact of the same model: exported now, reused, or left out."""
    if args.no_peer:
        notes.append("peer: not run (--no-peer)")
        return {}
    art = (peer.previous_export(args.peer_from) if args.peer_from
           else peer.export_peer(shape, folder))
    if not art.get("main"):
        lines = (art.get("error") or "").strip().splitlines() or ["no output"]
        notes.append("peer: export failed: " + lines[-1])
    else:
        notes.append(f"peer: decoder graph {'of an earlier run, ' if args.peer_from else ''}"
                     f"export {art['export']:.0f} s (its vision graph, "
                     f"{common.human_bytes(art['vision_nnef'])}, not counted)")
    return art


def _row(name: str, runs: list, artifacts: dict, first: dict, bw: float,
         peak: dict) -> list:
    """One table row: medians over rounds, ratios to the row's floors (the larger of its
    weight bytes / bandwidth and its matmul FLOPs / tract's peak in the row's format)."""
    label = next((f for f in artifacts if f"({f})" in name and "tract" in name), None)
    art = artifacts.get(label, {})
    weights = art["weight_bytes"] if art else first["params"] * 4
    fmt = art.get("format", "f32")
    one, many = peak[fmt if fmt in peak else "f32"]
    decode_floor = max(weights / bw, 2 * first["params"] / one)
    prefill_floor = first["flops_per_token"] * PREFILL / many
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    return [name, common.ms(med["decode"]), common.ratio(med["decode"] / decode_floor),
            common.ms(med["prefill"]), common.ratio(med["prefill"] / prefill_floor),
            common.ms(med["prefill_whole"]) if "prefill_whole" in med else "-",
            f"{art['export']:.0f} s" if art else "-",
            common.human_bytes(art["nnef"]) if art else "-",
            f"{med['load']:.1f} s" if art else "-",
            common.human_bytes(int(med["rss_load"])) if "rss_load" in med else "-",
            common.human_bytes(int(med["peak_rss"]))]


def export_format(shape: dict, fmt: str, folder: str, pair: str = "") -> dict:
    """``_export`` in a child process (bench/bench_generate.py runs each export alone);
    ``pair`` non-empty: with the decode graph (decode=True)."""
    return _export(shape, fmt, Path(folder), bool(pair))


def _export(shape: dict, fmt: str, folder: Path, pair: bool = False) -> dict:
    """Build the model in ``fmt`` and write its generation-ready artifact (``pair``: with its
    S = 1 decode graph, the pair of earlier releases); what was written."""
    from gdn_fx.hf.generator import export_generator

    dtype, weights = FORMATS[fmt]
    model = build(shape, dtype)
    params = sum(p.numel() for p in model.parameters())
    embedding = model.get_input_embeddings().weight.numel()
    start = time.perf_counter()
    name = f"model_{fmt}{'_pair' if pair else ''}.nnef.tgz"
    files = export_generator(model, folder / name, weights=weights, decode=pair)
    seconds = time.perf_counter() - start
    size = next(model.parameters()).element_size()
    written = [p for p in (files.main, files.decode) if p is not None]
    # q4_0: the bytes the main graph stores but the f32 embedding table, of which a decode
    # step reads one row (the tied head reads its own Q4_0 copy)
    weight_bytes = (params * size if weights == "f32"
                    else files.main.stat().st_size - embedding * size)
    # Prefill matmuls: every weight but the embedding table once per token (the tied head
    # runs on the last position only); attention's own S^2 terms are small at S = 512.
    return dict(main=str(files.main), decode=str(files.decode or ""), export=seconds, format=fmt,
                nnef=sum(p.stat().st_size for p in written), params=params, dtype_bytes=size,
                weight_bytes=weight_bytes, flops_per_token=2 * (params - embedding))


if __name__ == "__main__":
    main()
