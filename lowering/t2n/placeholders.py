"""Weights that are written from their source when the NNEF is written (``--stream``).

A streamed export traces a model whose large parameters are PLACEHOLDERS: a NaN scalar
expanded to the parameter's shape (no memory, any view works), registered with a
:class:`Source` that reads the real tensor (from a safetensors file, one at a time). The
trace never sees the real values; torch-to-nnef's writer is hooked (:func:`streamed_writes`)
so that each variable whose label is a placeholder's is written from its source, converted
to the stored format on the way (f32, f16, tract Q4_0: the same functions the in-memory
route calls, so the bytes are the same).

Why NaN: any constant the export computes FROM a placeholder's values (torch-to-nnef folds
ops whose inputs are all constants: ``1 + w``, ``exp(A_log)``, a reshape of a weight) comes
out NaN. The writer refuses such a variable, naming it, instead of writing it (the
placeholder builder keeps the small parameters real, so their folds are right).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import numpy as np
import torch

from gdn_fx.errors import ExportRefused
from gdn_fx.lowering.options import Q4_GROUP

Q4_0 = "q4_0"


@dataclass(frozen=True)
class Source:
    """Where a placeholder's values come from: ``load()`` returns the real tensor in the
    model's dtype; ``stored`` is how the NNEF stores it (a dtype, or "q4_0")."""

    name: str
    shape: tuple
    load: Callable[[], torch.Tensor]
    stored: object  # torch.dtype or Q4_0

    def values(self) -> torch.Tensor:
        """The real tensor, checked against the placeholder's shape, in its stored dtype
        (Q4_0: the float tensor it is quantized from)."""
        real = self.load()
        if tuple(real.shape) != tuple(self.shape):
            raise ExportRefused(f"streamed weight {self.name}: the checkpoint holds shape "
                                f"{tuple(real.shape)}, the model {tuple(self.shape)}")
        return real if self.stored == Q4_0 else real.to(self.stored)


