"""``torch.export`` as gdn-fx calls it for its own traces: without per-node stack traces.

For every node it creates, torch.export extracts and symbolizes the Python stack that made
it (``node.meta["stack_trace"]``, for error messages and debuggers). gdn-fx's own traces (the
reified decode step, its S = 1 re-trace, generalize's re-export, the batched step) never read
them, and they cost: 25 % of a whole tiny-model export, more than half of a small module's
(torch 2.13, measured with bench/bench_export.py). A program the user exported keeps its own.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.fx


@contextlib.contextmanager
def no_stack_traces() -> Iterator[None]:
    """torch.fx's ``do_not_emit_stack_traces`` switched on for the block, then restored."""
    before = torch.fx.config.do_not_emit_stack_traces
    torch.fx.config.do_not_emit_stack_traces = True
    try:
        yield
    finally:
        torch.fx.config.do_not_emit_stack_traces = before


def export(module, args, **kwargs) -> torch.export.ExportedProgram:
    """``torch.export.export(module, args, **kwargs)`` without per-node stack traces."""
    with no_stack_traces():
        return torch.export.export(module, args, **kwargs)
