"""Rule: transformers' chunked gated-delta rule (prefill) becomes one ``gated_delta_scan``.

Search pattern: the exporting branch of torch_chunk_gated_delta_rule (GDN) or
chunk_kimi_delta_attention (KDA) at the candidate's shapes, i.e.
    pad to a multiple of C; per chunk: cumulative decay G, A = strict_lower(beta k k^T e^(Gi-Gj)),
    forward substitution for (I + A)^-1; then a sequential scan over chunks; slice to T.
Anchor: a ``cumsum`` whose input is a padded gate; its shape gives B, H and C, the pad's input
gives T, the padded [B, H, T, D] tensors give the widths. The template (chunk_templates.py) is
traced at those shapes and must match node for node: targets, literals, no outside users and,
where the graph writes in place, the same order of operations.
"""

from __future__ import annotations

import torch
from torch import fx

from gdn_fx.passes.chunk_templates import PADS, ChunkShape, chunk_template, template_scale
from gdn_fx.passes.match import Match, match_at, op_name, order_problem, outside_users
from gdn_fx.passes.operands import scan_operands
from gdn_fx.passes.program import fake_mode_of, mutates, shape
from gdn_fx.passes.rebuild import Fusion
from gdn_fx.passes.result import Miss, NoMatch
from gdn_fx.passes.rule_kinds import kind_of_chunked_gate
from gdn_fx.passes.scan_fusion import ScanRegion, check_dtypes, plan_scan

NAME = "gated_delta_scan"
ATEN = torch.ops.aten
FORMS = ("training", "functional", "core")
RESHAPES = (ATEN.reshape.default, ATEN.view.default, ATEN._unsafe_view.default)


def plan_chunk_templates(graph: fx.Graph) -> tuple[list[Fusion], list[Miss]]:
    """The rule: every chunked gated-delta computation shaped as transformers writes it; a
    fusion's key names the region's output node."""
    order = {node: i for i, node in enumerate(graph.nodes)}
    fusions, misses, mode = [], [], None
    for cumsum in [n for n in graph.nodes if n.target is ATEN.cumsum.default]:
        shapes = candidate_shapes(graph, cumsum)
        if not shapes:
            continue
        try:
            region, ops = _find(graph, shapes, order, cumsum)
            mode = mode or fake_mode_of(graph)
            fusions.append(plan_scan(region, ops, order, mode))
        except NoMatch as err:
            misses.append(Miss(NAME, f"chunked form: {err.reason}", node=err.node))
    return fusions, misses


def templated_forms(graph: fx.Graph) -> list[str]:
    """What the template rule would fuse, for ``find_unrolled``."""
    return [chunked_form(*found) for found in chunked_anchors(graph)]


def chunked_anchors(graph: fx.Graph) -> list[tuple[fx.Node, int]]:
    """(cumsum, traced length) of each chunked form shaped as transformers writes it."""
    return [(n, s[0].length) for n in graph.nodes if n.target is ATEN.cumsum.default
            for s in [candidate_shapes(graph, n)] if s]


def chunked_form(anchor: fx.Node, length: int) -> str:
    """How ``find_unrolled`` names a chunked form."""
    return f"chunked gated-delta form at node {anchor.name} (length {length})"


def candidate_shapes(graph: fx.Graph, cumsum: fx.Node) -> list[ChunkShape]:
    """Shapes to trace a template at, read around a cumsum of a padded, chunked gate."""
    dims = shape(cumsum)
    source = _padded_source(cumsum.args[0])
    if dims is None or source is None:
        return []
    kind = kind_of_chunked_gate(len(dims))
    if kind is None:
        return []
    b, h, _, chunk = dims[:4]
    length = shape(source)[2]
    widths = sorted(_padded_widths(graph, b, h, length))
    if kind.per_key_gate:  # the gate's last axis is Dk
        return [ChunkShape(kind.name, b, h, length, dims[4], dv, chunk) for dv in widths]
    return [ChunkShape(kind.name, b, h, length, dk, dv, chunk) for dk in widths
            for dv in widths]


