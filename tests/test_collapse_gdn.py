"""Collapse of unrolled GDN / KDA recurrences: forms, lengths, variants, numerics, node counts."""

from __future__ import annotations

import pytest
import torch
from transformers.models.kimi_linear.modeling_kimi_linear import recurrent_kimi_delta_attention
from transformers.models.qwen3_5.modeling_qwen3_5 import torch_recurrent_gated_delta_rule

import gdn_fx
from gdn_fx.reference import recurrent_delta_rule_reference
from programs import (FORMS, assert_close_outputs, count_calls, export_form, flat, fused_nodes,
                      rel_err, run)

SCAN = torch.ops.gdn_fx.gated_delta_scan.default


class HFRule(torch.nn.Module):
    """transformers' recurrent rule (qwen3_5 / qwen3_next / olmo_hybrid share it) as a module."""

    def __init__(self, l2norm=True, final_state=True, given_state=True, kda=False):
        super().__init__()
        self.l2norm, self.final_state, self.given_state, self.kda = (
            l2norm, final_state, given_state, kda)

    def forward(self, q, k, v, g, beta, s0):
        rule = recurrent_kimi_delta_attention if self.kda else torch_recurrent_gated_delta_rule
        state = s0 if self.given_state else None
        return rule(q, k, v, g, beta, state, self.final_state, self.l2norm)


