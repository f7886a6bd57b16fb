"""Piecewise mutants of the gated delta rule and of the conv update (issue 30, item 1).

A piecewise operation (clamp, min / max, where, a comparison, relu, sign, hardtanh, threshold,
nan_to_num, masked_fill) whose threshold ordinary random draws never reach leaves a step that
equals the delta rule wherever those draws land, and is not the delta rule past the threshold.
Each mutant here is one such operation put into a correct loop, at one site of the step:

    gate   the log gate g_t (before its exp)          beta   beta_t
    v      v_t                                         k      k_t (both of its uses)
    decayed  S * exp(g_t), before the rank-one update  kv     k_t^T S (the memory read)
    delta    (v_t - k_t^T S) beta_t                    state  S after the update
    out      o_t

written into the loops of several authors' styles (``BASES``): transformers' recurrent torch
fallback (head-major loop, key-first state, q / sqrt(Dk)), FLA's naive recurrent reference
((q, k, v, beta, g) order, clones, einsum readout), an einsum step on head-major inputs, a
merged-heads bmm step, a KDA step with one gate per key. Plus a hand-written chunked (WY) form
with a piecewise op on the state carried between chunks or on the cumulative gate, and the conv
update with one on its pre-activation output or on its state.

Every mutant records how to build inputs that cross its threshold (``cross``); the tests check
that the mutant equals its base on ordinary draws and differs from it past the threshold, so
no mutant here can be one that leaves the math unchanged. ``CONTROLS``: loops that must still
fuse (piecewise ops that are identities on every input, clamps applied to the inputs before the
loop or to its output after it, the unmodified bases). ``LOOKALIKES``: identities a detection
may well not see through (fused or not, never wrong).

Nothing here imports gdn_fx.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

B, T, H, DK, DV = 1, 4, 2, 4, 6


# --- the piecewise operations ---------------------------------------------------------------

@dataclass(frozen=True)
class Piece:
    """One piecewise operation, as a function of the threshold c: ``make(c)(x)``.

    ``sides``: where it acts: 'both' (|x| > c), 'low' (x < -c), 'high' (x > c), or
    'nonfinite' (only on inf / nan)."""

    name: str
    make: Callable[[float], Callable[[torch.Tensor], torch.Tensor]]
    sides: str
    ops: tuple  # the op names a near-miss may name (loosely)


def _clamp(c):
    return lambda x: x.clamp(-c, c)


def _clip(c):
    return lambda x: torch.clip(x, min=-c, max=c)


def _clamp_min(c):
    return lambda x: x.clamp(min=-c)


def _clamp_max(c):
    return lambda x: x.clamp(max=c)


def _clamp_inplace(c):  # only where x is a fresh tensor of the step (the state)
    return lambda x: x.clamp_(-c, c)


def _where_zero(c):
    return lambda x: torch.where(x.abs() > c, torch.zeros_like(x), x)


def _where_low(c):
    return lambda x: torch.where(x < -c, torch.full_like(x, -c), x)


def _where_scalar(c):
    return lambda x: torch.where(x > c, c, x)


def _maximum(c):
    return lambda x: torch.maximum(x, torch.full_like(x, -c))


def _minimum(c):
    return lambda x: torch.minimum(x, torch.full_like(x, c))


def _relu_shift(c):
    return lambda x: F.relu(x + c) - c


def _nan_to_num(c):
    return lambda x: torch.nan_to_num(x, nan=0.0, posinf=c, neginf=-c)


def _sign_gate(c):  # x where |x| < c, x / 2 at |x| = c, 0 beyond
    return lambda x: x * (torch.sign(c - x.abs()) + 1) * 0.5


def _compare_mul(c):
    return lambda x: x * (x.abs() < c)


def _hardtanh(c):
    return lambda x: F.hardtanh(x, -c, c)


def _threshold(c):  # x where x > -c, else -c
    return lambda x: F.threshold(x, -c, -c)


def _masked_fill(c):
    return lambda x: x.masked_fill(x.abs() > c, 0.0)


def _sign_abs_min(c):  # a clamp spelled with sign, abs and minimum
    return lambda x: torch.sign(x) * torch.minimum(x.abs(), torch.full_like(x, c))


PIECES = {p.name: p for p in [
    Piece("clamp", _clamp, "both", ("clamp",)),
    Piece("clip", _clip, "both", ("clamp", "clip")),
    Piece("clamp_min", _clamp_min, "low", ("clamp",)),
    Piece("clamp_max", _clamp_max, "high", ("clamp",)),
    Piece("clamp_inplace", _clamp_inplace, "both", ("clamp",)),
    Piece("where_zero", _where_zero, "both", ("where", "abs", "gt")),
    Piece("where_low", _where_low, "low", ("where", "lt")),
    Piece("where_scalar", _where_scalar, "high", ("where", "gt")),
    Piece("maximum", _maximum, "low", ("maximum", "max")),
    Piece("minimum", _minimum, "high", ("minimum", "min")),
    Piece("relu_shift", _relu_shift, "low", ("relu", "clamp")),
    Piece("nan_to_num", _nan_to_num, "nonfinite", ("nan_to_num", "isnan", "isinf", "where")),
    Piece("sign_gate", _sign_gate, "both", ("sign", "abs")),
    Piece("compare_mul", _compare_mul, "both", ("lt", "abs")),
    Piece("hardtanh", _hardtanh, "both", ("hardtanh", "clamp")),
    Piece("threshold", _threshold, "low", ("threshold", "where", "le")),
    Piece("masked_fill", _masked_fill, "both", ("masked_fill", "where", "abs", "gt")),
    Piece("sign_abs_min", _sign_abs_min, "both", ("sign", "abs", "minimum")),
]}


class Edits(nn.Module):
    """The mutation points of a step: ``at(site, x)`` is x, or the site's operation of x (a
    module when it holds a buffer, as one of ``wide_spellings`` does: it is then a submodule
    of the loop's module)."""

    def __init__(self, site: Optional[str] = None, fn: Optional[Callable] = None):
        super().__init__()
        self.site, self.fn = site, fn

    def forward(self, site: str, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x) if site == self.site else x


