"""Turn an ExportedProgram or GraphModule into a plain module torch-to-nnef can trace.

torch-to-nnef traces with ``torch.jit.trace``; ``ep.module()`` can not be traced as it is (its
train()/eval() overrides raise, its forward goes through pytree specs and a guard submodule).
So the graph is copied into a fresh ``GraphModule``: positional tensor inputs, a flat tuple
of outputs, parameters and buffers as attributes, no guard call. The caller's program is
never modified. Example inputs for the trace are made from the placeholders' ``meta["val"]``.
"""

from __future__ import annotations

from typing import Union

import torch
import torch.fx as fx

from gdn_fx.errors import DTypeError, UnsupportedProgram
from gdn_fx.lowering.facts import static_dim

Program = Union[torch.export.ExportedProgram, fx.GraphModule]


def source_module(program: Program) -> fx.GraphModule:
    """The module whose graph holds the program's nodes (parameters as attributes).

    An ExportedProgram with in-place ops (torch.export's training IR) is functionalized first:
    torch.jit.trace, which torch-to-nnef uses, keeps the value from before an in-place write
    through a view for later readers, so such a graph would export silently wrong. The fused
    gdn_fx ops survive functionalization (they have no decomposition).
    """
    if isinstance(program, torch.export.ExportedProgram):
        if _writes_in_place(program.graph_module.graph):
            program = program.run_decompositions({})
        return program.module()
    if isinstance(program, fx.GraphModule):
        return program
    raise UnsupportedProgram(f"expected a torch.export.ExportedProgram or torch.fx.GraphModule, "
                             f"got {type(program).__name__}")


def _writes_in_place(graph: fx.Graph) -> bool:
    return any(getattr(n.target, "_schema", None) is not None and n.target._schema.is_mutable
               for n in graph.nodes if n.op == "call_function")


def float_attention_masks(module: fx.GraphModule) -> int:
    """Turn boolean SDPA masks into additive float masks (0 / -inf) in the query's dtype.

    tract 0.23.9 compiles scaled_dot_product_attention into its flash kernel, which refuses a
    boolean mask ("Mask must be floating point") at into_runnable(); transformers passes boolean
    masks. The additive mask means the same. Returns how many masks were converted.
    """
    count = 0
    for node in list(module.graph.nodes):
        mask = _sdpa_mask(node)
        if mask is None or mask.meta["val"].dtype != torch.bool:
            continue
        query_dtype = node.args[0].meta["val"].dtype
        with module.graph.inserting_before(node):
            additive = module.graph.call_function(
                torch.ops.aten.where.Scalar, (mask, 0.0, float("-inf")))
            additive = module.graph.call_function(
                torch.ops.aten._to_copy.default, (additive,), {"dtype": query_dtype})
        additive.meta["val"] = torch.empty_like(mask.meta["val"], dtype=query_dtype)
        node.replace_input_with(mask, additive)
        count += 1
    if count:
        module.recompile()
    return count


# Ops functionalization emits that torch-to-nnef has no handler for, and the op that means the
# same for a traced graph.
RESPELL = {torch.ops.aten._unsafe_view.default: torch.ops.aten.reshape.default}


def respell(module: fx.GraphModule) -> int:
    """Replace ops torch-to-nnef lacks by equivalent ones it has (see RESPELL)."""
    count = 0
    for node in module.graph.nodes:
        if node.target in RESPELL:
            node.target = RESPELL[node.target]
            count += 1
    if count:
        module.recompile()
    return count


def sorted_topk(module: fx.GraphModule) -> int:
    """Ask every topk for sorted results: torch-to-nnef exports only sorted topk.

    ``sorted=False`` leaves the order unspecified, so sorted order is one valid answer
    (MoE routers, e.g. Kimi-Linear's, ask for unsorted top-k and then sum over the picks).
    """
    count = 0
    for node in module.graph.nodes:
        if node.target is torch.ops.aten.topk.default:
            args = list(node.args) + [None] * (6 - len(node.args))
            if args[4] is False or node.kwargs.get("sorted") is False:
                node.args = tuple(node.args[:4]) + (True,) if len(node.args) > 4 else node.args
                node.kwargs = {**node.kwargs, "sorted": True} if "sorted" in node.kwargs \
                    else node.kwargs
                count += 1
    if count:
        module.recompile()
    return count


