"""MoE generation artifacts: ``export_generator`` with ``tract_moe_ffn`` vs the plain spelling.

A Qwen3.5-MoE-shaped causal LM (transformers' ``Qwen3_5MoeForCausalLM``, the defaults of
``Qwen3_5MoeTextConfig``, i.e. Qwen3.5-35B-A3B's layer: hidden 2048, 256 routed experts of width
512, top-8, a shared expert of width 512, linear-attention heads 16 / 32 of width 128) with
few layers (default one, full attention: transformers' cache needs an attention layer and
one MoE layer of 256 experts is 3 GiB in f32; ``--layers 2`` adds a linear-attention layer)
and a small vocabulary (4096 instead of 248,320: the lm_head alone would be 2 GiB in f32),
random weights, exported twice by
``export_generator`` (symbolic S and P, ``decode=False``): by default (every routed block ONE
``tract_moe_ffn``, ``lowering/t2n/moe_ffn.py``) and with ``choose={"transformers_moe":
"gathered_bmm"}`` (transformers' ``batched_mm`` spelling: a gather of one expert matrix per
(token, expert) row and a batched matmul).

Each export and each measurement runs in its own child process, so that its peak RSS
(``VmHWM`` of /proc/self/status, torch and tract imported) is its own. A measurement loads
the artifact in tract (``Generator``, one thread), times a prefill of S tokens at P = 0 (one
call, the median over ``--rounds`` runs of one kept State), then greedily generates
``--new-tokens`` tokens after it (decode ms per token, the main graph at S = 1), and finally
checks those tokens and logits against transformers' ``generate`` on the same model (after
the peak RSS is read).

The plain spelling copies S * 8 expert matrices per layer ([S*8, 1024, 2048] for the first
product: 4 GiB at S = 64); past ``--max-gather-gib`` it is not run and the table says so.

    .venv/bin/python bench/bench_moe_generation.py           # fused S = 64, 512; plain S = 8, 64
    .venv/bin/python bench/bench_moe_generation.py --quick   # 16 experts, S = 8, 64, 1 round
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
import sys
import time
from pathlib import Path

# One thread for tract, set before tract is imported (it reads the environment at start).
os.environ["TRACT_NUM_THREADS"] = "1"
os.environ["RAYON_NUM_THREADS"] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import common  # noqa: E402

FUSED, PLAIN = "tract_moe_ffn", "gathered_bmm"
HIDDEN, EXPERT_WIDTH, TOP_K = 2048, 512, 8
FULL_EXPERTS, QUICK_EXPERTS = 256, 16
FUSED_LENGTHS, PLAIN_LENGTHS, QUICK_LENGTHS = (64, 512), (8, 64), (8, 64)
GIB = 1 << 30


def model_overrides(experts: int, layers: int, vocab: int) -> dict:
    """Config fields over the tiny qwen3_5_moe: the real layer shape, few layers."""
    return dict(hidden_size=HIDDEN, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
                linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                linear_value_head_dim=128, num_experts=experts, num_experts_per_tok=TOP_K,
                moe_intermediate_size=EXPERT_WIDTH, shared_expert_intermediate_size=512,
                num_hidden_layers=layers, vocab_size=vocab,
                layer_types=["linear_attention"] * (layers - 1) + ["full_attention"])


def build_model(overrides: dict):
    from gdn_fx.hf import tiny_model

    return tiny_model("qwen3_5_moe", **overrides)


def peak_rss() -> int:
    """This process's peak resident set (VmHWM), in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def prompt(length: int) -> list:
    from gdn_fx.hf.configs import SAFE_TOKEN_RANGE

    low, high = SAFE_TOKEN_RANGE
    return torch.randint(low, high, (length,), generator=torch.Generator().manual_seed(length)
                         ).tolist()


def export_child(overrides: dict, spelling: str, path: str) -> dict:
    """Export one spelling (in a child process): its file, seconds, ops and peak RSS."""
    import re

    from gdn_fx import tract_check
    from gdn_fx.hf.generator import export_generator

    common.silence_warnings()
    torch.set_num_threads(1)
    model = build_model(overrides)
    start = time.perf_counter()
    files = export_generator(model, path, decode=False,
                             choose={"transformers_moe": spelling})
    seconds = time.perf_counter() - start
    text = tract_check.nnef_text(files.main)
    return dict(path=str(files.main), seconds=seconds, fused=text.count("tract_moe_ffn("),
                gathers=len(re.findall(r"tract_core_gather\(\w*experts", text)),
                rss=peak_rss())


def measure_child(overrides: dict, path: str, seq: int, rounds: int, new_tokens: int) -> dict:
    """Prefill of ``seq`` tokens and decode after it, in tract (in a child process)."""
    from gdn_fx.hf.generator import Generator, check_generation

    common.silence_warnings()
    torch.set_num_threads(1)
    start = time.perf_counter()
    generator = Generator(path, None, prefill_chunk=None)
    load = time.perf_counter() - start
    ids = np.array([prompt(seq)], dtype=np.int64)
    times = []
    for _ in range(rounds + 1):  # the first call warms up
        caches = [z.copy() for z in generator.zero_states]
        start = time.perf_counter()
        generator.step(generator.main, ids, caches)
        times.append(time.perf_counter() - start)
    result = generator.generate(prompt(seq), new_tokens + 1)
    rss = peak_rss()
    found = check_generation(build_model(overrides), result)
    return dict(load=load, prefill=common.median_of(times[1:]),
                decode=result.decode_s / new_tokens, rss=rss, ok=found.ok,
                error=found.worst_logits)


