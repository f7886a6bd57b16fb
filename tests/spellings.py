"""A corpus of the gated delta recurrence as other authors spell it, and one-change mutants.

Every spelling computes, per step t (canonical layout: q, k [B, T, Hk, Dk], v [B, T, H, Dv],
g [B, T, H] (GDN) or [B, T, H, Dk] (KDA), beta [B, T, H], state [B, H, Dk, Dv]):

    S = S * exp(g_t);  S += k_t (x) ((v_t - k_t^T S) * beta_t);  o_t = scale * q_t^T S

but each is written the way some other author writes it: FLA's naive references, transformers'
torch fallbacks, einsum / matmul / bmm steps, seq-major or head-major or time-first loops, a
value-first state, in-place updates, decays spelled every which way, outputs gathered by a
buffer, a list or a cat. Nothing here imports gdn_fx: this is what a recognizer is tested on.

``SPELLINGS``: the correct ones. Each records its family, how many gated_delta_scan fusions a
collapse should make (one per loop), its example inputs, and ``reference(args, scan)``: the
module's outputs recomputed by a canonical-layout ``scan`` the test supplies (the adapter says
which layout, scale and q/k norm the spelling uses; the arithmetic is the test's own).

``MUTANTS``: one small edit of a correct spelling (named by ``base``) that is not the delta rule
(or not one op); each must stay unfused with a near-miss. ``LOOKALIKES``: one-change edits that
the brief listed as mutants but that ARE still a gated delta rule under another gate or scale
(exp(2 g) is the log decay 2 g; a readout of 2 S is scale 2); a collapse may fuse them (and must
then agree) or leave them with a near-miss, never be wrong.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.kimi_linear.modeling_kimi_linear import recurrent_kimi_delta_attention
from transformers.models.qwen3_next.modeling_qwen3_next import torch_recurrent_gated_delta_rule


# --- inputs ------------------------------------------------------------------------------

def operands(b, t, h, dk, dv, *, hk=None, kda=False, seed=0) -> dict:
    """Canonical sequence-major operands: q, k [B, T, Hk, Dk], v [B, T, H, Dv], g (log decay,
    in [-0.95, -0.05]) [B, T, H] or [B, T, H, Dk], beta in [0.05, 0.95] [B, T, H], s0
    [B, H, Dk, Dv]."""
    gen = torch.Generator().manual_seed(seed)
    hk = hk or h

    def rnd(*shape, s=1.0):
        return torch.randn(*shape, generator=gen) * s

    def unit(*shape):
        return torch.rand(*shape, generator=gen) * 0.9 + 0.05

    return {
        "q": rnd(b, t, hk, dk), "k": rnd(b, t, hk, dk, s=0.5), "v": rnd(b, t, h, dv),
        "g": -unit(b, t, h, dk) if kda else -unit(b, t, h), "beta": unit(b, t, h),
        "s0": rnd(b, h, dk, dv, s=0.5),
    }


def head_major(x: torch.Tensor) -> torch.Tensor:
    """[B, T, H, ...] -> [B, H, T, ...] (and back: the same transpose)."""
    return x.transpose(1, 2).contiguous()


def time_first(x: torch.Tensor) -> torch.Tensor:
    """[B, T, H, ...] -> [T, B, H, ...] (and back)."""
    return x.transpose(0, 1).contiguous()


def standard_inputs(b, t, h, dk, dv, *, layout="bthd", state=True, kda=False, hk=None,
                    seed=0, state_layout="kv") -> Callable[[], tuple]:
    """An input builder: (q, k, v, g, beta[, s0]) in ``layout`` ('bthd', 'bhtd', 'tbhd'),
    the state key-first [B, H, Dk, Dv] ('kv') or value-first [B, H, Dv, Dk] ('vk')."""
    def build():
        x = operands(b, t, h, dk, dv, hk=hk, kda=kda, seed=seed)
        move = {"bthd": lambda y: y, "bhtd": head_major, "tbhd": time_first}[layout]
        args = [move(x[n]) for n in ("q", "k", "v", "g", "beta")]
        if state:
            args.append(x["s0"] if state_layout == "kv" else x["s0"].transpose(-1, -2).contiguous())
        return tuple(args)
    return build


def standard_reference(*, layout="bthd", state=True, final_state=True, scale=1.0, norm=None,
                       state_layout="kv", order=("q", "k", "v", "g", "beta")):
    """``reference(args, scan)`` for a module taking (q, k, v, g, beta[, s0]) in ``layout`` and
    returning o in that layout (and the final state, in ``state_layout``). ``scale``: a number
    or 'rsqrt' (1/sqrt(Dk)); ``norm``: None, 'rsqrt' (x * rsqrt(sum x^2 + 1e-6)) or
    'normalize' (F.normalize, eps 1e-12) of q and k before the loop."""
    back = {"bthd": lambda y: y, "bhtd": head_major, "tbhd": time_first}[layout]

    def reference(args, scan):
        named = dict(zip(order, args))
        q, k, v, g, beta = (back(named[n]) for n in ("q", "k", "v", "g", "beta"))
        s0 = args[5] if state else None
        if s0 is not None and state_layout == "vk":
            s0 = s0.transpose(-1, -2)
        factor = q.shape[-1] ** -0.5 if scale == "rsqrt" else scale
        o, s = scan(q, k, v, g, beta, s0, scale=factor, norm=norm)
        o = back(o)
        if state_layout == "vk":
            s = s.transpose(-1, -2)
        return (o, s) if final_state else o
    return reference


# --- the records -------------------------------------------------------------------------

@dataclass(frozen=True)
class Spelling:
    name: str
    family: str  # "gdn" or "kda"
    fusions: int  # gated_delta_scan nodes a collapse should make: one per loop
    module: Callable[[], nn.Module]
    inputs: Callable[[], tuple]
    reference: Callable  # (args, scan) -> the module's outputs, recomputed

    @property
    def doc(self) -> str:
        return (type(self.module()).__doc__ or "").strip().splitlines()[0]


@dataclass(frozen=True)
class Mutant:
    name: str
    base: str  # the Spelling it is one edit away from (its inputs are the base's)
    module: Callable[[], nn.Module]
    change: str  # the one edit, in words


# --- FLA --------------------------------------------------------------------------------

def fla_naive_recurrent_gdn(q, k, v, beta, g, scale=None, initial_state=None,
                            output_final_state=False):
    """Written as FLA's fla/ops/gated_delta_rule/naive.py does: (q, k, v, beta, g) order,
    transpose to head-major in f32, zeros buffers .to(v), clone()s, einsum readout."""
    q, k, v, beta, g = map(lambda x: x.transpose(1, 2).contiguous().to(torch.float32),
                           [q, k, v, beta, g])
    B, H, T, K, V = *k.shape, v.shape[-1]
    o = torch.zeros(B, H, T, V).to(v)
    h = torch.zeros(B, H, K, V).to(v)
    if initial_state is not None:
        h = initial_state.to(torch.float32)
    if scale is None:
        scale = 1 / (q.shape[-1] ** 0.5)
    q = q * scale
    for i in range(T):
        b_q = q[:, :, i]
        b_k = k[:, :, i]
        b_v = v[:, :, i].clone()
        h = h.clone() * g[:, :, i].exp()[..., None, None]
        b_beta = beta[:, :, i]
        b_v = b_v - (h.clone() * b_k[..., None]).sum(-2)
        b_v = b_v * b_beta[..., None]
        h = h.clone() + b_k.unsqueeze(-1) * b_v.unsqueeze(-2)
        o[:, :, i] = torch.einsum("bhd,bhdm->bhm", b_q, h)
    if not output_final_state:
        h = None
    o = o.transpose(1, 2).contiguous()
    return o, h


class FlaNaiveGDN(nn.Module):
    """FLA's naive_recurrent_gated_delta_rule with an initial state and the final state out."""

    def forward(self, q, k, v, beta, g, initial_state):
        return fla_naive_recurrent_gdn(q, k, v, beta, g, initial_state=initial_state,
                                       output_final_state=True)


class FlaNaiveGDNNoState(nn.Module):
    """FLA's naive_recurrent_gated_delta_rule called as `o, _ = f(q, k, v, beta, g)`."""

    def forward(self, q, k, v, beta, g):
        o, _ = fla_naive_recurrent_gdn(q, k, v, beta, g)
        return o


