"""Small differentiable oracles for GDN / KDA and the causal conv1d update.

Plain torch, independent of FLA and Triton; written for clarity and gradients, not speed.
Gates are natural logs of the per-step decay. Arithmetic runs in the inputs' own dtype (use
float64 for algebra tests); nothing here casts behind the caller's back.

Layouts (sequence-major, as in HF, FLA and tract):
    q, k  [B, T, Hk, Dk]      v [B, T, Hv, Dv], Hv = G * Hk (value head h reads key head h // G)
    g     [B, T, Hv] (GDN, one decay per head) or [B, T, Hv, Dk] (KDA, one decay per key channel)
    beta  [B, T, Hv]          state [N, Hv, Dk, Dv] (key-first) or [N, Hv, Dv, Dk] (state_v_first)
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor

E4M3_MAX = 448.0  # largest finite float8_e4m3fn value


def l2norm(x: Tensor, eps: float = 1e-6, dim: int = -1) -> Tensor:
    """``x * rsqrt(sum(x*x) + eps)`` over ``dim``: HF's ``use_qk_l2norm_in_kernel`` normalization."""
    return x * torch.rsqrt((x * x).sum(dim=dim, keepdim=True) + eps)


def _segments(total: int, cu_seqlens: Optional[Tensor]) -> list[tuple[int, int]]:
    """(start, end) of each packed sequence; the whole axis when cu_seqlens is None."""
    if cu_seqlens is None:
        return [(0, total)]
    bounds = [int(b) for b in cu_seqlens.detach().cpu().tolist()]  # read on the CPU, by design
    if bounds[0] != 0 or bounds[-1] != total or any(b > a for a, b in zip(bounds[1:], bounds)):
        raise ValueError(f"cu_seqlens {bounds} must rise from 0 to T={total}")
    return list(zip(bounds[:-1], bounds[1:]))


