"""Graph fixes applied before torch-to-nnef traces a program (``apply_fixes``).

Each fix rewrites, in the plain GraphModule export_nnef traces, something torch-to-nnef
0.24.12 or tract 0.23.9 can not take (or takes silently wrong, or panics on: a tract panic
aborts the whole Python process) into something that means the same. Each returns how many
nodes it changed. A refusal raises instead, when no rewrite can keep the meaning.

Fixes run on every export (not only transformers models); each one is a no-op on a graph
without the construct it fixes.
"""

from __future__ import annotations

import functools
import operator
from typing import Callable, Optional

import torch
import torch.fx as fx

from gdn_fx.errors import ExportRefused
from gdn_fx.lowering.node_facts import static_dim
from gdn_fx.lowering.t2n.moe import grouped_mm_as_plain_ops
from gdn_fx.lowering.t2n.noop_scatters import noop_scatters
from gdn_fx.lowering.t2n.traced_sizes import traced_arange
from gdn_fx.lowering.t2n.traced_sizes import dynamic_slice

aten = torch.ops.aten
Fix = Callable[[fx.GraphModule], int]


def _recompiles(fix: Fix) -> Fix:
    """Recompile the module after a fix that changed something."""

    @functools.wraps(fix)
    def run(module: fx.GraphModule) -> int:
        count = fix(module)
        if count:
            module.graph.lint()
            module.recompile()
        return count

    return run


def _val(node) -> torch.Tensor:
    return node.meta["val"]


# --- reshapes and indices ----------------------------------------------------------------

# Ops torch-to-nnef writes as an NNEF reshape (expand is tile + reshape).
_RESHAPES = {aten.view.default, aten.reshape.default, aten._unsafe_view.default,
             aten.expand.default}


def _is_static_empty_reshape(node: fx.Node) -> bool:
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


@_recompiles
def empty_reshapes_as_constants(module: fx.GraphModule) -> int:
    """Replace each reshape to a static shape with a zero-size axis by a ``zeros`` constant.

    An empty tensor is defined by its shape and dtype alone. torch-to-nnef writes the reshape
    literally (``reshape(x, shape = [1, 1, 1, 0])``) and NNEF reads a 0 in a reshape shape as
    "copy this input axis": tract 0.23.9 then panics or copies the wrong axis. glm5_next's MLA
    attention caches zero-width values.
    """
    count = 0
    for node in list(module.graph.nodes):
        if not _is_static_empty_reshape(node) or _orphans_an_input(node):
            continue
        with module.graph.inserting_before(node):
            empty = module.graph.call_function(aten.zeros.default, (list(_val(node).shape),),
                                               {"dtype": _val(node).dtype})
        empty.meta["val"] = _val(node)
        node.replace_all_uses_with(empty)
        count += 1
    if count:
        module.graph.eliminate_dead_code()
    return count


# Ops whose dim operand (position 1) torch-to-nnef passes to tract as it is.
_DIM_OPS = {aten.scatter.src, aten.scatter.value, aten.scatter_add.default,
            aten.scatter_reduce.two, aten.gather.default}


@_recompiles
def positive_scatter_dims(module: fx.GraphModule) -> int:
    """Write scatter/gather dims as non-negative axes.

    tract 0.23.9's scatter_elements takes ``axis = -1`` as an index (usize wrap-around) and
    panics (glm5_next's indexer: ``scatter_add(zeros, -1, ...)``).
    """
    count = 0
    for node in module.graph.nodes:
        if node.target in _DIM_OPS and isinstance(node.args[1], int) and node.args[1] < 0:
            node.args = (node.args[0], node.args[1] % _val(node.args[0]).dim(), *node.args[2:])
            count += 1
    return count


