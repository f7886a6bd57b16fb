"""The causal-conv1d-update region, read outward from its convolution.

Search pattern (transformers' ``causal_conv1d_update``, and the prefill that feeds a cache):
    full = cat(state, x, -1)          state [B, C, K], x [B, C, S]
         | pad(x, [Z, 0]) | x          (prefill from a fresh cache: zero history)
    state <- full[..., -K:]            (copy_, copy, or a buffer-mutation output; before or
                                        after the cast)
    y = conv1d(full.to(w.dtype), w.unsqueeze(1), bias, padding=P, groups=C)
    out = act(y[..., window]).to(x.dtype)    (slices, SiLU and casts, in the order HF wrote them)

This module only reads what is there: the feed into the conv (cat or pad, then casts), the
slices that keep the last K samples of the feed (the state writes), the chain after the conv
(slices on the time axis, SiLU, casts) and the window arithmetic on possibly symbolic sizes.
conv_update.py decides whether that is an update.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from gdn_fx.passes.program import ASSERT_META, ATEN, dtype, shape, val

CONVS = (ATEN.conv1d.default, ATEN.conv1d.padding, ATEN.convolution.default)
SLICES = (ATEN.slice.Tensor, ATEN.slice_copy.Tensor)
CASTS = (ATEN.to.dtype, ATEN.to.dtype_layout, ATEN.to.device, ATEN._to_copy.default,
         ATEN.clone.default, ATEN.alias.default, ATEN.contiguous.default)
PADS = (ATEN.pad.default, ATEN.constant_pad_nd.default)
TIME = 2  # the time axis of [B, C, T]
HALVES = (torch.float16, torch.bfloat16)


@dataclass
class ConvCall:
    """A convolution's arguments, whichever overload spelled them."""

    node: fx.Node
    input: fx.Node
    weight: fx.Node
    bias: Optional[fx.Node]
    stride: Any
    padding: Any  # an int list, or "same"/"valid" for conv1d.padding
    dilation: Any
    groups: int
    transposed: bool = False
    output_padding: Any = (0,)


@dataclass
class Feed:
    """What the conv reads: ``full`` (cat, pad or x itself), then casts to the conv input."""

    nodes: list  # full first, the conv's input last; each node casts the one before
    kind: str  # "cat" (a cat on the time axis), "pad" or "x" (the conv reads x itself)
    state: Optional[fx.Node]  # cat's first operand; None for a zero history
    x: fx.Node  # cat's last operand, the pad's input, or full itself
    zeros: Optional[int] = 0  # zero samples before x in full; None: a pad of something else

    @property
    def full(self) -> fx.Node:
        return self.nodes[0]

    @property
    def made(self) -> list:
        """Feed nodes the region computes (x itself is the caller's when full is x)."""
        return self.nodes if self.full is not self.x else self.nodes[1:]


@dataclass
class Link:
    """One node after the conv: a time slice, a SiLU or a cast (``extra``: the sigmoid)."""

    node: fx.Node
    kind: str  # "slice" | "silu" | "cast"
    extra: list = field(default_factory=list)


def conv_nodes(graph: fx.Graph) -> list[fx.Node]:
    """Every 1-D convolution call in the graph (input of rank 3)."""
    return [n for n in graph.nodes if n.op == "call_function" and n.target in CONVS
            and shape(n.args[0]) is not None and len(shape(n.args[0])) == 3]


def _arg(node: fx.Node, index: int, name: str, default: Any = None) -> Any:
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def conv_call(node: fx.Node) -> ConvCall:
    """The convolution's arguments with defaults filled in."""
    names = [("stride", [1]), ("padding", [0]), ("dilation", [1])]
    call = ConvCall(node, _arg(node, 0, "input"), _arg(node, 1, "weight"),
                    _arg(node, 2, "bias"), *[_arg(node, 3 + i, n, d) for i, (n, d) in
                                              enumerate(names)], groups=1)
    if node.target is ATEN.convolution.default:
        call.transposed = bool(_arg(node, 6, "transposed", False))
        call.output_padding = _arg(node, 7, "output_padding", [0])
        call.groups = _arg(node, 8, "groups", 1)
    else:
        call.groups = _arg(node, 6, "groups", 1)
    return call


def single(value: Any) -> Any:
    """The one entry of a 1-D conv's int list (``[3]`` -> 3), the value itself otherwise."""
    if isinstance(value, (list, tuple)) and len(value) == 1:
        return value[0]
    return value


def real_users(node: fx.Node) -> list[fx.Node]:
    """Users that compute something (metadata asserts only check a value)."""
    return [u for u in node.users if u.target is not ASSERT_META]


def is_cast(node: Any) -> bool:
    """A dtype cast or copy that keeps shape, device and values (up to the dtype)."""
    if not (isinstance(node, fx.Node) and node.op == "call_function" and node.target in CASTS
            and isinstance(node.args[0], fx.Node)):
        return False
    before, after = val(node.args[0]), val(node)
    return (isinstance(before, torch.Tensor) and isinstance(after, torch.Tensor)
            and before.shape == after.shape and before.device == after.device)


def is_write(user: fx.Node, node: fx.Node) -> bool:
    """``user`` copies ``node`` into another tensor (in place or functionally)."""
    return (user.target in (ATEN.copy_.default, ATEN.copy.default) and len(user.args) > 1
            and user.args[1] is node and user.args[0] is not node)


