"""Program plumbing shared by the rules: unwrap, node metadata, dead code, signature sync."""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from gdn_fx.errors import UnsupportedProgram

ATEN = torch.ops.aten
ASSERT_META = ATEN._assert_tensor_metadata.default


def graph_module_of(program: Any) -> tuple[fx.GraphModule, Optional[torch.export.ExportedProgram]]:
    """The GraphModule to rewrite in place, and the ExportedProgram around it (or None)."""
    if isinstance(program, torch.export.ExportedProgram):
        return program.graph_module, program
    if isinstance(program, fx.GraphModule):
        return program, None
    raise UnsupportedProgram(
        f"expected a torch.export.ExportedProgram or torch.fx.GraphModule, got {type(program)}")


def val(node: Any) -> Any:
    """The fake value recorded for a node (meta['val']), or None for literals/unknowns."""
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def shape(node: Any) -> Optional[tuple]:
    """The node's tensor shape as a tuple, or None when it has no tensor metadata."""
    value = val(node)
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None


def dtype(node: Any) -> Optional[torch.dtype]:
    """The dtype of a node's tensor value (None for non-tensors)."""
    value = val(node)
    return value.dtype if isinstance(value, torch.Tensor) else None


def fake_mode_of(graph: fx.Graph, among: Optional[Iterable[fx.Node]] = None
                 ) -> FakeTensorMode:
    """The fake mode behind the graph's metadata (of the nodes ``among``, when given: the
    operands new nodes will read), or a fresh one when there is none shared.

    torch.export uses one mode (symbolic sizes live there); make_fx on real tensors gives every
    value its own, with concrete sizes, which a fresh mode can rebuild.
    """
    modes = {}
    for node in graph.nodes if among is None else among:  # an unrolled loop: ~10^4 nodes
        value = node.meta.get("val")
        if isinstance(value, FakeTensor):
            modes[id(value.fake_mode)] = value.fake_mode
    return next(iter(modes.values())) if len(modes) == 1 else FakeTensorMode()


def in_mode(value: Any, mode: FakeTensorMode) -> Any:
    """``value`` as a fake tensor of ``mode`` (same shape, strides, dtype); non-tensors as is."""
    if not isinstance(value, torch.Tensor) or getattr(value, "fake_mode", None) is mode:
        return value
    with mode:
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype,
                                   device=value.device)


def add_node(graph: fx.Graph, target: Callable, args: tuple, kwargs: Optional[dict] = None,
             mode: Optional[FakeTensorMode] = None) -> fx.Node:
    """Create a call_function node (at the graph's insert point) with its meta['val'] filled."""
    node = graph.call_function(target, args, kwargs or {})
    mode = mode or fake_mode_of(graph)
    fake_args = fx.node.map_arg(args, lambda n: in_mode(val(n), mode))
    fake_kwargs = fx.node.map_arg(kwargs or {}, lambda n: in_mode(val(n), mode))
    with mode:
        node.meta["val"] = target(*fake_args, **fake_kwargs)
    return node


def copy_meta(source: fx.Node, nodes) -> None:
    """Give the nodes made for a fusion the source location of the node they stand for."""
    for node in nodes:
        for key in ("nn_module_stack", "stack_trace", "source_fn_stack"):
            if key in source.meta:
                node.meta[key] = source.meta[key]


def positions(graph: fx.Graph) -> dict:
    """node -> its position in ``graph``."""
    return {node: i for i, node in enumerate(graph.nodes)}


def reachable(starts: Iterable[fx.Node], step: Callable[[fx.Node], Iterable[fx.Node]]) -> set:
    """``starts`` and every node reached from them by ``step`` (a node's next ones)."""
    seen = set(starts)
    todo = list(seen)
    while todo:
        for node in step(todo.pop()):
            if node not in seen:
                seen.add(node)
                todo.append(node)
    return seen


def mutates(node: fx.Node) -> bool:
    """A call whose op's schema says it writes one of its arguments in place."""
    schema = getattr(node.target, "_schema", None)
    return bool(schema is not None and schema.is_mutable)


def is_mutation(node: fx.Node) -> bool:
    """A call that writes into its first argument, a node (``x.mul_(...)``, ``copy_``)."""
    return mutates(node) and node.op == "call_function" and bool(node.args) and \
        isinstance(node.args[0], fx.Node)


