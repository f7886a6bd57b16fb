"""Several sequences at once: aggregate tokens/s of N worker threads on one loaded artifact.

gdn-fx's artifact takes one sequence per call and tract's wheel runs each matmul on one thread,
so the way to use more cores is several States at once: ``gdn_fx.runtime.parallel.generate_all`` with
``workers`` threads, each a ``Generator.fork`` (its own tract States, the loaded model shared).
Beside it, torch eager on the same model and prompts, one sequence at a time, with as many
intra-op threads (``torch.set_num_threads``). Every configuration generates the same prompts
(``--prompts`` of ``--prompt-len`` tokens, ``--new-tokens`` each, greedy); rounds alternate the
configurations and figures are medians over rounds. The aggregate rate counts new tokens over
the wall time of the whole batch of prompts (their prefills included).

    .venv/bin/python bench/bench_parallel.py --quick           # 4 layers, vocab 32k (~3 min)
    .venv/bin/python bench/bench_parallel.py --threads 1,2,4,8,16   # on a machine with cores
    .venv/bin/python bench/bench_parallel.py --quick --batch 4     # + B = 4 slots per thread
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
from bench_generate import build  # noqa: E402
from common import QUICK, SHAPE  # noqa: E402


def _arguments(argv):
    parser = common.parser(__doc__.splitlines()[0])
    parser.add_argument("--threads", default="1,2", help="thread counts, e.g. 1,2,4")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--batch", type=int, default=0, metavar="B",
                        help="also the batched artifact (export_generator(..., batch=B)): "
                        "each worker thread a BatchGenerator fork serving B slots")
    return parser.parse_args(argv)


def _prompts(count: int, length: int) -> list:
    return [[3 + (7 * i + 11 * j) % 1000 for j in range(length)] for i in range(count)]


def _tract(generator, prompts, new_tokens: int, workers: int) -> float:
    from gdn_fx.runtime.parallel import generate_all

    start = time.perf_counter()
    results = generate_all(generator, prompts, new_tokens, workers=workers)
    elapsed = time.perf_counter() - start
    return sum(len(r.tokens) for r in results) / elapsed


def _batched(generator, prompts, new_tokens: int, workers: int) -> float:
    start = time.perf_counter()
    results = generator.generate(prompts, new_tokens, workers=workers)
    elapsed = time.perf_counter() - start
    return sum(len(r.tokens) for r in results) / elapsed


def _torch(model, prompts, new_tokens: int, threads: int) -> float:
    import torch

    torch.set_num_threads(threads)
    start = time.perf_counter()
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                           max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                           pad_token_id=0)
    return len(prompts) * new_tokens / (time.perf_counter() - start)


def main(argv=None) -> None:
    from gdn_fx.hf.generator import Generator, export_generator

    common.silence_warnings()
    args = _arguments(argv)
    threads = [int(t) for t in args.threads.split(",")]
    shape = QUICK if args.quick else SHAPE
    model = build(shape).eval()
    prompts = _prompts(args.prompts, args.prompt_len)
    with tempfile.TemporaryDirectory() as folder:
        files = export_generator(model, Path(folder) / "m.nnef.tgz")
        generator = Generator(files.main, files.decode)
        generator.generate(prompts[0], 2)  # warm-up
        calls = {}
        if args.batch:
            from gdn_fx.runtime.batch import BatchGenerator

            batched = BatchGenerator(export_generator(
                model, Path(folder) / "b.nnef.tgz", batch=args.batch).main)
            batched.generate(prompts[:1], 2)  # warm-up
        for count in threads:
            calls[("tract", count)] = lambda c=count: _tract(generator, prompts,
                                                             args.new_tokens, c)
            if args.batch:
                calls[("batched", count)] = lambda c=count: _batched(batched, prompts,
                                                                     args.new_tokens, c)
            calls[("torch", count)] = lambda c=count: _torch(model, prompts,
                                                             args.new_tokens, c)
        rates = {key: [] for key in calls}
        for _ in range(common.rounds_for(args, full=3, quick=2)):
            for key, call in calls.items():
                rates[key].append(call())
                print(f"[{key[0]}, {key[1]} threads] {rates[key][-1]:.1f} tokens/s",
                      file=sys.stderr, flush=True)
    base = statistics.median(rates[("tract", threads[0])])
    rows = []
    for (engine, count), values in rates.items():
        rate = statistics.median(values)
        label = {"tract": "gdn-fx artifact in tract, worker threads",
                 "batched": f"gdn-fx batched artifact (B = {args.batch}) in tract, worker "
                            "threads",
                 "torch": "torch eager, intra-op threads, one sequence at a time"}[engine]
        rows.append([label, count, f"{rate:.1f}",
                     common.ratio(rate / base) if engine != "torch" else ""])
    common.emit(common.header(
        "Several sequences at once: aggregate tokens/s",
        f"{'quick shape (4 layers, vocab 32k)' if args.quick else 'Qwen3.5-0.8B shape'}, f32, "
        f"{args.prompts} prompts of {args.prompt_len} tokens, {args.new_tokens} new tokens "
        f"each, {os.cpu_count()} CPUs"))
    common.emit(common.markdown(["engine", "threads", "tokens/s", "vs 1 tract thread"], rows))


if __name__ == "__main__":
    main()
