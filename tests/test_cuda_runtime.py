"""Exports for tract's CUDA runtime, run ON the GPU (``tract.runtime_for_name("cuda")``).

Every test here is skipped where tract has no CUDA runtime (no GPU or no driver: CI); the
table's CUDA decisions themselves are tested everywhere (tests/test_lowering_cuda.py). The
oracle is the float64 recurrence on the same inputs (tests/test_lowering_fast.py, oracle).
"""

from __future__ import annotations

import pytest
import torch

from gdn_fx import tract_check
from gdn_fx.export import export_nnef
from lowering_programs import SCAN_NAMES, scan_inputs
from test_lowering_fast import Fused, oracle

MISSING = tract_check.runtime_unavailable("cuda")
pytestmark = pytest.mark.skipif(MISSING is not None, reason=MISSING or "")
F16 = torch.float16


def run_on_gpu(tmp_path, args, dk: int, **export) -> float:
    """Export for CUDA, load with tract's CUDA runtime, return the largest relative error
    against the float64 recurrence."""
    module = Fused(dk ** -0.5)
    path = export_nnef(torch.export.export(module, args), tmp_path / "g.nnef", runtime="cuda",
                       input_names=SCAN_NAMES, **export)
    runnable = tract_check.load(path, "cuda")
    got = tract_check.run(runnable, args)
    return max(tract_check.relative_error(g, w) for g, w in zip(got, oracle(module, args)))


@pytest.mark.parametrize("s, dtype, bound", [(300, torch.float32, 1e-4), (300, F16, 2e-3),
                                             (2100, torch.float32, 1e-4)])
def test_chunked_parallel_on_gpu(tmp_path, s, dtype, bound):
    args = scan_inputs(s=s, hk=2, dk=16, dv=16, dtype=dtype)
    assert run_on_gpu(tmp_path, args, 16) <= bound


@pytest.mark.parametrize("s", [1, 8])
def test_native_cuda_kernel_on_gpu(tmp_path, s):
    """The kernel's own dtype set (f16 q/k/v/beta, f32 gate and state), width 128."""
    args = scan_inputs(s=s, hk=2, dk=128, dv=128, dtype=F16, gate_dtype=torch.float32)
    assert run_on_gpu(tmp_path, args, 128, choose={"*": "native"}) <= 2e-3


def test_demoted_scan_is_still_right_on_gpu(tmp_path):
    """Symbolic S in f32: the table's demoted 'chunked' (its loop runs on the CPU)."""
    args = scan_inputs(s=70, hk=2, dk=16, dv=16)
    axes = {name: {1: "S"} for name in SCAN_NAMES[:5]}
    assert run_on_gpu(tmp_path, args, 16, dynamic_axes=axes) <= 1e-4