def fla_naive_recurrent_kda(q, k, v, g, beta, scale=None, initial_state=None,
                            output_final_state=False):
    """Written as FLA's fla/ops/kda/naive.py does: repeat_interleave for GVA, q scaled up
    front, S = new_zeros then S += initial_state, seq-major buffer o[:, i], beta on k inside
    an einsum outer product, per-key decay g_i[..., None].exp()."""
    dtype = v.dtype
    B, T, H, K, HV, V = *q.shape, v.shape[2], v.shape[-1]
    G = HV // H
    if scale is None:
        scale = K ** -0.5
    q, k, v, g, beta = map(lambda x: x.to(torch.float), [q, k, v, g, beta])
    q = q.repeat_interleave(G, dim=2) * scale
    k = k.repeat_interleave(G, dim=2)
    S = q.new_zeros(B, HV, K, V)
    if initial_state is not None:
        S += initial_state
    o = torch.zeros_like(v)
    for i in range(0, T):
        q_i, k_i, v_i, g_i, b_i = q[:, i], k[:, i], v[:, i], g[:, i], beta[:, i]
        S = S * g_i[..., None].exp()
        S = S + torch.einsum("b h k, b h v -> b h k v", b_i[..., None] * k_i,
                             v_i - (k_i[..., None] * S).sum(-2))
        o[:, i] = torch.einsum("b h k, b h k v -> b h v", q_i, S)
    if not output_final_state:
        S = None
    return o.to(dtype), S


class FlaNaiveKDA(nn.Module):
    """FLA's naive_recurrent_kda, grouped value heads (Hv = 2 Hk), initial and final state."""

    def forward(self, q, k, v, g, beta, initial_state):
        return fla_naive_recurrent_kda(q, k, v, g, beta, initial_state=initial_state,
                                       output_final_state=True)


class FlaNaiveKDANoState(nn.Module):
    """FLA's naive_recurrent_kda called without a state: `o, _ = f(q, k, v, g, beta)`."""

    def forward(self, q, k, v, g, beta):
        o, _ = fla_naive_recurrent_kda(q, k, v, g, beta)
        return o


# --- transformers ----------------------------------------------------------------------

class HFQwen3NextRecurrent(nn.Module):
    """transformers' own torch_recurrent_gated_delta_rule (qwen3_next), l2norm in kernel."""

    def forward(self, q, k, v, g, beta, s0):
        return torch_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=s0,
                                                output_final_state=True,
                                                use_qk_l2norm_in_kernel=True)


class HFKimiRecurrent(nn.Module):
    """transformers' own recurrent_kimi_delta_attention (kimi_linear), no initial state."""

    def forward(self, q, k, v, g, beta):
        o, _ = recurrent_kimi_delta_attention(q, k, v, g, beta, None, False,
                                              use_qk_l2norm_in_kernel=True)
        return o


def hf_l2norm(x, dim=-1, eps=1e-6):
    """transformers' qwen3_next l2norm: x * rsqrt(sum(x * x) + eps)."""
    return x * torch.rsqrt((x * x).sum(dim=dim, keepdim=True) + eps)


