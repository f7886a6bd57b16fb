"""What the graph proves about the range of a value: interval arithmetic over fx nodes.

A loop that multiplies its state by a decay computed before it (not by exp of a log gate)
hands the op that decay's log. That is exact only where the decay is not negative, and no
drawn point proves it is never negative: the graph must. ``bounds`` walks back from a node
through the operations whose range follows from their operands' (exp, sigmoid, softplus,
tanh, sums, products, views, casts, ...) and returns an interval every element lies in
(NaN aside: where the program computes NaN, the op computes NaN too). An operation it does
not know, an input or a parameter lifted to an input is unbounded: the answer is a proof or
nothing.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch
from torch import fx

from gdn_fx.passes.evaluator import copy_constant, evaluable, op_name

INF = math.inf
ANY = (-INF, INF)
DEPTH = 24  # a decay is a few operations from its inputs; past this, nothing is proven

# operations whose every element is an element of their first operand (views, copies, casts,
# gathers, repeats): the operand's range
SAME = frozenset({
    "view", "reshape", "_unsafe_view", "unsqueeze", "squeeze", "expand", "expand_as",
    "permute", "transpose", "t", "clone", "contiguous", "select", "slice", "index_select",
    "narrow", "repeat", "repeat_interleave", "_to_copy", "to", "type_as", "alias", "detach",
    "flatten", "unflatten", "movedim", "lift_fresh_copy", "split", "split_with_sizes",
    "unbind", "chunk", "tensor_split", "unfold", "as_strided", "getitem", "gather", "roll",
    "flip", "view_as",
})
# operations with a fixed range, whatever their operand
FIXED = {
    "sigmoid": (0.0, 1.0), "tanh": (-1.0, 1.0), "softmax": (0.0, 1.0),
    "_softmax": (0.0, 1.0), "softplus": (0.0, INF), "sqrt": (0.0, INF), "rsqrt": (0.0, INF),
    "abs": (0.0, INF), "relu": (0.0, INF), "square": (0.0, INF), "hardsigmoid": (0.0, 1.0),
    "erf": (-1.0, 1.0), "cos": (-1.0, 1.0), "sin": (-1.0, 1.0),
}


def bounds(node: Any, depth: int = 0) -> tuple[float, float]:
    """(lo, hi) such that every element of ``node`` lies in [lo, hi] (a literal number is
    its own interval); (-inf, inf) when nothing is proven."""
    if isinstance(node, bool):
        return (float(node), float(node))
    if isinstance(node, numbers.Number):
        return (float(node), float(node)) if not isinstance(node, complex) else ANY
    if isinstance(node, (list, tuple)):
        return _hull([bounds(x, depth + 1) for x in node]) if node else ANY
    if not isinstance(node, fx.Node) or depth > DEPTH:
        return ANY
    if node.op == "get_attr":
        return _held(node)
    if node.op != "call_function":
        return ANY
    found = _of_call(node, op_name(node), depth + 1)
    if -INF in found or INF in found:
        if depth == 0 and evaluable(node):  # literals only: its values, as computed
            computed = _computed(node)
            return (max(found[0], computed[0]), min(found[1], computed[1]))
    return found


def nonnegative(node: fx.Node) -> bool:
    """Whether the graph proves every element of ``node`` >= 0."""
    return bounds(node)[0] >= 0.0


def _of_call(node: fx.Node, name: str, depth: int) -> tuple[float, float]:
    args = node.args
    arg = (lambda i: bounds(args[i], depth) if len(args) > i else ANY)
    if name in SAME:
        return arg(0)
    if name in FIXED:
        return FIXED[name]
    rule = RULES.get(name)
    return rule(node, arg) if rule is not None else ANY


def _held(node: fx.Node) -> tuple[float, float]:
    """A module attribute's values, as held (a constant of the program)."""
    module = node.graph.owning_module
    value = module
    for part in str(node.target).split("."):
        value = getattr(value, part, None)
    if not isinstance(value, torch.Tensor) or not value.numel() or value.is_complex():
        return ANY
    return (float(value.min()), float(value.max()))


def _computed(node: fx.Node) -> tuple[float, float]:
    """The range of a value computed from literals and module attributes alone (retention's
    ``1 - 2 ** (-5 - arange(H))``), by computing it."""
    graph, env = fx.Graph(), {}
    copy_constant(graph, node, env)
    graph.output(env[node])
    try:
        value = fx.GraphModule(node.graph.owning_module or torch.nn.Module(), graph)()
    except Exception:  # noqa: BLE001 (it does not run alone: nothing proven)
        return ANY
    if not isinstance(value, torch.Tensor) or not value.numel() or value.is_complex():
        return ANY
    return (float(value.min()), float(value.max()))


def _hull(parts: list) -> tuple[float, float]:
    return (min(p[0] for p in parts), max(p[1] for p in parts))


def _times(a: float, b: float) -> float:
    return 0.0 if a == 0.0 or b == 0.0 else a * b  # a bound of 0 times an unbounded one


def _product(a: tuple, b: tuple) -> tuple[float, float]:
    ends = [_times(x, y) for x in a for y in b]
    return (min(ends), max(ends))


