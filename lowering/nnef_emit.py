"""Small helpers that add NNEF operations to a torch-to-nnef graph on behalf of one fused node.

Every intermediate tensor is named after the node's first output, so two fused nodes never
collide. ``EmitContext`` is what an emitter receives: the graph, the node's operands as NNEF
tensors, its facts, and the names its two outputs must carry.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Union

import numpy as np
from nnef_tools.model import Graph as NGraph
from nnef_tools.model import Operation as NOperation
from nnef_tools.model import Tensor as NTensor

from gdn_fx.lowering.node_facts import ConvFacts, LinearFacts, ScanFacts

NUMPY = {"f16": np.float16, "f32": np.float32, "f64": np.float64}
_WIDTH = {"f16": 0, "f32": 1, "f64": 2}


def promote(*names: str) -> str:
    """The widest of some float dtype names (f16 < f32 < f64)."""
    return max(names, key=lambda name: _WIDTH[name])


def nnef_dtype_name(tensor: NTensor) -> str:
    """The short dtype name of an NNEF tensor ("f16", "f32", "f64")."""
    for name, dtype in NUMPY.items():
        if np.dtype(tensor.dtype) == np.dtype(dtype):
            return name
    return str(np.dtype(tensor.dtype))


@dataclass
class EmitContext:
    """One fused node being written: where, from what, and under which output names."""

    graph: NGraph
    name_to_tensor: dict
    operands: dict[str, Optional[NTensor]]
    output_names: tuple[str, str]
    facts: Union[ScanFacts, LinearFacts, ConvFacts]

    @property
    def prefix(self) -> str:
        return f"{self.output_names[0]}_gdnfx"

    def tensor(self, suffix: str, shape: Sequence, dtype: str) -> NTensor:
        """A fresh intermediate tensor named after the node."""
        return NTensor(self.graph, name=f"{self.prefix}_{suffix}", dtype=NUMPY[dtype],
                       shape=tuple(shape))

    def apply(self, op_type: str, inputs, suffix: str, shape: Sequence, dtype: str,
              attribs: Optional[dict] = None) -> NTensor:
        """Add a single-output operation; returns its output tensor."""
        out = self.tensor(suffix, shape, dtype)
        NOperation(self.graph, type=op_type, attribs=attribs or {}, inputs=tuple(inputs),
                   outputs=(out,))
        return out

    def concat(self, tensors: Sequence[NTensor], axis: int, suffix: str, shape: Sequence,
               dtype: str) -> NTensor:
        """``concat([tensors], axis)``: NNEF takes them as one list argument, which the writer
        prints for a list of inputs (a tuple prints as separate arguments)."""
        out = self.tensor(suffix, shape, dtype)
        NOperation(self.graph, type="concat", attribs={"axis": axis}, inputs=list(tensors),
                   outputs=(out,))
        return out

    def apply_multi(self, op_type: str, inputs, outputs: Sequence[NTensor],
                    attribs: Optional[dict] = None) -> None:
        """Add an operation with several outputs, written into ``outputs``."""
        NOperation(self.graph, type=op_type, attribs=attribs or {}, inputs=tuple(inputs),
                   outputs=tuple(outputs))

    def cast(self, tensor: NTensor, dtype: str, suffix: str) -> NTensor:
        """``tensor`` in ``dtype`` (itself when it already is)."""
        if nnef_dtype_name(tensor) == dtype:
            return tensor
        return self.apply("tract_core_cast", [tensor], f"{suffix}_as_{dtype}", tensor.shape,
                          dtype, {"to": dtype})

    def finish(self, index: int, tensor: NTensor, dtype: str) -> NTensor:
        """Make ``tensor`` (cast to ``dtype`` if needed) the node's output number ``index``."""
        tensor = self.cast(tensor, dtype, f"out{index}")
        if not tensor.name.startswith(self.prefix):  # never rename a tensor we do not own
            tensor = self.apply("copy", [tensor], f"out{index}", tensor.shape, dtype)
        tensor.name = self.output_names[index]
        self.name_to_tensor[tensor.name] = tensor
        return tensor

    def output_tensor(self, index: int, shape: Sequence, dtype: str) -> NTensor:
        """A tensor already carrying the node's output name ``index``."""
        out = NTensor(self.graph, name=self.output_names[index], dtype=NUMPY[dtype],
                      shape=tuple(shape))
        self.name_to_tensor[out.name] = out
        return out