def refuse_boolean_mask_indexing(module: fx.GraphModule) -> int:
    """Refuse ``x[..., mask]`` (aten.index with a boolean index among several).

    Its output length depends on the mask's values; torch-to-nnef writes it as a gather
    reading the booleans as positions, which loads and runs silently wrong (glm5_next's
    sparse-attention indexer: ``pool_keys[:, keep]``). torch-to-nnef itself refuses the
    single-index form ``x[mask]``.
    """
    for node in module.graph.nodes:
        if node.target is not aten.index.Tensor or len(node.args[1]) < 2:
            continue
        for index in node.args[1]:
            val = index.meta.get("val") if isinstance(index, fx.Node) else None
            if isinstance(val, torch.Tensor) and val.dtype == torch.bool:
                raise ExportRefused(
                    f"node '{node.name}' indexes {list(_val(node.args[0]).shape)} with the "
                    f"boolean mask '{index.name}' {list(val.shape)}: its output "
                    "length depends on the mask's values, which NNEF can not express "
                    "(torch-to-nnef would write a gather reading the booleans as positions, "
                    "silently wrong)")
    return 0


# --- dtypes ------------------------------------------------------------------------------

# Factories whose ``dtype=`` torch-to-nnef's tracer drops when it evaluates them: it keeps
# only the size (ones/zeros: float32; full: the fill's type) or the like-tensor (its dtype).
# (torch.ones / torch.zeros: their spelling when the size is symbolic, see traced_sizes.py.)
_FULL = {aten.full.default, torch.full}
_SIZED = {aten.ones.default, aten.zeros.default, torch.ones, torch.zeros, *_FULL}
_LIKE = {aten.ones_like.default, aten.zeros_like.default}
_EXACT_IN_F32 = 2 ** 24  # integers up to here survive a float32 round trip


def _traced_dtype(node: fx.Node) -> Optional[torch.dtype]:
    """The dtype torch-to-nnef's tracer gives a factory (None: a bool fill does not trace)."""
    if node.target in _LIKE:
        return _val(node.args[0]).dtype
    if node.target in _FULL and isinstance(node.args[1], bool):
        return None
    if node.target in _FULL and isinstance(node.args[1], int):
        return torch.int64
    return torch.float32


def _fill_is_exact(node: fx.Node) -> bool:
    if node.target not in _FULL:
        return True
    value = node.args[1]
    return isinstance(value, (bool, float)) or abs(value) <= _EXACT_IN_F32


def _retype_factory(graph: fx.Graph, node: fx.Node, dtype: torch.dtype) -> None:
    """Make ``node`` build its traced dtype, and convert it to ``dtype`` for its users."""
    kwargs = dict(node.kwargs)
    if node.target in _LIKE:
        kwargs.pop("dtype", None)
    else:
        kwargs["dtype"] = torch.float32
    if node.target in _FULL:
        node.args = (node.args[0], float(node.args[1]), *node.args[2:])
    node.kwargs = kwargs
    with graph.inserting_after(node):
        if dtype == torch.bool:
            converted = graph.call_function(aten.ne.Scalar, (node, 0))
        else:
            converted = graph.call_function(aten._to_copy.default, (node,), {"dtype": dtype})
    converted.meta["val"] = _val(node)
    node.meta["val"] = torch.empty_like(_val(node), dtype=_traced_dtype(node))
    node.replace_all_uses_with(converted, delete_user_cb=lambda user: user is not converted)


@_recompiles
def typed_factories(module: fx.GraphModule) -> int:
    """Build constants of an explicit dtype (``torch.ones(..., dtype=torch.bool)``,
    ``torch.zeros(..., dtype=torch.int32)``) in the dtype torch-to-nnef's tracer assumes,
    then convert them.

    torch-to-nnef evaluates factories at trace time WITHOUT their ``dtype=``, so the traced
    value has another dtype than the graph says and the next op fails (glm5_next's default
    attention mask: ``running aten.bitwise_not(args=(tensor([[[1.]]]),))``; its indexer's int32
    scatter_add base); ``aten::full`` with a bool fill does not even trace. The conversion
    (``ne(x, 0)`` for bool, a cast otherwise) yields the same tensor.
    """
    count = 0
    for node in list(module.graph.nodes):
        if node.op != "call_function" or node.target not in _SIZED | _LIKE:
            continue
        if _fill_is_exact(node) and _val(node).dtype != _traced_dtype(node):
            _retype_factory(module.graph, node, _val(node).dtype)
            count += 1
    return count


