"""The three fused ops, as torch.library custom ops with fake kernels.

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

``torch.ops.gdn_fx.gated_linear_scan(q, k, v, g, initial_state, *, scale)``
    The layout of gated_delta_scan without beta; per step S = S * e^g_t; S = S + k_t v_t^T;
    out_t = scale * S^T q_t (read after the write): no delta erase. Mamba2's SSD maps to it
    with q = C, k = B, v = dt * x, g = dt * A (G = heads per group); Mamba1 with Dv = 1 and g
    per (channel, state). Dtypes and resets as for gated_delta_scan, except that the work
    dtype is f64 when any operand is f64 (gated_delta_scan looks at q and initial_state).

``torch.ops.gdn_fx.causal_conv1d_update(x, conv_state, weight, bias, activation)``
    x [B, C, T]; conv_state [B, C, K]; weight [C, K]; bias [C] or None; activation None/"silu".
    Returns (out [B, C, T] in x's dtype, new_state [B, C, K] in conv_state's dtype). Functional:
    the caller writes new_state back where the model kept its state.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from gdn_fx.errors import DTypeError, ShapeError, UsageError
# GATE_FLOOR and gate_parts live with the references (the chunked linear reference splits its
# gates too); the lowering reads GATE_FLOOR from here.
from gdn_fx.reference import GATE_FLOOR, gate_parts, l2norm  # noqa: F401
from gdn_fx.reference import recurrent_delta_rule_reference, recurrent_linear_reference

SCAN = "gated_delta_scan"
CONV = "causal_conv1d_update"
LINEAR = "gated_linear_scan"


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


def _check_layout(op: str, q: Tensor, k: Tensor, v: Tensor, g: Tensor,
                  initial_state: Tensor, beta: Optional[Tensor] = None) -> None:
    """The layout both scans share (beta only for the delta rule), checked operand by operand."""
    _expect_float(op, dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=initial_state))
    if q.dim() != 4 or v.dim() != 4:
        raise ShapeError(f"{op}: q and v must be 4-D [B, T, H, D]; got q {_shape(q)}, "
                         f"v {_shape(v)}")
    b, t, hk, dk = q.shape
    hv, dv = v.shape[2], v.shape[3]
    _expect(op, "k", k, _shape(q))
    _expect(op, "v", v, [b, t, hv, dv])
    if hk == 0 or hv % hk:
        raise ShapeError(f"{op}: operand 'v' has {hv} heads, not a multiple of the {hk} heads "
                         "of 'q' and 'k'")
    _expect(op, "g", g, [b, t, hv], [b, t, hv, dk])
    if beta is not None:
        _expect(op, "beta", beta, [b, t, hv])
    _expect(op, "initial_state", initial_state, [b, hv, dk, dv])


def check_scan_operands(q, k, v, g, beta, initial_state) -> None:
    """Raise ShapeError/DTypeError naming the operand that breaks the gated_delta_scan contract."""
    _check_layout(SCAN, q, k, v, g, initial_state, beta)


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
    """Within this block the eager gated_delta_scan runs ``_scan_fast`` (and gated_linear_scan
    ``_linear_fast``, organized the same way), equal to the definition up to rounding: with a
    scalar gate (GDN, Mamba2) and ``chunks``, the chunked form (matmuls over blocks of CHUNK
    tokens), else the same steps with matmul readouts and in-place state updates. The default
    kernel is ``_scan_math``, bit-identical to transformers' recurrent rule (what reify's
    exact mode promises; ``_linear_math``, the step-by-step reference, for the linear op);
    translation validation, which compares within a tolerance and runs the op on every
    fusion, uses this one."""
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
        decay, grow, tail = _block_decays(g[:, :, s:s + CHUNK])
        bc = beta[:, :, s:s + CHUNK]
        n = decay.shape[-1]
        mix = bc.unsqueeze(-1) * (kc @ kc.transpose(-1, -2)) * decay
        eye = torch.eye(n, dtype=g.dtype, device=g.device)
        rhs = bc.unsqueeze(-1) * (vc - (grow * kc) @ state)
        deltas = torch.linalg.solve_triangular(mix.tril(-1) + eye, rhs, upper=False,
                                               unitriangular=True)
        reads = (qc @ kc.transpose(-1, -2)) * decay
        out[:, :, s:s + CHUNK] = (grow * qc) @ state + reads @ deltas
        state = grow[:, :, -1:] * state + (tail * kc).transpose(-1, -2) @ deltas
    return out.transpose(1, 2).contiguous(), state


def _block_decays(g: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The decays of one block of scalar log gates g [B, H, n], c its cumulative gate:
    (e^(c_t - c_j) for j <= t, else 0, [B, H, n, n]; e^c_t and e^(c_n - c_t), [B, H, n, 1]).
    Both chunked kernels use it (``_chunks`` has why c is kept in two parts)."""
    whole, frac = (part.cumsum(-1) for part in gate_parts(g))
    n = g.shape[-1]
    later = torch.ones(n, n, dtype=torch.bool, device=g.device).triu(1)
    pairs = ((frac.unsqueeze(-1) - frac.unsqueeze(-2))
             + (whole.unsqueeze(-1) - whole.unsqueeze(-2)))  # c_t - c_j, each part exact
    decay = pairs.masked_fill(later, float("-inf")).exp()
    grow = (frac + whole).exp().unsqueeze(-1)
    tail = ((frac[..., -1:] - frac) + (whole[..., -1:] - whole)).exp().unsqueeze(-1)
    return decay, grow, tail


