"""No false collapse: perturbed loops stay as they were and explain why; a property test."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st
from transformers.models.qwen3_5.modeling_qwen3_5 import torch_recurrent_gated_delta_rule

import gdn_fx
from programs import assert_close_outputs, export_form, flat, rel_err, run

T, AT = 6, 3  # loop length, perturbed step


class Loop(torch.nn.Module):
    """An unrolled head-major loop, like transformers', with one step optionally perturbed."""

    def __init__(self, perturb=None, at=AT):
        super().__init__()
        self.perturb, self.at = perturb, at

    def forward(self, q, k, v, g, beta, s0, g2):
        state, buf, leak = s0, torch.zeros_like(v), None
        before = {}
        for i in range(q.shape[2]):
            hit = i == self.at and self.perturb is not None
            idx = {AT: AT + 1, AT + 1: AT}.get(i, i) if self.perturb == "order" else i
            before[i] = state
            if self.perturb == "skip" and i == AT + 1:
                state = before[AT]  # the state edge skips step AT
            gate = g2 if hit and self.perturb == "gate" else g
            q_t, k_t, v_t = q[:, :, idx], k[:, :, idx], v[:, :, idx]
            state = state * gate[:, :, idx].exp()[..., None, None]
            kv = (state * k_t.unsqueeze(-1)).sum(dim=-1 if hit and self.perturb == "sumdim" else -2)
            delta = v_t - kv
            if not (hit and self.perturb == "beta"):
                delta = delta * beta[:, :, idx].unsqueeze(-1)
            state = state + k_t.unsqueeze(-1) * delta.unsqueeze(-2)
            buf[:, :, i] = (state * q_t.unsqueeze(-1)).sum(dim=-2)
            if hit and self.perturb in ("leak", "state_leak"):
                leak = kv if self.perturb == "leak" else state
        return (buf, state) if leak is None else (buf, state, leak)


def loop_inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    b, h, d = 1, 2, 4  # dk == dv, so a sum over the wrong axis still broadcasts

    def rnd(*shape):
        return torch.randn(*shape, generator=gen)

    return (rnd(b, h, T, d), rnd(b, h, T, d), rnd(b, h, T, d), -torch.rand(b, h, T, generator=gen),
            torch.rand(b, h, T, generator=gen), rnd(b, h, d, d),
            -torch.rand(b, h, T, generator=gen))


def test_the_unperturbed_loop_collapses():
    args = loop_inputs()
    program = export_form(Loop(), args, "training")
    result = gdn_fx.collapse(program)
    assert result.counts["gated_delta_scan"] == 1 and result.misses == []
    assert_close_outputs(run(result.program, args), run(program, args))


PERTURBATIONS = {
    "sumdim": "is not the delta rule",  # a different sum dim
    "gate": "reads g",        # a gate from another tensor
    "beta": "does not read beta",  # a dropped beta
    "skip": "skips the step",  # a state edge that skips a step
    "order": "in order",      # indices out of order
    "leak": "also read",      # an intermediate value with an outside user
    "state_leak": "also read",  # an intermediate state with an outside user
}


@pytest.mark.parametrize("perturb", PERTURBATIONS)
def test_perturbed_loops_are_left_unchanged_with_a_reason(perturb):
    args = loop_inputs()
    program = export_form(Loop(perturb), args, "training")
    result = gdn_fx.collapse(program)
    assert result.counts["gated_delta_scan"] == 0
    assert not gdn_fx.graph_diff(program, result.program), "the graph must stay as it was"
    reasons = [str(m) for m in result.misses]
    assert any(PERTURBATIONS[perturb] in r for r in reasons), reasons
    assert any(m.step is not None for m in result.misses), reasons
    assert_close_outputs(run(result.program, args), run(program, args), rtol=0)


def test_a_miss_names_the_step_and_node():
    program = export_form(Loop("sumdim"), loop_inputs(), "training")
    (miss,) = [m for m in gdn_fx.collapse(program).misses if "delta rule" in m.reason]
    assert (miss.step, miss.of) == (AT, T)
    assert "sum" in miss.node and f"step {AT} of {T}" in str(miss)


@pytest.mark.parametrize("at", [0, T - 2, T - 1])
def test_a_perturbed_first_or_last_step_is_caught(at):
    """Steps 0 and T-1 are the ones not compared with a step after them (step 0 shares the
    verdict of step 1 only when it is node for node the same)."""
    program = export_form(Loop("sumdim", at=at), loop_inputs(), "training")
    result = gdn_fx.collapse(program)
    assert result.counts["gated_delta_scan"] == 0
    assert any(m.step == at and "delta rule" in m.reason for m in result.misses), \
        [str(m) for m in result.misses]


def test_an_ordinary_graph_has_no_misses():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.SiLU(), torch.nn.Linear(4, 2))
    program = export_form(model, (torch.randn(3, 4),), "training")
    result = gdn_fx.collapse(program)
    assert result.counts["gated_delta_scan"] == 0 and result.misses == []


def test_nothing_fused_still_leaves_the_input_alone():
    """Rules that fuse nothing hand their input graph back; collapse then copies it, so the
    result never shares (and its clean-up never edits) the caller's graph."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.SiLU(), torch.nn.Linear(4, 2))
    program = export_form(model, (torch.randn(3, 4),), "training")
    before = str(program.graph_module.graph)
    result = gdn_fx.collapse(program)
    assert result.program.graph_module.graph is not program.graph_module.graph
    assert str(program.graph_module.graph) == before


class Rule(torch.nn.Module):
    def __init__(self, l2norm, given_state):
        super().__init__()
        self.l2norm, self.given_state = l2norm, given_state

    def forward(self, q, k, v, g, beta, s0):
        state = s0 if self.given_state else None
        return torch_recurrent_gated_delta_rule(q, k, v, g, beta, state, True, self.l2norm)


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(b=st.integers(1, 2), hk=st.integers(1, 2), groups=st.integers(1, 3),
       dk=st.integers(2, 6), dv=st.integers(2, 6), t=st.integers(1, 6),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       l2norm=st.booleans(), given_state=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_property_collapse_keeps_numerics(b, hk, groups, dk, dv, t, dtype, l2norm, given_state,
                                          seed):
    gen = torch.Generator().manual_seed(seed)
    hv = hk * groups
    args = [torch.randn(b, t, hk, dk, generator=gen), torch.randn(b, t, hk, dk, generator=gen),
            torch.randn(b, t, hv, dv, generator=gen), -torch.rand(b, t, hv, generator=gen),
            torch.rand(b, t, hv, generator=gen)]
    args = tuple(a.to(dtype) for a in args) + (torch.randn(b, hv, dk, dv, generator=gen),)
    module = Rule(l2norm, given_state)
    program = export_form(module, args, "training")
    result = gdn_fx.collapse(program)
    assert result.counts["gated_delta_scan"] == 1, result.explain()
    if dtype == torch.float32:
        assert_close_outputs(run(result.program, args), run(program, args), rtol=1e-5)
        return
    exact = flat(module(*[a.double() for a in args]))
    for new, old, ref in zip(flat(run(result.program, args)), flat(run(program, args)), exact):
        assert new.dtype == old.dtype
        assert rel_err(new, ref) <= rel_err(old, ref) * 1.25 + 1e-6