def _sdpa_mask(node: fx.Node):
    if node.target is not aten.scaled_dot_product_attention.default:
        return None
    mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
    return mask if isinstance(mask, fx.Node) else None


@_recompiles
def float_attention_masks(module: fx.GraphModule) -> int:
    """Turn boolean SDPA masks into additive float masks (0 / the dtype's lowest) in the
    query's dtype.

    tract 0.23.9 compiles scaled_dot_product_attention into its flash kernel, which refuses a
    boolean mask ("Mask must be floating point") at into_runnable(); transformers passes
    boolean masks. The additive mask means the same for every row that sees a key (causal and
    sliding masks: each row sees itself). The lowest finite value, not -inf: with -inf the
    flash kernel returns NaN for a row whose first block of keys is all masked (a sliding
    window 160 tokens into a prefill, seen on lara_mini); transformers' eager masks use it too.
    """
    count = 0
    for node in list(module.graph.nodes):
        mask = _sdpa_mask(node)
        if mask is None or _val(mask).dtype != torch.bool:
            continue
        query_dtype = _val(node.args[0]).dtype
        with module.graph.inserting_before(node):
            lowest = torch.finfo(query_dtype).min
            additive = module.graph.call_function(aten.where.Scalar, (mask, 0.0, lowest))
            additive = module.graph.call_function(aten._to_copy.default, (additive,),
                                                  {"dtype": query_dtype})
        additive.meta["val"] = torch.empty_like(_val(mask), dtype=query_dtype)
        node.replace_input_with(mask, additive)
        count += 1
    return count


@_recompiles
def scatter_values_as_tensors(module: fx.GraphModule) -> int:
    """Spell ``scatter(x, dim, index, value)`` (a scalar value, ``mask.scatter_(1, idx, 1)``)
    as a scatter of the tensor ``full_like(index, value)`` in x's dtype.

    torch-to-nnef hands the scalar to tract's scatter_elements as its updates; tract 0.23.9
    indexes the updates by the index's coordinates and panics on a rank-0 updates tensor
    (Kimi-Linear's and Bailing's grouped MoE routers). torch casts the value to x's dtype.
    """
    count = 0
    for node in list(module.graph.nodes):
        if node.target is not aten.scatter.value:
            continue
        base, dim, index, value = node.args[:4]
        dtype = _val(base).dtype
        with module.graph.inserting_before(node):
            # Cast the index first so that full_like inherits the dtype: torch-to-nnef's
            # tracer drops full_like's own dtype= (see typed_factories).
            typed = module.graph.call_function(aten._to_copy.default, (index,),
                                               {"dtype": dtype})
            src = module.graph.call_function(aten.full_like.default, (typed, value))
        typed.meta["val"] = torch.empty_like(_val(index), dtype=dtype)
        src.meta["val"] = typed.meta["val"]
        node.target, node.args = aten.scatter.src, (base, dim, index, src)
        count += 1
    return count


@_recompiles
def precise_sigmoids(module: fx.GraphModule) -> int:
    """Write each f32/f64 ``sigmoid(x)`` as ``1 / (1 + exp(-x))``.

    tract 0.23.9's sigmoid is a fast approximation: up to 1% relative error in the negative
    tail (measured near x = -12, where sigmoid(x) ~ 7e-6). A decay gate built from a sigmoid
    (Bailing's KDA gate ``-5 * sigmoid(.)``) sums those errors over the tokens: a prefill of
    50 tokens came out 5e-5 away from eager (7e-7 with this fix). tract's exp and reciprocal
    are exact to f32 rounding. f16 sigmoids are left alone (exp(-x) overflows there).
    """
    count = 0
    for node in list(module.graph.nodes):
        if node.target is not aten.sigmoid.default:
            continue
        if _val(node).dtype not in (torch.float32, torch.float64):
            continue
        steps = ((aten.neg.default, ()), (aten.exp.default, ()), (aten.add.Scalar, (1.0,)),
                 (aten.reciprocal.default, ()))
        value = node.args[0]
        with module.graph.inserting_before(node):
            for op, extra in steps:
                value = module.graph.call_function(op, (value, *extra))
                value.meta["val"] = _val(node)
        node.replace_all_uses_with(value)
        module.graph.erase_node(node)
        count += 1
    return count


