"""A corpus of the gated linear recurrence as other authors spell it, and one-change mutants.

Every spelling computes, per step t (canonical layout: q, k [B, T, Hk, Dk], v [B, T, H, Dv],
g the log decay [B, T, H] (one per head) or [B, T, H, Dk] (one per key channel), the state
[B, H, Dk, Dv] key-first):

    S = S * exp(g_t);  S += k_t (x) v_t;  o_t = scale * q_t^T S      (no delta erase, no beta)

but each is written the way some other author writes it: FLA's naive recurrent simple-GLA and
GLA references, retention with its per-head decay built from literals, MiniMax's lightning
attention decode loop (ALiBi slopes in a buffer), a decay through the sigmoid of a parameter,
transformers' Mamba2 decode step unrolled over the sequence with a value-first state
[B, H, P, N] (q = C, k = B, v = dt * x, g = dt * A, the last two computed before the loop),
einsum / bmm / matmul steps with heads merged, time-major and head-major layouts, in-place
``mul_`` / ``add_`` updates, outputs written into a zeros buffer or gathered by list + stack,
with and without an initial and a final state. Nothing here imports gdn_fx: this is what a
recognizer is tested on.

``SPELLINGS``: the correct ones. Each records its author's ``style`` (the decompositions run
the first spelling of each style), an input builder ``args(which, seed)`` ('example': log
gates in [-0.95, -0.05], values of order 1; 'wide': log gates down to -50, values and states
of order 1e3), and ``reference(module, args, scan)``: the module's outputs recomputed by a
canonical-layout ``scan(q, k, v, g, s0, scale=)`` the test supplies (the adapter says which
layout, decay and scale the spelling uses; the arithmetic is the test's own).

``MUTANTS``: one small edit of a plain loop (named by ``base``; a mutant takes its base's
inputs). ``inside``: the edit changes the recurrence itself (no op computes it from the loop's
reads), so nothing may fuse. The others change what a gate reads and may fuse only into
something that computes them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

B, H, T, DK, DV = 2, 3, 5, 4, 5  # every axis a different length (DV != DK)


# --- inputs ------------------------------------------------------------------------------

def operands(which: str = "example", seed: int = 0, *, per_key: bool = False, dk: int = DK,
             dv: int = DV, hk: int = H) -> dict:
    """Canonical operands: q, k [B, T, Hk, Dk], v [B, T, H, Dv], g (log decay) [B, T, H] or
    [B, T, H, Dk], s0 [B, H, Dk, Dv]. 'wide': g in [-50, 0] (-50 reached), v and s0 * 1e3."""
    wide = which == "wide"
    gen = torch.Generator().manual_seed(seed + (7919 if wide else 0))

    def rnd(*shape, s=1.0):
        return torch.randn(*shape, generator=gen) * s

    u = torch.rand(*((B, T, H, dk) if per_key else (B, T, H)), generator=gen)
    if wide:
        g = -50.0 * u ** 3
        g.view(-1)[::7] = -50.0
    else:
        g = -(0.9 * u + 0.05)
    big = 1e3 if wide else 1.0
    return {"q": rnd(B, T, hk, dk), "k": rnd(B, T, hk, dk, s=0.5), "v": rnd(B, T, H, dv, s=big),
            "g": g, "s0": rnd(B, H, dk, dv, s=0.5 * big)}


def head_major(x: torch.Tensor) -> torch.Tensor:
    """[B, T, H, ...] <-> [B, H, T, ...]."""
    return x.transpose(1, 2).contiguous()


def time_major(x: torch.Tensor) -> torch.Tensor:
    """[B, T, H, ...] <-> [T, B, H, ...]."""
    return x.transpose(0, 1).contiguous()


MOVE = {"bthd": lambda x: x, "bhtd": head_major, "tbhd": time_major}


def standard_args(*, layout="bthd", state=True, per_key=False, gate=True, dk=DK, dv=DV):
    """(q, k, v[, g][, s0]) in ``layout``; the state key-first [B, H, Dk, Dv]."""
    def build(which="example", seed=0):
        x = operands(which, seed, per_key=per_key, dk=dk, dv=dv)
        names = ("q", "k", "v", "g") if gate else ("q", "k", "v")
        return tuple(MOVE[layout](x[n]) for n in names) + ((x["s0"],) if state else ())
    return build


def standard_reference(*, layout="bthd", state=True, final=True, scale=1.0, log_decay=None):
    """``reference(module, args, scan)`` for a module taking (q, k, v, g[, s0]) in ``layout``
    (or (q, k, v[, s0]) with ``log_decay(module)`` [H], float64, a fixed decay per head) and
    returning o in that layout [and the final state]. ``scale``: a number or 'rsqrt'."""
    def reference(module, args, scan):
        q, k, v = (MOVE[layout](a) for a in args[:3])
        rest = list(args[3:])
        if log_decay is None:
            g = MOVE[layout](rest.pop(0))
        else:
            g = log_decay(module).double()[None, None, :].expand(q.shape[0], q.shape[1], -1)
        s0 = rest.pop(0) if state else None
        factor = q.shape[-1] ** -0.5 if scale == "rsqrt" else scale
        o, S = scan(q, k, v, g, s0, scale=factor)
        o = MOVE[layout](o)
        return (o, S) if final else o
    return reference


# --- the records -------------------------------------------------------------------------

@dataclass(frozen=True)
class Spelling:
    name: str
    style: str  # the author's style: the decompositions run the first spelling of each
    module: Callable[[], nn.Module]
    args: Callable[..., tuple]  # (which='example' | 'wide', seed=0) -> the module's inputs
    reference: Callable  # (module, args, scan) -> the module's outputs, recomputed

    @property
    def doc(self) -> str:
        return (type(self.module()).__doc__ or "").strip().splitlines()[0]


@dataclass(frozen=True)
class Mutant:
    name: str
    base: str  # the Spelling it is one edit away from (its inputs are the base's)
    module: Callable[[], nn.Module]
    change: str  # the one edit, in words
    inside: bool = True  # the recurrence itself changes: nothing may fuse


# --- FLA: simple GLA (a scalar gate per head) -----------------------------------------------

def torch_simple_gla_recurrent(q, k, v, g, initial_state=None, scale=None):
    """Written as FLA's fla/ops/simple_gla/naive.py does: head-major [B, H, T, D], f32, q
    scaled before the loop, S.clone() * gate, zeros output buffer .to(q)."""
    B_, H_, T_, DK_ = q.shape
    original_dtype = q.dtype
    q, k, v, g = q.float(), k.float(), v.float(), g.float()
    if scale is None:
        scale = DK_ ** -0.5
    q = q * scale
    DV_ = v.shape[-1]
    if initial_state is None:
        S = torch.zeros(B_, H_, DK_, DV_).to(q)
    else:
        S = initial_state
    o = torch.zeros(B_, H_, T_, DV_).to(q)
    for i in range(T_):
        gate = g[:, :, i].exp()
        key = k[:, :, i]
        value = v[:, :, i]
        kv = key.unsqueeze(-1) * value.unsqueeze(-2)
        S = S.clone() * gate.unsqueeze(-1).unsqueeze(-1) + kv
        q_i = q[:, :, i, :]
        o_i = (q_i.unsqueeze(-1) * S).sum(-2)
        o[:, :, i] = o_i
    return o.to(original_dtype), S


class FlaSimpleGLA(nn.Module):
    """FLA's torch_simple_gla_recurrent with an initial state, the final state out."""

    def forward(self, q, k, v, g, initial_state):
        return torch_simple_gla_recurrent(q, k, v, g, initial_state=initial_state)