def read_feed(conv_input: fx.Node) -> Feed:
    """Walk back from the conv input through casts to a cat, a pad or (else) x itself.

    For a zero history without pad, ``full`` is the earliest node of the cast run; the rule
    may settle on a later one (:func:`shorten_feed`).
    """
    nodes = [conv_input]
    while is_cast(nodes[0]) and not _is_full(nodes[0]):
        nodes.insert(0, nodes[0].args[0])
    full = nodes[0]
    if full.target is ATEN.cat.default and _arg(full, 1, "dim", 0) % 3 == TIME:
        parts = list(full.args[0])
        return Feed(nodes, "cat", parts[0], parts[-1])
    if full.target in PADS:
        return Feed(nodes, "pad", None, full.args[0], zeros=left_zeros(full))
    return Feed(nodes, "x", None, full)


def _is_full(node: fx.Node) -> bool:
    return node.target is ATEN.cat.default or node.target in PADS


def left_zeros(pad: fx.Node) -> Optional[int]:
    """Z for a constant zero pad of Z samples on the left of the time axis only, else None."""
    widths = list(pad.args[1])
    is_pad = pad.target is ATEN.pad.default
    mode = _arg(pad, 2, "mode", "constant") if is_pad else "constant"
    value = _arg(pad, 3 if is_pad else 2, "value", 0.0)
    if mode != "constant" or value not in (None, 0, 0.0) or len(widths) != 2 or widths[1] != 0:
        return None
    return widths[0] if isinstance(widths[0], int) and widths[0] >= 0 else None


def shorten_feed(feed: Feed, start: int) -> Feed:
    """The same zero-history feed with ``full`` = x moved to ``feed.nodes[start]``."""
    nodes = feed.nodes[start:]
    return Feed(nodes, "x", None, nodes[0])


def slice_args(node: fx.Node) -> tuple:
    """(dim, start, end, step) of a slice, defaults filled in."""
    return (_arg(node, 1, "dim", 0), _arg(node, 2, "start"), _arg(node, 3, "end"),
            _arg(node, 4, "step", 1))


def number(value: Any) -> Any:
    """A slice bound as an int or SymInt (a SymInt-valued node gives its value)."""
    return val(value) if isinstance(value, fx.Node) else value


def tails(feed: Feed, width: Any) -> list[fx.Node]:
    """Slices of the feed keeping its last ``width`` samples on the time axis."""
    found = []
    for source in feed.nodes:
        length = shape(source)[TIME]
        for user in real_users(source):
            if user.target not in SLICES or user.args[0] is not source:
                continue
            dim, start, _, step = slice_args(user)
            begin = start_in(number(start), length)
            if (dim % 3 == TIME and step == 1 and begin is not None
                    and known(begin == length - width) and known(shape(user)[TIME] == width)):
                found.append(user)
    return found


def read_chain(conv: fx.Node) -> list[Link]:
    """The run of time slices, SiLU and casts after the conv, each read by the next only."""
    links = []
    while (link := _next_link(links[-1].node if links else conv)) is not None:
        links.append(link)
    return links


def _next_link(node: fx.Node) -> Optional[Link]:
    users = real_users(node)
    if len(users) == 1:
        user = users[0]
        if user.target in SLICES and user.args[0] is node:
            return Link(user, "slice")
        if user.target is ATEN.silu.default:
            return Link(user, "silu")
        if is_cast(user):
            return _half_silu(node, user) or Link(user, "cast")
        return None
    return _sigmoid_mul(node, users)


def _sigmoid_mul(node: fx.Node, users: list[fx.Node]) -> Optional[Link]:
    """SiLU as core aten spells it: mul(x, sigmoid(x)), in either operand order."""
    if len(users) != 2:
        return None
    sig = next((u for u in users if u.target is ATEN.sigmoid.default), None)
    mul = next((u for u in users if u.target is ATEN.mul.Tensor), None)
    if sig is None or mul is None or real_users(sig) != [mul]:
        return None
    if set(mul.args[:2]) != {node, sig} or len(mul.args) != 2:
        return None
    return Link(mul, "silu", extra=[sig])


def _half_silu(node: fx.Node, up: fx.Node) -> Optional[Link]:
    """SiLU of a half tensor as core aten spells it: in f32, rounded back once (as eager)."""
    if dtype(node) not in HALVES or dtype(up) != torch.float32:
        return None
    silu = _sigmoid_mul(up, real_users(up))
    down = real_users(silu.node) if silu is not None else []
    if len(down) != 1 or not is_cast(down[0]) or dtype(down[0]) != dtype(node):
        return None
    return Link(down[0], "silu", extra=[up, *silu.extra, silu.node])


def dtype_changes(nodes: list[fx.Node]) -> int:
    """How many casts in a run of nodes change the dtype."""
    return sum(dtype(a) != dtype(b) for a, b in zip(nodes, nodes[1:]))


def known(condition: Any) -> bool:
    """True only when ``condition`` holds for every value of its symbols (adds no guard)."""
    if isinstance(condition, bool):
        return condition
    return statically_known_true(condition)


def start_in(start: Any, length: Any) -> Any:
    """A slice start as an offset in [0, length], or None when its sign is not known."""
    if start is None:
        return 0
    if known(start >= 0):
        return start
    if known(start < 0):
        return 0 if known(start + length <= 0) else start + length
    return None
