"""Read fused gdn_fx nodes in an fx graph: find them, bind their arguments, build their facts.

Operands are checked against the op contract here, so a malformed node fails with an error
naming the node and the operand before anything is traced or written.
"""

from __future__ import annotations

from typing import Any, Union

import torch
import torch.fx as fx

from gdn_fx import ops
from gdn_fx.errors import DTypeError, LoweringUnsupported, ShapeError, UnsupportedProgram
from gdn_fx.lowering.node_facts import (CONV_OPERANDS, LINEAR_OPERANDS, SCAN_OPERANDS,
                                        ConvFacts, LinearFacts, ScanFacts, dtype_name,
                                        static_dim)

SCAN_TARGET = torch.ops.gdn_fx.gated_delta_scan.default
CONV_TARGET = torch.ops.gdn_fx.causal_conv1d_update.default
LINEAR_TARGET = torch.ops.gdn_fx.gated_linear_scan.default
FUSED_TARGETS = {SCAN_TARGET: "gated_delta_scan", CONV_TARGET: "causal_conv1d_update",
                 LINEAR_TARGET: "gated_linear_scan"}
FactsOf = Union[ScanFacts, LinearFacts, ConvFacts]


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


def fused_nodes(graph: fx.Graph) -> list[fx.Node]:
    """Every fused gdn_fx call (``FUSED_TARGETS``) in the graph, in graph order."""
    return [n for n in graph.nodes if n.op == "call_function" and n.target in FUSED_TARGETS]


def bound_arguments(node: fx.Node) -> dict[str, Any]:
    """The node's arguments by schema name, whether passed positionally or by keyword."""
    names = [arg.name for arg in node.target._schema.arguments]
    bound = dict(zip(names, node.args))
    bound.update(node.kwargs)
    return bound


def _value(node: fx.Node, operand: str, arg) -> Any:
    """The fake tensor recorded for one operand (None stays None)."""
    if arg is None:
        return None
    if not isinstance(arg, fx.Node):
        raise UnsupportedProgram(f"node '{node.name}': operand '{operand}' is a literal "
                                 f"{type(arg).__name__}, expected a tensor-producing node")
    val = arg.meta.get("val")
    if not isinstance(val, torch.Tensor):
        raise UnsupportedProgram(f"node '{node.name}': operand '{operand}' (from node "
                                 f"'{arg.name}') has no meta['val'] tensor; export the program "
                                 "with torch.export or propagate fake tensors first")
    return val


def _checked(node: fx.Node, check, *values) -> None:
    """Run an op-contract check, naming the node in any error it raises."""
    try:
        check(*values)
    except (ShapeError, DTypeError) as err:
        raise type(err)(f"node '{node.name}': {err}") from None
    except ValueError as err:  # an activation outside the contract: nothing can lower it
        raise LoweringUnsupported(f"node '{node.name}': {err}") from None


def _shape(val: torch.Tensor) -> tuple:
    return tuple(static_dim(d) for d in val.shape)


def scan_facts(node: fx.Node) -> ScanFacts:
    """Facts of a gated_delta_scan node, after checking its operands against the contract."""
    args = bound_arguments(node)
    vals = {name: _value(node, name, args[name]) for name in SCAN_OPERANDS}
    _checked(node, ops.check_scan_operands, *vals.values())
    return ScanFacts(
        node=node.name,
        shapes={name: _shape(val) for name, val in vals.items()},
        dtypes={name: dtype_name(val.dtype) for name, val in vals.items()},
        scale=float(args["scale"]),
        qk_l2norm=bool(args["qk_l2norm"]),
    )


def linear_facts(node: fx.Node) -> LinearFacts:
    """Facts of a gated_linear_scan node, after checking its operands against the contract."""
    args = bound_arguments(node)
    vals = {name: _value(node, name, args[name]) for name in LINEAR_OPERANDS}
    _checked(node, ops.check_linear_operands, *vals.values())
    return LinearFacts(
        node=node.name,
        shapes={name: _shape(val) for name, val in vals.items()},
        dtypes={name: dtype_name(val.dtype) for name, val in vals.items()},
        scale=float(args["scale"]),
    )


def conv_facts(node: fx.Node) -> ConvFacts:
    """Facts of a causal_conv1d_update node, after checking its operands against the contract."""
    args = bound_arguments(node)
    vals = {name: _value(node, name, args.get(name)) for name in CONV_OPERANDS}
    activation = args.get("activation")
    _checked(node, ops.check_conv_operands, *vals.values(), activation)
    present = {name: val for name, val in vals.items() if val is not None}
    return ConvFacts(
        node=node.name,
        shapes={name: _shape(val) for name, val in present.items()},
        dtypes={name: dtype_name(val.dtype) for name, val in present.items()},
        has_bias=vals["bias"] is not None,
        activation=activation,
    )


def node_facts(node: fx.Node) -> FactsOf:
    """Facts of any fused node."""
    if node.target is SCAN_TARGET:
        return scan_facts(node)
    if node.target is LINEAR_TARGET:
        return linear_facts(node)
    return conv_facts(node)
