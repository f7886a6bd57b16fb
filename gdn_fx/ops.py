"""The two fused ops, as torch.library custom ops with fake kernels.

``torch.ops.gdn_fx.gated_delta_scan(q, k, v, g, beta, initial_state, *, scale, qk_l2norm)``
    q, k [B, T, Hk, Dk]; v [B, T, Hv, Dv] with Hv = G * Hk (value head h reads key head h // G);
    g, the LOG decay, [B, T, Hv] (GDN) or [B, T, Hv, Dk] (KDA); beta [B, T, Hv];
    initial_state [B, Hv, Dk, Dv]. If qk_l2norm, q and k are l2-normalized (eps 1e-6); q is then
    scaled by ``scale``. Returns (out [B, T, Hv, Dv] in promote_types(q, initial_state),
    final_state in initial_state's dtype). Computed in f32 (f64 if an operand is f64).
    A gate may be any log decay down to -inf: g_t = -inf (or any g_t whose e^g_t is 0 in the
    work dtype, e.g. -1e4, -1e9) is a state RESET, decay exactly 0: the state before step t is
    forgotten, and the result is the recurrence restarted from a zero state at t. Never NaN
    (as long as the state before it is finite); every kernel and lowering agrees with this.

``torch.ops.gdn_fx.causal_conv1d_update(x, conv_state, weight, bias, activation)``
    x [B, C, T]; conv_state [B, C, K]; weight [C, K]; bias [C] or None; activation None/"silu".
    Returns (out [B, C, T] in x's dtype, new_state [B, C, K] in conv_state's dtype). Functional:
    the caller writes new_state back where the model kept its state.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from gdn_fx.errors import DTypeError, ShapeError, UsageError
from gdn_fx.reference import l2norm, recurrent_delta_rule_reference

SCAN = "gated_delta_scan"
CONV = "causal_conv1d_update"


def _shape(x: Tensor) -> list:
    return list(x.shape)


def _expect(op: str, name: str, x: Tensor, want: list, alt: Optional[list] = None) -> None:
    got = _shape(x)
    if got != want and got != alt:
        extra = f" or {alt}" if alt is not None else ""
        raise ShapeError(f"{op}: operand '{name}' has shape {got}; expected {want}{extra}")


def _expect_float(op: str, operands: dict) -> None:
    for name, x in operands.items():
        if x is not None and not x.dtype.is_floating_point:
            raise DTypeError(f"{op}: operand '{name}' has dtype {x.dtype}; expected a float dtype")


def check_scan_operands(q, k, v, g, beta, initial_state) -> None:
    """Raise ShapeError/DTypeError naming the operand that breaks the gated_delta_scan contract."""
    _expect_float(SCAN, dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=initial_state))
    if q.dim() != 4 or v.dim() != 4:
        raise ShapeError(f"{SCAN}: q and v must be 4-D [B, T, H, D]; got q {_shape(q)}, "
                         f"v {_shape(v)}")
    b, t, hk, dk = q.shape
    hv, dv = v.shape[2], v.shape[3]
    _expect(SCAN, "k", k, _shape(q))
    _expect(SCAN, "v", v, [b, t, hv, dv])
    if hk == 0 or hv % hk:
        raise ShapeError(f"{SCAN}: operand 'v' has {hv} heads, not a multiple of the {hk} heads "
                         "of 'q' and 'k'")
    _expect(SCAN, "g", g, [b, t, hv], [b, t, hv, dk])
    _expect(SCAN, "beta", beta, [b, t, hv])
    _expect(SCAN, "initial_state", initial_state, [b, hv, dk, dv])


def scan_out_dtype(q: Tensor, initial_state: Tensor) -> torch.dtype:
    """The promoted output dtype of gated_delta_scan."""
    return torch.promote_types(q.dtype, initial_state.dtype)


def _scan_math(q, k, v, g, beta, initial_state, *, scale, qk_l2norm):
    """The op's definition in differentiable torch (the eager kernel and the backward)."""
    work = torch.promote_types(torch.float32, scan_out_dtype(q, initial_state))
    q2, k2, v2, g2, b2, s0 = (x.to(work) for x in (q, k, v, g, beta, initial_state))
    if qk_l2norm:
        q2, k2 = l2norm(q2), l2norm(k2)
    out, final = recurrent_delta_rule_reference(q2, k2, v2, g2, b2, scale=scale, initial_state=s0)
    # The reference concatenates its final states, so `final` never aliases initial_state.
    return out.to(scan_out_dtype(q, initial_state)), final.to(initial_state.dtype)