def _cast(x: torch.Tensor, dtype: Optional[torch.dtype]) -> torch.Tensor:
    """x in ``dtype``; x as it is when dtype is None (the caller's dtype)."""
    return x if dtype is None else x.to(dtype)


# --- the bases: one loop per author ----------------------------------------------------------
# Canonical operands (what a test draws): q, k [B, T, H, Dk], v [B, T, H, Dv], g (log decay)
# [B, T, H] or [B, T, H, Dk] (KDA), beta [B, T, H], s0 [B, H, Dk, Dv] (key first). Each base
# says how it takes them (``args``) and what scale it applies to q.

class TransformersStyle(nn.Module):
    """transformers' torch_recurrent_gated_delta_rule style: sequence-major in, transposed to
    [B, H, T, D] in f32, q / sqrt(Dk), state key-first, kv_mem / delta, a preallocated output
    buffer written at [:, :, i]. ``dtype``: what it computes in (None: the caller's dtype, as
    ``wide_spellings``' port has it)."""

    dtype: Optional[torch.dtype] = torch.float32

    def __init__(self, site=None, fn=None):
        super().__init__()
        self.at = Edits(site, fn)

    def forward(self, query, key, value, g, beta, initial_state):
        at = self.at
        query, key, value, beta, g = [_cast(x.transpose(1, 2).contiguous(), self.dtype)
                                      for x in (query, key, value, beta, g)]
        query = query * (1 / (query.shape[-1] ** 0.5))
        state = initial_state.to(value)
        core_attn_out = torch.zeros_like(value)
        for i in range(query.shape[2]):
            q_t = query[:, :, i]
            k_t = at("k", key[:, :, i])
            v_t = at("v", value[:, :, i])
            g_t = at("gate", g[:, :, i]).exp().unsqueeze(-1).unsqueeze(-1)
            beta_t = at("beta", beta[:, :, i]).unsqueeze(-1)
            state = at("decayed", state * g_t)
            kv_mem = at("kv", (state * k_t.unsqueeze(-1)).sum(dim=-2))
            delta = at("delta", (v_t - kv_mem) * beta_t)
            state = at("state", state + k_t.unsqueeze(-1) * delta.unsqueeze(-2))
            core_attn_out[:, :, i] = at("out", (state * q_t.unsqueeze(-1)).sum(dim=-2))
        return core_attn_out.transpose(1, 2).contiguous(), state


class FlaNaiveStyle(nn.Module):
    """FLA's naive recurrent reference style: (q, k, v, beta, g) order, head-major f32, q
    scaled up front, ``h.clone()`` everywhere, the readout by einsum into a zeros buffer.
    ``dtype``: what it computes in (None: the caller's dtype, as ``wide_spellings``' port has
    it)."""

    dtype: Optional[torch.dtype] = torch.float32

    def __init__(self, site=None, fn=None):
        super().__init__()
        self.at = Edits(site, fn)

    def forward(self, q, k, v, beta, g, initial_state):
        at = self.at
        q, k, v, beta, g = map(lambda x: _cast(x.transpose(1, 2).contiguous(), self.dtype),
                               [q, k, v, beta, g])
        Bn, Hn, Tn, Kd = k.shape
        o = torch.zeros(Bn, Hn, Tn, v.shape[-1]).to(v)
        h = _cast(initial_state, self.dtype)
        q = q * Kd ** -0.5
        for i in range(Tn):
            b_q = q[:, :, i]
            b_k = at("k", k[:, :, i])
            b_v = at("v", v[:, :, i].clone())
            h = at("decayed", h.clone() * at("gate", g[:, :, i]).exp()[..., None, None])
            b_beta = at("beta", beta[:, :, i])
            b_v = b_v - at("kv", (h.clone() * b_k[..., None]).sum(-2))
            b_v = at("delta", b_v * b_beta[..., None])
            h = at("state", h.clone() + b_k.unsqueeze(-1) * b_v.unsqueeze(-2))
            o[:, :, i] = at("out", torch.einsum("bhd,bhdm->bhm", b_q, h))
        return o.transpose(1, 2).contiguous(), h


