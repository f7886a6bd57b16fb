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

import operator

import torch
from torch import fx

from gdn_fx.passes.loop_outputs import Gathered, gather
from gdn_fx.passes.operands import Operands, scan_operands
from gdn_fx.passes.program import add_node, dtype, fake_mode_of, shape
from gdn_fx.passes.result import Miss, NoMatch
from gdn_fx.passes.steps import Step, chains, check_chain, find_steps, time_length

NAME = "gated_delta_scan"
SCAN = torch.ops.gdn_fx.gated_delta_scan.default
ATEN = torch.ops.aten


def collapse_recurrences(gm: fx.GraphModule) -> tuple[int, list[Miss]]:
    """Fuse every whole unrolled loop in ``gm``; return (fusions, near-misses)."""
    steps, failures = find_steps(gm.graph)
    misses = [_miss(f.error, f.partial.index) for f in failures
              if f.complete or f.touches(steps)]
    fused = 0
    mode = fake_mode_of(gm.graph) if steps else None
    for chain in chains(steps):
        try:
            check_chain(chain)
            gathered = gather([s.out for s in chain], _order(gm.graph))
            operands = scan_operands(chain[0])
            _check_dtypes(chain, gathered, operands)
        except NoMatch as err:
            misses.append(_miss(err, err.step, time_length(chain[0])))
            continue
        _rewrite(gm.graph, chain, gathered, operands, mode)
        fused += 1
    return fused, misses


def find_unrolled(gm: fx.GraphModule) -> list[str]:
    """Descriptions of unrolled recurrence steps still in the graph (fused or not)."""
    steps, failures = find_steps(gm.graph)
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


def _rewrite(graph: fx.Graph, chain: list[Step], gathered: Gathered, ops: Operands,
             mode) -> None:
    order = _order(graph)
    region = [n for s in chain for n in s.match.nodes.values() if n.op == "call_function"]
    first = min(region + gathered.erase, key=order.__getitem__)
    with graph.inserting_before(first):
        args = [_time_major(graph, ops, name, mode) for name in ("q", "k", "v", "g", "beta")]
        fused = add_node(graph, SCAN, (*args, ops.nodes["state"]),
                         dict(scale=ops.scale, qk_l2norm=ops.qk_l2norm), mode)
        out = add_node(graph, operator.getitem, (fused, 0), mode=mode)
        final = add_node(graph, operator.getitem, (fused, 1), mode=mode)
        value = out if gathered.axis == 1 else _permute(graph, out, mode)
    _copy_meta(chain[0].out, (fused, out, final, value))
    for node in gathered.erase:  # in-place writes first: they are the buffer's only writers
        graph.erase_node(node)
    gathered.value.replace_all_uses_with(value)
    chain[-1].state_out.replace_all_uses_with(final)
    if value is not out:
        _fold_transpose_back(value, out)


def _fold_transpose_back(value: fx.Node, out: fx.Node) -> None:
    """Readers that transpose the head-major value back to time-major read ``out`` itself."""
    for user in list(value.users):
        if _swaps_axes_1_2(user):
            user.replace_all_uses_with(out)


def _swaps_axes_1_2(node: fx.Node) -> bool:
    if node.target is ATEN.transpose.int:
        return sorted(d % 4 for d in node.args[1:3]) == [1, 2]
    return node.target is ATEN.permute.default and [d % 4 for d in node.args[1]] == [0, 2, 1, 3]


def _time_major(graph: fx.Graph, ops: Operands, name: str, mode) -> fx.Node:
    node = ops.nodes[name]
    return _permute(graph, node, mode) if name in ops.to_time_major else node


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
