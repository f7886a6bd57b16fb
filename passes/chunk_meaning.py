"""The chunked form recognized by what it computes, whatever algebra spells it.

A chunked gated-delta computation (FLA's naive chunk references, transformers' chunk rules, a
per-chunk loop of bmm's) turns q, k, v, g, beta and an initial state into the output of every
position and the final state, by way of per-chunk cumulative decays, WY matrices and a state
carried from chunk to chunk. A chunked gated linear one (transformers' Mamba2 SSD, FLA's
naive chunk simple-GLA) does the same from q, k, v, g without beta or WY matrices, and is
decided by the same evaluation against the linear layouts (four inputs). How it is spelled
varies; what it computes does not. A region that pads its inputs to whole chunks and hands
out the padded output (transformers' SSD) is read at the inputs' length T: the positions past
T must be zeros, and the fusion pads the op's output with them.

Found by structure (cheaply), around each floating ``cumsum`` (the within-chunk cumulative
decay that every chunked algebra takes; the anchor):

- the region's END: a graph position after the anchor where at most two values computed since
  the anchor are still read later (the output and the final state: everything the chunk loop
  carried is spent there). Ends come in runs (the chunk buffer, its unpad view, slice and
  transpose); the last of a run whose region agrees is taken, never a copy or cast (that is
  the reader's), and a later run that agrees too extends the region (a per-chunk loop);
- the region's INPUTS: walking back from the anchor, the latest value the region reads is
  taken into it, one at a time (pads, casts, transposes, q's scale, beta folded into k and v,
  the chunk reshapes...), and every set of inputs on the way that is five sequence tensors
  of one length T (four for the gated linear recurrence), maybe with a state, is a cut.

Decided by meaning: the region between a cut and the outputs is run in float64 at random
inputs (step_meaning's interpreter) next to the delta rule run along all T positions under
every layout the shapes allow (layouts.py's records and its ``reference_step``). The
widest cut whose region agrees to 1e-9 relative at two points, output and final state, is
fused (when the widest does not agree, the last that does is found by bisection), through
plan_operands and plan_scan as for a recurrent loop; translation validation then
runs the whole program both ways. A region that does not agree is left with a near-miss that
says how far off it is and where its output first goes wrong (which chunk, which offset).
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass, field, replace
from typing import Optional

import torch
from torch import fx

from gdn_fx.passes.layouts import (Layout, batch_heads, group_features, input_kind,
                                   layouts_for, plan_operands, reference_step)
from gdn_fx.passes.program import (ASSERT_META, ATEN, base_of, dtype, fake_mode_of, is_mutation,
                                   is_pure, is_zeros, shape, static_int, view_writes)
from gdn_fx.passes.rebuild import Fusion
from gdn_fx.passes.result import Miss, NoMatch
from gdn_fx.passes.scan_fusion import NAME, ScanRegion, check_dtypes, plan_scan, time_order
from gdn_fx.passes.evaluator import (TOLERANCE, Float64, Sampler, Verdict, copy_constant,
                                     evaluable, exact_scale, fitted_scale, one_scale, rel,
                                     wide_problem)

PREFIX = 3  # positions on which every layout is tried before the whole sequence
END_SCAN = 20000  # nodes after the anchor searched for the region's end
END_TRIES = 4  # evaluated ends per anchor before giving up (until one agrees)
END_CANDIDATES = 24  # output readings walked back from per anchor
ABSORB = 300  # nodes taken in past the last candidate cut before the walk back stops
WIDE_INPUTS = 12  # more inputs than this: the walk back has left the region
LOW_FLOATS = (torch.float16, torch.bfloat16)
# Ops that only view, slice, move or cast: from the chunk buffer to the whole-sequence output.
SHAPE_OPS = {ATEN.view.default, ATEN.reshape.default, ATEN._unsafe_view.default,
             ATEN.slice.Tensor, ATEN.transpose.int, ATEN.permute.default, ATEN.clone.default,
             ATEN.contiguous.default, ATEN.alias.default, ATEN.squeeze.dim, ATEN.squeeze.dims,
             ATEN.unsqueeze.default, ATEN._to_copy.default, ATEN.to.dtype}

PADS = {ATEN.constant_pad_nd.default, ATEN.pad.default}
COPIES = {ATEN.clone.default, ATEN.contiguous.default, ATEN.alias.default,
          ATEN._to_copy.default, ATEN.to.dtype}


@dataclass
class Facts:
    """What every search reads about the graph, computed once."""

    nodes: list
    order: dict
    dead: set  # pure values nothing live reads
    last_use: dict  # node -> position of its last live reader (the output: after all)
    constants: dict = field(default_factory=dict)

    @staticmethod
    def of(graph: fx.Graph) -> "Facts":
        nodes = list(graph.nodes)
        order = {node: i for i, node in enumerate(nodes)}
        dead = set()
        for node in reversed(nodes):
            if is_pure(node) and all(u in dead for u in node.users):
                dead.add(node)
        last_use = {}
        for node in nodes:
            readers = [u for u in node.users if u.target is not ASSERT_META and u not in dead]
            last_use[node] = max((len(nodes) if u.op == "output" else order[u]
                                  for u in readers), default=-1)
        return Facts(nodes, order, dead, last_use)

    def constant(self, node: fx.Node) -> bool:
        """evaluator.evaluable, remembered (the walk back asks again at every step)."""
        known = self.constants.get(node)
        if known is None:
            known = self.constants[node] = evaluable(node)
        return known

    def read_outside(self, node: fx.Node, inside: set) -> list:
        """Live readers of ``node`` that are not in ``inside``."""
        return [u for u in node.users if u not in inside and u.target is not ASSERT_META
                and u not in self.dead]


@dataclass
class Cut:
    """A candidate region: its nodes, what it reads, what it hands out."""

    nodes: set
    inputs: list  # non-constant values read from before the region, in graph order
    value: fx.Node  # all outputs, one axis of length T
    final: Optional[fx.Node]  # the final state, when the region hands one out


@dataclass
class Fit:
    """A cut's inputs read as the op's operands: which is the state, time axes, layouts."""

    state: Optional[fx.Node]  # None: the region starts from zeros it makes itself
    state_shape: tuple
    groups: list  # (input, time axis), the order layouts index
    value_axis: int
    length: int  # T, the inputs' length
    out_shape: list
    # the output's length on its time axis: T, or more where the region pads its inputs to
    # whole chunks and hands out the padded output (transformers' Mamba2 SSD): the positions
    # past T must then be zeros, and the fusion pads the op's output with zeros
    padded: int = 0

    @property
    def pad(self) -> int:
        return max(self.padded - self.length, 0)

    @functools.cached_property
    def layouts(self) -> list:
        """Made when first asked: most readings are dropped before (causality, bisection)."""
        return list(layouts_for(list(self.state_shape), self.groups, self.out_shape))


# --- the rule ------------------------------------------------------------------------------

def plan_chunks_by_meaning(graph: fx.Graph) -> tuple[list[Fusion], list[Miss]]:
    """The rule: every chunked gated-delta region found by meaning around the graph's
    cumsums; a fusion's key names the region's anchor."""
    anchors = _anchors(graph)
    if not anchors:  # the usual case once the other rules ran: no walk
        return [], []
    facts = Facts.of(graph)
    fusions, misses, taken, proven, mode = [], [], set(), [], None
    for anchor in anchors:
        if anchor in taken:
            continue
        try:
            verdict = _decide_anchor(anchor, facts, taken)
            if verdict is None:
                continue  # nothing around this cumsum is shaped like a chunked region
            if verdict.layout is None:
                raise NoMatch(_not_delta(verdict))
            problem = _wide(verdict, facts.order)
            if problem:
                raise NoMatch(f"the region from {', '.join(n.name for n in verdict.region[0].inputs)}"
                              f" is the delta rule at ordinary inputs only: {problem}")
            # an earlier region's output may be this one's operand; its other nodes are gone
            cuts = [v.region[0] for v in proven]
            claimed = taken - {c.value for c in cuts} - {c.final for c in cuts}
            taken = taken | verdict.region[0].nodes
            proven.append(verdict)
            mode = mode or fake_mode_of(graph)
            fusions.append(_plan(verdict, anchor, facts.order, mode, claimed))
        except NoMatch as err:
            misses.append(Miss(NAME, f"chunked form by meaning: {err.reason}",
                               node=err.node or anchor.name))
    return fusions, misses


def find_chunk_forms(graph: fx.Graph) -> list[str]:
    """The chunked regions the rule would decide, found by structure alone (no evaluation):
    a floating cumsum of static shape with a region around it whose inputs are four or five
    sequence tensors of one length (and maybe a state). Each is frozen at its traced length,
    whether it computes the delta rule or not."""
    anchors = [n for n in _anchors(graph) if all(isinstance(d, int) for d in shape(n))]
    if not anchors:
        return []
    facts, found = Facts.of(graph), []
    for anchor in anchors:
        length = _shaped_length(anchor, facts)
        if length is not None:
            found.append(f"chunked recurrence form at node {anchor.name} (length {length})")
    return found


def _anchors(graph: fx.Graph) -> list:
    return [n for n in graph.nodes if n.target is ATEN.cumsum.default
            and dtype(n) is not None and dtype(n).is_floating_point]


def _shaped_length(anchor: fx.Node, facts: Facts) -> Optional[int]:
    """The sequence length of the first region around ``anchor`` shaped like a chunked
    form (the ends and cuts ``_decide_anchor`` would evaluate), None when there is none."""
    for run in _runs(anchor, facts):
        for value, final, end in reversed(run):
            core = _closure([value] + ([final] if final is not None else []),
                            facts.order[anchor], end, facts)
            for _, fits in _cuts(core, value, final, end, facts, set()):
                return fits[0].length
    return None


def _plan(verdict: Verdict, anchor: fx.Node, order: dict, mode, taken: set):
    """The fusion of a proven region; ``taken``: the nodes earlier fusions drop."""
    (cut, fit), layout = verdict.region, verdict.layout
    region = ScanRegion(cut.nodes, cut.value, fit.value_axis, cut.final, anchor)
    state = fit.state if fit.state is not None else fit.groups[layout.roles["k"]][0]
    value_shape = list(shape(cut.value))
    value_shape[fit.value_axis] = fit.length
    plan = plan_operands(layout, fit.groups, state, value_shape, fit.value_axis, fit.length)
    if fit.pad:  # the region's output past T is zeros (_tail): the op's, padded so
        plan.out_steps = _to_axis(plan.out_steps, fit.value_axis) + [
            (ATEN.constant_pad_nd.default, ([0, 0] * (len(value_shape) - 1 - fit.value_axis)
                                            + [0, fit.pad], 0.0))]
    if fit.state is None:  # the op starts from zeros it is handed, made beside it
        ops = plan.operands
        ops.nodes["state"] = ops.nodes["k"]
        ops.adapters["state"] = ops.adapters.get("k", []) + [
            (ATEN.new_zeros.default, (_op_state_shape(fit, layout),))]
    region.out_steps, region.final_steps = plan.out_steps, plan.final_steps
    inside = [n for n in plan.operands.nodes.values() if n in taken]
    if inside:
        raise NoMatch(f"operand {inside[0].name} lies in another fused region", node=anchor)
    check_dtypes(region, plan.operands)
    return plan_scan(region, plan.operands, order, mode)


def _to_axis(out_steps: Optional[list], axis: int) -> list:
    """The steps from the op's [B, T, H, Dv] output to the region's layout, where
    plan_operands left them to one permute (None)."""
    if out_steps is not None:
        return list(out_steps)
    return [] if axis == 1 else [(ATEN.permute.default, (time_order(axis),))]


def _op_state_shape(fit: Fit, layout: Layout) -> list:
    """[B, H, Dk, Dv] of the op for a state of ``fit.state_shape``."""
    b, h = batch_heads(fit.state_shape)
    d1, d2 = fit.state_shape[-2:]
    return [b, h, d1, d2] if layout.key_first else [b, h, d2, d1]


# --- deciding one anchor ---------------------------------------------------------------------

def _decide_anchor(anchor: fx.Node, facts: Facts, taken: set) -> Optional[Verdict]:
    """The widest region around ``anchor`` that is the delta rule; else the nearest miss
    (None when nothing there is shaped like a chunked region). Ends come in runs (an output
    and the views and slices of it that follow); the last end of a run is tried first. Once
    a run agrees, later runs extend the region (a per-chunk loop agrees chunk by chunk)
    until one does not (or, where that one read a state as the output, until the reading the
    other way round does not either)."""
    best, nearest, tries, swap = None, None, 0, None
    for run in _runs(anchor, facts):
        if best is None and tries >= END_TRIES:
            break
        if swap is not None and not any((v, f) == swap for v, f, _ in run):
            return best
        verdict = None
        for value, final, end in reversed(run):
            if value.target in COPIES and len(run) > 1:
                continue  # a copy or cast of the output is its reader's (operand peeling
                # walks through it, and must find the fused value there)
            if best is not None and _swapped(value, final, best.region[0]):
                continue  # the agreeing region's output and state read the other way round
                # (a state [.., Dk, Dv] whose Dk is as long as a chunk): no wider region
            verdict = _decide_end(anchor, value, final, end, facts, taken,
                                  best.region[0] if best else None)
            if verdict is not None:
                tries += 1
                if verdict.layout is not None:
                    break
                if nearest is None or _closer(verdict, nearest):
                    nearest = verdict
        if verdict is not None and verdict.layout is not None:
            best, swap = verdict, None
        elif best is not None and verdict is not None:
            cut = verdict.region[0]
            if swap is not None or cut.final is None:
                return best
            swap = (cut.final, cut.value)  # the same two values, the other way round: next
    return best or nearest


def _runs(anchor: fx.Node, facts: Facts):
    """Lists of (value, final, end): the output readings of the end candidates, each grouped
    with the readings after it (same final state) whose value is a view, slice or cast of
    the one before."""
    open_runs, seen = {}, set()
    for end, live in _end_candidates(anchor, facts):
        if len(seen) > END_CANDIDATES:
            break
        for value, final in _outputs(live):
            if (value, final) in seen or not _may_be_output(value, final):
                continue
            seen.add((value, final))
            run = open_runs.get(final)
            if run and _viewed(value, run[-1][0]):
                run.append((value, final, end))
                continue
            if run:
                yield run
            open_runs[final] = [(value, final, end)]
    yield from open_runs.values()


def _swapped(value: fx.Node, final: Optional[fx.Node], cut: Cut) -> bool:
    """(value, final) is the cut's final state and output, read the other way round."""
    return value is cut.final and final is cut.value


