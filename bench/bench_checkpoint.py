"""Checkpoint folders at real shapes, exported by streaming (issue 31): what export, load and
generation cost, per artifact format.

Each shape's folder is written by ``save_pretrained`` in bf16 (as real checkpoints are) from a
model built in bf16 from its config with random weights (``gdn_fx.hf.tiny_model``'s seeded
init: no downloads). Then, per format, in fresh one-thread processes: ``gdn-fx export --model
DIR --stream`` (``export_checkpoint``: wall time, peak RSS = VmHWM), the artifact's bytes, and
bench_generate's tract run (load time, memory the load adds, prefill of 512 tokens in the
Generator's chunks and in one call, decode ms/token after those 512, the run's peak RSS). Both
processes run with glibc as users have it (not common.py's timing pin: memory is the point).

    .venv/bin/python bench/bench_checkpoint.py --shapes 0.8b            # ~30-60 min here
    .venv/bin/python bench/bench_checkpoint.py --quick                  # 4 layers, vocab 32k
    .venv/bin/python bench/bench_checkpoint.py --shapes 4b --formats q4_0
    .venv/bin/python bench/bench_checkpoint.py --workdir W --reuse ...  # keep W's folders

Formats: f32 (the model in f32), f16 (the model in f16: ``--dtype f16``), f16w (f32 model,
weights stored f16: ``--weights f16``, f32 arithmetic), q4_0 (f32 model,
matmul weights and embedding tables as tract's Q4_0 blocks; 3-D expert stacks stay f32).
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

LIN, FULL = common.LIN, common.FULL
# The shapes (family, config overrides). 4b: Qwen3.5-4B's text shape as published (hidden
# 2560, 32 layers 3:1 GDN:attention, GDN 16 key / 32 value heads of 128, attention 16 / 4
# heads of 256, FFN 9216, vocab 248,320, tied). moe: one Qwen3.5-MoE (35B-A3B) layer pair
# (hidden 2048, 256 experts of width 512, top-8, shared expert 512, GDN 16 / 32 heads of 128,
# attention 16 / 2 heads of 256) with 2 layers instead of 40, so that it fits this machine.
SHAPES = {
    "quick": ("qwen3_5", common.QUICK),
    "0.8b": ("qwen3_5", common.SHAPE),
    "4b": ("qwen3_5", dict(vocab_size=248320, hidden_size=2560, num_attention_heads=16,
                           num_key_value_heads=4, head_dim=256, linear_num_key_heads=16,
                           linear_num_value_heads=32, linear_key_head_dim=128,
                           linear_value_head_dim=128, intermediate_size=9216,
                           num_hidden_layers=32, layer_types=[LIN, LIN, LIN, FULL] * 8,
                           tie_word_embeddings=True)),
    "moe": ("qwen3_5_moe", dict(vocab_size=248320, hidden_size=2048, num_attention_heads=16,
                                num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
                                linear_num_value_heads=32, linear_key_head_dim=128,
                                linear_value_head_dim=128, num_experts=256,
                                num_experts_per_tok=8, moe_intermediate_size=512,
                                shared_expert_intermediate_size=512, num_hidden_layers=2,
                                layer_types=[LIN, FULL], tie_word_embeddings=False)),
    # Falcon-H1-0.5B's shape (tiiuae/Falcon-H1-0.5B config as published, recalled: not
    # downloadable here): 36 layers, each attention (8 / 2 heads of 64) and Mamba2 (24 heads
    # of 64, state 128, one group, chunk 128) in parallel, FFN 2048, vocab 32,784; 0.52 B.
    "falcon_h1_0.5b": ("falcon_h1", dict(
        initializer_range=0.02, vocab_size=32784, hidden_size=1024, intermediate_size=2048,
        num_hidden_layers=36, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
        mamba_d_ssm=1536, mamba_n_heads=24, mamba_d_head=64, mamba_d_state=128,
        mamba_n_groups=1, mamba_chunk_size=128, tie_word_embeddings=False)),
    # A Granite-4.0-H-1B-like shape (recalled, not verified): 40 layers, attention (12 / 4
    # heads of 128) in every tenth, Mamba2 (48 heads of 64, state 128, one group) in the
    # others, a dense shared FFN of 4096, vocab 100,352, tied; 1.49 B.
    "granite_h_1b": ("granitemoehybrid", dict(
        initializer_range=0.02, vocab_size=100352, hidden_size=1536, num_hidden_layers=40,
        num_attention_heads=12, num_key_value_heads=4,
        layer_types=["attention" if i % 10 == 9 else "mamba" for i in range(40)],
        mamba_n_heads=48, mamba_d_head=64, mamba_d_state=128, mamba_n_groups=1,
        mamba_chunk_size=256, shared_intermediate_size=4096, num_local_experts=0,
        num_experts_per_tok=0, tie_word_embeddings=True)),
}
# format -> (export_checkpoint's dtype=, weights=)
FORMATS = {"f32": ("f32", "f32"), "f16": ("f16", "f32"), "f16w": ("f32", "f16"),
           "q4_0": ("f32", "q4_0")}


# --- what each subprocess runs ------------------------------------------------------------

def write_checkpoint(shape: str, folder: str) -> dict:
    """The bf16 checkpoint folder of ``shape`` (built in bf16: never a f32 copy)."""
    import torch

    from gdn_fx.hf import tiny_model

    family, overrides = SHAPES[shape]
    torch.set_default_dtype(torch.bfloat16)
    model = tiny_model(family, dtype=torch.bfloat16, **overrides)
    model.save_pretrained(folder)
    return dict(params=sum(p.numel() for p in model.parameters()))


def export(folder: str, out: str, fmt: str) -> dict:
    """The streamed export of ``folder`` to ``out`` in ``fmt``: seconds and bytes written."""
    from gdn_fx.hf.checkpoint import export_checkpoint

    dtype, weights = FORMATS[fmt]
    start = time.perf_counter()
    files = export_checkpoint(folder, out, weights=weights, dtype=dtype)
    return dict(seconds=time.perf_counter() - start, bytes=Path(files.main).stat().st_size)


# --- the parent ---------------------------------------------------------------------------

def _child(kind: str, *args: str, pinned: bool = True) -> dict:
    """``kind`` in a fresh one-thread process (tract_run.run_tract, else this
    module's function); its figures and peak RSS (VmHWM)."""
    module = "tract_run" if kind == "run_tract" else "bench_checkpoint"
    return common.child(kind, *args, module=module, pinned=pinned)


def _folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))


