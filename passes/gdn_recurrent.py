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
from typing import Optional

from torch import fx

from gdn_fx.passes.loop_outputs import gather
from gdn_fx.passes.operands import scan_operands
from gdn_fx.passes.patterns import TIME_AXIS
from gdn_fx.passes.program import fake_mode_of
from gdn_fx.passes.rebuild import rebuild
from gdn_fx.passes.result import Miss, NoMatch
from gdn_fx.passes.scan_fusion import ScanRegion, check_dtypes, plan_scan
from gdn_fx.passes.steps import (SOURCES, Step, chains, check_chain, find_steps, step_nodes,
                                  time_length)

NAME = "gated_delta_scan"


def collapse_recurrences(graph: fx.Graph, only: Optional[set] = None
                         ) -> tuple[fx.Graph, list[str], list[Miss]]:
    """Fuse every whole unrolled loop (those keyed in ``only``, when given); return (new graph,
    keys of the fusions made, near-misses). A key names the region's first step output.

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
            region = _region(chain, order)
            head = chain[0]
            operands = scan_operands({n: head.source(n) for n in SOURCES}, head.state_in,
                                     head_major=TIME_AXIS[head.kind] == 2)
            check_dtypes(region, operands)
            if only is None or region.meta_source.name in only:
                fusions.append(plan_scan(region, operands, order, mode))
        except NoMatch as err:
            misses.append(_miss(err, err.step, time_length(chain[0])))
    new = rebuild(graph, fusions) if fusions else copy.deepcopy(graph)
    return new, [f.key for f in fusions], misses


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


def _region(chain: list[Step], order: dict) -> ScanRegion:
    """The loop's nodes, its gathered output and final state."""
    gathered = gather([s.out for s in chain], order)
    nodes = {n for s in chain for n in s.match.computed()}
    return ScanRegion(nodes, gathered.value, gathered.axis, chain[-1].state_out, chain[0].out,
                      gathered.erase)