def _may_be_output(value: fx.Node, final: Optional[fx.Node]) -> bool:
    """A floating value with an axis of length >= 2 whose positions hold one row per state
    (when the final state is known)."""
    dims = shape(value)
    if dims is None or len(dims) < 3 or not dtype(value).is_floating_point:
        return False
    if final is None:
        return True
    return any(d >= 2 and _value_fits(dims, i, shape(final)) for i, d in enumerate(dims))


def _viewed(node: fx.Node, source: fx.Node) -> bool:
    """``node`` is ``source`` through views, slices and casts only."""
    while node is not source:
        if node.target not in SHAPE_OPS or not node.args or not isinstance(node.args[0],
                                                                         fx.Node):
            return False
        node = node.args[0]
    return True


def _closer(a: Verdict, b: Verdict) -> bool:
    """Nearer: agrees on the first positions where ``b`` does not (else the first one tried,
    the widest, is the one a near-miss describes)."""
    return a.partial and not b.partial


def _end_candidates(anchor: fx.Node, facts: Facts):
    """(position, live values) after the anchor where at most two values computed since it
    are still read later, one of them a tensor of rank >= 3, and the anchor is spent (the
    cumulative decays are read up to the last chunk)."""
    nodes, last_use = facts.nodes, facts.last_use
    start = facts.order[anchor]
    live = set()
    expiring: dict = {}
    for pos in range(start, min(len(nodes), start + END_SCAN)):
        node = nodes[pos]
        if last_use[node] > pos and not _passes_through(node, start, facts.order):
            live.add(node)
            expiring.setdefault(last_use[node], []).append(node)
        for done in expiring.pop(pos, ()):
            live.discard(done)
        if 1 <= len(live) <= 2 and anchor not in live and node.op == "call_function" and any(
                len(shape(n) or ()) >= 3 for n in live):
            yield pos, sorted(live, key=facts.order.__getitem__)


