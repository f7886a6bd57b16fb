"""Translation validation: a wrong rewrite is never committed, whichever rule made it.

Each test breaks a rule on purpose (test-only monkeypatches that swap operands or misstate a
scale) and checks that ``collapse`` rolls the fusion back with a near-miss naming the region,
while ``verify=False`` shows that the broken rewrite really is wrong (so the test can fail).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import gdn_fx
import gdn_fx.passes as passes
import gdn_fx.passes.chunk_meaning as chunk_meaning
import gdn_fx.passes.gdn_recurrent as gdn_recurrent
from tests.programs import export_form, flat, max_rel, run

B, H, T, DK, DV = 1, 2, 4, 4, 6


def _step(state, q, k, v, g, beta):
    state = state * g.exp()[..., None, None]
    kv = (state * k[..., None]).sum(-2)
    delta = (v - kv) * beta[..., None]
    state = state + k[..., None] * delta[..., None, :]
    return state, (state * q[..., None]).sum(-2)


class TwoLoops(torch.nn.Module):
    """Two independent head-major loops, outputs stacked (two fusions for one rule)."""

    def forward(self, q, k, v, g, beta, s0):
        results = []
        for layer in range(2):
            state, outs = s0 + layer, []
            for t in range(T):
                state, o = _step(state, q[:, :, t], k[:, :, t], v[:, :, t], g[:, :, t],
                                 beta[:, :, t])
                outs.append(o)
            results += [torch.stack(outs, 2), state]
        return tuple(results)


def _inputs(seed: int = 0) -> tuple:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(B, H, T, DK, generator=gen), torch.randn(B, H, T, DK, generator=gen),
            torch.randn(B, H, T, DV, generator=gen), -torch.rand(B, H, T, generator=gen),
            torch.rand(B, H, T, generator=gen), torch.randn(B, H, DK, DV, generator=gen))


def _swap_qk(only_key=None):
    """A plan_scan that feeds k as q and q as k (for one region, or all)."""
    real = gdn_recurrent.plan_scan

    def broken(region, ops, order, mode):
        if only_key is None or region.meta_source.name == only_key:
            ops.nodes["q"], ops.nodes["k"] = ops.nodes["k"], ops.nodes["q"]
        return real(region, ops, order, mode)
    return broken


def _error(program, module) -> float:
    args = _inputs(1)
    return max_rel(flat(run(program, args)), flat(module(*args)))


@pytest.mark.parametrize("form", ["training", "core", "make_fx"])
def test_a_rewrite_that_swaps_operands_is_rolled_back(monkeypatch, form):
    module = TwoLoops()
    program = export_form(module, _inputs(), form)
    monkeypatch.setattr(gdn_recurrent, "plan_scan", _swap_qk())
    unchecked = gdn_fx.collapse(program, verify=False)
    assert unchecked.counts["gated_delta_scan"] == 2
    assert _error(unchecked.program, module) > 0.05  # the broken rewrite is really wrong
    checked = gdn_fx.collapse(program)
    assert checked.counts["gated_delta_scan"] == 0
    rolled = [m for m in checked.misses if m.kind == passes.VALIDATION_FAILED]
    assert len(rolled) == 2 and all(m.node for m in rolled)
    assert _error(checked.program, module) < 1e-6


def test_the_step_by_step_kernel_has_the_last_word(monkeypatch):
    """Validation runs gated_delta_scan chunked; when that disagrees (here: a chunked form
    broken on purpose), the verdict is the step-by-step kernel's, so a right fusion stays."""
    import gdn_fx.ops as ops

    module = TwoLoops()
    program = export_form(module, _inputs(), "training")
    real, calls = ops._chunks, []

    def off(q, k, v, g, beta, state):
        calls.append(1)
        out, final = real(q, k, v, g, beta, state)
        return out + 1, final
    monkeypatch.setattr(ops, "_chunks", off)
    result = gdn_fx.collapse(program)
    assert calls and result.counts["gated_delta_scan"] == 2 and not result.misses
    assert _error(result.program, module) < 1e-6


def test_only_the_wrong_fusion_is_rolled_back(monkeypatch):
    module = TwoLoops()
    program = export_form(module, _inputs(), "training")
    keys = [f.key for f in gdn_recurrent.plan_recurrences(program.graph_module.graph)[0]]
    assert len(keys) == 2
    monkeypatch.setattr(gdn_recurrent, "plan_scan", _swap_qk(only_key=keys[1]))
    result = gdn_fx.collapse(program)
    assert result.counts["gated_delta_scan"] == 1
    rolled = [m for m in result.misses if m.kind == passes.VALIDATION_FAILED]
    assert [m.node for m in rolled] == [keys[1]]
    assert _error(result.program, module) < 1e-4


def _halve_scale(real):
    """plan_scan as the rule calls it, with the op's q scale halved."""
    def plan(region, ops, order, mode):
        return real(region, dataclasses.replace(ops, scale=ops.scale / 2), order, mode)
    return plan


def test_a_chunk_fusion_with_a_wrong_scale_is_rolled_back(monkeypatch):
    from tests.test_collapse_chunk import ChunkRule, inputs  # transformers' own chunked rule

    program = export_form(ChunkRule(), inputs(8), "training")
    right = gdn_fx.collapse(program)
    assert right.counts["gated_delta_scan"] == 1
    monkeypatch.setattr(chunk_meaning, "plan_scan", _halve_scale(chunk_meaning.plan_scan))
    wrong = gdn_fx.collapse(program, verify=False)
    assert wrong.counts["gated_delta_scan"] == 1
    assert gdn_fx.compare_programs(program, wrong.program) is not None
    result = gdn_fx.collapse(program)
    assert result.counts["gated_delta_scan"] == 0
    assert any(m.kind == passes.VALIDATION_FAILED for m in result.misses)
    assert gdn_fx.compare_programs(program, right.program) is None


