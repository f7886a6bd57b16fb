"""Loops written with torch's higher-order operators (``scan``, ``while_loop``, ``map``).

torch.export keeps such a loop as ONE node (``torch.ops.higher_order.scan`` and kin) whose
body is a subgraph held as a module attribute: nothing is unrolled, so the loop rules, which
find loops as chains of steps, never see it, and torch-to-nnef cannot trace it.

``plan_scan_hops`` fuses a ``scan`` whose body is one delta-rule step (the body decided by
meaning, as one step of an unrolled loop is) and leaves a near-miss naming every other looping
node; ``find_unrolled`` reports what is left (``hop_unrolled``) and the lowering refuses it
in one line (``loop_hops``, ``describe``) instead of failing inside torch-to-nnef.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from gdn_fx.passes.layouts import plan_operands
from gdn_fx.passes.loops import Step
from gdn_fx.passes.program import ATEN, fake_mode_of, positions, shape, val
from gdn_fx.passes.result import Miss, NoMatch
from gdn_fx.passes.scan_fusion import NAME, ScanRegion, check_dtypes, plan_scan
from gdn_fx.passes.step_meaning import decide


# The higher-order operators that repeat a body (torch._higher_order_ops).
LOOPS = frozenset({"scan", "while_loop", "while_loop_stack_output", "map_impl",
                   "associative_scan"})


def loop_hops(graph: fx.Graph) -> list[fx.Node]:
    """The nodes of ``graph`` that call a looping higher-order operator, in graph order
    (found through the graph's own index by target: no walk over an unrolled graph)."""
    found = [n for name in sorted(LOOPS) if hasattr(torch.ops.higher_order, name)
             for n in graph.find_nodes(op="call_function",
                                       target=getattr(torch.ops.higher_order, name))]
    if len(found) < 2:
        return found
    order = positions(graph)
    return sorted(found, key=order.__getitem__)


def describe(node: fx.Node, *, at: bool = True) -> str:
    """``torch.ops.higher_order.scan at node scan (body scan_combine_graph_0)``; without
    ``at``, the node's name is left out."""
    bodies = [a.target for a in node.args if isinstance(a, fx.Node) and a.op == "get_attr"]
    body = f" (body {', '.join(bodies)})" if bodies else ""
    where = f" at node {node.name}" if at else ""
    return f"torch.ops.higher_order.{node.target.name()}{where}{body}"


def hop_unrolled(graph: fx.Graph) -> list[str]:
    """``find_unrolled``'s line for each looping higher-order node."""
    return [f"{describe(n)}: a loop kept as one higher-order node, which export_nnef cannot "
            "lower" for n in loop_hops(graph)]


# --- a scan whose body is one delta-rule step ------------------------------------------------

def plan_scan_hops(graph: fx.Graph) -> tuple[list, list[Miss]]:
    """The rule: ``torch.ops.higher_order.scan`` over (q, k, v, gate, beta) along axis 0,
    carrying one state, whose body IS one delta-rule step, decided by meaning
    (step_meaning.decide on the body, as for one step of an unrolled loop): fused into one
    ``gated_delta_scan``. Every other looping higher-order node (a while_loop, a scan of
    another body or signature) is left with a near-miss naming it.

    Search pattern::

        final, ys = scan(body, [state], [x0, x1, x2, x3, x4], ())
        # body(state, x0_t, .., x4_t) -> (state', o_t)
    """
    fusions, misses, order = [], [], None
    for node in loop_hops(graph):
        try:
            if node.target.name() != "scan":
                raise NoMatch("no rule reads inside its body", node=node)
            order = order or positions(graph)
            fusions.append(_scan_fusion(graph, node, order))
        except NoMatch as err:
            misses.append(_hop_miss(node, err.reason))
    return fusions, misses


def _hop_miss(node: fx.Node, reason: str) -> Miss:
    return Miss(NAME, f"a loop kept as one higher-order node, {describe(node, at=False)}: "
                      f"{reason}; it is left as it is and export_nnef refuses it",
                      node=node.name)


def _scan_parts(graph: fx.Graph, node: fx.Node):
    """(body module, state, xs, final getitem or None, ys getitem) of a scan node."""
    combine, init, xs, extra = (list(node.args) + [()])[:4]
    owner = graph.owning_module
    body = getattr(owner, combine.target, None) if combine.op == "get_attr" and owner else None
    if not isinstance(body, fx.GraphModule):
        raise NoMatch("its body is not a graph the pass can read", node=node)
    if len(init) != 1 or len(xs) != 5 or extra or node.kwargs:
        raise NoMatch(f"it carries {len(init)} values over {len(xs)} scanned inputs and "
                      f"{len(extra)} others; one step of the delta rule carries one state "
                      "over q, k, v, gate and beta", node=node)
    users = {u.args[1]: u for u in node.users
             if u.target is operator.getitem and isinstance(u.args[1], int)}
    if len(users) != len(node.users) or 1 not in users:
        raise NoMatch("its outputs are read other than as (final state, outputs)", node=node)
    return body, init[0], list(xs), users.get(0), users[1]


def _step_of(body: fx.GraphModule, state: fx.Node, xs: list):
    """The body as one loop step over a small graph of its own: a state placeholder and one
    position (``select(x, 0, 0)``) of each scanned input; (step, new state, groups)."""
    nodes = list(body.graph.nodes)
    places = [n for n in nodes if n.op == "placeholder"]
    result = next(n for n in nodes if n.op == "output").args[0]
    if any(n.op == "get_attr" for n in nodes) or len(places) != 6 or len(result) != 2:
        raise NoMatch("its body is not (state, 5 positions) -> (state, output)")
    graph = fx.Graph()
    state_in = graph.placeholder("state")
    state_in.meta["val"] = val(state)
    env, groups, reads = {places[0]: state_in}, [], {}
    for index, (place, x) in enumerate(zip(places[1:], xs)):
        source = graph.placeholder(f"scanned_{index}")
        source.meta["val"] = val(x)
        read = graph.call_function(ATEN.select.int, (source, 0, 0))
        read.meta["val"] = val(place)
        env[place], groups = read, groups + [(source, 0)]
        reads[(source, 0)] = [read]
    computed = [n for n in nodes if n.op == "call_function"]
    for n in computed:
        env[n] = graph.node_copy(n, env.__getitem__)
    new_state, out = (env[r] for r in result)
    step = Step(0, state_in, new_state, out, reads, [env[n] for n in computed])
    return step, new_state, groups


def _scan_fusion(graph: fx.Graph, node: fx.Node, order: dict):
    body, state, xs, final, ys = _scan_parts(graph, node)
    step, new_state, groups = _step_of(body, state, xs)
    verdict = decide(step, new_state, groups)
    if verdict.layout is None:
        raise NoMatch(f"its body is not one delta-rule step ({verdict.reason})", node=node)
    length = shape(ys)[0]
    plan = plan_operands(verdict.layout, [(x, 0) for x in xs], state, shape(ys), 0, length)
    region = ScanRegion({node} | set(node.users), ys, 0, final, node,
                        out_steps=plan.out_steps, final_steps=plan.final_steps)
    check_dtypes(region, plan.operands)
    mode = fake_mode_of(graph, plan.operands.nodes.values())
    return plan_scan(region, plan.operands, order, mode)