def scatter_values_as_tensors(module: fx.GraphModule) -> int:
    """Spell ``scatter(x, dim, index, value)`` (a scalar value) as a scatter of a tensor
    ``full_like(index, value)`` in x's dtype (``mask.scatter_(1, idx, 1)``).

    torch-to-nnef hands the scalar straight to tract's scatter_elements as its updates; tract
    0.23.9 indexes the updates by the index's coordinates and PANICS (aborting the process) on
    a rank-0 updates tensor. torch casts the value to x's dtype anyway.
    """
    count = 0
    for node in list(module.graph.nodes):
        if node.target is not torch.ops.aten.scatter.value:
            continue
        base, dim, index, value = node.args[:4]
        dtype = base.meta["val"].dtype
        with module.graph.inserting_before(node):
            # full_like(index, value, dtype=...) would be re-run by torch-to-nnef without its
            # dtype: cast the index first, so the filled tensor inherits the dtype.
            typed = module.graph.call_function(torch.ops.aten._to_copy.default, (index,),
                                               {"dtype": dtype})
            src = module.graph.call_function(torch.ops.aten.full_like.default, (typed, value))
        typed.meta["val"] = torch.empty_like(index.meta["val"], dtype=dtype)
        src.meta["val"] = typed.meta["val"]
        node.target, node.args = torch.ops.aten.scatter.src, (base, dim, index, src)
        count += 1
    if count:
        module.recompile()
    return count


# Factories whose dtype= torch-to-nnef's tracer drops when it evaluates them (it keeps only the
# size, or the like-tensor), mapped to the dtype it then produces.
_SIZED = {torch.ops.aten.ones.default, torch.ops.aten.zeros.default, torch.ops.aten.full.default}
_LIKE = {torch.ops.aten.ones_like.default, torch.ops.aten.zeros_like.default}
_EXACT_IN_F32 = 2 ** 24  # integers up to here survive a float32 round trip


def _traced_dtype(node: fx.Node) -> torch.dtype:
    """The dtype torch-to-nnef's tracer gives a factory node (it ignores ``dtype=``)."""
    if node.target in _LIKE:
        return node.args[0].meta["val"].dtype
    return torch.float32  # ones/zeros default, and full once its fill is made a float


def _fill_is_exact(node: fx.Node) -> bool:
    if node.target is not torch.ops.aten.full.default:
        return True
    value = node.args[1]
    return isinstance(value, (bool, float)) or abs(value) <= _EXACT_IN_F32


def typed_factories(module: fx.GraphModule) -> int:
    """Build constants of an explicit dtype (``torch.ones(..., dtype=torch.bool)``,
    ``torch.zeros(..., dtype=torch.int32)``) in the dtype torch-to-nnef's tracer assumes,
    then convert them.

    torch-to-nnef evaluates factories at trace time WITHOUT their ``dtype=`` argument, so the
    traced value has another dtype than the graph says and the next op fails (glm5_next's
    default attention mask: ``running aten.bitwise_not(args=(tensor([[[1.]]]),))``, its
    indexer's int32 ``scatter_add`` base); ``aten::full`` with a bool fill does not even trace.
    The conversion (``ne(x, 0)`` for bool, a cast otherwise) gives the same tensor.
    """
    count = 0
    for node in list(module.graph.nodes):
        dtype = node.kwargs.get("dtype") if node.op == "call_function" else None
        if node.target not in _SIZED | _LIKE or dtype is None or not _fill_is_exact(node):
            continue
        if dtype == _traced_dtype(node):
            continue
        _retype_factory(module.graph, node, dtype)
        count += 1
    if count:
        module.recompile()
    return count


def _retype_factory(graph: fx.Graph, node: fx.Node, dtype: torch.dtype) -> None:
    """Make ``node`` produce its traced dtype, and convert its users' view back to ``dtype``."""
    kwargs = dict(node.kwargs)
    if node.target in _LIKE:
        del kwargs["dtype"]
    else:
        kwargs["dtype"] = torch.float32
    if node.target is torch.ops.aten.full.default:
        node.args = (node.args[0], float(node.args[1]), *node.args[2:])
    node.kwargs = kwargs
    with graph.inserting_after(node):
        if dtype == torch.bool:
            converted = graph.call_function(torch.ops.aten.ne.Scalar, (node, 0))
        else:
            converted = graph.call_function(torch.ops.aten._to_copy.default, (node,),
                                            {"dtype": dtype})
    converted.meta["val"] = node.meta["val"]
    node.meta["val"] = torch.empty_like(node.meta["val"], dtype=_traced_dtype(node))
    node.replace_all_uses_with(converted, delete_user_cb=lambda user: user is not converted)