class FlaSimpleGLANoState(nn.Module):
    """FLA's torch_simple_gla_recurrent called as `o, _ = f(q, k, v, g)`."""

    def forward(self, q, k, v, g):
        o, _ = torch_simple_gla_recurrent(q, k, v, g)
        return o


# --- FLA: GLA (a gate per key channel) --------------------------------------------------------

def naive_recurrent_gla(q, k, v, gk, initial_state=None, output_final_state=False):
    """Written as FLA's fla/ops/gla/naive.py does: seq-major in, transposed to head-major in
    f32, h = new_zeros then h += initial_state, q scaled inside the loop, per-key gk."""
    dtype = q.dtype
    q, k, v, gk = map(lambda x: x.transpose(1, 2).float(), (q, k, v, gk))
    B_, H_, T_, K_, V_ = *q.shape, v.shape[-1]
    o = torch.zeros_like(v)
    scale = K_ ** -0.5
    h = q.new_zeros(B_, H_, K_, V_, dtype=torch.float32)
    if initial_state is not None:
        h += initial_state.float()
    for i in range(T_):
        q_i = q[:, :, i] * scale
        k_i = k[:, :, i]
        v_i = v[:, :, i]
        gk_i = gk[:, :, i].exp()
        kv_i = k_i[..., None] * v_i[..., None, :]
        h = h * gk_i[..., None] + kv_i
        o[:, :, i] = (q_i[..., None] * h).sum(-2)
    if not output_final_state:
        h = None
    return o.transpose(1, 2).to(dtype), h


