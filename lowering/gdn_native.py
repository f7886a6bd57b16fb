"""Candidate "native" for gated_delta_scan: tract's ``tract_transformers_gdn_recurrent``.

The operator computes, on RAW q/k in layout q, k [b, S, hk, w], v [b, S, hv, w],
log_decay/beta [b, S, hv], state [b, hv, w, w] (value head h reads key head h // (hv / hk)):
q and k are l2-normalized inside (eps 1e-6) and the output is scaled by 1 / sqrt(w). So it
serves a node only when qk_l2norm is True and scale == 1 / sqrt(Dk), with a scalar (GDN) gate
and Dk == Dv. What else it accepts depends on the release (docs/FACTS.md, "tract: native
operators, release by release"):

- before 0.23.5: no such operator;
- 0.23.5 to 0.23.8 (the first form; later releases did not say when it widened, so every one
  before 0.23.9 is held to it): one decode step (S == 1, no symbolic axes), width 128, no GQA,
  q/k/v/beta f16 with log_decay/state f32;
- 0.23.9: any S (symbolic too), any width, GQA, and exactly three dtype sets: all f32;
  q/k/v/beta f16 with log_decay/state f32; q/k/v/beta/state f16 with log_decay f32.
  Its output takes q's dtype; the op contract wants promote(q, state), so a cast follows.

A f16 log decay is cast to f32 on the way in (a lossless widening).

Under tract's CUDA runtime (0.23.9, measured with bench/bench_cuda.py on an H200) the operator
has a CUDA kernel only for f16 q/k/v/beta with an f32 state, width 128, batch 1
(``device_reason``); other dtypes and batches run the CPU operator (a scalar loop, 20-50x
slower), and f16 operands of another width reach the kernel and FAIL at run time (``check``
refuses them under CUDA). Inside them the kernel is a
step loop: fastest at S = 1, slower than "chunked_parallel" for static prefill (``suits``).
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np
from nnef_tools.model import Graph as NGraph
from nnef_tools.model import Operation as NOperation
from nnef_tools.model import Tensor as NTensor

from gdn_fx.lowering.node_facts import SCAN_OPERANDS, ScanFacts
from gdn_fx.lowering.nnef_emit import EmitContext, nnef_dtype_name, promote
from gdn_fx.lowering.target import Target, as_target

OP = "tract_transformers_gdn_recurrent"
MIN_VERSION = "0.23.5"
WIDE_VERSION = "0.23.9"  # first release measured with any S / width / GQA / three dtype sets
FIRST_WIDTH = 128

# Accepted dtypes of (q, k, v, beta, initial_state); log_decay is always f32 (after the cast).
FIRST_DTYPES = {("f16", "f16", "f16", "f16", "f32")}
WIDE_DTYPES = {("f32",) * 5, ("f16", "f16", "f16", "f16", "f32"), ("f16",) * 5}
_STEP_OPERANDS = ("q", "k", "v", "beta", "initial_state")


# The CUDA kernel's limits, tract 0.23.9 (bench/bench_cuda.py --probe on an H200).
CUDA_WIDTH = 128
CUDA_BATCH = 1
CUDA_OPERAND_DTYPE = "f16"  # q, k, v, beta
CUDA_STATE_DTYPE = "f32"  # an f16 state runs on the CPU
# Static S from which "chunked_parallel" beats the kernel (bench/bench_cuda.py, H200, 20:12
# run of the text with the sequential state pass: 0.625x the kernel's time at S = 256, 0.32x
# at 512; 1.03x at 128 and 1.24x at 64, slower there; the text before measured 0.85x at 128
# in one run).
CUDA_CHUNKED_FROM = 256


def _cuda_width_reason(facts: ScanFacts, target: Target) -> Optional[str]:
    """Under CUDA, tract 0.23.9 gives f16 operands of any width to its kernel, which then
    fails at run time ("the Qwen3.5 kernel currently requires width=128"): refused."""
    if target.runtime == "cuda" and facts.dk != CUDA_WIDTH and \
            facts.dtypes["q"] == CUDA_OPERAND_DTYPE:
        return (f"under CUDA tract runs the op with its kernel, which fails for width "
                f"{facts.dk} (it requires {CUDA_WIDTH})")
    return None


def device_reason(facts: ScanFacts, target: Target) -> Optional[str]:
    """Why tract would run the operator on the CPU under the target's runtime (None: it
    stays on the device): under CUDA, outside its kernel's dtypes and batch."""
    if target.runtime != "cuda":
        return None
    operands = {name: facts.dtypes[name] for name in ("q", "k", "v", "beta", "initial_state")}
    wanted = dict.fromkeys(("q", "k", "v", "beta"), CUDA_OPERAND_DTYPE) | {
        "initial_state": CUDA_STATE_DTYPE}
    if operands != wanted:
        return f"the CUDA kernel takes {wanted}; node has {operands}"
    if facts.dk != CUDA_WIDTH:
        return f"the CUDA kernel needs width {CUDA_WIDTH}; node has {facts.dk}"
    if facts.batch != CUDA_BATCH:
        batch = "a symbolic batch" if facts.batch is None else f"batch {facts.batch}"
        return f"the CUDA kernel serves batch {CUDA_BATCH}; node has {batch}"
    return None