# --- ops torch-to-nnef lacks or limits ---------------------------------------------------

# Ops functionalization emits that torch-to-nnef has no handler for, and the op that means
# the same in a traced graph.
RESPELL = {aten._unsafe_view.default: aten.reshape.default}


@_recompiles
def respell(module: fx.GraphModule) -> int:
    """Replace ops torch-to-nnef lacks by equivalent ones it has (see RESPELL)."""
    count = 0
    for node in module.graph.nodes:
        if node.target in RESPELL:
            node.target = RESPELL[node.target]
            count += 1
    return count


@_recompiles
def sorted_topk(module: fx.GraphModule) -> int:
    """Ask every topk for sorted results: torch-to-nnef exports only sorted topk.

    ``sorted=False`` leaves the order unspecified, so sorted order is one valid answer (MoE
    routers, e.g. Kimi-Linear's, ask for unsorted top-k and then sum over the picks).
    """
    count = 0
    for node in module.graph.nodes:
        if node.target is not aten.topk.default:
            continue
        if len(node.args) > 4 and node.args[4] is False:
            node.args = (*node.args[:4], True)
            count += 1
        elif node.kwargs.get("sorted") is False:
            node.kwargs = {**node.kwargs, "sorted": True}
            count += 1
    return count


def _step(node: fx.Node) -> int:
    return node.args[5] if len(node.args) > 5 else node.kwargs.get("step", 1)


def _scatter_dim(node: fx.Node) -> int:
    dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
    return dim % _val(node).dim()


def _strided_pieces(graph: fx.Graph, node: fx.Node) -> list:
    base, src = node.args[0], node.args[1]
    dim = _scatter_dim(node)
    size = _val(node).shape[dim]
    start = node.args[3] if len(node.args) > 3 and node.args[3] is not None else 0
    end = node.args[4] if len(node.args) > 4 and node.args[4] is not None else size
    written = {p: i for i, p in enumerate(range(*slice(start, end, _step(node)).indices(size)))}
    pieces = []
    for position in range(size):
        source, at = (src, written[position]) if position in written else (base, position)
        piece = graph.call_function(aten.slice.Tensor, (source, dim, at, at + 1, 1))
        piece.meta["val"] = _val(source).narrow(dim, at, 1)
        pieces.append(piece)
    return pieces


@_recompiles
def unit_step_slice_scatters(module: fx.GraphModule) -> int:
    """Spell each slice_scatter with a step > 1 as a cat of unit-step slices.

    Functionalized models write strided slices (Qwen3.5's mRoPE: ``f[..., 1:33:3] = ...``)
    and torch-to-nnef only exports slice_scatter with step 1. Position by position, the
    result takes the source where the strided slice lands and the base elsewhere; sizes here
    are static and small (a rotary half-width).
    """
    count = 0
    for node in list(module.graph.nodes):
        if node.target is not aten.slice_scatter.default or _step(node) == 1:
            continue
        with module.graph.inserting_before(node):
            pieces = _strided_pieces(module.graph, node)
            cat = module.graph.call_function(aten.cat.default, (pieces, _scatter_dim(node)))
        cat.meta["val"] = _val(node)
        node.replace_all_uses_with(cat)
        module.graph.erase_node(node)
        count += 1
    return count


# --- tract miscompiles -----------------------------------------------------------------

_CONVS = {aten.convolution.default, aten.conv1d.default, aten.conv1d.padding}