class FlaGLA(nn.Module):
    """FLA's naive_recurrent_gla with an initial state and the final state out."""

    def forward(self, q, k, v, gk, initial_state):
        return naive_recurrent_gla(q, k, v, gk, initial_state, output_final_state=True)


class FlaGLAFinalOnly(nn.Module):
    """FLA's naive_recurrent_gla from a zero state, the final state out."""

    def forward(self, q, k, v, gk):
        return naive_recurrent_gla(q, k, v, gk, None, output_final_state=True)


class FlaGLANoState(nn.Module):
    """FLA's naive_recurrent_gla without a state: `o, _ = f(q, k, v, gk)`."""

    def forward(self, q, k, v, gk):
        o, _ = naive_recurrent_gla(q, k, v, gk)
        return o


# --- retention / lightning: a fixed decay per head -----------------------------------------

def retention_log_decay(n_heads: int, like: torch.Tensor) -> torch.Tensor:
    """FLA's fused_recurrent_retention: s = log(1 - 2^(-5 - h)) from literals."""
    return (1 - like.new_tensor(2., dtype=torch.float).pow(
        -5. - like.new_tensor(range(n_heads), dtype=torch.float))).log()


class RetentionRecurrent(nn.Module):
    """FLA's fused_recurrent_retention as a loop: the log decay from literals, expanded to
    [B, T, H] before the loop (as it is handed to simple GLA), seq-major, scale in the
    readout."""

    def forward(self, q, k, v, initial_state):
        B_, T_, H_, K_ = q.shape
        s = retention_log_decay(H_, q)
        g = s[None, None, :].expand(B_, T_, H_).contiguous()
        S = initial_state
        o = torch.zeros_like(v)
        for t in range(T_):
            S = S * g[:, t].exp()[..., None, None] + k[:, t, :, :, None] * v[:, t, :, None, :]
            o[:, t] = (q[:, t, :, :, None] * S).sum(-2) * K_ ** -0.5
        return o, S


class RetentionDecayInLoop(nn.Module):
    """Retention as research code writes it: the decay 1 - 2^(-5 - h) (not its log) built
    before the loop from arange, head-major, einsum steps, no initial state, o only."""

    def forward(self, q, k, v):
        B_, H_, T_, K_ = q.shape
        decay = 1 - 2.0 ** (-5.0 - torch.arange(H_, dtype=torch.float32))
        S = q.new_zeros(B_, H_, K_, v.shape[-1])
        outs = []
        for t in range(T_):
            S = decay[None, :, None, None] * S + torch.einsum("bhk,bhv->bhkv", k[:, :, t], v[:, :, t])
            outs.append(torch.einsum("bhk,bhkv->bhv", q[:, :, t], S))
        return torch.stack(outs, dim=2)


