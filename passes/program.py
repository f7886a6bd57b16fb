"""Program plumbing shared by the rules: unwrap, node metadata, dead code, signature sync."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterable, Optional

import sympy
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


def hint(size: Any) -> Optional[int]:
    """A size as an int: a symbolic one at the value it was traced at (None when it has
    none: a size that depends on data)."""
    if isinstance(size, int):
        return size
    if isinstance(size, torch.SymInt):
        return size.node.hint if isinstance(size.node.hint, int) else None
    return None


def static_int(size: Any) -> Optional[int]:
    """A size that is one number: an int, or a SymInt whose expression is a constant
    (make_fx's symbolic tracing keeps a size it specialized as such); None otherwise."""
    if type(size) is int:
        return size
    expr = size_expr(size)
    return int(expr) if expr is not None and expr.is_Integer else None


def same_size(a: Any, b: Any) -> bool:
    """Two sizes (ints, SymInts, or nodes holding them) known equal, compared by their
    expressions: never by ``==`` on a SymInt, which would record a guard in the program's
    shape environment (and, at an equal hint, replace one symbol by the other)."""
    a, b = (val(x) if isinstance(x, fx.Node) else x for x in (a, b))
    if type(a) is int and type(b) is int:
        return a == b
    x, y = size_expr(a), size_expr(b)
    if x is None or y is None:
        return False
    return x == y or sympy.expand(x - y) == 0


def size_expr(size: Any) -> Optional[sympy.Expr]:
    """A size's expression (an int's Integer), its symbols as the shape environment now
    names them; None for anything else."""
    if type(size) is int:
        return sympy.Integer(size)
    if isinstance(size, torch.SymInt):
        node = size.node
        return node.shape_env.replace(node.expr) if node.shape_env is not None else node.expr
    return None


def same_sizes(a, b) -> bool:
    """Two shapes known equal, size by size (``same_size``)."""
    return a is not None and b is not None and len(a) == len(b) and \
        all(x is y or same_size(x, y) for x, y in zip(a, b))


BIG = 2 ** 62  # a slice's end at or past this is "to the end" (torch writes 2^63 - 1)


def full_slice(node: Any) -> bool:
    """``x[:, :]`` along one axis: a slice from 0 to the end with step 1, which torch.export
    writes before a position read along another axis when sizes are symbolic."""
    if not isinstance(node, fx.Node) or node.target is not ATEN.slice.Tensor:
        return False
    args = list(node.args) + [0, None, None, 1][len(node.args) - 1:]
    _, axis, start, end, step = args[:5]
    dims = shape(args[0])
    if step != 1 or start not in (0, None) or dims is None or not isinstance(axis, int):
        return False
    if end is None or (type(end) is int and end >= BIG):
        return True
    size = dims[axis]
    return (type(end) is int and type(size) is int and end >= size) or \
        (isinstance(end, fx.Node) and same_size(end, size))


def unsliced(node: Any) -> Any:
    """``node`` without the full slices (``full_slice``) on top of it."""
    while full_slice(node):
        node = node.args[0]
    return node


# Copies that keep a literal tensor's value (torch.export lifts ``torch.tensor([t])`` in a
# module into a constant read through lift_fresh_copy and detach_).
LITERAL_COPIES = frozenset({ATEN.lift_fresh_copy.default, ATEN.detach_.default,
                            ATEN.detach.default, ATEN.clone.default, ATEN.alias.default})
LITERAL = "gdn_fx_literal"  # meta key: a constant input's value (passes/__init__._planned)


def literal(node: Any) -> Optional[torch.Tensor]:
    """The value of a literal tensor: a module's attribute, a constant torch.export lifted
    (its fake value keeps it in the training IR; the passes record it otherwise), through
    copies that keep it; None for anything computed."""
    while isinstance(node, fx.Node):
        value = node.meta.get(LITERAL, getattr(node.meta.get("val"), "constant", None))
        if isinstance(value, torch.Tensor):
            return value
        if node.op == "get_attr" and node.graph.owning_module is not None:
            found = attribute(node.graph.owning_module, node.target)
            return found if isinstance(found, torch.Tensor) else None
        if node.op != "call_function" or node.target not in LITERAL_COPIES:
            return None
        node = node.args[0]
    return None


def attribute(owner: Any, path: str) -> Any:
    """``owner``'s attribute at a dotted ``path`` (None where one is missing)."""
    for name in path.split("."):
        owner = getattr(owner, name, None)
    return owner


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


def no_guards(mode: FakeTensorMode):
    """A context in which fake kernels on symbolic sizes record no guard in the program's
    shape environment (a rewrite must not narrow the sizes the program was traced for)."""
    env = getattr(mode, "shape_env", None)
    return env.suppress_guards() if env is not None else contextlib.nullcontext()


def guards_paused(graph: fx.Graph):
    """``no_guards`` for the shape environment of ``graph``'s inputs (read off its
    placeholders: no walk over an unrolled graph): whatever a rule compares of its
    symbolic sizes is then evaluated at the traced sizes and leaves the program's sizes
    as they were."""
    for node in graph.find_nodes(op="placeholder"):
        value = node.meta.get("val")
        if isinstance(value, FakeTensor) and value.fake_mode.shape_env is not None:
            return no_guards(value.fake_mode)
    return contextlib.nullcontext()


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


def has_dead(graph: fx.Graph) -> bool:
    """Whether ``graph`` computes a value nothing reads (make_fx keeps the ``detach`` of each
    parameter that requires grad: a reader outside a loop that is no reader)."""
    return any(_removable(node) for node in graph.nodes)


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
