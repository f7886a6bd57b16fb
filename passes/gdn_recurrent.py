"""Rule: an unrolled gated-delta recurrence becomes one ``gdn_fx::gated_delta_scan`` node.

Found by structure, decided by meaning:
  1. loops.py finds loops over time (tensors read one position at a time, a carried state)
     and cuts them into steps, whatever ops the steps use;
  2. step_meaning.py runs step bodies in float64 and finds the layout (layouts.py) under which
     each is the gated delta rule; steps that are structurally the same as the step before
     (same ops, same literals, inputs in the same roles) share its verdict, the others are
     evaluated too;
  3. the region (every step, the gathered output, the final state) is replaced by the op,
     with permutes / reshapes outside it where the layout needs them.
Guards (each failure is a near-miss naming the step and node, and the loop stays as it was):
every step reads the same tensors at its own position and one state from the step before;
no intermediate value is read outside the loop; in-place writes touch only the loop's own
values; the outputs are gathered by a recognized write (loop_outputs.py); dtypes agree with
the op's. Translation validation (validate.py) then runs the whole program both ways.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch
from torch import fx

from gdn_fx.passes.layouts import Layout, Plan, layouts_for, plan_operands, read_shape
from gdn_fx.passes.loop_outputs import gather
from gdn_fx.passes.loops import (Cluster, Loop, Step, concrete_step, cut_steps, descendants_in,
                                 find_clusters, size_points, state_like, step_candidates,
                                 symbols, tag_window, take_decays, undecayed, walk_body)
from gdn_fx.passes.program import ASSERT_META, fake_mode_of, hint, is_pure, mutates, positions, shape
from gdn_fx.passes.rebuild import Fusion
from gdn_fx.passes.result import Miss, NoMatch
from gdn_fx.passes.scan_fusion import NAME, ScanRegion, check_dtypes, plan_scan
from gdn_fx.passes.evaluator import TOLERANCE, Verdict
from gdn_fx.passes.step_meaning import decide

LOOP_LIKE = 3  # a loop reading this many tensors position by position gets a near-miss


@dataclass
class Recurrence:
    """A proven loop: its region and the op's operands."""

    region: ScanRegion
    plan: Plan
    length: int


def plan_recurrences(graph: fx.Graph) -> tuple[list[Fusion], list[Miss]]:
    """The rule: every whole unrolled loop that is the delta rule; a fusion's key names the
    region's first step output."""
    order = positions(graph)
    found, misses = find_recurrences(graph, order)
    # the mode of the operands the fused nodes read (not a walk over the whole graph)
    operands = [n for rec in found for n in rec.plan.operands.nodes.values()]
    mode = fake_mode_of(graph, operands) if found else None
    fusions = []
    for rec in found:
        try:
            fusions.append(plan_scan(rec.region, rec.plan.operands, order, mode))
        except NoMatch as err:
            misses.append(Miss(NAME, err.reason, node=err.node, of=rec.length))
    return fusions, misses


def find_recurrences(graph: fx.Graph, order: dict) -> tuple[list[Recurrence], list[Miss]]:
    """Every loop that is the delta rule, and a near-miss for each loop-like one that is not.
    ``order``: node -> position in ``graph``."""
    found, misses, single = [], [], []
    for cluster, tags, candidates in _candidates(graph, order):
        if isinstance(candidates, NoMatch):
            if _loop_like(cluster):
                misses.append(_miss(candidates, cluster.length))
            continue
        here, failed = [], []
        for outs in candidates:
            try:
                here.append(_recurrence(cluster, tags, outs, order))
            except NoMatch as err:
                if _loop_like(cluster, outs, tags):
                    failed.append((outs[0], _miss(err, cluster.length)))
        fused = {n for rec in here for n in rec.region.nodes}
        found += here  # a single step's other candidates inside a proven step are not misses
        for out, miss in failed:
            if out in fused:
                continue
            if cluster.length == 1:
                single.append((cluster, miss))
            else:
                misses.append(miss)
    # a "single step" whose reads index values of a loop fused here (Mamba1's (S @ C)[:, :, 0]
    # in every step) is part of that loop, not a step of its own
    fused = {n for rec in found for n in rec.region.nodes}
    misses += [miss for cluster, miss in single
               if not any(read.source in fused for read in cluster.reads.values())]
    return found, misses


