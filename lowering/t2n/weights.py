"""How an export stores the program's weights: ``f32`` (as the program holds them), ``f16``,
``q4_0``. Applied to the plain GraphModule just before torch-to-nnef traces it
(``gdn_fx.lowering.write_nnef``); the caller's program is never modified.

- ``f32``: every parameter written in its own dtype (the default; nothing changes).
- ``f16``: every floating-point parameter not already in f16 is stored as f16; the
  arithmetic is the program's dtype on the weights rounded to f16 once. tract does NOT fold a
  cast of a variable at load: it runs on every call, and a matmul fed by it re-packs its
  weight every call (a 1024x4096 MLP at S = 1: 35-46 ms cast, 0.8 ms as stored; docs/FACTS.md).
  So each reader is routed: ``linear`` gets the weight as stored (``copy`` of the variable;
  tract multiplies f32 activations with f16 weights, packed once at load, bit for bit the
  f32 product of the rounded weights), an embedding gathers its rows from the f16 table
  and casts the rows, and the other readers (norms, biases, filters: small) a cast.
- ``q4_0``: every 2-D floating-point parameter that the program reads only as the weight of a
  matrix product over its last axis (``linear(x, W)``, ``matmul(x, W.t())``) or as a table
  an embedding gathers rows from (a tied lm_head is both: one Q4_0 table serves the two),
  and whose last axis is a multiple of 32 becomes torch-to-nnef's tract Q4_0 tensor
  (``fp_to_tract_q4_0_with_min_max_calibration``: groups of 32 consecutive weights along
  the last axis, one f16 scale per group, 4-bit codes; 18 bytes per 32 weights, 9/64 of
  f32). tract multiplies with the dequantized weights. Other parameters stay as they are.

Why here and not through torch-to-nnef's ``compress`` registry: ``min_max_q4_0`` walks
``nn.Linear`` modules, and an exported program has none (its weights are attributes read by
``aten.linear`` nodes); the registry's quantizer function is what is reused, per parameter.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.fx as fx

from gdn_fx.errors import UsageError
from gdn_fx.lowering.options import Q4_GROUP, check_format
from gdn_fx.lowering.t2n.placeholders import active as active_placeholders

aten = torch.ops.aten
LOG = logging.getLogger("gdn_fx.lowering")
# Ops that hand the matrix product's weight on unchanged or transposed (rank 2).
_TRANSPOSES = {aten.t.default, aten.transpose.int, aten.permute.default}
_PRODUCTS = {aten.matmul.default, aten.mm.default}


@dataclass
class WeightReport:
    """What a weight format did: the parameters it converted and those it left (with why)."""

    weights: str
    converted: list = field(default_factory=list)  # parameter names
    kept: dict = field(default_factory=dict)  # parameter name -> why it was left as it is

    def summary(self) -> str:
        """One line for the NNEF's properties and logs."""
        return f"{self.weights}: {len(self.converted)} converted, {len(self.kept)} kept"



def apply_weights(module: fx.GraphModule, weights: str) -> WeightReport:
    """Store ``module``'s parameters in format ``weights`` (in place; see the module doc)."""
    check_format(weights)
    report = WeightReport(weights)
    if weights == "f16":
        _as_f16(module, report)
    elif weights == "q4_0":
        _as_q4_0(module, report)
    if weights != "f32":
        LOG.info("weights %s (kept: %s)", report.summary(),
                 "; ".join(f"{k}: {v}" for k, v in list(report.kept.items())[:20]))
    return report


def _parameter(module: fx.GraphModule, node: fx.Node) -> Optional[torch.nn.Parameter]:
    if node.op != "get_attr":
        return None
    try:
        value = module.get_parameter(node.target)
    except AttributeError:  # a buffer or a plain constant
        return None
    return value if value.dtype.is_floating_point else None


def _set_attribute(module: fx.GraphModule, target: str, value) -> None:
    """Set ``module.<target>`` on the module's own copy of the path (GraphModule copies the
    submodule path of each attribute it references into fresh modules: the source program's
    modules are not touched)."""
    owner_path, _, name = target.rpartition(".")
    owner = module.get_submodule(owner_path) if owner_path else module
    if name in owner._parameters:
        owner._parameters[name] = value
    else:
        setattr(owner, name, value)