def in_child(fn, *args):
    """``fn(*args)`` in a fresh process (spawned: its peak RSS is its own); (result, error)."""
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=context) as pool:
        try:
            return pool.submit(fn, *args).result(), None
        except Exception as exc:  # noqa: BLE001  (the table says why a row is missing)
            return None, f"{type(exc).__name__}: {common.first_line(exc)}"


def gather_bytes(seq: int) -> int:
    """What the plain spelling materializes per layer for its first product: one
    [2H, D] f32 copy of the expert weights per (token, expert) row."""
    return seq * TOP_K * 2 * EXPERT_WIDTH * HIDDEN * 4


def gib(count: int) -> str:
    return f"{count / GIB:.1f}"


def rows_of(overrides: dict, spelling: str, written: dict, lengths, args) -> list[list]:
    rows = []
    for seq in lengths:
        head = [spelling, seq]
        if written.get("error"):
            rows.append(head + [None] * 6 + [f"export failed: {written['error']}"])
            continue
        counts = f"{written['fused']} / {written['gathers']}"
        if spelling == PLAIN and gather_bytes(seq) > args.max_gather_gib * GIB:
            rows.append(head + [counts] + [None] * 5 + [
                f"not run: gathers {gib(gather_bytes(seq))} GiB of expert weights per "
                f"layer (limit --max-gather-gib {args.max_gather_gib:g})"])
            continue
        got, error = in_child(measure_child, overrides, written["path"], seq, args.rounds,
                              args.new_tokens)
        if got is None:
            rows.append(head + [counts] + [None] * 5 + [f"failed: {error}"])
            continue
        check = "tokens equal" if got["ok"] else "DIFFERS"
        rows.append(head + [counts, common.ms(got["load"]), common.ms(got["prefill"]),
                            common.ms(got["decode"]), gib(got["rss"]),
                            f"{got['error']:.1e}", check])
    return rows


def main(argv=None) -> None:
    ap = common.parser(__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=None,
                    help=f"routed experts (default {FULL_EXPERTS}, quick {QUICK_EXPERTS})")
    ap.add_argument("--layers", type=int, default=1,
                    help="decoder layers: linear attention, the last one full attention "
                         "(default 1: transformers' hybrid cache needs one attention layer)")
    ap.add_argument("--vocab", type=int, default=4096, help="vocabulary size (default 4096)")
    ap.add_argument("--new-tokens", type=int, default=16,
                    help="tokens generated after the prefill, timed for decode (default 16)")
    ap.add_argument("--max-gather-gib", type=float, default=2.0,
                    help="skip the plain spelling where its first product would copy more "
                         "expert weights per layer (S = 64 copies 4 GiB)")
    ap.add_argument("--fused-lengths", type=int, nargs="+", default=None)
    ap.add_argument("--plain-lengths", type=int, nargs="+", default=None)
    args = ap.parse_args(argv)
    args.rounds = args.rounds if args.rounds is not None else (1 if args.quick else 3)
    common.silence_warnings()
    torch.set_num_threads(1)
    folder = common.workdir(args, "moe_generation")
    experts = args.experts or (QUICK_EXPERTS if args.quick else FULL_EXPERTS)
    overrides = model_overrides(experts, args.layers, args.vocab)
    plan = [(FUSED, args.fused_lengths or (QUICK_LENGTHS if args.quick else FUSED_LENGTHS)),
            (PLAIN, args.plain_lengths or (QUICK_LENGTHS if args.quick else PLAIN_LENGTHS))]
    rows, exports = [], []
    for spelling, lengths in plan:
        written, error = in_child(export_child, overrides, spelling,
                                  str(folder / f"{spelling}.nnef.tgz"))
        written = written or {"error": error}
        if not error:
            exports.append(f"{spelling} {written['seconds']:.0f} s, peak RSS "
                           f"{gib(written['rss'])} GiB")
        rows += rows_of(overrides, spelling, written, lengths, args)
    common.emit(common.header(
        "MoE generation artifact: tract_moe_ffn vs the plain spelling",
        f"qwen3_5_moe, {args.layers} layer(s), hidden {HIDDEN}, {experts} experts of width "
        f"{EXPERT_WIDTH}, top-{TOP_K}, shared expert 512, vocab {args.vocab}, f32, B = 1; "
        f"export_generator(decode=False) with choose['transformers_moe'] (export: "
        f"{'; '.join(exports) or 'failed'}); tract on one thread, each row in its own "
        f"process: load, prefill at P = 0 (median of {args.rounds} runs of a kept State), "
        f"{args.new_tokens} decode steps after it, peak RSS (VmHWM) of that process, then "
        "tokens and logits against transformers' generate"))
    common.emit(common.markdown(
        ["lowering", "S", "tract_moe_ffn / expert gathers", "load ms", "prefill ms",
         "decode ms/token", "peak RSS GiB", "logits rel. err", "note"], rows))
    common.emit("")


if __name__ == "__main__":
    main()