@_recompiles
def reshaped_depthwise_filters(module: fx.GraphModule) -> int:
    """Give depthwise conv filters made by ``unsqueeze(w [C, K], 1)`` as ``reshape(w)``.

    tract 0.23.9 runs a static-shape depthwise conv whose filter is an unsqueezed constant with
    the wrong weights (channel c reads flat_w[c:c+K], docs/FACTS.md "tract 0.23.9: traps"):
    every causal conv that transformers writes ``weight.unsqueeze(1)`` and that was not
    collapsed (a cache-less prefill) would be silently wrong. A reshape to [C, 1, K] means the
    same and is compiled right.
    """
    count = 0
    for node in module.graph.nodes:
        weight = node.args[1] if node.target in _CONVS and len(node.args) > 1 else None
        if not isinstance(weight, fx.Node) or weight.target is not aten.unsqueeze.default:
            continue
        shape = list(_val(weight).shape)
        if len(shape) != 3 or shape[1] != 1 or weight.args[1] % 3 != 1:
            continue
        with module.graph.inserting_before(node):
            filters = module.graph.call_function(aten.reshape.default, (weight.args[0], shape))
        filters.meta["val"] = _val(weight)
        node.replace_input_with(weight, filters)
        count += 1
    return count


def attention_math(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                   scale=None, enable_gqa=False):
    """``softmax(q k^T * scale + mask) v``: what scaled_dot_product_attention computes (no
    dropout, no causal flag, no GQA: the fix below only takes such calls)."""
    factor = query.shape[-1] ** -0.5 if scale is None else scale
    weights = torch.matmul(query, key.transpose(-2, -1)) * factor
    if attn_mask is not None:
        weights = weights + attn_mask
    return torch.matmul(torch.softmax(weights, dim=-1), value)


@_recompiles
def static_query_attention_as_matmuls(module: fx.GraphModule) -> int:
    """An SDPA whose query length is static but whose key length is symbolic (a decode graph:
    one new token after P cached ones) is spelled as matmuls and a softmax: tract 0.23.9's
    flash kernel, which it picks for such a call, fails at run time for P > 0 with
    "IncompatibleShape" (P = 0 runs). With a symbolic query length it is not picked."""
    count = 0
    for node in module.graph.nodes:
        if node.target is not aten.scaled_dot_product_attention.default:
            continue
        query, key = _val(node.args[0]), _val(node.args[1])
        plain = (node.kwargs.get("dropout_p", 0.0) == 0.0 and not node.kwargs.get("is_causal")
                 and not node.kwargs.get("enable_gqa") and len(node.args) <= 4)
        if plain and static_dim(query.shape[-2]) is not None \
                and static_dim(key.shape[-2]) is None:
            node.target = attention_math
            count += 1
    return count


def _tied_linear_weight(node: fx.Node) -> Optional[fx.Node]:
    """The weight of a bias-free ``linear(h, W)`` whose W another node also reads."""
    if node.target is not aten.linear.default or len(node.args) > 2 and node.args[2] is not None:
        return None
    weight = node.args[1]
    shared = isinstance(weight, fx.Node) and weight.op == "get_attr" and len(weight.users) > 1
    return weight if shared and _val(node.args[0]).dim() >= 3 else None


@_recompiles
def tied_linears_as_matmuls(module: fx.GraphModule) -> int:
    """``linear(h, W)`` with a W that is also read elsewhere (an lm_head tied to the
    embedding) becomes ``matmul(h, W^T)`` on the 3-D hidden state.

    tract 0.23.9 folds (pre-packs) a constant matmul operand at load only when the constant
    has one consumer or is at most 4 MiB; a tied lm_head is read by the embedding gather too,
    so it was re-packed on every call (~500 ms a decode step for a 248k x 1024 f32 head).
    torch-to-nnef writes the matmul as transpose -> unsqueeze -> matmul, which gives the
    matmul a constant of its own, packed once."""
    count = 0
    for node in module.graph.nodes:
        weight = _tied_linear_weight(node)
        if weight is None:
            continue
        with module.graph.inserting_before(node):
            transposed = module.graph.call_function(aten.t.default, (weight,))
            transposed.meta["val"] = _val(weight).t()
        node.target, node.args = aten.matmul.default, (node.args[0], transposed)
        count += 1
    return count