def _padded_source(node: fx.Node):
    """x for reshape(pad(x, ..)) (the chunked gate), else None."""
    if getattr(node, "target", None) not in RESHAPES:
        return None
    pad = node.args[0]
    return pad.args[0] if getattr(pad, "target", None) in PADS else None


def _padded_widths(graph: fx.Graph, b: int, h: int, length: int) -> set:
    """Last dims of the [B, H, T, D] tensors that get padded (the prepared q, k, v)."""
    widths = set()
    for node in graph.nodes:
        if node.target in PADS:
            dims = shape(node.args[0])
            if dims is not None and len(dims) == 4 and tuple(dims[:3]) == (b, h, length):
                widths.add(dims[3])
    return widths


def _find(graph: fx.Graph, shapes: list[ChunkShape], order: dict, cumsum: fx.Node):
    """The region around ``cumsum`` for the first shape whose template matches there;
    NoMatch with the most advanced failure otherwise."""
    targets = {n.target for n in graph.nodes if n.op == "call_function"}
    best = None
    for chunk_shape in shapes:
        template = _template_for(chunk_shape, targets)
        for anchor in _anchors(graph, template, chunk_shape, cumsum):
            try:
                region, ops = _region(template, anchor, chunk_shape, order)
                if cumsum in region.nodes:  # another layer's region has the same shapes
                    return region, ops
            except NoMatch as err:
                progress = len(getattr(err, "partial", Match(template)).nodes)
                if best is None or progress > best[0]:
                    best = (progress, err)
    raise best[1] if best else NoMatch("no node has the shape of the chunked output")


def _template_for(chunk_shape: ChunkShape, targets: set):
    """The template traced like the graph: training IR unless the graph was decomposed."""
    for form in FORMS:
        template = chunk_template(chunk_shape, form)
        if template.targets() <= targets:
            return template
    return template


def _anchors(graph: fx.Graph, template, chunk_shape: ChunkShape, cumsum: fx.Node) -> list:
    """Nodes shaped like the template's output, the nearest after ``cumsum`` first."""
    target = template.outputs["out"].target
    want = (chunk_shape.batch, chunk_shape.heads, chunk_shape.length, chunk_shape.dv)
    order = {node: i for i, node in enumerate(graph.nodes)}
    found = [n for n in graph.nodes if n.target is target and shape(n) == want
             and order[n] > order[cumsum]]
    return sorted(found, key=order.__getitem__)


def _region(template, anchor: fx.Node, chunk_shape: ChunkShape, order: dict):
    match = match_at(template, anchor, complete=True)
    if match.defects:
        reason, node = match.defects[0]
        raise NoMatch(reason, node=node)
    final = _final_state(match)
    leaks = outside_users(match)
    if leaks:
        inner, user = leaks[0]
        raise NoMatch(f"{inner.name} is also read by {user.name} ({op_name(user.target)})",
                      node=inner)
    problem = order_problem(match, order)
    if problem:
        raise NoMatch(problem, node=anchor)
    sources = {name: match.bound(name) for name in ("q", "k", "v", "g", "beta")}
    inside = template_scale(chunk_shape)  # what the installed function does, measured
    scale = None if inside == 1.0 else inside
    ops = scan_operands(sources, match.bound("state"), head_major=True, scale=scale)
    region = ScanRegion(set(match.computed()), match.out("out"), 2, final, anchor)
    check_dtypes(region, ops)
    return region, ops


def _final_state(match: Match):
    """The final state's node, or None when the graph never computes it (output dropped)."""
    state = match.pattern.outputs["state"]
    if not match.missing:
        return match.nodes[state]
    needed_by_out = _ancestors(match.pattern.outputs["out"])
    required = [p for p in match.missing if p in needed_by_out or mutates(p)]
    if required or state not in match.missing:
        node = required[0] if required else match.missing[0]
        raise NoMatch(f"no node computes the template's {op_name(node.target)} ({node.name})")
    return None


def _ancestors(node: fx.Node) -> set:
    seen, todo = set(), [node]
    while todo:
        current = todo.pop()
        if current not in seen:
            seen.add(current)
            todo.extend(current.all_input_nodes)
    return seen
