"""Swapping the functions transformers' hybrid layers call by global name.

transformers' linear-attention layers call module-level functions of their modeling file
(``torch_recurrent_gated_delta_rule``, ``causal_conv1d_update``, ...): without the ``kernels``
package nothing routes them per layer, so the only way to change what a layer runs is to swap
the module global. Everything here does that reversibly, and marks what it installs so that two
helpers (a :class:`~gdn_fx.hf.decode.DecodeStep` around a reified model) never stack twice.

The prefill-with-state conv path needs one more trick. HF writes it as
``full = cache.update_conv_state(x)`` (= cat(state, x), state written) followed by
``causal_conv1d_fn(full)`` (a padded conv over the concatenation). To run it as one
``causal_conv1d_update(x, state)`` instead, a :class:`DeferringLinearAttentionLayer` returns
``full`` WITHOUT writing the state and leaves a note in :data:`PENDING`; a conv function that
knows the note (a "consumer") then calls the update function, which writes the state.
"""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn

from gdn_fx.errors import PatchError
from gdn_fx.hf import compat
from gdn_fx.hf.rule_kinds import KINDS
from gdn_fx.hf.ssm_dropins import MAMBA1_NAME, MAMBA2_NAMES

# family name -> (recurrent, chunk) function names, read off the one record per family
RULE_NAMES = {name: kind.names for name, kind in KINDS.items()}
CONV_UPDATE, CONV_FN = "causal_conv1d_update", "causal_conv1d_fn"
ROLE = "__gdn_fx_role__"  # attribute marking a function gdn-fx installed
ORIGINAL = "__gdn_fx_original__"  # the transformers function it stands in for


@dataclass(frozen=True)
class ModelingModule:
    """A transformers modeling file a model's layers come from, and what it defines."""

    module: types.ModuleType
    rule_kind: Optional[str]  # a name in rule_kinds.KINDS, or None (no delta rule: lfm2, mamba2)
    has_conv: bool
    # "mamba2" or "mamba1": the file defines transformers' Mamba2 scans or Mamba1's scan
    # forward (ssm_dropins.MAMBA2_NAMES, MAMBA1_NAME), which reify swaps; None otherwise
    ssm: Optional[str] = None

    @property
    def name(self) -> str:
        return self.module.__name__


def modeling_modules(model: nn.Module) -> list[ModelingModule]:
    """The modeling files of ``model``'s submodules that define delta rules, Mamba scans or
    conv functions."""
    found: dict[str, ModelingModule] = {}
    for sub in model.modules():
        name = type(sub).__module__
        if name in found or not name.startswith("transformers.models."):
            continue
        module = sys.modules[name]
        kind = next((k for k, names in RULE_NAMES.items()
                     if all(hasattr(module, n) for n in names)), None)
        # Before 5.15 these names can be None (optional kernels not installed): not functions.
        conv = callable(getattr(module, CONV_UPDATE, None)) and callable(getattr(module, CONV_FN,
                                                                                 None))
        ssm = ("mamba2" if all(callable(getattr(module, n, None)) for n in MAMBA2_NAMES)
               else "mamba1" if callable(getattr(module, MAMBA1_NAME, None)) else None)
        if kind is not None or conv or ssm:
            found[name] = ModelingModule(module, kind, conv, ssm)
    return list(found.values())


def role(fn: Any) -> Optional[str]:
    """The gdn-fx role of an installed function, or None for anything else."""
    return getattr(fn, ROLE, None)


def original(fn: Callable) -> Callable:
    """The transformers function behind ``fn`` (``fn`` itself if gdn-fx did not install it)."""
    return getattr(fn, ORIGINAL, fn)


def mark(fn: Callable, fn_role: str, stands_for: Callable) -> Callable:
    """Tag ``fn`` with its role and the transformers function it replaces."""
    setattr(fn, ROLE, fn_role)
    setattr(fn, ORIGINAL, original(stands_for))
    return fn


class Patches:
    """Attribute swaps applied together and undone together, in reverse order."""

    def __init__(self, swaps: list[tuple[Any, str, Any]]):
        self.swaps = swaps
        self._saved: list[tuple[Any, str, Any, Any]] = []

    def apply(self) -> "Patches":
        if self._saved:
            raise PatchError("these patches are already applied")
        for target, name, value in self.swaps:
            self._saved.append((target, name, getattr(target, name), value))
            setattr(target, name, value)
        return self

    def undo(self) -> None:
        """Restore every swapped attribute; refuse if someone swapped it again since."""
        for target, name, old, value in reversed(self._saved):
            if getattr(target, name) is not value:
                raise PatchError(f"cannot undo the swap of {_where(target)}.{name}: it was "
                                   "swapped again since; undo patches in reverse order")
            setattr(target, name, old)
        self._saved = []

    def __enter__(self) -> "Patches":
        return self.apply()

    def __exit__(self, *exc) -> None:
        self.undo()


