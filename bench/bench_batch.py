"""Batched decode: aggregate decode tokens/s of one call serving B sequences, B = 1 ... 16.

Decode reads every weight once per call; a call that decodes B sequences reads them once for
all B, so aggregate tokens/s should grow with B until the matmuls stop being bound by the
weights. gdn-fx's batched artifact (``export_generator(model, path, batch=B)``, one static B
per export; ``gdn_fx.hf.batch``) decodes B rows of different past lengths (row b sees the last
``past - 8 b`` of the ``past`` cached columns, ``past_mask``) in one tract call, one thread.
Beside it, torch eager (``torch.set_num_threads(1)``) on the same model decodes a batch of B
after a batched prefill of ``past`` tokens (equal pasts: no mask), and the one-sequence
artifact (``export_generator`` default, ``Generator``) as the B = 1 reference. Each figure is
the median of ``--steps`` decode calls after warm-up, medians over ``--rounds`` rounds that
alternate the engines; tokens/s = B / step time.

    .venv/bin/python bench/bench_batch.py                  # quick shape: 4 layers, vocab 32k
    .venv/bin/python bench/bench_batch.py --shape 0.8b     # Qwen3.5-0.8B shape (24 layers)
    .venv/bin/python bench/bench_batch.py --batches 1,8 --past 512
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
from bench_generate import build  # noqa: E402
from common import QUICK, SHAPE  # noqa: E402

SHAPES = {"quick": QUICK, "0.8b": SHAPE}


def _arguments(argv):
    parser = common.parser(__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=list(SHAPES), default="quick")
    parser.add_argument("--batches", default="1,2,4,8,16", help="batch sizes, e.g. 1,4,16")
    parser.add_argument("--past", type=int, default=128, help="cached columns at decode")
    parser.add_argument("--steps", type=int, default=8, help="decode calls per sample")
    parser.add_argument("--no-plain", action="store_true",
                        help="leave out the one-sequence artifact (Generator) reference")
    return parser.parse_args(argv)


def tract_batched(path: Path, batch: int, past: int):
    """A sampler: the median seconds of one decode call of the batched artifact at ``past``
    columns, rows seeing different numbers of them."""
    import numpy as np

    from gdn_fx.runtime.batch import MASKED, BatchGenerator

    gen = BatchGenerator(path)
    rng = np.random.default_rng(0)
    caches = []
    for zero, axis in zip(gen.zero_states, gen.past_axes):
        shape = list(zero.shape)
        if axis is not None:
            shape[axis] = past
        caches.append((rng.standard_normal(shape) * 0.1).astype(zero.dtype))
    own = [max(past - 8 * b, 1) for b in range(batch)]
    mask = np.full((batch, past), MASKED, dtype=np.float32)
    for row, count in enumerate(own):
        mask[row, past - count:] = 0.0
    ids = np.full((batch, 1), 5, dtype=np.int64)
    positions = np.array([[count] for count in own], dtype=np.int64)

    def sample(steps: int) -> float:
        times = []
        for _ in range(steps):  # the same call each time: P stays at ``past``
            start = time.perf_counter()
            logits, _ = gen.step(ids, positions, mask, caches)
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    return sample


def tract_plain(path: Path, past: int):
    """A sampler over the one-sequence artifact (Generator.step) at ``past`` columns."""
    import numpy as np

    from gdn_fx.hf.generator import Generator

    gen = Generator(path)
    rng = np.random.default_rng(0)
    caches = []
    for zero, (_, dims, _) in zip(gen.zero_states, gen.main_graph.inputs[1:]):
        shape = [past if d == "P" else d for d in dims]
        caches.append((rng.standard_normal(shape) * 0.1).astype(zero.dtype))
    ids = np.full((1, 1), 5, dtype=np.int64)

    def sample(steps: int) -> float:
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            gen.step(gen.decode, ids, caches)
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    return sample


def torch_eager(model, batch: int, past: int):
    """A sampler: torch eager decoding a batch of ``batch`` after a batched prefill of
    ``past`` tokens (the cache copied back before each call, so P stays at ``past``)."""
    import copy

    import torch
    from transformers import DynamicCache

    ids = (torch.arange(past) % 1000 + 3)[None].expand(batch, -1)
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
    token = torch.full((batch, 1), 5, dtype=torch.long)

    def sample(steps: int) -> float:
        times = []
        with torch.no_grad():
            for _ in range(steps):
                fresh = copy.deepcopy(cache)  # outside the timed call
                start = time.perf_counter()
                model(input_ids=token, cache=fresh, use_cache=True, logits_to_keep=1)
                times.append(time.perf_counter() - start)
        return statistics.median(times)

    return sample


def main(argv=None) -> None:
    import torch

    from gdn_fx.hf.generator import export_generator

    args = _arguments(argv)
    common.silence_warnings()
    torch.set_num_threads(1)
    shape = SHAPES[args.shape]
    batches = [int(b) for b in args.batches.split(",")]
    rounds = args.rounds or 3
    folder = common.workdir(args, "bench_batch")
    model = build(shape)
    samplers = {}
    started = time.perf_counter()
    for batch in batches:
        path = folder / f"b{batch}.nnef.tgz"
        if not path.exists():
            export_generator(build(shape), path, batch=batch)
        samplers[("tract", batch)] = tract_batched(path, batch, args.past)
        samplers[("torch", batch)] = torch_eager(model, batch, args.past)
    if not args.no_plain:
        plain = folder / "plain.nnef.tgz"
        if not plain.exists():
            export_generator(build(shape), plain)
        samplers[("plain", 1)] = tract_plain(plain, args.past)
    exported = time.perf_counter() - started
    found = {key: [] for key in samplers}
    keys = list(samplers)
    for index in range(rounds):
        order = keys[index % len(keys):] + keys[:index % len(keys)]  # rotate the first
        for key in order:
            samplers[key](2)  # warm-up
            found[key].append(samplers[key](args.steps))
    step = {key: statistics.median(values) for key, values in found.items()}
    base = {"tract": step[("tract", batches[0])] / batches[0],
            "torch": step[("torch", batches[0])] / batches[0]}
    rows = []
    for batch in batches:
        tract, eager = step[("tract", batch)], step[("torch", batch)]
        rows.append([batch, common.ms(tract), f"{batch / tract:.1f}",
                     f"{base['tract'] / (tract / batch):.2f}x", common.ms(eager),
                     f"{batch / eager:.1f}", f"{base['torch'] / (eager / batch):.2f}x",
                     f"{eager / tract:.2f}x"])
    if ("plain", 1) in step:
        plain = step[("plain", 1)]
        rows.append(["1 (Generator, one-sequence artifact)", common.ms(plain),
                     f"{1 / plain:.1f}", "-", "-", "-", "-", "-"])
    layers = shape["num_hidden_layers"]
    common.emit(common.header(
        "Batched decode: aggregate tokens/s against B (one thread)",
        f"{args.shape} shape ({layers} layers, vocab {shape['vocab_size']}), f32, random "
        f"weights; decode at past {args.past} (tract rows: past - 8 b own columns); median "
        f"of {args.steps} calls, {rounds} rounds; exports {exported:.0f} s"))
    common.emit(common.markdown(
        ["B", "tract step", "tract tokens/s", "tract vs B = 1", "torch step",
         "torch tokens/s", "torch vs B = 1", "tract speed-up over torch"], rows))


if __name__ == "__main__":
    main()