@gated_delta_scan.register_fake
def _(q, k, v, g, beta, initial_state, *, scale, qk_l2norm):
    check_scan_operands(q, k, v, g, beta, initial_state)
    b, t, hv, dv = v.shape
    out = v.new_empty((b, t, hv, dv), dtype=scan_out_dtype(q, initial_state))
    return out, torch.empty_like(initial_state)


# ---- gated_linear_scan: the gated linear recurrence (no delta erase, no beta) ----------------

def check_linear_operands(q, k, v, g, initial_state) -> None:
    """Raise ShapeError/DTypeError naming the operand that breaks the gated_linear_scan
    contract (gated_delta_scan's layout without beta)."""
    _check_layout(LINEAR, q, k, v, g, initial_state)


def _linear_work(*operands: Tensor) -> torch.dtype:
    """The dtype gated_linear_scan computes in: f32, f64 where an operand is f64."""
    return functools.reduce(torch.promote_types, (x.dtype for x in operands), torch.float32)


def _linear_math(q, k, v, g, initial_state, *, scale):
    """The op's definition in differentiable torch (the default eager kernel and the
    backward): the step-by-step reference in the work dtype."""
    work = _linear_work(q, k, v, g, initial_state)
    out, final = recurrent_linear_reference(*(x.to(work) for x in (q, k, v, g)), scale=scale,
                                            initial_state=initial_state.to(work))
    # The reference never returns initial_state itself (T = 0 gives a copy): no alias.
    return out.to(scan_out_dtype(q, initial_state)), final.to(initial_state.dtype)


@torch.library.custom_op("gdn_fx::gated_linear_scan", mutates_args=())
def gated_linear_scan(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, initial_state: Tensor, *, scale: float,
) -> tuple[Tensor, Tensor]:
    """Gated linear recurrence over the whole sequence (Mamba2's SSD, Mamba1, lightning,
    retention, GLA): one op for the unrolled loop or the chunked form.

    ``g`` is the log decay; a gate of -inf is a reset (decay 0, never NaN): the module
    docstring has the contract."""
    check_linear_operands(q, k, v, g, initial_state)
    kernel = _linear_fast if FAST_KERNEL.on else _linear_math
    return kernel(q, k, v, g, initial_state, scale=scale)


