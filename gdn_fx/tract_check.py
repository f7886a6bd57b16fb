"""Load and run an NNEF export in the real tract engine (Python package) and compare with torch.

    runnable = load(path)                      # tract.nnef().with_tract_transformers()...
    runnable = load(path, runtime="cuda")      # ... prepared by tract's CUDA runtime
    outputs = run(path_or_runnable, inputs)    # numpy arrays, one per NNEF output
    report = compare(path, torch_outputs, inputs)   # max relative error per output
    read_decisions(path)                       # {node: candidate} recorded by export_nnef
    read_runtime(path)                         # "cpu" or "cuda", as export_nnef was told
    read_cpu_fallbacks(path)                   # nodes that run on the CPU under that runtime
    runtime_unavailable("cuda")                # why tract has no such runtime here, or None

The relative error of an output is ``max|tract - torch| / max|torch|``; the default tolerance
is 1e-4 when the torch output is f32 (or f64) and 1e-3 when it is f16.
"""

from __future__ import annotations

import io
import re
import struct
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence, Union

import numpy as np
import torch

from gdn_fx.errors import DTypeError, MissingFile, RuntimeUnavailable, ShapeError
from gdn_fx.lowering.target import MAX_TOKENS, check_runtime

TOLERANCE = {torch.float16: 1e-3, torch.float32: 1e-4, torch.float64: 1e-4}
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


