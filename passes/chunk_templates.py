"""Templates of transformers' chunked gated-delta rules, traced at the shapes of a candidate.

The chunked form is ~900 nodes whose structure depends on the sequence length (one block per
chunk) and on the chunk size (an unrolled forward substitution), so it is not written as a
pattern: the rule reads a candidate's shapes from the graph, calls transformers' own function
(imported, never copied) at those shapes, traces it the way the graph was traced, and compares.

A template is cut to the algorithm proper. Its inputs are what the function pads (prepared q,
k, v, beta and gate, head-major f32) and the initial state after ``.to()``; its outputs are the
head-major [B, H, T, Dv] output before the final transpose, and the final state. The prologue
and epilogue (repeat, transposes, casts, l2norm, q scale) stay with the operand peeler.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch
from torch import fx

from gdn_fx.errors import InternalError
from gdn_fx.passes.evaluator import rel
from gdn_fx.passes.match import Pattern
from gdn_fx.passes.result import NoMatch
from gdn_fx.passes.rule_kinds import DeltaKind, kind_named
from gdn_fx.reference import recurrent_delta_rule_reference

ATEN = torch.ops.aten
PADS = (ATEN.pad.default, ATEN.constant_pad_nd.default)
INPUTS = ("q", "k", "v", "g", "beta")


def _installed(kind: DeltaKind) -> Callable:
    """The first of the family's places (module, function) the installed transformers has."""
    import importlib

    for module, name in kind.chunk_places:
        try:
            return getattr(importlib.import_module(f"transformers.models.{module}"), name)
        except (ImportError, AttributeError):
            continue
    raise NoMatch(f"the installed transformers has no chunked {kind.label} rule to compare with "
                  f"(looked in {', '.join(m for m, _ in kind.chunk_places)})")


# Whether the installed chunked rule scales q itself after the pad (inside the cut template)
# differs across families and versions: ``template_scale`` measures it.


@dataclass(frozen=True)
class ChunkShape:
    """What a template is traced at."""

    kind: str  # a name in rule_kinds.KINDS ("gdn": gate [B, T, H]; "kda": [B, T, H, Dk])
    batch: int
    heads: int
    length: int
    dk: int
    dv: int
    chunk: int

    def __post_init__(self):
        kind_named(self.kind)  # an unknown family is an error here, not another's shapes

    @property
    def family(self) -> DeltaKind:
        return kind_named(self.kind)

    def example(self) -> tuple:
        b, h, t = self.batch, self.heads, self.length
        gate = self.family.gate_shape(b, t, h, self.dk)
        return (torch.randn(b, t, h, self.dk), torch.randn(b, t, h, self.dk),
                torch.randn(b, t, h, self.dv), -torch.rand(gate), torch.rand(b, t, h),
                torch.randn(b, h, self.dk, self.dv))


class _Rule(torch.nn.Module):
    def __init__(self, fn: Callable, chunk: int):
        super().__init__()
        self.fn, self.chunk = fn, chunk

    def forward(self, q, k, v, g, beta, s0):
        return self.fn(q, k, v, g, beta, chunk_size=self.chunk, initial_state=s0,
                       output_final_state=True, use_qk_l2norm_in_kernel=False)


# A template is ~900 traced nodes per (shape, form); a model has a few shapes (one per layer
# kind), so a handful of entries covers it and a long-running process does not grow.
TEMPLATE_CACHE = 16


@functools.lru_cache(maxsize=TEMPLATE_CACHE)
def chunk_template(shape: ChunkShape, form: str) -> Pattern:
    """The template for ``shape``, traced in ``form`` ("training", "functional" or "core")."""
    fn = _installed(shape.family)
    ep = torch.export.export(_Rule(fn, shape.chunk), shape.example())
    if form == "functional":
        ep = ep.run_decompositions({})
    elif form == "core":
        ep = ep.run_decompositions()
    graph = ep.graph_module.graph
    outputs = _cut(graph)
    return Pattern(f"chunk_{shape.kind}", graph, outputs, anchor="out")