def _linear_fast(q, k, v, g, initial_state, *, scale):
    """``_scan_fast``'s organization for the linear op: chunked with a scalar gate and
    ``chunks`` (fast_scan_kernel), else steps with matmul readouts and in-place updates."""
    work = _linear_work(q, k, v, g, initial_state)
    q2, k2, v2, g2 = (x.to(work) for x in (q, k, v, g))
    groups = v.shape[2] // q.shape[2]
    if groups > 1:
        q2, k2 = q2.repeat_interleave(groups, dim=2), k2.repeat_interleave(groups, dim=2)
    q2 = q2 * scale
    state = initial_state.to(work).clone()
    if g2.dim() == 3 and FAST_KERNEL.chunks:
        out, state = _linear_chunks(q2, k2, v2, g2, state)
    else:
        out = _linear_steps(q2, k2, v2, g2, state)
    return out.to(scan_out_dtype(q, initial_state)), state.to(initial_state.dtype)


def _linear_steps(q, k, v, g, state):
    """The linear recurrence step by step on [B, T, H, D] operands; updates ``state`` in
    place (a decay of 0 zeroes a finite state: a reset)."""
    decay = g.exp() if g.dim() == 4 else g.exp().unsqueeze(-1)  # [B, T, H, Dk or 1]
    out = v.new_empty(v.shape)
    for t in range(v.shape[1]):
        state.mul_(decay[:, t].unsqueeze(-1))
        state.addcmul_(k[:, t].unsqueeze(-1), v[:, t].unsqueeze(-2))
        out[:, t] = (q[:, t].unsqueeze(-2) @ state).squeeze(-2)
    return out


def _linear_chunks(q, k, v, g, state):
    """The linear recurrence with a scalar gate, CHUNK tokens at a time: (out, final state).

    Within a block, with c_t the cumulative log gate from its start and S the state before
    it: out = e^c Q S + (Q K^T * e^(c_t - c_j), j <= t) V and S' = e^c_n S +
    (e^(c_n - c_j) K)^T V: ``_chunks`` without the deltas, with its decays (``_block_decays``).
    """
    q, k, v = (x.transpose(1, 2).contiguous() for x in (q, k, v))  # [B, H, T, D]
    g = g.transpose(1, 2)  # [B, H, T]
    out = v.new_empty(v.shape)
    for s in range(0, v.shape[2], CHUNK):
        qc, kc, vc = (x[:, :, s:s + CHUNK] for x in (q, k, v))
        decay, grow, tail = _block_decays(g[:, :, s:s + CHUNK])
        reads = (qc @ kc.transpose(-1, -2)) * decay
        out[:, :, s:s + CHUNK] = (grow * qc) @ state + reads @ vc
        state = grow[:, :, -1:] * state + (tail * kc).transpose(-1, -2) @ vc
    return out.transpose(1, 2).contiguous(), state


@gated_linear_scan.register_fake
def _(q, k, v, g, initial_state, *, scale):
    check_linear_operands(q, k, v, g, initial_state)
    out = v.new_empty(v.shape, dtype=scan_out_dtype(q, initial_state))
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


def _backward_of(math: Callable) -> Callable:
    """The backward of a scan whose definition ``math`` is differentiable torch: gradients by
    re-running the definition under autograd."""
    def backward(ctx, grad_out, grad_state):
        inputs = [x.detach().requires_grad_(True) for x in ctx.saved_tensors]
        with torch.enable_grad():
            outs = math(*inputs, **ctx.options)
            grads = torch.autograd.grad(outs, inputs, (grad_out, grad_state),
                                        allow_unused=True)
        return tuple(grads)
    return backward


gated_delta_scan.register_autograd(_backward_of(_scan_math), setup_context=_scan_setup)
gated_linear_scan.register_autograd(_backward_of(_linear_math), setup_context=_scan_setup)
