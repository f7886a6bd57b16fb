"""MoE: tract's fused ``tract_moe_ffn`` against the plain-op spelling (gather + bmm), in tract.

One Qwen3.5-MoE / Qwen3-Next-shaped sparse MoE block (transformers' ``Qwen3_5MoeSparseMoeBlock``:
hidden 2048, expert width 512, 8 experts per token, a shared expert of width 512; 64 routed
experts instead of 256 / 512 so that the weights fit this shared machine: the work per token
does not depend on the expert count, tokens per expert at prefill do) with transformers' default
experts kernel (``grouped_mm``), exported with torch.export at S = 1, 16, 64 and 512 and written
twice by ``gdn_fx.export_nnef``: ``choose={"transformers_moe": "tract_moe_ffn"}`` (the routed
block as one operator, ``lowering/t2n/moe_ffn.py``) and ``"gathered_bmm"`` (each (token, expert)
row gathers its expert's weights and runs a batched matmul, ``lowering/t2n/moe.py``). Both run
on one thread (``TRACT_NUM_THREADS=1``, ``RAYON_NUM_THREADS=1``), sampled round-robin in one
process; both are checked against eager transformers.

The gather spelling materializes S * k expert weight copies ([S*k, 2048, 1024] for the first
product): past ``--max-gather-gib`` it is not run and the table says what it would take.

    .venv/bin/python bench/bench_moe.py            # S = 1, 16, 64, 512
    .venv/bin/python bench/bench_moe.py --quick    # S = 1, 16 experts, 2 rounds
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

# One thread for tract, set before tract is imported (it reads the environment at start).
os.environ["TRACT_NUM_THREADS"] = "1"
os.environ["RAYON_NUM_THREADS"] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import common  # noqa: E402

HIDDEN, EXPERT_WIDTH, TOP_K, SHARED_WIDTH = 2048, 512, 8, 512
FULL_LENGTHS, QUICK_LENGTHS = (1, 16, 64, 512), (1,)
FULL_EXPERTS, QUICK_EXPERTS = 64, 16
FUSED, PLAIN = "tract_moe_ffn", "gathered_bmm"
GIB = 1 << 30


def moe_block(experts: int, seed: int = 0) -> torch.nn.Module:
    """transformers' Qwen3.5-MoE sparse block with its default experts kernel, random weights
    at a trained model's scale (std 0.02)."""
    import transformers.integrations.moe  # noqa: F401  (registers grouped_mm_fallback)
    from transformers import Qwen3_5MoeTextConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeSparseMoeBlock

    config = Qwen3_5MoeTextConfig(hidden_size=HIDDEN, moe_intermediate_size=EXPERT_WIDTH,
                                  num_experts=experts, num_experts_per_tok=TOP_K,
                                  shared_expert_intermediate_size=SHARED_WIDTH)
    config._experts_implementation = "grouped_mm"  # what a model loaded by transformers uses
    torch.manual_seed(seed)
    block = Qwen3_5MoeSparseMoeBlock(config).eval()
    with torch.no_grad():
        for parameter in block.parameters():
            parameter.normal_(0.0, 0.02)
    return block


def gather_bytes(seq: int) -> int:
    """What the gather spelling materializes for the first product: one [D, 2H] f32 copy of
    the expert weights per (token, expert) row."""
    return seq * TOP_K * HIDDEN * 2 * EXPERT_WIDTH * 4


def written_for(block, seq: int, folder: Path, max_gather: float) -> tuple[list, dict, tuple]:
    """(written files, {name: why missing}, example args) of one length."""
    x = torch.randn(1, seq, HIDDEN, generator=torch.Generator().manual_seed(seq))
    program = torch.export.export(block, (x,))
    names = [FUSED] + ([PLAIN] if gather_bytes(seq) <= max_gather * GIB else [])
    written = [common.write_nnef(program, folder / f"s{seq}_{name}.nnef.tgz", name,
                                 {"transformers_moe": name}, ["x"], ["y"]) for name in names]
    skipped = {} if PLAIN in names else {PLAIN: f"not run: gathers "
                                          f"{gather_bytes(seq) / GIB:.0f} GiB of expert weights "
                                          f"(limit --max-gather-gib {max_gather:g})"}
    return written, skipped, (x,)


def holds_op(item: common.Written) -> bool:
    return item.path is not None and "tract_moe_ffn(" in common.graph_text(item.path)


def measure(block, seq: int, folder: Path, rounds: int, max_gather: float) -> list[list]:
    """Rows of one length: each spelling's load, run time, ratio to the fused one, error."""
    from bench_conv import load_all

    written, missing, args = written_for(block, seq, folder, max_gather)
    with torch.no_grad():
        want = [block(*args)]
    arrays = common.numpy_inputs(args)
    loaded, failures = load_all(written, arrays, want)
    missing.update(failures)
    calls = {name: common.tract_call(got.runnable, arrays) for name, (got, _) in loaded.items()}
    samples = common.interleave(calls, rounds, warmup=1) if calls else None
    rows = []
    for item in written + [common.Written(name, None) for name in missing if
                           name not in {w.name for w in written}]:
        if item.name in missing:
            rows.append([seq, item.name, None, None, None, None, None, missing[item.name]])
            continue
        got, error = loaded[item.name]
        versus = samples.ratio(item.name, FUSED) if FUSED in calls else None
        rows.append([seq, item.name, "yes" if holds_op(item) else "no",
                     common.ms(got.load + got.optimize), common.ms(samples.median(item.name)),
                     common.ratio(versus), common.error_cell(error), ""])
    return rows


def main(argv=None) -> None:
    ap = common.parser(__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=None,
                    help=f"routed experts (default {FULL_EXPERTS}, quick {QUICK_EXPERTS})")
    ap.add_argument("--max-gather-gib", type=float, default=2.0,
                    help="skip the gather spelling where it would copy more expert weights "
                         "(S = 64 copies 4 GiB and the process then peaks near 16 GiB)")
    ap.add_argument("--lengths", type=int, nargs="+", default=None,
                    help=f"sequence lengths (default {' '.join(map(str, FULL_LENGTHS))})")
    args = ap.parse_args(argv)
    common.silence_warnings()
    torch.set_num_threads(1)
    folder = common.workdir(args, "moe")
    rounds = common.rounds_for(args)
    experts = args.experts or (QUICK_EXPERTS if args.quick else FULL_EXPERTS)
    block = moe_block(experts)
    rows = []
    for seq in args.lengths or (QUICK_LENGTHS if args.quick else FULL_LENGTHS):
        rows += measure(block, seq, folder, rounds, args.max_gather_gib)
    common.emit(common.header(
        "MoE: tract_moe_ffn vs the plain-op spelling",
        f"transformers' Qwen3_5MoeSparseMoeBlock (grouped_mm kernel), hidden {HIDDEN}, "
        f"{experts} experts of width {EXPERT_WIDTH}, top-{TOP_K}, shared expert {SHARED_WIDTH}, "
        f"f32, B=1; torch.export then gdn_fx.export_nnef with choose['transformers_moe']; "
        f"tract on one thread (TRACT_NUM_THREADS=1), load + into_runnable once, run time the "
        f"median over {rounds} interleaved rounds, ratio the median of per-round ratios; "
        "error against eager transformers"))
    common.emit(common.markdown(["S", "lowering", "tract_moe_ffn in graph", "load ms",
                                 "run ms", "run / tract_moe_ffn", "rel. err", "note"], rows))
    common.emit("")


if __name__ == "__main__":
    main()