class EinsumStep(nn.Module):
    """Research code: head-major [B, H, T, D] inputs, a step method of einsums, no scale, the
    outputs in a list and stacked."""

    def __init__(self, site=None, fn=None):
        super().__init__()
        self.at = Edits(site, fn)

    def step(self, S, q_t, k_t, v_t, g_t, b_t):
        at = self.at
        k_t, v_t = at("k", k_t), at("v", v_t)
        S = at("decayed", S * torch.exp(at("gate", g_t))[:, :, None, None])
        pred = at("kv", torch.einsum("bhk,bhkv->bhv", k_t, S))
        err = at("delta", (v_t - pred) * at("beta", b_t)[:, :, None])
        S = at("state", S + torch.einsum("bhk,bhv->bhkv", k_t, err))
        return S, at("out", torch.einsum("bhk,bhkv->bhv", q_t, S))

    def forward(self, q, k, v, g, beta, s0):
        S, outs = s0, []
        for t in range(q.shape[2]):
            S, o = self.step(S, q[:, :, t], k[:, :, t], v[:, :, t], g[:, :, t], beta[:, :, t])
            outs.append(o)
        return torch.stack(outs, dim=2), S


class BmmStep(nn.Module):
    """A kernel port: batch and heads merged to [B*H, ...], torch.bmm for the read, the
    rank-one update and the readout, outputs concatenated, the state handed back merged."""

    def __init__(self, site=None, fn=None):
        super().__init__()
        self.at = Edits(site, fn)

    def forward(self, q, k, v, g, beta, s0):
        at = self.at
        Bn, Tn, Hn, Dk = q.shape
        Dv = v.shape[-1]
        q, k, v = (x.permute(0, 2, 1, 3).reshape(Bn * Hn, Tn, x.shape[-1]) for x in (q, k, v))
        g, beta = (x.permute(0, 2, 1).reshape(Bn * Hn, Tn) for x in (g, beta))
        S = s0.reshape(Bn * Hn, Dk, Dv)
        outs = []
        for t in range(Tn):
            k_t, v_t = at("k", k[:, t]), at("v", v[:, t])
            S = at("decayed", S * torch.exp(at("gate", g[:, t])).view(-1, 1, 1))
            kv = at("kv", torch.bmm(k_t.unsqueeze(1), S).squeeze(1))
            delta = at("delta", (v_t - kv) * at("beta", beta[:, t]).unsqueeze(1))
            S = at("state", S + torch.bmm(k_t.unsqueeze(2), delta.unsqueeze(1)))
            outs.append(at("out", torch.bmm(q[:, t].unsqueeze(1), S)))
        o = torch.cat(outs, dim=1)
        return o.reshape(Bn, Hn, Tn, Dv).permute(0, 2, 1, 3), S


class KdaStep(nn.Module):
    """A Kimi-delta step: one log gate per key (g [B, T, H, Dk]), S * exp(g_t)[..., None],
    beta on the key inside the outer product, q / sqrt(Dk), sequence-major buffer."""

    def __init__(self, site=None, fn=None):
        super().__init__()
        self.at = Edits(site, fn)

    def forward(self, q, k, v, g, beta, s0):
        at = self.at
        scale = q.shape[-1] ** -0.5
        S = s0.clone()
        o = torch.zeros_like(v)
        for i in range(q.shape[1]):
            k_i, v_i = at("k", k[:, i]), at("v", v[:, i])
            S = at("decayed", S * at("gate", g[:, i])[..., None].exp())
            read = at("kv", (k_i[..., None] * S).sum(-2))
            b_i = at("beta", beta[:, i])
            upd = at("delta", b_i[..., None] * (v_i - read))
            S = at("state", S + torch.einsum("bhk,bhv->bhkv", k_i, upd))
            o[:, i] = at("out", torch.einsum("bhk,bhkv->bhv", q[:, i] * scale, S))
        return o, S


def _hm(x):
    return x.transpose(1, 2).contiguous()


@dataclass(frozen=True)
class Base:
    name: str
    module: type
    kda: bool
    scale: str  # "rsqrt" or "one"
    args: Callable  # canonical dict -> the module's arguments
    outs: Callable  # the module's outputs -> canonical (o [B, T, H, Dv], S [B, H, Dk, Dv])
    hop: bool = False  # a loop handed to a higher-order op (``wide_spellings``' scan loop)


BASES = {b.name: b for b in [
    Base("transformers", TransformersStyle, False, "rsqrt",
         lambda x: (x["q"], x["k"], x["v"], x["g"], x["beta"], x["s0"]), lambda r: r),
    Base("fla_naive", FlaNaiveStyle, False, "rsqrt",
         lambda x: (x["q"], x["k"], x["v"], x["beta"], x["g"], x["s0"]), lambda r: r),
    Base("einsum", EinsumStep, False, "one",
         lambda x: tuple(_hm(x[n]) for n in ("q", "k", "v", "g", "beta")) + (x["s0"],),
         lambda r: (_hm(r[0]), r[1])),
    Base("bmm", BmmStep, False, "one",
         lambda x: (x["q"], x["k"], x["v"], x["g"], x["beta"], x["s0"]),
         lambda r: (r[0], r[1].reshape(B, H, DK, DV))),
    Base("kda", KdaStep, True, "rsqrt",
         lambda x: (x["q"], x["k"], x["v"], x["g"], x["beta"], x["s0"]), lambda r: r),
]}


