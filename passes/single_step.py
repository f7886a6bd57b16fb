"""A state updated once with no time axis: said, not fused (yet).

A decode step written without a loop (transformers' ``mamba2_selective_state_update``: the
state, a program input, cloned, decayed and written once, ``S * dA + dBx``, then read out)
has no tensor read position by position, so the loop rules do not see it; its decay and
write are formed from inputs that the step broadcasts over the state (dt and A expanded to
[H, P, N]), which no layout reads as the op's operands. Rather than leave such a step without
a word, this rule finds it by structure and leaves a near-miss naming it: the state, the
update, what the op would need. It fuses nothing.
"""

from __future__ import annotations

from torch import fx

from gdn_fx.passes.loops import MULS
from gdn_fx.passes.program import ATEN, dtype, same_sizes, shape
from gdn_fx.passes.rebuild import Fusion
from gdn_fx.passes.result import Miss

NAME = "gated_linear_scan"  # (a delta rule written so would be said the same way)
PASSES = {ATEN.clone.default, ATEN.alias.default, ATEN._to_copy.default, ATEN.to.dtype,
          ATEN.contiguous.default}
ADDS = {ATEN.add.Tensor, ATEN.add_.Tensor}


def plan_single_steps(graph: fx.Graph) -> tuple[list[Fusion], list[Miss]]:
    """Near-misses for the single-step state updates of ``graph`` (no fusions)."""
    return [], [Miss(NAME, _reason(state, mul), node=mul.name)
                for state, mul in _updates(graph)]


def find_single_steps(graph: fx.Graph) -> list[str]:
    """Nothing here is frozen at a traced length: a single step has none."""
    return []


def _updates(graph: fx.Graph) -> list:
    """(program input, S * decay) of each update S * decay + write of a state input of rank
    >= 3 whose new state is written back in place (into the input or a copy of it, as a
    cache is: a sequence input scaled and shifted, the D skip, is no state) and not decayed
    again (one step, not a loop: a loop the other rules left has its near-miss from them)."""
    found = []
    for node in graph.nodes:
        if node.target not in MULS or len(node.args) != 2:
            continue
        state = next(filter(None, map(_input_of, node.args)), None)
        if state is None or not same_sizes(shape(node), shape(state)):
            continue
        adds = [u for u in node.users if u.target in ADDS and same_sizes(shape(u), shape(node))]
        if any(_written_back(a) for a in adds) and not any(_decayed_again(a) for a in adds):
            found.append((state, node))
    return found


def _input_of(value) -> fx.Node | None:
    """The program input ``value`` is a copy or cast of: a floating tensor of rank >= 3."""
    while isinstance(value, fx.Node) and value.target in PASSES:
        value = value.args[0]
    if not isinstance(value, fx.Node) or value.op != "placeholder":
        return None
    dims, kind = shape(value), dtype(value)
    if dims is None or kind is None or not kind.is_floating_point or len(dims) < 3:
        return None
    return value


def _written_back(new: fx.Node) -> bool:
    """Whether the new state (through copies and casts) is copied into a value in place."""
    return any(user.target is ATEN.copy_.default and user.args[1] is value
               for value, user in _reads_of(new))


def _decayed_again(new: fx.Node) -> bool:
    """Whether the new state (through copies and casts) is multiplied and added to again."""
    return any(user.target in MULS and same_sizes(shape(user), shape(new))
               and any(u.target in ADDS for u in user.users) for _, user in _reads_of(new))


def _reads_of(new: fx.Node):
    """(value, reader) for the readers of ``new`` and of its copies and casts."""
    todo = [new]
    while todo:
        node = todo.pop()
        for user in node.users:
            yield node, user
            if user.target in PASSES:
                todo.append(user)


def _reason(state: fx.Node, mul: fx.Node) -> str:
    return (f"the state {state.name} {list(shape(state))} is multiplied and added to once, "
            "with no time axis (a decode step of one token written without a loop): not "
            "recognized yet. The loop rules take a step read position by position from a "
            "sequence, a loop of one step too")
