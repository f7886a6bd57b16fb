"""Loops written with torch's higher-order operators (``scan``, ``while_loop``, ``map``).

torch.export keeps such a loop as ONE node (``torch.ops.higher_order.scan`` and kin) whose
body is a subgraph held as a module attribute: nothing is unrolled, so the loop rules, which
find loops as chains of steps, never see it, and torch-to-nnef cannot trace it. This module
names those nodes, so that ``collapse`` leaves a near-miss, ``find_unrolled`` reports them and
the lowering refuses them in one line instead of failing inside torch-to-nnef.
"""

from __future__ import annotations

from torch import fx
from torch._ops import HigherOrderOperator

from gdn_fx.passes.result import Miss

# The higher-order operators that repeat a body (torch._higher_order_ops): what each is
# called in the messages.
LOOPS = {"scan": "scan", "while_loop": "while_loop", "while_loop_stack_output": "while_loop",
         "map_impl": "map", "associative_scan": "associative_scan"}
RULE = "gated_delta_scan"  # the op such a loop could be: the near-miss is that rule's


def loop_hops(graph: fx.Graph) -> list[fx.Node]:
    """The nodes of ``graph`` that call a looping higher-order operator, in graph order."""
    return [n for n in graph.nodes if n.op == "call_function"
            and isinstance(n.target, HigherOrderOperator) and n.target.name() in LOOPS]


def describe(node: fx.Node, *, at: bool = True) -> str:
    """``torch.ops.higher_order.scan at node scan (body scan_combine_graph_0)``; without
    ``at``, the node's name is left out."""
    bodies = [a.target for a in node.args if isinstance(a, fx.Node) and a.op == "get_attr"]
    body = f" (body {', '.join(bodies)})" if bodies else ""
    where = f" at node {node.name}" if at else ""
    return f"torch.ops.higher_order.{node.target.name()}{where}{body}"


def hop_misses(graph: fx.Graph) -> list[Miss]:
    """One near-miss per looping higher-order node: no rule reads inside its body."""
    return [Miss(RULE, f"a {LOOPS[n.target.name()]} loop kept as one higher-order node, "
                       f"{describe(n, at=False)}: no rule reads inside its body; it is left "
                       "as it is and export_nnef refuses it", node=n.name)
            for n in loop_hops(graph)]


def hop_unrolled(graph: fx.Graph) -> list[str]:
    """``find_unrolled``'s line for each looping higher-order node."""
    return [f"{describe(n)}: a {LOOPS[n.target.name()]} loop no rule fused "
            "(export_nnef cannot lower it)" for n in loop_hops(graph)]