def _passes_through(node: fx.Node, start: int, order: dict) -> bool:
    """A view or cast of a value from before the anchor (``initial_state.to(f32)`` that the
    program also hands out): no result of the region."""
    while node.target in SHAPE_OPS and node.args and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return order[node] < start


def _outputs(live: list):
    """(value, final) readings of the live values: a final state has rank >= 3 too."""
    if len(live) == 1:
        yield live[0], None
        return
    for value, final in (live, live[::-1]):
        dims = shape(final)
        if dims is not None and len(dims) >= 3 and dtype(final).is_floating_point:
            yield value, final


def _decide_end(anchor, value, final, end: int, facts: Facts, taken: set,
                extends: Optional[Cut] = None) -> Optional[Verdict]:
    """Cut the region ending at ``end`` back to its inputs and decide it; None when no cut
    has the shapes of the op's operands, or when it would not extend the agreeing region
    ``extends`` (a later chunk of a per-chunk loop computes from the earlier chunks' output:
    a region that does not is no wider one). The widest cut is tried first; when it does not
    agree (the walk went past the region's inputs into the caller's gate or norm), the
    narrowest, then the last agreeing cut is found by bisection (cuts agree up to the
    region's real inputs and not beyond)."""
    core = _closure([value] + ([final] if final is not None else []), facts.order[anchor],
                    end, facts)
    if core & taken or (extends is not None and extends.value not in core):
        return None  # another region's, or no extension of the one that agrees
    cuts = list(_cuts(core, value, final, end, facts, taken))
    if not cuts:
        return None
    widest = _decide_cut(*cuts[-1], facts)
    if widest.layout is not None or len(cuts) == 1:
        return widest
    good = _decide_cut(*cuts[0], facts)
    if good.layout is None:
        return widest if not _closer(good, widest) else good
    lo, hi = 0, len(cuts) - 1  # cuts[lo] agrees, cuts[hi] does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        verdict = _decide_cut(*cuts[mid], facts)
        if verdict.layout is not None:
            lo, good = mid, verdict
        else:
            hi = mid
    return good