# Ops with a dim operand (position 1) that torch-to-nnef passes to tract as is.
_DIM_OPS = {torch.ops.aten.scatter.src, torch.ops.aten.scatter.value,
            torch.ops.aten.scatter_add.default, torch.ops.aten.scatter_reduce.two,
            torch.ops.aten.gather.default}


def positive_scatter_dims(module: fx.GraphModule) -> int:
    """Write scatter/gather dims as non-negative axes.

    tract 0.23.9's scatter_elements takes ``axis = -1`` as an index (usize wrap-around) and
    PANICS, aborting the process (glm5_next's indexer: ``scatter_add(zeros, -1, ...)``).
    """
    count = 0
    for node in module.graph.nodes:
        if node.target in _DIM_OPS and isinstance(node.args[1], int) and node.args[1] < 0:
            rank = node.args[0].meta["val"].dim()
            node.args = (node.args[0], node.args[1] % rank, *node.args[2:])
            count += 1
    if count:
        module.recompile()
    return count


def positive_select_indices(module: fx.GraphModule) -> int:
    """Write ``select(x, dim, -i)`` over a static axis as ``select(x, dim, size - i)``.

    torch-to-nnef writes select as a slice ending at ``index + 1``: for index -1 that is
    ``end = 0``, which tract reads as an empty range (not "to the end"); glm5_next's indexer
    reads ``keys[..., -1]``.
    """
    count = 0
    for node in module.graph.nodes:
        if node.target is not torch.ops.aten.select.int or node.args[2] >= 0:
            continue
        size = static_dim(node.args[0].meta["val"].shape[node.args[1]])
        if size is not None:
            node.args = (node.args[0], node.args[1], node.args[2] % size)
            count += 1
    if count:
        module.recompile()
    return count


# Ops torch-to-nnef writes as an NNEF reshape (expand is tile + reshape).
_RESHAPES = {torch.ops.aten.view.default, torch.ops.aten.reshape.default,
             torch.ops.aten._unsafe_view.default, torch.ops.aten.expand.default}


def _is_static_empty(node: fx.Node) -> bool:
    val = node.meta.get("val")
    if node.target not in _RESHAPES or not isinstance(val, torch.Tensor):
        return False
    shape = [static_dim(d) for d in val.shape]
    return None not in shape and 0 in shape


def _orphans_an_input(node: fx.Node) -> bool:
    """Whether removing ``node`` (and what only it reads) leaves a program input unread:
    torch.jit.trace drops unread inputs, and the NNEF would take fewer inputs than the
    program."""
    dead, todo = {node}, [node]
    while todo:
        for source in todo.pop().all_input_nodes:
            if source in dead or not all(user in dead for user in source.users):
                continue
            if source.op == "placeholder":
                return True
            dead.add(source)
            todo.append(source)
    return False


def empty_reshapes_as_constants(module: fx.GraphModule) -> int:
    """Replace each reshape to a static shape with a zero-size axis by a ``zeros`` constant.

    An empty tensor is defined by its shape and dtype alone. torch-to-nnef writes the reshape
    literally (``reshape(x, shape = [1, 1, 1, 0])``) and NNEF reads a 0 in a reshape shape as
    "copy this input axis": tract 0.23.9 then panics (aborting the process) or copies the
    wrong axis. glm5_next's MLA attention caches zero-width values.
    """
    count = 0
    for node in list(module.graph.nodes):
        if not _is_static_empty(node) or _orphans_an_input(node):
            continue
        val = node.meta["val"]
        with module.graph.inserting_before(node):
            empty = module.graph.call_function(torch.ops.aten.zeros.default, (list(val.shape),),
                                               {"dtype": val.dtype})
        empty.meta["val"] = val
        node.replace_all_uses_with(empty)
        count += 1
    if count:
        module.graph.eliminate_dead_code()
        module.recompile()
    return count


def unit_step_slice_scatters(module: fx.GraphModule) -> int:
    """Spell each slice_scatter with a step > 1 as a cat of unit-step slices.

    Functionalized models write strided slices (Qwen3.5's mRoPE: ``f[..., 1:33:3] = ...``) and
    torch-to-nnef only exports slice_scatter with step 1. Position by position, the result takes
    the source where the strided slice lands and the base elsewhere; sizes here are static and
    small (a rotary half-width). Returns how many were rewritten.
    """
    count = 0
    for node in list(module.graph.nodes):
        if node.target is not torch.ops.aten.slice_scatter.default or _step(node) == 1:
            continue
        with module.graph.inserting_before(node):
            pieces = _strided_pieces(module.graph, node)
            cat = module.graph.call_function(torch.ops.aten.cat.default,
                                             (pieces, _scatter_dim(node)))
        cat.meta["val"] = node.meta["val"]
        node.replace_all_uses_with(cat)
        module.graph.erase_node(node)
        count += 1
    if count:
        module.recompile()
    return count