def find_unrolled(graph: fx.Graph) -> list[str]:
    """Descriptions of loops over time still unrolled in the graph (found by structure)."""
    order, found = positions(graph), []
    for cluster, tags, candidates in _candidates(graph, order):
        for outs in () if isinstance(candidates, NoMatch) else candidates:
            try:
                loop = cut_steps(cluster, tags, outs, order)
            except NoMatch:
                continue
            if len(loop.groups) >= LOOP_LIKE:
                found.append(f"unrolled {loop.length}-step loop over state "
                             f"{loop.steps[0].state_in.name} (node {outs[0].name})")
    return found


def _candidates(graph: fx.Graph, order: dict):
    """(cluster, its tags, its step candidates, or the NoMatch saying why it has none) for
    every cluster of time reads in the graph."""
    nodes = list(graph.nodes)
    for cluster in find_clusters(graph, order):
        tags = tag_window(nodes, cluster)
        if cluster.length == 1 and _drop_derived_reads(cluster, tags):
            tags = tag_window(nodes, cluster)
        try:
            candidates = step_candidates(cluster, tags, order)
        except NoMatch as err:
            candidates = err
        yield cluster, tags, candidates


def _drop_derived_reads(cluster: Cluster, tags: dict) -> bool:
    """In a single step, ``x[:, :, 0]`` of a value the step computes (its output's size-1
    axis, squeezed: Mamba1's ``(S @ C)[:, :, 0]`` at one token) reads no tensor position by
    position: it is part of the step. Whether any was dropped."""
    derived = [node for node, read in cluster.reads.items() if read.source in tags]
    for node in derived:
        del cluster.reads[node]
    return bool(derived)


def _loop_like(cluster: Cluster, outs=None, tags=None) -> bool:
    """Worth a near-miss: a loop reading >= 3 tensors (a single step only once its body is
    known to read them: size-1 reads are everywhere in a decode graph)."""
    groups = len({(r.source, r.axis) for r in cluster.reads.values()})
    if outs is None or cluster.length >= 2:
        return cluster.length >= 2 and groups >= LOOP_LIKE
    try:
        body = walk_body([outs[-1]], cluster.length - 1, tags, cluster)
    except NoMatch:
        return False
    return len(body[1]) >= LOOP_LIKE and any(state_like(c) for c in body[3])


def _miss(err: NoMatch, length: int) -> Miss:
    return Miss(NAME, err.reason, node=err.node, step=err.step, of=length)


def _recurrence(cluster: Cluster, tags: dict, outs: list, order: dict) -> Recurrence:
    loop = cut_steps(cluster, tags, outs, order)
    _check_reads(loop.steps[:-1])  # the last step's body is known once its new state is
    layout = _check_steps(loop)
    last, layout = _last_step(loop, cluster, tags, order, layout)
    _check_reads(loop.steps)
    gathered = gather(outs, order)
    region = ScanRegion({n for step in loop.steps for n in step.body}, gathered.value,
                        gathered.axis, last.state_out, outs[0], gathered.erase)
    _check_leaks(loop, region)
    first = loop.steps[0]
    plan = plan_operands(symbolic_layout(layout, first.state_in, first.out, loop.groups),
                         loop.groups, first.state_in, shape(gathered.value), gathered.axis,
                         loop.length)
    region.out_steps, region.final_steps = plan.out_steps, plan.final_steps
    check_dtypes(region, plan.operands)
    return Recurrence(region, plan, loop.length)


def symbolic_layout(layout: Layout, state: fx.Node, out: fx.Node, groups: list) -> Layout:
    """``layout``, decided at concrete sizes, with the loop's own sizes (symbolic where they
    are: the operands' permutes and reshapes then hold for every batch); as it is where
    every size is static. A size-1 axis is told by its traced size, as the layout was."""
    if not symbols([state, out] + [g[0] for g in groups]):
        return layout
    if layout.unit_value:  # its widths are static; the batch is read off the state
        return replace(layout, state_shape=tuple(shape(state)), out_shape=tuple(shape(out)))
    lead = len(shape(state)) - 2
    features = tuple([d for d in read_shape(g)[lead:] if hint(d) != 1] for g in groups)
    heads = layout.key_heads if layout.key_heads is None else \
        read_shape(groups[layout.roles["q"]])[lead - 1]
    return replace(layout, features=features, state_shape=tuple(shape(state)),
                   out_shape=tuple(shape(out)), key_heads=heads)


