"""torch-to-nnef's ``cumsum`` made right for a reused tract State.

torch-to-nnef 0.24.12 writes ``aten.cumsum`` as its ``tract_cumsum`` fragment: a
``tract_core_scan`` with ``reset_every_turn = false``. tract keeps such a scan's accumulator
between runs of one State and then ignores the initial value (docs/FACTS.md, "tract 0.23.9:
traps"), so from the second run on every cumulative sum starts from the last run's total:
``cumsum(x, 1)`` on a kept State gave 0, then 3.4, then 6.9 of absolute error. A cumulative
sum restarts at every call, so the fragment is rewritten in the written graph to reset its
scan every run (what gdn-fx's own scans set).
"""

from __future__ import annotations

import tarfile
from pathlib import Path

from gdn_fx.errors import InternalError

FRAGMENT = "fragment tract_cumsum("
KEPT, RESET = "reset_every_turn = false", "reset_every_turn = true"
GRAPH_FILE = "graph.nnef"


def reset_cumsum_scans(text: str) -> str:
    """``text`` (a graph.nnef) with torch-to-nnef's cumsum fragment resetting its scan."""
    start = text.find(FRAGMENT)
    if start < 0:
        return text
    end = text.index("\n}", start)
    body = text[start:end]
    if RESET in body:
        return text
    if body.count(KEPT) != 1:  # another fragment than the one read: do not guess
        raise InternalError(f"torch-to-nnef's tract_cumsum fragment no longer holds one "
                            f"'{KEPT}': {body!r}")
    return text[:start] + body.replace(KEPT, RESET) + text[end:]


def graph_text(path: Path) -> str:
    """The graph.nnef of a written export (folder or tar)."""
    if path.is_dir():
        return (path / GRAPH_FILE).read_text()
    with tarfile.open(path) as archive:
        for member in archive.getmembers():
            if Path(member.name).name == GRAPH_FILE:
                return archive.extractfile(member).read().decode("utf8")
    return ""


def needs_reset(path: Path) -> bool:
    text = graph_text(path)
    return reset_cumsum_scans(text) != text
