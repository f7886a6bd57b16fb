"""reify: run a transformers hybrid's linear-attention layers through the gdn-fx ops.

The capture-before-trace path. :func:`reify` swaps, in each modeling file the model's layers
come from, the recurrent AND chunk delta rules, the Mamba scans (``ssm_dropins.py``),
``causal_conv1d_update`` and ``causal_conv1d_fn`` for drop-ins with transformers' call
signatures and eager math, which call ``torch.ops.gdn_fx.gated_delta_scan`` /
``gated_linear_scan`` / ``causal_conv1d_update``. A reified model exports with a
dynamic sequence axis (the per-token Python loop is gone) and its graph holds one fused node per
layer from the start.

Module globals are swapped: while reified, EVERY model of the same family runs the drop-ins
(they compute the same function, so other models stay correct). Undo with the returned
handle, or use it as a context manager.
"""

from __future__ import annotations

import functools
import sys
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn

import gdn_fx.ops  # noqa: F401  (registers torch.ops.gdn_fx.*)
from gdn_fx.errors import UnsupportedModel
from gdn_fx.hf import compat, patching, ssm_dropins
from gdn_fx.hf.patching import CONV_FN, CONV_UPDATE, ModelingModule
from gdn_fx.hf.rule_kinds import kind_named

SCAN = torch.ops.gdn_fx.gated_delta_scan
CONV = torch.ops.gdn_fx.causal_conv1d_update
# transformers' ACT2FN names that mean SiLU, the only activation the conv op knows.
SILU_NAMES = ("silu", "swish")


def _activation(name: Optional[str]) -> Optional[str]:
    if name is None:
        return None
    if name in SILU_NAMES:
        return "silu"
    raise UnsupportedModel(f"causal conv activation {name!r}: the conv op supports None or "
                           "'silu' only")


def conv_update(hidden_states: Tensor, conv_state: Tensor, weight: Tensor,
                bias: Optional[Tensor] = None, activation: Optional[str] = None) -> Tensor:
    """HF ``causal_conv1d_update`` through the op: same result, ``conv_state`` written in place."""
    out, new_state = CONV(hidden_states, conv_state, weight, bias, _activation(activation))
    conv_state.copy_(new_state)  # the op is functional; HF's callers expect the write
    return out


def conv_fn(hidden_states: Tensor, weight: Tensor, bias: Optional[Tensor] = None,
            activation: Optional[str] = None, **kwargs) -> Tensor:
    """HF ``causal_conv1d_fn`` (zero-padded causal conv) as a conv update from a zero state."""
    batch, channels, _ = hidden_states.shape
    zeros = hidden_states.new_zeros(batch, channels, weight.shape[-1])
    out, _ = CONV(hidden_states, zeros, weight, bias, _activation(activation))
    return out


def _no_packing(kwargs: dict) -> None:
    if kwargs.get("cu_seqlens") is not None:
        raise UnsupportedModel("packed sequences (cu_seqlens) are not supported by reify")


def _initial_state(initial_state: Optional[Tensor], key: Tensor, value: Tensor) -> Tensor:
    """The f32 state HF starts from (``initial_state.to(f32)`` or zeros)."""
    if initial_state is not None:
        return initial_state.to(torch.float32)
    batch, _, _, dk = key.shape
    return value.new_zeros(batch, value.shape[2], dk, value.shape[3], dtype=torch.float32)