def measure(shape: str, formats, workdir: Path, reuse: bool) -> list:
    folder = workdir / f"{shape}-ckpt"
    if not (reuse and (folder / "config.json").exists()):
        made = _child("write_checkpoint", shape, str(folder))
        print(f"[{shape}] checkpoint: {made['params'] / 1e9:.2f} B parameters, "
              f"{_folder_bytes(folder) / 2**30:.2f} GiB bf16 (built at "
              f"{made['peak_rss'] / 2**30:.1f} GiB peak)", file=sys.stderr)
    ckpt = _folder_bytes(folder)
    rows = []
    for fmt in formats:
        out = workdir / f"{shape}-{fmt}.nnef.tgz"
        if reuse and out.exists():
            exported = dict(seconds=float("nan"), bytes=out.stat().st_size, peak_rss=float("nan"))
        else:
            exported = _child("export", str(folder), str(out), fmt, pinned=False)
        print(f"[{shape} {fmt}] export {exported}", file=sys.stderr)
        ran = _child("run_tract", str(out), "", pinned=False)  # memory as users meet it
        print(f"[{shape} {fmt}] tract {ran}", file=sys.stderr)
        rows.append((shape, fmt, ckpt, exported, ran))
    return rows


def table(rows) -> str:
    gib = 2 ** 30
    lines = ["| shape | format | checkpoint GiB | export s | export peak RSS GiB | peak / "
             "checkpoint | artifact GiB | load s | RSS the load adds GiB | load RSS / artifact "
             "| prefill 512 ms (chunks / one call) | decode ms/token at P = 512 | run peak RSS "
             "GiB | run peak / artifact |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for shape, fmt, ckpt, e, r in rows:
        lines.append(
            f"| {shape} | {fmt} | {ckpt / gib:.2f} | {e['seconds']:.0f} | "
            f"{e['peak_rss'] / gib:.2f} | {e['peak_rss'] / ckpt:.2f}x | {e['bytes'] / gib:.2f} | "
            f"{r['load']:.1f} | {r['rss_load'] / gib:.2f} | {r['rss_load'] / e['bytes']:.2f}x | "
            f"{r['prefill'] * 1e3:,.0f} / {r['prefill_whole'] * 1e3:,.0f} | "
            f"{r['decode'] * 1e3:.1f} | {r['peak_rss'] / gib:.2f} | "
            f"{r['peak_rss'] / e['bytes']:.2f}x |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = common.parser(__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=["0.8b"])
    parser.add_argument("--formats", nargs="+", choices=list(FORMATS), default=list(FORMATS))
    parser.add_argument("--reuse", action="store_true",
                        help="keep the checkpoint folders and artifacts WORKDIR holds")
    args = parser.parse_args(argv)
    shapes = ["quick"] if args.quick else args.shapes
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="gdn_fx_ckpt_"))
    workdir.mkdir(parents=True, exist_ok=True)
    rows = []
    for shape in shapes:
        rows += measure(shape, args.formats, workdir, args.reuse)
    print(f"Command: `.venv/bin/python bench/bench_checkpoint.py {' '.join(argv or sys.argv[1:])}`")
    print(table(rows))


if __name__ == "__main__":
    main()