@torch.library.custom_op("gdn_fx::gated_delta_scan", mutates_args=())
def gated_delta_scan(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor,
    *, scale: float, qk_l2norm: bool,
) -> tuple[Tensor, Tensor]:
    """Gated delta rule over the whole sequence: one op for the unrolled loop.

    ``g`` is the log decay; a gate of -inf is a reset (decay 0, never NaN): the module
    docstring has the contract."""
    check_scan_operands(q, k, v, g, beta, initial_state)
    kernel = _scan_fast if FAST_KERNEL.on else _scan_math
    return kernel(q, k, v, g, beta, initial_state, scale=scale, qk_l2norm=qk_l2norm)


class _Switch(threading.local):
    on = False
    chunks = True


FAST_KERNEL = _Switch()
CHUNK = 64  # tokens per block of the chunked kernel


@contextlib.contextmanager
def fast_scan_kernel(chunks: bool = True):
    """Within this block the eager gated_delta_scan runs ``_scan_fast``, equal to the
    definition up to rounding: with a scalar gate (GDN) and ``chunks``, the chunked form
    (matmuls over blocks of CHUNK tokens), else the same steps with matmul readouts and
    in-place state updates. The default kernel is ``_scan_math``, bit-identical to
    transformers' recurrent rule (what reify's exact mode promises); translation validation,
    which compares within a tolerance and runs the op on every fusion, uses this one."""
    before = FAST_KERNEL.on, FAST_KERNEL.chunks
    FAST_KERNEL.on, FAST_KERNEL.chunks = True, chunks
    try:
        yield
    finally:
        FAST_KERNEL.on, FAST_KERNEL.chunks = before


def _scan_fast(q, k, v, g, beta, initial_state, *, scale, qk_l2norm):
    work = torch.promote_types(torch.float32, scan_out_dtype(q, initial_state))
    q2, k2, v2, g2, b2 = (x.to(work) for x in (q, k, v, g, beta))
    if qk_l2norm:
        q2, k2 = l2norm(q2), l2norm(k2)
    groups = v.shape[2] // q.shape[2]
    if groups > 1:
        q2, k2 = q2.repeat_interleave(groups, dim=2), k2.repeat_interleave(groups, dim=2)
    q2 = q2 * scale
    state = initial_state.to(work).clone()
    if g2.dim() == 3 and FAST_KERNEL.chunks:
        out, state = _chunks(q2, k2, v2, g2, b2, state)
    else:
        out = _steps(q2, k2, v2, g2, b2, state)
    return out.to(scan_out_dtype(q, initial_state)), state.to(initial_state.dtype)


def _steps(q, k, v, g, beta, state):
    """The recurrence step by step on [B, T, H, D] operands; updates ``state`` in place."""
    decay = g.exp() if g.dim() == 4 else g.exp().unsqueeze(-1)  # [B, T, H, Dk or 1]
    out = v.new_empty(v.shape)
    for t in range(v.shape[1]):
        state.mul_(decay[:, t].unsqueeze(-1))
        kv = (k[:, t].unsqueeze(-2) @ state).squeeze(-2)
        delta = (v[:, t] - kv) * beta[:, t].unsqueeze(-1)
        state.addcmul_(k[:, t].unsqueeze(-1), delta.unsqueeze(-2))
        out[:, t] = (q[:, t].unsqueeze(-2) @ state).squeeze(-2)
    return out


def _chunks(q, k, v, g, beta, state):
    """The recurrence with a scalar gate, CHUNK tokens at a time; returns (out, final state).

    Within a block, with c_t the cumulative log gate from its start and S the state before
    it, the deltas U solve (I + L) U = beta (V - e^c K S), L[t, j] = beta_t e^(c_t - c_j)
    k_t.k_j (j < t); the outputs are e^c Q S + (Q K^T * e^(c_t - c_j), j <= t) U. Every decay
    is a ratio e^(c_t - c_j) with j <= t, the product of the gates between, as the steps
    multiply them, so nothing grows that the steps do not grow. The cumulative gate is kept
    in two exact parts (``gate_parts``), so a reset gate (-1e9, -inf) neither swamps the
    small gates after it nor makes a NaN.
    """
    q, k, v = (x.transpose(1, 2).contiguous() for x in (q, k, v))  # [B, H, T, D]: each
    # block's rows are whole matrices for the matmuls
    g, beta = g.transpose(1, 2), beta.transpose(1, 2)  # [B, H, T]
    out = v.new_empty(v.shape)
    for s in range(0, v.shape[2], CHUNK):
        qc, kc, vc = (x[:, :, s:s + CHUNK] for x in (q, k, v))
        whole, frac = (part.cumsum(-1) for part in gate_parts(g[:, :, s:s + CHUNK]))
        bc = beta[:, :, s:s + CHUNK]
        n = whole.shape[-1]
        later = torch.ones(n, n, dtype=torch.bool, device=g.device).triu(1)
        pairs = ((frac.unsqueeze(-1) - frac.unsqueeze(-2))
                 + (whole.unsqueeze(-1) - whole.unsqueeze(-2)))  # c_t - c_j, each part exact
        decay = pairs.masked_fill(later, float("-inf")).exp()
        grow = (frac + whole).exp().unsqueeze(-1)  # [B, H, n, 1]
        mix = bc.unsqueeze(-1) * (kc @ kc.transpose(-1, -2)) * decay
        eye = torch.eye(n, dtype=g.dtype, device=g.device)
        rhs = bc.unsqueeze(-1) * (vc - (grow * kc) @ state)
        deltas = torch.linalg.solve_triangular(mix.tril(-1) + eye, rhs, upper=False,
                                               unitriangular=True)
        reads = (qc @ kc.transpose(-1, -2)) * decay
        out[:, :, s:s + CHUNK] = (grow * qc) @ state + reads @ deltas
        tail = ((frac[..., -1:] - frac) + (whole[..., -1:] - whole)).exp().unsqueeze(-1)
        state = grow[:, :, -1:] * state + (tail * kc).transpose(-1, -2) @ deltas
    return out.transpose(1, 2).contiguous(), state