def _exact_operands(kind: str, l2norm: Callable, use_l2norm: bool,
                    operands: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    """q, k, v, g, beta prepared as transformers' f32 RECURRENT rule of ``kind`` prepares them
    (its own l2norm, its own q scaling), so the scan op reproduces it bit for bit.

    Memory layout matters for the last bit: the GDN rule works on dense head-major copies,
    which dense sequence-major copies reproduce; the KDA rule works on the layer's views as
    they come, which the op then sees unchanged.
    """
    family = kind_named(kind)
    q, k, v, g, beta = (x.to(torch.float32) for x in operands)
    if family.dense_operands:
        q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    if use_l2norm:
        q, k = l2norm(q, dim=-1, eps=1e-6), l2norm(k, dim=-1, eps=1e-6)
    if family.divides_q:
        return q / (q.shape[-1] ** 0.5), k, v, g, beta
    return q * (1 / (q.shape[-1] ** 0.5)), k, v, g, beta


def make_rule(module: Any, kind: str, form: str, exact: bool) -> Callable:
    """A drop-in for one of ``module``'s delta rules (``form`` "recurrent" or "chunk").

    Both forms compute the exact per-token recurrence (the op). Canonical mode hands raw q/k
    to the op with ``qk_l2norm`` and ``scale = Dk**-0.5`` (the fused form lowering wants).
    ``exact`` mode normalizes and scales q/k outside the op with the family's own formulas
    (``qk_l2norm=False, scale=1``): in f32 it reproduces transformers' RECURRENT rule bit for
    bit (the chunk rule itself differs from it by rounding).
    """
    kind_named(kind)  # an unknown family fails here, not at the first call

    def run(query, key, value, g, beta, initial_state, output_final_state, use_l2norm, kwargs):
        _no_packing(kwargs)
        s0 = _initial_state(initial_state, key, value)
        if exact:
            ops = _exact_operands(kind, module.l2norm, use_l2norm, (query, key, value, g, beta))
            out, final = SCAN(*ops, s0, scale=1.0, qk_l2norm=False)
        else:
            out, final = SCAN(query, key, value, g, beta, s0, scale=key.shape[-1] ** -0.5,
                              qk_l2norm=bool(use_l2norm))
        return out.to(query.dtype), final if output_final_state else None

    # The two signatures below are transformers' (recurrent and chunk rules, GDN and KDA).
    def recurrent_rule(query, key, value, g, beta, initial_state=None, output_final_state=False,
                       use_qk_l2norm_in_kernel=False, **kwargs):
        return run(query, key, value, g, beta, initial_state, output_final_state,
                   use_qk_l2norm_in_kernel, kwargs)

    def chunk_rule(query, key, value, g, beta, chunk_size=64, initial_state=None,
                   output_final_state=False, use_qk_l2norm_in_kernel=False, **kwargs):
        return run(query, key, value, g, beta, initial_state, output_final_state,
                   use_qk_l2norm_in_kernel, kwargs)

    return recurrent_rule if form == "recurrent" else chunk_rule


def _rule_swaps(m: ModelingModule, exact: bool) -> list[tuple[Any, str, Any]]:
    if m.rule_kind is None:
        return []
    swaps = []
    for form, name in zip(("recurrent", "chunk"), kind_named(m.rule_kind).names):
        current = getattr(m.module, name)
        if patching.role(current) is None:
            rule = make_rule(m.module, m.rule_kind, form, exact)
            swaps.append((m.module, name, patching.mark(rule, "reified-rule", current)))
    return swaps


def _ssm_swaps(m: ModelingModule) -> list[tuple[Any, str, Any]]:
    """The Mamba2 scans, or Mamba1's scan forward, of a modeling file (ssm_dropins.py)."""
    chunk, step = ssm_dropins.MAMBA2_NAMES
    drop_ins = {"mamba2": ((chunk, ssm_dropins.chunk_scan),
                           (step, ssm_dropins.selective_state_update)),
                "mamba1": ((ssm_dropins.MAMBA1_NAME, ssm_dropins.mamba_scan_forward),)}
    return [(m.module, name, patching.mark(_copy(fn), "reified-ssm", getattr(m.module, name)))
            for name, fn in drop_ins.get(m.ssm, ())
            if patching.role(getattr(m.module, name)) is None]


def _conv_swaps(m: ModelingModule) -> list[tuple[Any, str, Any]]:
    if not m.has_conv or patching.role(getattr(m.module, CONV_UPDATE)) is not None:
        return []
    hf_update, hf_fn = getattr(m.module, CONV_UPDATE), getattr(m.module, CONV_FN)
    update = patching.mark(_copy(conv_update), "reified-conv", hf_update)
    consumer = patching.conv_consumer(update, conv_fn, patching.original(hf_fn),
                                      "conv-fn-reified", hf_fn)
    return [(m.module, CONV_UPDATE, update), (m.module, CONV_FN, consumer)]


def _require_ssm_functions(model: nn.Module, modules: list[ModelingModule]) -> None:
    """Refuse a model with recurrent mixers (transformers' ``A_log``: Mamba's, or a delta
    rule's) whose modeling file has no scan function to swap: its scan would stay a
    per-token loop or a padded SSD."""
    swapped = {m.name for m in modules if m.ssm or m.rule_kind is not None}
    for sub in ssm_dropins.recurrent_mixers(model):
        if type(sub).__module__ not in swapped:
            raise UnsupportedModel(
                f"{type(sub).__name__} in transformers {compat.VERSION} calls no module-level "
                "scan that reify can swap (Mamba2's mamba2_chunk_scan from 5.15, Mamba1's "
                "mamba_scan_forward from 5.25): its scan cannot follow a symbolic S"
                + _stateless_scan(type(sub).__module__))


def _stateless_scan(module_name: str) -> str:
    """Why a Mamba1 file's own ``mamba_selective_scan`` is no such scan (Zamba v1 calls it per
    head, from the mixer's forward): a drop-in of it would not know the state to continue."""
    if not callable(getattr(sys.modules.get(module_name), ssm_dropins.STATELESS_SCAN, None)):
        return ""
    return (f"; its {ssm_dropins.STATELESS_SCAN} is handed no cached state (several tokens "
            "start from zeros, one token goes to mamba_selective_state_update), so a drop-in "
            "of it could not continue a cache")


def _copy(fn: Callable) -> Callable:
    """A distinct function object calling ``fn`` (each swap carries its own markers)."""
    return functools.wraps(fn)(lambda *args, **kwargs: fn(*args, **kwargs))


class Reified:
    """Handle of a :func:`reify`: ``undo()`` restores transformers' functions; also a context
    manager (``with reify(model): ...``)."""

    def __init__(self, modules: list[ModelingModule], patches: patching.Patches):
        self.modules = modules
        self.patches = patches

    @property
    def module_names(self) -> list[str]:
        """The modeling files whose functions were swapped."""
        return [m.name for m in self.modules]

    def undo(self) -> None:
        """Put transformers' own functions back."""
        self.patches.undo()

    def __enter__(self) -> "Reified":
        return self

    def __exit__(self, *exc) -> None:
        self.undo()


def reify(model: nn.Module, *, exact: bool = False, conv: bool = True) -> Reified:
    """Swap ``model``'s delta rules, Mamba scans and conv functions for gdn-fx op drop-ins
    (see module doc).

    ``exact=True`` keeps q/k normalization and scaling outside the scan op, in transformers'
    own formulas, so the reified rules reproduce transformers' f32 recurrent rule bit for bit;
    the default hands them to the op (``qk_l2norm=True``), the form the native lowering needs.
    ``conv=False`` leaves the conv functions alone (only the delta rules are swapped).
    """
    compat.require_module_kernels(model, "reify")
    modules = patching.modeling_modules(model)
    _require_ssm_functions(model, modules)
    if not any(m.rule_kind is not None or m.has_conv or m.ssm for m in modules):
        raise UnsupportedModel(f"{type(model).__name__}: no linear-attention, Mamba or conv "
                               "layers found in its modeling files")
    swaps = [s for m in modules for s in (*_rule_swaps(m, exact), *_ssm_swaps(m),
                                          *(_conv_swaps(m) if conv else []))]
    return Reified(modules, patching.Patches(swaps).apply())