def _sum(a: tuple, b: tuple, alpha: float = 1.0) -> tuple[float, float]:
    b = _product(b, (alpha, alpha))
    lo, hi = a[0] + b[0], a[1] + b[1]
    return (lo if not math.isnan(lo) else -INF, hi if not math.isnan(hi) else INF)


def _negate(a: tuple) -> tuple[float, float]:
    return (-a[1], -a[0])


def _reciprocal(a: tuple) -> tuple[float, float]:
    if a[0] > 0.0:
        return (1.0 / a[1], 1.0 / a[0])
    if a[0] >= 0.0:  # 1 / 0 is inf, never negative
        return (1.0 / a[1] if a[1] > 0 else 0.0, INF)
    return ANY


def _alpha(node: fx.Node) -> float:
    alpha = node.kwargs.get("alpha", 1)
    return float(alpha) if isinstance(alpha, numbers.Number) else INF


def _exp(a: tuple) -> tuple[float, float]:
    return (math.exp(a[0]) if a[0] > -INF else 0.0, math.exp(min(a[1], 709.0))
            if a[1] < 709.0 else INF)


def _pow(node: fx.Node, arg) -> tuple[float, float]:
    base, exponent = arg(0), node.args[1] if len(node.args) > 1 else None
    if base[0] >= 0.0:
        return (0.0, INF)
    if isinstance(exponent, numbers.Number) and float(exponent).is_integer() and \
            int(exponent) % 2 == 0:
        return (0.0, INF)
    return ANY


def _clamp(node: fx.Node, arg) -> tuple[float, float]:
    lo, hi = arg(0)
    name = op_name(node)
    low = node.args[1] if len(node.args) > 1 and name != "clamp_max" else \
        node.kwargs.get("min")
    high = node.args[2] if len(node.args) > 2 else node.args[1] \
        if name == "clamp_max" and len(node.args) > 1 else node.kwargs.get("max")
    if isinstance(low, numbers.Number):
        lo, hi = max(lo, float(low)), max(hi, float(low))
    if isinstance(high, numbers.Number):
        lo, hi = min(lo, float(high)), min(hi, float(high))
    return (lo, hi)


def _filled(node: fx.Node, arg) -> tuple[float, float]:
    """full / full_like / fill / new_full: the fill value."""
    for value in (node.args[1] if len(node.args) > 1 else None, node.kwargs.get("fill_value")):
        if isinstance(value, numbers.Number):
            return (float(value), float(value))
    return ANY


def _cumprod_like(node: fx.Node, arg) -> tuple[float, float]:
    """Products and sums of non-negative elements are non-negative."""
    return (0.0, INF) if arg(0)[0] >= 0.0 else ANY


RULES = {
    "exp": lambda n, arg: _exp(arg(0)),
    "exp2": lambda n, arg: _exp(_product(arg(0), (math.log(2), math.log(2)))),
    "log": lambda n, arg: (-INF, math.log(arg(0)[1]) if 0 < arg(0)[1] < INF else
                          (-INF if arg(0)[1] == 0 else INF)),
    "neg": lambda n, arg: _negate(arg(0)),
    "add": lambda n, arg: _sum(arg(0), arg(1), _alpha(n)),
    "sub": lambda n, arg: _sum(arg(0), arg(1), -_alpha(n)),
    "rsub": lambda n, arg: _sum(arg(1), arg(0), -_alpha(n)),
    "mul": lambda n, arg: _product(arg(0), arg(1)),
    "div": lambda n, arg: _product(arg(0), _reciprocal(arg(1)))
    if n.kwargs.get("rounding_mode") is None else ANY,
    "reciprocal": lambda n, arg: _reciprocal(arg(0)),
    "pow": _pow,
    "clamp": _clamp, "clip": _clamp, "clamp_min": _clamp, "clamp_max": _clamp,
    "maximum": lambda n, arg: (max(arg(0)[0], arg(1)[0]), max(arg(0)[1], arg(1)[1])),
    "minimum": lambda n, arg: (min(arg(0)[0], arg(1)[0]), min(arg(0)[1], arg(1)[1])),
    "where": lambda n, arg: _hull([arg(1), arg(2)]),
    "cat": lambda n, arg: arg(0), "stack": lambda n, arg: arg(0),
    "full": _filled, "full_like": _filled, "new_full": _filled, "fill": _filled,
    "scalar_tensor": lambda n, arg: arg(0),
    "ones": lambda n, arg: (1.0, 1.0), "ones_like": lambda n, arg: (1.0, 1.0),
    "new_ones": lambda n, arg: (1.0, 1.0), "zeros": lambda n, arg: (0.0, 0.0),
    "zeros_like": lambda n, arg: (0.0, 0.0), "new_zeros": lambda n, arg: (0.0, 0.0),
    "cumprod": _cumprod_like, "prod": _cumprod_like, "sum": _cumprod_like,
    "cumsum": _cumprod_like,
    "mean": lambda n, arg: arg(0), "amax": lambda n, arg: arg(0),
    "amin": lambda n, arg: arg(0),
    "logsigmoid": lambda n, arg: (-INF, 0.0),
}