# A log gate below this is a reset in any float dtype the kernels compute in: e^GATE_FLOOR is 0
# in f32 (and e^-104 already is); clamping to it changes no decay, and it keeps -inf out of
# the sums (-inf - -inf is NaN). Chunk sums of it stay exact integers (64 * 1024 << 2^24).
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


@gated_delta_scan.register_fake
def _(q, k, v, g, beta, initial_state, *, scale, qk_l2norm):
    check_scan_operands(q, k, v, g, beta, initial_state)
    b, t, hv, dv = v.shape
    out = v.new_empty((b, t, hv, dv), dtype=scan_out_dtype(q, initial_state))
    return out, torch.empty_like(initial_state)


def check_conv_operands(x, conv_state, weight, bias, activation) -> None:
    """Raise ShapeError/DTypeError naming the operand that breaks the conv-update contract."""
    _expect_float(CONV, dict(x=x, conv_state=conv_state, weight=weight, bias=bias))
    if x.dim() != 3 or weight.dim() != 2:
        raise ShapeError(f"{CONV}: x must be [B, C, T] and weight [C, K]; got x {_shape(x)}, "
                         f"weight {_shape(weight)}")
    b, c, _ = x.shape
    _expect(CONV, "weight", weight, [c, weight.shape[1]])
    _expect(CONV, "conv_state", conv_state, [b, c, weight.shape[1]])
    if bias is not None:
        _expect(CONV, "bias", bias, [c])
    if activation not in (None, "silu"):
        raise UsageError(f"{CONV}: activation must be None or 'silu', got {activation!r}")


@torch.library.custom_op("gdn_fx::causal_conv1d_update", mutates_args=())
def causal_conv1d_update(
    x: Tensor, conv_state: Tensor, weight: Tensor, bias: Optional[Tensor],
    activation: Optional[str],
) -> tuple[Tensor, Tensor]:
    """Depthwise causal conv1d of x after the cached samples; returns (out, new_state)."""
    check_conv_operands(x, conv_state, weight, bias, activation)
    # The arithmetic of transformers' causal_conv1d_update (F.conv1d in the weight's dtype),
    # so a model that calls this op gives bit-identical results; reference.py has the oracle.
    full = torch.cat([conv_state, x], dim=-1).to(weight.dtype)
    out = F.conv1d(full, weight.unsqueeze(1), bias, padding=0, groups=x.shape[1])
    out = out[..., out.shape[-1] - x.shape[-1]:]
    if activation == "silu":
        out = F.silu(out)
    new_state = full[..., full.shape[-1] - conv_state.shape[-1]:].to(conv_state.dtype)
    dense = torch.contiguous_format  # fresh, dense tensors (even when empty), as the fake says
    return out.to(x.dtype).clone(memory_format=dense), new_state.clone(memory_format=dense)


@causal_conv1d_update.register_fake
def _(x, conv_state, weight, bias, activation):
    check_conv_operands(x, conv_state, weight, bias, activation)
    return torch.empty_like(x), torch.empty_like(conv_state)


def _scan_setup(ctx, inputs, keyword_only_inputs, output) -> None:
    ctx.save_for_backward(*inputs)
    ctx.options = keyword_only_inputs


def _scan_backward(ctx, grad_out, grad_state):
    """Gradients by re-running the differentiable definition under autograd."""
    inputs = [x.detach().requires_grad_(True) for x in ctx.saved_tensors]
    with torch.enable_grad():
        outs = _scan_math(*inputs, **ctx.options)
        grads = torch.autograd.grad(outs, inputs, (grad_out, grad_state), allow_unused=True)
    return tuple(grads)


gated_delta_scan.register_autograd(_scan_backward, setup_context=_scan_setup)
