"""Small differentiable oracles for GDN / KDA, the gated linear recurrence (Mamba2's SSD,
Mamba1, lightning, retention, GLA: no delta erase) and the causal conv1d update.

Plain torch, independent of FLA and Triton; written for clarity and gradients, not speed.
Gates are natural logs of the per-step decay. Arithmetic runs in the inputs' own dtype (use
float64 for algebra tests); nothing here casts behind the caller's back.

Layouts (sequence-major, as in HF, FLA and tract):
    q, k  [B, T, Hk, Dk]      v [B, T, Hv, Dv], Hv = G * Hk (value head h reads key head h // G)
    g     [B, T, Hv] (GDN, one decay per head) or [B, T, Hv, Dk] (KDA, one decay per key channel)
    beta  [B, T, Hv]          state [N, Hv, Dk, Dv] (key-first) or [N, Hv, Dv, Dk] (state_v_first)
The gated linear references take the same layout without beta (state key-first, N = B).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor

from gdn_fx.errors import ShapeError, UsageError

E4M3_MAX = 448.0  # largest finite float8_e4m3fn value


def l2norm(x: Tensor, eps: float = 1e-6, dim: int = -1) -> Tensor:
    """``x * rsqrt(sum(x*x) + eps)`` over ``dim``: HF's ``use_qk_l2norm_in_kernel`` norm."""
    return x * torch.rsqrt((x * x).sum(dim=dim, keepdim=True) + eps)


# A log gate below this is a reset in any float dtype the kernels compute in: e^GATE_FLOOR is 0
# in f32 (and e^-104 already is) and in f64 (e^-746 is); clamping to it changes no decay, and
# it keeps -inf out of the sums (-inf - -inf is NaN). Chunk sums of it stay exact integers
# (64 * 1024 << 2^24). The chunked kernels of both ops (gdn_fx.ops) and the chunked linear
# reference below use it.
GATE_FLOOR = -1024.0


def gate_parts(g: Tensor) -> tuple[Tensor, Tensor]:
    """(whole, frac): the log gate clamped at GATE_FLOOR, split into its ceiling (an integer,
    whose cumulative sums within a chunk are exact in f32) and the rest, in (-1, 0].
    Cumulative differences c_t - c_j are then the exact integer difference plus a difference
    of fraction sums, which a reset gate (-1e9, -inf) never enters: in one cumulative sum the
    small gates after a reset would round against it (ulp(1024) ~ 1e-4). Gates in (-1, 0]
    have whole part 0: their sums are what they were."""
    clamped = g.clamp(min=GATE_FLOOR)
    whole = clamped.ceil()
    return whole, clamped - whole


def _segments(total: int, cu_seqlens: Optional[Tensor]) -> list[tuple[int, int]]:
    """(start, end) of each packed sequence; the whole axis when cu_seqlens is None."""
    if cu_seqlens is None:
        return [(0, total)]
    bounds = [int(b) for b in cu_seqlens.detach().cpu().tolist()]  # read on the CPU, by design
    rising = all(a <= b for a, b in zip(bounds, bounds[1:]))
    if len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != total or not rising:
        raise ShapeError(f"cu_seqlens {bounds} must rise (not strictly) from 0 to T={total}")
    return list(zip(bounds[:-1], bounds[1:]))


def _check_operands(q: Tensor, k: Tensor, v: Tensor, g: Tensor,
                    beta: Optional[Tensor] = None) -> None:
    """Raise ShapeError naming the operand whose shape breaks the layout of this module
    (``beta`` None: the gated linear recurrence, which has none)."""
    if q.dim() != 4 or v.dim() != 4:
        raise ShapeError(f"q and v must be 4-D [B, T, H, D]; got q {list(q.shape)}, "
                         f"v {list(v.shape)}")
    b, t, hk, dk = q.shape
    hv = v.shape[2]
    wanted = {"k": ([list(q.shape)], k), "v": ([[b, t, hv, v.shape[3]]], v),
              "g": ([[b, t, hv], [b, t, hv, dk]], g), "beta": ([[b, t, hv]], beta)}
    for name, (shapes, x) in wanted.items():
        if x is not None and list(x.shape) not in shapes:
            raise ShapeError(f"operand '{name}' has shape {list(x.shape)}; expected "
                             + " or ".join(str(s) for s in shapes))
    if hk == 0 or hv % hk:
        raise ShapeError(f"value heads {hv} must be a multiple of key heads {hk}")