def _decide_cut(cut: Cut, fits: list, facts: Facts) -> Verdict:
    """The first reading of the cut's inputs under which the region is the delta rule, else
    the nearest. The region is run once, at points drawn by its inputs' shapes: the readings
    only differ in how the reference reads those points."""
    problem = _leak(cut, facts) or _low_float(cut)
    if not problem:
        try:
            sampler, points = _sampler(cut, facts.order)
        except NoMatch as miss:
            problem = miss.reason
    if problem:
        return Verdict(reason=problem, region=(cut, fits[0]))
    nearest = None
    for fit in _causal(cut, fits, sampler, points[0]) or fits:
        verdict = _evaluate(cut, fit, sampler, points)
        if verdict.layout is not None:
            return verdict
        if nearest is None or _closer(verdict, nearest):
            nearest = verdict
    return nearest


def _wide(verdict: Verdict, order: dict) -> str:
    """Why the region, the delta rule under the verdict's layout at the ordinary points, is
    not it over the wide domain or breaks its linearity in (v, state) (evaluator.py); ''."""
    (cut, fit), layout = verdict.region, verdict.layout
    _check_static(cut)
    owner = cut.value.graph.owning_module or torch.nn.Module()
    sampler = Sampler(owner, cut_out(cut, order),
                      lambda gen: [_draw(shape(n), gen) for n in cut.inputs], "chunk")
    kinds = ["linear" if n is fit.state else None for n in cut.inputs]
    for role, index in layout.roles.items():
        kinds[cut.inputs.index(fit.groups[index][0])] = input_kind(role, layout)
    linear = [i for i, n in enumerate(cut.inputs)
              if n is fit.state or n is fit.groups[layout.roles[layout.value_role]][0]]

    def error(points) -> float:
        out, state = _score(layout, fit, cut, points, fit.length, explain=False,
                            scale=layout.scale, every=True)[:2]
        return out + state

    return wide_problem(sampler, kinds, error, linear, [0, 1])