@pytest.mark.parametrize("kda", [False, True])
def test_the_chunk_rules_q_scale_is_the_one_transformers_applies(kda):
    # without the in-kernel l2norm q's scale shows in the output: transformers' chunk rules
    # (5.24) multiply q by 1 / sqrt(Dk), GDN before padding, KDA after; Dk = 8 here
    from tests.test_collapse_chunk import ChunkRule, inputs

    args = inputs(70, groups=1 if kda else 2, kda=kda)
    program = export_form(ChunkRule(kda=kda, l2norm=False), args, "training")
    result = gdn_fx.collapse(program)
    (node,) = [n for n in result.program.graph.nodes
               if n.target is torch.ops.gdn_fx.gated_delta_scan.default]
    assert node.kwargs == dict(scale=pytest.approx(8 ** -0.5), qk_l2norm=False)
    assert gdn_fx.compare_programs(program, result.program) is None


def test_compare_programs_says_why_two_programs_differ():
    module = TwoLoops()
    program = export_form(module, _inputs(), "training")
    assert gdn_fx.compare_programs(program, gdn_fx.collapse(program).program) is None

    class Off(TwoLoops):
        def forward(self, q, k, v, g, beta, s0):
            first, *rest = super().forward(q, k, v, g, beta, s0)
            return (first * 1.01, *rest)

    other = export_form(Off(), _inputs(), "training")
    reason = gdn_fx.compare_programs(program, other)
    assert reason is not None and "output 0" in reason


@pytest.mark.parametrize("writer", ["original", "rewritten"])
def test_an_input_written_by_one_program_only_is_a_difference(writer):
    """Inputs go to a program uncopied only when it cannot write them; a write that one of
    the two programs makes and the other does not shows as that input after the run."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def writes(x, y):
        x.add_(1.0)
        return x * y

    def pure(x, y):
        return (x + 1.0) * y

    args = (torch.randn(3, 4), torch.randn(3, 4))
    a, b = make_fx(writes)(*args), make_fx(pure)(*args)
    first, second = (a, b) if writer == "original" else (b, a)
    reason = gdn_fx.compare_programs(first, second)
    assert reason is not None and "after the run" in reason
    assert gdn_fx.compare_programs(a, a) is None and gdn_fx.compare_programs(b, b) is None


def test_a_program_with_a_forward_hook_runs_through_it():
    """Programs are run through their generated code with the ops called directly; a module
    with a hook must still be run as a module, or what the hook does would not be compared."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(x, y):
        return x * y + 1.0

    args = (torch.randn(3, 4), torch.randn(3, 4))
    plain, hooked = make_fx(f)(*args), make_fx(f)(*args)
    hooked.register_forward_pre_hook(lambda module, inputs: (inputs[0] * 2.0, inputs[1]))
    assert gdn_fx.compare_programs(plain, make_fx(f)(*args)) is None
    reason = gdn_fx.compare_programs(plain, hooked)
    assert reason is not None and "output 0" in reason


def test_a_program_that_fails_on_probe_inputs_is_left_alone():
    class Picky(TwoLoops):
        def forward(self, q, k, v, g, beta, s0):
            torch._assert_async((beta >= 0).all())  # random probe inputs break this
            return super().forward(q, k, v, g, beta, s0)

    program = export_form(Picky(), _inputs(), "make_fx")
    result = gdn_fx.collapse(program)
    assert result.counts["gated_delta_scan"] == 0
    assert any("original program fails on probe inputs" in m.reason for m in result.misses)


def test_finiteness_is_decided_exactly():
    from gdn_fx.passes.validate import _finite

    assert _finite(torch.tensor([1.0, -2.0]))
    assert not _finite(torch.tensor([1.0, float("nan")]))
    assert not _finite(torch.tensor([float("inf"), -float("inf")]))  # a NaN sum
    assert _finite(torch.tensor([3e38, 3e38]))  # the sum overflows; the values are finite
    assert _finite(torch.tensor([60000.0, 60000.0], dtype=torch.float16))


@pytest.mark.parametrize("finite", [True, None])
def test_disagreement_with_a_finite_reference(finite):
    from gdn_fx.passes.validate import _disagreement

    want = torch.tensor([1.0, -2.0])
    assert _disagreement(torch.tensor([1.0, -2.5]), want, finite)[0] == pytest.approx(0.25)
    assert _disagreement(want.clone(), want, finite)[0] == 0.0
    for bad in (float("nan"), float("inf")):
        assert _disagreement(torch.tensor([1.0, bad]), want, finite)[0] == float("inf")


def test_disagreement_with_a_reference_that_is_not_finite():
    from gdn_fx.passes.validate import _disagreement

    want = torch.tensor([float("inf"), 1.0, -4.0])
    # scaled by the finite entries' largest magnitude: |1.5 - 1| / 4
    assert _disagreement(torch.tensor([float("inf"), 1.5, -4.0]), want, False)[0] == \
        pytest.approx(0.125)
    assert _disagreement(torch.tensor([1.0, 1.0, -4.0]), want, False)[0] == float("inf")
