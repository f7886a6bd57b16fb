"""tract, loaded and run: the one place gdn-fx's runtime meets the engine (tract's Python
package; no torch).

    runnable = load(path)                      # tract.nnef().with_tract_transformers()...
    runnable = load(path, runtime="cuda")      # ... prepared by tract's CUDA runtime
    nnef_text(path)                            # graph.nnef of an export
    read_decisions(path)                       # {node: candidate} recorded by export_nnef
    read_runtime(path)                         # "cpu" or "cuda", as export_nnef was told
    read_cpu_fallbacks(path)                   # nodes that run on the CPU under that runtime
    runtime_unavailable("cuda")                # why tract has no such runtime here, or None
    error_text(error)                          # tract's error on one line, root cause kept
"""

from __future__ import annotations

import io
import re
import tarfile
from pathlib import Path
from typing import Optional, Sequence, Union

from gdn_fx.errors import MissingFile, RuntimeUnavailable
from gdn_fx.contract import MAX_TOKENS, check_runtime
from gdn_fx.memory import release_freed_memory

_DECISIONS = re.compile(r'\(\s*"gdn_fx_lowering"\s*,\s*"([^"]*)"\s*\)')
_RUNTIME = re.compile(r'\(\s*"gdn_fx_runtime"\s*,\s*"([^"]*)"\s*\)')
_FALLBACKS = re.compile(r'\(\s*"gdn_fx_cpu_fallback"\s*,\s*"([^"]*)"\s*\)')
_MAX_TOKENS = re.compile(r'\(\s*"' + MAX_TOKENS + r'"\s*,\s*"(\d+)"\s*\)')


def runtime_unavailable(runtime: str) -> Optional[str]:
    """Why tract has no ``runtime`` ("cpu" or "cuda") on this machine (None: it has).

    tract's CUDA runtime loads the driver, cuBLAS and NVRTC when it is asked for; with no
    GPU (or no driver) the lookup fails, and that failure is the answer."""
    import tract

    if check_runtime(runtime) == "cpu":
        return None
    try:
        tract.runtime_for_name(runtime)
    except tract.TractError as error:
        text = " ".join(str(error).split("Stack backtrace")[0].split())  # tract's own words
        return f"tract has no {runtime} runtime here: {text}"
    return None


ERROR_LIMIT = 1500  # characters of tract's error kept in a one-line message


def error_text(error: BaseException, limit: int = ERROR_LIMIT) -> str:
    """tract's error as one line: its message and its whole chain of causes ("Caused by:
    0: ... 1: ..."), without the stack backtrace, joined by " / ". Past ``limit`` characters
    causes in the middle give way to "...", never the last one, the root cause (e.g. "8: 3
    should be equal to 14"), nor the first line (the operation that failed). Only those two
    are ever cut inside: the first line when it would take more than half of
    the room the root cause leaves, the root cause when it alone is longer than ``limit``."""
    text = str(error).split("Stack backtrace")[0]
    lines = [" ".join(line.split()) for line in text.splitlines()]
    lines = [line for line in lines if line and line != "Caused by:"]
    if not lines:
        return type(error).__name__
    joined = " / ".join(lines)
    if len(joined) <= limit or len(lines) == 1:
        return joined if len(joined) <= limit else _cut(joined, limit)
    head, root = lines[0], _cut(lines[-1], limit)
    room = limit - len(root) - len(" / ... / ")
    if len(head) > room // 2:
        head = _cut(head, max(room // 2, 40))
    room -= len(head)
    kept: list = []
    for line in reversed(lines[1:-1]):  # the causes next to the root first
        if len(line) + 3 > room:
            break
        kept.insert(0, line)
        room -= len(line) + 3
    middle = ["..."] if len(kept) < len(lines) - 2 else []
    return " / ".join([head, *middle, *kept, root])


def _cut(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters (at a space in its last quarter, if any), "..."
    marking the cut."""
    if len(text) <= limit:
        return text
    cut = text[:limit]
    space = cut.rfind(" ")
    return (cut[:space] if space >= limit * 3 // 4 else cut) + " ..."


def load(path: Union[str, Path], runtime: str = "cpu", transforms: Sequence[str] = (),
         names: Optional[list] = None):
    """The NNEF at ``path`` (folder, .tar or .tgz) loaded and optimized by tract for
    ``runtime``: "cpu" (``into_runnable``) or "cuda" (``runtime_for_name("cuda").prepare``),
    after tract's model ``transforms`` (names, e.g. "detect_kv_cache"), if any; ``names``, a
    list, receives the model's input names as the runnable takes them.
    RuntimeUnavailable when tract has no such runtime here."""
    import tract

    model = tract.nnef().with_tract_transformers().load(str(path))
    for transform in transforms:
        model.transform(transform)
    if names is not None:
        names.extend(model.input_name(i) for i in range(model.input_count()))
    if check_runtime(runtime) == "cpu":
        runnable = model.into_runnable()
    else:
        missing = runtime_unavailable(runtime)
        if missing is not None:
            raise RuntimeUnavailable(missing)
        runnable = tract.runtime_for_name(runtime).prepare(model)
    del model
    release_freed_memory()
    return runnable


def nnef_text(path: Union[str, Path]) -> str:
    """The graph.nnef text of an export (folder, .tar or .tgz)."""
    path = Path(path)
    if path.is_dir():
        return (path / "graph.nnef").read_text()
    with tarfile.open(path) as archive:
        for member in archive:  # lazily: stop at graph.nnef (gdn-fx archives put it first)
            if Path(member.name).name == "graph.nnef":
                return io.TextIOWrapper(archive.extractfile(member), encoding="utf8").read()
    raise MissingFile(f"no graph.nnef in {path}")


def read_runtime(path: Union[str, Path]) -> str:
    """The runtime ("cpu" or "cuda") an export was lowered for; "cpu" for exports that
    predate the property (they were all lowered for the CPU)."""
    match = _RUNTIME.search(nnef_text(path))
    return match.group(1) if match else "cpu"


def read_cpu_fallbacks(path: Union[str, Path]) -> list[str]:
    """The fused nodes whose candidate runs on the CPU under the export's runtime (recorded
    by ``gdn_fx.export_nnef``; empty for the CPU runtime and when every node stays)."""
    match = _FALLBACKS.search(nnef_text(path))
    return [name for name in match.group(1).split(";") if name] if match else []


def read_max_tokens(path: Union[str, Path]) -> Optional[int]:
    """The most tokens one call may take, where a candidate computes a fixed window
    (recorded by ``gdn_fx.export_nnef``; None: any number)."""
    match = _MAX_TOKENS.search(nnef_text(path))
    return int(match.group(1)) if match else None


def read_decisions(path: Union[str, Path]) -> dict[str, str]:
    """{fused node name: candidate} as recorded by ``gdn_fx.export_nnef`` in the NNEF."""
    match = _DECISIONS.search(nnef_text(path))
    if match is None or not match.group(1):
        return {}
    return dict(item.split("=", 1) for item in match.group(1).split(";"))
