"""The cache adapter for ``DynamicCache`` and its layers (transformers 5.5 and later).

A layer holds linear-attention states (``LinearAttentionLayer``: conv and recurrent states in
``number_of_states`` slots from 5.15, one tensor per kind in 5.5-5.12), attention tensors
(keys, values, a sparse indexer's keys), or both (the hybrid layers of Falcon-H1 and Zamba2,
read the same way). A cache built from explicit states uses gdn-fx's own layer classes where
transformers' would lose information: a counting linear layer (5.25 counts tokens per layer,
``compat.CountingLayer``) and, on request, :class:`WholeWindowLayer` for sliding windows.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from torch import Tensor, nn
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from gdn_fx.errors import ShapeError
from gdn_fx.hf import compat

LINEAR_KINDS = ("conv", "recurrent")
# attention kind -> the layer attribute that holds it
ATTENTION = {"key": "keys", "value": "values", "indexer_key": "indexer_keys"}


class WholeWindowLayer(DynamicLayer):
    """A sliding-window attention cache layer that keeps every token.

    transformers' sliding layer keeps the last ``window - 1`` tokens, so the size it returns
    depends on whether the window is full (a branch on P that no symbolic P survives). This
    one keeps them all and lets the sliding mask alone hide what lies outside the window:
    the same attention, a cache that grows like a full-attention layer's.
    """

    is_sliding = True  # masking_utils sizes the sliding mask from the first sliding layer


class LayersAdapter:
    """``DynamicCache(config=...)``: reads and writes its layers (gdn_fx.hf.caches)."""

    def new(self, model: nn.Module) -> DynamicCache:
        return DynamicCache(config=model.config)

    def entries(self, cache: DynamicCache) -> list[list[tuple[str, Optional[int], Tensor]]]:
        return [_layer_entries(layer) for layer in cache.layers]

    def filled(self, model: nn.Module, specs: Sequence, tensors: Sequence[Tensor], *,
               linear_class: Optional[type] = None, whole_windows: bool = False,
               forget_linear: bool = False) -> DynamicCache:
        """A fresh cache holding ``tensors`` (used as given, not copied).

        ``linear_class`` (a LinearAttentionLayer subclass) replaces the plain linear-attention
        layers, e.g. to change how they update conv states; ``whole_windows`` replaces the
        sliding-window layers by :class:`WholeWindowLayer`; ``forget_linear`` leaves the
        linear layers empty, as a fresh cache's are (their tensors are then not installed)."""
        cache = DynamicCache(config=model.config)
        linear_class = linear_class or compat.COUNTING_LINEAR
        for index, layer in enumerate(cache.layers):
            if linear_class is not None and type(layer) is compat.LINEAR_LAYER:
                cache.layers[index] = linear_class(number_of_states=layer.number_of_states)
            elif whole_windows and compat.SLIDING_LAYER is not None and isinstance(
                    layer, compat.SLIDING_LAYER):
                cache.layers[index] = WholeWindowLayer()
        for spec, tensor in zip(specs, tensors):
            layer = cache.layers[spec.layer]
            if spec.kind in LINEAR_KINDS:
                if not forget_linear:
                    set_state(layer, spec.kind, spec.slot, tensor)
            else:
                _fill_attention(layer, spec, tensor)
        _carry_length(cache)
        return cache

    def read(self, cache: DynamicCache, specs: Sequence) -> list[Tensor]:
        out = []
        for spec in specs:
            layer = cache.layers[spec.layer]
            if spec.kind in LINEAR_KINDS:
                out.append(get_state(layer, spec.kind, spec.slot))
            else:
                out.append(getattr(layer, ATTENTION[spec.kind]))
        return out

    def step_swaps(self, model: nn.Module) -> list:
        return []


ADAPTER = LayersAdapter()


def is_linear(layer: Any) -> bool:
    """Whether a cache layer holds linear-attention (conv / recurrent) states."""
    return compat.LINEAR_MIXIN is not None and isinstance(layer, compat.LINEAR_MIXIN)


def slots(layer: Any) -> list[Optional[int]]:
    """The state slots of a linear-attention cache layer: ``range(number_of_states)``, or
    ``[None]`` where the layer holds one tensor per kind (5.5-5.12)."""
    count = getattr(layer, "number_of_states", None)
    return [None] if count is None else list(range(count))


def _layer_entries(layer) -> list[tuple[str, Optional[int], Tensor]]:
    """(kind, slot, tensor) for every tensor one cache layer holds."""
    found = []
    if is_linear(layer):
        for slot in slots(layer):
            for kind in LINEAR_KINDS:
                tensor = get_state(layer, kind, slot)
                if tensor is not None:
                    found.append((kind, slot, tensor))
    for kind, attr in ATTENTION.items():
        tensor = getattr(layer, attr, None)
        if isinstance(tensor, Tensor):
            found.append((kind, 0, tensor))
    return found


def _table(kind: str) -> str:
    return "conv_states" if kind == "conv" else "recurrent_states"


def _flag(kind: str) -> str:
    return "is_conv_states_initialized" if kind == "conv" else "is_recurrent_states_initialized"


def get_state(layer: Any, kind: str, slot: Optional[int]) -> Optional[Tensor]:
    """The conv (``kind="conv"``) or recurrent state in ``slot`` of a cache layer."""
    value = getattr(layer, _table(kind))
    return value if slot is None else value[slot]


def set_state(layer: Any, kind: str, slot: Optional[int], tensor: Tensor) -> None:
    """Install a conv or recurrent state the way the layer's lazy initialization would."""
    if getattr(layer, "device", None) is None:
        layer.device, layer.dtype = tensor.device, tensor.dtype
    _put(layer, _table(kind), slot, tensor)
    _put(layer, _flag(kind), slot, True)
    if kind == "conv":
        _put(layer, "conv_kernel_size", slot, tensor.shape[-1])
        if slot is None:
            layer.max_batch_size = tensor.shape[0]
    # Given states mean "continue from here": transformers then takes its cached branches.
    _put(layer, "has_previous_state", slot, True)


def _put(layer: Any, name: str, slot: Optional[int], value: Any) -> None:
    """``layer.<name>[slot] = value``, or the attribute itself where the layer holds one
    tensor per kind (slot None)."""
    if slot is None:
        setattr(layer, name, value)
    else:
        getattr(layer, name)[slot] = value


def _fill_attention(layer, spec, tensor: Tensor) -> None:
    """Install keys, values or indexer keys the way DynamicLayer.update would leave them."""
    if spec.kind == "indexer_key":
        layer.indexer_keys = tensor
        layer.indexer_dtype, layer.indexer_device = tensor.dtype, tensor.device
        layer.is_indexer_initialized = True
        return
    setattr(layer, ATTENTION[spec.kind], tensor)
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
