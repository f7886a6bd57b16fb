"""Loops written with torch's higher-order operators (``scan``, ``while_loop``, ``map``).

torch.export keeps such a loop as ONE node (``torch.ops.higher_order.scan`` and kin) whose
body is a subgraph held as a module attribute: nothing is unrolled, so the loop rules, which
find loops as chains of steps, never see it, and torch-to-nnef cannot trace it.

``plan_scan_hops`` fuses a ``scan`` whose body is one delta-rule step (the body decided by
meaning, as one step of an unrolled loop is) and leaves a near-miss naming every other looping
node; ``find_unrolled`` reports what is left (``hop_unrolled``) and the lowering refuses it
in one line (``loop_hops``, ``describe``) instead of failing inside torch-to-nnef.

The training IR also keeps ``with torch.no_grad():`` or ``torch.autocast`` inside a forward as
one wrapper node around a body; ``inline_wrappers`` copies the bodies that compute the same
values outside it into the graph the rules plan on (passes/__init__._planned).
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from gdn_fx.passes.gdn_recurrent import decide_sized, symbolic_layout
from gdn_fx.passes.layouts import plan_operands
from gdn_fx.passes.loops import Step
from gdn_fx.passes.program import (ATEN, attribute, fake_mode_of, positions, shape, static_int,
                                   val)
from gdn_fx.passes.result import Miss, NoMatch
from gdn_fx.passes.scan_fusion import NAME, ScanRegion, check_dtypes, plan_scan


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
    verdict = decide_sized(step, new_state, groups)
    if verdict.layout is None:
        raise NoMatch(f"its body is not one delta-rule step ({verdict.reason})", node=node)
    length = static_int(shape(ys)[0])
    if length is None:
        raise NoMatch(f"it scans a symbolic length {shape(ys)[0]}", node=node)
    layout = symbolic_layout(verdict.layout, step.state_in, step.out, groups)
    plan = plan_operands(layout, [(x, 0) for x in xs], state, shape(ys), 0, length)
    region = ScanRegion({node} | set(node.users), ys, 0, final, node,
                        out_steps=plan.out_steps, final_steps=plan.final_steps)
    check_dtypes(region, plan.operands)
    mode = fake_mode_of(graph, plan.operands.nodes.values())
    return plan_scan(region, plan.operands, order, mode)


# --- wrappers that only set a mode around a body ---------------------------------------------

def _wrapper(name: str):
    return getattr(torch.ops.higher_order, name, None)


# target -> index of the body among its arguments (the operands follow it)
WRAPPERS = {op: index for op, index in ((_wrapper("wrap_with_set_grad_enabled"), 1),
                                        (_wrapper("wrap_with_autocast"), 4)) if op is not None}


def wrappers(graph: fx.Graph) -> list[fx.Node]:
    """The wrapper nodes of ``graph`` (``with torch.no_grad():`` or ``torch.autocast`` inside
    a module's forward, as the training IR keeps them), found by target."""
    return [n for op in WRAPPERS for n in graph.find_nodes(op="call_function", target=op)]


def inlinable(node: fx.Node) -> bool:
    """Whether the wrapper's body computes the same values outside it. Grad mode changes no
    value (only what autograd records, and the collapsed program is for inference). A
    disabled autocast region is inlined only where no enabled one is around it: the
    wrappers are inlined from the top, and an enabled one is kept whole with its body (its
    ops' dtypes are chosen when it runs), so a disabled one inlined is under no autocast
    (the program runs as traced, outside any autocast of its caller)."""
    if node.target is _wrapper("wrap_with_autocast"):
        return node.args[2] is False
    return node.target in WRAPPERS


def inline_wrappers(graph: fx.Graph) -> tuple[fx.Graph, list[fx.Node]]:
    """``graph`` with every inlinable wrapper replaced by its body's nodes (a new graph;
    ``graph`` itself when there is none), and the wrappers kept (in the new graph)."""
    found = wrappers(graph)
    if not any(inlinable(n) for n in found):
        return graph, found
    new = fx.Graph(owning_module=graph.owning_module)
    try:
        out = _copy_inlined(new, graph, {}, "")
    except NoMatch:  # a body held otherwise than as a graph: nothing is inlined
        return graph, found
    new.output(out).meta = dict(next(iter(graph.find_nodes(op="output"))).meta)
    for node in [n for n in new.nodes if n.op == "get_attr" and not n.users]:
        new.erase_node(node)  # the bodies inlined
    return new, wrappers(new)


def _copy_inlined(new: fx.Graph, graph: fx.Graph, env: dict, prefix: str):
    """Copy ``graph``'s nodes into ``new`` (``env``: its placeholders already mapped when it
    is a body), inlining wrappers; returns what its output node hands out."""
    for node in graph.nodes:
        if node in env:
            continue
        if node.op == "output":
            return fx.node.map_arg(node.args[0], env.__getitem__)
        if node.op == "call_function" and inlinable(node):
            env[node] = _inlined(new, node, env, prefix)
        elif node.target is operator.getitem and isinstance(env.get(node.args[0]), tuple):
            env[node] = env[node.args[0]][node.args[1]]  # an output of an inlined body
        else:
            env[node] = new.node_copy(node, env.__getitem__)
            if node.op == "get_attr":  # a body's attribute, seen from the root module
                env[node].target = prefix + node.target
    return None


def _inlined(new: fx.Graph, node: fx.Node, env: dict, prefix: str):
    """The nodes of ``node``'s body, copied into ``new`` reading the wrapper's operands;
    what the body hands out (a tuple of nodes, as the wrapper's getitems read it)."""
    at = WRAPPERS[node.target]
    body = wrapper_body(node)
    if body is None or node.kwargs:
        raise NoMatch(f"the body of {node.name} is not a graph the pass can read", node=node)
    places = [n for n in body.graph.nodes if n.op == "placeholder"]
    inner = {p: fx.node.map_arg(a, env.__getitem__) for p, a in zip(places, node.args[at + 1:])}
    out = _copy_inlined(new, body.graph, inner, f"{prefix}{node.args[at].target}.")
    return tuple(out) if isinstance(out, (list, tuple)) else out


def wrapper_body(node: fx.Node):
    """The body GraphModule of a wrapper node (also one inlined from another body, whose
    attribute is a dotted path), or None."""
    holder = node.args[WRAPPERS[node.target]]
    owner = node.graph.owning_module
    if owner is None or getattr(holder, "op", None) != "get_attr":
        return None
    body = attribute(owner, holder.target)
    return body if isinstance(body, fx.GraphModule) else None


def describe_wrapper(node: fx.Node) -> str:
    """``torch.autocast('cpu', torch.bfloat16) region (wrap_with_autocast at node w)``."""
    if node.target is _wrapper("wrap_with_autocast"):
        what = f"torch.autocast({node.args[0]!r}, {node.args[1]}) region"
    else:
        what = f"torch.set_grad_enabled({node.args[0]}) region"
    return f"a {what} ({node.target.name()} at node {node.name})"