# --- inputs ------------------------------------------------------------------------------

def operands(*, kda=False, t=T, seed=0) -> dict:
    """Ordinary canonical operands: q, k ~ N(0, 1) * (1, 0.5), v ~ N(0, 1), g in
    [-0.95, -0.05], beta in [0.05, 0.95], s0 ~ N(0, 0.25)."""
    gen = torch.Generator().manual_seed(seed)
    gate = (B, t, H, DK) if kda else (B, t, H)
    return {"q": torch.randn(B, t, H, DK, generator=gen),
            "k": torch.randn(B, t, H, DK, generator=gen) * 0.5,
            "v": torch.randn(B, t, H, DV, generator=gen),
            "g": -(torch.rand(*gate, generator=gen) * 0.9 + 0.05),
            "beta": torch.rand(B, t, H, generator=gen) * 0.9 + 0.05,
            "s0": torch.randn(B, H, DK, DV, generator=gen) * 0.5}


def draws(*, kda=False, t=T, seed=0) -> dict:
    """What a checker that draws at random sees: every operand uniform in [-1, 1] * 0.5
    (gates and betas of either sign included)."""
    gen = torch.Generator().manual_seed(seed)
    x = operands(kda=kda, t=t, seed=seed)
    return {n: (torch.rand(a.shape, generator=gen) * 2 - 1) * 0.5 for n, a in x.items()}


def cross(site: str, piece: Piece, c: float, x: dict, seed: int = 5) -> dict:
    """``x`` (ordinary operands) changed so that the value at ``site`` crosses the threshold
    c on the side(s) where ``piece`` acts (and stays below it elsewhere). The delta rule is
    linear in (S, v) together and its output linear in q: scaling those scales every value
    downstream."""
    gen = torch.Generator().manual_seed(seed)
    x = {n: a.clone() for n, a in x.items()}
    if piece.sides == "nonfinite":
        name = {"gate": "g", "v": "v", "out": "s0", "k": "k"}.get(site, "s0")
        a = x[name].flatten()
        a[0], a[-1] = (-math.inf, -math.inf) if site == "gate" else (math.inf, -math.inf)
        x[name] = a.view(x[name].shape)
        return x
    if site == "gate":  # log gates beyond -c (no author clamps a gate from above)
        x["g"] = x["g"] - c * (1.0 + torch.rand(x["g"].shape, generator=gen))
        x["s0"] = x["s0"] * 10  # the decayed state counts for something after the step
    elif site == "beta":  # a third of the betas beyond c, a third beyond -c, the rest kept
        far = c * (1.5 + torch.rand(x["beta"].shape, generator=gen)).flatten()
        beta = x["beta"].flatten()
        beta[0::3], beta[1::3] = far[0::3], -far[1::3]
        x["beta"] = beta.view(x["beta"].shape)
    elif site == "k":
        x["k"] = x["k"] * (3 * c)
    elif site == "v":
        x["v"] = x["v"] * (3 * c)
    elif site == "out":
        x["q"] = x["q"] * (6 * c)
    else:  # decayed, kv, delta, state: S and v together
        x["s0"], x["v"] = x["s0"] * (6 * c), x["v"] * (6 * c)
    return x


# --- the step mutants -------------------------------------------------------------------------

# sites whose value is per-step input or output only: a piecewise op there commutes with the
# loop (it is the op applied to the whole input before, or the whole output after), so a
# collapse may fuse it with the op kept outside; elsewhere it is inside the recurrence.
OUTSIDE_SITES = ("gate", "beta", "v", "k", "out")
INSIDE_SITES = ("decayed", "kv", "delta", "state")


@dataclass(frozen=True)
class Mutant:
    name: str
    base: str
    site: str
    piece: str
    c: float
    t: int = T

    @property
    def module(self) -> Callable[[], nn.Module]:
        base, fn = BASES[self.base], PIECES[self.piece].make(self.c)
        return lambda: base.module(self.site, fn)

    @property
    def inside(self) -> bool:
        return self.site in INSIDE_SITES

    @property
    def change(self) -> str:
        return f"{self.piece}(c={self.c:g}) on {self.site} in the {self.base} loop"


def _m(base, site, piece, c, t=T):
    tag = f"{c:g}".replace(".", "p").replace("+", "")
    return Mutant(f"{base}_{site}_{piece}_{tag}", base, site, piece, c, t)


