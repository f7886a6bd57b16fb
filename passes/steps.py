"""Find the timesteps of unrolled gated-delta loops and chain them along the state edge.

Search pattern (one step, see patterns.py), state S, time index t:
    S_t = S_{t-1} * decay(g_t);  S_t += k_t (outer) ((v_t - sum_k(S_t * k_t)) * beta_t)
    out_t = sum_k(S_t * q_t)
Chain rule: step t's new state is step t+1's incoming state; every step of a chain reads the
same q/k/v/g/beta sources, at time indices 0, 1, ..., T-1 in order, T being the sources' length.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Optional

from torch import fx

from gdn_fx.passes.match import Match, match_at, outside_users, op_name
from gdn_fx.passes.patterns import TIME_AXIS, step_patterns
from gdn_fx.passes.program import shape
from gdn_fx.passes.result import NoMatch

SOURCES = ("q", "k", "v", "g", "beta")


@dataclass
class Step:
    """One matched timestep."""

    match: Match

    @property
    def kind(self) -> str:
        return self.match.pattern.name

    @property
    def index(self) -> int:
        return self.match.index

    @property
    def state_in(self) -> fx.Node:
        return self.match.bound("state")

    @property
    def state_out(self) -> fx.Node:
        return self.match.out("state")

    @property
    def out(self) -> fx.Node:
        return self.match.out("out")

    def source(self, name: str) -> fx.Node:
        return self.match.bound(name)


@dataclass
class Failure:
    """A candidate step that did not check out: a full match with defects, or a partial one."""

    error: NoMatch
    partial: Match
    complete: bool  # every pattern node matched; a literal, user or shape check failed

    def touches(self, known: set) -> bool:
        """Whether the failure reads one of the ``known`` nodes (states, sources of steps)."""
        bound = [self.partial.bound(name) for name in ("state",) + SOURCES]
        return any(node is not None and node in known for node in bound)


def step_nodes(steps: list[Step]) -> set:
    """The states and sources matched steps read or produce."""
    return {s.state_out for s in steps} | {s.source(n) for s in steps for n in SOURCES}


def find_steps(graph: fx.Graph) -> tuple[list[Step], list[Failure]]:
    """Every structurally complete, defect-free step, and the candidates that failed."""
    targets = {n.target for n in graph.nodes if n.op == "call_function"}
    patterns = step_patterns(targets)
    anchor_targets = {p.outputs[p.anchor].target for p in patterns}
    steps, failures = [], []
    for node in graph.nodes:
        if node.op == "call_function" and node.target in anchor_targets:
            found = _try_patterns(patterns, node)
            if isinstance(found, Step):
                steps.append(found)
            elif found is not None:
                failures.append(found)
    return steps, failures


def _try_patterns(patterns, node: fx.Node):
    """The node's step, or its most advanced failure (None when nothing got started)."""
    best: Optional[Failure] = None
    for pattern in patterns:
        if node.target != pattern.outputs[pattern.anchor].target:
            continue
        try:
            match = match_at(pattern, node)
        except NoMatch as err:
            failure = Failure(err, err.partial, complete=False)
        else:
            problem = _step_problem(match)
            if problem is None:
                return Step(match)
            failure = Failure(problem, match, complete=True)
        if best is None or (failure.complete, len(failure.partial.nodes)) > \
                (best.complete, len(best.partial.nodes)):
            best = failure
    return best


def _step_problem(match: Match) -> Optional[NoMatch]:
    """Defects found after a full structural match: literals, outside users, shapes."""
    if match.defects:
        reason, node = match.defects[0]
        return NoMatch(reason, node=node, step=match.index)
    leaks = outside_users(match)
    if leaks:
        inner, user = leaks[0]
        return NoMatch(f"intermediate value {inner.name} is also read by {user.name} "
                       f"({op_name(user.target)}) outside the step", node=inner, step=match.index)
    return _shape_problem(match)


