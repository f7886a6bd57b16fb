"""Drop-ins for transformers' Mamba2 and Mamba1 scans, through ``gdn_fx::gated_linear_scan``.

From transformers 5.15 the six Mamba2 families (mamba2, bamba, granitemoehybrid, nemotron_h,
falcon_h1, zamba2) call the same two module-level functions of their modeling file: the
chunked SSD ``mamba2_chunk_scan`` (any S, padded to whole chunks inside) and the one-token
``mamba2_selective_state_update`` (decode on a warm cache). :func:`gdn_fx.hf.reify` swaps
both for these, which keep transformers' signatures and compute the same function as ONE
scan op, so a reified model exports with a symbolic S and no padding guard. From 5.25 the
Mamba1 families (mamba, falcon_mamba, jamba) call ``mamba_scan_forward`` with their cache,
which :func:`mamba_scan_forward` replaces.

The SSD in the op's terms (docs/recognition.md, "gated linear recurrences"): per head h,
``S_t = exp(dt_t A_h) S_{t-1} + B_t (dt_t x_t)^T`` and ``y_t = S_t^T C_t``; so k = B, q = C
(n_groups key heads, ``repeat_interleave``d as the op's value-head groups), v = dt x, the log
decay g = dt A, scale 1. transformers keeps the state value-first ``[B, H, P, N]``; the op
key-first ``[B, H, N, P]``. dt's bias, softplus and limits and the D skip stay ordinary ops
outside the scan, written as transformers writes them.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import gdn_fx.ops  # noqa: F401  (registers torch.ops.gdn_fx.*)

LINEAR = torch.ops.gdn_fx.gated_linear_scan
# (chunk form, one-token form): the names a Mamba2 modeling file defines (transformers 5.15+)
MAMBA2_NAMES = ("mamba2_chunk_scan", "mamba2_selective_state_update")
# the function a Mamba1 mixer calls with its cache (transformers 5.25)
MAMBA1_NAME = "mamba_scan_forward"
# the per-call scan it wraps, which Zamba v1's mixer calls per head without the cached state
STATELESS_SCAN = "mamba_selective_scan"


def _time_step(dt: Tensor, dt_bias: Optional[Tensor], dt_softplus: bool) -> Tensor:
    """dt as transformers prepares it, before any clamp."""
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)
    return F.softplus(dt) if dt_softplus else dt


class _Past:
    """The cached length of the step in flight (``DecodeStep`` sets it: an int, or the
    symbolic P of an export), None outside one."""

    length = None


PAST = _Past()


@contextlib.contextmanager
def past_length(length) -> Iterator[None]:
    """Within the block, a warm cache means ``length > 0`` (a DecodeStep's states are given
    even for a first prompt, as zeros at P = 0)."""
    PAST.length = length
    try:
        yield
    finally:
        PAST.length = None


def recurrent_mixers(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` holding transformers' ``A_log`` (a Mamba mixer, or a delta
    rule's layer): the ones that carry a recurrent state."""
    return [m for m in model.modules() if isinstance(getattr(m, "A_log", None), Tensor)]


def limits_dt(model: nn.Module) -> bool:
    """Whether some Mamba2 mixer of ``model`` limits dt in prefill (Zamba2's time_step_min),
    which its one-token step does not: then a first prompt of one token and a step on a warm
    cache compute different functions."""
    return any(tuple(getattr(m, "time_step_limit", ())) not in ((), (0.0, float("inf")))
               for m in model.modules())


def _limited(dt: Tensor, dt_limit: tuple[float, float], length, warm: bool) -> Tensor:
    """dt within ``dt_limit``, except for one token on a warm cache.

    transformers' ``mamba2_scan_forward`` runs ONE token on a cached state through
    ``mamba2_selective_state_update``, which takes no limit (Zamba2's ``time_step_min`` holds
    in prefill only), and everything else, a first prompt of one token included, through
    the chunk scan. Under a symbolic S (and P) that branch was decided for the chunk scan, so
    here the one-token case is put back as a select; a Python branch on numbers."""
    limited = torch.clamp(dt, min=dt_limit[0], max=dt_limit[1])
    past = PAST.length
    if not warm or (isinstance(past, int) and past == 0):
        return limited
    if isinstance(length, int) and (past is None or isinstance(past, int)):
        return dt if length == 1 else limited
    step = ~(torch.arange(length, device=dt.device) > 0).any()  # S == 1, as a tensor
    if past is not None and not isinstance(past, int):
        step = step & (torch.arange(past + 1, device=dt.device) > 0).any()  # and P > 0
    return torch.where(step, dt, limited)