@functools.lru_cache(maxsize=TEMPLATE_CACHE)
def template_scale(shape: ChunkShape) -> float:
    """The factor the cut template applies to q itself, measured by running it: 1.0 (the
    function scales q before padding, in the prologue) or Dk ** -0.5 (after padding: KDA, and
    GDN in transformers 5.10). Raises NoMatch when the template computes neither."""
    graph = chunk_template(shape, "training").graph
    module = fx.GraphModule(torch.nn.Module(), graph)
    generator = torch.Generator().manual_seed(0)
    q, k, v, g, beta, s0 = _probe(shape, generator)
    out, final = module(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                        g.transpose(1, 2), beta.transpose(1, 2), s0)
    errors = {}
    for scale in (1.0, shape.dk ** -0.5):
        want, want_final = recurrent_delta_rule_reference(
            q.double(), k.double(), v.double(), g.double(), beta.double(), scale=scale,
            initial_state=s0.double())
        errors[scale] = max(rel(out.transpose(1, 2).double(), want),
                            rel(final.double(), want_final))
    scale, error = min(errors.items(), key=lambda item: item[1])
    if error > 1e-4:
        raise NoMatch(f"the installed transformers' {shape.family.label} chunk rule does not "
                      "compute the delta rule at any q scale (relative errors "
                      f"{sorted(errors.values())})")
    return scale


def _probe(shape: ChunkShape, generator: torch.Generator) -> tuple:
    """Time-major inputs on which the delta rule is well conditioned (unit-norm keys)."""
    b, h, t, dk, dv = shape.batch, shape.heads, shape.length, shape.dk, shape.dv
    gate = shape.family.gate_shape(b, t, h, dk)

    def unit(*dims):
        x = torch.randn(*dims, generator=generator)
        return x / x.norm(dim=-1, keepdim=True)

    return (unit(b, t, h, dk), unit(b, t, h, dk), torch.randn(b, t, h, dv, generator=generator),
            -0.5 * torch.rand(gate, generator=generator), torch.rand(b, t, h, generator=generator),
            torch.randn(b, h, dk, dv, generator=generator))


def _cut(graph: fx.Graph) -> dict:
    """Replace the prologue by placeholders and end at the head-major output; return outputs."""
    originals = [n for n in graph.nodes if n.op == "placeholder"]
    first = originals[0]
    for name, original in zip(INPUTS, originals):
        pad = _first_pad(original)
        with graph.inserting_before(first):
            cut = graph.placeholder(name)
        cut.meta = dict(pad.args[0].meta)
        pad.replace_input_with(pad.args[0], cut)
    with graph.inserting_before(first):
        state = graph.placeholder("state")
    state_in = _state_value(originals[-1])
    state.meta = dict(state_in.meta)
    state_in.replace_all_uses_with(state)
    output = next(n for n in graph.nodes if n.op == "output")
    out, final = output.args[0]
    head_major = _before_transpose(out)
    output.args = ((head_major, final),)
    _drop_dead(graph, originals)
    return {"out": head_major, "state": final}


def _first_pad(placeholder: fx.Node) -> fx.Node:
    """The pad an input reaches through its prologue (a chain of single-purpose nodes)."""
    seen, todo = set(), [placeholder]
    while todo:
        node = todo.pop(0)
        for user in node.users:
            if user.target in PADS:
                return user
            if user not in seen:
                seen.add(user)
                todo.append(user)
    raise InternalError(f"template input {placeholder.name} reaches no pad")


def _state_value(placeholder: fx.Node) -> fx.Node:
    """The initial state as the algorithm reads it: after ``.to()`` when that is a node."""
    readers = [u for u in placeholder.users if u.target is not ATEN._assert_tensor_metadata.default]
    aliases = (ATEN.to.device, ATEN.to.dtype, ATEN._to_copy.default, ATEN.alias.default)
    if len(readers) == 1 and readers[0].target in aliases:
        return readers[0]
    return placeholder


def _before_transpose(node: fx.Node) -> fx.Node:
    """The head-major value under the epilogue's casts and transpose back to [B, T, H, Dv]."""
    while node.target not in (ATEN.transpose.int, ATEN.permute.default):
        node = node.args[0]
    return node.args[0]


def _drop_dead(graph: fx.Graph, originals: list) -> None:
    """Remove the cut-off prologue/epilogue: dead pure nodes and the asserts on them."""
    changed = True
    while changed:
        changed = False
        for node in reversed(graph.nodes):
            dead_assert = node.target is ATEN._assert_tensor_metadata.default and all(
                u.target is ATEN._assert_tensor_metadata.default for u in node.args[0].users) \
                and node.args[0].op != "placeholder"
            if node.op == "call_function" and not node.users and (dead_assert
                                                                   or not node.is_impure()):
                graph.erase_node(node)
                changed = True
    for node in originals:
        for user in list(node.users):  # asserts on the original inputs
            graph.erase_node(user)
        if node.op == "placeholder" and not node.users:
            graph.erase_node(node)
