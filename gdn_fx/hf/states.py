"""The cache of a transformers hybrid model as a flat list of named tensors, and back.

A :class:`StateSpec` names one tensor a ``DynamicCache`` holds: a linear-attention layer's conv
or recurrent state, an attention layer's keys or values, or a sparse-attention indexer's keys.
Specs are discovered by running the model once on a short prompt and reading the cache it
built, so they follow whatever each family stores (MLA caches, zero-width values, ...).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch import Tensor, nn
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from gdn_fx.errors import DTypeError, ShapeError, UnsupportedModel
from gdn_fx.hf import compat, list_cache
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


def _layer_entries(layer) -> list[tuple[str, int, Tensor]]:
    """(kind, slot, tensor) for every tensor one cache layer holds."""
    found = []
    if compat.is_linear(layer):
        for slot in compat.slots(layer):
            for kind in ("conv", "recurrent"):
                tensor = compat.get_state(layer, kind, slot)
                if tensor is not None:
                    found.append((kind, slot, tensor))
    for kind, attr in (("key", "keys"), ("value", "values"), ("indexer_key", "indexer_keys")):
        tensor = getattr(layer, attr, None)
        if isinstance(tensor, Tensor):
            found.append((kind, 0, tensor))
    return found


def new_cache(model: nn.Module):
    """An empty cache of the kind ``model``'s forward fills: ``DynamicCache`` from
    transformers 5.5, the family's own class before (``list_cache.py``)."""
    if compat.LINEAR_LAYER is None:
        return list_cache.new_cache(model)
    return DynamicCache(config=model.config)


def _entries_by_layer(cache) -> list[list[tuple[str, Optional[int], Tensor]]]:
    if list_cache.is_list_cache(cache):
        return [[(kind, None, t) for kind, t in layer] for layer in list_cache.entries(cache)]
    return [_layer_entries(layer) for layer in cache.layers]


def discover_specs(model: nn.Module) -> list[StateSpec]:
    """Run ``model`` once on a short prompt and describe every tensor its cache then holds."""
    cache = new_cache(model)
    ids = torch.full((1, PROBE_LEN), 3, dtype=torch.long, device=model_device(model))
    with torch.no_grad():
        try:
            compat.run(model, cache, input_ids=ids)
        except AttributeError as err:  # e.g. olmo_hybrid before 5.15 wants its own cache class
            raise UnsupportedModel(
                f"{type(model).__name__} in transformers {compat.VERSION} does not keep its "
                f"states in DynamicCache's layers ({err}); DecodeStep cannot pass them") from None
    specs = []
    entries_by_layer = _entries_by_layer(cache)
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


def _fill_attention(layer, spec: StateSpec, tensor: Tensor) -> None:
    """Install keys, values or indexer keys the way DynamicLayer.update would leave them."""
    if spec.kind == "indexer_key":
        layer.indexer_keys = tensor
        layer.indexer_dtype, layer.indexer_device = tensor.dtype, tensor.device
        layer.is_indexer_initialized = True
        return
    setattr(layer, "keys" if spec.kind == "key" else "values", tensor)
    layer.device = tensor.device
    layer.is_initialized = True
    sliding = compat.SLIDING_LAYER is not None and isinstance(layer, compat.SLIDING_LAYER)
    if sliding and spec.kind == "key":
        if tensor.shape[-2] >= layer.sliding_window - 1:
            # The layer then keeps only its window: the absolute position is lost.
            raise ShapeError(f"state '{spec.name}': {tensor.shape[-2]} cached tokens reach the "
                             f"sliding window ({layer.sliding_window}) minus one; explicit "
                             "states cannot carry positions beyond it")
        layer.cumulative_length = tensor.shape[-2]
        layer._sliding_window_tensor = layer._sliding_window_tensor.to(tensor.device)


class WholeWindowLayer(DynamicLayer):
    """A sliding-window attention cache layer that keeps every token.

    transformers' sliding layer keeps the last ``window - 1`` tokens, so the size it returns
    depends on whether the window is full (a branch on P that no symbolic P survives). This
    one keeps them all and lets the sliding mask alone hide what lies outside the window:
    the same attention, a cache that grows like a full-attention layer's.
    """

    is_sliding = True  # masking_utils sizes the sliding mask from the first sliding layer


def build_cache(config, specs: Sequence[StateSpec], tensors: Sequence[Tensor],
                linear_class: Optional[type] = None,
                whole_windows: bool = False) -> DynamicCache:
    """A fresh ``DynamicCache(config=...)`` holding ``tensors`` (used as given, not copied).

    ``linear_class`` (a LinearAttentionLayer subclass) replaces the plain linear-attention
    cache layers, e.g. to change how they update conv states. ``whole_windows`` replaces
    the sliding-window layers by :class:`WholeWindowLayer`.
    """
    if len(tensors) != len(specs):
        raise ShapeError(f"expected {len(specs)} state tensors "
                         f"({', '.join(s.name for s in specs)}), got {len(tensors)}")
    cache = DynamicCache(config=config)
    linear_class = linear_class or compat.COUNTING_LINEAR
    for index, layer in enumerate(cache.layers):
        if linear_class is not None and type(layer) is compat.LINEAR_LAYER:
            cache.layers[index] = linear_class(number_of_states=layer.number_of_states)
        elif whole_windows and compat.SLIDING_LAYER is not None and isinstance(
                layer, compat.SLIDING_LAYER):
            cache.layers[index] = WholeWindowLayer()
    for spec, tensor in zip(specs, tensors):
        layer = cache.layers[spec.layer]
        if spec.kind in ("conv", "recurrent"):
            compat.set_state(layer, spec.kind, spec.slot, tensor)
        else:
            _fill_attention(layer, spec, tensor)
    _carry_length(cache)
    return cache


def _carry_length(cache: DynamicCache) -> None:
    """Give the linear layers the cached length (transformers 5.25 counts tokens in each and
    ``get_seq_length()`` reads layer 0's): the first other layer's, the one 5.24's
    ``get_seq_length()`` read. A cache of linear layers alone keeps transformers' count."""
    if not compat.COUNTS_TOKENS:
        return
    others = [layer for layer in cache.layers if not isinstance(layer, compat.CountingLayer)]
    if not others:
        return
    length = others[0].get_seq_length()
    for layer in cache.layers:
        compat.carry_length(layer, length)


def read_cache(cache: DynamicCache, specs: Sequence[StateSpec]) -> list[Tensor]:
    """The tensors ``cache`` holds now, in ``specs`` order."""
    if list_cache.is_list_cache(cache):
        return list_cache.read(cache, specs)
    out = []
    for spec in specs:
        layer = cache.layers[spec.layer]
        if spec.kind in ("conv", "recurrent"):
            out.append(compat.get_state(layer, spec.kind, spec.slot))
        else:
            attr = {"key": "keys", "value": "values", "indexer_key": "indexer_keys"}[spec.kind]
            out.append(getattr(layer, attr))
    return out


def check_states(specs: Sequence[StateSpec], tensors: Sequence[Tensor], batch: int) -> None:
    """Raise a clear error when the state tensors do not match the specs."""
    if len(tensors) != len(specs):
        raise ShapeError(f"expected {len(specs)} state tensors "
                         f"({', '.join(s.name for s in specs)}), got {len(tensors)}")
    for spec, tensor in zip(specs, tensors):
        _check(spec, tensor, batch)
