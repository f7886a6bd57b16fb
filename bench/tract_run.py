"""gdn-fx's side of a benchmark as a deployment runs it: gdn_fx.runtime, tract and numpy, no
torch (``common.child(..., torch=False)`` imports nothing else), so the process's memory is
what a user's process holds: Python, numpy, tract and the artifact."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

PREFILL = 512  # prompt tokens; the decode steps below continue after them (P = PREFILL)
DECODE_STEPS = 8


def run_tract(main: str, decode: str) -> dict:
    """Load the artifact, prefill PREFILL tokens (in the Generator's automatic chunks, and in
    one call), decode DECODE_STEPS after them; load seconds and the RSS the load adds."""
    import numpy as np

    from gdn_fx.runtime.generator import Generator

    base, start = vm_rss(), time.perf_counter()  # base: Python, numpy and tract imported
    gen = Generator(main, decode or None)
    load = time.perf_counter() - start
    rss_load = vm_rss() - base
    ids = np.arange(3, 3 + PREFILL, dtype=np.int64)[None] % 1000 + 3
    chunk = gen.prefill_chunk
    timed = {}
    for name, size in (("prefill_whole", None), ("prefill", chunk)):
        gen.prefill_chunk = size
        runs = []
        for _ in range(2):
            start = time.perf_counter()
            logits, caches = gen.prefill(ids, [z.copy() for z in gen.zero_states])
            runs.append(time.perf_counter() - start)
        timed[name] = min(runs)
    steps = []
    for _ in range(DECODE_STEPS):  # continuing from the PREFILL-token prefill above
        token = np.array([[int(logits[0].argmax())]], dtype=np.int64)
        start = time.perf_counter()
        logits, caches = gen.step(gen.decode, token, caches)
        steps.append(time.perf_counter() - start)
    return dict(load=load, rss_load=rss_load, decode=statistics.median(steps[1:]),
                chunk=chunk, **timed)


def tract_tokens(main: str, ids: str, new: int) -> dict:
    """Greedy tokens in tract (Generator.generate: argmax, no EOS stop) after ``ids`` (JSON)."""
    import json

    from gdn_fx.runtime.generator import Generator

    return dict(tokens=Generator(main).generate(json.loads(ids), int(new)).tokens)


def peak_rss() -> int:
    """This process's peak resident memory in bytes (VmHWM: unlike getrusage's ru_maxrss,
    which Linux carries across execve, it starts afresh with the process's own image)."""
    return _status("VmHWM:")


def vm_rss() -> int:
    """This process's resident memory now, in bytes (VmRSS)."""
    return _status("VmRSS:")


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key):
            return int(line.split()[1]) * 1024
    return 0