SLICE_END = 2 ** 63 - 1  # what torch writes for "to the end"


@_recompiles
def explicit_slice_ends(module: fx.GraphModule) -> int:
    """``aten.slice(x, dim, start)`` with its end left out (torch.export writes ``x[..., -1:]``
    so once a size became static, e.g. a decode graph traced at S = 1) gets the end written
    out: under dynamic axes torch-to-nnef 0.24.12 emits the default end as a reference to a
    constant it never defines (``dyn_slice(.., end = c35)``), and tract refuses to load it."""
    count = 0
    for node in module.graph.nodes:
        if node.target is aten.slice.Tensor and 2 < len(node.args) < 4 and "end" not in \
                node.kwargs:
            node.args = (*node.args, SLICE_END)
            count += 1
    return count


# --- position compares ----------------------------------------------------------------------

_COMPARES = {aten.le.Tensor, aten.lt.Tensor, aten.ge.Tensor, aten.gt.Tensor}
# Ops a position tensor passes through unchanged in value, as aten writes them and as the
# traceable module spells them (t2n/traced_sizes.py: methods, dynamic_slice).
_SAME_VALUES = {aten.unsqueeze.default, aten.squeeze.dim, aten.slice.Tensor, aten.view.default,
                aten.reshape.default, aten.expand.default, aten.clone.default,
                aten.alias.default, dynamic_slice, "reshape", "expand", "view", "unsqueeze"}
_SUMS = {aten.add.Tensor, aten.sub.Tensor, operator.add, operator.sub}
_ARANGES = {aten.arange.default, aten.arange.start, aten.arange.start_step, traced_arange}
# Each symbol of an export with a position compare is declared to tract as at most this
# (write.py): positions, sums of at most two such extents (P + S), then stay below 2^24,
# exact in float32 (_EXACT_IN_F32).
POSITION_SYMBOL_MAX = 2 ** 22