def _lightning_slopes(n: int) -> list:
    """MiniMax-Text-01's ALiBi-style slopes (its _build_slope_tensor)."""
    def power_of_2(n):
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start * start ** i for i in range(n)]

    if math.log2(n).is_integer():
        return power_of_2(n)
    closest = 2 ** math.floor(math.log2(n))
    return power_of_2(closest) + _lightning_slopes(2 * closest)[0::2][:n - closest]


class LightningDecode(nn.Module):
    """MiniMax's lightning attention decode loop: slope_rate a buffer [H, 1, 1], ratio =
    exp(-slope_rate), kv = ratio * kv + einsum of k[:, :, i:i+1] and v[..], readout einsum
    on q[:, :, i:i+1], outputs cat along the sequence; head-major; the state in and out."""

    def __init__(self):
        super().__init__()
        self.register_buffer("slope_rate", torch.tensor(_lightning_slopes(H)).reshape(H, 1, 1))

    def forward(self, q, k, v, kv):
        ratio = torch.exp(-self.slope_rate)
        output = []
        for i in range(q.shape[2]):
            kv = ratio * kv + torch.einsum("... n d, ... n e -> ... d e",
                                           k[:, :, i:i + 1], v[:, :, i:i + 1])
            qkv = torch.einsum("... n e, ... e d -> ... n d", q[:, :, i:i + 1], kv)
            output.append(qkv)
        return torch.cat(output, dim=-2), kv


