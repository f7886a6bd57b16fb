"""FX passes: find unrolled GDN/KDA loops and conv updates, collapse each into one op.

``collapse(program)`` runs every rule over a copy of the program (or in place) and returns a
:class:`CollapseResult` with the rewritten program, fusion counts and near-misses.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import fx

from gdn_fx.passes.gdn_recurrent import collapse_recurrences, find_unrolled as _unrolled_steps
from gdn_fx.passes.program import finish, graph_module_of
from gdn_fx.passes.result import CollapseResult, Miss

# (count key, rule): each rule rewrites a GraphModule in place, returning (fusions, misses).
RULES = (
    ("gated_delta_scan", collapse_recurrences),
)


def collapse(program: Any, *, inplace: bool = False) -> CollapseResult:
    """Collapse every unrolled GDN/KDA recurrence and conv update in ``program``.

    ``program`` is a torch.export.ExportedProgram or a torch.fx.GraphModule (with meta['val']
    on its nodes, as torch.export and make_fx leave them). The result's ``program`` has the same
    kind; the input is left untouched unless ``inplace``.
    """
    program = program if inplace else copy_program(program)
    gm, ep = graph_module_of(program)
    counts, misses = {}, []
    for name, rule in RULES:
        counts[name], found = rule(gm)
        misses.extend(found)
    finish(gm, ep)
    return CollapseResult(program, counts, misses)


def find_unrolled(gm: fx.GraphModule) -> list[str]:
    """What in ``gm`` is still an unrolled, length-frozen loop (empty when nothing is)."""
    return _unrolled_steps(gm)


def copy_program(program: Any) -> Any:
    """A copy whose graph can be rewritten without touching the original."""
    gm, ep = graph_module_of(program)
    new_gm = fx.GraphModule(gm, copy.deepcopy(gm.graph))
    if ep is None:
        return new_gm
    return torch.export.ExportedProgram(
        root=new_gm, graph=new_gm.graph, graph_signature=copy.deepcopy(ep.graph_signature),
        state_dict=ep.state_dict, range_constraints=ep.range_constraints,
        module_call_graph=copy.deepcopy(ep.module_call_graph), example_inputs=ep.example_inputs,
        constants=ep.constants, verifiers=ep.verifiers)


__all__ = ["CollapseResult", "Miss", "collapse", "find_unrolled", "copy_program"]