def _check_reads(steps: list) -> None:
    """Every step reads the same tensors (each at its own position: loops.walk_body)."""
    first = set(steps[0].reads) if steps else set()
    for step in steps[1:]:
        if set(step.reads) != first:
            extra, missing = set(step.reads) - first, first - set(step.reads)
            what = (f"reads {min(extra, key=_name)[0].name}, which step 0 does not" if extra
                    else f"does not read {min(missing, key=_name)[0].name}, which step 0 reads")
            raise NoMatch(f"step {step.t} {what}", node=step.out, step=step.t)


def _name(group) -> str:
    return group[0].name


def _last_step(loop: Loop, cluster: Cluster, tags: dict, order: dict, layout
               ) -> tuple[Step, object]:
    """The last step with its new state: the state-shaped value after the state that makes
    the step the delta rule (None when the loop's final state is not computed), in the
    layout of the steps before it (when there are any). Returns (step, layout)."""
    last = loop.steps[-1]
    t = loop.length - 1
    # The state read after the loop first (it usually is the new state), then graph order.
    # (from the state received, and from its product with a decay from outside the loop
    # that the step took: loops.take_decays)
    starts = [last.state_in] + [u for u in last.state_in.users
                                if u in last.body and tags.get(u) != t]
    reached = set().union(*(descendants_in(s, tags, t) for s in starts))
    candidates = sorted((c for c in reached if state_like(c, last.state_in)),
                        key=lambda c: (not any(_read_after(u, tags) for u in c.users), order[c]))
    passing, chosen = [], None
    for final in candidates + [None]:
        if final is None and passing:
            break
        step, verdict = _ending_with(last, final, loop, t, tags, cluster, order, layout)
        if isinstance(verdict, Verdict) and verdict.layout is not None:
            passing.append((step, verdict))
            if final is not None and any(u not in step.body and u.target is not ASSERT_META
                                         for u in final.users):
                chosen = passing[-1]  # the state the program reads after the loop
                break
    if not passing:
        raise _nearest_miss(last, candidates, loop, t, tags, cluster, order)
    step, verdict = chosen or passing[0]
    if layout is not None:
        _same_layout(step, verdict.layout, layout)
    loop.steps[-1] = step
    return step, verdict.layout


def _read_after(user: fx.Node, tags: dict) -> bool:
    """A read of the loop's result: the graph's output, a write, or past the loop's window
    (not a metadata assert: it checks whatever the step computes)."""
    if user.target is ASSERT_META:
        return False
    return user.op == "output" or user not in tags or not is_pure(user)


def _ending_with(last: Step, final, loop: Loop, t: int, tags: dict, cluster: Cluster,
                 order: dict, layout: Optional[Layout] = None) -> tuple:
    """(the last step with ``final`` as its new state, the verdict on it or the NoMatch
    that stopped it: e.g. a copy into the input state reads what the loop does not); (None,
    None) when the step would read from another step. ``layout``: the other steps'."""
    body, reads, earlier, consts = walk_body([last.out] + ([final] if final else []), t,
                                             tags, cluster)
    if len(earlier) > 1 or (t > 0 and not earlier):
        return None, None
    # the state received: from the step before, or (step 0) the initial state, maybe its
    # product with a decay from before the loop (loops.take_decays)
    received = earlier[0] if t > 0 else next(
        (c for c in consts if undecayed(c, 0, tags) == (last.state_in, c)), last.state_in)
    state_in, consts = take_decays(received, t, tags, body, reads, consts)
    if state_in is not last.state_in:
        return None, None
    step = Step(t, last.state_in, final, last.out, reads, sorted(body, key=order.__getitem__),
                consts)
    try:
        return step, decide_sized(step, final, loop.groups, layout, search=layout is None)
    except NoMatch as err:
        return step, err