class HFStyleGQA(nn.Module):
    """A model file in transformers' style: repeat_interleave GQA, l2norm, q / sqrt(Dk),
    head-major transpose, kv_mem / delta names, core_attn_out[:, :, i] buffer."""

    def forward(self, query, key, value, g, beta, initial_state):
        n_v, n_k = value.shape[2], key.shape[2]
        query = query.repeat_interleave(n_v // n_k, dim=2)
        key = key.repeat_interleave(n_v // n_k, dim=2)
        query, key, value, beta, g = [x.transpose(1, 2).contiguous().to(torch.float32)
                                      for x in (query, key, value, beta, g)]
        query = hf_l2norm(query)
        key = hf_l2norm(key)
        query = query / (query.shape[-1] ** 0.5)
        state = initial_state.to(value)
        core_attn_out = torch.zeros_like(value)
        for i in range(query.shape[2]):
            q_t, k_t, v_t = query[:, :, i], key[:, :, i], value[:, :, i]
            state = state * g[:, :, i].exp()[..., None, None]
            kv_mem = (state * k_t.unsqueeze(-1)).sum(dim=-2)
            delta = (v_t - kv_mem) * beta[:, :, i].unsqueeze(-1)
            state = state + k_t.unsqueeze(-1) * delta.unsqueeze(-2)
            core_attn_out[:, :, i] = (state * q_t.unsqueeze(-1)).sum(dim=-2)
        return core_attn_out.transpose(1, 2).contiguous(), state


class HFSingleToken(nn.Module):
    """A decode step as model code writes it when T == 1: one step, no loop, scale 1/sqrt(Dk)."""

    def forward(self, q, k, v, g, beta, s0):
        q_t, k_t, v_t = q[:, 0], k[:, 0], v[:, 0]
        q_t = q_t * q_t.shape[-1] ** -0.5
        state = s0 * g[:, 0].exp().unsqueeze(-1).unsqueeze(-1)
        kv_mem = (state * k_t.unsqueeze(-1)).sum(dim=-2)
        delta = (v_t - kv_mem) * beta[:, 0].unsqueeze(-1)
        state = state + k_t.unsqueeze(-1) * delta.unsqueeze(-2)
        out = (state * q_t.unsqueeze(-1)).sum(dim=-2)
        return out.unsqueeze(1), state


# --- einsum / matmul / bmm steps ----------------------------------------------------------

class EinsumHeadMajor(nn.Module):
    """A research-code einsum loop on head-major [B, H, T, D] inputs, outputs in a list + stack."""

    def step(self, S, q_t, k_t, v_t, g_t, b_t):
        S = S * torch.exp(g_t)[:, :, None, None]
        kv = torch.einsum("bhk,bhkv->bhv", k_t, S)
        delta = (v_t - kv) * b_t[:, :, None]
        S = S + torch.einsum("bhk,bhv->bhkv", k_t, delta)
        return S, torch.einsum("bhk,bhkv->bhv", q_t, S)

    def forward(self, q, k, v, g, beta, s0):
        S, outs = s0, []
        for t in range(q.shape[2]):
            S, o = self.step(S, q[:, :, t], k[:, :, t], v[:, :, t], g[:, :, t], beta[:, :, t])
            outs.append(o)
        return torch.stack(outs, dim=2), S


class EinsumScaleInLoop(nn.Module):
    """An einsum loop with other letters ('bhd,bhde->bhe'), seq-major, q scaled in the readout."""

    def forward(self, q, k, v, g, beta, s0):
        scale = q.shape[-1] ** -0.5
        S = s0
        out = torch.empty_like(v)
        for t in range(q.shape[1]):
            S = torch.exp(g[:, t]).unsqueeze(-1).unsqueeze(-1) * S
            err = v[:, t] - torch.einsum("bhd,bhde->bhe", k[:, t], S)
            S = S + torch.einsum("bhd,bhe->bhde", k[:, t], err * beta[:, t].unsqueeze(-1))
            out[:, t] = torch.einsum("bhd,bhde->bhe", q[:, t] * scale, S)
        return out, S


class MatmulAt(nn.Module):
    """Row-vector `@` products (k^T S as [1, Dk] @ [Dk, Dv]), Dk == Dv, cat of outputs."""

    def step(self, S, q_t, k_t, v_t, g_t, b_t):
        S = S * g_t.exp()[..., None, None]
        kv = (k_t.unsqueeze(-2) @ S).squeeze(-2)
        delta = (v_t - kv) * b_t[..., None]
        S = S + k_t.unsqueeze(-1) @ delta.unsqueeze(-2)
        return S, (q_t.unsqueeze(-2) @ S).squeeze(-2)

    def forward(self, q, k, v, g, beta, s0):
        S, outs = s0, []
        for t in range(q.shape[1]):
            S, o = self.step(S, q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t])
            outs.append(o.unsqueeze(1))
        return torch.cat(outs, dim=1), S


class TorchMatmulTransposed(nn.Module):
    """torch.matmul with the state transposed (S^T k as a column), [..., 0] to drop the axis."""

    def forward(self, q, k, v, g, beta, s0):
        S = s0
        out = torch.zeros_like(v)
        for t in range(q.shape[1]):
            S = S * torch.exp(g[:, t])[:, :, None, None]
            kv = torch.matmul(S.transpose(-1, -2), k[:, t][..., None])[..., 0]
            delta = beta[:, t][..., None] * (v[:, t] - kv)
            S = S + torch.matmul(k[:, t][..., None], delta[..., None, :])
            out[:, t] = torch.matmul(S.transpose(-1, -2), q[:, t][..., None])[..., 0]
        return out, S


class BmmMerged(nn.Module):
    """A kernel-port style: batch and heads merged to [B*H, ...], torch.bmm steps, state out
    as [B*H, Dk, Dv]."""

    def forward(self, q, k, v, g, beta, s0):
        B, T, H, Dk = q.shape
        Dv = v.shape[-1]
        q, k, v = (x.permute(0, 2, 1, 3).reshape(B * H, T, x.shape[-1]) for x in (q, k, v))
        g, beta = (x.permute(0, 2, 1).reshape(B * H, T) for x in (g, beta))
        S = s0.reshape(B * H, Dk, Dv)
        outs = []
        for t in range(T):
            S = S * torch.exp(g[:, t]).view(-1, 1, 1)
            kv = torch.bmm(k[:, t].unsqueeze(1), S).squeeze(1)
            delta = (v[:, t] - kv) * beta[:, t].unsqueeze(1)
            S = S + torch.bmm(k[:, t].unsqueeze(2), delta.unsqueeze(1))
            outs.append(torch.bmm(q[:, t].unsqueeze(1), S))
        o = torch.cat(outs, dim=1)  # [B*H, T, Dv]
        return o.reshape(B, H, T, Dv).permute(0, 2, 1, 3), S


class Baddbmm(nn.Module):
    """torch.baddbmm for the rank-one update, merged heads, no initial state, o only."""

    def forward(self, q, k, v, g, beta):
        B, T, H, Dk = q.shape
        Dv = v.shape[-1]
        q, k, v = (x.transpose(1, 2).reshape(B * H, T, -1) for x in (q, k, v))
        a, b = g.transpose(1, 2).reshape(B * H, T).exp(), beta.transpose(1, 2).reshape(B * H, T)
        S = q.new_zeros(B * H, Dk, Dv)
        out = q.new_zeros(B * H, T, Dv)
        for t in range(T):
            S = S * a[:, t, None, None]
            kv = torch.bmm(k[:, t:t + 1], S)  # [BH, 1, Dv]
            delta = (v[:, t:t + 1] - kv) * b[:, t, None, None]
            S = torch.baddbmm(S, k[:, t:t + 1].transpose(1, 2), delta)
            out[:, t:t + 1] = torch.bmm(q[:, t:t + 1], S)
        return out.view(B, H, T, Dv).transpose(1, 2)


# --- loop axes and iteration ----------------------------------------------------------------

class SeqMajorScalarGate(nn.Module):
    """Seq-major loop (time axis 1), scalar gate exp-then-unsqueeze, preallocated buffer."""

    def forward(self, q, k, v, g, beta, s0):
        S = s0.clone()
        out = v.new_zeros(v.shape)
        for t in range(q.shape[1]):
            decay = torch.exp(g[:, t]).unsqueeze(-1).unsqueeze(-1)
            S = S * decay
            pred = (S * k[:, t].unsqueeze(-1)).sum(-2)
            S = S + k[:, t].unsqueeze(-1) * ((v[:, t] - pred) * beta[:, t].unsqueeze(-1)).unsqueeze(-2)
            out[:, t] = (S * q[:, t].unsqueeze(-1)).sum(-2)
        return out, S


class TimeFirstIteration(nn.Module):
    """Time-first [T, B, H, D] inputs iterated directly (`for q_t, ... in zip(q, k, ...)`)."""

    def forward(self, q, k, v, g, beta, s0):
        S, outs = s0, []
        for q_t, k_t, v_t, g_t, b_t in zip(q, k, v, g, beta):
            S = S * g_t.exp()[..., None, None]
            delta = (v_t - (k_t[..., None] * S).sum(-2)) * b_t[..., None]
            S = S + k_t[..., None] * delta[..., None, :]
            outs.append((q_t[..., None] * S).sum(-2))
        return torch.stack(outs), S


class UnbindIteration(nn.Module):
    """`zip(*(x.unbind(1) for x in ...))` iteration, outputs stacked at dim 1."""

    def forward(self, q, k, v, g, beta, s0):
        S, outs = s0, []
        for q_t, k_t, v_t, g_t, b_t in zip(*(x.unbind(1) for x in (q, k, v, g, beta))):
            S = S * g_t.exp()[:, :, None, None]
            kv = (S * k_t[:, :, :, None]).sum(2)
            S = S + k_t[:, :, :, None] * (b_t[:, :, None] * (v_t - kv))[:, :, None, :]
            outs.append((S * q_t[:, :, :, None]).sum(2))
        return torch.stack(outs, 1), S


class SliceSqueeze(nn.Module):
    """Slice-and-squeeze iteration (`q[:, t:t+1].squeeze(1)`), beta unsqueezed, o only."""

    def forward(self, q, k, v, g, beta, s0):
        S, outs = s0, []
        for t in range(q.size(1)):
            q_t, k_t, v_t = (x[:, t:t + 1].squeeze(1) for x in (q, k, v))
            g_t, b_t = g[:, t:t + 1].squeeze(1), beta[:, t:t + 1].squeeze(1)
            S = S * g_t.exp().unsqueeze(-1).unsqueeze(-1)
            kv = (S * k_t.unsqueeze(-1)).sum(dim=-2)
            S = S + k_t.unsqueeze(-1) * ((v_t - kv) * b_t.unsqueeze(-1)).unsqueeze(-2)
            outs.append((S * q_t.unsqueeze(-1)).sum(dim=-2))
        return torch.stack(outs, dim=1)


# --- state layout and beta placement --------------------------------------------------------

class ValueFirstState(nn.Module):
    """A value-first state [B, H, Dv, Dk] (S k as in the paper's S_t = S_{t-1} - ...), mul+sum."""

    def forward(self, q, k, v, g, beta, s0):
        S = s0  # [B, H, Dv, Dk]
        out = torch.zeros_like(v)
        for t in range(q.shape[1]):
            S = S * g[:, t].exp()[:, :, None, None]
            kv = (S * k[:, t][:, :, None, :]).sum(-1)
            delta = (v[:, t] - kv) * beta[:, t][:, :, None]
            S = S + delta[:, :, :, None] * k[:, t][:, :, None, :]
            out[:, t] = (S * q[:, t][:, :, None, :]).sum(-1)
        return out, S


class ValueFirstMatmul(nn.Module):
    """Value-first state [B, H, Dv, Dk] with column-vector matmuls (S @ k), Dk == Dv."""

    def forward(self, q, k, v, g, beta, s0):
        S = s0
        outs = []
        for t in range(q.shape[1]):
            S = torch.exp(g[:, t])[..., None, None] * S
            kv = (S @ k[:, t, ..., None]).squeeze(-1)
            S = S + ((v[:, t] - kv) * beta[:, t, :, None])[..., None] @ k[:, t, :, None, :]
            outs.append((S @ q[:, t, ..., None]).squeeze(-1))
        return torch.stack(outs, dim=1), S


class BetaOnKey(nn.Module):
    """beta applied to k (k_beta = beta k) instead of to delta, as DeltaNet papers write it."""

    def forward(self, q, k, v, g, beta, s0):
        S = s0
        out = torch.zeros_like(v)
        k_beta = k * beta[..., None]
        for t in range(q.shape[1]):
            S = S * g[:, t].exp()[..., None, None]
            v_old = (S * k[:, t, ..., None]).sum(-2)
            S = S + k_beta[:, t, ..., None] * (v[:, t] - v_old)[..., None, :]
            out[:, t] = (S * q[:, t, ..., None]).sum(-2)
        return out, S


# --- in-place updates --------------------------------------------------------------------

class InplaceMulAdd(nn.Module):
    """In-place state updates with mul_ and add_ on a clone of the initial state."""

    def forward(self, q, k, v, g, beta, s0):
        S = s0.clone()
        out = torch.zeros_like(v)
        for t in range(q.shape[1]):
            S.mul_(g[:, t].exp()[..., None, None])
            delta = (v[:, t] - (S * k[:, t, ..., None]).sum(-2)) * beta[:, t, ..., None]
            S.add_(k[:, t, ..., None] * delta[..., None, :])
            out[:, t] = (S * q[:, t, ..., None]).sum(-2)
        return out, S


class InplaceOperators(nn.Module):
    """In-place `S *= decay; S += outer` on a zeros state (no initial state), o only."""

    def forward(self, q, k, v, g, beta):
        B, T, H, Dk = q.shape
        S = torch.zeros(B, H, Dk, v.shape[-1])
        outs = []
        for t in range(T):
            S *= torch.exp(g[:, t, :, None, None])
            delta = (v[:, t] - torch.einsum("bhk,bhkv->bhv", k[:, t], S)) * beta[:, t, :, None]
            S += torch.einsum("bhk,bhv->bhkv", k[:, t], delta)
            outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], S))
        return torch.stack(outs, dim=1)