def _where(target: Any) -> str:
    return getattr(target, "__name__", type(target).__name__)


class _Pending:
    """The prefill-with-state conv call in flight: (concatenation, state, new samples)."""

    entry: Optional[tuple[Tensor, Tensor, Tensor]] = None


PENDING = _Pending()


class DeferringLinearAttentionLayer(*compat.LINEAR_BASES):  # type: ignore[misc]
    """A LinearAttentionLayer whose prefill-with-state conv update leaves the state write to
    the conv function (a consumer of :data:`PENDING`), so it can run as one conv update.

    Used only where the layers call module-level conv functions (transformers >= 5.15, whose
    layers hold ``number_of_states`` slots); older releases never install a consumer."""

    def update_conv_state(self, conv_states: Tensor, state_idx: int = 0,
                          conv_kernel_size: Optional[int] = None, **kwargs) -> Tensor:
        if not self.has_previous_state[state_idx] or self.record_past:
            return super().update_conv_state(conv_states, state_idx,
                                             conv_kernel_size=conv_kernel_size, **kwargs)
        state = self.conv_states[state_idx]
        full = torch.cat([state, conv_states], dim=-1)
        PENDING.entry = (full, state, conv_states)
        compat.count_tokens(self, state_idx, conv_states.shape[-1])  # as super()'s would (5.25)
        return full


def take_pending(hidden_states: Tensor) -> Optional[tuple[Tensor, Tensor]]:
    """(state, new samples) if ``hidden_states`` is the deferred concatenation, else None."""
    entry = PENDING.entry
    if entry is None or entry[0] is not hidden_states:
        return None
    PENDING.entry = None
    return entry[1], entry[2]


def conv_consumer(update: Callable, fallback: Callable, head: Callable, fn_role: str,
                  stands_for: Callable) -> Callable:
    """A ``causal_conv1d_fn`` stand-in that runs a deferred prefill-with-state conv through
    ``update(x, state, ...)`` (which must write the state) and anything else through
    ``fallback``. ``head`` (HF's conv fn) recomputes the first K outputs of the concatenation,
    so the result equals HF's even for a caller that does not slice it."""

    def causal_conv1d_fn(hidden_states: Tensor, weight: Tensor, bias: Optional[Tensor] = None,
                         activation: Optional[str] = None, **kwargs) -> Tensor:
        taken = take_pending(hidden_states)
        if taken is None:
            return fallback(hidden_states, weight, bias, activation=activation, **kwargs)
        state, x = taken
        first = head(state, weight, bias, activation=activation)  # before the state changes
        out = update(x, state, weight, bias, activation)
        return torch.cat([first, out], dim=-1)

    return mark(causal_conv1d_fn, fn_role, stands_for)


def is_consumer(fn: Callable) -> bool:
    """Whether a ``causal_conv1d_fn`` stand-in consumes deferred conv updates."""
    return role(fn) in ("conv-fn-recurrent", "conv-fn-reified")


def chunk_as_recurrent(recurrent: Callable, stands_for: Callable) -> Callable:
    """A chunk-rule stand-in that runs the (per-token) recurrent rule instead."""

    def chunk_rule(query, key, value, g, beta, chunk_size: int = 64, initial_state=None,
                   output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
                   **kwargs):
        return recurrent(query, key, value, g=g, beta=beta, initial_state=initial_state,
                         output_final_state=output_final_state,
                         use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, **kwargs)

    return mark(chunk_rule, "chunk-as-recurrent", stands_for)


def recurrent_swaps(modules: list[ModelingModule]) -> list[tuple[Any, str, Any]]:
    """Swaps making every multi-token step take the recurrent rule and the conv update."""
    swaps = []
    for m in modules:
        if m.rule_kind is not None:
            rec_name, chunk_name = KINDS[m.rule_kind].names
            chunk = getattr(m.module, chunk_name)
            if role(chunk) is None:  # a reified chunk rule is already the per-token scan
                swaps.append((m.module, chunk_name,
                              chunk_as_recurrent(getattr(m.module, rec_name), chunk)))
        if m.has_conv and not is_consumer(getattr(m.module, CONV_FN)):
            fn = getattr(m.module, CONV_FN)
            update = getattr(m.module, CONV_UPDATE)
            swaps.append((m.module, CONV_FN,
                          conv_consumer(update, fn, original(fn), "conv-fn-recurrent", fn)))
    return swaps