def _prepare(q, k, v, g, beta, scale, initial_state, cu_seqlens, state_v_first):
    """Shared argument handling: expand GQA and GDN gates, pick the initial states."""
    b, _, hk, dk = q.shape
    hv, dv = v.shape[2], v.shape[3]
    if hv % hk:
        raise ValueError(f"value heads {hv} must be a multiple of key heads {hk}")
    if cu_seqlens is not None and b != 1:
        raise ValueError(f"cu_seqlens needs batch 1 (packed sequences), got batch {b}")
    q = q.repeat_interleave(hv // hk, dim=2)
    k = k.repeat_interleave(hv // hk, dim=2)
    if g.dim() == 3:  # GDN: one decay per head, the same for every key channel
        g = g.unsqueeze(-1).expand(*g.shape, dk)
    scale = dk**-0.5 if scale is None else scale
    n = 1 if cu_seqlens is None else cu_seqlens.numel() - 1
    count = b * n if cu_seqlens is None else n
    if initial_state is None:
        s0 = q.new_zeros(count, hv, dk, dv)
    else:
        s0 = initial_state.transpose(-1, -2) if state_v_first else initial_state
    return q * scale, k, v, g, beta, s0


def recurrent_delta_rule_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    scale: Optional[float] = None,
    initial_state: Optional[Tensor] = None,
    cu_seqlens: Optional[Tensor] = None,
    state_v_first: bool = False,
) -> tuple[Tensor, Tensor]:
    """GDN (scalar decay) or KDA (per-key decay) exact token recurrence.

    Per step, with state S [Dk, Dv]: ``S = exp(g_t) * S; delta = beta_t * (v_t - k_t^T S);
    S = S + k_t delta^T; o_t = (scale * q_t)^T S``. ``scale`` defaults to ``Dk ** -0.5``.
    Returns ``(o [B, T, Hv, Dv], final_state)``; the final state has the initial state's layout
    and one entry per sequence (``N = B``, or the number of packed sequences).
    Gradients flow to every input, the initial state included.
    """
    q, k, v, g, beta, s0 = _prepare(q, k, v, g, beta, scale, initial_state, cu_seqlens,
                                    state_v_first)
    outs, finals = [], []
    for seq, (start, end) in enumerate(_segments(q.shape[1], cu_seqlens)):
        state = s0 if cu_seqlens is None else s0[seq:seq + 1]
        for t in range(start, end):
            state = state * g[:, t].exp().unsqueeze(-1)
            kv = (state * k[:, t].unsqueeze(-1)).sum(-2)
            delta = (v[:, t] - kv) * beta[:, t].unsqueeze(-1)
            state = state + k[:, t].unsqueeze(-1) * delta.unsqueeze(-2)
            outs.append((state * q[:, t].unsqueeze(-1)).sum(-2))
        finals.append(state)
    out = torch.stack(outs, dim=1) if outs else v.new_zeros(v.shape)
    final = torch.cat(finals, dim=0)
    return out, final.transpose(-1, -2) if state_v_first else final


def gated_delta_reference(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, s0: Optional[Tensor],
    scale: Optional[float] = None,
) -> tuple[Tensor, Tensor]:
    """The recurrence over time axis 2, head-major: q, k, v ``[B, H, T, D]``, g/beta ``[B, H, T]``.

    For pre-normalized q/k it matches HF's ``torch_recurrent_gated_delta_rule`` (which always
    scales q by ``Dk ** -0.5``, the default here). Returns ``(y [B, H, T, Dv], final state)``.
    """
    def seq_major(x: Tensor) -> Tensor:
        return x.transpose(1, 2)

    out, final = recurrent_delta_rule_reference(
        seq_major(q), seq_major(k), seq_major(v), seq_major(g), seq_major(beta),
        scale=scale, initial_state=s0)
    return out.transpose(1, 2), final


def state_fp8_qdq_reference(state: Tensor, block_v: int = 64) -> Tensor:
    """Dynamic E4M3 quantize-dequantize with one scale per ``[Dk, block_v]`` tile.

    ``state`` is key-first ``[..., Dk, Dv]``; the last value tile may be partial. An all-zero
    tile uses scale one. The gradient is the identity (straight-through): neither the scales
    nor the rounding contribute derivatives.
    """
    dv = state.shape[-1]
    tiles = []
    for start in range(0, dv, block_v):
        tile = state[..., start:start + block_v].detach()
        amax = tile.abs().amax(dim=(-2, -1), keepdim=True)
        scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
        coded = (tile / scale).to(torch.float8_e4m3fn).to(state.dtype)
        tiles.append(coded * scale)
    qdq = torch.cat(tiles, dim=-1) if tiles else state.detach()
    return state + (qdq - state).detach()


def _chunk_terms(q, k, g, beta):
    """Intra-chunk terms of one chunk: cumulative gate, decayed pair products, the UT system."""
    gc = g.cumsum(dim=1)  # [b, c, h, dk], log decay from the chunk start through step t
    c = q.shape[1]
    diff = gc.unsqueeze(2) - gc.unsqueeze(1)  # [b, t, j, h, dk]: log decay from step j to t
    causal = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    decay = diff.masked_fill(~causal[None, :, :, None, None], float("-inf")).exp()
    kk = torch.einsum("bthd,bjhd,btjhd->bhtj", k, k, decay)
    qk = torch.einsum("bthd,bjhd,btjhd->bhtj", q, k, decay)
    strict = torch.ones(c, c, dtype=torch.bool, device=q.device).tril(-1)
    system = kk * beta.permute(0, 2, 1).unsqueeze(-1) * strict
    eye = torch.eye(c, dtype=q.dtype, device=q.device)
    return gc, qk, system + eye


def _chunk_uw(k, v, gc, beta, unit_lower):
    """Solve the unit-lower UT system for U (values) and W (decayed keys), both head-major."""
    def head_major(x):
        return x.permute(0, 2, 1, 3)

    bv = head_major(v * beta.unsqueeze(-1))
    bk = head_major(k * beta.unsqueeze(-1) * gc.exp())
    u = torch.linalg.solve_triangular(unit_lower, bv, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(unit_lower, bk, upper=False, unitriangular=True)
    return u, w


def chunk_gdn_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    chunk_size: int = 64,
    scale: Optional[float] = None,
    initial_state: Optional[Tensor] = None,
    cu_seqlens: Optional[Tensor] = None,
    state_v_first: bool = False,
    state_qdq: bool = False,
    state_qdq_block_v: int = 64,
    w_quantizer: Optional[Callable[[Tensor], Tensor]] = None,
) -> tuple[Tensor, Tensor]:
    """Exact chunk (WY) algebra of the gated delta rule, GDN or KDA gates.

    Per chunk of C steps with cumulative log gate G: ``A = I + strict_lower(beta k k^T * e^(Gi-Gj))``
    is unit lower triangular; ``U = A^-1 (beta v)``, ``W = A^-1 (beta k e^G)``; then
    ``u = U - W S``, ``o = (q e^G) S + causal(q k^T e^(Gi-Gj)) u`` and
    ``S' = e^(G_C) S + (k e^(G_C - G))^T u``.
    ``w_quantizer`` sees the complete materialized W ``[B, T, Hv, Dk]`` once. With
    ``state_qdq``, the initial state and each chunk's final state go through
    :func:`state_fp8_qdq_reference` (after the chunk's readout of the previous state).
    """
    q, k, v, g, beta, s0 = _prepare(q, k, v, g, beta, scale, initial_state, cu_seqlens,
                                    state_v_first)
    chunks = _chunk_bounds(q.shape[1], chunk_size, cu_seqlens)
    solved = [_solve_chunk(q, k, v, g, beta, a, b) for _, a, b in chunks]
    w_all = torch.cat([w.permute(0, 2, 1, 3) for *_, w in solved], dim=1)
    if w_quantizer is not None:
        w_all = w_quantizer(w_all)
    qdq = (lambda s: state_fp8_qdq_reference(s, state_qdq_block_v)) if state_qdq else (lambda s: s)
    outs, finals, state, seq_prev = [], [], None, -1
    for (seq, a, b), (gc, qk, _, u, _) in zip(chunks, solved):
        if seq != seq_prev:
            if state is not None:
                finals.append(state)
            state = qdq(s0 if cu_seqlens is None else s0[seq:seq + 1])
            seq_prev = seq
        w = w_all[:, a:b].permute(0, 2, 1, 3)
        out, state = _chunk_step(q[:, a:b], k[:, a:b], gc, qk, u, w, state)
        state = qdq(state)
        outs.append(out)
    if state is None:  # T == 0: nothing to chunk
        finals.append(qdq(s0))
    else:
        finals.append(state)
    out = torch.cat(outs, dim=1) if outs else v.new_zeros(v.shape)
    final = torch.cat(finals, dim=0)
    return out, final.transpose(-1, -2) if state_v_first else final


def _chunk_bounds(total, chunk_size, cu_seqlens) -> list[tuple[int, int, int]]:
    """(sequence index, start, end) of every chunk; chunks never straddle two sequences."""
    return [(seq, a, min(a + chunk_size, end))
            for seq, (start, end) in enumerate(_segments(total, cu_seqlens))
            for a in range(start, end, chunk_size)]


def _solve_chunk(q, k, v, g, beta, a, b):
    gc, qk, unit_lower = _chunk_terms(q[:, a:b], k[:, a:b], g[:, a:b], beta[:, a:b])
    u, w = _chunk_uw(k[:, a:b], v[:, a:b], gc, beta[:, a:b], unit_lower)
    return gc, qk, unit_lower, u, w


def _chunk_step(q, k, gc, qk, u, w, state):
    """Readout of one chunk from the incoming state, and the state it leaves behind."""
    def head_major(x):
        return x.permute(0, 2, 1, 3)

    new_u = u - w @ state
    inter = head_major(q * gc.exp()) @ state
    out = inter + qk @ new_u
    last = gc[:, -1:]  # [b, 1, h, dk]
    tail_k = head_major(k * (last - gc).exp())
    state = state * last.squeeze(1).exp().unsqueeze(-1) + tail_k.transpose(-1, -2) @ new_u
    return out.permute(0, 2, 1, 3), state


def causal_conv1d_update_reference(
    x: Tensor,
    conv_state: Tensor,
    weight: Tensor,
    bias: Optional[Tensor] = None,
    activation: Optional[str] = None,
) -> tuple[Tensor, Tensor]:
    """Depthwise causal conv1d over ``cat(conv_state, x)``, returning ``(out, new_state)``.

    x ``[B, C, T]``, conv_state ``[B, C, K]`` (the last K samples), weight ``[C, K]``.
    ``out = act(conv(cat(state, x))[..., -T:])`` in the weight's dtype, cast to x's dtype;
    ``new_state = cat(state, x)[..., -K:]`` in the state's dtype. Mutates nothing.
    """
    if activation not in (None, "silu"):
        raise ValueError(f"activation must be None or 'silu', got {activation!r}")
    seq_len, width = x.shape[-1], conv_state.shape[-1]
    full = torch.cat([conv_state, x], dim=-1).to(weight.dtype)
    kernel = weight.shape[-1]
    windows = full.unfold(-1, kernel, 1)[:, :, full.shape[-1] - kernel + 1 - seq_len:]
    out = (windows * weight.unsqueeze(1)).sum(-1)
    if bias is not None:
        out = out + bias.unsqueeze(-1)
    if activation == "silu":
        out = torch.nn.functional.silu(out)
    new_state = full[..., full.shape[-1] - width:].to(conv_state.dtype)
    return out.to(x.dtype), new_state