# --- decay spellings -------------------------------------------------------------------

class DecayView(nn.Module):
    """Decay reshaped with view(B, H, 1, 1) after the exp, head-major loop."""

    def forward(self, q, k, v, g, beta, s0):
        B, H = q.shape[:2]
        S, out = s0, torch.zeros_like(v)
        for t in range(q.shape[2]):
            S = S * g[:, :, t].exp().view(B, H, 1, 1)
            kv = (S * k[:, :, t].view(B, H, -1, 1)).sum(2)
            delta = (v[:, :, t] - kv) * beta[:, :, t].view(B, H, 1)
            S = S + k[:, :, t].view(B, H, -1, 1) * delta.view(B, H, 1, -1)
            out[:, :, t] = (S * q[:, :, t].view(B, H, -1, 1)).sum(2)
        return out, S


class DecayReshapeThenExp(nn.Module):
    """Gate reshaped first, exp after (g_t.reshape(B, H, 1, 1).exp()), seq-major."""

    def forward(self, q, k, v, g, beta, s0):
        B, T, H, _ = q.shape
        S, outs = s0, []
        for t in range(T):
            S = S * g[:, t].reshape(B, H, 1, 1).exp()
            kv = (S * k[:, t].reshape(B, H, -1, 1)).sum(-2)
            delta = (v[:, t] - kv) * beta[:, t].reshape(B, H, 1)
            S = S + k[:, t].reshape(B, H, -1, 1) * delta.reshape(B, H, 1, -1)
            outs.append((S * q[:, t].reshape(B, H, -1, 1)).sum(-2))
        return torch.stack(outs, dim=1), S


class DecayNoneNone(nn.Module):
    """Gate None-indexed then exp (g[:, :, t][..., None, None].exp()), head-major, Dk == Dv."""

    def forward(self, q, k, v, g, beta, s0):
        S, out = s0, torch.zeros_like(v)
        for t in range(q.shape[2]):
            S = S * g[:, :, t][..., None, None].exp()
            kv = (S * k[:, :, t][..., None]).sum(-2)
            S = S + k[:, :, t][..., None] * ((v[:, :, t] - kv) * beta[:, :, t][..., None])[..., None, :]
            out[:, :, t] = (S * q[:, :, t][..., None]).sum(-2)
        return out, S


class DecayPrecomputed(nn.Module):
    """exp of the whole gate precomputed before the loop (alpha = g.exp()), alpha[:, t, :, None, None]."""

    def forward(self, q, k, v, g, beta, s0):
        alpha = g.exp()
        S, out = s0, torch.zeros_like(v)
        for t in range(q.shape[1]):
            S = alpha[:, t, :, None, None] * S
            kv = (S * k[:, t, :, :, None]).sum(-2)
            S = S + k[:, t, :, :, None] * (beta[:, t, :, None] * (v[:, t] - kv))[:, :, None, :]
            out[:, t] = (S * q[:, t, :, :, None]).sum(-2)
        return out, S


class DecaySigmoidAlpha(nn.Module):
    """A forget gate given directly as alpha = sigmoid(a) (no log decay, no exp), seq-major."""

    def forward(self, q, k, v, a, beta, s0):
        alpha = torch.sigmoid(a)
        S, out = s0, torch.zeros_like(v)
        for t in range(q.shape[1]):
            S = S * alpha[:, t].unsqueeze(-1).unsqueeze(-1)
            kv = (S * k[:, t].unsqueeze(-1)).sum(-2)
            S = S + k[:, t].unsqueeze(-1) * ((v[:, t] - kv) * beta[:, t].unsqueeze(-1)).unsqueeze(-2)
            out[:, t] = (S * q[:, t].unsqueeze(-1)).sum(-2)
        return out, S


class GateFromParameters(nn.Module):
    """A layer's gate and beta from parameters (Mamba2-style g = -exp(A_log) softplus(a + dt_bias),
    beta = sigmoid(b)), then a plain seq-major loop."""

    def __init__(self, heads=3):
        super().__init__()
        gen = torch.Generator().manual_seed(7)
        self.A_log = nn.Parameter(torch.rand(heads, generator=gen).log())
        self.dt_bias = nn.Parameter(torch.randn(heads, generator=gen) * 0.1)

    def gates(self, a, b):
        return -self.A_log.exp() * F.softplus(a + self.dt_bias), b.sigmoid()

    def forward(self, q, k, v, a, b, s0):
        g, beta = self.gates(a, b)
        S, out = s0, torch.zeros_like(v)
        for t in range(q.shape[1]):
            S = S * g[:, t].exp()[..., None, None]
            kv = (S * k[:, t].unsqueeze(-1)).sum(-2)
            delta = (v[:, t] - kv) * beta[:, t].unsqueeze(-1)
            S = S + k[:, t].unsqueeze(-1) * delta.unsqueeze(-2)
            out[:, t] = (S * q[:, t].unsqueeze(-1)).sum(-2)
        return out, S


# --- q handling ------------------------------------------------------------------------

class NormalizeBeforeLoop(nn.Module):
    """F.normalize of q and k before the loop, scale applied to q before it, GQA by expand+reshape."""

    def forward(self, q, k, v, g, beta, s0):
        B, T, Hk, Dk = q.shape
        G = v.shape[2] // Hk
        q = F.normalize(q, p=2, dim=-1) * Dk ** -0.5
        k = F.normalize(k, p=2, dim=-1)
        q, k = (x[:, :, :, None].expand(B, T, Hk, G, Dk).reshape(B, T, Hk * G, Dk) for x in (q, k))
        S, out = s0, torch.zeros_like(v)
        for t in range(T):
            S = S * g[:, t].exp()[..., None, None]
            kv = (S * k[:, t].unsqueeze(-1)).sum(-2)
            S = S + k[:, t].unsqueeze(-1) * ((v[:, t] - kv) * beta[:, t].unsqueeze(-1)).unsqueeze(-2)
            out[:, t] = (S * q[:, t].unsqueeze(-1)).sum(-2)
        return out, S


class ScaleOnOutput(nn.Module):
    """The scale applied to each step's output (o_t = scale * q^T S), not to q."""

    def __init__(self, scale=0.3):
        super().__init__()
        self.scale = scale

    def forward(self, q, k, v, g, beta, s0):
        S, outs = s0, []
        for t in range(q.shape[1]):
            S = S * g[:, t].exp()[..., None, None]
            kv = (S * k[:, t].unsqueeze(-1)).sum(-2)
            S = S + k[:, t].unsqueeze(-1) * ((v[:, t] - kv) * beta[:, t].unsqueeze(-1)).unsqueeze(-2)
            outs.append(self.scale * (S * q[:, t].unsqueeze(-1)).sum(-2))
        return torch.stack(outs, dim=1), S


class GQAInStep(nn.Module):
    """Grouped value heads repeated inside the loop: each step reads q_t, k_t of Hk heads and
    repeats them to the value heads itself (``repeat_interleave``: value head h reads key head
    h // G; ``tiled``: ``repeat``, h % Hk). ``k_tiled``: the mutants' one edit, k tiled
    while q is interleaved."""

    def __init__(self, tiled=False, k_tiled=False):
        super().__init__()
        self.tiled, self.k_tiled = tiled, k_tiled

    def forward(self, q, k, v, g, beta, s0):
        groups = v.shape[2] // q.shape[2]
        S, outs = s0, []
        for t in range(q.shape[1]):
            if self.tiled:
                q_t, k_t = q[:, t].repeat(1, groups, 1), k[:, t].repeat(1, groups, 1)
            else:
                q_t, k_t = (x[:, t].repeat_interleave(groups, dim=1) for x in (q, k))
            if self.k_tiled:
                k_t = k[:, t].repeat(1, groups, 1)
            S = S * g[:, t].exp()[..., None, None]
            delta = (v[:, t] - (S * k_t[..., None]).sum(-2)) * beta[:, t][..., None]
            S = S + k_t[..., None] * delta[..., None, :]
            outs.append((S * q_t[..., None]).sum(-2))
        return torch.stack(outs, 1), S