def release_freed_memory() -> None:
    """Hand the memory that loading freed back to the kernel (glibc's ``malloc_trim``).

    tract reads each weight through buffers it frees once the tensor is built, and
    ``into_runnable`` replaces weights by packed copies; glibc keeps those freed blocks in the
    heap (its mmap threshold grows with the first large frees), so the process stays ~1.3-1.5x
    the artifact's bytes after a load, trimmed ~1.04x (bench/bench_load.py, docs/FACTS.md).
    Nothing where the C library has no ``malloc_trim`` (not glibc)."""
    import ctypes
    import ctypes.util

    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _numpy(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        if x.dtype == torch.bfloat16:
            raise DTypeError("tract has no bfloat16 input")
        return x.detach().cpu().contiguous().numpy()
    return np.ascontiguousarray(x)


def run(model, inputs: Sequence, runtime: str = "cpu") -> list[np.ndarray]:
    """Run a path (loaded for ``runtime``), a tract runnable, or a tract State on torch
    tensors or numpy arrays."""
    if isinstance(model, (str, Path)):
        model = load(model, runtime)
    return [t.to_numpy() for t in model.run([_numpy(x) for x in inputs])]


def relative_error(got: np.ndarray, want: torch.Tensor) -> float:
    """``max|got - want| / max|want|`` in float64 (absolute error when want is all zeros)."""
    want64 = want.detach().double().cpu().numpy()
    if tuple(got.shape) != tuple(want64.shape):
        raise ShapeError(f"tract output shape {tuple(got.shape)} != torch {tuple(want64.shape)}")
    scale = float(np.abs(want64).max()) if want64.size else 0.0
    diff = float(np.abs(got.astype(np.float64) - want64).max()) if want64.size else 0.0
    return diff / scale if scale > 0 else diff


@dataclass(frozen=True)
class Comparison:
    """Per-output relative errors of tract against torch, and whether all are within tolerance."""

    errors: tuple[float, ...]
    tolerances: tuple[float, ...]
    dtypes: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return all(e <= t for e, t in zip(self.errors, self.tolerances))

    def __str__(self) -> str:
        return ", ".join(self._lines(only_failing=False))

    def failures(self) -> list[str]:
        """One line per output over its tolerance (``str`` lists every output)."""
        return self._lines(only_failing=True)

    def _lines(self, only_failing: bool) -> list[str]:
        return [f"out{i} {d} rel.err {e:.2e} (tol {t:g})" for i, (e, t, d) in
                enumerate(zip(self.errors, self.tolerances, self.dtypes))
                if e > t or not only_failing]


KEPT_STATE_RUNS = 2


def kept_state_runs(model, inputs: Sequence, runtime: str = "cpu",
                    times: int = KEPT_STATE_RUNS) -> list[list[np.ndarray]]:
    """``inputs`` run ``times`` times on ONE tract State of ``model`` (a path, a runnable or a
    State), as an application runs a model.

    A graph that keeps something between runs of a State (a ``tract_core_scan`` that does
    not reset: torch-to-nnef's cumsum, the peer's recurrent scans) answers differently from
    the second run on; a fresh State per run would never show it (docs/FACTS.md, "tract
    0.23.9: traps")."""
    if isinstance(model, (str, Path)):
        model = load(model, runtime)
    state = model.spawn_state() if hasattr(model, "spawn_state") else model
    arrays = [_numpy(x) for x in inputs]
    return [[t.to_numpy() for t in state.run(arrays)] for _ in range(times)]


def compare(model, want: Sequence[torch.Tensor], inputs: Sequence,
            tolerance: Union[None, float, Sequence[float]] = None,
            runtime: str = "cpu") -> Comparison:
    """Run ``model`` in tract (a path is loaded for ``runtime``) on ``inputs``, twice on one
    kept State (:func:`kept_state_runs`), and compare each output of each run with ``want``
    (torch); an output's error is the worse of the two runs. ``tolerance`` is one bound for
    every output, one per output, or None for the dtype's own (``TOLERANCE``)."""
    runs = kept_state_runs(model, inputs, runtime)
    for got in runs:
        if len(got) != len(want):
            raise ShapeError(f"tract returned {len(got)} outputs, torch {len(want)}")
        for g, w in zip(got, want):
            if g.dtype != torch.empty(0, dtype=w.dtype).numpy().dtype:
                raise DTypeError(f"tract output dtype {g.dtype} != torch {w.dtype}")
    return Comparison(
        errors=tuple(max(relative_error(got[i], w) for got in runs)
                     for i, w in enumerate(want)),
        tolerances=tuple(_bounds(tolerance, want)),
        dtypes=tuple(str(w.dtype).replace("torch.", "") for w in want))


def _bounds(tolerance, want: Sequence[torch.Tensor]) -> list[float]:
    if isinstance(tolerance, Sequence):
        if len(tolerance) != len(want):
            raise ShapeError(f"{len(tolerance)} tolerances for {len(want)} outputs")
        return list(tolerance)
    return [tolerance or TOLERANCE.get(w.dtype, 1e-4) for w in want]


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


# --- the weights an export stores -----------------------------------------------------------

_HEADER = 128  # NNEF tensor files: a 128-byte header, then the data
_Q4_BLOCK, _Q4_BYTES = 32, 18  # tract Q4_0: 32 weights in 18 bytes (f16 scale, 16 code bytes)


def _dat_files(path: Path):
    """(name, bytes) of every .dat file of an export (folder, .tar or .tgz)."""
    if path.is_dir():
        for file in sorted(path.rglob("*.dat")):
            yield file.relative_to(path).as_posix(), file.read_bytes()
        return
    with tarfile.open(path, "r|*") as archive:  # one pass, in archive order
        for member in archive:
            if member.isfile() and member.name.endswith(".dat"):
                yield member.name, archive.extractfile(member).read()


def decode_q4_0(data: bytes, shape: Sequence[int]) -> np.ndarray:
    """tract's Q4_0 blocks (as NNEF data, post 0.21.11 layout) as f32 values of ``shape``:
    per block of 32 weights, an f16 scale and 16 bytes whose low nibbles are weights 0..15
    and high nibbles weights 16..31; a weight is ``(nibble - 8) * scale``."""
    blocks = np.frombuffer(data, dtype=np.uint8).reshape(-1, _Q4_BYTES)
    scale = blocks[:, :2].copy().view(np.float16).astype(np.float32)  # [n, 1]
    codes = blocks[:, 2:]
    values = np.concatenate([codes & 0x0F, codes >> 4], axis=1).astype(np.float32)
    values -= 8.0  # in place: one f32 array of the table at a time (a 2.5 GB head at 4B)
    values *= scale
    return values.reshape(shape)


def stored_parameters(path: Union[str, Path]) -> dict[str, np.ndarray]:
    """{label: f32 values} of every floating-point variable an export stores (f32, f16, or
    Q4_0 dequantized), read from its .dat files: what tract multiplies with."""
    return dict(iter_stored_parameters(path))


def iter_stored_parameters(path: Union[str, Path]):
    """(label, f32 values) of each variable :func:`stored_parameters` reads, one at a time
    (memory holds one of them, not the model)."""
    for name, raw in _dat_files(Path(path)):
        length, rank = struct.unpack_from("<II", raw, 4)
        shape = struct.unpack_from(f"<{rank}I", raw, 12)
        bits, code = struct.unpack_from("<II", raw, 44)
        data = raw[_HEADER:_HEADER + length]
        label = Path(name).name[: -len(".dat")]
        count = int(np.prod(shape)) if shape else 1
        if code == 0 and bits in (16, 32):  # IEEE floats
            dtype = np.float16 if bits == 16 else np.float32
            values = np.frombuffer(data, dtype=dtype).astype(np.float32, copy=False)
            yield label, values.reshape(shape)  # f32: a read-only view of the file's bytes
        elif length == count // _Q4_BLOCK * _Q4_BYTES and count % _Q4_BLOCK == 0:
            yield label, decode_q4_0(data, shape)
