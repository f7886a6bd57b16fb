"""Wide-domain mutants of the gated delta rule and of the conv update (issue 54, "Must show").

Round 3 of the held-out corpora. ``piecewise_spellings`` put a clamp / where / max / ... into a
correct loop; the switch list of passes/evaluator.py now names all of those. Every mutant here
changes the result only beyond some threshold or scale too, but is spelled with operations
no switch list names:

- saturations through smooth functions: c tanh(x / c), c erf(x / c), c atan(x / c),
  x c / hypot(x, c), x (1 + (x / c)^2)^-1/2, x (1 + (x / c)^8)^-1/8;
- windows that vanish far out: x sigmoid(4 (c - sqrt(x x))), x exp(-(x / c)^4), a smooth
  sign u / sqrt(u u + tiny) of u = sqrt(x x) - c;
- log-sum-exp floors and caps: logaddexp(b x, -b c) / b, logsumexp over a stacked pair,
  softplus(x + c, beta) - c, x - softplus(x - c, beta), x + log1p(exp(-b (x + c))) / b;
- relu and |x| by square roots: (y + sqrt(y y)) / 2 of y = x + c;
- wrap-around by rounding divisions: x - c div(x, c, rounding_mode='trunc'), the floor mode
  and the ``//`` operator shifted by c, c frac(x / c), a cast to int64 and back, a copy_ into
  an int32 tensor, or into an int32 buffer the module registers;
- overflow detectors: y = (x s).to(float16 / bfloat16), x + (y - y) (nan once y is inf),
  log(exp(x)) past 709;
- the other end of the scale: a stray epsilon x + 1e-9, a dead zone x - c tanh(x / c), a
  flush to zero x (1 - exp(-(x / c)^2)): invisible at ordinary magnitudes, everything at
  tiny ones;
- exact values no random draw hits: x (x / x) (nan at exactly 0: a zero initial state makes
  k^T S exactly 0; a log gate of exactly 0; a beta of exactly 0), x + 0 log(1 - x) (nan at a
  beta of exactly 1);
- a soft cap on each head's state norm (not elementwise).

(None of clamp, clip, where, min, max, minimum, maximum, relu, a comparison, abs, sign, floor,
round, fmod, remainder, nan_to_num or masked_fill is written here; ``test_wide_domain`` checks
the exported graphs for them.)

Each is put at one site of a correct loop (``Edits``): the state after the update, the memory
read k^T S (``kv``), the delta, the output o_t, the log gate g_t, beta_t; in step loops of
several authors' styles (``BASES``), a KDA step (a gate per key), a loop handed to torch's
``scan`` higher-order op, a hand-written chunked (WY) form (the state carried between chunks,
the cumulative gate) and the conv update (its pre-activation output, the state it writes,
the window it reads). Every base keeps the dtype of its inputs, so the same module runs in
float32 (what is exported) and in float64 (where the tests prove the corpus honest).

Each mutant records how to build inputs that cross its threshold (``crossing``); the tests
check, in eager float64, that it equals its base within 1e-6 on ordinary draws (uniform
[-1, 1] and randn * 0.5) and differs from it by more than 1e-3 on crossing inputs.

Nothing here imports gdn_fx.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

import piecewise_spellings
from piecewise_spellings import (
    B, CONV_C, CONV_K, DK, DV, H, Base, ChunkedRule, ConvStepRoll, ConvUpdate, Edits,
    FlaNaiveStyle, TransformersStyle, wy_blocks, wy_carry, wy_solve_rows,
)

T = 3


# --- the wide operations ---------------------------------------------------------------------

@dataclass(frozen=True)
class Wide:
    """An operation that is the identity (within 1e-7 relative) well inside a threshold c and
    not beyond it: ``make(c)(x)``.

    ``sides``: where it acts: 'both' (|x| beyond c), 'low' (x below -c), 'high' (x above c),
    'tiny' (|x| well under c), 'zero' / 'one' (x exactly 0 / 1).
    ``kind``: what it does there (cap, floor, window, wrap, overflow; tiny: a stray epsilon or
    a flush to zero; exact: nan at one exact value, the ends of beta, a zero state)."""

    name: str
    make: Callable[[float], Callable[[torch.Tensor], torch.Tensor]]
    sides: str
    kind: str


def _tanh_cap(c):
    return lambda x: c * torch.tanh(x / c)


def _erf_cap(c):  # slope 1 at 0
    return lambda x: (c * math.sqrt(math.pi) / 2) * torch.erf(x / c)


def _atan_cap(c):
    return lambda x: c * torch.atan(x / c)


def _hypot_cap(c):
    return lambda x: x * (c / torch.hypot(x, x.new_tensor(c)))


def _rsqrt_cap(c):
    return lambda x: x * torch.rsqrt(1 + (x / c) ** 2)


def _power_cap(c):  # sharper: a soft clamp at c
    return lambda x: x * (1 + (x / c) ** 8) ** -0.125


def _sigmoid_window(c):  # x inside c, 0 beyond
    return lambda x: x * torch.sigmoid(4 * (c - torch.sqrt(x * x)))


def _gauss_window(c):
    return lambda x: x * torch.exp(-((x / c) ** 4))


def _smooth_sign_zero(c):  # x inside c, 0 beyond: a sign spelled u / sqrt(u^2 + tiny)
    def f(x):
        u = torch.sqrt(x * x) - c
        s = u / torch.sqrt(u * u + 1e-30)
        return x * (1 - s) * 0.5
    return f


def _sqrt_relu_floor(c):  # max(x, -c) as relu(x + c) - c, relu as (y + sqrt(y y)) / 2
    def f(x):
        y = x + c
        return (y + torch.sqrt(y * y)) * 0.5 - c
    return f


def _sqrt_relu_cap(c):  # min(x, c)
    def f(x):
        y = c - x
        return c - (y + torch.sqrt(y * y)) * 0.5
    return f


def _softplus_floor(c, beta=1.0):  # softplus takes its exact path (x) past threshold 20
    return lambda x: F.softplus(x + c, beta=beta) - c


def _softplus_cap(c, beta=1.0):
    return lambda x: x - F.softplus(x - c, beta=beta)


def _logaddexp_floor(c, b=1.0):
    return lambda x: torch.logaddexp(x * b, torch.full_like(x, -c * b)) / b


def _logaddexp_cap(c, b=1.0):
    return lambda x: -torch.logaddexp(-x * b, torch.full_like(x, -c * b)) / b


def _logsumexp_floor(c, b=1.0):
    return lambda x: torch.logsumexp(torch.stack([x * b, torch.full_like(x, -c * b)]), 0) / b


def _log1p_floor(c, b=4.0):  # x + softplus(-(x + c)) by hand
    return lambda x: x + torch.log1p(torch.exp(-b * (x + c))) / b


def _sigmoid_unreset(c):  # a log gate beyond -c becomes 0: resets stop resetting
    return lambda g: g * torch.sigmoid(4 * (g + c))


def _trunc_wrap(c):
    return lambda x: x - c * torch.div(x, c, rounding_mode="trunc")


def _floor_wrap(c):  # x on [-c, c), wrapped into it beyond
    return lambda x: x - (2 * c) * torch.div(x + c, 2 * c, rounding_mode="floor")


def _floordiv_wrap(c):  # the same with the // operator
    return lambda x: x - (2 * c) * ((x + c) // (2 * c))


def _frac_wrap(c):
    return lambda x: c * torch.frac(x / c)


def _int_cast_wrap(c):
    return lambda x: x - c * (x / c).to(torch.int64).to(x.dtype)


def _int_buffer_wrap(c):
    def f(x):
        n = torch.zeros(x.shape, dtype=torch.int32)
        n.copy_(x / c)  # truncates toward zero
        return x - (n * c).to(x.dtype)
    return f


class IntStateBuffer(nn.Module):
    """A module's own int32 buffer the size of the state [B, H, Dk, Dv]: each step writes the
    state / c into it (copy_ truncates toward zero) and takes c times it off the state."""

    def __init__(self, c):
        super().__init__()
        self.c = c
        self.register_buffer("wraps", torch.zeros(B, H, DK, DV, dtype=torch.int32))

    def forward(self, x):
        self.wraps.copy_(x / self.c)
        return x - (self.wraps * self.c).to(x.dtype)


def _f16_overflow(c):  # nan once x s overflows float16 (65504): s puts that at c
    def f(x):
        y = (x * (65504.0 / c)).to(torch.float16).to(x.dtype)
        return x + (y - y)
    return f


def _f16_plain(c):  # the state itself through float16: nan past 65520 (c ignored)
    def f(x):
        y = x.to(torch.float16).to(x.dtype)
        return x + (y - y)
    return f


def _bf16_overflow(c):  # bfloat16 keeps float32's range: the scale puts it at ~1.1 c
    def f(x):
        y = (x * (3.0e38 / c)).to(torch.bfloat16).to(x.dtype)
        return x + (y - y)
    return f


def _eps_bias(c):  # a stray epsilon: nothing at ordinary scales, everything at tiny ones
    return lambda x: x + c


def _deadzone(c):  # x - c tanh(x / c): x shifted by c far out, flushed to ~0 inside c
    return lambda x: x - c * torch.tanh(x / c)


def _flush_to_zero(c):  # x beyond c (the exp underflows to 0), ~0 well inside it
    return lambda x: x * (1 - torch.exp(-((x / c) ** 2)))


def _zero_nan(c):  # nan exactly where x == 0 (0 / 0), x elsewhere (c ignored)
    return lambda x: x * (x / x)


def _one_nan(c):  # nan exactly where x == 1 (0 * log 0), x below 1 (c ignored)
    return lambda x: x + 0.0 * torch.log(1 - x)


def _norm_cap(c):  # a soft cap on the Frobenius norm of each head's state
    return lambda x: x * torch.rsqrt(1 + (x * x).sum(dim=(-2, -1), keepdim=True) / (c * c))


def _log_exp(c):  # inf past log(max float64) = 709.78 (c ignored)
    return lambda x: torch.log(torch.exp(x))


WIDES = {w.name: w for w in [
    Wide("tanh_cap", _tanh_cap, "both", "cap"),
    Wide("erf_cap", _erf_cap, "both", "cap"),
    Wide("atan_cap", _atan_cap, "both", "cap"),
    Wide("hypot_cap", _hypot_cap, "both", "cap"),
    Wide("rsqrt_cap", _rsqrt_cap, "both", "cap"),
    Wide("power_cap", _power_cap, "both", "cap"),
    Wide("sigmoid_window", _sigmoid_window, "both", "window"),
    Wide("gauss_window", _gauss_window, "both", "window"),
    Wide("smooth_sign_zero", _smooth_sign_zero, "both", "window"),
    Wide("sqrt_relu_floor", _sqrt_relu_floor, "low", "floor"),
    Wide("sqrt_relu_cap", _sqrt_relu_cap, "high", "cap"),
    Wide("softplus_floor", _softplus_floor, "low", "floor"),
    Wide("softplus_floor_b10", lambda c: _softplus_floor(c, beta=10.0), "low", "floor"),
    Wide("softplus_cap", _softplus_cap, "high", "cap"),
    Wide("softplus_cap_b40", lambda c: _softplus_cap(c, beta=40.0), "high", "cap"),
    Wide("logaddexp_floor", _logaddexp_floor, "low", "floor"),
    Wide("logaddexp_floor_b10", lambda c: _logaddexp_floor(c, b=10.0), "low", "floor"),
    Wide("logaddexp_cap", _logaddexp_cap, "high", "cap"),
    Wide("logsumexp_floor", _logsumexp_floor, "low", "floor"),
    Wide("logsumexp_floor_b10", lambda c: _logsumexp_floor(c, b=10.0), "low", "floor"),
    Wide("log1p_floor", _log1p_floor, "low", "floor"),
    Wide("sigmoid_unreset", _sigmoid_unreset, "low", "window"),
    Wide("trunc_wrap", _trunc_wrap, "both", "wrap"),
    Wide("floor_wrap", _floor_wrap, "both", "wrap"),
    Wide("floordiv_wrap", _floordiv_wrap, "both", "wrap"),
    Wide("frac_wrap", _frac_wrap, "both", "wrap"),
    Wide("int_cast_wrap", _int_cast_wrap, "both", "wrap"),
    Wide("int_buffer_wrap", _int_buffer_wrap, "both", "wrap"),
    Wide("int_module_buffer_wrap", IntStateBuffer, "both", "wrap"),
    Wide("f16_overflow", _f16_overflow, "both", "overflow"),
    Wide("f16_plain", _f16_plain, "both", "overflow"),
    Wide("bf16_overflow", _bf16_overflow, "both", "overflow"),
    Wide("log_exp", _log_exp, "high", "overflow"),
    Wide("eps_bias", _eps_bias, "tiny", "tiny"),
    Wide("deadzone", _deadzone, "tiny", "tiny"),
    Wide("flush_to_zero", _flush_to_zero, "tiny", "tiny"),
    Wide("zero_nan", _zero_nan, "zero", "exact"),
    Wide("one_nan", _one_nan, "one", "exact"),
    Wide("norm_cap", _norm_cap, "both", "cap"),
]}

# where an operation's threshold really is when it ignores c
NATURAL = {"f16_plain": 65520.0, "log_exp": 709.8}


# --- the step bases: one loop per author --------------------------------------------------
# Canonical operands (what the tests draw): q, k [B, T, H, Dk], v [B, T, H, Dv], g (log
# decay) [B, T, H] or [B, T, H, Dk] (KDA), beta [B, T, H], s0 [B, H, Dk, Dv] (key first).
# The loops that piecewise_spellings has too are its own (with its ``Edits``), in the
# caller's dtype: its einsum step, merged-heads bmm step and KDA step as they are, its
# transformers and FLA naive loops without their float32 cast. Its extra mutation points
# (k, v, the decayed state) are the identity here: no mutant below names them.

class RecurrentHF(TransformersStyle):
    """transformers' recurrent fallback as a port that keeps the caller's dtype: sequence-
    major in, transposed to [B, H, T, D], q / sqrt(Dk), kv_mem and delta, a preallocated
    output buffer written at [:, :, i]."""

    dtype = None


class NaiveClones(FlaNaiveStyle):
    """FLA's naive reference manner in the caller's dtype: (q, k, v, beta, g) order,
    head-major, q scaled up front, clones of the state, the readout by einsum into a zeros
    buffer."""

    dtype = None


class ValueFirstMatmul(nn.Module):
    """Another author: sequence-major inputs, the state value-first [B, H, Dv, Dk], ``@``
    with column vectors, q scaled up front, outputs stacked on dim 1."""

    def __init__(self, site=None, fn=None):
        super().__init__()
        self.at = Edits(site, fn)

    def forward(self, q, k, v, g, beta, s_vk):
        at = self.at
        q = q * q.shape[-1] ** -0.5
        S, outs = s_vk, []
        for t in range(q.shape[1]):
            a = at("gate", g[:, t]).exp()
            S = S * a[..., None, None]
            recalled = at("kv", (S @ k[:, t, :, :, None])[..., 0])
            delta = at("delta", at("beta", beta[:, t])[..., None] * (v[:, t] - recalled))
            S = at("state", S + delta[..., :, None] * k[:, t, :, None, :])
            outs.append(at("out", (S @ q[:, t, :, :, None])[..., 0]))
        return torch.stack(outs, 1), S


class ScanLoop(nn.Module):
    """The step handed to torch's ``scan`` higher-order op over time (sequence-major inputs
    moved to time-first), the state key-first, einsums, no scale."""

    def __init__(self, site=None, fn=None):
        super().__init__()
        self.at = Edits(site, fn)

    def forward(self, q, k, v, g, beta, s0):
        from torch._higher_order_ops.scan import scan

        at = self.at

        def step(S, xs):
            q_t, k_t, v_t, g_t, b_t = xs
            S = S * at("gate", g_t).exp()[:, :, None, None]
            kv = at("kv", torch.einsum("bhkv,bhk->bhv", S, k_t))
            delta = at("delta", at("beta", b_t)[:, :, None] * (v_t - kv))
            S = at("state", S + torch.einsum("bhk,bhv->bhkv", k_t, delta))
            return S, at("out", torch.einsum("bhkv,bhk->bhv", S, q_t))

        final, out = scan(step, s0, [x.transpose(0, 1) for x in (q, k, v, g, beta)])
        return out.transpose(0, 1), final


def _vk(s):
    return s.transpose(-1, -2).contiguous()


_PIECEWISE = piecewise_spellings.BASES  # the same layouts: their args and outs
BASES = {b.name: b for b in [
    replace(_PIECEWISE["transformers"], name="recurrent_hf", module=RecurrentHF),
    replace(_PIECEWISE["fla_naive"], name="naive_clones", module=NaiveClones),
    replace(_PIECEWISE["einsum"], name="einsum_step"),
    replace(_PIECEWISE["bmm"], name="bmm_merged"),
    Base("value_first", ValueFirstMatmul, False, "rsqrt",
         lambda x: (x["q"], x["k"], x["v"], x["g"], x["beta"], _vk(x["s0"])),
         lambda r: (r[0], _vk(r[1]))),
    replace(_PIECEWISE["kda"], name="kda_step"),
    Base("scan_hop", ScanLoop, False, "one",
         lambda x: (x["q"], x["k"], x["v"], x["g"], x["beta"], x["s0"]), lambda r: r,
         hop=True),
]}


# --- inputs ------------------------------------------------------------------------------

def _gen(seed):
    return torch.Generator().manual_seed(seed)


def operands(*, kda=False, t=T, seed=0, dtype=torch.float32) -> dict:
    """Well-behaved canonical operands (the start of every crossing): piecewise_spellings'
    (q ~ N(0, 1), k ~ N(0, 0.25), v ~ N(0, 1), g in [-0.95, -0.05], beta in [0.05, 0.95],
    s0 ~ N(0, 0.25)) in ``dtype``."""
    x = piecewise_spellings.operands(kda=kda, t=t, seed=seed)
    return {n: a.to(dtype) for n, a in x.items()}


def ordinary(kind: str, *, kda=False, t=T, seed=0, dtype=torch.float64) -> dict:
    """What a checker drawing at random sees: every operand uniform in [-1, 1] ('uniform')
    or N(0, 0.25) ('randn'): gates and betas of either sign included."""
    gen = _gen(1000 + seed)
    shapes = {n: a.shape for n, a in operands(kda=kda, t=t).items()}
    if kind == "uniform":
        x = {n: torch.rand(s, generator=gen, dtype=torch.float64) * 2 - 1
             for n, s in shapes.items()}
    else:
        x = {n: torch.randn(s, generator=gen, dtype=torch.float64) * 0.5
             for n, s in shapes.items()}
    return {n: a.to(dtype) for n, a in x.items()}


ORDINARY = ("uniform", "randn")


def cross(site: str, wide: Wide, c: float, x: dict, seed: int = 5) -> dict:
    """``x`` (operands()) changed so that the value at ``site`` goes past the threshold c on
    the side(s) where ``wide`` acts. The delta rule is linear in (S, v) together and its
    output linear in q: scaling those scales every value downstream."""
    gen = _gen(seed)
    x = {n: a.clone() for n, a in x.items()}
    c = NATURAL.get(wide.name, c)
    if wide.sides in ("zero", "one"):  # exact values: a zero initial state (then k^T S = 0
        # at the first step), log gates of exactly 0 (no decay), betas of exactly 0 or 1
        name = {"gate": "g", "beta": "beta"}.get(site, "s0")
        a = x[name].flatten().clone()
        if name == "s0":
            a[:] = 0.0
        else:
            a[0::2] = 0.0 if wide.sides == "zero" else 1.0
        x[name] = a.view(x[name].shape)
        return x
    if wide.sides == "tiny":  # everything downstream of (S, v) or q at 1e-3 of c
        if site == "out":
            x["q"] = x["q"] * (1e-3 * c)
        else:
            x["s0"], x["v"] = x["s0"] * (1e-3 * c), x["v"] * (1e-3 * c)
        return x
    if site == "gate":  # log gates beyond -c (a reset); the decayed state matters
        x["g"] = x["g"] - c * (1.0 + torch.rand(x["g"].shape, generator=gen)).to(x["g"])
        x["s0"] = x["s0"] * min(math.exp(c), 1e4)
    elif site == "beta":  # a third of the betas beyond c, a third beyond -c, the rest kept
        far = (c * (1.5 + torch.rand(x["beta"].shape, generator=gen))).flatten().to(x["beta"])
        beta = x["beta"].flatten().clone()
        beta[0::3] = far[0::3]
        if wide.sides == "both":
            beta[1::3] = -far[1::3]
        x["beta"] = beta.view(x["beta"].shape)
    elif site == "out":
        x["q"] = x["q"] * (6 * c)
    else:  # kv, delta, state: S and v together
        x["s0"], x["v"] = x["s0"] * (6 * c), x["v"] * (6 * c)
    return x


# --- the mutants ---------------------------------------------------------------------------

# sites whose value is a per-step input or output only: the operation commutes with the loop
# (it is the operation applied to the whole input before, or the whole output after), so a
# collapse may fuse it with the operation kept outside; elsewhere it is inside the recurrence.
OUTSIDE_SITES = ("gate", "beta", "out")
INSIDE_SITES = ("kv", "delta", "state")


@dataclass(frozen=True)
class StepMutant:
    name: str
    base: str
    site: str
    wide: str
    c: float
    t: int = T
    family = "step"

    @property
    def kda(self):
        return BASES[self.base].kda

    @property
    def inside(self) -> bool:
        return self.site in INSIDE_SITES

    @property
    def change(self) -> str:
        return f"{self.wide}(c={self.c:g}) on {self.site} in the {self.base} loop"

    def module(self) -> nn.Module:
        return BASES[self.base].module(self.site, WIDES[self.wide].make(self.c))

    def base_module(self) -> nn.Module:
        return BASES[self.base].module()

    def canonical(self, which: str, seed: int = 0, dtype=torch.float32) -> dict:
        """'example' (what is exported), 'uniform' / 'randn' (ordinary draws), 'cross'."""
        if which in ORDINARY:
            return ordinary(which, kda=self.kda, t=self.t, seed=seed, dtype=dtype)
        x = operands(kda=self.kda, t=self.t, seed=seed, dtype=dtype)
        return cross(self.site, WIDES[self.wide], self.c, x) if which == "cross" else x

    def args(self, which: str, seed: int = 0, dtype=torch.float32) -> tuple:
        return BASES[self.base].args(self.canonical(which, seed, dtype))


def _step(base, site, wide, c, t=T):
    tag = f"{c:g}".replace(".", "p").replace("+", "")
    return StepMutant(f"{base}_{site}_{wide}_{tag}", base, site, wide, c, t)


# state magnitudes on ordinary draws stay under ~30 (gates up to +1 grow it): thresholds at
# 100 for the sharp operations, 1e4 / 1e5 for the smooth saturations (their deviation
# (x / c)^2 / 3 stays under 1e-7 there)
_STATE = [
    ("recurrent_hf", "tanh_cap", 1e5), ("naive_clones", "erf_cap", 1e5),
    ("einsum_step", "atan_cap", 1e5), ("bmm_merged", "hypot_cap", 1e5),
    ("value_first", "rsqrt_cap", 1e5), ("kda_step", "power_cap", 100.0),
    ("recurrent_hf", "sigmoid_window", 100.0), ("naive_clones", "gauss_window", 1e4),
    ("einsum_step", "smooth_sign_zero", 100.0), ("bmm_merged", "sqrt_relu_floor", 100.0),
    ("value_first", "sqrt_relu_cap", 100.0), ("kda_step", "softplus_floor", 100.0),
    ("recurrent_hf", "softplus_cap", 100.0), ("naive_clones", "logaddexp_floor", 100.0),
    ("einsum_step", "logaddexp_cap", 100.0), ("bmm_merged", "logsumexp_floor", 100.0),
    ("value_first", "trunc_wrap", 100.0), ("kda_step", "floor_wrap", 100.0),
    ("recurrent_hf", "floordiv_wrap", 100.0), ("naive_clones", "frac_wrap", 100.0),
    ("einsum_step", "int_cast_wrap", 100.0), ("bmm_merged", "int_buffer_wrap", 100.0),
    ("value_first", "f16_overflow", 1e3), ("recurrent_hf", "f16_plain", 65504.0),
    ("kda_step", "bf16_overflow", 100.0), ("naive_clones", "log_exp", 709.0),
    ("kda_step", "tanh_cap", 1e5), ("recurrent_hf", "int_module_buffer_wrap", 100.0),
    ("einsum_step", "eps_bias", 1e-9), ("bmm_merged", "deadzone", 1e-9),
    ("kda_step", "flush_to_zero", 1e-8), ("recurrent_hf", "norm_cap", 1e5),
    ("bmm_merged", "norm_cap", 1e5),
]
_KV = [
    ("naive_clones", "power_cap", 100.0), ("bmm_merged", "trunc_wrap", 100.0),
    ("value_first", "f16_overflow", 1e3), ("kda_step", "logaddexp_cap", 100.0),
    ("recurrent_hf", "erf_cap", 1e5), ("recurrent_hf", "zero_nan", 0.0),
    ("value_first", "eps_bias", 1e-9),
]
_DELTA = [
    ("recurrent_hf", "hypot_cap", 1e5), ("einsum_step", "int_cast_wrap", 100.0),
    ("kda_step", "sigmoid_window", 100.0), ("bmm_merged", "softplus_floor", 100.0),
]
_OUT = [
    ("recurrent_hf", "logaddexp_cap", 100.0), ("naive_clones", "frac_wrap", 100.0),
    ("einsum_step", "erf_cap", 1e5), ("value_first", "sqrt_relu_floor", 100.0),
    ("bmm_merged", "bf16_overflow", 100.0), ("kda_step", "smooth_sign_zero", 100.0),
    ("naive_clones", "flush_to_zero", 1e-8),
]
# log gates: ordinary ones stay above -2.5; floors at -6 (resets stop resetting)
_GATE = [
    ("recurrent_hf", "softplus_floor_b10", 6.0), ("naive_clones", "logaddexp_floor_b10", 6.0),
    ("einsum_step", "logsumexp_floor_b10", 6.0), ("bmm_merged", "sqrt_relu_floor", 6.0),
    ("value_first", "log1p_floor", 6.0), ("kda_step", "logaddexp_floor_b10", 6.0),
    ("kda_step", "trunc_wrap", 6.0), ("recurrent_hf", "sigmoid_unreset", 10.0),
    ("einsum_step", "int_cast_wrap", 6.0), ("bmm_merged", "zero_nan", 0.0),
]
# beta: a cap at 1.5 (FLA's allow_neg_eigval draws beta in [0, 2])
_BETA = [
    ("recurrent_hf", "softplus_cap_b40", 1.5), ("einsum_step", "sqrt_relu_cap", 1.5),
    ("kda_step", "trunc_wrap", 1.5), ("naive_clones", "smooth_sign_zero", 1.5),
    ("einsum_step", "zero_nan", 0.0), ("kda_step", "one_nan", 1.0),
]
_SCAN = [
    ("scan_hop", "state", "tanh_cap", 1e5), ("scan_hop", "state", "trunc_wrap", 100.0),
    ("scan_hop", "kv", "f16_overflow", 1e3), ("scan_hop", "gate", "logaddexp_floor_b10", 6.0),
    ("scan_hop", "out", "power_cap", 100.0),
]

STEP_MUTANTS = ([_step(b, "state", w, c) for b, w, c in _STATE]
                + [_step(b, "kv", w, c) for b, w, c in _KV]
                + [_step(b, "delta", w, c) for b, w, c in _DELTA]
                + [_step(b, "out", w, c) for b, w, c in _OUT]
                + [_step(b, "gate", w, c) for b, w, c in _GATE]
                + [_step(b, "beta", w, c) for b, w, c in _BETA]
                + [_step(b, s, w, c) for b, s, w, c in _SCAN]
                + [_step("recurrent_hf", "state", "trunc_wrap", 100.0, t=6)])
STEP_MUTANTS = [StepMutant(m.name + ("" if m.t == T else f"_t{m.t}"), m.base, m.site, m.wide,
                           m.c, m.t) for m in STEP_MUTANTS]


# --- the chunked form -------------------------------------------------------------------------

def chunked_wy(q, k, v, g, beta, s0, chunk=4, at=None):
    """The chunked (WY) gated delta rule written by hand, in the caller's dtype: head-major
    inside, q / sqrt(Dk), k and v scaled by beta, a cumulative gate per chunk, the strictly
    lower (I + A) solved row by row in place, then a loop over chunks carrying the state.
    T must be a multiple of the chunk. ``at``: mutation points 'cumgate', 'state'."""
    at = at or Edits()
    q, k, v, beta, g = (x.transpose(1, 2).contiguous() for x in (q, k, v, beta, g))
    Bn, Hn, Tn, _ = k.shape
    Dv = v.shape[-1]
    n = Tn // chunk
    q, k, v_beta, k_beta, G = wy_blocks(q, k, v, beta, g, n, chunk, at)
    lower = torch.ones(chunk, chunk, dtype=q.dtype).tril()
    strict = torch.ones(chunk, chunk, dtype=q.dtype).tril(-1)
    decay = ((G.unsqueeze(-1) - G.unsqueeze(-2)) * lower).exp() * lower
    A = -(k_beta @ k.transpose(-1, -2)) * decay * strict
    wy_solve_rows(A, chunk)
    A = A + torch.eye(chunk, dtype=q.dtype)
    u = A @ v_beta
    w = A @ (k_beta * G.exp().unsqueeze(-1))
    S = s0
    out = torch.zeros(Bn, Hn, n, chunk, Dv, dtype=q.dtype)
    for c in range(n):
        q_c, k_c, G_c = q[:, :, c], k[:, :, c], G[:, :, c]
        scores = (q_c @ k_c.transpose(-1, -2)) * decay[:, :, c]
        S = wy_carry(S, out, c, q_c, k_c, G_c, u[:, :, c], w[:, :, c], scores)
        S = at("state", S)
    return out.reshape(Bn, Hn, Tn, Dv).transpose(1, 2).contiguous(), S


class ChunkedWY(ChunkedRule):
    """piecewise_spellings' chunked module (chunk 4, an optional operation) on
    ``chunked_wy``."""

    rule = staticmethod(chunked_wy)


CHUNK_T = 8  # two chunks of 4


def chunk_operands(t=CHUNK_T, seed=0, dtype=torch.float32) -> dict:
    """Operands the chunked algebra is well conditioned on (piecewise_spellings': q and k
    rows of norm 1, g in [-0.5, -0.01], beta in [0.05, 0.95]) in ``dtype``."""
    x = piecewise_spellings.chunk_operands(t, seed=seed)
    return {n: a.to(dtype) for n, a in x.items()}


def _chunk_args(x):
    return tuple(x[n] for n in ("q", "k", "v", "g", "beta", "s0"))


@dataclass(frozen=True)
class ChunkMutant:
    name: str
    site: str  # "state" (carried between chunks) or "cumgate" (the cumulative gate)
    wide: str
    c: float
    t: int = CHUNK_T
    family = "chunk"
    base = "chunked_wy"
    kda = False

    @property
    def inside(self):
        return True

    @property
    def change(self):
        return f"{self.wide}(c={self.c:g}) on the chunked form's {self.site}"

    def module(self):
        return ChunkedWY(self.site, WIDES[self.wide].make(self.c))

    def base_module(self):
        return ChunkedWY()

    def canonical(self, which: str, seed: int = 0, dtype=torch.float32) -> dict:
        if which in ORDINARY:  # the ordinary draws with unit q, k rows (the chunk algebra's)
            x = ordinary(which, t=self.t, seed=seed, dtype=dtype)
            for n in ("q", "k"):
                x[n] = x[n] / x[n].norm(dim=-1, keepdim=True)
            return x
        x = chunk_operands(self.t, seed=seed, dtype=dtype)
        if which != "cross":
            return x
        c = NATURAL.get(self.wide, self.c)
        if WIDES[self.wide].sides == "tiny":
            x["s0"], x["v"] = x["s0"] * (1e-3 * c), x["v"] * (1e-3 * c)
        elif self.site == "cumgate":  # gates summing past -c within a chunk
            x["g"] = x["g"] - c / 2
        else:
            x["s0"], x["v"] = x["s0"] * (6 * c), x["v"] * (6 * c)
        return x

    def args(self, which: str, seed: int = 0, dtype=torch.float32) -> tuple:
        return _chunk_args(self.canonical(which, seed, dtype))


CHUNK_MUTANTS = [
    ChunkMutant("chunk_state_tanh_cap_1e5", "state", "tanh_cap", 1e5),
    ChunkMutant("chunk_state_trunc_wrap_100", "state", "trunc_wrap", 100.0),
    ChunkMutant("chunk_state_f16_overflow_1e3", "state", "f16_overflow", 1e3),
    ChunkMutant("chunk_state_power_cap_100", "state", "power_cap", 100.0),
    ChunkMutant("chunk_state_int_buffer_wrap_100", "state", "int_buffer_wrap", 100.0),
    ChunkMutant("chunk_state_deadzone_1e-9", "state", "deadzone", 1e-9),
    ChunkMutant("chunk_cumgate_logaddexp_floor_b10_12", "cumgate", "logaddexp_floor_b10", 12.0),
    ChunkMutant("chunk_cumgate_softplus_floor_b10_12", "cumgate", "softplus_floor_b10", 12.0),
]


# --- the conv update ----------------------------------------------------------------------

class ConvCat(ConvUpdate):
    """piecewise_spellings' conv update (cat(state, x), the last K samples copied back into
    the state, a depthwise F.conv1d, the last T positions, SiLU; mutation points 'window',
    'pre', 'written') with weights of another seed."""

    seed = 17


class ConvRoll(ConvStepRoll):
    """piecewise_spellings' mamba single-token step (the state rolled in place, x into the
    last column, the taps, bias, SiLU; mutation point 'pre') with weights of another seed."""

    seed = 18


CONV_BASES = {"cat": ConvCat, "roll": ConvRoll}


@dataclass(frozen=True)
class ConvMutant:
    name: str
    base: str  # "cat" or "roll"
    site: str
    wide: str
    c: float
    family = "conv"
    kda = False

    @property
    def inside(self):  # one step: every site may be kept outside a fused update
        return False

    @property
    def change(self):
        return f"{self.wide}(c={self.c:g}) on the conv update's {self.site} ({self.base})"

    def module(self):
        return CONV_BASES[self.base](self.site, WIDES[self.wide].make(self.c))

    def base_module(self):
        return CONV_BASES[self.base]()

    def args(self, which: str, seed: int = 0, dtype=torch.float32) -> tuple:
        gen = _gen(2000 + seed)
        step = self.base == "roll"
        xs = (2, CONV_C) if step else (2, CONV_C, 3)
        ss = (2, CONV_C, CONV_K)
        if which == "uniform":
            x, s = (torch.rand(sh, generator=gen, dtype=torch.float64) * 2 - 1 for sh in (xs, ss))
        elif which == "randn":
            x, s = (torch.randn(sh, generator=gen, dtype=torch.float64) * 0.5 for sh in (xs, ss))
        else:
            x, s = (torch.randn(sh, generator=gen, dtype=torch.float64) for sh in (xs, ss))
            sides = WIDES[self.wide].sides
            if which == "cross" and sides == "zero":  # a zero state and zero inputs
                x, s = x * 0, s * 0
            elif which == "cross":
                f = (1e-3 if sides == "tiny" else 6) * NATURAL.get(self.wide, self.c)
                x, s = x * f, s * f
        return x.to(dtype), s.to(dtype)


CONV_MUTANTS = [
    ConvMutant("conv_pre_tanh_cap_1e5", "cat", "pre", "tanh_cap", 1e5),
    ConvMutant("conv_pre_softplus_cap_100", "cat", "pre", "softplus_cap", 100.0),
    ConvMutant("conv_pre_trunc_wrap_100", "cat", "pre", "trunc_wrap", 100.0),
    ConvMutant("conv_written_f16_overflow_1e3", "cat", "written", "f16_overflow", 1e3),
    ConvMutant("conv_written_int_cast_wrap_100", "cat", "written", "int_cast_wrap", 100.0),
    ConvMutant("conv_window_power_cap_100", "cat", "window", "power_cap", 100.0),
    ConvMutant("conv_written_eps_bias_1e-9", "cat", "written", "eps_bias", 1e-9),
    ConvMutant("conv_written_zero_nan", "cat", "written", "zero_nan", 0.0),
    ConvMutant("conv_roll_pre_logaddexp_cap_100", "roll", "pre", "logaddexp_cap", 100.0),
    ConvMutant("conv_roll_pre_frac_wrap_100", "roll", "pre", "frac_wrap", 100.0),
]


MUTANTS = STEP_MUTANTS + CHUNK_MUTANTS + CONV_MUTANTS
MUTANT = {m.name: m for m in MUTANTS}


# --- controls: exact identities spelled oddly (may fuse; when fused, must be right) --------

IDENTITIES = {
    "times_ones_like": lambda x: x * torch.ones_like(x),
    "scale_by_powers_of_two": lambda x: (x * 4.0) * 0.25,
    "minus_zeros_like": lambda x: x - torch.zeros_like(x),
    "plus_tanh_of_zero": lambda x: x + torch.tanh(x * 0.0),
    "cast_to_same_dtype": lambda x: x.to(x.dtype),
}


@dataclass(frozen=True)
class Control:
    name: str
    base: str
    site: Optional[str]
    identity: Optional[str]

    @property
    def kda(self):
        return BASES[self.base].kda

    def module(self):
        fn = IDENTITIES[self.identity] if self.identity else None
        return BASES[self.base].module(self.site, fn)


PLAIN = [Control(f"plain_{b}", b, None, None) for b in BASES]
IDENTITY_CONTROLS = [
    Control("recurrent_hf_state_times_ones_like", "recurrent_hf", "state", "times_ones_like"),
    Control("einsum_step_state_scale_by_powers_of_two", "einsum_step", "state",
            "scale_by_powers_of_two"),
    Control("bmm_merged_kv_minus_zeros_like", "bmm_merged", "kv", "minus_zeros_like"),
    Control("kda_step_gate_plus_tanh_of_zero", "kda_step", "gate", "plus_tanh_of_zero"),
    Control("value_first_state_cast_to_same_dtype", "value_first", "state",
            "cast_to_same_dtype"),
]