_STATE = [  # on the state after the update: every kind, spread over the authors
    ("transformers", "clamp", 4.0), ("transformers", "clamp", 20.0),
    ("transformers", "clamp", 1e3), ("fla_naive", "clamp", 20.0), ("einsum", "clamp", 20.0),
    ("bmm", "clamp", 20.0), ("kda", "clamp", 20.0), ("kda", "clamp", 1e3),
    ("fla_naive", "clip", 20.0), ("transformers", "clamp_inplace", 20.0),
    ("einsum", "clamp_min", 20.0), ("bmm", "clamp_max", 20.0),
    ("transformers", "where_zero", 20.0), ("einsum", "where_low", 20.0),
    ("kda", "where_scalar", 20.0), ("bmm", "maximum", 20.0), ("fla_naive", "minimum", 20.0),
    ("transformers", "relu_shift", 10.0), ("einsum", "nan_to_num", 1e3),
    ("kda", "nan_to_num", 1e3), ("fla_naive", "sign_gate", 20.0),
    ("bmm", "compare_mul", 20.0), ("kda", "hardtanh", 20.0), ("transformers", "threshold", 20.0),
    ("einsum", "masked_fill", 20.0), ("bmm", "sign_abs_min", 20.0),
]
_INSIDE = [  # elsewhere inside the recurrence
    ("transformers", "decayed", "clamp", 20.0), ("kda", "decayed", "where_zero", 20.0),
    ("fla_naive", "kv", "clamp", 20.0), ("bmm", "kv", "hardtanh", 20.0),
    ("einsum", "delta", "clamp", 20.0), ("transformers", "delta", "compare_mul", 20.0),
]
_GATE = [  # on the log gate: thresholds below the gates (g_t.clamp(min=-5))
    ("transformers", "clamp_min", 5.0), ("fla_naive", "clamp_min", 5.0),
    ("einsum", "clamp_min", 5.0), ("bmm", "clamp_min", 5.0), ("kda", "clamp_min", 5.0),
    ("transformers", "clamp", 5.0), ("kda", "maximum", 5.0), ("einsum", "relu_shift", 5.0),
    ("bmm", "threshold", 5.0), ("fla_naive", "where_low", 5.0), ("kda", "where_zero", 5.0),
    ("transformers", "hardtanh", 5.0), ("einsum", "compare_mul", 5.0),
    ("bmm", "sign_gate", 5.0), ("fla_naive", "nan_to_num", 5.0), ("kda", "masked_fill", 5.0),
]
_BETA = [  # on beta: beta.clamp(max=3) and its kin
    ("transformers", "clamp_max", 3.0), ("fla_naive", "clamp", 3.0), ("einsum", "minimum", 3.0),
    ("bmm", "where_scalar", 3.0), ("kda", "hardtanh", 3.0), ("transformers", "maximum", 3.0),
    ("einsum", "compare_mul", 3.0),
]
_V = [
    ("transformers", "clamp", 20.0), ("fla_naive", "where_zero", 20.0),
    ("bmm", "compare_mul", 20.0), ("kda", "clamp", 20.0), ("einsum", "nan_to_num", 1e3),
]
_K = [("einsum", "clamp", 4.0), ("transformers", "hardtanh", 4.0)]
_OUT = [
    ("transformers", "maximum", 20.0), ("fla_naive", "minimum", 20.0),
    ("einsum", "clamp", 20.0), ("bmm", "relu_shift", 10.0), ("kda", "where_zero", 20.0),
    ("transformers", "nan_to_num", 1e3), ("kda", "sign_gate", 20.0),
    ("fla_naive", "threshold", 20.0),
]

MUTANTS = ([_m(b, "state", p, c) for b, p, c in _STATE]
           + [_m(b, s, p, c) for b, s, p, c in _INSIDE]
           + [_m(b, "gate", p, c) for b, p, c in _GATE]
           + [_m(b, "beta", p, c) for b, p, c in _BETA]
           + [_m(b, "v", p, c) for b, p, c in _V]
           + [_m(b, "k", p, c, t=3) for b, p, c in _K]
           + [_m(b, "out", p, c) for b, p, c in _OUT]
           # T = 8 and T = 3 versions of the issue's own two examples
           + [_m("transformers", "state", "clamp", 4.0, t=8),
              _m("fla_naive", "gate", "clamp_min", 5.0, t=3)])
MUTANTS = [Mutant(m.name + ("" if m.t == T else f"_t{m.t}"), m.base, m.site, m.piece, m.c, m.t)
           for m in MUTANTS]
MUTANT = {m.name: m for m in MUTANTS}


# --- controls: must still fuse ---------------------------------------------------------------

class WhereConstMask(TransformersStyle):
    """torch.where(mask, S, S) on the state, the mask a constant: S on every input."""

    def __init__(self):
        super().__init__("state", lambda x: torch.where(
            torch.ones(x.shape, dtype=torch.bool), x, x))


class WhereAllTrueMask(TransformersStyle):
    """torch.where(ones mask, S, 0): the constant mask picks S everywhere."""

    def __init__(self):
        super().__init__("state", lambda x: torch.where(
            torch.ones(x.shape, dtype=torch.bool), x, torch.zeros_like(x)))