def _leak(cut: Cut, facts: Facts) -> str:
    """Why the region cannot be replaced: a value of it read outside, a write into a value
    from before it; empty when it can."""
    for node in cut.nodes:
        if node is cut.value or node is cut.final:
            continue
        outside = facts.read_outside(node, cut.nodes)
        if outside:
            return f"its value {node.name} is also read by {outside[0].name} outside it"
        if is_mutation(node) and base_of(node.args[0]) not in cut.nodes:
            return f"{node.name} writes {base_of(node.args[0]).name} in place, which is " \
                   "not the region's own"
    return ""


def _closure(sinks: list, lo: int, hi: int, facts: Facts) -> set:
    """The nodes in positions [lo, hi] that the sinks are computed from, with every in-place
    write into them. A value the program also reads after ``hi`` is left out: it can only
    be an input of the region."""
    order, nodes, todo = facts.order, set(), list(sinks)
    while todo:
        node = todo.pop()
        if node in nodes or node.op != "call_function" or not lo <= order[node] <= hi:
            continue
        if node not in sinks and facts.last_use[node] > hi:
            continue
        nodes.add(node)
        todo.extend(node.all_input_nodes)
        todo.extend(view_writes(node, lambda user: order[user] <= hi))
    return nodes


# --- walking back to the inputs --------------------------------------------------------------

def _cuts(core: set, value: fx.Node, final, end: int, facts: Facts, taken: set):
    """(Cut, fits) for every set of inputs on the walk back that fits the op's operands,
    the narrowest first. The latest input is taken in at each step."""
    order, nodes = facts.order, set(core)
    frontier = {a for n in nodes for a in n.all_input_nodes if a not in nodes}
    blocked, since = set(), 0
    while since <= ABSORB:
        inputs = sorted((f for f in frontier if not facts.constant(f)), key=order.__getitem__)
        if len(inputs) > WIDE_INPUTS:
            return
        fits = _fits(inputs, value, final, nodes)
        if fits:
            since = 0
            yield Cut(set(nodes), inputs, value, final), fits
        movable = [f for f in inputs if f.op == "call_function" and f not in blocked
                   and f not in taken]
        if not movable:
            return
        latest = max(movable, key=order.__getitem__)
        if any(not is_mutation(u) for u in facts.read_outside(latest, nodes)):
            blocked.add(latest)  # also read outside: it stays an input
            continue
        absorbed = [latest] + [w for w in view_writes(latest, lambda user: order[user] <= end)
                               if w not in nodes]
        nodes |= set(absorbed)
        frontier -= set(absorbed)
        frontier |= {a for t in absorbed for a in t.all_input_nodes if a not in nodes}
        since += 1


def _fits(inputs: list, value: fx.Node, final: Optional[fx.Node], nodes: set) -> list:
    """The ways the inputs are sequence tensors of one length (and maybe the state): five
    for the delta rule (q, k, v, g, beta), four for the gated linear recurrence."""
    if len(inputs) not in (4, 5, 6) or shape(value) is None:
        return []
    fits, pads = [], _pads(nodes)
    for state in [None] + inputs:
        seqs = [n for n in inputs if n is not state]
        if len(seqs) not in (4, 5):
            continue
        state_shape = _state_shape(state, final, nodes)
        if state_shape is None or any(shape(n) is None for n in seqs):
            continue
        if final is not None and tuple(shape(final)) != tuple(state_shape):
            continue
        for v_axis, padded in enumerate(shape(value)):
            if padded < 2 or not _value_fits(shape(value), v_axis, state_shape):
                continue
            for length in [padded] + pads.get(padded, []):
                for axes in itertools.product(*[_axes_of(n, length, state_shape)
                                                for n in seqs]):
                    groups = list(zip(seqs, axes))
                    out_shape = [d for i, d in enumerate(shape(value)) if i != v_axis]
                    if next(layouts_for(list(state_shape), groups, out_shape), None):
                        fits.append(Fit(state, tuple(state_shape), groups, v_axis, length,
                                        out_shape, padded))
    return fits


def _pads(nodes: set) -> dict:
    """padded length -> the lengths (longest first) that a pad in the region makes that long
    on one axis (the inputs padded to whole chunks inside it)."""
    found: dict = {}
    for node in nodes:
        if node.target not in PADS or not isinstance(node.args[0], fx.Node):
            continue
        before, after = shape(node.args[0]), shape(node)
        if before is None or after is None or len(before) != len(after):
            continue
        changed = [(a, b) for a, b in zip(before, after) if a != b]
        if len(changed) == 1 and all(isinstance(d, int) for d in changed[0]) and \
                1 <= changed[0][0] < changed[0][1]:
            found.setdefault(changed[0][1], set()).add(changed[0][0])
    return {padded: sorted(lengths, reverse=True) for padded, lengths in found.items()}


