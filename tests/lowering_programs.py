"""Shared builders for the lowering tests (no tests here).

Programs are tiny nn.Modules whose forward calls the fused ops directly, exported with
torch.export; the oracle of every tract run is torch eager on the same inputs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch
from torch import nn

import gdn_fx  # noqa: F401  (registers torch.ops.gdn_fx)
from gdn_fx.export import export_nnef
from gdn_fx.tract_check import Comparison, compare, nnef_text, read_decisions

SCAN = torch.ops.gdn_fx.gated_delta_scan
CONV = torch.ops.gdn_fx.causal_conv1d_update
SCAN_NAMES = ["q", "k", "v", "g", "beta", "s0"]
NATIVE_GDN = "tract_transformers_gdn_recurrent"
NATIVE_CONV = "tract_transformers_causal_conv1d_update"


class ScanModule(nn.Module):
    """The fused scan between plain ops: a scaled output and the final state."""

    def __init__(self, scale: float, qk_l2norm: bool = True):
        super().__init__()
        self.scale, self.qk_l2norm = scale, qk_l2norm

    def forward(self, q, k, v, g, beta, s0):
        out, state = SCAN(q, k, v, g, beta, s0, scale=self.scale, qk_l2norm=self.qk_l2norm)
        return out * 2.0, state


class ConvModule(nn.Module):
    """The fused conv update with its weight (and bias) as parameters: constants in NNEF."""

    def __init__(self, channels: int, kernel: int, bias: bool, activation: Optional[str],
                 dtype=torch.float32, seed: int = 0):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.weight = nn.Parameter(torch.randn(channels, kernel, generator=gen).to(dtype))
        self.bias = nn.Parameter(torch.randn(channels, generator=gen).to(dtype)) if bias else None
        self.activation = activation

    def forward(self, x, state):
        return CONV(x, state, self.weight, self.bias, self.activation)


def scan_inputs(b=1, s=4, hk=2, groups=1, dk=16, dv=16, kda=False, dtype=torch.float32,
                state_dtype=torch.float32, gate_dtype=None, seed=0) -> tuple:
    """q, k, v, g (log decay), beta, s0 in the op contract's layout."""
    gen = torch.Generator().manual_seed(seed)
    hv = hk * groups

    def rnd(*shape):
        return torch.randn(*shape, generator=gen)

    gate = -0.5 * torch.rand(b, s, hv, *([dk] if kda else []), generator=gen)
    beta = torch.rand(b, s, hv, generator=gen)
    return (rnd(b, s, hk, dk).to(dtype), rnd(b, s, hk, dk).to(dtype), rnd(b, s, hv, dv).to(dtype),
            gate.to(gate_dtype or (torch.float32 if dtype == torch.float16 else dtype)),
            beta.to(dtype), (0.5 * rnd(b, hv, dk, dv)).to(state_dtype))


def conv_inputs(b=2, channels=6, s=4, kernel=4, dtype=torch.float32, seed=0) -> tuple:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(b, channels, s, generator=gen).to(dtype),
            torch.randn(b, channels, kernel, generator=gen).to(dtype))


def export_checked(module: nn.Module, args: tuple, path: Path, tolerance: float,
                   **export_kwargs) -> tuple[dict, Comparison, str]:
    """Export, load and run in tract, compare with torch eager; returns what was emitted."""
    program = torch.export.export(module, args)
    written = export_nnef(program, path, **export_kwargs)
    comparison = compare(written, module(*args), args, tolerance)
    return read_decisions(written), comparison, nnef_text(written)


def tolerance_for(*tensors) -> float:
    """1e-3 when any operand is f16, else 1e-4 (the issue's bar)."""
    return 1e-3 if any(t.dtype == torch.float16 for t in tensors) else 1e-4
