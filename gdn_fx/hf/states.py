"""The cache of a transformers hybrid model as a flat list of named tensors.

A :class:`StateSpec` names one tensor a cache holds: a linear-attention layer's conv
or recurrent state, an attention layer's keys or values, or a sparse-attention indexer's keys.
Specs are discovered by running the model once on a short prompt and reading the cache it
built, so they follow whatever each family stores (MLA caches, zero-width values, ...). The
cache itself is read and written by the adapter of its layout (``gdn_fx.hf.caches``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch import Tensor, nn

from gdn_fx.errors import DTypeError, ShapeError, UnsupportedModel
from gdn_fx.hf import compat
from gdn_fx.hf.caches import adapter
from gdn_fx.hf.ssm_dropins import recurrent_mixers

# kind -> (input-name stem, past-length axis or None)
KINDS = {
    "conv": ("conv_state", None),
    "recurrent": ("recurrent_state", None),
    "key": ("key", 2),
    "value": ("value", 2),
    "indexer_key": ("indexer_key", 1),
}
PROBE_LEN = 2  # tokens run once to discover what the cache holds


@dataclass(frozen=True)
class StateSpec:
    """One cached tensor: where it lives in the cache, and its shape at batch 1 / past 0."""

    layer: int
    kind: str  # a key of KINDS
    # state index inside a linear-attention layer (0 for attention tensors); None where the
    # layer holds one tensor per kind (transformers 5.5-5.12)
    slot: Optional[int]
    shape: tuple[int, ...]  # batch 1; past-length axis 0
    dtype: torch.dtype
    multi_slot: bool = False  # the layer holds several states of this kind: name carries slot

    @property
    def name(self) -> str:
        """The input name, e.g. ``conv_state_0`` or ``key_3`` (a valid NNEF identifier)."""
        stem = KINDS[self.kind][0]
        suffix = f"_{self.slot}" if self.multi_slot else ""
        return f"{stem}_{self.layer}{suffix}"

    @property
    def past_axis(self) -> Optional[int]:
        """The axis that grows with the cached length (attention tensors), else None."""
        return KINDS[self.kind][1]

    def shape_for(self, batch: int, past_len: int) -> tuple[int, ...]:
        """The tensor's shape for a batch size and a cached length."""
        shape = [batch, *self.shape[1:]]
        if self.past_axis is not None:
            shape[self.past_axis] = past_len
        return tuple(shape)


def discover_specs(model: nn.Module) -> list[StateSpec]:
    """Run ``model`` once on a short prompt and describe every tensor its cache then holds."""
    caches = adapter()
    cache = caches.new(model)
    ids = torch.full((1, PROBE_LEN), 3, dtype=torch.long, device=model_device(model))
    with torch.no_grad():
        try:
            compat.run(model, cache, input_ids=ids)
        except AttributeError as err:  # e.g. olmo_hybrid before 5.15 wants its own cache class
            raise UnsupportedModel(
                f"{type(model).__name__} in transformers {compat.VERSION} does not keep its "
                f"states in DynamicCache's layers ({err}); DecodeStep cannot pass them") from None
    specs = []
    entries_by_layer = caches.entries(cache)
    if not any(kind in ("conv", "recurrent") for entries in entries_by_layer
               for kind, _, _ in entries) and recurrent_mixers(model):
        raise UnsupportedModel(
            f"{type(model).__name__} in transformers {compat.VERSION} keeps its Mamba states "
            "outside the DynamicCache it is given (its own cache class); DecodeStep cannot "
            "pass them")
    for index, entries in enumerate(entries_by_layer):
        for kind, slot, tensor in entries:
            shape = list(tensor.shape)
            if KINDS[kind][1] is not None:
                shape[KINDS[kind][1]] = 0
            multi = sum(k == kind for k, _, _ in entries) > 1
            specs.append(StateSpec(index, kind, slot, tuple(shape), tensor.dtype, multi))
    return specs


def model_device(model: nn.Module) -> torch.device:
    """The device of ``model``'s first parameter (CPU for a parameterless model)."""
    param = next(model.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


def _check(spec: StateSpec, tensor: Tensor, batch: int) -> None:
    """Raise ShapeError/DTypeError when a state tensor does not match its spec."""
    axis = spec.past_axis
    past = tensor.shape[axis] if axis is not None and tensor.dim() > axis else 0
    want = spec.shape_for(batch, past)
    if tuple(tensor.shape) != want:
        what = ", any past length" if axis is not None else ""
        raise ShapeError(f"state '{spec.name}' has shape {list(tensor.shape)}; expected "
                         f"{list(want)} (batch {batch}{what})")
    if tensor.dtype != spec.dtype:
        raise DTypeError(f"state '{spec.name}' has dtype {tensor.dtype}; expected {spec.dtype}")


def check_states(specs: Sequence[StateSpec], tensors: Sequence[Tensor], batch: int) -> None:
    """Raise a clear error when the state tensors do not match the specs."""
    if len(tensors) != len(specs):
        raise ShapeError(f"expected {len(specs)} state tensors "
                         f"({', '.join(s.name for s in specs)}), got {len(tensors)}")
    for spec, tensor in zip(specs, tensors):
        _check(spec, tensor, batch)