def _axes_of(node: fx.Node, length: int, state_shape) -> list:
    """Axes of ``node`` of ``length`` that leave the state's batch axes in front."""
    dims = list(shape(node))
    return [i for i, d in enumerate(dims) if d == length and group_features(
        dims[:i] + dims[i + 1:], state_shape) is not None]


def _value_fits(dims, axis: int, state_shape) -> bool:
    """One position of the output holds one value row per state: batch times Dk or Dv."""
    rest = math.prod(d for i, d in enumerate(dims) if i != axis)
    batch = math.prod(state_shape[:-2])
    return rest in (batch * state_shape[-1], batch * state_shape[-2])


def _state_shape(state, final, nodes: set):
    """The state's shape: the input's, else the final state's, else that of the zeros the
    region starts from."""
    if state is not None:
        dims = shape(state)
        return dims if dims is not None and len(dims) >= 3 else None
    if final is not None:
        return shape(final)
    zeros = [n for n in nodes if is_zeros(n) and len(shape(n) or ()) in (3, 4)] or [
        n for n in nodes if is_zeros(n) and len(shape(n) or ()) == 5]  # (an output buffer
    # of chunks is rank 5 too: the state's zeros of rank <= 4 come first)
    return _unit_axes_off(shape(zeros[0])) if len(zeros) == 1 else None


def _unit_axes_off(dims) -> Optional[list]:
    """A state's shape without the size-1 axes after the first beyond rank 4 (the zeros of
    one chunk's states, [B, 1, H, Dv, Dk]: transformers' Mamba2 SSD); None when it stays
    longer."""
    dims = list(dims)
    while len(dims) > 4 and 1 in dims[1:]:
        del dims[dims.index(1, 1)]
    return dims if len(dims) <= 4 else None


# --- evaluation ----------------------------------------------------------------------------

def cut_out(cut: Cut, order: dict) -> fx.Graph:
    """(inputs...) -> (value, final), run on the program's own module (for get_attr)."""
    graph = fx.Graph()
    env = {n: graph.placeholder(f"in_{i}") for i, n in enumerate(cut.inputs)}
    for node in sorted(cut.nodes, key=order.__getitem__):
        for arg in node.all_input_nodes:
            if arg not in env and arg not in cut.nodes:
                copy_constant(graph, arg, env)
        env[node] = graph.node_copy(node, lambda n: env[n])
    graph.output((env[cut.value], env[cut.final] if cut.final is not None else None))
    return graph


def _draw(dims, gen: torch.Generator) -> torch.Tensor:
    """Uniform in [-1, 1] scaled by 1/sqrt of the last axis: small keys keep the chunked
    solve well conditioned (as an l2norm does), both signs show a missing exp or abs."""
    dims = list(dims)
    scale = 0.5 / max(dims[-1], 1) ** 0.5 if dims else 0.5
    # in place: a sequence input at a real width is ~10^7 numbers
    return torch.rand(dims, generator=gen, dtype=torch.float64).mul_(2 * scale).sub_(scale)


def _causal(cut: Cut, fits: list, sampler: Sampler, point) -> list:
    """The fits whose time axes the region is causal along: a change at an input's last
    position leaves the output's earlier positions as they were (a head axis as long as
    the sequence changes them all). Probed only for inputs with a choice of axes, one run
    each: the readings are many where T equals H, each scored under every layout."""
    choices = {}
    for fit in fits:
        for node, axis in fit.groups:
            choices.setdefault(node, set()).add(axis)
    runs, value = {}, point[1][0]

    def causal(node, axis, fit) -> bool:
        if (node, axis) not in runs:
            moved = [x.clone() for x in point[0]]
            moved[cut.inputs.index(node)].select(axis, -1).add_(1.0)
            try:
                runs[node, axis] = Float64(sampler.owner, graph=sampler.graph).run(*moved)[0]
            except Exception:  # noqa: BLE001 (no answer: the reading is kept, scored as any)
                runs[node, axis] = None
        if runs[node, axis] is None:
            return True
        earlier, v_axis = fit.length - 1, fit.value_axis
        return rel(runs[node, axis].narrow(v_axis, 0, earlier),
                   value.narrow(v_axis, 0, earlier)) <= TOLERANCE

    return [fit for fit in fits if all(causal(node, axis, fit)
                                       for node, axis in fit.groups if len(choices[node]) > 1)]


def _low_float(cut: Cut) -> str:
    """Why float64 cannot decide the region (it would not see a rounding to f16/bf16 inside
    it); empty when it can."""
    low = [n for n in cut.nodes if dtype(n) in LOW_FLOATS]
    if not low:
        return ""
    return f"the region computes {low[0].name} in {dtype(low[0])}; by meaning only in f32 or f64"


def _sampler(cut: Cut, order: dict) -> tuple[Sampler, list]:
    """The region cut out and its points (reaching both sides of each clamp, where...:
    evaluator.py); NoMatch when it cannot be run so."""
    _check_static(cut)
    owner = cut.value.graph.owning_module or torch.nn.Module()
    sampler = Sampler(owner, cut_out(cut, order),
                      lambda gen: [_draw(shape(n), gen) for n in cut.inputs], "chunk")
    try:
        return sampler, sampler.points()
    except NoMatch:
        raise
    except Exception as error:  # noqa: BLE001 (a region that does not run on its own)
        raise NoMatch(f"the region does not run on its own: {error}") from None


