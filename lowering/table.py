"""THE lowering table: for each fused op, its candidates in order of preference.

A candidate is a name, a pure check ``(facts, target) -> reason | None`` and an emitter
``(EmitContext) -> fragments`` (the torch-to-nnef fragment keys / objects the NNEF needs).
The first candidate whose check passes wins; every rejection is logged (logger
``gdn_fx.lowering``) and kept in the returned ``Decision``.

The order is decided by bench/ measurements on tract 0.23.9 CPU (bench/bench_gdn_fast.py:
B=1, 16 heads of 128; bench/bench_conv.py: 6144 channels, K=4). By shape class:
- gated_delta_scan, decode S = 1 static: "matmul_step" (one matmul step; ~0.3x the native
  operator's time);
- gated_delta_scan, static prefill up to 1024 (GDN gate, q/k l2norm in the node):
  "chunked_unrolled" (chunks written out, shrunk for short S; up to 16 chunks of 64);
- gated_delta_scan, symbolic S (same conditions): "split" (the loop over chunks for the
  whole chunks, then a loop of matmul steps for the S mod 64 tokens left: at S = 1 it costs
  one step, so one graph serves decode and prefill; lowering/gdn_split.py);
- gated_delta_scan, static S past 16 chunks (same conditions): "chunked" (a loop over chunks);
- gated_delta_scan, KDA gates or qk_l2norm=False: "matmul" (a loop of matmul steps);
- causal_conv1d_update, static S = 1 or symbolic S: "portable" (K multiply-adds; ~2x faster
  than the native operator, 1.7-2x faster than "depthwise" at S = 1; with a symbolic S tract
  runs its conv as im2col + matmul, 8-52x slower than the multiply-adds at S = 1..512);
- causal_conv1d_update, longer static S: "depthwise" (tract's conv kernel; 2-10x faster
  than "portable", whose time at S = 64 swings between 1.5 and 9 ms from run to run, and ~9x
  faster than the native operator).
- gated_linear_scan (bench/bench_linear_scan.py: one Mamba2 layer core of Falcon-H1-0.5B,
  24 value heads of 64 on one key head of 128): static S = 1 "matmul_step"; static prefill up
  to 1024 (one decay per head) "chunked_unrolled" (0.07-0.08x the step loop at S = 64 and
  512), longer "chunked"; symbolic S on the CPU "split" where the graph serves decode (S = 1:
  half "chunked"'s time), else "chunked" (1.3-1.6x faster than "split" at S = 64 and 512);
  gates per key channel (GLA, Mamba1) "matmul".
The native operators (and "scan") stay as fallbacks and can be forced with ``choose``.

Under tract's CUDA runtime (``Target.runtime == "cuda"``) the candidates are tried in
``CUDA_ORDER``, measured with bench/bench_cuda.py on an H200 (same layer core, f16 q/k/v/beta
with f32 gate and state; figures in bench/RESULTS.md):
- the native operator's CUDA kernel serves decode S = 1 and symbolic S (its CUDA limits are
  its ``device`` check: f16 q/k/v/beta, width 128, batch 1);
- static S >= 2: "chunked_parallel" (every chunk's terms at once, the state pass one matmul
  per chunk), where the native kernel does not take the node: from S = 256 the kernel's
  ``suits`` gives way to it (``gdn_native.CUDA_CHUNKED_FROM``);
- symbolic S in a graph that does not serve decode (a main / decode pair's main graph,
  ``Target.serves_decode``): "chunked_window", the batched chunks of a fixed window of 512
  tokens, S zero-padded to it (at most 512 tokens a call: the NNEF says so in
  "gdn_fx_max_tokens", which the generator reads to cut a prompt); the kernel steps token by
  token (bench/bench_cuda_generate.py);
- a candidate whose ops tract runs on the CPU there (every ``tract_core_scan``: "chunked",
  "matmul", "scan"; the native operator outside its kernel's limits) is DEMOTED: it is taken
  only when nothing that stays on the GPU accepts the node, and the decision says so (logged
  as a warning, kept in ``Decision.note`` and in the NNEF property "gdn_fx_cpu_fallback").
The conv update under CUDA: "depthwise" at every S (tract's CudaConv, one launch; the
multiply-adds are cut in three by tract's slice push-up; bench/bench_cuda_generate.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Optional, Union

from gdn_fx.errors import InternalError, LoweringUnsupported, UnknownName
from gdn_fx.lowering import (conv_native, conv_portable, gdn_chunked, gdn_chunked_parallel,
                             gdn_matmul, gdn_native, gdn_scan, gdn_split, linear_chunked,
                             linear_matmul, linear_split)
from gdn_fx.lowering.choice import Choice
from gdn_fx.lowering.node_facts import ConvFacts, LinearFacts, ScanFacts, describe
from gdn_fx.lowering.target import Target

LOGGER = logging.getLogger("gdn_fx.lowering")

Facts = Union[ScanFacts, LinearFacts, ConvFacts]


@dataclass(frozen=True)
class Candidate:
    """One way to write a fused op in NNEF. ``check``: why it can not serve a node (None: it
    can). ``suits``: why it is not the measured choice for the node's shape class although it
    could serve it (skipped by default, still taken when ``choose`` forces it). ``device``:
    why, under the target's runtime, tract would run it on the CPU (None: it stays on the
    device); such a candidate is demoted behind every one that stays."""

    name: str
    check: Callable[[Facts, Target], Optional[str]]
    emit: Callable
    suits: Optional[Callable[[Facts, Target], Optional[str]]] = None
    device: Optional[Callable[[Facts, Target], Optional[str]]] = None
    window: Optional[int] = None  # the most tokens one call may take (NNEF: gdn_fx_max_tokens)


def _on_cpu_under_cuda(facts: Facts, target: Target) -> Optional[str]:
    """The ``device`` check of a candidate built on tract_core_scan (bench/bench_cuda.py)."""
    if target.runtime == "cuda":
        return "its tract_core_scan has no CUDA kernel: tract runs the loop on the CPU"
    return None


TABLE: dict[str, tuple[Candidate, ...]] = {
    "gated_delta_scan": (  # CPU order measured with bench/bench_gdn_fast.py (see above)
        Candidate("matmul_step", gdn_matmul.check_step, gdn_matmul.emit_step),
        Candidate("chunked_unrolled", gdn_chunked.check_unrolled, gdn_chunked.emit_unrolled),
        Candidate("split", gdn_split.check, gdn_split.emit, suits=gdn_split.suits,
                  device=_on_cpu_under_cuda),
        Candidate("chunked", gdn_chunked.check, gdn_chunked.emit, device=_on_cpu_under_cuda),
        Candidate("matmul", gdn_matmul.check, gdn_matmul.emit, device=_on_cpu_under_cuda),
        Candidate("native", gdn_native.check, gdn_native.emit, suits=gdn_native.suits,
                  device=gdn_native.device_reason),
        Candidate("scan", gdn_scan.check, gdn_scan.emit, device=_on_cpu_under_cuda),
        Candidate("chunked_parallel", gdn_chunked_parallel.check, gdn_chunked_parallel.emit,
                  suits=gdn_chunked_parallel.suits),
        Candidate("chunked_window", gdn_chunked_parallel.check_window,
                  gdn_chunked_parallel.emit_window, suits=gdn_chunked_parallel.suits_window,
                  window=gdn_chunked_parallel.WINDOW),
    ),
    "causal_conv1d_update": (  # order measured with bench/bench_conv.py (see above)
        Candidate("depthwise", conv_portable.check, conv_portable.emit_depthwise,
                  suits=conv_portable.suits_depthwise),
        Candidate("portable", conv_portable.check, conv_portable.emit),
        Candidate("native", conv_native.check, conv_native.emit),
    ),
    "gated_linear_scan": (  # order measured with bench/bench_linear_scan.py (see above)
        Candidate("matmul_step", linear_matmul.check_step, linear_matmul.emit_step),
        Candidate("chunked_unrolled", linear_chunked.check_unrolled,
                  linear_chunked.emit_unrolled),
        Candidate("split", linear_split.check, linear_split.emit, suits=linear_split.suits,
                  device=_on_cpu_under_cuda),
        Candidate("chunked", linear_chunked.check, linear_chunked.emit,
                  device=_on_cpu_under_cuda),
        Candidate("matmul", linear_matmul.check, linear_matmul.emit, device=_on_cpu_under_cuda),
    ),
}


# The order under tract's CUDA runtime (bench/bench_cuda.py on an H200; see above).
CUDA_ORDER: dict[str, tuple[str, ...]] = {
    "gated_delta_scan": ("chunked_window", "native", "chunked_parallel", "matmul_step",
                         "chunked_unrolled", "chunked", "split", "matmul", "scan"),
    "causal_conv1d_update": ("depthwise", "portable", "native"),
    # not measured under CUDA: the CPU order, the tract_core_scan forms demoted by ``device``
    "gated_linear_scan": ("matmul_step", "chunked_unrolled", "split", "chunked", "matmul"),
}


def check_orders(table: dict, cuda_order: dict) -> None:
    """Each runtime's order names every candidate of the table once, and no other (a
    candidate missing from the CUDA order would never be tried there). Run at import."""
    for op, entries in table.items():
        names = sorted(entry.name for entry in entries)
        if sorted(cuda_order.get(op, ())) != names:
            raise InternalError(f"the CUDA order of {op} {list(cuda_order.get(op, ()))} is "
                                f"not a permutation of its table's candidates {names}")
    if set(cuda_order) != set(table):
        raise InternalError(f"the CUDA order names ops {sorted(cuda_order)}, the table "
                            f"{sorted(table)}")


check_orders(TABLE, CUDA_ORDER)


def ordered(op: str, target: Target) -> tuple[Candidate, ...]:
    """The candidates of ``op`` in the order of the target's runtime."""
    if target.runtime != "cuda":
        return TABLE[op]
    return tuple(candidate(op, name) for name in CUDA_ORDER[op])