class TwoLayers(nn.Module):
    """Two stacked recurrences (the second layer's values are the first's outputs): two loops."""

    @staticmethod
    def layer(q, k, v, g, beta, S):
        out = torch.zeros_like(v)
        for t in range(q.shape[1]):
            S = S * g[:, t].exp()[..., None, None]
            kv = (S * k[:, t].unsqueeze(-1)).sum(-2)
            S = S + k[:, t].unsqueeze(-1) * ((v[:, t] - kv) * beta[:, t].unsqueeze(-1)).unsqueeze(-2)
            out[:, t] = (S * q[:, t].unsqueeze(-1)).sum(-2)
        return out, S

    def forward(self, q, k, v, g, beta, s0):
        o1, s1 = self.layer(q, k, v, g, beta, s0)
        o2, s2 = self.layer(k, q, o1, g * 0.5, 1 - beta, s1)
        return o2, s1, s2


# --- KDA spellings ---------------------------------------------------------------------

class KDAExpUnsqueeze(nn.Module):
    """KDA's per-key decay spelled g[:, :, t].exp().unsqueeze(-1), head-major."""

    def step(self, S, q_t, k_t, v_t, g_t, b_t):
        S = S * g_t.exp().unsqueeze(-1)
        kv = (S * k_t.unsqueeze(-1)).sum(-2)
        S = S + k_t.unsqueeze(-1) * ((v_t - kv) * b_t.unsqueeze(-1)).unsqueeze(-2)
        return S, (S * q_t.unsqueeze(-1)).sum(-2)

    def forward(self, q, k, v, g, beta, s0):
        S, out = s0, torch.zeros_like(v)
        for t in range(q.shape[2]):
            S, out[:, :, t] = self.step(S, q[:, :, t], k[:, :, t], v[:, :, t], g[:, :, t],
                                        beta[:, :, t])
        return out, S


class KDAValueFirst(nn.Module):
    """KDA with a value-first state [B, H, Dv, Dk]: the decay broadcast over rows g[..., None, :]."""

    def forward(self, q, k, v, g, beta, s0):
        S, outs = s0, []
        for t in range(q.shape[1]):
            S = S * g[:, t, :, None, :].exp()
            kv = (S * k[:, t, :, None, :]).sum(-1)
            S = S + ((v[:, t] - kv) * beta[:, t, :, None])[..., None] * k[:, t, :, None, :]
            outs.append((S * q[:, t, :, None, :]).sum(-1))
        return torch.stack(outs, 1), S


class KDAMatmulPrecomputed(nn.Module):
    """KDA with decays precomputed (a = g.exp()) and `@` products, Dk == Dv, no initial state."""

    def forward(self, q, k, v, g, beta):
        B, T, H, K = q.shape
        a = g.exp()
        S = torch.zeros(B, H, K, v.shape[-1], dtype=q.dtype)
        out = torch.zeros_like(v)
        for t in range(T):
            S = a[:, t][..., None] * S
            kv = (k[:, t].unsqueeze(-2) @ S).squeeze(-2)
            S = S + k[:, t].unsqueeze(-1) @ ((v[:, t] - kv) * beta[:, t][..., None]).unsqueeze(-2)
            out[:, t] = (q[:, t].unsqueeze(-2) @ S).squeeze(-2)
        return out, S


class KDABmmMerged(nn.Module):
    """KDA with batch and heads merged ([B*H, Dk, Dv] state, bmm), decay as [B*H, Dk, 1]."""

    def forward(self, q, k, v, g, beta, s0):
        B, T, H, Dk = q.shape
        Dv = v.shape[-1]
        q, k, v, g = (x.transpose(1, 2).reshape(B * H, T, x.shape[-1]) for x in (q, k, v, g))
        beta = beta.transpose(1, 2).reshape(B * H, T, 1)
        S = s0.reshape(B * H, Dk, Dv)
        out = torch.zeros(B * H, T, Dv)
        for t in range(T):
            S = S * g[:, t].exp().unsqueeze(-1)
            delta = (v[:, t:t + 1] - torch.bmm(k[:, t:t + 1], S)) * beta[:, t:t + 1]
            S = S + torch.bmm(k[:, t:t + 1].transpose(1, 2), delta)
            out[:, t] = torch.bmm(q[:, t:t + 1], S)[:, 0]
        return out.reshape(B, H, T, Dv).transpose(1, 2), S.reshape(B, H, Dk, Dv)


class KDAInplace(nn.Module):
    """KDA with in-place mul_ / add_ on a cloned state, q scaled before the loop, list + stack."""

    def forward(self, q, k, v, g, beta, s0):
        q = q * q.shape[-1] ** -0.5
        S = s0.clone()
        outs = []
        for t in range(q.shape[1]):
            S.mul_(torch.exp(g[:, t]).unsqueeze(-1))
            kv = (S * k[:, t].unsqueeze(-1)).sum(-2)
            S.add_(k[:, t].unsqueeze(-1) * ((v[:, t] - kv) * beta[:, t].unsqueeze(-1)).unsqueeze(-2))
            outs.append((S * q[:, t].unsqueeze(-1)).sum(-2))
        return torch.stack(outs, dim=1), S


class KDAL2normEinsum(nn.Module):
    """KDA with a hand-written l2norm (x / sqrt(sum x^2 + eps), Kimi's) and einsum steps, unbind."""

    def forward(self, q, k, v, g, beta, s0):
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
        S, outs = s0, []
        for q_t, k_t, v_t, g_t, b_t in zip(q.unbind(1), k.unbind(1), v.unbind(1), g.unbind(1),
                                            beta.unbind(1)):
            S = torch.einsum("bhkv,bhk->bhkv", S, g_t.exp())
            u = torch.einsum("bhk,bhkv->bhv", k_t, S)
            S = S + torch.einsum("bhk,bhv->bhkv", k_t * b_t[..., None], v_t - u)
            outs.append(torch.einsum("bhk,bhkv->bhv", q_t, S))
        return torch.stack(outs, dim=1), S


# --- the corpus ------------------------------------------------------------------------

def _fla_gdn_reference(state):
    def reference(args, scan):
        q, k, v, beta, g = args[:5]
        o, s = scan(q, k, v, g, beta, args[5] if state else None,
                    scale=q.shape[-1] ** -0.5, norm=None)
        return (o, s) if state else o
    return reference


def _bmm_reference(args, scan):
    q, k, v, g, beta, s0 = args
    o, s = scan(q, k, v, g, beta, s0, scale=1.0, norm=None)
    return o, s.reshape(-1, *s.shape[2:])


def _sigmoid_alpha_reference(args, scan):
    q, k, v, a, beta, s0 = args
    return scan(q, k, v, F.logsigmoid(a.double()), beta, s0, scale=1.0, norm=None)


def _params_reference(args, scan):
    q, k, v, a, b, s0 = args
    g, beta = GateFromParameters().double().gates(a.double(), b.double())
    return scan(q, k, v, g, beta, s0, scale=1.0, norm=None)


def _tiled_reference(args, scan):
    """GQAInStep(tiled=True): q and k tiled to the value heads here (h % Hk), then the
    recurrence with Hk = H."""
    q, k, v, g, beta, s0 = args
    groups = v.shape[2] // q.shape[2]
    q, k = (torch.cat([x] * groups, dim=2) for x in (q, k))
    return scan(q, k, v, g, beta, s0, scale=1.0, norm=None)


def _two_layers_reference(args, scan):
    q, k, v, g, beta, s0 = args
    o1, s1 = scan(q, k, v, g, beta, s0, scale=1.0, norm=None)
    o2, s2 = scan(k, q, o1, g * 0.5, 1 - beta, s1, scale=1.0, norm=None)
    return o2, s1, s2


