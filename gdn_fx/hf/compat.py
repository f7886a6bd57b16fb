"""What differs between the transformers releases gdn-fx supports, in one place.

Three layouts (docs/FACTS.md, "transformers releases"; detected by feature, not by version):

- 5.15 and later: ``LinearAttentionLayer`` holds lists of states (``number_of_states`` slots)
  and the layers call module-level functions (``causal_conv1d_update``,
  ``torch_chunk_gated_delta_rule``...), which reify and the recurrent rule swap.
- 5.5 to 5.12 (5.13, 5.14 unchecked): ``LinearAttentionLayer`` holds ONE conv and ONE
  recurrent tensor, and each layer binds its kernels as instance attributes at construction
  (swapping module globals does nothing), so only transformers' own rules (``rule="auto"``) are available.
- before 5.5: no ``LinearAttentionLayer``; each family keeps its own cache class.
  ``DecodeStep`` fills Qwen3-Next-style ones (per-layer lists, ``caches/family_lists.py``)
  and refuses the others with the version named. Each layout's cache is read and written by
  its adapter in ``gdn_fx.hf.caches``; this module only says what the release has.

From 5.25 each linear-attention layer also counts the tokens it has seen
(``cumulative_length_linear``, ``increase_count``) and ``Cache.get_seq_length()`` returns
layer 0's count even when layer 0 is linear: a cache built from explicit states must carry
the cached length into its linear layers (:class:`CountingLayer`).

The forward keyword of the cache is ``cache=`` from 5.24 and ``past_key_values=`` before
(``cache_params=`` for the Mamba models without attention; an older forward silently ignores
an unknown ``cache=``), so it is read from the signature.
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
# 5.25: linear-attention layers count tokens and get_seq_length may read a linear layer.
COUNTS_TOKENS: bool = LINEAR_LAYER is not None and hasattr(LINEAR_LAYER, "increase_count")
# Kernel attributes 5.5-5.12 bind on each linear-attention layer instance.
BOUND_KERNELS = ("causal_conv1d_update", "chunk_gated_delta_rule", "recurrent_gated_delta_rule")


# Model types whose forward, given no position_ids, numbers the new tokens from 0 whatever the
# cache holds (bamba in 5.25: ``torch.arange(S)``), where generate passes P + arange(S):
# DecodeStep passes those positions itself.
NUMBERS_FROM_ZERO = ("bamba",)


def numbers_from_zero(model: nn.Module) -> bool:
    """Whether ``model`` must be given its positions on a warm cache (NUMBERS_FROM_ZERO)."""
    return getattr(model.config, "model_type", None) in NUMBERS_FROM_ZERO


def cache_kwarg(model: nn.Module) -> str:
    """The keyword ``model``'s forward takes its cache by: ``cache`` (5.24), or
    ``cache_params`` (the Mamba models without attention) or ``past_key_values`` (earlier
    releases)."""
    params = inspect.signature(model.forward).parameters
    # the Mamba models without attention took ``cache_params`` before 5.24
    return next((k for k in ("cache", "cache_params") if k in params), "past_key_values")


def run(model: nn.Module, cache: Any, **kwargs: Any) -> Any:
    """``model(..., <cache keyword>=cache, use_cache=True)`` for the installed release."""
    return model(**{cache_kwarg(model): cache}, use_cache=True, **kwargs)


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


class CountingLayer:
    """Mixin (before a ``LINEAR_LAYER`` base) for a linear-attention cache layer built from
    explicit states: it reports the cached length it was given (:func:`carry_length`) plus
    the tokens counted since, where transformers' own count (5.25's
    ``cumulative_length_linear``) would start at 0 and give every step after a prompt the
    wrong positions. A layer given no length, or a release without the count, is unchanged."""

    carried_length: Any = None  # an int or a SymInt (the attention caches' symbolic P)

    def get_seq_length(self, *args, **kwargs):
        if self.carried_length is None:
            return super().get_seq_length(*args, **kwargs)
        return self.carried_length

    def increase_count(self, state_idx: int):
        super().increase_count(state_idx)
        count_tokens(self, state_idx, 1)

    def update_conv_state(self, conv_states: Tensor, state_idx: int = 0, **kwargs) -> Tensor:
        out = super().update_conv_state(conv_states, state_idx, **kwargs)
        count_tokens(self, state_idx, conv_states.shape[-1])
        return out


def count_tokens(layer: Any, state_idx: int, count: Any) -> None:
    """Add ``count`` new tokens to a :class:`CountingLayer`'s carried length (as 5.25 counts:
    on state 0 only); nothing for any other layer."""
    if isinstance(layer, CountingLayer) and state_idx == 0 and layer.carried_length is not None:
        layer.carried_length = layer.carried_length + count


def carry_length(layer: Any, length: Any) -> None:
    """Give a :class:`CountingLayer` the number of tokens its states already hold."""
    if isinstance(layer, CountingLayer):
        layer.carried_length = length


# The bases of a linear-attention layer subclass: counting where the release counts.
LINEAR_BASES: tuple = ((CountingLayer, LINEAR_LAYER) if COUNTS_TOKENS
                       else (LINEAR_LAYER or object,))
# The plain linear layer a cache built from states uses instead of LINEAR_LAYER (None: no need).
COUNTING_LINEAR: Optional[type] = (type("CountingLinearAttentionLayer", LINEAR_BASES, {})
                                   if COUNTS_TOKENS else None)