class ClampedInputsBefore(nn.Module):
    """The inputs clamped before the loop (beta to [0, 1], g from below at -5, v to [-20, 20]):
    other inputs, the same rule (a sequence-major loop, the scale on each output)."""

    def forward(self, q, k, v, g, beta, s0):
        beta = beta.clamp(0, 1)
        g = g.clamp(min=-5)
        v = v.clamp(-20, 20)
        S = s0
        out = torch.zeros_like(v)
        for t in range(q.shape[1]):
            S = S * g[:, t].exp()[..., None, None]
            kv = (S * k[:, t].unsqueeze(-1)).sum(-2)
            delta = (v[:, t] - kv) * beta[:, t].unsqueeze(-1)
            S = S + k[:, t].unsqueeze(-1) * delta.unsqueeze(-2)
            out[:, t] = (S * q[:, t].unsqueeze(-1)).sum(-2) * q.shape[-1] ** -0.5
        return out, S


class BetaClampedBefore(TransformersStyle):
    """transformers' style with ``beta = beta.clamp(0, 1)`` before the call."""

    def forward(self, query, key, value, g, beta, initial_state):
        return super().forward(query, key, value, g, beta.clamp(0, 1), initial_state)


class OutputClampedAfter(EinsumStep):
    """The einsum loop, its stacked output clamped to [-20, 20] after the loop."""

    def forward(self, q, k, v, g, beta, s0):
        o, S = super().forward(q, k, v, g, beta, s0)
        return o.clamp(-20, 20), S


@dataclass(frozen=True)
class Control:
    name: str
    base: str  # whose inputs and layout it takes
    module: Callable[[], nn.Module]
    change: str
    # the clamps a control applies to its inputs before the loop / its output after it,
    # on canonical operands (for the tests' reference); identity when None
    before: Optional[Callable[[dict], dict]] = None
    after: Optional[Callable] = None
    differs: bool = False  # whether it differs from the plain base past the thresholds


def _clamped_inputs(x):
    x = dict(x)
    x["beta"], x["g"], x["v"] = x["beta"].clamp(0, 1), x["g"].clamp(min=-5), x["v"].clamp(-20, 20)
    return x


def _beta_clamped(x):
    return {**x, "beta": x["beta"].clamp(0, 1)}


CONTROLS = [Control(f"plain_{b}", b, BASES[b].module, "no piecewise op") for b in BASES] + [
    Control("where_const_mask", "transformers", WhereConstMask,
            "torch.where(constant mask, S, S) on the state"),
    Control("where_all_true_mask", "transformers", WhereAllTrueMask,
            "torch.where(constant all-true mask, S, 0) on the state"),
    Control("clamped_inputs_before", "transformers", ClampedInputsBefore,
            "beta.clamp(0, 1), g.clamp(min=-5), v.clamp(-20, 20) before the loop (a "
            "sequence-major loop of its own)", before=_clamped_inputs, differs=True),
    Control("beta_clamped_before", "transformers", BetaClampedBefore,
            "beta.clamp(0, 1) before transformers' loop", before=_beta_clamped, differs=True),
    Control("output_clamped_after", "einsum", OutputClampedAfter,
            "the stacked output clamped after the loop",
            after=lambda o: o.clamp(-20, 20), differs=True),
]
CONTROL = {c.name: c for c in CONTROLS}

# identities a detection may not see through: fused (and right) or left with a near-miss
LOOKALIKES = [
    Control("where_same_branches", "einsum",
            lambda: EinsumStep("state", lambda x: torch.where(x.abs() > 20, x, x)),
            "torch.where(|S| > 20, S, S): both branches S"),
    Control("clamp_infinite", "fla_naive",
            lambda: FlaNaiveStyle("state", lambda x: x.clamp(-math.inf, math.inf)),
            "S.clamp(-inf, inf)"),
    Control("relu_of_exp_gate", "bmm",
            lambda: BmmStep("gate", lambda g: torch.log(F.relu(g.exp()))),
            "log(relu(exp(g))): relu of a positive value"),
    Control("maximum_with_itself", "kda",
            lambda: KdaStep("state", lambda x: torch.maximum(x, x)), "torch.maximum(S, S)"),
]
LOOKALIKE = {c.name: c for c in LOOKALIKES}


# --- the chunked form -------------------------------------------------------------------------

def wy_blocks(q, k, v, beta, g, n, chunk, at):
    """The chunked (WY) form's operands from head-major ones [B, H, n * chunk, D]: q / sqrt(Dk),
    k, v * beta and k * beta, each cut into n chunks [B, H, n, chunk, D], and the cumulative
    gate per chunk (mutation point 'cumgate'). (``wide_spellings``' chunked form's too.)"""
    Bn, Hn, Dk = k.shape[0], k.shape[1], k.shape[-1]
    q = q * (Dk ** -0.5)
    v_beta = v * beta.unsqueeze(-1)
    k_beta = k * beta.unsqueeze(-1)
    q, k, v_beta, k_beta = (x.reshape(Bn, Hn, n, chunk, x.shape[-1])
                            for x in (q, k, v_beta, k_beta))
    G = at("cumgate", g.reshape(Bn, Hn, n, chunk).cumsum(dim=-1))
    return q, k, v_beta, k_beta, G


