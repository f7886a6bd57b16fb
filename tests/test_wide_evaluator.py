"""The meaning rules' wide domain and laws (passes/evaluator.py), checked directly: what the
draws reach, that a region that is the op keeps the laws and one that caps its state does not,
that a region turning data into integers or a narrower float is refused naming the node, and
that a conv region handing out a boolean value is left with a reason (it once raised)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import fx

import gdn_fx
from gdn_fx.passes.evaluator import (DECADES, LAW_FACTORS, RESET, WIDE_DRAWS, Sampler,
                                     law_problem, wide_draw)
from gdn_fx.passes.result import NoMatch

sys.path.insert(0, str(Path(__file__).parent))
from conv_spellings import K, CatSliceReturned, inputs  # noqa: E402


def _draws(kind, dims=(3, 5, 7)):
    gen = torch.Generator().manual_seed(0)
    return [wide_draw(kind, dims, gen, r, r) for r in range(WIDE_DRAWS)]


def test_linear_inputs_meet_every_decade_both_signs_and_zeros():
    draws = _draws("linear")
    assert any(not x.any() for x in draws)  # one draw all zeros: a fresh state
    draws = [x for x in draws if x.any()]
    biggest = [x.abs().max().item() for x in draws]
    smallest = [x[x != 0].abs().min().item() for x in draws]
    assert max(biggest) > 10 ** (DECADES[1] - 1) and min(smallest) < 10 ** (DECADES[0] + 1)
    assert all((x > 0).any() and (x < 0).any() for x in draws)
    assert any((x == 0).any() for x in draws)  # and zeros among other values


def test_gates_reach_past_minus_100_and_reset_beta_reaches_its_ends():
    gates = torch.cat([x.flatten() for x in _draws("gate")])
    assert (gates <= 0).all() and (gates == RESET).any()
    assert ((gates < -10) & (gates > RESET)).any() and (gates > -1e-5).any()
    decays = torch.cat([x.flatten() for x in _draws("decay")])
    # a decay the loop multiplies by takes both signs: every value of [-1, 1]
    assert ((decays >= -1) & (decays <= 1)).all() and (decays == 0).any()
    assert (decays < -0.5).any() and (decays > 0.5).any() and (decays.abs() == 1).any()
    betas = torch.cat([x.flatten() for x in _draws("beta")])
    assert (betas == 0).any() and (betas == 1).any() and ((betas > 0) & (betas < 1)).any()


def test_keys_keep_the_recurrence_contractive():
    for k in _draws("key", (4, 6, 8)):
        assert (k.pow(2).sum(-1) <= 1).all()


def _region(fn, count=2) -> Sampler:
    graph = fx.Graph()
    places = [graph.placeholder(f"x{i}") for i in range(count)]
    graph.output(graph.call_function(fn, tuple(places)))
    draw = lambda gen: [torch.rand(3, 4, generator=gen, dtype=torch.float64)  # noqa: E731
                        for _ in range(count)]
    return Sampler(torch.nn.Module(), graph, draw, "step")


@pytest.mark.parametrize("fn, scaled, linear", [
    (lambda a, b: 2 * a - b, [0, 1], True),
    (lambda a, b: a * b.tanh(), [0], True),  # linear in a, b left as it is
    (lambda a, b: 1e3 * torch.tanh(a / 1e3) + b, [0, 1], False),  # a smooth cap at 1e3
    (lambda a, b: torch.logaddexp(a, b), [0, 1], False),  # log-sum-exp: a soft maximum
    (lambda a, b: a - 1e3 * torch.div(a, 1e3, rounding_mode="trunc"), [0], False),  # a wrap
    (lambda a, b: (a * a).sqrt() + b, [0, 1], False),  # |a| (homogeneous, but not for -1)
])
def test_the_law_tells_a_linear_region_from_a_capped_one(fn, scaled, linear):
    sampler = _region(fn)
    problem = law_problem(sampler, sampler.point(), scaled, [0])
    assert (problem == "") is linear, problem


def test_the_law_factors_are_extreme_and_exact():
    assert max(abs(f) for f in LAW_FACTORS) > 1e80 and min(abs(f) for f in LAW_FACTORS) < 1e-80
    assert any(f < 0 for f in LAW_FACTORS)
    for f in LAW_FACTORS:  # powers of two: scaling rounds nothing
        assert torch.frexp(torch.tensor(abs(f), dtype=torch.float64)).mantissa == 0.5


@pytest.mark.parametrize("cast", [torch.int64, torch.int32, torch.float16, torch.bfloat16])
def test_a_region_that_turns_data_into_a_narrower_dtype_is_refused_naming_the_node(cast):
    def body(a, b):
        return (a * 1e3).to(cast).to(a.dtype) + b

    gm = torch.fx.experimental.proxy_tensor.make_fx(body, tracing_mode="fake")(
        torch.rand(3, 4), torch.rand(3, 4))
    sampler = Sampler(gm, gm.graph, lambda gen: [torch.rand(3, 4, generator=gen,
                                                            dtype=torch.float64)] * 2, "step")
    with pytest.raises(NoMatch) as miss:
        sampler.point()
    assert str(cast) in miss.value.reason and "node" in miss.value.reason


class BoolExit(CatSliceReturned):
    """A conv update that also hands out which state entries are positive (a bool)."""

    def forward(self, x, state):
        new_state = torch.cat([state[:, :, 1:], x.unsqueeze(-1)], dim=-1)
        out = (new_state * self.taps().unsqueeze(0)).sum(-1) + self.bias
        return F.silu(out), new_state, new_state > 0


@pytest.mark.parametrize("form", ["training", "functional", "core"])
def test_a_conv_region_handing_out_a_bool_is_decided_without_raising(form):
    x, state = inputs(layout="bc", width=K)()
    program = torch.export.export(BoolExit(), (x, state))
    if form != "training":
        program = program.run_decompositions({} if form == "functional" else None)
    result = gdn_fx.collapse(program)
    module = program.module()
    want = module(x.clone(), state.clone())
    got = result.program.module()(x.clone(), state.clone())
    for a, b in zip(got, want):
        assert torch.equal(a, b) if b.dtype is torch.bool else torch.allclose(a, b, atol=1e-6)