# --- f16 --------------------------------------------------------------------------------

# How an f16-stored weight reaches its readers: torch-to-nnef extension ops, not ``aten.to``:
# torch-to-nnef evaluates every op whose inputs are all constants at export and writes the
# result as one more variable (``<name>_weight_raw2d``), so the file would hold both copies.
# Each op therefore also takes one program input (``anchor``, never read): with a
# non-constant input torch-to-nnef leaves it an op, and its handler emits only what it names.
# In torch both are ``weight.to(dtype)``; in the NNEF:
# - "gdn_fx_stored_weight": ``tract_core_cast`` of the variable (norms, biases, filters);
# - "gdn_fx_matmul_weight": ``copy`` of the f16 variable, no cast (tract's matmul takes f16
#   weights as stored and packs them once at load).


def _weight_reader(name: str, nnef_op: str, to_dtype: bool) -> None:
    """Define ``t2n_extra::<name>(weight, anchor, dtype)`` and its torch-to-nnef handler,
    which writes ``nnef_op`` of the stored variable (with ``to`` = the read dtype when
    ``to_dtype``)."""
    from torch_to_nnef.dtypes import TORCH_DTYPE_TO_TRACT_STR
    from torch_to_nnef.op.extras import register

    @torch.library.custom_op(f"t2n_extra::{name}", mutates_args=())
    def read(weight: torch.Tensor, anchor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return weight.to(dtype)

    @read.register_fake
    def _(weight, anchor, dtype):
        return torch.empty_like(weight, dtype=dtype)

    @register(name)
    def handler(g, node, name_to_tensor, op_helper, inference_target, **kwargs):
        weight = op_helper.get_or_add_tensor_variable_in_nnef(node.inputs[0])
        attrs = {"to": TORCH_DTYPE_TO_TRACT_STR[node.outputs[0].dtype]} if to_dtype else {}
        op_helper.add_single_output_op_from_nnef_tensors(
            node, nnef_op, inputs=weight, attrs=attrs, maybe_cast_align_tract=False)
        return []


_weight_reader("gdn_fx_stored_weight", "tract_core_cast", to_dtype=True)
_weight_reader("gdn_fx_matmul_weight", "copy", to_dtype=False)


def _reader_kind(node: fx.Node, user: fx.Node) -> str:
    """How ``user`` reads the f16-stored ``node``: "matmul" (the weight of ``linear``, or its
    transpose read by matrix products only: tract takes it as stored), "gather" (rows of an
    embedding table: gathered in f16, the rows cast), or "cast" (anything else: the whole
    weight cast back where read)."""
    if user.target is aten.linear.default and user.args[1] is node and user.args[0] is not node:
        return "matmul"
    if user.target in _TRANSPOSES and _is_reduction_transpose(user) and user.users and all(
            u.target in _PRODUCTS and u.args[1] is user and u.args[0] is not user
            for u in user.users):
        return "matmul"  # x @ W.t(): a tied head's product, as transformers spells it
    if user.target is aten.embedding.default and user.args[0] is node and \
            node not in user.args[1:]:
        return "gather"
    return "cast"


def _as_f16(module: fx.GraphModule, report: WeightReport) -> None:
    """Each floating parameter stored f16; each reader routed by :func:`_reader_kind`: a cast
    of a whole weight runs on every call in tract (not folded at load), so only the small
    ones (norms, biases, conv filters) are read through one."""
    graph = module.graph
    anchor = next((n for n in graph.nodes if n.op == "placeholder" and n.users
                   and isinstance(n.meta.get("val"), torch.Tensor)), None)
    if anchor is None:
        raise UsageError("weights='f16' needs a program with at least one tensor input that "
                         "is read (the stored-weight casts hang on it)")
    for node in list(graph.nodes):
        param = _parameter(module, node)
        if param is None or param.dtype == torch.float16 or not node.users:
            continue
        if param.dtype == torch.float64:  # tract's f64 support is thin: not ours to change
            report.kept[node.target] = "float64"
            continue
        half = torch.nn.Parameter(_converted(param, torch.float16), requires_grad=False)
        _set_attribute(module, node.target, half)
        read = node.meta.get("val")
        node.meta["val"] = torch.empty(half.shape, dtype=half.dtype, device="meta")
        order = {n: i for i, n in enumerate(graph.nodes)}
        users = sorted(node.users, key=order.__getitem__)
        kinds = {user: _reader_kind(node, user) for user in users}
        for op, kind in ((torch.ops.t2n_extra.gdn_fx_matmul_weight.default, "matmul"),
                         (torch.ops.t2n_extra.gdn_fx_stored_weight.default, "cast")):
            readers = [u for u in users if kinds[u] == kind]
            if readers:
                with graph.inserting_before(readers[0]):  # after the anchor input, too
                    weight = graph.call_function(op, (node, anchor, param.dtype))
                weight.meta["val"] = read
                for reader in readers:
                    reader.replace_input_with(node, weight)
        for reader in (u for u in users if kinds[u] == "gather"):
            _cast_rows(graph, reader, param.dtype)
        report.converted.append(node.target)
    if report.converted:
        graph.lint()
        module.recompile()


def _cast_rows(graph: fx.Graph, gather: fx.Node, dtype: torch.dtype) -> None:
    """``embedding(W, ids)`` on the f16 table W, its rows cast to ``dtype`` (the cast commutes
    with the gather: the same values, and only the rows gathered are cast)."""
    rows = gather.meta.get("val")
    with graph.inserting_after(gather):
        cast = graph.call_function(aten.to.dtype, (gather, dtype))  # aten::to for jit.trace
    gather.replace_all_uses_with(cast, delete_user_cb=lambda user: user is not cast)
    cast.meta["val"] = rows
    if isinstance(rows, torch.Tensor):
        gather.meta["val"] = rows.to(torch.float16)


def _converted(param, to):
    """``param`` as ``to`` (a dtype, or a quantizer) stores it; a placeholder of a streamed
    export (t2n/placeholders.py) stays one, whose source the writer converts instead."""
    placeholders = active_placeholders()
    if placeholders is not None and placeholders.source(param.detach()) is not None:
        if isinstance(to, torch.dtype):
            return placeholders.as_dtype(param.detach(), to)
        return placeholders.quantized(param.detach())  # tract Q4_0, the one quantizer
    return param.detach().to(to) if isinstance(to, torch.dtype) else to(param.detach())


# --- q4_0 -------------------------------------------------------------------------------

def _is_reduction_transpose(node: fx.Node) -> bool:
    """A rank-2 transpose (``t``, ``transpose(0, 1)``, ``permute([1, 0])``)."""
    if node.target is aten.t.default:
        return True
    if node.target is aten.transpose.int:
        return sorted(d % 2 for d in node.args[1:3]) == [0, 1]
    return node.target is aten.permute.default and list(node.args[1]) == [1, 0]


def _weight_use(weight: fx.Node, user: fx.Node) -> Optional[str]:
    """Why ``user`` reading 2-D ``weight`` stops it from being Q4_0 (None: a product over
    the weight's last axis, or an embedding gather, which tract reads Q4_0 for too)."""
    if user.target is aten.linear.default and user.args[0] is not weight:
        return _permuted_merge(user.args[0])
    if user.target is aten.embedding.default and user.args[0] is weight and \
            weight not in user.args[1:]:
        return None  # tract gathers rows of a Q4_0 constant (torch-to-nnef: datum_type)
    if user.target in _TRANSPOSES and _is_reduction_transpose(user) and user.users and all(
            u.target in _PRODUCTS and u.args[1] is user and u.args[0] is not user
            for u in user.users):
        return next((why for why in map(_permuted_merge, (u.args[0] for u in user.users))
                     if why), None)
    return f"read by {user.target}"


_RESHAPES = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}