def _step(node: fx.Node) -> int:
    return node.args[5] if len(node.args) > 5 else node.kwargs.get("step", 1)


def _scatter_dim(node: fx.Node) -> int:
    dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
    return dim % node.meta["val"].dim()


def _strided_pieces(graph: fx.Graph, node: fx.Node) -> list:
    base, src = node.args[0], node.args[1]
    dim, size = _scatter_dim(node), node.meta["val"].shape[_scatter_dim(node)]
    start = node.args[3] if len(node.args) > 3 and node.args[3] is not None else 0
    end = node.args[4] if len(node.args) > 4 and node.args[4] is not None else size
    written = {p: i for i, p in enumerate(range(*slice(start, end, _step(node)).indices(size)))}
    pieces = []
    for position in range(size):
        source, at = (src, written[position]) if position in written else (base, position)
        piece = graph.call_function(torch.ops.aten.slice.Tensor, (source, dim, at, at + 1, 1))
        piece.meta["val"] = source.meta["val"].narrow(dim, at, 1)
        pieces.append(piece)
    return pieces


def _sdpa_mask(node: fx.Node):
    if node.target is not torch.ops.aten.scaled_dot_product_attention.default:
        return None
    mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
    return mask if isinstance(mask, fx.Node) else None


def _is_guard(node: fx.Node) -> bool:
    return node.op == "call_module" and node.target == "_guards_fn" and not node.users


def traceable_module(program: Program) -> fx.GraphModule:
    """A fresh, plain GraphModule computing the program (see the module docstring)."""
    source = source_module(program)
    graph = fx.Graph()
    result = graph.graph_copy(source.graph, {})
    graph.output(result)
    for node in [n for n in graph.nodes if _is_guard(n)]:
        graph.erase_node(node)
    # A fresh GraphModule copies only what the graph references from ``source``: not the
    # train()/eval() overrides ep.module() installs.
    return fx.GraphModule(source, graph)


def input_names(module: fx.GraphModule) -> list[str]:
    """The placeholder names, in call order."""
    return [n.name for n in module.graph.nodes if n.op == "placeholder"]


def _example(node: fx.Node, generator: torch.Generator) -> torch.Tensor:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        raise UnsupportedProgram(f"input '{node.name}' has no meta['val'] tensor; export the "
                                 "program with torch.export so its inputs carry shapes")
    shape = [static_dim(d) for d in val.shape]
    if None in shape:  # a symbolic extent without a constant: take its trace-time hint
        shape = [int(d.node.hint) if isinstance(d, torch.SymInt) else int(d) for d in val.shape]
    if val.dtype.is_floating_point:
        return (0.5 * torch.randn(shape, generator=generator)).to(val.dtype)
    return torch.zeros(shape, dtype=val.dtype)


def example_inputs(module: fx.GraphModule, seed: int = 0) -> tuple:
    """One tensor per placeholder, shaped and typed as its meta['val'] (values are arbitrary)."""
    generator = torch.Generator().manual_seed(seed)
    return tuple(_example(n, generator) for n in module.graph.nodes if n.op == "placeholder")


def refuse_bfloat16(module: fx.GraphModule) -> None:
    """Neither torch-to-nnef nor tract has bfloat16: fail early, naming the first such node."""
    for node in module.graph.nodes:
        vals = node.meta.get("val")
        for val in vals if isinstance(vals, (tuple, list)) else [vals]:
            if isinstance(val, torch.Tensor) and val.dtype == torch.bfloat16:
                raise DTypeError(f"node '{node.name}' produces a bfloat16 tensor "
                                 f"{list(val.shape)}; torch-to-nnef and tract have no bfloat16: "
                                 "cast the model to float16 or float32 before export")


# Each rewrites what torch-to-nnef or tract 0.23.9 can not take into what means the same.
FIXES = (empty_reshapes_as_constants, typed_factories, positive_select_indices, positive_scatter_dims, float_attention_masks, unit_step_slice_scatters, respell, sorted_topk,
         scatter_values_as_tensors)


def apply_fixes(module: fx.GraphModule) -> dict:
    """Run every fix in FIXES; return how many nodes each one changed (non-zero only)."""
    counts = {fix.__name__: fix(module) for fix in FIXES}
    return {name: n for name, n in counts.items() if n}
