"""torch-to-nnef handlers for the gdn_fx bridge ops (``t2n_extra::gdn_fx_*``).

Importing this module registers them; torch-to-nnef imports it itself through the
``torch_to_nnef.extras`` entry point when called with ``discover_extra_entrypoints=True``
(``gdn_fx.export_nnef`` loads it explicitly). A handler reads the node's NNEF operands, checks
the candidate the bridge op carries against the traced tensors once more (or decides when it
carries ``"auto"``), and lets the candidate's emitter write the NNEF.
"""

from __future__ import annotations

from typing import Optional

from torch_to_nnef.inference_target import TractNNEF
from torch_to_nnef.op.extras import register

from gdn_fx.errors import LoweringUnsupported
from gdn_fx.lowering.t2n.bridge import AUTO, CONV_BRIDGE, LINEAR_BRIDGE, SCAN_BRIDGE
from gdn_fx.lowering.node_facts import (CONV_OPERANDS, LINEAR_OPERANDS, SCAN_OPERANDS,
                                        ConvFacts, LinearFacts, ScanFacts)
from gdn_fx.lowering.nnef_emit import EmitContext, nnef_dtype_name
from gdn_fx.lowering.table import candidate, decide
from gdn_fx.lowering.target import as_target


def _constant(node_input):
    """A literal argument of the traced node (scale, flags, activation, candidate)."""
    return getattr(node_input, "data", None)


def _is_none(node_input) -> bool:
    return node_input is None or (not hasattr(node_input, "shape") and
                                  _constant(node_input) in (None, "none"))


def _operands(op_helper, node, names) -> dict:
    """The node's tensor operands as NNEF tensors (None for an absent optional bias)."""
    return {name: None if _is_none(inp) else op_helper.get_or_add_tensor_variable_in_nnef(inp)
            for name, inp in zip(names, node.inputs)}


def _shapes_dtypes(operands: dict) -> tuple[dict, dict]:
    present = {name: t for name, t in operands.items() if t is not None}
    return ({name: tuple(t.shape) for name, t in present.items()},
            {name: nnef_dtype_name(t) for name, t in present.items()})


def _scan_facts(label: str, operands: dict, literals: list) -> ScanFacts:
    shapes, dtypes = _shapes_dtypes(operands)
    return ScanFacts(node=label, shapes=shapes, dtypes=dtypes, scale=float(literals[0]),
                     qk_l2norm=bool(literals[1]))


def _linear_facts(label: str, operands: dict, literals: list) -> LinearFacts:
    shapes, dtypes = _shapes_dtypes(operands)
    return LinearFacts(node=label, shapes=shapes, dtypes=dtypes, scale=float(literals[0]))


def _conv_facts(label: str, operands: dict, literals: list) -> ConvFacts:
    shapes, dtypes = _shapes_dtypes(operands)
    activation: Optional[str] = literals[0]
    return ConvFacts(node=label, shapes=shapes, dtypes=dtypes,
                     has_bias=operands["bias"] is not None,
                     activation=None if activation in (None, "none") else activation)


def _lower(op: str, names: tuple, make_facts, g, node, name_to_tensor, op_helper,
           inference_target) -> list:
    if not isinstance(inference_target, TractNNEF):
        raise LoweringUnsupported(f"{node.kind}: gdn_fx lowers to tract only, "
                                  f"not {inference_target!r}")
    operands = _operands(op_helper, node, names)
    literals = [_constant(inp) for inp in node.inputs[len(names):]]
    outputs = (node.outputs[0].export_name, node.outputs[1].export_name)
    facts = make_facts(outputs[0], operands, literals[:-1])
    target = as_target(inference_target)
    name = literals[-1]
    if name == AUTO:
        name = decide(facts, target).candidate
    entry = candidate(op, name)
    reason = entry.check(facts, target)
    if reason is not None:  # the traced tensors disagree with what the fx graph promised
        raise LoweringUnsupported(f"{op} '{outputs[0]}': candidate {name} rejected at "
                                  f"emission: {reason}")
    return entry.emit(EmitContext(g, name_to_tensor, operands, outputs, facts))


@register(SCAN_BRIDGE)
def gdn_fx_gated_delta_scan(g, node, name_to_tensor, op_helper, inference_target,
                            **kwargs) -> list:
    """Lower ``t2n_extra::gdn_fx_gated_delta_scan`` with the candidate it carries."""
    return _lower("gated_delta_scan", SCAN_OPERANDS, _scan_facts, g, node, name_to_tensor,
                  op_helper, inference_target)


@register(CONV_BRIDGE)
def gdn_fx_causal_conv1d_update(g, node, name_to_tensor, op_helper, inference_target,
                                **kwargs) -> list:
    """Lower ``t2n_extra::gdn_fx_causal_conv1d_update`` with the candidate it carries."""
    return _lower("causal_conv1d_update", CONV_OPERANDS, _conv_facts, g, node, name_to_tensor,
                  op_helper, inference_target)


@register(LINEAR_BRIDGE)
def gdn_fx_gated_linear_scan(g, node, name_to_tensor, op_helper, inference_target,
                             **kwargs) -> list:
    """Lower ``t2n_extra::gdn_fx_gated_linear_scan`` with the candidate it carries."""
    return _lower("gated_linear_scan", LINEAR_OPERANDS, _linear_facts, g, node, name_to_tensor,
                  op_helper, inference_target)
