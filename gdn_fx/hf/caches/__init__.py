"""Reading and writing a transformers cache: one adapter per cache layout.

Everything else in ``gdn_fx.hf`` asks the adapter of the installed release
(:func:`adapter`) and never touches a cache's attributes itself:

- ``layers.py``: ``DynamicCache`` and its layers (transformers 5.5 and later):
  linear-attention layers (conv and recurrent states, one or several slots), attention layers
  (keys, values, a sparse indexer's keys), the hybrid layers that hold both (Falcon-H1,
  Zamba2) and sliding-window layers;
- ``family_lists.py``: the per-family cache classes of releases before 5.5, four lists indexed
  by layer (Qwen3-Next's and its copies; other classes are refused by name).

An adapter answers five questions: an empty cache for a model (:meth:`new`); what a cache
holds, per layer, as ``(kind, slot, tensor)`` (:meth:`entries`); a fresh cache holding given
tensors where the specs say (:meth:`filled`); the tensors a cache holds now, in spec order
(:meth:`read`); and the patches a step needs while it runs on such a cache
(:meth:`step_swaps`). A new layout is a new module with these methods, chosen in
:func:`adapter`.
"""

from __future__ import annotations

from typing import Any, Optional, Protocol, Sequence

from torch import Tensor, nn

from gdn_fx.hf import compat

# (kind, slot, tensor): kind is one of states.KINDS; slot the state index inside a
# linear-attention layer (0 for attention tensors, None where a layer holds one per kind)
Entry = tuple[str, Optional[int], Tensor]


class CacheAdapter(Protocol):
    """How gdn-fx reads and writes one cache layout (the module docstring)."""

    def new(self, model: nn.Module) -> Any:
        """An empty cache of the class ``model``'s forward fills."""

    def entries(self, cache: Any) -> list[list[Entry]]:
        """Per layer, ``(kind, slot, tensor)`` of every tensor ``cache`` holds."""

    def filled(self, model: nn.Module, specs: Sequence, tensors: Sequence[Tensor], *,
               linear_class: Optional[type] = None, whole_windows: bool = False,
               forget_linear: bool = False) -> Any:
        """A fresh cache holding ``tensors`` (used as given) where ``specs`` say; the options
        are the layered adapter's (``layers.LayersAdapter.filled``)."""

    def read(self, cache: Any, specs: Sequence) -> list[Tensor]:
        """The tensors ``cache`` holds now, in ``specs`` order."""

    def step_swaps(self, model: nn.Module) -> list:
        """(instance, name, replacement) patches a step needs while it runs on such a cache."""


def adapter() -> CacheAdapter:
    """The adapter of the installed release: found by feature (``LinearAttentionLayer``)."""
    if compat.LINEAR_LAYER is None:
        from gdn_fx.hf.caches import family_lists
        return family_lists.ADAPTER
    from gdn_fx.hf.caches import layers
    return layers.ADAPTER


def new_cache(model: nn.Module) -> Any:
    """An empty cache of the kind ``model``'s forward fills (the installed release's)."""
    return adapter().new(model)


def read_cache(cache: Any, specs: Sequence) -> list[Tensor]:
    """The tensors ``cache`` holds now, in ``specs`` order."""
    return adapter().read(cache, specs)