def _shape_problem(match: Match) -> Optional[NoMatch]:
    """Operand shapes must be the layout the pattern kind stands for."""
    state = shape(match.bound("state"))
    if state is None or len(state) != 4:
        return NoMatch(f"state has shape {state}, expected [B, H, Dk, Dv]",
                       node=match.bound("state"), step=match.index)
    b, h, dk, dv = state
    time = TIME_AXIS[match.pattern.name]
    for name, width in (("q", dk), ("k", dk), ("v", dv), ("beta", None), ("g", None)):
        got = shape(match.bound(name))
        want = _expected(match.pattern.name, name, b, h, width, dk, got)
        if got is None or want is None or not _fits(got, want, time):
            return NoMatch(f"operand {name} has shape {got}, expected {want} (time axis {time})",
                           node=match.bound(name), step=match.index)
    return None


def _expected(kind, name, b, h, width, dk, got):
    """The expected shape with the time axis left as None."""
    if name == "g":
        return [b, h, None] if kind == "gdn" else [b, None, h, dk]
    if name == "beta":
        return [b, h, None] if kind == "gdn" else [b, None, h]
    return [b, h, None, width] if kind == "gdn" else [b, None, h, width]


def _fits(got, want, time) -> bool:
    return len(got) == len(want) and all(w is None or g == w for g, w in zip(got, want))


def time_length(step: Step) -> int:
    """T, the length of the time axis of the step's sources."""
    return shape(step.source("q"))[TIME_AXIS[step.kind]]


def chains(steps: list[Step]) -> list[list[Step]]:
    """Steps grouped into connected components along state edges, each in state order.

    A component where one state feeds two steps keeps all its steps, unordered after the fork;
    check_chain reports it.
    """
    reading = {}
    for step in steps:
        reading.setdefault(step.state_in, []).append(step)
    succ = {id(s): reading.get(s.state_out, []) for s in steps}
    has_pred = {id(t) for s in steps for t in succ[id(s)]}
    result = []
    for start in (s for s in steps if id(s) not in has_pred):
        chain, todo = [], [start]
        while todo:
            step = todo.pop(0)
            chain.append(step)
            todo.extend(succ[id(step)])
        result.append(chain)
    return result


def check_chain(chain: list[Step]) -> int:
    """Raise NoMatch unless the chain is one whole loop; return T."""
    head = chain[0]
    length = time_length(head)
    readers = Counter(s.state_in for s in chain)
    for pos, step in enumerate(chain):
        if readers[step.state_out] > 1:
            raise NoMatch(f"the state after step {pos} feeds {readers[step.state_out]} steps",
                          node=step.state_out, step=pos)
    for pos, step in enumerate(chain):
        _check_link(chain, pos, step, head, length)
    if len(chain) != length:
        raise NoMatch(f"steps 0..{len(chain) - 1} form a chain but the loop has {length} steps; "
                      "the others did not match", node=chain[-1].state_out, step=len(chain))
    return length


def _check_link(chain: list[Step], pos: int, step: Step, head: Step, length: int) -> None:
    if pos > 0 and step.state_in is not chain[pos - 1].state_out:
        raise NoMatch(f"reads state {step.state_in.name}, not the state after step {pos - 1}",
                      node=step.state_in, step=pos)
    if step.kind != head.kind:
        raise NoMatch(f"step layout {step.kind} differs from step 0 ({head.kind})", step=pos)
    for name in SOURCES:
        if step.source(name) is not head.source(name):
            raise NoMatch(f"reads {name} from {step.source(name).name}, step 0 reads it from "
                          f"{head.source(name).name}", node=step.source(name), step=pos)
    if step.index != pos:
        raise NoMatch(f"reads time index {step.index}, expected {pos}", node=step.out, step=pos)
    if pos < len(chain) - 1:
        inside = set(step.match.nodes.values()) | set(chain[pos + 1].match.nodes.values())
        extra = [u for u in step.state_out.users if u not in inside]
        if extra:
            raise NoMatch(f"the state after this step is also read by {extra[0].name}; the fused "
                          "node only gives the final state", node=step.state_out, step=pos)