def _check_static(cut: Cut) -> None:
    """A region is run at the sizes it was traced at: one whose sizes are symbolic (a
    dynamic batch) is refused in words, before a draw fails on them."""
    for node in cut.inputs:
        dims = shape(node) or ()
        symbolic = [d for d in dims if not isinstance(d, int) and static_int(d) is None]
        if symbolic:
            raise NoMatch(f"its input {node.name} {list(dims)} has the symbolic size "
                          f"{symbolic[0]}: the rule runs a chunked region at static sizes "
                          "only (the recurrent form of the rule fuses with a symbolic batch)")


def _evaluate(cut: Cut, fit: Fit, sampler: Sampler, points: list) -> Verdict:
    """The first layout of ``fit`` under which the region is the delta rule; then the same
    with q and k L2-normalized inside the region (the op's qk_l2norm, as the step rule
    tries them); else the nearest of the first."""
    prepared, every = {}, bool(sampler.switches)  # points sliced by heads: every layout's
    first = _evaluate_pool(cut, fit, fit.layouts, points, prepared, every)
    if first.layout is not None:
        return first
    normed = [replace(lay, qk_l2norm=True) for lay in fit.layouts if "kb" not in lay.roles]
    if normed:
        second = _evaluate_pool(cut, fit, normed, points, prepared, every)
        if second.layout is not None:
            return second
    first.reason = sampler.named(first.reason)
    return first


def _evaluate_pool(cut: Cut, fit: Fit, layouts: list, points: list, prepared: dict,
                   every: bool) -> Verdict:
    """Every layout first on the first positions (at the first and last head and batch
    entry: a screen that orders the work), the ones that agree there along the whole
    sequence at every head and batch entry, at the scale the first positions gave.
    ``every``: a switch may act on any entry, so the screen runs every head too."""
    prefix = []
    for i, layout in enumerate(layouts):
        error, _, scale, _ = _score(layout, fit, cut, points, PREFIX, explain=False,
                                    prepared=prepared, every=every)
        prefix.append((error, i, layout, scale))
    prefix.sort(key=lambda item: item[:2])
    survivors = [(lay, c) for error, _, lay, c in prefix if error <= TOLERANCE]
    best = Verdict(region=(cut, fit), partial=bool(survivors))
    for layout, c in survivors or [prefix[0][2:]]:
        # the decision runs every head and batch entry (a change on one of them alone is
        # linear in (v, S0): no law shows it)
        out_error, state_error, scale, where = _score(layout, fit, cut, points, fit.length,
                                                      scale=c, prepared=prepared,
                                                      every=True)
        if out_error <= TOLERANCE and state_error <= TOLERANCE:
            return Verdict(layout.with_scale(exact_scale(scale, cut.nodes)), out_error,
                           state_error, region=(cut, fit))
        if out_error + state_error < best.error:
            best = Verdict(None, out_error, state_error, layout, where, (cut, fit),
                           bool(survivors))
    return best


def _score(layout: Layout, fit: Fit, cut: Cut, points, steps: int, explain: bool = True,
           scale: Optional[float] = None, prepared: Optional[dict] = None,
           every: bool = False):
    """(output error, final-state error, scale, where the output first differs) of the
    region against the delta rule under ``layout`` along the first ``steps`` positions; the
    output scale is fitted unless given. The rule is run for every batch entry and head
    when ``every`` (a decision), else for the first and last of each only (a screen: at
    real widths the run along T is the cost), for all points at once (one more batch axis
    in front). ``prepared``: the points sliced so, by the heads they are sliced at, shared
    by the layouts of one region."""
    steps = min(steps, fit.length)
    batch = fit.state_shape[:-2]
    heads = _heads_checked(layout, batch, every)
    key_heads = [layout.key_head(h) for h in heads]
    lasts = tuple(key_heads if i in (layout.roles["q"], layout.roles["k"]) else heads
                  for i in range(len(fit.groups)))
    prepared = {} if prepared is None else prepared
    key = (steps, tuple(heads), tuple(map(tuple, lasts)), every)
    if key not in prepared:
        prepared[key] = _at_heads(fit, cut, points, steps, heads, lasts, every)
    if prepared[key] is None:
        return float("inf"), float("inf"), 1.0, ""
    s, reads, gots = prepared[key]
    s, refs = s.clone(), []  # (the prepared states are every layout's: updated in place here)
    for t in range(steps):
        s, o = reference_step(layout, s, [read[t] for read in reads], inplace=True)[:2]
        refs.append(o)
    refs = torch.stack(refs)
    if gots[0].numel() != refs[:, 0].numel():
        return float("inf"), float("inf"), 1.0, ""
    return _errors(refs, gots, s, points, fit, (batch, heads, every), steps, scale,
                   _chunk_size(cut) if explain else None)