def inputs(b=1, t=3, hk=2, groups=2, dk=8, dv=8, kda=False, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hv = hk * groups

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    gate = -torch.rand(b, t, hv, *((dk,) if kda else ()), generator=gen).to(dtype)
    beta = torch.rand(b, t, hv, generator=gen).to(dtype)
    state = torch.randn(b, hv, dk, dv, generator=gen)
    return rnd(b, t, hk, dk), rnd(b, t, hk, dk), rnd(b, t, hv, dv), gate, beta, state


def collapse_and_check(module, args, form, rtol=1e-5, expect=1):
    program = export_form(module, args, form)
    result = gdn_fx.collapse(program)
    assert result.counts["gated_delta_scan"] == expect, result.explain()
    assert_close_outputs(run(result.program, args), run(program, args), rtol=rtol)
    return program, result


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("t", [1, 2, 3, 8])
def test_hf_gdn_rule_collapses_in_every_form(form, t):
    args = inputs(t=t)
    program, result = collapse_and_check(HFRule(), args, form)
    assert result.misses == []
    (node,) = fused_nodes(result.program)
    assert node.kwargs == dict(scale=pytest.approx(8 ** -0.5), qk_l2norm=True)


@pytest.mark.parametrize("form", ["training", "core", "make_fx"])
@pytest.mark.parametrize("t", [1, 5])
def test_hf_kda_rule_collapses(form, t):
    args = inputs(t=t, groups=1, kda=True)
    collapse_and_check(HFRule(kda=True), args, form)


def test_prologue_is_absorbed_to_model_level_operands():
    """q/k reach the node un-repeated, un-transposed and un-normalized: the native op's inputs."""
    args = inputs(t=4, hk=2, groups=3)
    program = export_form(HFRule(), args, "training")
    result = gdn_fx.collapse(program)
    (node,) = fused_nodes(result.program)
    names = [a.name for a in node.args]
    assert names == ["q", "k", "v", "g", "beta", "s0"]
    diff = gdn_fx.graph_diff(program, result.program)
    assert {"gated_delta_scan_default", "getitem", "getitem_1"} <= set(diff.added)
    assert diff.op_delta()["gdn_fx.gated_delta_scan.default"] == (0, 1)
    assert diff.changed == []


VARIANTS = {
    "no_l2norm": (dict(l2norm=False), {}),
    "no_gqa": ({}, dict(groups=1)),
    "zeros_state": (dict(given_state=False), {}),
    "no_final_state": (dict(final_state=False), {}),
    "batch3": ({}, dict(b=3)),
    "dk_ne_dv": ({}, dict(dk=8, dv=12)),
}


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("form", ["training", "core"])
def test_variants(variant, form):
    mod_kw, in_kw = VARIANTS[variant]
    args = inputs(t=5, **in_kw)
    _, result = collapse_and_check(HFRule(**mod_kw), args, form)
    (node,) = fused_nodes(result.program)
    assert node.kwargs["qk_l2norm"] == mod_kw.get("l2norm", True)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_models_are_no_worse_than_the_original(dtype):
    args = inputs(t=6, dtype=dtype)
    program = export_form(HFRule(), args, "training")
    result = gdn_fx.collapse(program)
    assert result.counts["gated_delta_scan"] == 1
    exact = HFRule()(*[a.double() for a in args])
    before, after = flat(run(program, args)), flat(run(result.program, args))
    for b, a, e in zip(before, after, flat(exact)):
        assert a.dtype == b.dtype
        assert rel_err(a, e) <= rel_err(b, e) * 1.25 + 1e-6
    (node,) = fused_nodes(result.program)
    assert node.args[0].meta["val"].dtype == dtype  # the up-cast was absorbed


def test_node_count_does_not_grow_with_length():
    sizes = []
    for t in (2, 4, 16):
        args = inputs(t=t)
        program = export_form(HFRule(), args, "training")
        result = gdn_fx.collapse(program)
        sizes.append((count_calls(program), count_calls(result.program)))
    assert len({after for _, after in sizes}) == 1, sizes
    assert sizes[-1][0] > sizes[0][0] + 100  # the unrolled graph did grow


def test_long_sequence():
    args = inputs(t=256, hk=1, groups=2, dk=4, dv=4)
    collapse_and_check(HFRule(), args, "training")


@pytest.mark.parametrize("form", ["training", "core", "make_fx"])
@pytest.mark.parametrize("kda", [False, True])
def test_gdn_fx_reference_loop_collapses(form, kda):
    class Ref(torch.nn.Module):
        def forward(self, q, k, v, g, beta, s0):
            return recurrent_delta_rule_reference(q, k, v, g, beta, initial_state=s0, scale=0.3)

    args = inputs(t=4, kda=kda)
    _, result = collapse_and_check(Ref(), args, form)
    (node,) = fused_nodes(result.program)
    assert node.kwargs["scale"] == pytest.approx(0.3)
    gate = node.args[3]  # GDN gates reach the node unexpanded, straight from the input
    assert gate.op == "placeholder" and gate.meta["val"].dim() == (4 if kda else 3)


class StatefulRule(torch.nn.Module):
    """The recurrent state kept as a buffer, or passed in and written back (a mutated input)."""

    def __init__(self, state, as_buffer):
        super().__init__()
        self.as_buffer = as_buffer
        self.register_buffer("state", state.clone())

    def forward(self, q, k, v, g, beta, s0):
        state = self.state if self.as_buffer else s0
        out, new = torch_recurrent_gated_delta_rule(q, k, v, g, beta, state, True, True)
        state.copy_(new)
        return out


@pytest.mark.parametrize("as_buffer", [True, False])
@pytest.mark.parametrize("form", ["training", "functional"])
def test_state_as_buffer_or_mutated_input(as_buffer, form):
    args = inputs(t=3)
    module = StatefulRule(args[5], as_buffer)
    program = export_form(module, args, form)
    result = gdn_fx.collapse(program)
    assert result.counts["gated_delta_scan"] == 1
    kinds = [s.kind for s in program.graph_signature.output_specs]
    assert [s.kind for s in result.program.graph_signature.output_specs] == kinds
    (want_out, want_state), (out, state) = (_run_stateful(p, args, as_buffer)
                                            for p in (program, result.program))
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(state, want_state, rtol=1e-5, atol=1e-6)
    assert not torch.equal(want_state, args[5])  # the state really was written


def _run_stateful(program, args, as_buffer):
    """Output and written state, from the same initial state (programs share their buffers)."""
    module, s0 = program.module(), args[5].clone()
    module.state.copy_(args[5])
    out = module(*args[:5], s0)
    return out, (module.state if as_buffer else s0).clone()


def test_surrounding_graph_is_untouched():
    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.pre = torch.nn.Linear(8, 8)
            self.post = torch.nn.Linear(8, 8)

        def forward(self, q, k, v, g, beta, s0):
            out, state = torch_recurrent_gated_delta_rule(self.pre(q), k, v, g, beta, s0, True)
            return self.post(out), state

    args = inputs(t=3)
    program = export_form(Layer(), args, "training")
    result = gdn_fx.collapse(program)
    diff = gdn_fx.graph_diff(program, result.program)
    assert diff.op_delta().get("aten.linear.default") is None
    assert count_calls(result.program, torch.ops.aten.linear.default) == 2
    assert_close_outputs(run(result.program, args), run(program, args))


def test_collapse_leaves_its_input_alone_and_accepts_graph_modules():
    args = inputs(t=2)
    program = export_form(HFRule(), args, "training")
    before = count_calls(program)
    result = gdn_fx.collapse(program.module())
    assert isinstance(result.program, torch.fx.GraphModule)
    assert count_calls(program) == before
    with pytest.raises(TypeError, match="ExportedProgram or torch.fx.GraphModule"):
        gdn_fx.collapse(HFRule())
