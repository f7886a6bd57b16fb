"""A dense SwiGLU MLP as a two-expert ``tract_moe_ffn``: both CPU cores for one sequence.

tract 0.23.9 runs a matmul on one thread whatever its thread settings say; its fused MoE
operator ``tract_moe_ffn`` runs its experts on rayon's threads. The MLP
``y = Wd (silu(Wg x) * (Wu x))`` is therefore split along its hidden width H into E = 2 halves,
each one "expert"; a router of zeros gives both experts the same logit, so ``softmax_topk``
with k = 2 weighs each by exactly 1/2, and each down half is stored times 2 (exact: a power of
two):

    y = 1/2 (2 Wd_a) h_a + 1/2 (2 Wd_b) h_b = Wd_a h_a + Wd_b h_b = Wd h

the MLP's own sum over H, added in two parts (a summation order, nothing else). Measured on
one Qwen3.5-0.8B-sized MLP (D 1024, H 3584, f32, this 2-core VM, 2026-12-07): with rayon's two
threads 1 token 2.10 -> 1.54 ms, 16 tokens 6.44 -> 4.00 ms, 128 tokens 39.0 -> 17.7 ms; on one
thread level (2.31 / 2.37 ms, 34.1 / 33.1 ms). docs/FACTS.md has the NNEF that measured it.

Opt-in (``choose={"dense_mlp": "tract_moe_ffn"}`` of every export route), CPU runtime, f32 weights (the expert stacks are 3-D: the f16 and Q4_0 formats store them
otherwise, not measured). Found by structure: three bias-free ``linear`` of constant weights
and a ``silu`` and a ``mul`` between them, each intermediate read by the next node only; with
weights in memory the rewrite is also checked on random tokens before it is committed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Mapping, Optional

import torch
import torch.fx as fx
from torch import Tensor

from gdn_fx.errors import UsageError
from gdn_fx.lowering.t2n.moe_ffn import MIN_VERSION, OP, moe_ffn_reference
from gdn_fx.lowering.t2n.placeholders import active as active_placeholders
from gdn_fx.lowering.t2n.placeholders import resolve as resolve_placeholder

LOG = logging.getLogger("gdn_fx.lowering")
aten = torch.ops.aten

CHOICE_KEY = "dense_mlp"
EXPERTS, PLAIN = "tract_moe_ffn", "plain"
DEFAULT = PLAIN
HALVES = 2
GATE = "softmax_topk"
BOUND = 1e-5  # relative, f32: the same products summed in two parts


def split_choice(choose: Optional[Mapping]) -> tuple[str, Optional[Mapping]]:
    """(dense MLP lowering, the rest of ``choose`` for the lowering table)."""
    if not isinstance(choose, Mapping) or CHOICE_KEY not in choose:
        return DEFAULT, choose
    value = choose[CHOICE_KEY]
    if value not in (EXPERTS, PLAIN):
        raise UsageError(f"choose[{CHOICE_KEY!r}] must be {EXPERTS!r} or {PLAIN!r}, "
                         f"got {value!r}")
    return value, {key: v for key, v in choose.items() if key != CHOICE_KEY}


def refused(target, weights: str) -> Optional[str]:
    """Why dense MLPs stay plain for this target and weight format (None: they need not)."""
    if not target.at_least(MIN_VERSION):
        return f"tract {target.version_text} has no {OP} (first in {MIN_VERSION})"
    if getattr(target, "runtime", "cpu") != "cpu":
        return f"{OP} measured on tract's CPU runtime only"
    if weights != "f32":
        return f"weights={weights!r}: the expert stacks are measured in f32 only"
    return None


# --- finding the MLP by structure -------------------------------------------------------------

@dataclass
class Mlp:
    x: fx.Node
    gate: fx.Node  # linear(x, Wg)
    up: fx.Node  # linear(x, Wu)
    act: fx.Node  # silu(gate)
    product: fx.Node  # act * up
    down: fx.Node  # linear(product, Wd)


def _linear(node, source=None) -> Optional[tuple]:
    """(input, weight node) of a bias-free ``linear`` of a constant weight, else None."""
    if not (isinstance(node, fx.Node) and node.target is aten.linear.default):
        return None
    args = list(node.args) + [None] * (3 - len(node.args))
    x, weight, bias = args[:3]
    if bias is not None or node.kwargs.get("bias") is not None:
        return None
    if not (isinstance(weight, fx.Node) and weight.op == "get_attr"):
        return None
    if source is not None and x is not source:
        return None
    return x, weight


def _only_user(node: fx.Node, user: fx.Node) -> bool:
    return list(node.users) == [user]


def _read(down: fx.Node) -> Optional[Mlp]:
    found = _linear(down)
    if found is None or not isinstance(found[0], fx.Node):
        return None
    product = found[0]
    if product.target is not aten.mul.Tensor or len(product.args) != 2:
        return None
    for act, up in (product.args, product.args[::-1]):
        if not (isinstance(act, fx.Node) and act.target is aten.silu.default):
            continue
        gate = act.args[0]
        gate_read, up_read = _linear(gate), _linear(up)
        if gate_read is None or up_read is None or gate_read[0] is not up_read[0]:
            continue
        mlp = Mlp(gate_read[0], gate, up, act, product, down)
        if all(_only_user(a, b) for a, b in ((gate, act), (act, product), (up, product),
                                             (product, down))):
            return mlp
    return None


def find_mlps(graph: fx.Graph) -> list[Mlp]:
    return [m for m in map(_read, graph.nodes) if m is not None]


# --- the experts ------------------------------------------------------------------------------

def _weight(module: fx.GraphModule, node: fx.Node) -> Tensor:
    value = module
    for part in node.target.split("."):
        value = getattr(value, part)
    return value


def _shapes_fit(mlp: Mlp, module) -> Optional[str]:
    wg, wu, wd = (_weight(module, n.args[1]) for n in (mlp.gate, mlp.up, mlp.down))
    hidden, width = wg.shape
    if wg.dim() != 2 or wu.shape != wg.shape or tuple(wd.shape) != (width, hidden):
        return f"weights {tuple(wg.shape)}, {tuple(wu.shape)}, {tuple(wd.shape)}"
    if hidden % HALVES:
        return f"hidden width {hidden} is not a multiple of {HALVES}"
    if len({wg.dtype, wu.dtype, wd.dtype}) != 1 or not wg.dtype.is_floating_point:
        return f"weight dtypes {wg.dtype}, {wu.dtype}, {wd.dtype}"
    return None


def experts(wg: Tensor, wu: Tensor, wd: Tensor) -> dict[str, Tensor]:
    """``tract_moe_ffn``'s operands (canonical layout: w1, w3 [E, D, H/E], w2 [E, H/E, D]) of
    the MLP with gate, up and down weights ``wg``, ``wu`` [H, D] and ``wd`` [D, H]."""
    hidden, width = wg.shape
    part = hidden // HALVES
    halves = lambda w: w.reshape(HALVES, part, width).transpose(1, 2)  # noqa: E731
    return {"wg": torch.zeros(HALVES, width, dtype=wg.dtype),
            "w1": halves(wg).contiguous(),
            "w2": (wd.t().reshape(HALVES, part, width) * HALVES).contiguous(),
            "w3": halves(wu).contiguous()}


def _operands(module: fx.GraphModule, mlp: Mlp, index: int) -> dict[str, Tensor]:
    """The operands, computed now; in a streamed export each derived stack is a placeholder
    whose source computes it from the stored weights when the writer writes it."""
    nodes = [n.args[1] for n in (mlp.gate, mlp.up, mlp.down)]
    weights = [_weight(module, n) for n in nodes]
    placeholders = active_placeholders()
    if placeholders is None or all(placeholders.source(w) is None for w in weights):
        return experts(*weights)
    like = experts(*(torch.empty(w.shape, dtype=w.dtype, device="meta") for w in weights))
    operands = {"wg": torch.zeros(like["wg"].shape, dtype=like["wg"].dtype)}
    for name in ("w1", "w2", "w3"):
        def load(name=name) -> Tensor:
            with torch.no_grad():
                return experts(*(resolve_placeholder(w) for w in weights))[name]
        operands[name] = placeholders.make(f"gdn_fx_mlp{index}.{name}", like[name].shape,
                                           like[name].dtype, load)
    return operands


def _checked(module: fx.GraphModule, mlp: Mlp, operands: dict) -> Optional[str]:
    """Why the experts do not compute the MLP on random tokens (None: they do). Skipped for
    placeholders: their values are not in memory (the structure and the identity above)."""
    placeholders = active_placeholders()
    if placeholders is not None and placeholders.source(operands["w1"]) is not None:
        return None
    wg, wu, wd = (_weight(module, n.args[1]) for n in (mlp.gate, mlp.up, mlp.down))
    tokens = torch.randn(3, wg.shape[1], generator=torch.Generator().manual_seed(0),
                         dtype=wg.dtype)
    with torch.no_grad():
        linear = torch.nn.functional.linear
        want = linear(torch.nn.functional.silu(linear(tokens, wg)) * linear(tokens, wu), wd)
        got = moe_ffn_reference(tokens, **operands, k=HALVES, gate=GATE)
    error = float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))
    return None if error <= BOUND else f"differs by {error:.2e} relative (bound {BOUND})"


def _attribute(module: fx.GraphModule, name: str, value: Tensor) -> fx.Node:
    setattr(module, name, torch.nn.Parameter(value, requires_grad=False))
    node = module.graph.get_attr(name)
    node.meta["val"] = torch.empty(value.shape, dtype=value.dtype, device="meta")
    return node


def _fuse(module: fx.GraphModule, mlp: Mlp, operands: dict, index: int) -> None:
    graph = module.graph
    with graph.inserting_before(mlp.down):
        nodes = [_attribute(module, f"gdn_fx_mlp{index}_{name}", operands[name])
                 for name in ("wg", "w1", "w2", "w3")]
        fused = graph.call_function(torch.ops.t2n_extra.gdn_fx_moe_ffn.default,
                                    (mlp.x, *nodes, HALVES, GATE))
    fused.meta["val"] = mlp.down.meta.get("val")
    mlp.down.replace_all_uses_with(fused)
    weights = [n.args[1] for n in (mlp.gate, mlp.up, mlp.down)]
    for node in (mlp.down, mlp.product, mlp.act, mlp.up, mlp.gate, *weights):
        if not node.users:
            graph.erase_node(node)


def fuse_dense_mlps(module: fx.GraphModule, target, weights: str) -> int:
    """Replace, in place, every dense SwiGLU MLP by a two-expert ``tract_moe_ffn``; how many.
    One that does not fit or check out stays plain (logged why)."""
    why = refused(target, weights)
    found = find_mlps(module.graph)
    if why is not None:
        if found:
            LOG.info("%d dense MLPs left as plain ops: %s", len(found), why)
        return 0
    count = 0
    for mlp in found:
        why = _shapes_fit(mlp, module)
        operands = _operands(module, mlp, count) if why is None else None
        why = why or _checked(module, mlp, operands)
        if why is not None:
            LOG.info("dense MLP at %s left as plain ops: %s", mlp.down.name, why)
            continue
        _fuse(module, mlp, operands, count)
        count += 1
    if count:
        module.graph.lint()
        module.recompile()
    return count
