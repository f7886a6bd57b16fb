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
- gated_delta_scan, longer or symbolic S (same conditions): "chunked" (a loop over chunks);
- gated_delta_scan, KDA gates or qk_l2norm=False: "matmul" (a loop of matmul steps);
- causal_conv1d_update, static S = 1 or symbolic S: "portable" (K multiply-adds; ~2x faster
  than the native operator, 1.7-2x faster than "depthwise" at S = 1; with a symbolic S tract
  runs its conv as im2col + matmul, 8-52x slower than the multiply-adds at S = 1..512);
- causal_conv1d_update, longer static S: "depthwise" (tract's conv kernel; 2-10x faster
  than "portable", whose time at S = 64 swings between 1.5 and 9 ms from run to run, and ~9x
  faster than the native operator).
The native operators (and "scan") stay as fallbacks and can be forced with ``choose``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Optional, Union

from gdn_fx.errors import LoweringUnsupported, UnknownName
from gdn_fx.lowering import (conv_native, conv_portable, gdn_chunked, gdn_matmul, gdn_native,
                             gdn_scan)
from gdn_fx.lowering.choice import Choice
from gdn_fx.lowering.facts import ConvFacts, ScanFacts, describe
from gdn_fx.lowering.target import Target

LOGGER = logging.getLogger("gdn_fx.lowering")

Facts = Union[ScanFacts, ConvFacts]


@dataclass(frozen=True)
class Candidate:
    """One way to write a fused op in NNEF. ``check``: why it can not serve a node (None: it
    can). ``suits``: why it is not the measured choice for the node's shape class although it
    could serve it (skipped by default, still taken when ``choose`` forces it)."""

    name: str
    check: Callable[[Facts, Target], Optional[str]]
    emit: Callable
    suits: Optional[Callable[[Facts, Target], Optional[str]]] = None


TABLE: dict[str, tuple[Candidate, ...]] = {
    "gated_delta_scan": (  # order measured with bench/bench_gdn_fast.py (see above)
        Candidate("matmul_step", gdn_matmul.check_step, gdn_matmul.emit_step),
        Candidate("chunked_unrolled", gdn_chunked.check_unrolled, gdn_chunked.emit_unrolled),
        Candidate("chunked", gdn_chunked.check, gdn_chunked.emit),
        Candidate("matmul", gdn_matmul.check, gdn_matmul.emit),
        Candidate("native", gdn_native.check, gdn_native.emit),
        Candidate("scan", gdn_scan.check, gdn_scan.emit),
    ),
    "causal_conv1d_update": (  # order measured with bench/bench_conv.py (see above)
        Candidate("depthwise", conv_portable.check, conv_portable.emit_depthwise,
                  suits=conv_portable.suits_depthwise),
        Candidate("portable", conv_portable.check, conv_portable.emit),
        Candidate("native", conv_native.check, conv_native.emit),
    ),
}


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

    def __str__(self) -> str:
        why = "; ".join(f"{name}: {reason}" for name, reason in self.rejected)
        if not why:
            why = "forced by choose" if self.forced else "first in the table, accepted"
        return f"{self.node} [{self.op}] -> {self.candidate}  ({why})"


def _reject(facts: Facts, name: str, reason: str) -> tuple[str, str]:
    LOGGER.info("%s [%s]: candidate %s rejected: %s", facts.node, facts.op, name, reason)
    return name, reason


def decide(facts: Facts, target: Target, choice: Optional[Choice] = None) -> Decision:
    """The first acceptable candidate for one node; LoweringUnsupported when none is."""
    choice = choice or Choice()
    forced = choice.forced(facts.node, facts.op)
    if forced not in candidate_names()[facts.op]:
        forced = None  # a "*" value naming another op's candidate
    forbidden = choice.forbidden(facts.node, facts.op)
    rejected = []
    for entry in TABLE[facts.op]:
        if entry.name in forbidden or (forced is not None and entry.name != forced):
            why = "forbidden by choose" if entry.name in forbidden else f"choose forces {forced}"
            rejected.append(_reject(facts, entry.name, why))
            continue
        reason = entry.check(facts, target)
        if reason is None and forced is None and entry.suits is not None:
            reason = entry.suits(facts, target)
        if reason is None:
            decision = Decision(facts.node, facts.op, entry.name, tuple(rejected),
                                forced is not None)
            LOGGER.info("lowering %s", decision)
            return decision
        rejected.append(_reject(facts, entry.name, reason))
    reasons = "; ".join(f"{name}: {why}" for name, why in rejected)
    raise LoweringUnsupported(f"node '{facts.node}' ({facts.op}, {describe(facts)}) on tract "
                              f"{target.version_text}: no candidate accepts it ({reasons})")
