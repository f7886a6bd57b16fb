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

import struct
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence, Union

import numpy as np
import torch

from gdn_fx.errors import DTypeError, ShapeError
# the engine's side, torch-free (gdn_fx.runtime.engine), kept importable from here
from gdn_fx.runtime.engine import (ERROR_LIMIT, error_text, load, nnef_text,  # noqa: F401
                                   read_cpu_fallbacks, read_decisions, read_max_tokens,
                                   read_runtime, release_freed_memory, runtime_unavailable)

TOLERANCE = {torch.float16: 1e-3, torch.float32: 1e-4, torch.float64: 1e-4}


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