def candidate_names() -> dict[str, tuple[str, ...]]:
    """Op name -> its candidate names, in table order."""
    return {op: tuple(c.name for c in cands) for op, cands in TABLE.items()}


def candidate(op: str, name: str) -> Candidate:
    """The table entry ``name`` of ``op`` (KeyError naming the valid ones otherwise)."""
    for entry in TABLE[op]:
        if entry.name == name:
            return entry
    raise UnknownName(f"{op} has no candidate {name!r}; candidates: {candidate_names()[op]}")


@dataclass(frozen=True)
class Decision:
    """How one fused node is lowered, and why the earlier candidates were not."""

    node: str
    op: str
    candidate: str
    rejected: tuple[tuple[str, str], ...] = ()
    forced: bool = False
    note: str = ""  # set when the candidate leaves the target's device (runs on the CPU)

    def __str__(self) -> str:
        why = "; ".join(f"{name}: {reason}" for name, reason in self.rejected)
        if not why:
            why = "forced by choose" if self.forced else "first in the table, accepted"
        note = f"  [{self.note}]" if self.note else ""
        return f"{self.node} [{self.op}] -> {self.candidate}  ({why}){note}"


def _reject(facts: Facts, name: str, reason: str) -> tuple[str, str]:
    LOGGER.info("%s [%s]: candidate %s rejected: %s", facts.node, facts.op, name, reason)
    return name, reason


