"""Shared pieces of the matmul-form candidates for gated_delta_scan ("matmul", "chunked",
"chunked_unrolled"): dtype checks, constants written as NNEF variables, generated fragments
named by their content, and the NNEF text of the prologue (casts aside) they all start with.

The candidates write their NNEF as generated fragment text: shapes that never change at run
time (head counts, widths, chunk size, the q scale) are literals in the text; the batch and
the sequence length are read at run time with ``tract_core_shape_of``, so a symbolic batch or
sequence axis is served by the same text.
"""

from __future__ import annotations

import hashlib

import numpy as np
from nnef_tools.model import Operation as NOperation
from nnef_tools.model import Tensor as NTensor
from torch_to_nnef.op.fragment import Fragment

from gdn_fx.lowering.node_facts import SCAN_OPERANDS, ScanFacts
from gdn_fx.lowering.fragment_files import generated
from gdn_fx.lowering.nnef_emit import NUMPY, EmitContext, promote

L2NORM_EPS = 1e-6  # HF's use_qk_l2norm_in_kernel eps (the op contract's)


def work_dtype(facts: ScanFacts) -> str:
    """The arithmetic dtype, as the op's kernel: f32, or f64 when q or the state is f64."""
    return promote("f32", facts.dtypes["q"], facts.dtypes["initial_state"])


def variable(ctx: EmitContext, suffix: str, array: np.ndarray, dtype: str) -> NTensor:
    """A constant as an NNEF variable (NNEF here has no literal-tensor op), named after the
    node. Constants are stored at the full rank of the tensors they meet: tract broadcasting
    pads the lower-rank operand with TRAILING axes (docs/FACTS.md, "tract: loading and graphs")."""
    data = np.ascontiguousarray(array, dtype=NUMPY[dtype])
    tensor = ctx.tensor(suffix, data.shape, dtype)
    tensor.data = data
    NOperation(ctx.graph, type="variable", inputs=None, outputs=(tensor,),
               attribs={"label": tensor.name, "shape": list(data.shape),
                        "dtype": data.dtype})
    return tensor


def fragment(base: str, text_of_name) -> tuple[str, Fragment]:
    """(name, fragment) for generated text; the name carries a digest of the text, so two
    nodes share a fragment exactly when their text is the same.

    ``text_of_name(suffix)`` returns the definitions, every fragment name ending in ``suffix``.
    """
    digest = hashlib.sha1(text_of_name("").encode()).hexdigest()[:10]
    suffix = f"_{digest}"
    return base + suffix, generated(base + suffix, text_of_name(suffix))


def literal(value: float) -> str:
    """A float as NNEF text, exactly (repr round-trips)."""
    text = repr(float(value))
    return text if any(c in text for c in ".en") else text + ".0"


def l2norm_fragment(suffix: str) -> str:
    """``gdn_fx_fast_l2norm``: x * rsqrt(sum(x*x over the head dim, axis 3) + eps)."""
    return fragment_text(f"gdn_fx_fast_l2norm{suffix}", ["x"], ["y"], [
        f"y = mul(x, rsqrt(add(sum_reduce(mul(x, x), axes = [3]), {literal(L2NORM_EPS)})));"])


def prologue_lines(facts: ScanFacts, suffix: str) -> list[str]:
    """NNEF lines turning raw q, k into ``qs`` (normalized when asked, times the ``scale``
    tensor) and ``kn``."""
    norm = f"gdn_fx_fast_l2norm{suffix}"
    q = f"{norm}(q)" if facts.qk_l2norm else "q"
    k = f"{norm}(k)" if facts.qk_l2norm else "copy(k)"
    return [f"qs = mul({q}, scale);", f"kn = {k};"]


def scale_variable(ctx: EmitContext, work: str) -> NTensor:
    """The q scale as a [1, 1, 1, 1] constant: a scalar literal in NNEF text is read as f32 by
    tract, which would round the scale of an f64 graph."""
    return variable(ctx, "scale", np.full((1, 1, 1, 1), ctx.facts.scale), work)


def dims_lines() -> list[str]:
    """NNEF lines reading the batch ``b`` and the sequence length ``n`` at run time."""
    return ["b = squeeze(slice(tract_core_shape_of(q), axes = [0], begin = [0], end = [1]),"
            " axes = [0]);",
            "n = squeeze(slice(tract_core_shape_of(q), axes = [0], begin = [1], end = [2]),"
            " axes = [0]);"]


def pad_tail(facts, operand: str) -> tuple[str, str]:
    """(the dims after [B, S] of ``operand``, the constant that pads it) for ``padded_line``:
    q, k [Hk, Dk] and v [Hv, Dv] padded with ``zero4``; a gate or beta of one value per head
    [Hv] with ``zero3`` (the chunked forms take no per-key-channel gate)."""
    if operand in ("q", "k"):
        return f", {facts.key_heads}, {facts.dk}", "zero4"
    if operand == "v":
        return f", {facts.value_heads}, {facts.dv}", "zero4"
    return f", {facts.value_heads}", "zero3"


def padded_line(name: str, source: str, pad: str, tail: str, zero: str,
                block: int = 0) -> str:
    """NNEF: ``name`` = ``source`` [B, S, ...] zero-padded by ``pad`` positions (an NNEF dim
    expression, "0" for none) along S with the [1, ..] constant ``zero`` broadcast to
    [b, pad``tail``]; cut into blocks [B, n, ``block``, ...] when ``block`` is given. (The
    pad needs ``dims_lines``' ``b``; tract's ``pad`` op needs concrete sizes: docs/FACTS.md.)"""
    if pad != "0":
        source = (f"concat([{source}, tract_core_broadcast({zero}, shape = [b, {pad}{tail}])],"
                  " axis = 1)")
    if block:
        source = f"reshape({source}, shape = [-1, {block}], axis_start = 1, axis_count = 1)"
    return f"{name} = {source if '(' in source else f'copy({source})'};"


def fragment_text(name: str, params: list[str], outputs: list[str], lines: list[str]) -> str:
    """One NNEF fragment definition with tensor parameters and results."""
    signature = ",\n    ".join(f"{p}: tensor<scalar>" for p in params)
    results = ", ".join(f"{o}: tensor<scalar>" for o in outputs)
    body = "\n".join(f"    {line}" for line in lines)
    return f"fragment {name}(\n    {signature}\n) -> ( {results} )\n{{\n{body}\n}}\n"


def prepared_operands(ctx: EmitContext, work: str,
                      names: tuple[str, ...] = SCAN_OPERANDS) -> list[NTensor]:
    """The node's operands ``names`` (default q, k, v, g, beta, initial_state) cast to the
    work dtype (casts only where needed)."""
    return [ctx.cast(ctx.operands[name], work, name) for name in names]


def finish_outputs(ctx: EmitContext, out: NTensor, final: NTensor) -> None:
    """Give the node's outputs their contract dtypes: promote(q, state) and the state's."""
    facts = ctx.facts
    ctx.finish(0, out, promote(facts.dtypes["q"], facts.dtypes["initial_state"]))
    ctx.finish(1, final, facts.dtypes["initial_state"])
