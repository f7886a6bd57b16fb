"""Decide what one step of a found loop computes, by running it in float64.

A step's body (loops.py) is cut out as a small graph and run at random points, in float64
whatever dtypes it was traced in, next to the gated delta rule

    S' = S * decay;  S' += k (outer) ((v - k^T S') * beta);  o = c * q^T S'

under every layout its shapes allow (layouts.py: which tensor is q, k, v, the gate and beta;
key-first or value-first state; log gate or decay). The step is the delta rule when, for one
layout, S' and o agree to 1e-9 relative at two random points with the same c: the body is then
the rule up to rounding, whatever ops it used (einsum, bmm, in-place updates, views). Where no
layout fits, the nearest one says how far off the body is, and common slips are named.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Optional

import torch
from torch import fx

from gdn_fx.passes.evaluator import (POINTS, TOLERANCE, Sampler, Verdict, copy_constant,
                                     evaluable, exact_scale, fitted_scale, nearest, one_scale,
                                     rel, wide_problem)
from gdn_fx.passes.layouts import Layout, input_kind, layouts_for, read_shape, reference_step
from gdn_fx.passes.loops import time_read
from gdn_fx.passes.program import shape
from gdn_fx.passes.result import NoMatch

# The screen of a layout search (a subset of the heads) passes what is within this of the
# rule; relative to the subset's own largest value, which may be smaller than the whole
# tensor's, so looser than TOLERANCE: the screen must not drop a layout that fits.
SCREEN = 1e-6


def body_graph(step, final: Optional[fx.Node], groups: list) -> fx.Graph:
    """The step as a graph: (state, one value per group in ``groups``) -> (S', o)."""
    graph = fx.Graph()
    env = {step.state_in: graph.placeholder("state")}
    group_inputs = {g: graph.placeholder(f"read_{i}") for i, g in enumerate(groups)}
    for g, nodes in step.reads.items():
        if g not in group_inputs:
            raise NoMatch(f"step {step.t} reads {g[0].name}, which the other steps do not",
                          node=nodes[0], step=step.t)
        for node in nodes:
            read_value = group_inputs[g]
            read = time_read(node)  # (None: a value read whole at every position)
            env[node] = graph.call_function(torch.unsqueeze, (read_value, g[1])) \
                if read is not None and read.keepdim else read_value
    for node in step.consts:
        if not evaluable(node):
            raise NoMatch(f"step {step.t} reads {node.name}, a tensor from outside the loop "
                          "that is neither the state nor read position by position",
                          node=node, step=step.t)
        copy_constant(graph, node, env)
    for node in step.body:
        env[node] = graph.node_copy(node, lambda n: env[n])
    results = (env[final] if final is not None else None, env[step.out])
    graph.output(results)
    return graph


def decide(step, final: Optional[fx.Node], groups: list,
           expect: Optional[Layout] = None, search: bool = True) -> Verdict:
    """The layout under which ``step`` (with ``final`` as its new state) is the delta rule.

    ``expect`` (the layout of the steps around it) is tried first; the others only when it
    does not fit and ``search`` (to find the nearest, for the near-miss)."""
    graph = body_graph(step, final, groups)  # run as it is: a GraphModule would compile it
    owner = step.state_in.graph.owning_module or torch.nn.Module()
    shapes = [list(shape(step.state_in))] + [read_shape(g) for g in groups]
    candidates = list(layouts_for(shape(step.state_in), groups, shape(step.out)))
    if not candidates:
        raise NoMatch(f"step {step.t} reads {len(groups)} tensors position by position ("
                      f"{_describe(groups)}) beside a state {shapes[0]}; no layout of "
                      "q, k, v, gate, beta fits those shapes", node=step.out, step=step.t)
    # uniform in [-1, 1]: both signs, so a clamp, an abs or a missing exp shows (drawn in
    # float32, half the generator's work, exact in float64)
    sampler = Sampler(owner, graph, lambda gen: [
        (torch.rand(dims, generator=gen) * 2 - 1).double() for dims in shapes], "step")
    points = sampler.points(1)
    verdict = _decide_at(points, sampler, candidates, final is not None, expect, search)
    if verdict.layout is not None:
        verdict.layout = verdict.layout.with_scale(exact_scale(verdict.layout.scale, step.body))
        problem = _wide(sampler, verdict.layout, final is not None)
        if problem:
            return Verdict(None, verdict.out_error, max(verdict.state_error, TOLERANCE * 2),
                           nearest=verdict.layout, reason=problem, node=step.out.name)
    else:
        verdict.reason = sampler.named(verdict.reason or "under no layout its shapes allow: "
                                       f"{verdict.off_by()}")
    return verdict


def _wide(sampler: Sampler, layout: Layout, with_state: bool) -> str:
    """Why the step, which is the delta rule under ``layout`` at the ordinary points, is not
    it over the wide domain or breaks its linearity in (v, state) (evaluator.py); ''."""
    kinds = ["linear"] + [None] * (len(sampler.shapes()) - 1)
    for role, index in layout.roles.items():
        kinds[1 + index] = input_kind(role, layout)

    def error(points) -> float:
        verdict = _score(layout, points, with_state, scale=layout.scale)
        if verdict.layout is None:  # a state far off stops the scoring before the output
            return verdict.state_error if verdict.state_error > 1e-3 else verdict.error
        return 0.0

    return wide_problem(sampler, kinds, error, [0, 1 + layout.roles[layout.value_role]],
                        [0, 1])


def _decide_at(points: list, sampler: Sampler, candidates: list, with_state: bool, expect,
               search) -> Verdict:
    """``decide`` once the first points are drawn (``sampler`` draws more)."""
    if expect is not None:  # one point: the scale must come out as the expected one
        verdict = _score(replace(expect, scale=1.0), points, with_state)
        fits = verdict.layout is not None and \
            abs(verdict.layout.scale - expect.scale) <= TOLERANCE * abs(expect.scale)
        if fits or not search:
            return verdict if fits else Verdict(None, max(verdict.out_error, TOLERANCE * 2),
                                                verdict.state_error, nearest=expect)
    points += [sampler.point() for _ in range(POINTS - 1)]
    # q and k normalized inside the step (the op's own qk_l2norm), tried when nothing else fits
    normed = [replace(lay, qk_l2norm=True) for lay in candidates if "kb" not in lay.roles
              and lay.delta]  # (gated_linear_scan normalizes nothing)
    verdicts = []
    for pool in (candidates, normed):
        found = _screened_search(pool, points, with_state)
        if found is not None:
            return found
        for layout in pool:
            verdicts.append(_score(layout, points, with_state))
            if verdicts[-1].layout is not None:
                return verdicts[-1]
    best = nearest(verdicts)
    best.reason = _hint([v.nearest for v in verdicts if with_state and
                         v.state_error <= TOLERANCE], points)
    return best


def _screened_search(candidates: list, points, with_state: bool) -> Optional[Verdict]:
    """The first candidate that fits, found by screening every candidate on the first and
    last entry of each batch axis (heads included: a Qwen3.5-sized step has 16, and the
    search scores ~25 layouts) and proving the ones that pass on the whole tensors, as the
    full search does. The screen only decides the order of the work: a layout is accepted
    by the same whole-tensor score at the same tolerance. None when no candidate passes
    both (the full search then runs and finds the nearest, for the near-miss)."""
    batch = points[0][0][0].shape[:-2]
    if math.prod(batch) <= 2:  # nothing to save
        return None
    screen = [_entries(point, batch) for point in points]
    for layout in candidates:
        if _score(layout, screen, with_state, SCREEN).layout is None:
            continue
        verdict = _score(layout, points, with_state)
        if verdict.layout is not None:
            return verdict
    return None


def _entries(point, batch):
    """A point ([s0, *reads], (S', o)) at the first and last entry of each batch axis. A
    read and S' lead with the state's batch axes; o is laid out as [*batch, Dv] (``_score``
    reshapes it so). q and k on fewer heads (GQA) are taken at their own first and last
    head: value heads 0 and H - 1 read those, grouped or tiled."""
    inputs, (s_got, o_got) = point

    def some(x):
        for axis in range(len(batch)):
            x = x.index_select(axis, torch.tensor(sorted({0, x.shape[axis] - 1})))
        return x

    o_flat = o_got.reshape(*batch, -1) if o_got.numel() % math.prod(batch) == 0 else None
    return ([some(x) for x in inputs], (some(s_got) if s_got is not None else None,
             some(o_flat) if o_flat is not None else o_got))


def _describe(groups) -> str:
    return ", ".join(f"{s.name} {list(shape(s))} along {a}" for s, a in groups[:6])


def _score(layout: Layout, points, with_state: bool, tolerance: float = TOLERANCE,
           scale: Optional[float] = None) -> Verdict:
    """How far the points are from the rule under ``layout``: the output scale fitted at
    each point and required to be one constant, or ``scale`` when given (a point whose
    output is all zeros fits no scale)."""
    worst_s, worst_o, scales = 0.0, 0.0, []
    for (s0, *ins), (s_got, o_got) in points:
        s_ref, o_ref, _, _ = reference_step(layout, s0, ins)
        if with_state:
            worst_s = max(worst_s, rel(s_got, s_ref))
            if worst_s > 1e-3:  # far off: the output would not make it fit
                return Verdict(None, float("inf"), worst_s, nearest=layout)
        if o_got.numel() != o_ref.numel():
            return Verdict(None, float("inf"), worst_s, nearest=layout)
        o_got = o_got.reshape(o_ref.shape)
        scales.append(fitted_scale(o_got, o_ref) if scale is None else scale)
        worst_o = max(worst_o, rel(o_got, scales[-1] * o_ref))
    if scale is None and not one_scale(scales, tolerance):
        worst_o = max(worst_o, 1.0)
    if worst_s <= tolerance and worst_o <= tolerance:
        return Verdict(layout.with_scale(scales[0]), worst_o, worst_s)
    return Verdict(None, worst_o, worst_s, nearest=layout)


def _hint(state_fits: list, points) -> str:
    """Name the slip when, under a layout whose new state is right, the output is the readout
    of the state before the update (as received, or decayed)."""
    (s0, *ins), (_, o_got) = points[0]
    for layout in state_fits:
        _, _, s_in, x = reference_step(layout, s0, ins)
        for before in (s_in[..., None] if layout.unit_value else s_in, x["decayed"]):
            readout = (before * x["q"][..., :, None]).sum(-2)
            if o_got.numel() != readout.numel():
                continue
            got = o_got.reshape(readout.shape)
            if rel(got, fitted_scale(got, readout) * readout) <= 1e-6:
                return "the readout reads the state before the update, expected after"
    return ""