def _screen(entry: Candidate, facts: Facts, target: Target, choice: Choice,
            forced: Optional[str]) -> Optional[str]:
    """Why ``entry`` is not taken for this node (None: it is), before any device question."""
    if entry.name in choice.forbidden(facts.node, facts.op):
        return "forbidden by choose"
    if forced is not None and entry.name != forced:
        return f"choose forces {forced}"
    reason = entry.check(facts, target)
    if reason is None and forced is None and entry.suits is not None:
        reason = entry.suits(facts, target)
    return reason


def _accept(facts: Facts, entry: Candidate, rejected: list, forced: bool,
            note: str = "") -> Decision:
    decision = Decision(facts.node, facts.op, entry.name, tuple(rejected), forced, note)
    if note:
        LOGGER.warning("lowering %s", decision)
    else:
        LOGGER.info("lowering %s", decision)
    return decision


def decide(facts: Facts, target: Target, choice: Optional[Choice] = None) -> Decision:
    """The first acceptable candidate for one node; LoweringUnsupported when none is.

    A candidate that tract would run on the CPU under the target's runtime (its ``device``
    check) is passed over while any later one stays on the device; when none does, the demoted
    one first in the CPU order (``TABLE``) is taken, and its decision carries the reason as
    ``note``."""
    choice = choice or Choice()
    forced = choice.forced(facts.node, facts.op)
    if forced not in candidate_names()[facts.op]:
        forced = None  # a "*" value naming another op's candidate
    rejected, demoted = [], []
    for entry in ordered(facts.op, target):
        reason = _screen(entry, facts, target, choice, forced)
        if reason is None and entry.device is not None:
            off_device = entry.device(facts, target)
            if off_device is not None:
                note = f"runs on the CPU under tract's {target.runtime} runtime: {off_device}"
                demoted.append((entry, note))
                reason = f"demoted: {note}"
        if reason is None:
            return _accept(facts, entry, rejected, forced is not None)
        rejected.append(_reject(facts, entry.name, reason))
    if demoted:  # they all run on the CPU: the CPU order decides between them
        entry, note = min(demoted, key=lambda pair: TABLE[facts.op].index(pair[0]))
        kept = [(name, why) for name, why in rejected if name != entry.name]
        return _accept(facts, entry, kept, forced is not None, note)
    reasons = "; ".join(f"{name}: {why}" for name, why in rejected)
    runtime = "" if target.runtime == "cpu" else f" ({target.runtime} runtime)"
    raise LoweringUnsupported(f"node '{facts.node}' ({facts.op}, {describe(facts)}) on tract "
                              f"{target.version_text}{runtime}: no candidate accepts it "
                              f"({reasons})")