def wy_solve_rows(A, chunk):
    """The strictly lower A [..., chunk, chunk] solved in place row by row: each row plus
    itself times the rows above it."""
    for i in range(1, chunk):
        row = A[..., i, :i].clone()
        A[..., i, :i] = row + (row.unsqueeze(-1) * A[..., :i, :i].clone()).sum(-2)


def wy_carry(S, out, c, q_c, k_c, G_c, u_c, w_c, scores):
    """Chunk c of the WY form: its output written to ``out[:, :, c]``; returns the state
    carried past it (before the 'state' mutation point)."""
    v_new = u_c - w_c @ S
    out[:, :, c] = (q_c * G_c.unsqueeze(-1).exp()) @ S + scores @ v_new
    last = G_c[:, :, -1]
    return S * last[..., None, None].exp() + (
        k_c * (last.unsqueeze(-1) - G_c).exp().unsqueeze(-1)).transpose(-1, -2) @ v_new


def chunked_rule(q, k, v, g, beta, s0, chunk=4, at=None):
    """The chunked (WY) gated delta rule written by hand in transformers' manner: sequence-
    major in, head-major f32 inside, q / sqrt(Dk), F.pad to a multiple of the chunk where T is
    not one (the tests use multiples: a pad sends the chunk rule to trace transformers' own
    templates first, ~12 s), k and v scaled by beta, a cumulative gate per chunk, the strictly
    lower (I + A) solved in place row by row, then a loop over chunks carrying the state.
    ``at``: the mutation points (the cumulative gate 'cumgate', the carried state 'state')."""
    at = at or Edits()
    q, k, v, beta, g = [x.transpose(1, 2).contiguous().to(torch.float32)
                        for x in (q, k, v, beta, g)]
    Bn, Hn, Tn, _ = k.shape
    Dv = v.shape[-1]
    pad = (chunk - Tn % chunk) % chunk
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        beta, g = F.pad(beta, (0, pad)), F.pad(g, (0, pad))
    n = (Tn + pad) // chunk
    q, k, v_beta, k_beta, G = wy_blocks(q, k, v, beta, g, n, chunk, at)
    diag_up = torch.triu(torch.ones(chunk, chunk, dtype=torch.bool), diagonal=0)
    decay = (G.unsqueeze(-1) - G.unsqueeze(-2)).tril().exp().tril()
    A = -((k_beta @ k.transpose(-1, -2)) * decay).masked_fill(diag_up, 0)
    wy_solve_rows(A, chunk)
    A = A + torch.eye(chunk)
    u = A @ v_beta
    w = A @ (k_beta * G.exp().unsqueeze(-1))
    S = s0.to(torch.float32)
    out = torch.zeros(Bn, Hn, n, chunk, Dv)
    strict_up = torch.triu(torch.ones(chunk, chunk, dtype=torch.bool), diagonal=1)
    for c in range(n):
        q_c, k_c, G_c = q[:, :, c], k[:, :, c], G[:, :, c]
        scores = (q_c @ k_c.transpose(-1, -2) * decay[:, :, c]).masked_fill(strict_up, 0)
        S = wy_carry(S, out, c, q_c, k_c, G_c, u[:, :, c], w[:, :, c], scores)
        S = at("state", S)
    out = out.reshape(Bn, Hn, -1, Dv)[:, :, :Tn]
    return out.transpose(1, 2).contiguous(), S


class ChunkedRule(nn.Module):
    """The hand-written chunked rule (chunk 4) with an optional piecewise op. ``rule``: the
    chunked function it runs (``wide_spellings``' ChunkedWY runs its own)."""

    rule = staticmethod(chunked_rule)

    def __init__(self, site=None, fn=None, chunk=4):
        super().__init__()
        self.at, self.chunk = Edits(site, fn), chunk

    def forward(self, q, k, v, g, beta, s0):
        return self.rule(q, k, v, g, beta, s0, chunk=self.chunk, at=self.at)


CHUNK_T = 12  # three chunks of 4


def chunk_operands(t=CHUNK_T, seed=0) -> dict:
    """Operands the chunked algebra is well conditioned on: q and k rows of norm 1, g in
    [-0.5, -0.01], beta in [0.05, 0.95]."""
    gen = torch.Generator().manual_seed(seed)

    def unit_rows(*shape):
        x = torch.randn(*shape, generator=gen)
        return x / x.norm(dim=-1, keepdim=True)

    return {"q": unit_rows(B, t, H, DK), "k": unit_rows(B, t, H, DK),
            "v": torch.randn(B, t, H, DV, generator=gen),
            "g": -(torch.rand(B, t, H, generator=gen) * 0.49 + 0.01),
            "beta": torch.rand(B, t, H, generator=gen) * 0.9 + 0.05,
            "s0": torch.randn(B, H, DK, DV, generator=gen) * 0.5}