def suits(facts: ScanFacts, target: Target) -> Optional[str]:
    """Under CUDA the kernel's step loop loses to "chunked_parallel" for static prefill."""
    if target.runtime != "cuda" or target.dynamic or facts.seq is None:
        return None
    if facts.seq >= CUDA_CHUNKED_FROM:
        return (f"static S={facts.seq} >= {CUDA_CHUNKED_FROM}: 'chunked_parallel' measured "
                "faster than the CUDA kernel's step loop (bench/bench_cuda.py)")
    return None


def native_gdn_min_version() -> str:
    """The first tract release carrying ``tract_transformers_gdn_recurrent``."""
    return MIN_VERSION


def _flags_reason(facts: ScanFacts) -> Optional[str]:
    """The operator's fixed math: in-op l2norm, 1/sqrt(Dk) scale, scalar gate, Dk == Dv."""
    if not facts.qk_l2norm:
        return "the op l2-normalizes q/k itself; node has qk_l2norm=False"
    want = 1.0 / math.sqrt(facts.dk)
    if not math.isclose(facts.scale, want, rel_tol=1e-6):
        return f"the op scales by 1/sqrt(Dk)={want:.6g}; node has scale={facts.scale:.6g}"
    if facts.kda:
        return "KDA (per-key) gate; the op takes one decay per head"
    if facts.dk != facts.dv:
        return f"Dk={facts.dk} != Dv={facts.dv}; the op needs square states"
    return None


def _dtype_reason(facts: ScanFacts, accepted: set, version: str) -> Optional[str]:
    if facts.dtypes["g"] not in ("f16", "f32"):
        return f"log decay g is {facts.dtypes['g']}; the op takes f32"
    got = tuple(facts.dtypes[name] for name in _STEP_OPERANDS)
    if got not in accepted:
        named = dict(zip(_STEP_OPERANDS, got))
        return f"dtypes {named} are not a set tract {version} accepts"
    return None


def _first_form_reason(facts: ScanFacts, target: Target) -> Optional[str]:
    """The 0.23.5 operator: one decode step, width 128, no GQA, f16 operands / f32 state."""
    if target.dynamic:
        return f"tract {target.version_text} decodes one step and the export has symbolic axes"
    if facts.seq != 1:
        seq = "a symbolic S" if facts.seq is None else f"S={facts.seq}"
        return f"tract {target.version_text} decodes one step; node has {seq}"
    if facts.dk != FIRST_WIDTH:
        return f"tract {target.version_text} needs width {FIRST_WIDTH}; node has {facts.dk}"
    if facts.groups != 1:
        return f"tract {target.version_text} has no GQA; node has {facts.groups} groups"
    return _dtype_reason(facts, FIRST_DTYPES, target.version_text)


def check(facts: ScanFacts, target: Target) -> Optional[str]:
    """Why the native operator can not serve this node on this target (None: it can)."""
    if not target.at_least(MIN_VERSION):
        return f"tract {target.version_text} has no {OP} (first in {MIN_VERSION})"
    reason = _flags_reason(facts)
    if reason is not None:
        return reason
    if not target.at_least(WIDE_VERSION):
        return _first_form_reason(facts, target)
    return _dtype_reason(facts, WIDE_DTYPES, target.version_text) or \
        _cuda_width_reason(facts, target)


def emit(ctx: EmitContext) -> list:
    """Write the operator for a node whose operands arrive in the op-contract layout."""
    ops = ctx.operands
    operands = [ops[name] for name in SCAN_OPERANDS]
    out_dtype = promote(nnef_dtype_name(ops["q"]), nnef_dtype_name(ops["initial_state"]))
    outputs = (ctx.output_tensor(0, ops["v"].shape, out_dtype),
               ctx.output_tensor(1, ops["initial_state"].shape,
                                 nnef_dtype_name(ops["initial_state"])))
    return emit_native_gdn_recurrent(ctx.graph, operands, outputs, head_major=False)


