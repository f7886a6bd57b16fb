"""Candidates "portable" and "depthwise" for causal_conv1d_update: plain NNEF, one fragment per
(kernel width, bias, activation, form).

With full = cat(state, x) of length K + S, output step t reads full[1 + t : 1 + t + K], so
- "portable": ``out = sum_j weight[:, j] * full[..., 1 + j : 1 + j + S]`` (tap K - 1 is x
  itself): K multiply-adds, no ``conv`` op;
- "depthwise": NNEF's depthwise ``conv`` of full (no padding; S + 1 outputs, the first
  dropped), its filter written as ``reshape(weight, [C, 1, K])``: tract 0.23.9 miscompiles a
  constant filter behind an unsqueeze (channel c reads the wrong weights), not a reshaped one
  (docs/FACTS.md, "tract 0.23.9: traps"; lowering/t2n/fixes.py relies on the same).
then the bias and SiLU when the node has them; ``new_state = full[..., -K:]``. At S = 1 the
multiply-adds are faster, for longer S tract's conv kernel is (bench/bench_conv.py). Slice
ends are written from ``tract_core_shape_of(full)``: negative ends break on a symbolic S in
tract 0.23.9, so every bound is ``n - c`` with n the runtime length. As the op does, full
is formed in the weight's dtype and the new state sliced from it (then in the state's dtype);
the arithmetic runs on full cast to f32 (f64 for f64 weights), the output in x's dtype. In
f16, K multiply-adds each rounded to f16 strayed twice as far from f32 as the op's F.conv1d
(seen on the recurrent states of a tiny f16 Qwen3.5 step, 1.5e-3 against 8.5e-4), and
tract's f16 element-wise ops are slower than one cast of full (docs/FACTS.md).
"""

from __future__ import annotations

from typing import Optional

from gdn_fx.lowering.node_facts import ConvFacts, portable_dtype_reason
from gdn_fx.lowering.fragment_files import generated
from gdn_fx.lowering.nnef_emit import EmitContext, nnef_dtype_name, promote
from gdn_fx.lowering.target import Target


def check(facts: ConvFacts, target: Target) -> Optional[str]:
    """Why the multiply-add form can not serve this node (None: it can)."""
    return portable_dtype_reason(facts)


def suits_depthwise(facts: ConvFacts, target: Target) -> Optional[str]:
    """Why the depthwise-conv form, which can serve every node the multiply-adds can, is not
    the default for this one (None: it is). Under tract's CUDA runtime it always is: the
    whole 0.8B-shaped generator decodes in 11.3 ms against 12.9 with the multiply-adds, which
    tract's slice push-up cuts in three (1224 kernels a step against 1764; prefill of 512
    tokens 133.7 against 136.2 ms; H100, bench/bench_cuda_generate.py, 2026-12-06)."""
    if target.runtime == "cuda":  # one CudaConv launch where the multiply-adds take ~31
        return None
    if facts.seq is None or target.dynamic:
        return ("symbolic S: tract 0.23.9 runs a depthwise conv of symbolic length as im2col "
                "and a matmul, 8-52x slower than the multiply-adds (bench/bench_conv.py)")
    if facts.seq == 1:
        return "S = 1: the multiply-add form is faster for one step (bench/bench_conv.py)"
    return None


def fragment_name(kernel: int, bias: bool, silu: bool, depthwise: bool = False) -> str:
    """One fragment per (K, bias, activation, form): e.g. ``gdn_fx_conv_update_k4_bias_silu``,
    ``gdn_fx_conv_update_dw_k4_silu``."""
    return (f"gdn_fx_conv_update{'_dw' if depthwise else ''}_k{kernel}" + ("_bias" if bias else "")
            + ("_silu" if silu else ""))


def _tap(kernel: int, j: int, axis: int) -> str:
    """Tap j of the window: full[1 + j : n - (K - 1 - j)] along the time ``axis`` (x for the
    last one)."""
    return f"slice(full, axes = [{axis}], begin = [{1 + j}], end = [n - {kernel - 1 - j}])"


def _taps_lines(kernel: int) -> list[str]:
    """``acc`` = the K multiply-adds of the portable form, on time-major [B, K + S, C] tensors
    (``weight`` given as [K, C]): each tap is a block of whole rows and its weights a row."""
    lines = []
    for j in range(kernel):
        row = f"unsqueeze(slice(weight, axes = [0], begin = [{j}], end = [{j + 1}]), axes = [0])"
        term = f"mul({_tap(kernel, j, 1)}, {row})"
        name = "acc" if j == kernel - 1 else f"acc{j}"
        lines.append(f"{name} = " + (term if j == 0 else f"add(acc{j - 1}, {term})") + ";")
    return lines