def writes_into(user: fx.Node, node: fx.Node) -> bool:
    """Whether ``user`` writes into ``node`` in place (its first argument)."""
    return is_mutation(user) and user.args[0] is node


def view_writes(node: fx.Node, keep: Callable[[fx.Node], bool] = lambda user: True) -> list:
    """In-place writes into ``node``'s storage, through its views and the writes before them
    (only the users ``keep`` allows are followed)."""
    through = reachable([node], lambda n: [u for u in n.users if u.args and u.args[0] is n
                                           and keep(u) and (is_alias(u) or is_mutation(u))])
    return [u for u in through if u is not node and is_mutation(u)]


def is_alias(node: fx.Node) -> bool:
    """The op's result aliases its first argument (a view, or an in-place op's self)."""
    schema = getattr(node.target, "_schema", None)
    return bool(node.op == "call_function" and schema is not None and schema.returns
                and schema.returns[0].alias_info is not None and node.args
                and isinstance(node.args[0], fx.Node))


def base_of(node: fx.Node) -> fx.Node:
    """The tensor a chain of views and in-place ops starts from."""
    while is_alias(node):
        node = node.args[0]
    return node


ZERO_MAKERS = (ATEN.zeros.default, ATEN.zeros_like.default, ATEN.new_zeros.default)
FILL_MAKERS = {ATEN.full.default: 1, ATEN.full_like.default: 1, ATEN.new_full.default: 2}


def is_zeros(node: Any) -> bool:
    """zeros, zeros_like, new_zeros, or a fill with 0 (core aten's spelling of them)."""
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return False
    index = FILL_MAKERS.get(node.target)
    return node.target in ZERO_MAKERS or index is not None and len(node.args) > index and \
        node.args[index] == 0


def is_pure(node: fx.Node) -> bool:
    """A call that only computes its value: an aten op without side effects, or a Python
    operator on sizes. Anything else (torch.vmap's nesting calls, higher-order ops, ...) may
    act on the interpreter's state and is kept even when nothing reads its value."""
    if node.op != "call_function":
        return False
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        known = _PURE_OVERLOADS.get(target)
        if known is None:
            known = _PURE_OVERLOADS[target] = not node.is_impure() and \
                not target._schema.is_mutable
        return known
    if node.is_impure():
        return False
    return getattr(target, "__module__", None) in ("_operator", "operator", "math")


# Whether an aten overload is pure depends on the overload alone (its schema, whether it is
# random, its registered effects: torch's is_impure reads its arguments only for higher-order
# ops), and asking torch costs ~5 us: a pass over an unrolled loop asks for thousands of nodes.
_PURE_OVERLOADS: dict = {}


def _removable(node: fx.Node) -> bool:
    if node.op != "call_function" or node.users:
        return False
    if node.target is ASSERT_META:  # checks a value nothing else reads any more
        arg = node.args[0]
        return all(user.target is ASSERT_META for user in arg.users)
    return is_pure(node)


def remove_dead(graph: fx.Graph) -> None:
    """Dead-code elimination that also drops metadata asserts on otherwise dead values."""
    changed = True
    while changed:
        changed = False
        for node in reversed(list(graph.nodes)):
            if _removable(node):
                graph.erase_node(node)
                changed = True


def finish(gm: fx.GraphModule) -> None:
    """Clean up after rewrites: dead code, lint, recompile."""
    remove_dead(gm.graph)
    gm.graph.lint()
    gm.recompile()


def sync_signature_names(graph: fx.Graph, signature, module_call_graph) -> None:
    """Point an export signature at the nodes the graph now has.

    A rewrite may replace the node an output reads (a state written back, a loop's output),
    and copying a graph may rename a placeholder whose name shadows a builtin (``input``).
    """
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    outputs = next(n for n in graph.nodes if n.op == "output").args[0]
    renames = {}
    pairs = list(zip(signature.input_specs, placeholders)) + list(
        zip(signature.output_specs, outputs))
    for spec, node in pairs:
        if isinstance(node, fx.Node) and hasattr(spec.arg, "name") and spec.arg.name != node.name:
            renames[spec.arg.name] = node.name
            spec.arg.name = node.name
    for entry in module_call_graph:
        if entry.signature is not None:
            for arg in entry.signature.inputs + entry.signature.outputs:
                if getattr(arg, "name", None) in renames:
                    arg.name = renames[arg.name]
