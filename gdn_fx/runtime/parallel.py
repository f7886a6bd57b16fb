"""Several prompts at once on one loaded artifact: N worker threads, each a Generator fork.

    gen = Generator.open("out/q.nnef.tgz")
    results = generate_all(gen, [[1, 2, 3], [7] * 40], max_new_tokens=64, workers=2)
    runs = stream_all(gen, ["Once upon", "The keeper"], workers=2, tokenizer=tok)

Why threads: the one-sequence artifact takes one sequence per call, and tract's wheel runs
each matmul on one thread (docs/FACTS.md); a batched artifact (gdn_fx.hf.batch) serves B
sequences per call, and ``BatchGenerator.generate(workers=N)`` runs N of its States through
:func:`serve` the same way. tract's Python package calls its
C library through ctypes, which releases the GIL for the length of each call, so worker threads
whose States run at once use as many cores; the loaded model is shared (``Generator.fork``: a
State of its own per thread, one copy of the weights in memory). Each prompt is served whole
by one worker, so what it generates is what ``Generator.generate`` gives for it alone.
"""

from __future__ import annotations

import numbers
import threading
from typing import Callable, Sequence

from gdn_fx.errors import GdnFxError, UsageError


def check_workers(workers) -> int:
    """``workers`` as an int >= 1, else UsageError."""
    if isinstance(workers, bool) or not isinstance(workers, numbers.Integral) or workers < 1:
        raise UsageError(f"workers must be an int >= 1, got {workers!r}")
    return int(workers)


def serve(generator, items: Sequence, job: Callable, workers: int = 1,
          label: str = "prompt") -> list:
    """``[job(fork, item) for item in items]``, computed by ``workers`` threads, each with
    its own fork of ``generator``; the results in the order of ``items``. The first error a
    job raises is raised here once every thread has stopped, naming the item's index
    (``label`` says what an item is)."""
    workers = min(check_workers(workers), max(len(items), 1))
    results: list = [None] * len(items)
    errors: list = []
    cursor = iter(range(len(items)))
    lock = threading.Lock()

    def work(fork) -> None:
        while not errors:
            with lock:
                index = next(cursor, None)
            if index is None:
                return
            try:
                results[index] = job(fork, items[index])
            except Exception as error:  # noqa: BLE001 (handed to the caller below)
                errors.append((index, error))

    forks = [generator] + [generator.fork() for _ in range(workers - 1)]
    threads = [threading.Thread(target=work, args=(fork,), daemon=True) for fork in forks]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        index, error = min(errors, key=lambda pair: pair[0])
        if isinstance(error, GdnFxError):  # one line naming the prompt, as every refusal
            raise type(error)(f"{label} {index}: {error}") from None
        raise error
    return results


def generate_all(generator, prompts: Sequence, max_new_tokens: int, workers: int = 1) -> list:
    """Greedy ``GenerationResult`` of each prompt (token ids), as ``generator.generate``
    gives it alone, computed by ``workers`` threads."""
    return serve(generator, list(prompts),
                 lambda fork, prompt: fork.generate(prompt, max_new_tokens), workers)


def stream_all(generator, prompts: Sequence, workers: int = 1, **options) -> list:
    """Each prompt (text or ids) run to its end by ``gdn_fx.runtime.streaming.stream`` with
    ``options`` (tokenizer, max_new_tokens, sampling, eos, stop, ...): the finished streams,
    in order (their ``summary`` holds text, tokens and rates)."""
    from gdn_fx.runtime.streaming import stream

    def finish(fork, prompt):
        run = stream(fork, prompt, **options)
        for _ in run:
            pass
        return run

    return serve(generator, list(prompts), finish, workers)
