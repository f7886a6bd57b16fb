"""Bridge ops: how a fused gdn_fx node reaches torch-to-nnef with its lowering decision.

torch-to-nnef hands only ``t2n_extra::<name>`` custom ops to registered handlers, so before
tracing every ``gdn_fx`` node is swapped for a call to a bridge op that computes the same thing
and carries the chosen candidate as a string argument:

    t2n_extra::gdn_fx_gated_delta_scan(q, k, v, g, beta, initial_state, scale, qk_l2norm,
                                       candidate) -> (out, final_state)
    t2n_extra::gdn_fx_causal_conv1d_update(x, conv_state, weight, bias, activation,
                                           candidate) -> (out, new_state)
    t2n_extra::gdn_fx_gated_linear_scan(q, k, v, g, initial_state, scale,
                                        candidate) -> (out, final_state)

``candidate`` names a table entry, or ``"auto"`` to let the handler decide from the traced
tensors (for models that call the bridge ops directly). The names carry a ``gdn_fx_`` prefix so
they never meet torch-to-nnef's own ``gated_delta_scan`` handler.
"""

from __future__ import annotations

from typing import Mapping, Optional

import torch
import torch.fx as fx
from torch import Tensor

from gdn_fx.lowering.fx_nodes import (CONV_TARGET, LINEAR_TARGET, SCAN_TARGET,
                                      bound_arguments, fused_nodes)
from gdn_fx.lowering.node_facts import LINEAR_OPERANDS

SCAN_BRIDGE = "gdn_fx_gated_delta_scan"
CONV_BRIDGE = "gdn_fx_causal_conv1d_update"
LINEAR_BRIDGE = "gdn_fx_gated_linear_scan"
AUTO = "auto"


@torch.library.custom_op(f"t2n_extra::{SCAN_BRIDGE}", mutates_args=())
def scan_bridge(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor,
                scale: float, qk_l2norm: bool, candidate: str) -> tuple[Tensor, Tensor]:
    """gdn_fx::gated_delta_scan, tagged with the lowering candidate for torch-to-nnef."""
    return SCAN_TARGET(q, k, v, g, beta, initial_state, scale=scale, qk_l2norm=qk_l2norm)


@scan_bridge.register_fake
def _(q, k, v, g, beta, initial_state, scale, qk_l2norm, candidate):
    return SCAN_TARGET(q, k, v, g, beta, initial_state, scale=scale, qk_l2norm=qk_l2norm)


@torch.library.custom_op(f"t2n_extra::{CONV_BRIDGE}", mutates_args=())
def conv_bridge(x: Tensor, conv_state: Tensor, weight: Tensor, bias: Optional[Tensor],
                activation: Optional[str], candidate: str) -> tuple[Tensor, Tensor]:
    """gdn_fx::causal_conv1d_update, tagged with the lowering candidate for torch-to-nnef."""
    return CONV_TARGET(x, conv_state, weight, bias, activation)


@conv_bridge.register_fake
def _(x, conv_state, weight, bias, activation, candidate):
    return CONV_TARGET(x, conv_state, weight, bias, activation)


@torch.library.custom_op(f"t2n_extra::{LINEAR_BRIDGE}", mutates_args=())
def linear_bridge(q: Tensor, k: Tensor, v: Tensor, g: Tensor, initial_state: Tensor,
                  scale: float, candidate: str) -> tuple[Tensor, Tensor]:
    """gdn_fx::gated_linear_scan, tagged with the lowering candidate for torch-to-nnef."""
    return LINEAR_TARGET(q, k, v, g, initial_state, scale=scale)


@linear_bridge.register_fake
def _(q, k, v, g, initial_state, scale, candidate):
    return LINEAR_TARGET(q, k, v, g, initial_state, scale=scale)


def _bridge_call(node: fx.Node, candidate: str) -> tuple:
    """(bridge op, positional args) replacing one fused node."""
    args = bound_arguments(node)
    if node.target is LINEAR_TARGET:
        values = [args[n] for n in LINEAR_OPERANDS] + [float(args["scale"]), candidate]
        return torch.ops.t2n_extra.gdn_fx_gated_linear_scan.default, tuple(values)
    if node.target is SCAN_TARGET:
        names = ("q", "k", "v", "g", "beta", "initial_state")
        values = [args[n] for n in names] + [float(args["scale"]), bool(args["qk_l2norm"])]
        return torch.ops.t2n_extra.gdn_fx_gated_delta_scan.default, tuple(values + [candidate])
    names = ("x", "conv_state", "weight", "bias", "activation")
    values = [args.get(n) for n in names]
    return torch.ops.t2n_extra.gdn_fx_causal_conv1d_update.default, tuple(values + [candidate])


def to_bridge(gm: fx.GraphModule, candidates: Mapping[str, str]) -> fx.GraphModule:
    """Swap, IN PLACE, each fused node of ``gm`` for its bridge op carrying its candidate.

    ``candidates`` maps fused node names to candidate names; a node it omits gets ``"auto"``.
    Returns ``gm`` (recompiled).
    """
    graph = gm.graph
    for node in fused_nodes(graph):
        target, args = _bridge_call(node, candidates.get(node.name, AUTO))
        with graph.inserting_after(node):
            bridged = graph.call_function(target, args)
        bridged.meta.update(node.meta)
        node.replace_all_uses_with(bridged)
        graph.erase_node(node)
    graph.lint()
    gm.recompile()
    return gm
