"""Rule: an unrolled gated-delta recurrence becomes one ``gdn_fx::gated_delta_scan`` node.

Search pattern (T steps, chained along the state, reading the same q/k/v/g/beta):
    for t in 0..T-1:  S = S * decay(g_t);  S += k_t (outer) ((v_t - k_t^T S) * beta_t)
                      buf[.., t, ..] = q_t^T S
Rewrite:  out, S_T = gated_delta_scan(q, k, v, g, beta, S_0, scale, qk_l2norm)
          buf -> out (transposed back when the loop was head-major);  S_T's users -> S_T.
Guards (each failure is a near-miss, and the region stays as it was): every step matches the
pattern with the right literals and no outside users; the chain covers t = 0..T-1 in order; the
outputs are gathered by a recognized write (loop_outputs.py); dtypes agree with the op's.
"""

from __future__ import annotations

import copy
import operator

import torch
from torch import fx

from gdn_fx.passes.loop_outputs import Gathered, gather
from gdn_fx.passes.operands import Operands, scan_operands
from gdn_fx.passes.program import add_node, dtype, fake_mode_of, shape
from gdn_fx.passes.rebuild import Fusion, rebuild
from gdn_fx.passes.result import Miss, NoMatch
from gdn_fx.passes.steps import (Step, chains, check_chain, find_steps, step_nodes,
                                  time_length)

NAME = "gated_delta_scan"
SCAN = torch.ops.gdn_fx.gated_delta_scan.default
ATEN = torch.ops.aten


def collapse_recurrences(graph: fx.Graph) -> tuple[fx.Graph, int, list[Miss]]:
    """Fuse every whole unrolled loop; return (new graph, fusions, near-misses).

    ``graph`` is read, never modified: the result is rebuilt from the surviving nodes.
    """
    steps, failures = find_steps(graph)
    known = step_nodes(steps)
    misses = [_miss(f.error, f.partial.index) for f in failures
              if f.complete or f.touches(known)]
    fusions, order = [], _order(graph)
    mode = fake_mode_of(graph) if steps else None
    for chain in chains(steps):
        try:
            check_chain(chain)
            gathered = gather([s.out for s in chain], order)
            operands = scan_operands(chain[0])
            _check_dtypes(chain, gathered, operands)
        except NoMatch as err:
            misses.append(_miss(err, err.step, time_length(chain[0])))
            continue
        fusions.append(_plan(chain, gathered, operands, order, mode))
    new = rebuild(graph, fusions) if fusions else copy.deepcopy(graph)
    return new, len(fusions), misses


def find_unrolled(graph: fx.Graph) -> list[str]:
    """Descriptions of unrolled recurrence steps in the graph (complete or nearly so)."""
    steps, failures = find_steps(graph)
    found = [f"unrolled {s.kind} step at time index {s.index} (node {s.out.name})" for s in steps]
    return found + [f"unrolled step that did not check out at node {f.error.node}: "
                    f"{f.error.reason}" for f in failures if f.complete]


def _miss(err: NoMatch, step, of=None) -> Miss:
    return Miss(NAME, err.reason, node=err.node, step=step, of=of)


def _order(graph: fx.Graph) -> dict:
    return {node: i for i, node in enumerate(graph.nodes)}


def _check_dtypes(chain: list[Step], gathered: Gathered, ops: Operands) -> None:
    """The op's dtypes must be the loop's: out promoted from (q, state), state kept."""
    state_in, state_out = ops.nodes["state"], chain[-1].state_out
    if dtype(state_in) != dtype(state_out):
        raise NoMatch(f"the loop turns a {dtype(state_in)} state into {dtype(state_out)}",
                      node=state_out)
    out_dtype = torch.promote_types(dtype(ops.nodes["q"]), dtype(state_in))
    if out_dtype != dtype(gathered.value):
        raise NoMatch(f"the gathered output is {dtype(gathered.value)}, the op would give "
                      f"{out_dtype}", node=gathered.value)


def _plan(chain: list[Step], gathered: Gathered, ops: Operands, order: dict, mode) -> Fusion:
    """The fused node, emitted where the loop began, standing in for its output and state."""
    region = {n for s in chain for n in s.match.computed()}
    region |= set(gathered.erase)
    replace = {gathered.value: "value", chain[-1].state_out: "final"}
    if gathered.axis == 2:  # readers that transpose the head-major value back read `out`
        replace.update({u: "out" for u in gathered.value.users if _swaps_axes_1_2(u)})

    def emit(graph: fx.Graph, env) -> dict:
        args = [_time_major(graph, env(ops.nodes[name]), name in ops.to_time_major, mode)
                for name in ("q", "k", "v", "g", "beta")]
        fused = add_node(graph, SCAN, (*args, env(ops.nodes["state"])),
                         dict(scale=ops.scale, qk_l2norm=ops.qk_l2norm), mode)
        out = add_node(graph, operator.getitem, (fused, 0), mode=mode)
        final = add_node(graph, operator.getitem, (fused, 1), mode=mode)
        value = out if gathered.axis == 1 else _permute(graph, out, mode)
        _copy_meta(chain[0].out, (fused, out, final, value))
        return {"out": out, "final": final, "value": value}

    anchor = min(region, key=order.__getitem__)
    return Fusion(anchor, emit, set(ops.nodes.values()), replace, region)


def _swaps_axes_1_2(node: fx.Node) -> bool:
    if node.target is ATEN.transpose.int:
        return sorted(d % 4 for d in node.args[1:3]) == [1, 2]
    return node.target is ATEN.permute.default and [d % 4 for d in node.args[1]] == [0, 2, 1, 3]


def _time_major(graph: fx.Graph, node: fx.Node, needed: bool, mode) -> fx.Node:
    return _permute(graph, node, mode) if needed else node


def _permute(graph: fx.Graph, node: fx.Node, mode) -> fx.Node:
    """Swap axes 1 and 2 (head-major <-> time-major) with a core-aten permute."""
    rank = len(shape(node))
    return add_node(graph, ATEN.permute.default, (node, [0, 2, 1] + list(range(3, rank))),
                    mode=mode)


def _copy_meta(source: fx.Node, nodes) -> None:
    for node in nodes:
        for key in ("nn_module_stack", "stack_trace", "source_fn_stack"):
            if key in source.meta:
                node.meta[key] = source.meta[key]