def _nearest_miss(last: Step, candidates: list, loop: Loop, t, tags, cluster, order) -> NoMatch:
    """Why no candidate new state makes the last step the delta rule (the nearest layout)."""
    nearest, first_error = None, None
    for final in candidates + [None]:
        step, verdict = _ending_with(last, final, loop, t, tags, cluster, order)
        if not isinstance(verdict, Verdict):
            first_error = first_error or verdict
            continue
        if nearest is None or verdict.error < nearest[1].error:
            nearest = (step, verdict)
    if nearest is not None:
        return NoMatch(_not_delta(*nearest), node=last.out, step=t)
    return first_error or NoMatch(f"step {t} reads from other steps than the one before",
                                  node=last.out, step=t)


def decide_sized(step: Step, final: Optional[fx.Node], groups: list, expect=None,
                 search: bool = True) -> Verdict:
    """``step_meaning.decide``; where the loop's sizes are symbolic (a dynamic batch), at
    concrete sizes (loops.concrete_step): at the traced ones, then at others, where the
    step must be the delta rule in the same layout with the same scale (a region whose
    meaning changes with the batch, a reshape that only lines up at the traced size or an
    output divided by it, does not fuse). The verdict is the traced sizes' one."""
    points = size_points(step, groups)
    if not points:
        return decide(step, final, groups, expect, search)
    twin, twin_final, twin_groups = concrete_step(step, final, groups, points[0])
    verdict = decide(twin, twin_final, twin_groups, expect, search)
    if verdict.layout is None or len(points) < 2:
        return verdict
    twin, twin_final, twin_groups = concrete_step(step, final, groups, points[1])
    moved = _moved(verdict.layout, twin, twin_groups)
    other = decide(twin, twin_final, twin_groups, moved) if moved else None
    why = _differs(verdict.layout, moved, other)
    if why:
        sizes = ", ".join(f"{s} = {v}" for s, v in sorted(points[1].items(), key=str))
        traced = ", ".join(f"{s} = {v}" for s, v in sorted(points[0].items(), key=str))
        return Verdict(None, TWICE, TWICE, nearest=verdict.layout,
                       reason=f"it is the delta rule at the traced sizes ({traced}), not at "
                              f"{sizes}: {why}")
    return verdict


def _differs(layout: Layout, moved: Optional[Layout], other: Optional[Verdict]) -> str:
    """Why the verdict at other sizes is not ``layout``'s (``moved`` there), in words; ''."""
    if moved is None:
        return "its shapes there allow no such layout"
    if other.layout is None:
        return other.reason or other.off_by()
    if not other.layout.same_as(moved):
        return f"there it is the delta rule in another layout ({other.layout.describe()})"
    if abs(other.layout.scale - layout.scale) > TOLERANCE * abs(layout.scale):
        return f"its output scale there is {other.layout.scale:.6g}, not {layout.scale:.6g}"
    return ""


TWICE = 2e-9  # the error a verdict refused at other sizes reports (over the tolerance)


def _moved(layout: Layout, twin: Step, groups: list) -> Optional[Layout]:
    """``layout`` (made at other sizes) at the sizes of ``twin``: the same roles, state
    orientation, gate kind and head map, the same scale and norm."""
    for other in layouts_for(shape(twin.state_in), groups, shape(twin.out)):
        if (other.roles, other.key_first, other.log_gate, other.tiled) == \
                (layout.roles, layout.key_first, layout.log_gate, layout.tiled) and \
                (other.key_heads is None) == (layout.key_heads is None):
            return replace(other, scale=layout.scale, qk_l2norm=layout.qk_l2norm)
    return None


def _not_delta(step: Step, verdict: Verdict) -> str:
    linear = verdict.nearest is not None and not getattr(verdict.nearest, "delta", True)
    rule = "a gated linear recurrence (S * decay + k v^T)" if linear else "the delta rule"
    return f"step {step.t} is not {rule}: {verdict.reason}"