def _depthwise_lines(kernel: int) -> list[str]:
    """``acc`` = the depthwise conv of full (S + 1 outputs), its first output dropped."""
    return [f"filters = reshape(weight, shape = [-1, 1, {kernel}]);",
            "conv_all = conv(full, filters, 0.0, border = 'constant', padding = [(0, 0)],"
            " stride = [1], dilation = [1], groups = 0);",
            f"acc = slice(conv_all, axes = [2], begin = [1], end = [n - {kernel - 1}]);"]


def fragment_text(kernel: int, bias: bool, silu: bool, depthwise: bool = False) -> str:
    """The NNEF text of the fragment for one (K, bias, activation, form). The depthwise form
    reads channel-major [B, C, K + S] tensors (NNEF's conv layout), the multiply-adds
    time-major [B, K + S, C] ones."""
    time = 2 if depthwise else 1
    params = ["kept", "full", "weight"] + (["bias"] if bias else [])
    body = [f"n = squeeze(slice(tract_core_shape_of(full), axes = [0], begin = [{time}],"
            f" end = [{time + 1}]), axes = [0]);"]
    body += _depthwise_lines(kernel) if depthwise else _taps_lines(kernel)
    pre = "acc"
    if bias:
        channel_row = [0, 2] if depthwise else [0, 1]  # the bias along the channel axis
        body.append(f"biased = add({pre}, unsqueeze(bias, axes = {channel_row}));")
        pre = "biased"
    body.append(f"out = mul({pre}, sigmoid({pre}));" if silu else f"out = copy({pre});")
    body.append(f"new_state = slice(kept, axes = [{time}], begin = [n - {kernel}], end = [n]);")
    signature = ", ".join(f"{p}: tensor<scalar>" for p in params)
    lines = "\n".join(f"    {line}" for line in body)
    return (f"fragment {fragment_name(kernel, bias, silu, depthwise)}( {signature} )\n"
            f"-> ( out: tensor<scalar>, new_state: tensor<scalar> )\n{{\n{lines}\n}}")


def emit(ctx: EmitContext) -> list:
    """Write the multiply-add form for one node; returns the fragment it needs."""
    return _emit(ctx, depthwise=False)


def emit_depthwise(ctx: EmitContext) -> list:
    """Write the depthwise-conv form for one node; returns the fragment it needs."""
    return _emit(ctx, depthwise=True)


def _emit(ctx: EmitContext, depthwise: bool) -> list:
    """The fragment call for one node: full = cat(state, x) kept in the weight's dtype (the
    new state's source) and cast to the arithmetic's dtype. The multiply-adds run time-major:
    x arrives as the transpose of a [B, S, C] projection and its output is transposed back
    by the model, so tract cancels both moves; channel-major, every tap was a strided copy
    (the update took ~8 % of a 128-token prefill chunk of the Qwen3.5 shapes)."""
    facts = ctx.facts
    kept_dtype = facts.dtypes["weight"]
    work = promote("f32", kept_dtype)
    batch, channels, seq = facts.shapes["x"]
    width = facts.shapes["conv_state"][2]
    time = 2 if depthwise else 1
    x, state = (_time_major(ctx, ctx.cast(ctx.operands[name], kept_dtype, name), name,
                            not depthwise) for name in ("x", "conv_state"))
    length = None if seq is None else seq + width
    kept = ctx.concat([state, x], time, "full",
                      (batch, channels, length) if depthwise else (batch, length, channels),
                      kept_dtype)
    weight = ctx.cast(ctx.operands["weight"], work, "weight")
    if not depthwise:
        weight = ctx.apply("transpose", [weight], "weight_t", (facts.kernel, channels), work,
                           {"axes": [1, 0]})
    inputs = [kept, ctx.cast(kept, work, "full"), weight] + (
        [ctx.cast(ctx.operands["bias"], work, "bias")] if facts.has_bias else [])
    out = ctx.tensor("out", _layout((batch, channels, seq), not depthwise), work)
    new_state = ctx.tensor("new_state", _layout((batch, channels, width), not depthwise),
                           kept_dtype)
    silu = facts.activation == "silu"
    name = fragment_name(facts.kernel, facts.has_bias, silu, depthwise)
    ctx.apply_multi(name, inputs, (out, new_state))
    ctx.finish(0, _time_major(ctx, out, "out", not depthwise), facts.dtypes["x"])
    ctx.finish(1, _time_major(ctx, new_state, "new_state", not depthwise),
               facts.dtypes["conv_state"])
    return [generated(name, fragment_text(facts.kernel, facts.has_bias, silu, depthwise))]


def _layout(shape: tuple, swap: bool) -> tuple:
    return (shape[0], shape[2], shape[1]) if swap else shape


def _time_major(ctx: EmitContext, tensor, suffix: str, swap: bool):
    """``tensor`` with its last two axes swapped ([B, C, T] <-> [B, T, C]) when ``swap``."""
    if not swap:
        return tensor
    return ctx.apply("transpose", [tensor], f"{suffix}_t", _layout(tensor.shape, True),
                     nnef_dtype_name(tensor), {"axes": [0, 2, 1]})