@dataclass(frozen=True)
class ChunkMutant:
    name: str
    site: str  # "state" (carried between chunks) or "cumgate" (the cumulative gate)
    piece: str
    c: float
    t: int = CHUNK_T

    @property
    def module(self):
        return lambda: ChunkedRule(self.site, PIECES[self.piece].make(self.c))

    def cross(self, x: dict) -> dict:
        x = {n: a.clone() for n, a in x.items()}
        if self.site == "cumgate":  # gates summing past -c within a chunk
            x["g"] = x["g"] - self.c / 2
            x["s0"] = x["s0"] * 10
        else:
            x["s0"], x["v"] = x["s0"] * (6 * self.c), x["v"] * (6 * self.c)
        return x


CHUNK_MUTANTS = [
    ChunkMutant("chunk_state_clamp_4", "state", "clamp", 4.0),
    ChunkMutant("chunk_state_clamp_20_t8", "state", "clamp", 20.0, t=8),
    ChunkMutant("chunk_state_where_zero_20", "state", "where_zero", 20.0),
    ChunkMutant("chunk_state_hardtanh_1e3", "state", "hardtanh", 1e3),
    ChunkMutant("chunk_cumgate_clamp_min_20", "cumgate", "clamp_min", 20.0),
]
CHUNK_MUTANT = {m.name: m for m in CHUNK_MUTANTS}


# --- the conv update ----------------------------------------------------------------------

CONV_C, CONV_K = 6, 4


class ConvUpdate(nn.Module):
    """The causal conv1d update as a model file writes it: cat(state, x), the last K samples
    copied back into the state, a depthwise F.conv1d, the last T positions, SiLU. Mutation
    points: 'window' (the state read), 'pre' (the conv output before SiLU), 'written' (the
    state written back). ``seed``: the one its weights are drawn with."""

    seed = 7

    def __init__(self, site=None, fn=None):
        super().__init__()
        gen = torch.Generator().manual_seed(self.seed)
        self.weight = nn.Parameter(torch.randn(CONV_C, 1, CONV_K, generator=gen) * 0.5)
        self.bias = nn.Parameter(torch.randn(CONV_C, generator=gen) * 0.1)
        self.at = Edits(site, fn)

    def forward(self, x, state):
        full = torch.cat([self.at("window", state), x], dim=-1)
        state.copy_(self.at("written", full[:, :, -state.shape[-1]:]))
        y = F.conv1d(full, self.weight, self.bias, groups=CONV_C)[..., -x.shape[-1]:]
        return F.silu(self.at("pre", y))


class ConvStepRoll(nn.Module):
    """mamba's single-token step: roll the state in place, x into the last column, the sum of
    the state times the taps, bias, SiLU; x and out [B, C]. Mutation point: 'pre'. ``seed``:
    the one its weights are drawn with."""

    seed = 8

    def __init__(self, site=None, fn=None):
        super().__init__()
        gen = torch.Generator().manual_seed(self.seed)
        self.weight = nn.Parameter(torch.randn(CONV_C, CONV_K, generator=gen) * 0.5)
        self.bias = nn.Parameter(torch.randn(CONV_C, generator=gen) * 0.1)
        self.at = Edits(site, fn)

    def forward(self, x, conv_state):
        conv_state.copy_(torch.roll(conv_state, shifts=-1, dims=-1))
        conv_state[:, :, -1] = x
        y = torch.sum(conv_state * self.weight, dim=-1) + self.bias
        return F.silu(self.at("pre", y))


def conv_inputs(seq=3, step=False, seed=0) -> tuple:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, CONV_C, 1 if step else seq, generator=gen)
    state = torch.randn(2, CONV_C, CONV_K, generator=gen)
    return (x[:, :, 0].contiguous() if step else x), state


@dataclass(frozen=True)
class ConvMutant:
    name: str
    base: str  # "update" or "roll"
    site: str
    piece: str
    c: float

    @property
    def module(self):
        cls = {"update": ConvUpdate, "roll": ConvStepRoll}[self.base]
        return lambda: cls(self.site, PIECES[self.piece].make(self.c))

    def inputs(self, large=False):
        x, state = conv_inputs(step=self.base == "roll")
        if large:
            return x * (6 * self.c), state * (6 * self.c)
        return x, state


CONV_MUTANTS = [
    ConvMutant("conv_pre_clamp_10", "update", "pre", "clamp", 10.0),
    ConvMutant("conv_pre_hardtanh_10", "update", "pre", "hardtanh", 10.0),
    ConvMutant("conv_pre_where_zero_10", "update", "pre", "where_zero", 10.0),
    ConvMutant("conv_written_clamp_10", "update", "written", "clamp", 10.0),
    ConvMutant("conv_window_clamp_10", "update", "window", "clamp", 10.0),
    ConvMutant("conv_roll_pre_clamp_10", "roll", "pre", "clamp", 10.0),
    ConvMutant("conv_roll_pre_minimum_10", "roll", "pre", "minimum", 10.0),
]
CONV_MUTANT = {m.name: m for m in CONV_MUTANTS}
