"""What the graph proves about a value's range (passes/bounds.py), and what it guards: a
decay the loop multiplies by reaches the op as its log only where it is proven non-negative;
and translation validation's probe drawn by role (passes/validate.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import gdn_fx
from gdn_fx.passes.bounds import bounds, nonnegative
from gdn_fx.passes.program import graph_module_of
from gdn_fx.passes.validate import Validator


def _last(fn, *args):
    """The node computing ``fn``'s result in its exported graph (and the graph module)."""
    program = torch.export.export(_Wrap(fn), args)
    gm = program.graph_module
    output = next(n for n in gm.graph.nodes if n.op == "output")
    return output.args[0][0]


class _Wrap(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return (self.fn(*args),)


X = torch.randn(3, 4)


@pytest.mark.parametrize("fn, lo, hi", [
    (torch.exp, 0.0, float("inf")),
    (torch.sigmoid, 0.0, 1.0),
    (lambda x: 1 - torch.sigmoid(x), 0.0, 1.0),
    (lambda x: 1 - 2 * torch.sigmoid(x), -1.0, 1.0),
    (torch.tanh, -1.0, 1.0),
    (lambda x: torch.exp(-F.softplus(x)), 0.0, 1.0),
    (lambda x: -torch.exp(x), -float("inf"), 0.0),
    (lambda x: x.clamp(min=0.5) * 2, 1.0, float("inf")),
    (lambda x: torch.sigmoid(x).transpose(0, 1)[1:].unsqueeze(0).flatten(), 0.0, 1.0),
    (lambda x: torch.sigmoid(x) ** 2, 0.0, float("inf")),
    (lambda x: x * x, -float("inf"), float("inf")),  # no relation between operands
    (lambda x: x + 1, -float("inf"), float("inf")),
])
def test_bounds_of_common_decays(fn, lo, hi):
    node = _last(fn, X)
    got = bounds(node)
    assert got == pytest.approx((lo, hi))
    # the proof holds on values: every element lies in it
    value = fn(torch.randn(200, 4) * 10)
    assert bool((value >= got[0]).all()) and bool((value <= got[1]).all())


def test_nonnegative_is_a_proof_or_nothing():
    assert nonnegative(_last(lambda x: torch.sigmoid(x) * torch.exp(x), X))
    assert not nonnegative(_last(lambda x: torch.sigmoid(x) - 0.5, X))
    assert not nonnegative(_last(lambda x: x.abs() - 1e-9, X))


class DecayLoop(torch.nn.Module):
    """A delta-rule loop that multiplies its state by a decay computed before the loop."""

    def __init__(self, decay):
        super().__init__()
        self.decay = decay

    def forward(self, q, k, v, a, beta, s):
        decay = self.decay(a)
        outs = []
        for t in range(q.shape[1]):
            s = s * decay[:, t, :, None, None]
            kv = (s * k[:, t, :, :, None]).sum(-2)
            delta = (v[:, t] - kv) * beta[:, t, :, None]
            s = s + k[:, t, :, :, None] * delta[:, :, None, :]
            outs.append((s * q[:, t, :, :, None]).sum(-2))
        return torch.stack(outs, 1), s


def _loop_inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    b, t, h, d = 2, 5, 3, 4
    return (torch.randn(b, t, h, d, generator=gen) * 0.5,
            torch.randn(b, t, h, d, generator=gen) * 0.3, torch.randn(b, t, h, d, generator=gen),
            torch.randn(b, t, h, generator=gen) * 2, torch.rand(b, t, h, generator=gen),
            torch.randn(b, h, d, d, generator=gen))


@pytest.mark.parametrize("name, decay, fuses", [
    ("sigmoid", torch.sigmoid, True),
    ("one_minus_sigmoid", lambda a: 1 - torch.sigmoid(a), True),
    ("signed", lambda a: 1 - 2 * torch.sigmoid(a), False),
    ("tanh", torch.tanh, False),
])
def test_a_decay_reaches_the_op_only_when_proven_non_negative(name, decay, fuses):
    args = _loop_inputs()
    module = DecayLoop(decay)
    result = gdn_fx.collapse(torch.export.export(module, args))
    assert result.counts["gated_delta_scan"] == int(fuses), result.explain()
    if not fuses:
        assert any("does not prove non-negative" in m.reason for m in result.misses)
    out = result.program.module()(*args)[0]
    want = module(*args)[0]
    assert bool(out.isfinite().all())
    assert (out - want).abs().max() <= 1e-4 * want.abs().max()


class FlooredGate(DecayLoop):
    """The loop with its log gate floored near -5 (spelled without max) before it."""

    def __init__(self, floor: bool):
        super().__init__(torch.exp)
        self.floor = floor

    def forward(self, q, k, v, g, beta, s):
        if self.floor:
            g = -5 + F.softplus(g + 5, beta=50)
        return super().forward(q, k, v, g, beta, s)


def test_the_default_validation_draws_gates_by_role():
    """A program whose gate is floored at -5 against the plain loop's fusion: the ordinary
    probe (randn * 0.5) never reaches the floor, the probe drawn by role does, without the
    wide probes."""
    q, k, v, _, beta, s = _loop_inputs()
    args = (q, k, v, -torch.rand(2, 5, 3), beta, s)
    plain = gdn_fx.collapse(torch.export.export(FlooredGate(False), args))
    assert plain.counts["gated_delta_scan"] == 1
    floored, _ = graph_module_of(torch.export.export(FlooredGate(True), args))
    fused, _ = graph_module_of(plain.program)
    problem = Validator(floored, wide=False).mismatch(fused)
    assert problem is not None and "drawn by role (g as a gate" in problem
    original, _ = graph_module_of(torch.export.export(FlooredGate(False), args))
    assert Validator(original, wide=False).mismatch(fused) is None