def _initial_state(q: Tensor, v: Tensor, initial_state: Optional[Tensor], count: int,
                   state_v_first: bool) -> Tensor:
    """The key-first initial states [N, Hv, Dk, Dv]: the given ones (checked) or zeros."""
    hv, dk, dv = v.shape[2], q.shape[3], v.shape[3]
    if initial_state is None:
        return q.new_zeros(count, hv, dk, dv)
    want = [count, hv, dv, dk] if state_v_first else [count, hv, dk, dv]
    if list(initial_state.shape) != want:
        raise ShapeError(f"operand 'initial_state' has shape {list(initial_state.shape)}; "
                         f"expected {want} (N = {count} sequences)")
    return initial_state.transpose(-1, -2) if state_v_first else initial_state


def _prepare(q, k, v, g, beta, scale, initial_state, cu_seqlens, state_v_first):
    """Shared argument handling: check shapes, expand GQA and GDN gates, pick initial states."""
    _check_operands(q, k, v, g, beta)
    b, _, hk, dk = q.shape
    hv = v.shape[2]
    if cu_seqlens is not None and b != 1:
        raise ShapeError(f"cu_seqlens needs batch 1 (packed sequences), got batch {b}")
    count = b if cu_seqlens is None else cu_seqlens.numel() - 1
    s0 = _initial_state(q, v, initial_state, count, state_v_first)
    q = q.repeat_interleave(hv // hk, dim=2)
    k = k.repeat_interleave(hv // hk, dim=2)
    if g.dim() == 3:  # GDN: one decay per head, the same for every key channel
        g = g.unsqueeze(-1).expand(*g.shape, dk)
    scale = dk**-0.5 if scale is None else scale
    return q * scale, k, v, g, beta, s0


def delta_rule_step(state: Tensor, decay: Tensor, q_t: Tensor, k_t: Tensor, v_t: Tensor,
                    beta_t: Tensor) -> tuple[Tensor, Tensor]:
    """One timestep: returns (new state, out_t). State [..., Dk, Dv]; decay broadcasts to it.

    ``S = S * decay; delta = (v_t - k_t^T S) * beta_t; S = S + k_t delta^T; out_t = q_t^T S``.
    Written the way the models write it: k_t unsqueezed once per use.
    """
    state = state * decay
    kv = (state * k_t.unsqueeze(-1)).sum(dim=-2)
    delta = (v_t - kv) * beta_t
    state = state + k_t.unsqueeze(-1) * delta.unsqueeze(-2)
    return state, (state * q_t.unsqueeze(-1)).sum(dim=-2)


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
            decay = g[:, t].unsqueeze(-1).exp()
            state, out_t = delta_rule_step(state, decay, q[:, t], k[:, t], v[:, t],
                                           beta[:, t].unsqueeze(-1))
            outs.append(out_t)
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
    if block_v < 1:
        raise UsageError(f"state_fp8_qdq_reference: block_v must be >= 1, got {block_v}")
    tiles = [_qdq_tile(state[..., start:start + block_v].detach())
             for start in range(0, state.shape[-1], block_v)]
    qdq = torch.cat(tiles, dim=-1) if tiles else state.detach()
    return state + (qdq - state).detach()


def _qdq_tile(tile: Tensor) -> Tensor:
    """E4M3 round trip of one [..., Dk, block] tile, scaled so its amax maps to E4M3_MAX."""
    amax = tile.abs().amax(dim=(-2, -1), keepdim=True)
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    # Clamp: amax / (amax / 448) can round a hair above 448, and the cast of an out-of-range
    # value is not saturating on every backend.
    scaled = (tile / scale).clamp(-E4M3_MAX, E4M3_MAX)
    return scaled.to(torch.float8_e4m3fn).to(tile.dtype) * scale


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

    Per chunk of C steps with cumulative log gate G:
    ``A = I + strict_lower(beta k k^T * e^(Gi-Gj))`` is unit lower triangular;
    ``U = A^-1 (beta v)``, ``W = A^-1 (beta k e^G)``; then ``u = U - W S``,
    ``o = (q e^G) S + causal(q k^T e^(Gi-Gj)) u`` and ``S' = e^(G_C) S + (k e^(G_C - G))^T u``.

    ``w_quantizer`` sees the complete materialized W ``[B, T, Hv, Dk]`` once; its output (with
    the quantizer's own autograd) is what multiplies the incoming states. With ``state_qdq``,
    the initial state and each chunk's final state go through :func:`state_fp8_qdq_reference`
    (after the chunk's readout of the previous state). T == 0 returns an empty output and the
    (QDQ'd) initial state; there is then no W and the quantizer is not called.
    """
    if chunk_size < 1:
        raise UsageError(f"chunk_size must be >= 1, got {chunk_size}")
    q, k, v, g, beta, s0 = _prepare(q, k, v, g, beta, scale, initial_state, cu_seqlens,
                                    state_v_first)
    segments = _segments(q.shape[1], cu_seqlens)
    chunks = [(a, min(a + chunk_size, end)) for start, end in segments
              for a in range(start, end, chunk_size)]
    solved = [_solve_chunk(q, k, v, g, beta, a, b) for a, b in chunks]
    w_all = _materialize_w(solved, w_quantizer)

    def qdq(state: Tensor) -> Tensor:
        return state_fp8_qdq_reference(state, state_qdq_block_v) if state_qdq else state

    outs, finals = [], []
    for seq, (start, end) in enumerate(segments):
        state = qdq(s0 if cu_seqlens is None else s0[seq:seq + 1])
        for index, (a, b) in enumerate(chunks):
            if start <= a < end:  # chunks never straddle two sequences
                out, state = _chunk_step(q[:, a:b], k[:, a:b], solved[index], w_all[:, a:b], state)
                state = qdq(state)  # after this chunk's readout of the previous state
                outs.append(out)
        finals.append(state)
    out = torch.cat(outs, dim=1) if outs else v.new_zeros(v.shape)
    final = torch.cat(finals, dim=0)  # a new tensor: never aliases initial_state
    return out, final.transpose(-1, -2) if state_v_first else final


def _materialize_w(solved: list, w_quantizer: Optional[Callable[[Tensor], Tensor]]
                   ) -> Optional[Tensor]:
    """All chunks' W as one sequence-major [B, T, Hv, Dk] operand, through w_quantizer once.

    With no chunk (T == 0) there is no W operand: None, and the quantizer is not called.
    """
    if not solved:
        return None
    w_all = torch.cat([w.permute(0, 2, 1, 3) for *_, w in solved], dim=1)
    if w_quantizer is None:
        return w_all
    quantized = w_quantizer(w_all)
    if quantized.shape != w_all.shape:
        raise ShapeError(f"w_quantizer returned shape {list(quantized.shape)}; expected "
                         f"{list(w_all.shape)}")
    return quantized


def _solve_chunk(q, k, v, g, beta, a: int, b: int) -> tuple[Tensor, ...]:
    """Everything of chunk [a, b) that does not depend on the incoming state."""
    gc, qk, unit_lower = _chunk_terms(q[:, a:b], k[:, a:b], g[:, a:b], beta[:, a:b])
    u, w = _chunk_uw(k[:, a:b], v[:, a:b], gc, beta[:, a:b], unit_lower)
    return gc, qk, unit_lower, u, w


def _chunk_step(q: Tensor, k: Tensor, solved: tuple, w: Tensor, state: Tensor
                ) -> tuple[Tensor, Tensor]:
    """Readout of one chunk from the incoming state, and the state it leaves behind.

    ``w`` is the chunk's (possibly quantized) W, sequence-major [b, c, h, dk].
    """
    def head_major(x):
        return x.permute(0, 2, 1, 3)

    gc, qk, _, u, _ = solved
    w = head_major(w)
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
        raise UsageError(f"activation must be None or 'silu', got {activation!r}")
    seq_len, width, kernel = x.shape[-1], conv_state.shape[-1], weight.shape[-1]
    if width < kernel - 1:
        raise ShapeError(f"operand 'conv_state' keeps {width} samples; a kernel of width "
                         f"{kernel} needs at least {kernel - 1}")
    full = torch.cat([conv_state, x], dim=-1).to(weight.dtype)
    windows = full.unfold(-1, kernel, 1)[:, :, full.shape[-1] - kernel + 1 - seq_len:]
    out = (windows * weight.unsqueeze(1)).sum(-1)
    if bias is not None:
        out = out + bias.unsqueeze(-1)
    if activation == "silu":
        out = torch.nn.functional.silu(out)
    new_state = full[..., full.shape[-1] - width:].to(conv_state.dtype)
    return out.to(x.dtype), new_state


# ---- the gated linear recurrence (gdn_fx::gated_linear_scan): no delta erase, no beta ----

def _linear_prepare(q: Tensor, k: Tensor, v: Tensor, g: Tensor,
                    initial_state: Optional[Tensor]) -> tuple[Tensor, ...]:
    """Check shapes; expand key heads to value heads; gates to [B, T, Hv, Dk or 1], which
    broadcast over the key channels; the key-first initial state or zeros."""
    _check_operands(q, k, v, g)
    groups = v.shape[2] // q.shape[2]
    s0 = _initial_state(q, v, initial_state, q.shape[0], state_v_first=False)
    q, k = q.repeat_interleave(groups, dim=2), k.repeat_interleave(groups, dim=2)
    return q, k, g if g.dim() == 4 else g.unsqueeze(-1), s0


def recurrent_linear_reference(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, *, scale: float,
    initial_state: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor]:
    """The gated linear recurrence step by step, in the inputs' dtype.

    Per step, with state S [Dk, Dv]: ``S = S * exp(g_t); S = S + k_t v_t^T;
    o_t = scale * S^T q_t`` (read after the write). g is the log decay, [B, T, Hv] (one per
    head: Mamba2, lightning, retention) or [B, T, Hv, Dk] (one per key channel: GLA, Mamba1);
    a gate of -inf is a reset (e^-inf = 0 forgets a finite state). Returns
    ``(o [B, T, Hv, Dv], final state [B, Hv, Dk, Dv])``; the final state never aliases the
    initial one. Gradients flow to every input.
    """
    q, k, g, state = _linear_prepare(q, k, v, g, initial_state)
    outs = []
    for t in range(v.shape[1]):
        state = state * g[:, t].exp().unsqueeze(-1)
        state = state + k[:, t].unsqueeze(-1) * v[:, t].unsqueeze(-2)
        outs.append(scale * (state * q[:, t].unsqueeze(-1)).sum(dim=-2))
    if not outs:
        return v.new_zeros(v.shape), state.clone()
    return torch.stack(outs, dim=1), state


def chunk_linear_reference(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, *, scale: float,
    initial_state: Optional[Tensor] = None, chunk_size: int = 64,
) -> tuple[Tensor, Tensor]:
    """The gated linear recurrence in chunks of ``chunk_size`` positions (Mamba2's SSD form).

    Per chunk, with c_t the cumulative log gate from its start (per key channel) and S the
    state before it: ``o_t = scale * ((q_t e^c_t)^T S + sum_{j<=t} (q_t e^(c_t - c_j))^T k_j
    v_j)`` and ``S' = e^c_C S + sum_j (k_j e^(c_C - c_j)) v_j^T``. Every decay is e^c_t or a
    ratio e^(c_t - c_j) with j <= t, the product of the gates between (never the unsafe
    k e^-c), formed per pair and per channel; the cumulative gates are kept in the two exact
    parts of ``gate_parts``, so a reset (-1e4, -inf) gives a decay of 0, never NaN.
    """
    if chunk_size < 1:
        raise UsageError(f"chunk_size must be >= 1, got {chunk_size}")
    q, k, g, state = _linear_prepare(q, k, v, g, initial_state)
    outs = []
    for a in range(0, v.shape[1], chunk_size):
        part = slice(a, a + chunk_size)
        out, state = _linear_chunk(q[:, part], k[:, part], v[:, part], g[:, part], state)
        outs.append(scale * out)
    if not outs:
        return v.new_zeros(v.shape), state.clone()
    return torch.cat(outs, dim=1), state


def _linear_chunk(q: Tensor, k: Tensor, v: Tensor, g: Tensor, state: Tensor
                  ) -> tuple[Tensor, Tensor]:
    """One chunk, sequence-major [b, c, h, d] (g [b, c, h, dk or 1]): the unscaled readout
    and the state after it."""
    whole, frac = (part.cumsum(dim=1) for part in gate_parts(g))
    # log decay from step j to step t, [b, t, j, h, dk or 1]: the exact integer difference
    # plus the difference of fraction sums (a reset never meets -inf - -inf)
    pairs = (whole[:, :, None] - whole[:, None]) + (frac[:, :, None] - frac[:, None])
    n = q.shape[1]
    causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    decay = pairs.masked_fill(~causal[None, :, :, None, None], float("-inf")).exp()
    scores = (q[:, :, None] * k[:, None] * decay).sum(dim=-1)  # [b, t, j, h]
    grow = (whole + frac).exp()  # e^c_t: the decay since the chunk began
    out = (torch.einsum("bthd,bhdv->bthv", q * grow, state)
           + torch.einsum("btjh,bjhv->bthv", scores, v))
    tail = ((whole[:, -1:] - whole) + (frac[:, -1:] - frac)).exp()  # e^(c_C - c_j)
    state = state * grow[:, -1].unsqueeze(-1) + torch.einsum("bjhd,bjhv->bhdv", k * tail, v)
    return out, state