class SigmoidParamDecay(nn.Module):
    """A learned per-head decay sigmoid(w) (a parameter), computed before the loop; seq-major
    einsum steps, the output buffer from empty_like, the state in and out."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.linspace(0.5, 3.0, H))

    def forward(self, q, k, v, s0):
        decay = torch.sigmoid(self.w)
        S, out = s0, torch.empty_like(v)
        for t in range(q.shape[1]):
            S = S * decay[:, None, None] + torch.einsum("bhk,bhv->bhkv", k[:, t], v[:, t])
            out[:, t] = torch.einsum("bhk,bhkv->bhv", q[:, t], S)
        return out, S


# --- Mamba2: a value-first state [B, H, P, N] ------------------------------------------------

P, N = DV, DK  # head dim (values) and state size (keys)


class Mamba2Steps(nn.Module):
    """transformers' Mamba2 decode step run over the sequence: A = -exp(A_log), v = dt * x and
    g = dt * A before the loop; the state value-first [B, H, P, N]: S = S * exp(g)[..., None,
    None] + v[..., None] * B[..., None, :]; y = S @ C; time-stacked."""

    def __init__(self):
        super().__init__()
        self.A_log = nn.Parameter(torch.log(torch.arange(1, H + 1, dtype=torch.float32)))

    def forward(self, x, dt, Bm, Cm, ssm_state):
        A = -torch.exp(self.A_log.float())
        v = dt[..., None] * x  # [B, T, H, P]
        g = dt * A  # [B, T, H]
        S, ys = ssm_state, []
        for t in range(x.shape[1]):
            S = S * torch.exp(g[:, t])[..., None, None] + v[:, t][..., None] * Bm[:, t][..., None, :]
            ys.append((S @ Cm[:, t][..., None]).squeeze(-1))
        return torch.stack(ys, dim=1), S


class Mamba2GroupsDSkip(nn.Module):
    """Mamba2 with one group: B and C [B, T, 1, N] repeat_interleave'd to the heads and dt * A
    computed before the loop; einsum readout, the D skip added after the loop, in-place
    state update on a clone; y only (the cache written back as an output)."""

    def __init__(self):
        super().__init__()
        self.A_log = nn.Parameter(torch.log(torch.arange(1, H + 1, dtype=torch.float32)))
        self.D = nn.Parameter(torch.linspace(-1.0, 1.0, H))

    def forward(self, x, dt, Bm, Cm, ssm_state):
        n_heads = x.shape[2]
        Bm = Bm.repeat_interleave(n_heads // Bm.shape[2], dim=2)
        Cm = Cm.repeat_interleave(n_heads // Cm.shape[2], dim=2)
        dA = dt * -torch.exp(self.A_log)
        dBx_v = x * dt.unsqueeze(-1)
        state = ssm_state.clone()
        y = torch.zeros_like(x)
        for t in range(x.shape[1]):
            state.mul_(dA[:, t].exp()[:, :, None, None])
            state.add_(dBx_v[:, t].unsqueeze(-1) * Bm[:, t].unsqueeze(-2))
            y[:, t] = torch.einsum("bhpn,bhn->bhp", state, Cm[:, t])
        y = y + x * self.D[:, None]
        return y, state


def mamba2_args(groups: int = H):
    """(x [B, T, H, P], dt [B, T, H] > 0, B, C [B, T, groups, N], state [B, H, P, N]); 'wide':
    dt up to 50 / 3 (dt * A down to -50), x and the state * 1e3."""
    def build(which="example", seed=0):
        wide = which == "wide"
        gen = torch.Generator().manual_seed(seed + (7919 if wide else 0) + 17)
        big = 1e3 if wide else 1.0
        u = torch.rand(B, T, H, generator=gen)
        dt = 50.0 / 3 * u ** 3 if wide else 0.05 + 0.25 * u
        if wide:
            dt.view(-1)[::7] = 50.0 / 3
        return (torch.randn(B, T, H, P, generator=gen) * big, dt,
                torch.randn(B, T, groups, N, generator=gen) * 0.5,
                torch.randn(B, T, groups, N, generator=gen),
                torch.randn(B, H, P, N, generator=gen) * 0.5 * big)
    return build


def mamba2_reference(*, d_skip=False):
    def reference(module, args, scan):
        x, dt, Bm, Cm, s0 = (a.double() for a in args)
        A = -torch.exp(module.A_log.detach().double())
        v, g = dt[..., None] * x, dt * A
        o, S = scan(Cm, Bm, v, g, s0.transpose(-1, -2), scale=1.0)  # q = C, k = B
        if d_skip:
            o = o + x * module.D.detach().double()[:, None]
        return o, S.transpose(-1, -2)
    return reference


# --- einsum / bmm / matmul, heads merged ---------------------------------------------------------

class EinsumMergedHeads(nn.Module):
    """Batch and heads merged to [B*H, T, D] (a kernel port), einsum 'nk,nv->nkv' writes and
    'nk,nkv->nv' reads, a scalar gate, the state [B*H, Dk, Dv] in and out."""

    def forward(self, q, k, v, g, s0):
        B_, T_, H_, Dk = q.shape
        Dv = v.shape[-1]
        q, k, v = (x.permute(0, 2, 1, 3).reshape(B_ * H_, T_, x.shape[-1]) for x in (q, k, v))
        a = g.permute(0, 2, 1).reshape(B_ * H_, T_).exp()
        S = s0.reshape(B_ * H_, Dk, Dv)
        outs = []
        for t in range(T_):
            S = a[:, t, None, None] * S + torch.einsum("nk,nv->nkv", k[:, t], v[:, t])
            outs.append(torch.einsum("nk,nkv->nv", q[:, t], S))
        o = torch.stack(outs, dim=1).reshape(B_, H_, T_, Dv).permute(0, 2, 1, 3)
        return o, S.reshape(B_, H_, Dk, Dv)


class BmmMergedPerKey(nn.Module):
    """GLA with torch.bmm: heads merged, the outer product as bmm of a column and a row, the
    per-key decay exp(g)[:, :, None], readout bmm of a row; no initial state, o only."""

    def forward(self, q, k, v, g):
        B_, T_, H_, Dk = q.shape
        Dv = v.shape[-1]
        q, k, v, g = (x.transpose(1, 2).reshape(B_ * H_, T_, x.shape[-1]) for x in (q, k, v, g))
        S = q.new_zeros(B_ * H_, Dk, Dv)
        out = q.new_zeros(B_ * H_, T_, Dv)
        for t in range(T_):
            S = S * torch.exp(g[:, t])[:, :, None]
            S = S + torch.bmm(k[:, t].unsqueeze(2), v[:, t].unsqueeze(1))
            out[:, t] = torch.bmm(q[:, t].unsqueeze(1), S).squeeze(1)
        return out.view(B_, H_, T_, Dv).transpose(1, 2)


class MatmulStack(nn.Module):
    """`@` steps on seq-major inputs: the write as k[..., None] @ v[..., None, :], the readout
    as q[..., None, :] @ S, scale 1/sqrt(Dk) on the output, list + stack."""

    def forward(self, q, k, v, g, s0):
        scale = q.shape[-1] ** -0.5
        S, outs = s0, []
        for t in range(q.shape[1]):
            S = S * g[:, t].exp()[..., None, None] + k[:, t][..., None] @ v[:, t][..., None, :]
            outs.append(scale * (q[:, t][..., None, :] @ S)[..., 0, :])
        return torch.stack(outs, dim=1), S


# --- loop axes ------------------------------------------------------------------------------

class TimeMajorZip(nn.Module):
    """Time-major [T, B, H, D] inputs iterated by zip, a gate per key channel, list + stack
    along time, the state in and out."""

    def forward(self, q, k, v, g, s0):
        S, outs = s0, []
        for q_t, k_t, v_t, g_t in zip(q, k, v, g):
            S = g_t.exp()[..., None] * S + k_t[..., None] * v_t[..., None, :]
            outs.append((q_t[..., None] * S).sum(-2))
        return torch.stack(outs), S


class HeadMajorUnbind(nn.Module):
    """Head-major [B, H, T, D] inputs unbound along time, scalar gate, the state in only
    (o out)."""

    def forward(self, q, k, v, g, s0):
        S, outs = s0, []
        for q_t, k_t, v_t, g_t in zip(q.unbind(2), k.unbind(2), v.unbind(2), g.unbind(2)):
            S = S * torch.exp(g_t).unsqueeze(-1).unsqueeze(-1)
            S = S + torch.einsum("bhk,bhv->bhkv", k_t, v_t)
            outs.append(torch.einsum("bhk,bhkv->bhv", q_t, S))
        return torch.stack(outs, dim=2)


# --- in place -----------------------------------------------------------------------------------

class InplaceMulAdd(nn.Module):
    """`S = s0.clone(); S.mul_(decay).add_(k v^T)`, written into a zeros buffer; both out."""

    def forward(self, q, k, v, g, s0):
        S = s0.clone()
        out = torch.zeros_like(v)
        for t in range(q.shape[1]):
            S.mul_(g[:, t].exp()[..., None, None]).add_(k[:, t].unsqueeze(-1) * v[:, t].unsqueeze(-2))
            out[:, t] = (S * q[:, t].unsqueeze(-1)).sum(-2)
        return out, S


class InplaceNoStatePerKey(nn.Module):
    """A per-key gate on a state from new_zeros, in-place `S *= ...; S += ...` operators,
    list + stack, o only."""

    def forward(self, q, k, v, g):
        S = q.new_zeros(q.shape[0], q.shape[2], q.shape[3], v.shape[3])
        outs = []
        for t in range(q.shape[1]):
            S *= g[:, t].exp().unsqueeze(-1)
            S += torch.einsum("bhk,bhv->bhkv", k[:, t], v[:, t])
            outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], S))
        return torch.stack(outs, 1)


# --- the plain loop (the mutants' base) --------------------------------------------------------

class PlainLinear(nn.Module):
    """The recurrence written plainly: seq-major, one step method, a zeros output buffer."""

    def step(self, S, q_t, k_t, v_t, g_t):
        S = S * self.decay(g_t)
        S = S + k_t.unsqueeze(-1) * v_t.unsqueeze(-2)
        return S, (S * q_t.unsqueeze(-1)).sum(dim=-2)

    def decay(self, g_t):
        return g_t.exp()[..., None, None]

    def forward(self, q, k, v, g, s0):
        S, out = s0, torch.zeros_like(v)
        for t in range(q.shape[1]):
            S, out[:, t] = self.step(S, q[:, t], k[:, t], v[:, t], g[:, t])
        return out, S


class PlainLinearPerKey(PlainLinear):
    """The plain loop with a gate per key channel, Dk == Dv."""

    def decay(self, g_t):
        return g_t.exp().unsqueeze(-1)


def _std(**kw):
    args_kw = {n: kw.pop(n) for n in ("per_key", "dk", "dv", "gate") if n in kw}
    args_kw.update({n: kw[n] for n in ("layout", "state") if n in kw})
    return dict(args=standard_args(**args_kw), reference=standard_reference(**kw))


def _retention_decay(module):
    return torch.log(1 - 2.0 ** (-5.0 - torch.arange(H, dtype=torch.float64)))


def _lightning_decay(module):
    return -torch.tensor(_lightning_slopes(H), dtype=torch.float64)


def _sigmoid_decay(module):
    return torch.log(torch.sigmoid(module.w.detach().double()))


SPELLINGS = [
    Spelling("fla_simple_gla", "fla_simple_gla", FlaSimpleGLA,
             **_std(layout="bhtd", scale="rsqrt")),
    Spelling("fla_simple_gla_no_state", "fla_simple_gla", FlaSimpleGLANoState,
             **_std(layout="bhtd", scale="rsqrt", state=False, final=False)),
    Spelling("fla_gla", "fla_gla", FlaGLA, **_std(per_key=True, scale="rsqrt")),
    Spelling("fla_gla_final_only", "fla_gla", FlaGLAFinalOnly,
             **_std(per_key=True, scale="rsqrt", state=False)),
    Spelling("fla_gla_no_state", "fla_gla", FlaGLANoState,
             **_std(per_key=True, scale="rsqrt", state=False, final=False)),
    Spelling("retention_literal_decay", "retention", RetentionRecurrent,
             **_std(gate=False, scale="rsqrt", log_decay=_retention_decay)),
    Spelling("retention_decay_in_loop", "retention", RetentionDecayInLoop,
             **_std(gate=False, layout="bhtd", state=False, final=False,
                    log_decay=_retention_decay)),
    Spelling("lightning_decode", "retention", LightningDecode,
             **_std(gate=False, layout="bhtd", log_decay=_lightning_decay)),
    Spelling("sigmoid_param_decay", "retention", SigmoidParamDecay,
             **_std(gate=False, log_decay=_sigmoid_decay)),
    Spelling("mamba2_steps", "mamba2", Mamba2Steps, mamba2_args(), mamba2_reference()),
    Spelling("mamba2_groups_d_skip", "mamba2", Mamba2GroupsDSkip, mamba2_args(groups=1),
             mamba2_reference(d_skip=True)),
    Spelling("einsum_merged_heads", "merged", EinsumMergedHeads, **_std()),
    Spelling("bmm_merged_per_key", "merged", BmmMergedPerKey,
             **_std(per_key=True, state=False, final=False)),
    Spelling("matmul_stack", "merged", MatmulStack, **_std(scale="rsqrt")),
    Spelling("time_major_zip", "layouts", TimeMajorZip, **_std(layout="tbhd", per_key=True)),
    Spelling("head_major_unbind", "layouts", HeadMajorUnbind,
             **_std(layout="bhtd", final=False)),
    Spelling("inplace_mul_add", "inplace", InplaceMulAdd, **_std()),
    Spelling("inplace_no_state_per_key", "inplace", InplaceNoStatePerKey,
             **_std(per_key=True, state=False, final=False)),
    Spelling("plain_linear", "plain", PlainLinear, **_std()),
    Spelling("plain_linear_per_key", "plain", PlainLinearPerKey,
             **_std(per_key=True, dv=DK)),
]

SPELLING = {s.name: s for s in SPELLINGS}


# --- mutants -------------------------------------------------------------------------------------

class DecayAfterWrite(PlainLinear):
    def step(self, S, q_t, k_t, v_t, g_t):
        S = (S + k_t.unsqueeze(-1) * v_t.unsqueeze(-2)) * self.decay(g_t)  # decays the write too
        return S, (S * q_t.unsqueeze(-1)).sum(dim=-2)


class ReadoutBeforeWrite(PlainLinear):
    def step(self, S, q_t, k_t, v_t, g_t):
        S = S * self.decay(g_t)
        o = (S * q_t.unsqueeze(-1)).sum(dim=-2)  # moved up: reads the state before the write
        return S + k_t.unsqueeze(-1) * v_t.unsqueeze(-2), o


class MissingWrite(PlainLinear):
    def forward(self, q, k, v, g, s0):
        S, out = s0, torch.zeros_like(v)
        for t in range(q.shape[1]):
            S = S * self.decay(g[:, t])
            if t != 2:  # step 2 decays but writes nothing
                S = S + k[:, t].unsqueeze(-1) * v[:, t].unsqueeze(-2)
            out[:, t] = (S * q[:, t].unsqueeze(-1)).sum(dim=-2)
        return out, S


class DoubledWrite(PlainLinear):
    def step(self, S, q_t, k_t, v_t, g_t):
        S = S * self.decay(g_t) + 2 * k_t.unsqueeze(-1) * v_t.unsqueeze(-2)  # 2 k v^T
        return S, (S * q_t.unsqueeze(-1)).sum(dim=-2)


class TanhCap(PlainLinear):
    def step(self, S, q_t, k_t, v_t, g_t):
        S, o = super().step(S, q_t, k_t, v_t, g_t)
        c = 1e2
        S = c * torch.tanh(S / c)  # a clamp of the state spelled without clamp (after readout)
        return S, o


class WindowReset(PlainLinear):
    def forward(self, q, k, v, g, s0):
        S, out = s0, torch.zeros_like(v)
        for t in range(q.shape[1]):
            if t > 0 and t % 4 == 0:
                S = torch.zeros_like(S)  # a window: the state starts over every 4 steps
            S, out[:, t] = self.step(S, q[:, t], k[:, t], v[:, t], g[:, t])
        return out, S


class DeltaErase(PlainLinear):
    def step(self, S, q_t, k_t, v_t, g_t):
        S = S * self.decay(g_t)
        err = v_t - (S * k_t.unsqueeze(-1)).sum(dim=-2)  # the delta rule's erase, beta = 1
        S = S + k_t.unsqueeze(-1) * err.unsqueeze(-2)
        return S, (S * q_t.unsqueeze(-1)).sum(dim=-2)


class GateWrongSign(PlainLinear):
    def decay(self, g_t):
        return torch.exp(-g_t)[..., None, None]  # exp(-g): grows where it should decay


class GateWrongAxis(PlainLinearPerKey):
    def decay(self, g_t):
        return g_t.exp().unsqueeze(-2)  # the per-key gate broadcast along Dv (Dk == Dv)


MUTANTS = [
    Mutant("decay_after_write", "plain_linear", DecayAfterWrite,
           "S = (S + k v^T) * decay: the decay applied after the write"),
    Mutant("readout_before_write", "plain_linear", ReadoutBeforeWrite,
           "o_t reads the decayed state before k v^T is written"),
    Mutant("missing_write", "plain_linear", MissingWrite, "step 2 writes no k v^T"),
    Mutant("doubled_write", "plain_linear", DoubledWrite, "S = S * decay + 2 k v^T"),
    Mutant("tanh_cap", "plain_linear", TanhCap, "S = c tanh(S / c), c = 1e2, every step"),
    Mutant("window_reset", "plain_linear", WindowReset, "the state reset every 4 steps"),
    Mutant("delta_erase", "plain_linear", DeltaErase,
           "S += k (v - k^T S)^T: the delta rule with beta = 1 (no beta read)"),
    Mutant("gate_wrong_axis", "plain_linear_per_key", GateWrongAxis,
           "the per-key decay broadcast along Dv instead of Dk"),
    Mutant("gate_wrong_sign", "plain_linear", GateWrongSign,
           "S * exp(-g_t): the gate's sign flipped", inside=False),
]

MUTANT = {m.name: m for m in MUTANTS}