def _permuted_merge(x: fx.Node) -> Optional[str]:
    """Why a product of ``x`` cannot take a Q4_0 weight: ``x``'s last axis merges axes that
    a permutation just reordered among themselves. tract 0.23.9 pushes such a permutation
    into the weight, and with a Q4_0 weight computes a wrong product (docs/facts/tract.md,
    "A Q4_0 matmul after a permutation"). None when that is not what ``x`` is, or its shapes
    are not known."""
    merged = x
    while isinstance(merged, fx.Node) and merged.target in _RESHAPES | {aten.clone.default}:
        merged = merged.args[0]
    if merged is x or not isinstance(merged, fx.Node) or merged.target not in _TRANSPOSES:
        return None
    order = _permutation(merged)
    if order is None:
        return None
    try:
        width, sizes = int(x.meta["val"].shape[-1]), [int(n) for n in merged.meta["val"].shape]
    except (KeyError, AttributeError, TypeError, IndexError):  # symbolic or unknown sizes
        return None
    start, product = len(sizes), 1
    while start > 0 and product < width:
        start -= 1
        product *= sizes[start]
    moved = [axis for axis, size in zip(order[start:], sizes[start:]) if size > 1]
    if product != width or moved == sorted(moved):
        return None
    return f"its product's input merges axes permuted by {merged.name} (tract 0.23.9)"