def _bound(value) -> Optional[int]:
    """An upper bound on ``|value|`` (an int or a SymInt whose symbols are each at most
    POSITION_SYMBOL_MAX), None where none is known (a product of symbols, a division)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return abs(value)
    expr = getattr(getattr(value, "node", None), "expr", None)
    if expr is None or not expr.is_polynomial() or expr.as_poly() is None \
            or expr.as_poly().total_degree() > 1:
        return None
    poly = expr.as_poly()
    return sum(abs(int(c)) for c in poly.coeffs()) * POSITION_SYMBOL_MAX  # >= |expr|


def _position_bound(node) -> Optional[int]:
    """An upper bound on the values of the int64 tensor ``node`` where it is built from
    ``arange`` by adds of bounded scalars and value-preserving views (None: not a position
    tensor, or no bound known)."""
    if isinstance(node, (int, torch.SymInt)):
        return _bound(node)
    if not isinstance(node, fx.Node):
        return None
    if isinstance(node.meta.get("val"), (int, torch.SymInt)):  # a size read off a tensor
        return _bound(node.meta["val"])
    if not isinstance(node.meta.get("val"), torch.Tensor) or _val(node).dtype != torch.int64 \
            or node.op not in ("call_function", "call_method"):
        return None
    if node.target in _SUMS:
        bounds = [_position_bound(a) for a in node.args]
        return None if None in bounds or len(bounds) != 2 or node.kwargs else sum(bounds)
    if node.target in _SAME_VALUES:
        return _position_bound(node.args[0])
    if node.target in _ARANGES:  # values between start and end (start 0 unless given)
        bounds = [_position_bound(a) for a in node.args]
        return None if None in bounds or not bounds else max(bounds)
    return None


def _is_size(value) -> bool:
    """An int or a node whose value is a (symbolic) size."""
    if isinstance(value, fx.Node):
        value = value.meta.get("val")
    return isinstance(value, (int, torch.SymInt)) and not isinstance(value, bool)


@_recompiles
def ranges_with_offsets(module: fx.GraphModule) -> int:
    """Spell ``arange(n) + off`` (an int64 range plus a size: the positions of S new tokens
    after P cached ones) as ``arange(off, off + n)``: the same values, one op fewer.

    tract 0.23.9 computes a range of sizes as a tensor of dims (TDim), and adding a size to
    it stays one, element by element: ~0.4 ms per 512 positions on this CPU, 0.8-1 ms on the
    CPU under the CUDA runtime (docs/FACTS.md)."""
    count = 0
    for node in list(module.graph.nodes):
        if node.op != "call_function" or node.target not in (operator.add, aten.add.Tensor) \
                or node.kwargs or len(node.args) != 2:
            continue
        positions, offset = node.args
        if not (isinstance(positions, fx.Node) and positions.target is traced_arange
                and len(positions.args) == 1 and len(positions.users) == 1
                and _is_size(offset) and _val(positions).dtype == torch.int64
                and _val(node).dtype == torch.int64):
            continue
        size = positions.args[0]
        with module.graph.inserting_before(node):
            end = module.graph.call_function(operator.add, (offset, size))
            shifted = module.graph.call_function(traced_arange, (offset, end),
                                                 dict(positions.kwargs))
        end.meta["val"] = _size_value(offset) + _size_value(size)
        shifted.meta["val"] = _val(node)
        node.replace_all_uses_with(shifted)
        module.graph.erase_node(node)
        module.graph.erase_node(positions)
        count += 1
    return count


def _size_value(value):
    return value.meta["val"] if isinstance(value, fx.Node) else value


@_recompiles
def float_position_compares(module: fx.GraphModule) -> int:
    """Compare position tensors (int64 built from ``arange``, the causal mask's ``kv_idx <=
    q_idx``) in float32: both operands cast first, exact while every value is below 2^24,
    which the bound checked here and the symbol bounds write.py then declares keep.

    tract 0.23.9 compares int64 tensors in a generic loop: the mask of a 512-token prefill
    took 3.4 ms on this CPU (0.15 ms in float32) and 6.4 ms on the CPU under the CUDA runtime,
    which has no int64 compare (docs/FACTS.md)."""
    count = 0
    for node in list(module.graph.nodes):
        if node.op != "call_function" or node.target not in _COMPARES or node.kwargs:
            continue
        operands = node.args[:2]
        bounds = [_position_bound(a) for a in operands]
        if None in bounds or max(bounds) >= _EXACT_IN_F32 \
                or not all(isinstance(a, fx.Node) for a in operands):
            continue
        with module.graph.inserting_before(node):
            cast = [module.graph.call_function(aten._to_copy.default, (a,),
                                               {"dtype": torch.float32}) for a in operands]
        for new, old in zip(cast, operands):
            new.meta["val"] = torch.empty_like(_val(old), dtype=torch.float32)
        node.args = (*cast, *node.args[2:])
        count += 1
    return count


# In order: refusals first (fail before any work), then fixes that remove nodes, then the
# dtype fixes (typed_factories must also see the zeros empty_reshapes_as_constants makes).
FIXES: tuple[Fix, ...] = (
    refuse_boolean_mask_indexing, reshaped_depthwise_filters, empty_reshapes_as_constants,
    typed_factories,
    positive_scatter_dims, float_attention_masks,
    _recompiles(noop_scatters),  # t2n/noop_scatters.py: before the strided ones are spelled out
    unit_step_slice_scatters, respell, sorted_topk, scatter_values_as_tensors, precise_sigmoids,
    explicit_slice_ends, static_query_attention_as_matmuls, tied_linears_as_matmuls,
    grouped_mm_as_plain_ops,  # t2n/moe.py: transformers' default MoE kernel
    ranges_with_offsets, float_position_compares,  # in this order: the second reads ranges
)


def apply_fixes(module: fx.GraphModule) -> dict[str, int]:
    """Run every fix in FIXES on ``module`` (in place); return how many nodes each changed
    (non-zero counts only). Raises ExportRefused when a refusal finds its construct."""
    counts = {fix.__name__: fix(module) for fix in FIXES}
    return {name: n for name, n in counts.items() if n}