def _check_steps(loop: Loop):
    """The layout of steps 0..T-2 (None for a single step). Step T-2 is evaluated, and every
    step that is not node for node the same as the step after it; the others share the
    verdict of the step after them. Step 0's state comes from outside: it shares the verdict
    only when that state also has the shape and dtype of the state step 1 receives (the
    same ops on other metadata may compute something else)."""
    steps, layout = loop.steps, None
    for t in range(len(steps) - 2, -1, -1):
        step = steps[t]
        if t + 1 < len(steps) - 1 and (t > 0 or _same_meta(step.state_in, steps[1].state_in)) \
                and _same_step(step, steps[t + 1]):
            continue
        verdict = decide_sized(step, step.state_out, loop.groups, layout)
        if verdict.layout is None:
            raise NoMatch(_not_delta(step, verdict), node=step.out, step=t)
        if layout is None:
            layout = verdict.layout
        _same_layout(step, verdict.layout, layout)
    return layout


def _same_meta(a: fx.Node, b: fx.Node) -> bool:
    """Same shape, dtype and strides (what an op's result may depend on besides values)."""
    x, y = a.meta.get("val"), b.meta.get("val")
    if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor):
        return False
    dims = [*x.shape, *x.stride(), *y.shape, *y.stride()]
    if not all(type(d) is int for d in dims):  # symbolic: comparing would add guards
        return False
    return x.dtype == y.dtype and (x.shape, x.stride()) == (y.shape, y.stride())


def _same_layout(step: Step, got, want) -> None:
    if not got.same_as(want) or abs(got.scale - want.scale) > 1e-9 * abs(want.scale):
        raise NoMatch(f"step {step.t} is the delta rule in another layout ({got.describe()}) "
                      f"than the steps after it ({want.describe()})", node=step.out, step=step.t)


def _same_step(a: Step, b: Step) -> bool:
    """Whether ``b`` computes what ``a`` does, node for node, from the inputs in the same
    roles (its own state and reads) and the same invariants and literals."""
    if len(a.body) != len(b.body) or a.reads.keys() != b.reads.keys():
        return False
    m = {a.state_in: b.state_in}
    for group, nodes in a.reads.items():
        others = b.reads[group]
        if len(others) != len(nodes):
            return False
        m.update(zip(nodes, others))
    for x, y in zip(a.body, b.body):
        if x.target != y.target or not _same_args(x.args, y.args, m):
            return False
        if (x.kwargs or y.kwargs) and not _same_args(tuple(x.kwargs.items()),
                                                     tuple(y.kwargs.items()), m):
            return False
        m[x] = y
    return m.get(a.out) is b.out and (a.state_out is None or m.get(a.state_out) is b.state_out)


def _same_args(xs, ys, m: dict) -> bool:
    """Arguments equal once ``m`` maps the first step's nodes to the second's: nodes by
    identity (fx.Node has no __eq__), literals by value. (Run on every node of every step:
    the cheap cases go first.)"""
    if len(xs) != len(ys):
        return False
    for x, y in zip(xs, ys):
        if isinstance(x, fx.Node):
            if m.get(x, x) is not y:
                return False
        elif isinstance(y, fx.Node):
            return False
        elif isinstance(x, (list, tuple)):
            if not isinstance(y, (list, tuple)) or not _same_args(x, y, m):
                return False
        elif x is not y and not _same_literal(x, y):  # the same object: small ints, None
            return False
    return True


def _same_literal(x, y) -> bool:
    try:
        return bool(x == y)
    except Exception:  # noqa: BLE001 (a tensor literal: not comparable, so not the same)
        return False


def _check_leaks(loop: Loop, region: ScanRegion) -> None:
    """Only the gathered outputs and the final state leave the loop; in-place writes only
    touch the loop's own values."""
    inside = region.nodes
    allowed = {s.out for s in loop.steps} | {region.final}
    for step in loop.steps:
        for node in step.body:
            if node in allowed:
                continue
            if not inside.issuperset(node.users) and any(  # (the test per user, in C)
                    u not in inside and u.target is not ASSERT_META for u in node.users):
                # (a metadata assert on a value of the loop goes with it: rebuild.py)
                outside = next(u for u in node.users if u not in inside
                               and u.target is not ASSERT_META)
                raise NoMatch(f"intermediate value {node.name} of step {step.t} is also read "
                              f"by {outside.name} outside the loop", node=node, step=step.t)
            if not mutates(node):
                continue
            target = node.args[0] if node.args else None
            if isinstance(target, fx.Node) and target not in inside and \
                    any(u not in inside for u in target.users):
                raise NoMatch(f"{node.name} writes {target.name} in place, which is read "
                              "outside the loop", node=node, step=step.t)