class Placeholders:
    """The placeholders of one streamed export, by tensor identity."""

    def __init__(self) -> None:
        self._by_storage: dict[int, tuple[torch.Tensor, Source]] = {}
        self._by_id: dict[int, tuple[object, Source]] = {}

    def make(self, name: str, shape, dtype: torch.dtype,
             load: Callable[[], torch.Tensor], stored=None) -> torch.Tensor:
        """A placeholder of ``shape`` and ``dtype`` whose values ``load`` reads."""
        value = torch.full((), math.nan, dtype=dtype).expand(tuple(shape))
        self._by_storage[value.untyped_storage().data_ptr()] = (
            value, Source(name, tuple(shape), load, stored or dtype))
        return value

    def source(self, tensor) -> Optional[Source]:
        """The source of ``tensor`` when it is a placeholder (or a Parameter over one)."""
        found = self._by_id.get(id(tensor))
        if found is not None:
            return found[1]
        if isinstance(tensor, torch.Tensor) and type(tensor) in (torch.Tensor,
                                                                  torch.nn.Parameter):
            if tensor.numel() and all(s == 0 for s in tensor.stride()):
                found = self._by_storage.get(tensor.untyped_storage().data_ptr())
                return None if found is None else found[1]
        return None

    def as_dtype(self, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """A placeholder for ``tensor`` (a placeholder) stored in ``dtype``."""
        source = self.source(tensor)
        return self.make(source.name, source.shape, dtype, source.load)

    def quantized(self, tensor: torch.Tensor):
        """torch-to-nnef's Q4_0 tensor for ``tensor`` (a placeholder), registered so that the
        writer writes the Q4_0 of the real tensor instead: its codes and scales are zero-stride
        expansions, made without quantizing the placeholder (what the trace reads of them is
        their shapes). Quantizing the NaN placeholder itself cost a float copy of each weight
        and more: a streamed export of the 0.8B shape in q4_0 peaked at 12.7 GiB, 9x its bf16
        checkpoint (bench/bench_checkpoint.py)."""
        source = self.source(tensor)
        codes = torch.zeros((), dtype=torch.uint8).expand(tensor.shape)  # a byte per weight
        scales = torch.zeros((), dtype=torch.float16).expand(tensor.numel() // Q4_GROUP, 1)
        value = _q4_0_tensor(tensor, codes, scales)
        # torch-to-nnef dequantizes a Q4_0 tensor at every torch function it meets while it
        # builds its graph: full size, ~2 GiB at a time for the 0.8B table (export peak 4.6
        # GiB). What zero codes at zero scales dequantize to is zeros: expanded, no memory.
        zeros = torch.zeros((), dtype=value.dequant_to_dtype).expand(tensor.shape)
        value.decompress = lambda: zeros
        self._by_id[id(value)] = (value, Source(source.name, source.shape, source.load, Q4_0))
        return value


_ACTIVE: contextvars.ContextVar[Optional[Placeholders]] = contextvars.ContextVar(
    "gdn_fx_placeholders", default=None)


def active() -> Optional[Placeholders]:
    """The placeholders of the streamed export under way, or None."""
    return _ACTIVE.get()


@contextlib.contextmanager
def streaming(placeholders: Placeholders) -> Iterator[Placeholders]:
    """Within: exports write placeholders from their sources (see the module doc)."""
    token = _ACTIVE.set(placeholders)
    try:
        yield placeholders
    finally:
        _ACTIVE.reset(token)


def resolve(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s real values when it is a placeholder of the streamed export under way
    (in its dtype), else ``tensor``."""
    found = active()
    source = None if found is None else found.source(tensor)
    return tensor if source is None else source.load().to(tensor.dtype)


def labels(module: torch.fx.GraphModule, placeholders: Placeholders) -> dict[str, Source]:
    """{NNEF label: source} for each parameter of ``module`` that is a placeholder
    (torch-to-nnef labels a parameter by its attribute path)."""
    found = {}
    for name, value in list(module.named_parameters(remove_duplicate=False)) + list(
            module.named_buffers(remove_duplicate=False)):
        source = placeholders.source(value)
        if source is not None:
            found[name] = source
    return found


@contextlib.contextmanager
def streamed_writes(sources: dict[str, Source], inference_target) -> Iterator[None]:
    """torch-to-nnef's variable writer, for the duration, writing each label of
    ``sources`` from its source and refusing a variable computed from a placeholder."""
    from torch_to_nnef.nnef_io import writer

    original = writer.Writer._write_tensors_from_operators

    def write(self, graph, folder):
        rest = _write_sources(graph, folder, sources, inference_target)
        original(self, _Only(graph, rest), folder)

    writer.Writer._write_tensors_from_operators = write
    try:
        with _expanded_clones():
            yield
    finally:
        writer.Writer._write_tensors_from_operators = original


@contextlib.contextmanager
def _expanded_clones() -> Iterator[None]:
    """torch-to-nnef 0.24.12's ``NamedTensor`` (each parameter while it builds its graph)
    clones its operands at every torch function it sees while inferring shapes; the clone of
    a placeholder (a NaN scalar expanded) is a full-size tensor, so the streamed 0.8B export
    held ~2 GiB of NaN copies before writing a weight (its peak: 4.1 GiB in f32). Within, the
    clone of a tensor whose every stride is zero is the same scalar, cloned, expanded: the
    same values and shape, a storage of its own (as a clone has), no memory; clones a traced
    forward records stay as they were."""
    try:
        from torch_to_nnef.tensor.named import NamedTensor
    except ImportError:  # another torch-to-nnef: nothing to change
        yield
        return
    original = NamedTensor.clone

    def clone(self, *args, **kwargs):
        # a traced forward keeps its clones: the trace must record the parameter's use
        if not torch.jit.is_tracing() and self.dim() and self.numel() > 1 \
                and not any(self.stride()):
            plain = self.as_subclass(torch.Tensor)
            scalar = plain.as_strided((), (), plain.storage_offset()).clone()
            return self.__class__(scalar.expand(self.shape), nnef_name=self.nnef_name)
        return original(self, *args, **kwargs)

    NamedTensor.clone = clone
    try:
        yield
    finally:
        NamedTensor.clone = original


class _Only:
    """A view of an NNEF graph whose ``operations`` are ``ops`` (the writer reads only
    ``operations``)."""

    def __init__(self, graph, ops) -> None:
        self._graph, self.operations = graph, ops

    def __getattr__(self, name):
        return getattr(self._graph, name)


def _write_sources(graph, folder: str, sources: dict[str, Source], target) -> list:
    """Write the variables of ``graph`` that ``sources`` names; return the operations left
    to torch-to-nnef's writer (refusing any variable computed from a placeholder)."""
    import os

    from torch_to_nnef.nnef_io.writer import write_nnef_tensor

    from gdn_fx.memory import release_freed_memory

    rest = []
    for op in graph.operations:
        label = op.attribs.get("label") if op.type == "variable" else None
        source = sources.get(label) if label is not None else None
        if source is None:
            if label is not None:
                _refuse_derived(op, label)
            rest.append(op)
            continue
        values = source.values()
        if source.stored == Q4_0:
            op.attribs.pop("custom_datatype", None)
            q4_0_by_rows(values).write_in_file(folder, label, target)
        else:
            write_nnef_tensor(np.asarray(values.numpy(), order="C"),
                              os.path.join(folder, label + ".dat"),
                              quantized=bool(op.output.quant))
        del values
        release_freed_memory()  # glibc keeps the freed blocks of each weight's conversion
    return rest


def q4_0_by_rows(values: torch.Tensor, rows: int = 4096):
    """torch-to-nnef's tract Q4_0 of the matrix ``values``, quantized ``rows`` rows at a
    time: its groups of 32 lie within a row, so the blocks' codes and scales are those of
    the whole (tests/test_stream_export.py). Quantizing a 1 GB table at once takes several
    float temporaries of its size; by blocks the peak is the table and its codes."""
    from torch_to_nnef.tensor.quant import fp_to_tract_q4_0_with_min_max_calibration

    if values.dim() != 2 or values.shape[0] <= rows:
        return fp_to_tract_q4_0_with_min_max_calibration(values)
    blocks = [fp_to_tract_q4_0_with_min_max_calibration(b) for b in values.split(rows)]
    return _q4_0_tensor(values, torch.cat([b.u8_blob for b in blocks]),
                        torch.cat([b.qscheme.scale for b in blocks]))


def _q4_0_tensor(values: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor):
    """torch-to-nnef's tract Q4_0 tensor of ``values`` holding the given codes (a byte per
    weight) and scales (one f16 per group): its constructor would quantize ``values``."""
    from torch_to_nnef.tensor.quant import QScalePerGroupF16, QTensorTractScaleOnly

    scheme = QScalePerGroupF16(group_size=Q4_GROUP, n_bits=4, scale=scales)
    scheme.quantize_as_u8 = lambda _: codes
    return QTensorTractScaleOnly(values, qscheme=scheme, dequant_to_dtype=values.dtype)


def _refuse_derived(op, label: str) -> None:
    data = getattr(op.output, "data", None)
    if isinstance(data, torch.Tensor) and data.is_floating_point() and data.numel() \
            and bool(torch.isnan(data.detach().as_subclass(torch.Tensor)).any()):
        raise ExportRefused(
            f"streamed export: NNEF variable {label!r} {tuple(data.shape)} is a constant "
            "computed from the values of a weight the trace only holds as a placeholder "
            "(torch-to-nnef folds ops whose inputs are all constants); the streamed file "
            "would be wrong: export without --stream")
