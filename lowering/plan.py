"""Decide the lowering of every fused node of a graph, before anything is traced."""

from __future__ import annotations

from typing import Mapping, Optional

import torch.fx as fx

from gdn_fx.lowering.choice import Choice, validate
from gdn_fx.lowering.fx_nodes import Program, fused_nodes, node_facts, source_module
from gdn_fx.lowering.options import ExportOptions
from gdn_fx.lowering.table import Decision, candidate, candidate_names, decide
from gdn_fx.lowering.target import Target


def plan(module: fx.GraphModule, target: Target,
         choose: Optional[Mapping] = None) -> list[Decision]:
    """One Decision per fused node of ``module``, in graph order (see ``choice`` for choose)."""
    facts = [node_facts(node) for node in fused_nodes(module.graph)]
    choice = Choice.parse(choose)
    validate(choice, {f.node: f.op for f in facts}, candidate_names())
    return [decide(f, target, choice) for f in facts]


def plan_lowering(program: Program, *, dynamic_axes: Optional[Mapping] = None,
                  options: Optional[ExportOptions] = None, **fields) -> list[Decision]:
    """What ``gdn_fx.export_nnef`` would emit for each fused node, without exporting.

    Same arguments as ``export_nnef``; returns the decisions (print them for a table).
    """
    options = ExportOptions.of(options, **fields)
    return plan(source_module(program), options.target(dynamic=bool(dynamic_axes)),
                options.choose)


def summary(decisions: list[Decision]) -> str:
    """``node=candidate;node=candidate`` (recorded in the exported NNEF's properties)."""
    return ";".join(f"{d.node}={d.candidate}" for d in decisions)


def fallbacks(decisions: list[Decision]) -> str:
    """``node;node``: the nodes whose candidate runs on the CPU under the target's runtime
    (recorded in the NNEF as "gdn_fx_cpu_fallback"; empty when every node stays)."""
    return ";".join(d.node for d in decisions if d.note)


def max_tokens(decisions: list[Decision]) -> str:
    """The most tokens one call of the graph may take, as its candidates are written (the
    smallest ``window`` among them; recorded in the NNEF as "gdn_fx_max_tokens"; empty when
    no candidate bounds it)."""
    windows = [candidate(d.op, d.candidate).window for d in decisions]
    return str(min(w for w in windows if w)) if any(windows) else ""