def chunk_scan(hidden_states: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor,
               chunk_size: int, D: Optional[Tensor] = None, dt_bias: Optional[Tensor] = None,
               initial_states: Optional[Tensor] = None, dt_softplus: bool = False,
               dt_limit: tuple[float, float] = (0.0, float("inf")),
               return_final_states: bool = False, **kwargs):
    """transformers' ``mamba2_chunk_scan`` (x ``[B, T, H, P]``, dt ``[B, T, H]``, A ``[H]``,
    B and C ``[B, T, G, N]``) as one ``gated_linear_scan``; ``chunk_size`` only says how
    transformers would have blocked the same sums."""
    batch, length, heads, head_dim = hidden_states.shape
    dt = _time_step(dt, dt_bias, dt_softplus)
    if not (dt_softplus and dt_limit[0] <= 0 and dt_limit[1] == float("inf")):  # else a no-op
        dt = _limited(dt, dt_limit, length, initial_states is not None)
    dt = dt.float()
    x = hidden_states.float()
    if initial_states is None:
        start = x.new_zeros(batch, heads, B.shape[-1], head_dim)
    else:
        start = initial_states.float().transpose(-1, -2)
    out, final = LINEAR(C.float(), B.float(), x * dt[..., None], A.float() * dt, start,
                        scale=1.0)
    if D is not None:
        out = out + D[..., None] * x
    if return_final_states:
        return out, final.transpose(-1, -2)
    return out


def selective_state_update(state: Tensor, hidden_states: Tensor, dt: Tensor, A: Tensor,
                           B: Tensor, C: Tensor, D: Optional[Tensor] = None,
                           dt_bias: Optional[Tensor] = None, dt_softplus: bool = False,
                           z: Optional[Tensor] = None, **kwargs) -> Tensor:
    """transformers' ``mamba2_selective_state_update`` (one token: x, dt ``[B, H, P]``, A
    ``[H, P, N]``, B and C ``[B, G, N]``, ``state [B, H, P, N]`` written in place) as one
    ``gated_linear_scan`` step.

    transformers hands dt, A, D and dt_bias expanded along P, and nothing says the expanded
    values are equal, so each (head, p) pair is a value head of its own (Dv = 1) with a
    decay per state entry (A's N axis): the op's general form, whatever the caller passes."""
    batch, heads, head_dim = hidden_states.shape
    groups, size = B.shape[1], B.shape[-1]
    dt = _time_step(dt, dt_bias, dt_softplus).float()  # [B, H, P]
    x = hidden_states.float()
    v = (x * dt).reshape(batch, 1, heads * head_dim, 1)
    g = (dt[..., None] * A.float()).reshape(batch, 1, heads * head_dim, size)
    k = B.float().reshape(batch, 1, groups, size)
    q = C.float().reshape(batch, 1, groups, size)
    start = state.float().reshape(batch, heads * head_dim, size, 1)
    out, final = LINEAR(q, k, v, g, start, scale=1.0)
    state.copy_(final.reshape(state.shape).to(state.dtype))  # transformers' callers expect it
    out = out.reshape(batch, heads, head_dim)
    if D is not None:
        out = out + x * D
    if z is not None:
        out = out * F.silu(z)
    return out.to(hidden_states.dtype)


def mamba_scan_forward(module: nn.Module, hidden_states: Tensor, time_step: Tensor, B: Tensor,
                       C: Tensor, gate: Tensor, cache, **kwargs) -> Tensor:
    """transformers' ``mamba_scan_forward`` of the Mamba1 families (mamba, falcon_mamba,
    jamba; 5.25), x, time_step and gate ``[b, D, T]``, B and C ``[b, T, N]``, as one
    ``gated_linear_scan`` from the cached state.

    The state ``[b, D, N]`` is the op's ``[b, H = D, Dk = N, Dv = 1]``: k = B and q = C, one
    key head shared by every channel; v = dt x; a log decay dt A per (channel, state entry).
    transformers' own multi-token branch starts from zeros even on a warm cache (its
    ``TODO ... it is WRONG if the cache is not empty``); this one continues the cached state,
    as its one-token branch does: the recurrence, at every S."""
    state = cache.get_recurrent_state(module.layer_idx, state_idx=0) if cache is not None \
        else None
    A = -torch.exp(module.A_log.float())  # [D, N]
    bias = module.dt_proj.bias
    dt = time_step if bias is None else time_step + bias.to(time_step.dtype)[..., None]
    dt = F.softplus(dt).float().transpose(1, 2)  # [b, T, D]
    x = hidden_states.float().transpose(1, 2)
    batch, _, channels = x.shape
    start = (state.float() if state is not None
             else x.new_zeros(batch, channels, A.shape[-1])).unsqueeze(-1)
    out, final = LINEAR(C.float()[:, :, None], B.float()[:, :, None], (dt * x)[..., None],
                        dt[..., None] * A, start, scale=1.0)
    y = out[..., 0].transpose(1, 2) + hidden_states * module.D.float()[None, :, None]
    y = y * F.silu(gate)
    if cache is not None:
        kept = state.dtype if state is not None else torch.float32
        cache.update_recurrent_state(final[..., 0].to(kept), module.layer_idx)
    return y
