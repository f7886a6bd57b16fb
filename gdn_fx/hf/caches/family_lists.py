"""The cache adapter for transformers before 5.5, where a hybrid family keeps its own cache.

Before ``LinearAttentionLayer`` (docs/FACTS.md, "transformers releases"), Qwen3-Next (and, from
5.2 / 5.3, Qwen3.5 and OLMo-hybrid, copies of it) keep their cache in a class of their
modeling file, ``<Family>DynamicCache(config)``: four lists indexed by layer, ``conv_states``
and ``recurrent_states`` (None on attention layers), ``key_cache`` and ``value_cache`` (None on
linear-attention layers), and ``has_previous_state`` true once the last linear layer holds a
conv state. This adapter fills such a cache from explicit tensors and reads it back;
families with another cache class there (lfm2's ``Lfm2HybridConvCache``, bamba's
preallocated ``HybridMambaAttentionDynamicCache``) are refused by name.

One export blocker of those releases is routed around: ``_update_linear_attn_mask`` tests
``cache_position[0] > 0``, a branch on a tensor's value that torch.export cannot trace. With
no attention mask (DecodeStep passes none) both of its branches return None, so while the step
runs it is replaced by a function that returns the mask it is given when that mask is None.
"""

from __future__ import annotations

import sys
from typing import Any, Optional, Sequence

from torch import Tensor, nn

from gdn_fx.errors import UnsupportedModel
from gdn_fx.hf import compat

# kind -> the list that holds it, in the order a layer's states are listed
TABLES = (("conv", "conv_states"), ("recurrent", "recurrent_states"),
          ("key", "key_cache"), ("value", "value_cache"))
MASK_METHOD = "_update_linear_attn_mask"


def _classes(model: nn.Module) -> list[type]:
    module = sys.modules[type(model).__module__]
    return [value for name, value in vars(module).items() if isinstance(value, type)
            and name.endswith("DynamicCache") and value.__module__ == module.__name__]


def _has_lists(cache: Any, layers: int) -> bool:
    return all(isinstance(getattr(cache, table, None), list) and
               len(getattr(cache, table)) == layers for _, table in TABLES)


def new_cache(model: nn.Module) -> Any:
    """An empty cache of the class ``model``'s own forward would build (module doc)."""
    layers = model.config.get_text_config(decoder=True).num_hidden_layers
    for cls in _classes(model):
        try:
            cache = cls(model.config)
        except TypeError:  # another constructor: another layout
            continue
        if _has_lists(cache, layers):
            return cache
    raise UnsupportedModel(
        f"{type(model).__name__} in transformers {compat.VERSION} keeps its cache in a class "
        "without per-layer conv_states / recurrent_states / key_cache / value_cache lists; "
        "DecodeStep passes explicit states there only for Qwen3-Next-style caches (use "
        "transformers >= 5.5 for this family)")


def entries(cache: Any) -> list[list[tuple[str, None, Tensor]]]:
    """Per layer, (kind, None, tensor) of every state the cache holds (one per kind: no
    slots)."""
    layers = len(cache.conv_states)
    return [[(kind, None, getattr(cache, table)[i]) for kind, table in TABLES
             if isinstance(getattr(cache, table)[i], Tensor)] for i in range(layers)]


def _table(kind: str) -> str:
    return dict(TABLES)[kind]


class FamilyListsAdapter:
    """A family's own ``<Family>DynamicCache`` of per-layer lists (gdn_fx.hf.caches)."""

    def new(self, model: nn.Module) -> Any:
        return new_cache(model)

    def entries(self, cache: Any) -> list[list[tuple[str, None, Tensor]]]:
        return entries(cache)

    def filled(self, model: nn.Module, specs: Sequence, tensors: Sequence[Tensor], *,
               linear_class: Optional[type] = None, whole_windows: bool = False,
               forget_linear: bool = False) -> Any:
        """A fresh cache holding ``tensors`` (used as given) where ``specs`` say. The
        options of the layered adapter do not apply: these releases have no layer classes,
        and no family they hold limits dt in its first prompt only."""
        cache = new_cache(model)
        for spec, tensor in zip(specs, tensors):
            getattr(cache, _table(spec.kind))[spec.layer] = tensor
        return cache

    def read(self, cache: Any, specs: Sequence) -> list[Tensor]:
        return [getattr(cache, _table(spec.kind))[spec.layer] for spec in specs]

    def step_swaps(self, model: nn.Module) -> list:
        """The export blocker of these releases, routed around (module docstring)."""
        return mask_swaps(model)


ADAPTER = FamilyListsAdapter()


def mask_swaps(model: nn.Module) -> list[tuple[Any, str, Any]]:
    """(instance, name, replacement) for every ``_update_linear_attn_mask`` of ``model``."""
    swaps = []
    for sub in model.modules():
        original = getattr(sub, MASK_METHOD, None)
        if callable(original):
            swaps.append((sub, MASK_METHOD, _without_value_branch(original)))
    return swaps


def _without_value_branch(original):
    def update_linear_attn_mask(attention_mask: Optional[Tensor], cache_position: Tensor):
        if attention_mask is None:  # what both branches of the original return then
            return None
        return original(attention_mask, cache_position)

    return update_linear_attn_mask