def _sigmoid_alpha_inputs():
    q, k, v, g, beta, s0 = standard_inputs(2, 4, 3, 4, 6, seed=21)()
    return q, k, v, torch.logit(g.exp()), beta, s0  # a with sigmoid(a) = exp(g)


def _params_inputs():
    q, k, v, g, beta, s0 = standard_inputs(2, 4, 3, 5, 4, seed=22)()
    return q, k, v, torch.randn(g.shape), torch.randn(beta.shape), s0


def _fla_gdn_inputs(state, **sizes):
    def build():
        q, k, v, g, beta, s0 = standard_inputs(**sizes)()
        return (q, k, v, beta, g, s0) if state else (q, k, v, beta, g)
    return build


_KV = dict(b=2, t=4, h=3, dk=4, dv=6)  # the default sizes: every axis a different length


def _std(**kw):
    """standard_inputs with _KV's sizes unless given."""
    sizes = {**_KV, **{n: kw.pop(n) for n in list(kw) if n in _KV}}
    return standard_inputs(sizes["b"], sizes["t"], sizes["h"], sizes["dk"], sizes["dv"], **kw)


SPELLINGS = [
    # FLA's naive references, as FLA writes them
    Spelling("fla_naive_gdn", "gdn", 1, FlaNaiveGDN,
             _fla_gdn_inputs(True, b=2, t=4, h=3, dk=4, dv=6, seed=1), _fla_gdn_reference(True)),
    Spelling("fla_naive_gdn_no_state", "gdn", 1, FlaNaiveGDNNoState,
             _fla_gdn_inputs(False, b=1, t=4, h=2, dk=8, dv=8, seed=2), _fla_gdn_reference(False)),
    Spelling("fla_naive_kda_gva", "kda", 1, FlaNaiveKDA,
             _std(b=2, t=3, h=4, hk=2, dk=4, dv=6, kda=True, seed=3),
             standard_reference(scale="rsqrt")),
    Spelling("fla_naive_kda_no_state", "kda", 1, FlaNaiveKDANoState,
             _std(b=1, t=3, h=2, dk=6, dv=6, kda=True, state=False, seed=4),
             standard_reference(scale="rsqrt", state=False, final_state=False)),
    # transformers
    Spelling("hf_qwen3_next_recurrent", "gdn", 1, HFQwen3NextRecurrent, _std(seed=5),
             standard_reference(scale="rsqrt", norm="rsqrt")),
    Spelling("hf_kimi_recurrent", "kda", 1, HFKimiRecurrent,
             _std(b=2, t=4, h=3, dk=5, dv=4, kda=True, state=False, seed=6),
             standard_reference(scale="rsqrt", norm="rsqrt", state=False, final_state=False)),
    Spelling("hf_style_gqa", "gdn", 1, HFStyleGQA, _std(b=1, t=3, h=4, hk=2, dk=6, dv=4, seed=7),
             standard_reference(scale="rsqrt", norm="rsqrt")),
    Spelling("hf_single_token", "gdn", 1, HFSingleToken, _std(t=1, seed=8),
             standard_reference(scale="rsqrt")),
    # einsum / matmul / bmm
    Spelling("einsum_head_major", "gdn", 1, EinsumHeadMajor, _std(layout="bhtd", seed=9),
             standard_reference(layout="bhtd")),
    Spelling("einsum_scale_in_loop", "gdn", 1, EinsumScaleInLoop,
             _std(b=1, t=4, h=2, dk=8, dv=8, seed=10), standard_reference(scale="rsqrt")),
    Spelling("matmul_at_cat", "gdn", 1, MatmulAt, _std(b=2, t=3, h=2, dk=6, dv=6, seed=11),
             standard_reference()),
    Spelling("torch_matmul_transposed", "gdn", 1, TorchMatmulTransposed, _std(seed=12),
             standard_reference()),
    Spelling("bmm_merged_heads", "gdn", 1, BmmMerged, _std(seed=13), _bmm_reference),
    Spelling("baddbmm_no_state", "gdn", 1, Baddbmm, _std(b=2, t=4, h=3, dk=5, dv=4, state=False,
                                                          seed=14),
             standard_reference(state=False, final_state=False)),
    # loop axes and iteration
    Spelling("seq_major_scalar_gate", "gdn", 1, SeqMajorScalarGate, _std(seed=15),
             standard_reference()),
    Spelling("time_first_iteration", "gdn", 1, TimeFirstIteration,
             _std(layout="tbhd", seed=16), standard_reference(layout="tbhd")),
    Spelling("unbind_iteration", "gdn", 1, UnbindIteration,
             _std(b=1, t=3, h=2, dk=4, dv=4, seed=17), standard_reference()),
    Spelling("slice_squeeze", "gdn", 1, SliceSqueeze, _std(seed=18),
             standard_reference(final_state=False)),
    # state layout and beta placement
    Spelling("value_first_state", "gdn", 1, ValueFirstState, _std(state_layout="vk", seed=19),
             standard_reference(state_layout="vk")),
    Spelling("value_first_matmul_square", "gdn", 1, ValueFirstMatmul,
             _std(b=2, t=3, h=2, dk=6, dv=6, state_layout="vk", seed=20),
             standard_reference(state_layout="vk")),
    Spelling("beta_on_key", "gdn", 1, BetaOnKey, _std(seed=23), standard_reference()),
    # in-place
    Spelling("inplace_mul_add", "gdn", 1, InplaceMulAdd, _std(seed=24), standard_reference()),
    Spelling("inplace_operators_no_state", "gdn", 1, InplaceOperators,
             _std(b=1, t=4, h=2, dk=8, dv=8, state=False, seed=25),
             standard_reference(state=False, final_state=False)),
    # decays
    Spelling("decay_view", "gdn", 1, DecayView, _std(layout="bhtd", seed=26),
             standard_reference(layout="bhtd")),
    Spelling("decay_reshape_then_exp", "gdn", 1, DecayReshapeThenExp, _std(seed=27),
             standard_reference()),
    Spelling("decay_none_none_square", "gdn", 1, DecayNoneNone,
             _std(b=2, t=3, h=3, dk=6, dv=6, layout="bhtd", seed=28),
             standard_reference(layout="bhtd")),
    Spelling("decay_precomputed", "gdn", 1, DecayPrecomputed, _std(seed=29),
             standard_reference()),
    Spelling("decay_sigmoid_alpha", "gdn", 1, DecaySigmoidAlpha, _sigmoid_alpha_inputs,
             _sigmoid_alpha_reference),
    Spelling("gate_from_parameters", "gdn", 1, GateFromParameters, _params_inputs,
             _params_reference),
    # q handling, several loops
    Spelling("normalize_before_loop_gqa", "gdn", 1, NormalizeBeforeLoop,
             _std(b=2, t=3, h=6, hk=3, dk=4, dv=5, seed=30),
             standard_reference(scale="rsqrt", norm="normalize")),
    Spelling("gqa_in_step", "gdn", 1, GQAInStep, _std(b=1, t=4, h=4, hk=2, dk=6, dv=4, seed=44),
             standard_reference()),
    Spelling("gqa_in_step_tiled", "gdn", 1, lambda: GQAInStep(tiled=True),
             _std(b=1, t=4, h=4, hk=2, dk=6, dv=4, seed=45), _tiled_reference),
    Spelling("scale_on_output", "gdn", 1, ScaleOnOutput, _std(seed=31),
             standard_reference(scale=0.3)),
    Spelling("two_layers", "gdn", 2, TwoLayers, _std(b=1, t=4, h=2, dk=4, dv=4, seed=32),
             _two_layers_reference),
    # KDA
    Spelling("kda_exp_unsqueeze", "kda", 1, KDAExpUnsqueeze,
             _std(layout="bhtd", kda=True, seed=33), standard_reference(layout="bhtd")),
    Spelling("kda_value_first", "kda", 1, KDAValueFirst,
             _std(kda=True, state_layout="vk", seed=34), standard_reference(state_layout="vk")),
    Spelling("kda_matmul_precomputed_square", "kda", 1, KDAMatmulPrecomputed,
             _std(b=1, t=3, h=2, dk=8, dv=8, kda=True, state=False, seed=35),
             standard_reference(state=False)),
    Spelling("kda_bmm_merged", "kda", 1, KDABmmMerged, _std(kda=True, seed=36),
             standard_reference()),
    Spelling("kda_inplace", "kda", 1, KDAInplace, _std(b=2, t=3, h=2, dk=6, dv=6, kda=True,
                                                        seed=37),
             standard_reference(scale="rsqrt")),
    Spelling("kda_l2norm_einsum", "kda", 1, KDAL2normEinsum, _std(kda=True, seed=38),
             standard_reference(norm="rsqrt")),
]