def _facts_of_tensors(operands: Sequence[NTensor], head_major: bool) -> ScanFacts:
    """Facts of raw operands, with the flags the operator itself implements."""
    shapes = {}
    for name, tensor in zip(SCAN_OPERANDS, operands):
        shape = tuple(tensor.shape)
        if head_major and name != "initial_state":  # [B, H, S, ...] -> [B, S, H, ...]
            shape = (shape[0], shape[2], shape[1]) + shape[3:]
        shapes[name] = shape
    dtypes = {name: nnef_dtype_name(t) for name, t in zip(SCAN_OPERANDS, operands)}
    dk = shapes["q"][-1]
    return ScanFacts(node="operands", shapes=shapes, dtypes=dtypes, scale=dk ** -0.5,
                     qk_l2norm=True)


def native_gdn_reject_reason(target, operands: Sequence[NTensor],
                             head_major: bool) -> Optional[str]:
    """Why these NNEF operands can NOT become tract's native operator (None when they can).

    ``operands`` is (query, key, value, log_decay, beta, state) as NNEF tensors, fed RAW (the
    operator normalizes q/k and scales by 1/sqrt(width) itself). ``head_major`` says the
    per-step operands are [B, H, S, ...] instead of the operator's [B, S, H, ...].
    ``target`` is a ``Target``, a version string, or a torch-to-nnef ``TractNNEF``.
    """
    target = as_target(target)
    shapes = [tuple(t.shape) for t in operands]
    if len(operands) != 6 or [len(s) for s in shapes] != [4, 4, 4, 3, 3, 4]:
        return f"operand ranks {[len(s) for s in shapes]}; expected [4, 4, 4, 3, 3, 4]"
    return check(_facts_of_tensors(operands, head_major), target)


def _seq_second(graph: NGraph, tensor: NTensor, suffix: str) -> NTensor:
    """[B, H, S, ...] -> [B, S, H, ...] (the transpose is its own inverse)."""
    rank = len(tensor.shape)
    axes = [0, 2, 1] + list(range(3, rank))
    shape = tuple(tensor.shape[a] for a in axes)
    out = NTensor(graph, name=f"{tensor.name}_{suffix}", dtype=tensor.dtype, shape=shape)
    NOperation(graph, type="transpose", attribs={"axes": axes}, inputs=(tensor,),
               outputs=(out,))
    return out


def _write_into(graph: NGraph, source: NTensor, target: NTensor) -> None:
    """target = source, cast when their dtypes differ."""
    if source.dtype == target.dtype:
        NOperation(graph, type="copy", inputs=(source,), outputs=(target,))
    else:
        NOperation(graph, type="tract_core_cast", attribs={"to": nnef_dtype_name(target)},
                   inputs=(source,), outputs=(target,))


def emit_native_gdn_recurrent(graph: NGraph, operands: Sequence[NTensor],
                              outputs: Sequence[NTensor], head_major: bool) -> list:
    """Emit ``tract_transformers_gdn_recurrent(q, k, v, log_decay, beta, state)``.

    ``outputs`` (output, final_state) are created by the caller in ITS layout and dtypes.
    With ``head_major`` the per-step operands and the output are [B, H, S, ...]: they are
    transposed to the operator's [B, S, H, ...] on the way in and back on the way out. When
    an output's dtype differs from what the operator yields (output in q's dtype, final state
    in the state's dtype), a cast follows; a f16 log decay is cast to f32 first. Returns the
    torch-to-nnef fragment keys needed.
    """
    operands = list(operands)
    out, final = outputs
    if nnef_dtype_name(operands[3]) != "f32":  # the op takes an f32 log decay: widen it
        widened = NTensor(graph, name=f"{out.name}_log_decay_f32", dtype=np.float32,
                          shape=tuple(operands[3].shape))
        _write_into(graph, operands[3], widened)
        operands[3] = widened
    if head_major:
        operands[:5] = [_seq_second(graph, t, "gdn_seq_second") for t in operands[:5]]
    raw_out = out if not head_major and out.dtype == operands[0].dtype else NTensor(
        graph, name=f"{out.name}_gdn_native", dtype=operands[0].dtype,
        shape=tuple(operands[2].shape))
    raw_final = final if final.dtype == operands[5].dtype else NTensor(
        graph, name=f"{final.name}_gdn_native", dtype=operands[5].dtype,
        shape=tuple(operands[5].shape))
    NOperation(graph, type=OP, inputs=tuple(operands), outputs=(raw_out, raw_final))
    if raw_out is not out:
        _write_into(graph, _seq_second(graph, raw_out, "head_major") if head_major else raw_out,
                    out)
    if raw_final is not final:
        _write_into(graph, raw_final, final)
    return ["tract_transformers"]
