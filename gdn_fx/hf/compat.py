"""What differs between the transformers releases gdn-fx supports, in one place.

Three layouts (docs/FACTS.md, "transformers releases"; detected by feature, not by version):

- 5.15 and later: ``LinearAttentionLayer`` holds lists of states (``number_of_states`` slots)
  and the layers call module-level functions (``causal_conv1d_update``,
  ``torch_chunk_gated_delta_rule``...), which reify and the recurrent rule swap.
- 5.5 to 5.12 (5.13, 5.14 unchecked): ``LinearAttentionLayer`` holds ONE conv and ONE
  recurrent tensor, and each layer binds its kernels as instance attributes at construction
  (swapping module globals does nothing), so only transformers' own rules (``rule="auto"``) are available.
- before 5.5: no ``LinearAttentionLayer``; each family keeps its own cache class.
  ``DecodeStep`` fills Qwen3-Next-style ones (per-layer lists, ``list_cache.py``) and refuses
  the others with the version named.

The forward keyword of the cache is ``cache=`` from 5.24 and ``past_key_values=`` before (an
older forward silently ignores an unknown ``cache=``), so it is read from the signature.
"""

from __future__ import annotations

import inspect
from typing import Any, Optional

import transformers
from torch import Tensor, nn
from transformers import cache_utils

from gdn_fx.errors import UnsupportedModel

VERSION: str = transformers.__version__
LINEAR_LAYER: Optional[type] = getattr(cache_utils, "LinearAttentionLayer", None)
LINEAR_MIXIN: Optional[type] = getattr(cache_utils, "LinearAttentionCacheLayerMixin", None)
SLIDING_LAYER: Optional[type] = getattr(cache_utils, "DynamicSlidingWindowLayer", None)
# Kernel attributes 5.5-5.12 bind on each linear-attention layer instance.
BOUND_KERNELS = ("causal_conv1d_update", "chunk_gated_delta_rule", "recurrent_gated_delta_rule")


def cache_kwarg(model: nn.Module) -> str:
    """The keyword ``model``'s forward takes its cache by: ``cache`` (5.24) or
    ``past_key_values`` (earlier releases)."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def run(model: nn.Module, cache: Any, **kwargs: Any) -> Any:
    """``model(..., <cache keyword>=cache, use_cache=True)`` for the installed release."""
    return model(**{cache_kwarg(model): cache}, use_cache=True, **kwargs)


def is_linear(layer: Any) -> bool:
    """Whether a cache layer holds linear-attention (conv / recurrent) states."""
    return LINEAR_MIXIN is not None and isinstance(layer, LINEAR_MIXIN)


def slots(layer: Any) -> list[Optional[int]]:
    """The state slots of a linear-attention cache layer: ``range(number_of_states)``, or
    ``[None]`` where the layer holds one tensor per kind (5.5-5.12)."""
    count = getattr(layer, "number_of_states", None)
    return [None] if count is None else list(range(count))


def _table(layer: Any, kind: str) -> str:
    return "conv_states" if kind == "conv" else "recurrent_states"


def get_state(layer: Any, kind: str, slot: Optional[int]) -> Optional[Tensor]:
    """The conv (``kind="conv"``) or recurrent state in ``slot`` of a cache layer."""
    value = getattr(layer, _table(layer, kind))
    return value if slot is None else value[slot]


def set_state(layer: Any, kind: str, slot: Optional[int], tensor: Tensor) -> None:
    """Install a conv or recurrent state the way the layer's lazy initialization would."""
    if getattr(layer, "device", None) is None:
        layer.device, layer.dtype = tensor.device, tensor.dtype
    flag = "is_conv_states_initialized" if kind == "conv" else "is_recurrent_states_initialized"
    if slot is None:
        setattr(layer, _table(layer, kind), tensor)
        setattr(layer, flag, True)
        if kind == "conv":
            layer.conv_kernel_size, layer.max_batch_size = tensor.shape[-1], tensor.shape[0]
        # Given states mean "continue from here": HF then takes its cached-decode branches.
        layer.has_previous_state = True
        return
    getattr(layer, _table(layer, kind))[slot] = tensor
    getattr(layer, flag)[slot] = True
    if kind == "conv":
        layer.conv_kernel_size[slot] = tensor.shape[-1]
    layer.has_previous_state[slot] = True


def kernels_bound_per_layer(model: nn.Module) -> bool:
    """Whether ``model``'s layers bind their kernels per instance (5.5-5.12), so swapping a
    modeling file's functions would not reach them."""
    return any(bound_kernel(model, name) for name in BOUND_KERNELS)


def bound_kernel(model: nn.Module, name: str) -> bool:
    """Whether some layer of ``model`` binds a callable kernel ``name`` itself (5.5-5.12)."""
    return any(callable(vars(sub).get(name)) for sub in model.modules())


def require_module_kernels(model: nn.Module, what: str) -> None:
    """Refuse ``what`` (a swap of transformers' functions) where it would not take effect."""
    if kernels_bound_per_layer(model):
        raise UnsupportedModel(
            f"{what} needs transformers >= 5.15: {type(model).__name__}'s layers in "
            f"transformers {VERSION} bind their kernels per layer, so swapping the modeling "
            "file's functions would not reach them")