# --- mutants: one edit each -----------------------------------------------------------------

class PlainLoop(nn.Module):
    """The mutants' base: a seq-major loop with a step method (transformers-like names)."""

    def step(self, S, q_t, k_t, v_t, g_t, b_t):
        S = S * g_t.exp()[..., None, None]
        kv_mem = (S * k_t.unsqueeze(-1)).sum(dim=-2)
        delta = (v_t - kv_mem) * b_t.unsqueeze(-1)
        S = S + k_t.unsqueeze(-1) * delta.unsqueeze(-2)
        return S, (S * q_t.unsqueeze(-1)).sum(dim=-2)

    def forward(self, q, k, v, g, beta, s0):
        S, out = s0, torch.zeros_like(v)
        for t in range(q.shape[1]):
            S, out[:, t] = self.step(S, q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t])
        return out, S


SPELLINGS += [
    Spelling("plain_loop", "gdn", 1, PlainLoop, _std(seed=40), standard_reference()),
    Spelling("plain_loop_square", "gdn", 1, PlainLoop, _std(b=2, t=4, h=3, dk=5, dv=5, seed=41),
             standard_reference()),
    Spelling("kda_exp_unsqueeze_square", "kda", 1, KDAExpUnsqueeze,
             _std(b=2, t=4, h=3, dk=5, dv=5, layout="bhtd", kda=True, seed=42),
             standard_reference(layout="bhtd")),
]
SPELLING = {s.name: s for s in SPELLINGS}


class ReadoutBeforeUpdate(PlainLoop):
    def step(self, S, q_t, k_t, v_t, g_t, b_t):
        S = S * g_t.exp()[..., None, None]
        o = (S * q_t.unsqueeze(-1)).sum(dim=-2)  # moved up: reads the state before the update
        kv_mem = (S * k_t.unsqueeze(-1)).sum(dim=-2)
        delta = (v_t - kv_mem) * b_t.unsqueeze(-1)
        S = S + k_t.unsqueeze(-1) * delta.unsqueeze(-2)
        return S, o


class DecayAfterUpdate(PlainLoop):
    def step(self, S, q_t, k_t, v_t, g_t, b_t):
        kv_mem = (S * k_t.unsqueeze(-1)).sum(dim=-2)
        delta = (v_t - kv_mem) * b_t.unsqueeze(-1)
        S = S + k_t.unsqueeze(-1) * delta.unsqueeze(-2)
        S = S * g_t.exp()[..., None, None]  # moved down: decays after the update
        return S, (S * q_t.unsqueeze(-1)).sum(dim=-2)


class MissingExp(PlainLoop):
    def step(self, S, q_t, k_t, v_t, g_t, b_t):
        S = S * g_t[..., None, None]  # the log decay used as a factor (negative)
        kv_mem = (S * k_t.unsqueeze(-1)).sum(dim=-2)
        delta = (v_t - kv_mem) * b_t.unsqueeze(-1)
        S = S + k_t.unsqueeze(-1) * delta.unsqueeze(-2)
        return S, (S * q_t.unsqueeze(-1)).sum(dim=-2)


class BetaOnValueOnly(PlainLoop):
    def step(self, S, q_t, k_t, v_t, g_t, b_t):
        S = S * g_t.exp()[..., None, None]
        kv_mem = (S * k_t.unsqueeze(-1)).sum(dim=-2)
        delta = v_t * b_t.unsqueeze(-1) - kv_mem  # beta on v only, not on the memory readout
        S = S + k_t.unsqueeze(-1) * delta.unsqueeze(-2)
        return S, (S * q_t.unsqueeze(-1)).sum(dim=-2)


class WrongSignDelta(PlainLoop):
    def step(self, S, q_t, k_t, v_t, g_t, b_t):
        S = S * g_t.exp()[..., None, None]
        kv_mem = (S * k_t.unsqueeze(-1)).sum(dim=-2)
        delta = (kv_mem - v_t) * b_t.unsqueeze(-1)  # sign flipped
        S = S + k_t.unsqueeze(-1) * delta.unsqueeze(-2)
        return S, (S * q_t.unsqueeze(-1)).sum(dim=-2)


class KeyInReadout(PlainLoop):
    def step(self, S, q_t, k_t, v_t, g_t, b_t):
        S = S * g_t.exp()[..., None, None]
        kv_mem = (S * k_t.unsqueeze(-1)).sum(dim=-2)
        delta = (v_t - kv_mem) * b_t.unsqueeze(-1)
        S = S + k_t.unsqueeze(-1) * delta.unsqueeze(-2)
        return S, (S * k_t.unsqueeze(-1)).sum(dim=-2)  # k where q belongs


class QueryInMemoryRead(PlainLoop):
    def step(self, S, q_t, k_t, v_t, g_t, b_t):
        S = S * g_t.exp()[..., None, None]
        kv_mem = (S * q_t.unsqueeze(-1)).sum(dim=-2)  # q where k belongs
        delta = (v_t - kv_mem) * b_t.unsqueeze(-1)
        S = S + k_t.unsqueeze(-1) * delta.unsqueeze(-2)
        return S, (S * q_t.unsqueeze(-1)).sum(dim=-2)


class TanhState(PlainLoop):
    def step(self, S, q_t, k_t, v_t, g_t, b_t):
        S = S * g_t.exp()[..., None, None]
        kv_mem = (S * k_t.unsqueeze(-1)).sum(dim=-2)
        delta = (v_t - kv_mem) * b_t.unsqueeze(-1)
        S = torch.tanh(S + k_t.unsqueeze(-1) * delta.unsqueeze(-2))  # a nonlinearity added
        return S, (S * q_t.unsqueeze(-1)).sum(dim=-2)


class ClampState(PlainLoop):
    def step(self, S, q_t, k_t, v_t, g_t, b_t):
        S = S * g_t.exp()[..., None, None]
        kv_mem = (S * k_t.unsqueeze(-1)).sum(dim=-2)
        delta = (v_t - kv_mem) * b_t.unsqueeze(-1)
        S = (S + k_t.unsqueeze(-1) * delta.unsqueeze(-2)).clamp(-0.5, 0.5)  # clamped
        return S, (S * q_t.unsqueeze(-1)).sum(dim=-2)


class WrongSumAxis(PlainLoop):
    def step(self, S, q_t, k_t, v_t, g_t, b_t):
        S = S * g_t.exp()[..., None, None]
        kv_mem = (S * k_t.unsqueeze(-1)).sum(dim=-1)  # -1 where -2 belongs (Dk == Dv)
        delta = (v_t - kv_mem) * b_t.unsqueeze(-1)
        S = S + k_t.unsqueeze(-1) * delta.unsqueeze(-2)
        return S, (S * q_t.unsqueeze(-1)).sum(dim=-2)


class OuterSwapped(PlainLoop):
    def step(self, S, q_t, k_t, v_t, g_t, b_t):
        S = S * g_t.exp()[..., None, None]
        kv_mem = (S * k_t.unsqueeze(-1)).sum(dim=-2)
        delta = (v_t - kv_mem) * b_t.unsqueeze(-1)
        S = S + delta.unsqueeze(-1) * k_t.unsqueeze(-2)  # delta (x) k, not k (x) delta (Dk == Dv)
        return S, (S * q_t.unsqueeze(-1)).sum(dim=-2)


class StaleSource(PlainLoop):
    def forward(self, q, k, v, g, beta, s0):
        S, out = s0, torch.zeros_like(v)
        for t in range(q.shape[1]):
            v_t = v[:, max(t - 1, 0)]  # step t reads v at t-1
            S, out[:, t] = self.step(S, q[:, t], k[:, t], v_t, g[:, t], beta[:, t])
        return out, S


class SkippedStep(PlainLoop):
    def forward(self, q, k, v, g, beta, s0):
        S, out = s0, torch.zeros_like(v)
        for t in range(q.shape[1]):
            if t == 2:
                continue  # step 2 never runs (its output stays zero)
            S, out[:, t] = self.step(S, q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t])
        return out, S


