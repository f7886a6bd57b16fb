"""The prompt chunk an artifact runs fastest: the generator asks the lowering, which knows
the step of the delta-rule scans it wrote ("split", "chunked") and what tract's matmuls cost.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

from gdn_fx.lowering.scan_chunks import SCAN_CHUNK, SCAN_CHUNKS_PER_STEP

# tract 0.23.9 computes a matmul whose row count is symbolic (S) at ~150 GFLOP/s on this
# machine while its packed activations (rows x inner dim x itemsize) fit the L2 cache, and at
# 40-66 GFLOP/s beyond (measured: a 1024-wide product slows from 26 ms at S = 508 to 65 ms at
# S = 511; 3584-wide between S = 140 and 146; 2 MiB of L2): docs/FACTS.md, "tract 0.23.9:
# traps", symbolic-S matmul. A graph whose delta-rule scans are "split" (the one-graph
# export's) never takes chunks below 64 tokens, whatever the L2: it runs the tokens of a call
# past a multiple of 64 as single matmul steps, ~3x the chunk loop's cost per token. Measured
# (issue 31; 4-layer Qwen3.5 shape, one graph, f32, 512-token prompt, this VM's 512 KiB L2,
# where the L2 rule alone gives 32): chunks of 32 2.95-3.17 s, 64 2.31-2.58 s, 128 3.82-4.41 s,
# 256 3.52-4.49 s, 512 3.56-4.11 s.
_L2_FALLBACK = 1 << 20
_WEIGHT = re.compile(r"label = '[^']*\.weight', shape = \[(\d+), (\d+)\]\)")


def auto_prefill_chunk(graph_text: str, l2_bytes: Optional[int] = None) -> int:
    """The longest prompt chunk whose f32 activations, in the widest projection of the
    artifact whose graph.nnef is ``graph_text`` (``tract_check.nnef_text``),
    fit the L2 cache (this machine's, from sysfs): a multiple of the chunked delta-rule scan's
    step (64 tokens: the tokens of a call past a multiple of it run as single steps, "split"),
    or of 16 below one step; 16 to 512. Where the graph holds a "split" scan (the one-graph
    export) never below one step (64), even when the L2 holds fewer rows: below it every call
    runs single steps only (measured: the comment above). f16 models get the same chunk
    (conservative: their activations take half the bytes)."""
    whole = SCAN_CHUNK * SCAN_CHUNKS_PER_STEP
    widths = [int(inner) for _, inner in _WEIGHT.findall(graph_text)]  # torch Linear: [out, in]
    rows = (l2_bytes or _l2_bytes()) // (4 * max(widths or [1]))
    if "fragment gdn_fx_split_" in graph_text:
        rows = max(rows, whole)
    step = whole if rows >= whole else 16
    return int(min(512, max(16, rows // step * step)))


def _l2_bytes() -> int:
    """This CPU's L2 size in bytes (Linux sysfs; 1 MiB where it cannot be read)."""
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            if (index / "level").read_text().strip() == "2":
                size = (index / "size").read_text().strip().upper()
                return int(size.rstrip("KM")) << (20 if size.endswith("M") else 10)
        except (OSError, ValueError):
            continue
    return _L2_FALLBACK