def _permutation(node: fx.Node) -> Optional[list]:
    """The axis order a permute / transpose / t node produces, or None."""
    rank = len(node.meta["val"].shape) if "val" in node.meta else None
    if rank is None:
        return None
    if node.target is aten.permute.default:
        return [axis % rank for axis in node.args[1]]
    order = list(range(rank))
    if node.target is aten.t.default:
        return order[::-1]
    first, second = (axis % rank for axis in node.args[1:3])
    order[first], order[second] = order[second], order[first]
    return order


def _why_not_q4_0(module: fx.GraphModule, node: fx.Node, param) -> Optional[str]:
    """None when ``param`` (read by ``node``) can be stored Q4_0, else why not."""
    if param.dim() != 2:
        return f"rank {param.dim()}"
    if param.shape[-1] % Q4_GROUP:
        return f"last axis {param.shape[-1]} is not a multiple of {Q4_GROUP}"
    blocking = [why for why in (_weight_use(node, user) for user in node.users) if why]
    return blocking[0] if blocking else None


def _as_q4_0(module: fx.GraphModule, report: WeightReport) -> None:
    for node in list(module.graph.nodes):
        param = _parameter(module, node)
        if param is None or not node.users:
            continue
        reason = _why_not_q4_0(module, node, param)
        if reason is not None:
            report.kept[node.target] = reason
            continue
        _quantize_products(module, node, param)
        report.converted.append(node.target)
    module.graph.lint()
    module.recompile()


def _quantize_products(module: fx.GraphModule, node: fx.Node, param) -> None:
    """Store ``param`` as ONE Q4_0 tensor under its own name, which its gathers (an
    embedding table) and its products (a tied lm_head too) all read: tract gathers rows of a
    Q4_0 constant (torch-to-nnef writes the gather's ``datum_type``), and packs the products'
    copy itself. Each product as ``linear(x, W)``: torch-to-nnef 0.24.12 writes a transpose
    of a Q4_0 variable as the variable itself (``x @ W.t()`` came out with W's shape), so
    ``matmul(x, t(W))`` becomes ``linear(x, W)``."""
    from torch_to_nnef.tensor.quant import fp_to_tract_q4_0_with_min_max_calibration

    with torch.no_grad():
        quantized = _converted(param, fp_to_tract_q4_0_with_min_max_calibration)
    quantized.nnef_name = node.target
    _set_attribute(module, node.target, torch.nn.Parameter(quantized, requires_grad=False))
    for user in list(node.users):
        if user.target in (aten.linear.default, aten.embedding.default):
            continue
        for product in list(user.users):  # a transpose feeding matmul / mm as their rhs
            product.target, product.args = aten.linear.default, (product.args[0], node)
        module.graph.erase_node(user)
