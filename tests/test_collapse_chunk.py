"""Collapse of transformers' chunked GDN / KDA rules (the prefill form) into one scan node."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.models.kimi_linear.modeling_kimi_linear import chunk_kimi_delta_attention
from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

import gdn_fx
from programs import assert_close_outputs, count_calls, export_form, fused_nodes, graph_of, run

ATEN = torch.ops.aten


class ChunkRule(torch.nn.Module):
    def __init__(self, kda=False, l2norm=True, given_state=True, final_state=True, chunk=64):
        super().__init__()
        self.kda, self.l2norm, self.given_state, self.final_state, self.chunk = (
            kda, l2norm, given_state, final_state, chunk)

    def forward(self, q, k, v, g, beta, s0):
        rule = chunk_kimi_delta_attention if self.kda else torch_chunk_gated_delta_rule
        return rule(q, k, v, g, beta, chunk_size=self.chunk,
                    initial_state=s0 if self.given_state else None,
                    output_final_state=self.final_state, use_qk_l2norm_in_kernel=self.l2norm)


def inputs(t, hk=2, groups=2, d=8, kda=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hv = hk * groups
    gate = -torch.rand(1, t, hv, *((d,) if kda else ()), generator=gen)
    return (torch.randn(1, t, hk, d, generator=gen), torch.randn(1, t, hk, d, generator=gen),
            torch.randn(1, t, hv, d, generator=gen), gate, torch.rand(1, t, hv, generator=gen),
            torch.randn(1, hv, d, d, generator=gen))


def collapse(module, args, form="training"):
    program = export_form(module, args, form)
    result = gdn_fx.collapse(program)
    assert result.counts["gated_delta_scan"] == 1, result.explain()
    assert_close_outputs(run(result.program, args), run(program, args), rtol=1e-5)
    return program, result


@pytest.mark.parametrize("t", [8, 70, 130])
def test_gdn_chunk_rule_collapses_at_one_and_many_chunks(t):
    program, result = collapse(ChunkRule(), inputs(t))
    assert count_calls(result.program) < 20 < count_calls(program) / 40
    (node,) = fused_nodes(result.program)
    assert [a.name for a in node.args] == ["q", "k", "v", "g", "beta", "s0"]
    assert node.kwargs == dict(scale=pytest.approx(8 ** -0.5), qk_l2norm=True)


@pytest.mark.parametrize("variant", [dict(l2norm=False), dict(given_state=False),
                                     dict(final_state=False), dict(chunk=4)])
def test_gdn_chunk_variants(variant):
    collapse(ChunkRule(**variant), inputs(9))


def test_gdn_chunk_without_gqa():
    collapse(ChunkRule(), inputs(9, hk=4, groups=1))


@pytest.mark.parametrize("t", [8, 70])
def test_kda_chunk_collapses(t):
    _, result = collapse(ChunkRule(kda=True), inputs(t, groups=1, kda=True))
    (node,) = fused_nodes(result.program)
    assert node.kwargs["scale"] == pytest.approx(8 ** -0.5)


@pytest.mark.parametrize("form", ["functional", "core"])
def test_decomposed_forms(form):
    collapse(ChunkRule(), inputs(8), form)


def _perturb_mask(graph):
    """The strictly-upper mask becomes upper-from-2: the diagonal below it leaks through."""
    (triu,) = [n for n in graph.nodes if n.target is ATEN.triu.default]
    triu.args = (triu.args[0], 2)


def _perturb_chunk_end(graph):
    """Each chunk's total decay read one position too early (cum_decay[..., -2])."""
    node = next(n for n in graph.nodes if n.target is ATEN.select.int and n.args[2] == -1
                and n.args[0].target is ATEN.cumsum.default)
    node.args = (node.args[0], node.args[1], -2)


def _skip_chunk(graph):
    """Chunk 1 starts again from the initial state instead of chunk 0's state."""
    (state0,) = [n for n in graph.nodes if n.target is ATEN.to.device]
    state1 = next(n for n in graph.nodes if n.target is ATEN.add.Tensor
                  and getattr(n.args[0], "target", None) is ATEN.mul.Tensor
                  and n.args[0].args[0] is state0)
    state1.replace_all_uses_with(state0)


@pytest.mark.parametrize("perturb", [_perturb_mask, _perturb_chunk_end, _skip_chunk])
def test_perturbed_chunk_forms_are_left_unchanged(perturb):
    args = inputs(70)
    program = export_form(ChunkRule(), args, "training")
    perturb(program.graph_module.graph)
    program.graph_module.graph.eliminate_dead_code()  # what the perturbation left unread
    program.graph_module.recompile()
    result = gdn_fx.collapse(program)
    assert result.counts["gated_delta_scan"] == 0
    assert not gdn_fx.graph_diff(program, result.program)
    assert any("chunked form" in str(m) for m in result.misses), result.explain()
    assert math.isfinite(float(run(result.program, args)[0].sum()))


def test_find_unrolled_reports_the_chunked_form():
    program = export_form(ChunkRule(), inputs(8), "training")
    assert any("chunked" in s for s in gdn_fx.find_unrolled(program))
    assert gdn_fx.find_unrolled(gdn_fx.collapse(program).program) == []
    assert graph_of(program) is not None