def _at_heads(fit: Fit, cut: Cut, points, steps: int, heads: list, lasts: tuple,
              every: bool):
    """(initial states, reads, outputs) of the points at the heads run and their first
    ``steps`` positions, the points stacked on a new axis in front of states and reads;
    None when an output position does not hold one row per state."""
    batch = fit.state_shape[:-2]
    starts, seqs, gots = [], [], []
    for ins, (value, _) in points:
        by_node = dict(zip(cut.inputs, ins))
        s = by_node[fit.state] if fit.state is not None else \
            torch.zeros(fit.state_shape, dtype=torch.float64)
        starts.append(_some(s, batch, heads, every=every))
        # each sequence with its first ``steps`` positions in front
        seqs.append([_some(by_node[n].movedim(axis, 0)[:steps], batch, last, 1, every)
                     for (n, axis), last in zip(fit.groups, lasts)])
        got = value.movedim(fit.value_axis, 0)[:steps]
        if got[0].numel() % math.prod(batch):
            return None
        gots.append(_some(got.reshape(steps, *batch, -1), batch, heads, 1, every))
    reads = [torch.stack(group, 1) for group in zip(*seqs)]  # [steps, points, ...]
    return torch.stack(starts), reads, gots


def _errors(refs, gots, finals, points, fit: Fit, entries, steps: int, scale, chunk):
    """The worst output and final-state errors over the points, the output scale (fitted
    at the first point unless given), where the output first differs (``chunk``: None, not
    asked)."""
    worst_o, worst_s, scales, where = 0.0, 0.0, [], ""
    for i, (got, (_, (_, final))) in enumerate(zip(gots, points)):
        ref = refs[:, i]
        got = got.reshape(ref.shape)
        c = scale if scale is not None else fitted_scale(got, ref)
        scales.append(c)
        worst_o = max(worst_o, rel(got, c * ref))
        if chunk is not None and not where and worst_o > TOLERANCE:
            where = _first_wrong((got - c * ref).abs(), ref, c, chunk)
        if steps == fit.length and fit.pad:
            worst_o = max(worst_o, _tail(points[i][1][0], fit))
        if steps == fit.length and final is not None:
            batch, heads, every = entries
            worst_s = max(worst_s, rel(_some(final.reshape(fit.state_shape), batch, heads,
                                             every=every), finals[i]))
    if not one_scale(scales):
        worst_o = max(worst_o, 1.0)
    return worst_o, worst_s, scales[0], where


def _tail(value: torch.Tensor, fit: Fit) -> float:
    """How far the output's positions past the inputs' length are from zeros, relative to
    the output's largest magnitude."""
    tail = value.narrow(fit.value_axis, fit.length, fit.pad)
    return tail.abs().max().item() / max(value.abs().max().item(), 1e-30)


def _some(x: torch.Tensor, batch, last: list, first: int = 0, every: bool = False
          ) -> torch.Tensor:
    """``x`` (axes from ``first`` on: the state's batch) at the first and last entry of each
    batch axis but the heads (the last), there at the entries ``last``: a slip that spares
    some heads still shows, and translation validation then runs every head. ``every``:
    every entry of the other batch axes."""
    for axis, size in enumerate(batch):
        index = last if axis == len(batch) - 1 else \
            list(range(size)) if every else sorted({0, size - 1})
        x = x.index_select(first + axis, torch.tensor(index))
    return x


def _heads_checked(layout: Layout, batch, every: bool = False) -> list:
    """The value heads the rule is run for: the first and the last; under GQA head 1 too,
    where grouped (h // G) and tiled (h % Hk) key heads differ (at 0 and the last they
    agree). ``every``: all of them."""
    if not batch:
        return []
    count = batch[-1]
    if every:
        return list(range(count))
    return sorted({0, count - 1} | ({1} if layout.key_heads is not None else set()))


def _first_wrong(error: torch.Tensor, ref: torch.Tensor, c: float, chunk: int) -> str:
    scale = max(ref.abs().max().item() * abs(c), 1e-30)
    per_position = error.reshape(error.shape[0], -1).max(-1).values / scale
    t = int((~(per_position <= TOLERANCE)).nonzero()[0])  # NaN counts as wrong
    if chunk and t and t % chunk == 0:
        return f"the output first differs at position {t}, the start of chunk {t // chunk}: " \
               "the chunks before it agree, the state they hand on does not"
    if chunk:
        return f"the output first differs at position {t} (chunk {t // chunk}, offset " \
               f"{t % chunk})"
    return f"the output first differs at position {t}"


def _chunk_size(cut: Cut) -> int:
    """The size of the cumulated axis of the region's first cumsum (the chunk), else 0."""
    for node in cut.nodes:
        if node.target is ATEN.cumsum.default:
            return shape(node)[node.args[1] % len(shape(node))]
    return 0


def _not_delta(verdict: Verdict) -> str:
    cut = verdict.region[0]
    if verdict.out_error == float("inf") and verdict.reason:
        return verdict.reason
    text = (f"the region from {', '.join(n.name for n in cut.inputs)} is not the delta rule "
            "or a gated linear recurrence under any layout its shapes allow: "
            f"{verdict.off_by('final state' if cut.final is not None else None)}")
    return text + (f"; {verdict.reason}" if verdict.reason else "")
