"""What a lowering check may know about one fused node: operand shapes, dtypes and flags.

Facts are plain frozen data, built either from an fx node's ``meta["val"]`` (before tracing,
where the decision is taken) or from the NNEF tensors torch-to-nnef hands a handler (to check
the decision again at emission time). Shapes hold ints, or None for a symbolic extent;
dtypes are short names ("f16", "bf16", "f32", "f64").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

Shape = tuple[Optional[int], ...]

SCAN_OPERANDS = ("q", "k", "v", "g", "beta", "initial_state")
LINEAR_OPERANDS = ("q", "k", "v", "g", "initial_state")
CONV_OPERANDS = ("x", "conv_state", "weight", "bias")

_TORCH_DTYPES = {torch.float16: "f16", torch.bfloat16: "bf16", torch.float32: "f32",
                 torch.float64: "f64"}
_NUMPY_DTYPES = {np.dtype(np.float16): "f16", np.dtype(np.float32): "f32",
                 np.dtype(np.float64): "f64"}


def dtype_name(dtype) -> str:
    """A torch or numpy dtype as a short name; anything else as its own text."""
    if isinstance(dtype, torch.dtype):
        return _TORCH_DTYPES.get(dtype, str(dtype).replace("torch.", ""))
    try:
        return _NUMPY_DTYPES.get(np.dtype(dtype), str(np.dtype(dtype)))
    except TypeError:
        return str(dtype)


def portable_dtype_reason(facts) -> Optional[str]:
    """Why plain NNEF can not carry these operands (None: it can): tract and torch-to-nnef
    have f16, f32 and f64, no bf16."""
    bad = {name: dt for name, dt in facts.dtypes.items() if dt not in ("f16", "f32", "f64")}
    if bad:
        return f"dtypes {bad}: tract and torch-to-nnef have no such dtype (use f16 or f32)"
    return None


def static_dim(dim) -> Optional[int]:
    """An int extent, or None when the extent is symbolic (a SymInt without a constant)."""
    if isinstance(dim, int):
        return dim
    if isinstance(dim, torch.SymInt):
        return dim.node.maybe_as_int()
    try:
        return int(dim)
    except (TypeError, ValueError):
        return None


class HeadShapes:
    """The head layout both scans share (q, k [B, T, Hk, Dk], v [B, T, Hv, Dv], g [B, T, Hv]
    or [B, T, Hv, Dk]), read off ``self.shapes``."""

    shapes: dict[str, Shape]

    @property
    def batch(self) -> Optional[int]:
        return self.shapes["q"][0]

    @property
    def seq(self) -> Optional[int]:
        """The sequence extent, None when symbolic."""
        return self.shapes["q"][1]

    @property
    def key_heads(self) -> int:
        return self.shapes["q"][2]

    @property
    def value_heads(self) -> int:
        return self.shapes["v"][2]

    @property
    def groups(self) -> int:
        """Value heads per key head (GQA factor G; 1 without GQA)."""
        return self.value_heads // self.key_heads

    @property
    def dk(self) -> int:
        return self.shapes["q"][3]

    @property
    def dv(self) -> int:
        return self.shapes["v"][3]

    @property
    def per_key(self) -> bool:
        """True for a gate per key channel g [B, T, Hv, Dk]; False for one per value head."""
        return len(self.shapes["g"]) == 4


@dataclass(frozen=True)
class ScanFacts(HeadShapes):
    """One gated_delta_scan node: operand shapes/dtypes (contract layout) and its flags."""

    node: str
    shapes: dict[str, Shape]
    dtypes: dict[str, str]
    scale: float
    qk_l2norm: bool
    op: str = field(default="gated_delta_scan", init=False)

    @property
    def kda(self) -> bool:
        """True for a per-key (KDA) gate g [B, T, Hv, Dk]; False for a per-head GDN gate."""
        return self.per_key


@dataclass(frozen=True)
class LinearFacts(HeadShapes):
    """One gated_linear_scan node (no beta, no l2norm): operand shapes/dtypes and its scale."""

    node: str
    shapes: dict[str, Shape]
    dtypes: dict[str, str]
    scale: float
    op: str = field(default="gated_linear_scan", init=False)


@dataclass(frozen=True)
class ConvFacts:
    """One causal_conv1d_update node: operand shapes/dtypes and its flags."""

    node: str
    shapes: dict[str, Shape]
    dtypes: dict[str, str]
    has_bias: bool
    activation: Optional[str]
    op: str = field(default="causal_conv1d_update", init=False)

    @property
    def batch(self) -> Optional[int]:
        return self.shapes["x"][0]

    @property
    def channels(self) -> int:
        return self.shapes["x"][1]

    @property
    def seq(self) -> Optional[int]:
        return self.shapes["x"][2]

    @property
    def kernel(self) -> int:
        return self.shapes["weight"][1]


def describe(facts) -> str:
    """A one-line summary of a node's facts, for logs and decision tables."""
    parts = [f"{name}{list(shape)}:{facts.dtypes[name]}" for name, shape in facts.shapes.items()]
    if isinstance(facts, ScanFacts):
        parts.append(f"scale={facts.scale:.6g} qk_l2norm={facts.qk_l2norm}")
    elif isinstance(facts, LinearFacts):
        parts.append(f"scale={facts.scale:.6g}")
    else:
        parts.append(f"bias={facts.has_bias} activation={facts.activation}")
    return " ".join(parts)