class ResetMidLoop(PlainLoop):
    def forward(self, q, k, v, g, beta, s0):
        S, out = s0, torch.zeros_like(v)
        for t in range(q.shape[1]):
            if t == 2:
                S = torch.zeros_like(S)  # the state starts over at step 2
            S, out[:, t] = self.step(S, q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t])
        return out, S


class OutputShifted(PlainLoop):
    def forward(self, q, k, v, g, beta, s0):
        T = q.shape[1]
        S, out = s0, torch.zeros_like(v)
        for t in range(T):
            S, o = self.step(S, q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t])
            if t + 1 < T:
                out[:, t + 1] = o  # written one position late (the last output is dropped)
        return out, S


class LeakIntermediate(PlainLoop):
    def forward(self, q, k, v, g, beta, s0):
        S, out, mems = s0, torch.zeros_like(v), []
        for t in range(q.shape[1]):
            S = S * g[:, t].exp()[..., None, None]
            kv_mem = (S * k[:, t].unsqueeze(-1)).sum(dim=-2)
            mems.append(kv_mem)
            delta = (v[:, t] - kv_mem) * beta[:, t].unsqueeze(-1)
            S = S + k[:, t].unsqueeze(-1) * delta.unsqueeze(-2)
            out[:, t] = (S * q[:, t].unsqueeze(-1)).sum(dim=-2)
        return out, S, mems[2]  # one step's memory readout is also a model output


class StaleInitialState(PlainLoop):
    def forward(self, q, k, v, g, beta, s0):
        S, out = s0, torch.zeros_like(v)
        for t in range(q.shape[1]):
            S = S * g[:, t].exp()[..., None, None]
            kv_mem = (s0 * k[:, t].unsqueeze(-1)).sum(dim=-2)  # reads the initial state, not S
            delta = (v[:, t] - kv_mem) * beta[:, t].unsqueeze(-1)
            S = S + k[:, t].unsqueeze(-1) * delta.unsqueeze(-2)
            out[:, t] = (S * q[:, t].unsqueeze(-1)).sum(dim=-2)
        return out, S


class KDAGateOnValueAxis(KDAExpUnsqueeze):
    def step(self, S, q_t, k_t, v_t, g_t, b_t):
        S = S * g_t.exp().unsqueeze(-2)  # per-key decay broadcast along Dv instead (Dk == Dv)
        kv = (S * k_t.unsqueeze(-1)).sum(-2)
        S = S + k_t.unsqueeze(-1) * ((v_t - kv) * b_t.unsqueeze(-1)).unsqueeze(-2)
        return S, (S * q_t.unsqueeze(-1)).sum(-2)


class EinsumKeyInReadout(EinsumHeadMajor):
    def step(self, S, q_t, k_t, v_t, g_t, b_t):
        S = S * torch.exp(g_t)[:, :, None, None]
        kv = torch.einsum("bhk,bhkv->bhv", k_t, S)
        delta = (v_t - kv) * b_t[:, :, None]
        S = S + torch.einsum("bhk,bhv->bhkv", k_t, delta)
        return S, torch.einsum("bhk,bhkv->bhv", k_t, S)  # k where q belongs


class MatmulReadoutBeforeUpdate(MatmulAt):
    def step(self, S, q_t, k_t, v_t, g_t, b_t):
        S = S * g_t.exp()[..., None, None]
        o = (q_t.unsqueeze(-2) @ S).squeeze(-2)  # moved up
        kv = (k_t.unsqueeze(-2) @ S).squeeze(-2)
        delta = (v_t - kv) * b_t[..., None]
        S = S + k_t.unsqueeze(-1) @ delta.unsqueeze(-2)
        return S, o


MUTANTS = [
    Mutant("gqa_in_step_k_tiled", "gqa_in_step", lambda: GQAInStep(k_tiled=True),
           "k repeated to the value heads tiled while q is interleaved: value head h pairs q "
           "of key head h // G with k of key head h % Hk"),
    Mutant("readout_before_update", "plain_loop", ReadoutBeforeUpdate,
           "the output reads the state before the rank-one update"),
    Mutant("decay_after_update", "plain_loop", DecayAfterUpdate,
           "the decay is applied after the update, not before"),
    Mutant("missing_exp", "plain_loop", MissingExp, "S * g_t instead of S * exp(g_t)"),
    Mutant("beta_on_value_only", "plain_loop", BetaOnValueOnly,
           "delta = beta v - k^T S instead of beta (v - k^T S)"),
    Mutant("wrong_sign_delta", "plain_loop", WrongSignDelta, "delta = (k^T S - v) beta"),
    Mutant("key_in_readout", "plain_loop", KeyInReadout, "o_t = k_t^T S instead of q_t^T S"),
    Mutant("query_in_memory_read", "plain_loop", QueryInMemoryRead,
           "delta = v - q_t^T S instead of v - k_t^T S"),
    Mutant("stale_source", "plain_loop", StaleSource, "step t reads v at index t-1"),
    Mutant("skipped_step", "plain_loop", SkippedStep, "step 2 is skipped"),
    Mutant("reset_mid_loop", "plain_loop", ResetMidLoop, "the state is zeroed at step 2"),
    Mutant("tanh_state", "plain_loop", TanhState, "tanh on the updated state"),
    Mutant("clamp_state", "plain_loop", ClampState, "the updated state clamped to [-0.5, 0.5]"),
    Mutant("output_shifted", "plain_loop", OutputShifted,
           "the output of step t written at position t+1"),
    Mutant("leak_intermediate", "plain_loop", LeakIntermediate,
           "step 2's memory readout k^T S is also a model output (must not fuse)"),
    Mutant("stale_initial_state", "plain_loop", StaleInitialState,
           "the memory readout reads the initial state every step"),
    Mutant("wrong_sum_axis", "plain_loop_square", WrongSumAxis,
           "k^T S summed over Dv instead of Dk (Dk == Dv so it broadcasts)"),
    Mutant("outer_swapped", "plain_loop_square", OuterSwapped,
           "S += delta (x) k instead of k (x) delta (Dk == Dv)"),
    Mutant("kda_gate_on_value_axis", "kda_exp_unsqueeze_square", KDAGateOnValueAxis,
           "the per-key decay broadcast along Dv instead of Dk (Dk == Dv)"),
    Mutant("einsum_key_in_readout", "einsum_head_major", EinsumKeyInReadout,
           "einsum readout with k instead of q"),
    Mutant("matmul_readout_before_update", "matmul_at_cat", MatmulReadoutBeforeUpdate,
           "matmul readout moved before the update"),
]


# --- lookalikes: one edit, but still a gated delta rule ---------------------------------------

class DoubleLogDecay(PlainLoop):
    def step(self, S, q_t, k_t, v_t, g_t, b_t):
        S = S * torch.exp(2 * g_t)[..., None, None]  # exp(2 g): the log decay 2 g
        kv_mem = (S * k_t.unsqueeze(-1)).sum(dim=-2)
        delta = (v_t - kv_mem) * b_t.unsqueeze(-1)
        S = S + k_t.unsqueeze(-1) * delta.unsqueeze(-2)
        return S, (S * q_t.unsqueeze(-1)).sum(dim=-2)


class ReadoutOfDoubledState(PlainLoop):
    def step(self, S, q_t, k_t, v_t, g_t, b_t):
        S = S * g_t.exp()[..., None, None]
        kv_mem = (S * k_t.unsqueeze(-1)).sum(dim=-2)
        delta = (v_t - kv_mem) * b_t.unsqueeze(-1)
        S = S + k_t.unsqueeze(-1) * delta.unsqueeze(-2)
        return S, ((2 * S) * q_t.unsqueeze(-1)).sum(dim=-2)  # the output reads 2 S: scale 2


LOOKALIKES = [
    Mutant("decay_exp_2g", "plain_loop", DoubleLogDecay,
           "S * exp(2 g_t): a gated delta rule with log decay 2 g"),
    Mutant("readout_of_doubled_state", "plain_loop", ReadoutOfDoubledState,
           "o_t = q_t^T (2 S): a gated delta rule with scale 2"),
]

MUTANT = {m.name: m for m in MUTANTS + LOOKALIKES}
