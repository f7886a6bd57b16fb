"""Candidate "portable" for causal_conv1d_update: plain NNEF, one fragment per kernel width.

With full = cat(state, x) of length K + S, output step t reads full[1 + t : 1 + t + K], so
``out = sum_j weight[:, j] * full[..., 1 + j : 1 + j + S]`` (tap K - 1 is x itself), then the
bias and SiLU when the node has them; ``new_state = full[..., -K:]``. No ``conv`` op is used,
so tract 0.23.9's depthwise-conv miscompile (a constant filter behind an unsqueeze reads the
wrong weights) can not occur. Slice ends are written from ``tract_core_shape_of(full)``:
negative ends break on a symbolic S in tract 0.23.9, so every bound is ``n - c`` with n the
runtime length. Arithmetic runs in the weight's dtype, as the op's kernel does; the output
takes x's dtype and the new state the state's dtype.
"""

from __future__ import annotations

from typing import Optional

from gdn_fx.lowering.facts import ConvFacts, portable_dtype_reason
from gdn_fx.lowering.fragments import generated
from gdn_fx.lowering.nnef_emit import EmitContext
from gdn_fx.lowering.target import Target

def check(facts: ConvFacts, target: Target) -> Optional[str]:
    """Why the portable form can not serve this node (None: it can)."""
    return portable_dtype_reason(facts)


def fragment_name(kernel: int, bias: bool, silu: bool) -> str:
    """One fragment per (K, bias, activation): e.g. ``gdn_fx_conv_update_k4_bias_silu``."""
    return f"gdn_fx_conv_update_k{kernel}" + ("_bias" if bias else "") + ("_silu" if silu else "")


def _tap(kernel: int, j: int) -> str:
    """Tap j of the window: full[..., 1 + j : n - (K - 1 - j)], i.e. x for the last one."""
    if j == kernel - 1:
        return "x"
    return f"slice(full, axes = [2], begin = [{1 + j}], end = [n - {kernel - 1 - j}])"


def fragment_text(kernel: int, bias: bool, silu: bool) -> str:
    """The NNEF text of the fragment for one (K, bias, activation)."""
    params = ["x", "state", "weight"] + (["bias"] if bias else [])
    body = ["full = concat([state, x], axis = 2);",
            "n = squeeze(slice(tract_core_shape_of(full), axes = [0], begin = [2], end = [3]),"
            " axes = [0]);"]
    for j in range(kernel):
        column = f"unsqueeze(slice(weight, axes = [1], begin = [{j}], end = [{j + 1}]), axes = [0])"
        term = f"mul({_tap(kernel, j)}, {column})"
        body.append(f"acc{j} = " + (term if j == 0 else f"add(acc{j - 1}, {term})") + ";")
    pre = f"acc{kernel - 1}"
    if bias:
        body.append(f"biased = add({pre}, unsqueeze(bias, axes = [0, 2]));")
        pre = "biased"
    body.append(f"out = mul({pre}, sigmoid({pre}));" if silu else f"out = copy({pre});")
    body.append(f"new_state = slice(full, axes = [2], begin = [n - {kernel}], end = [n]);")
    signature = ", ".join(f"{p}: tensor<scalar>" for p in params)
    lines = "\n".join(f"    {line}" for line in body)
    return (f"fragment {fragment_name(kernel, bias, silu)}( {signature} )\n"
            f"-> ( out: tensor<scalar>, new_state: tensor<scalar> )\n{{\n{lines}\n}}")


def emit(ctx: EmitContext) -> list:
    """Write the fragment call for one node, with the casts its dtypes need."""
    facts = ctx.facts
    work = facts.dtypes["weight"]
    names = ["x", "conv_state", "weight"] + (["bias"] if facts.has_bias else [])
    inputs = [ctx.cast(ctx.operands[name], work, name) for name in names]
    out = ctx.tensor("out", facts.shapes["x"], work)
    new_state = ctx.tensor("new_state", facts.shapes["conv_state"], work)
    silu = facts.activation == "silu"
    name = fragment_name(facts.kernel, facts.has_bias, silu)
    ctx.apply_multi(name, inputs, (out, new_state))
    ctx.finish(0, out, facts.dtypes["x"])
    ctx.finish(1, new_state, facts.dtypes["conv_state"])
    return [generated(name, fragment_text(facts.kernel, facts.has_bias, silu))]
