"""The evaluator's switches (passes/evaluator.py): operations whose result switches on data
values are found, the points reach both of their sides, and what cannot be reached refuses.
Also the in-step L2 norm, which the step rule now fuses as the op's own qk_l2norm."""

import pytest
import torch
from torch import fx

import gdn_fx
from gdn_fx.passes.evaluator import covering_points, switches
from gdn_fx.passes.layouts import Layout
from gdn_fx.passes.result import NoMatch


def _graph(fn, *example):
    program = torch.export.export(_Fn(fn), example)
    return program.graph_module, program.graph_module.graph


class _Fn(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


def _uniform(*dims):
    generator = torch.Generator().manual_seed(0)
    return torch.rand(dims, generator=generator, dtype=torch.float64) * 2 - 1


def test_switches_are_found_by_what_they_switch_on():
    owner, graph = _graph(lambda s, g: (s.clamp(-20, 20) * torch.where(g > 3, 1.0, g).exp()),
                          torch.randn(2, 3), torch.randn(2, 3))
    names = sorted(n.target.__name__.split(".")[0] for n in switches(graph))
    assert names == ["clamp", "gt", "where"]


def test_a_literal_mask_is_not_a_switch():
    owner, graph = _graph(lambda x: x.masked_fill(torch.triu(
        torch.ones(4, 4, dtype=torch.bool), 1), 0.0), torch.randn(4, 4))
    assert switches(graph) == {}


def test_points_reach_both_sides_of_a_far_threshold():
    owner, graph = _graph(lambda s: s.clamp(-20, 20) * 2, torch.randn(3, 5))
    base = _uniform(3, 5)
    assert base.abs().max() < 20  # the draws alone never reach it
    extra = covering_points(owner, graph, [base])
    assert extra, "no point crosses the clamp"
    assert any((ins[0].abs() > 20).any() for ins, _ in extra)


def test_a_negative_threshold_on_few_entries_is_reached_by_flipping_the_sign():
    owner, graph = _graph(lambda g: g.clamp(min=-5).exp(), torch.randn(2))
    base = torch.tensor([0.3, 0.7], dtype=torch.float64)  # both positive: scaling alone fails
    extra = covering_points(owner, graph, [base])
    assert any((ins[0] < -5).any() for ins, _ in extra)


def test_an_in_place_clamp_is_seen_on_its_input_as_it_was():
    """clamp_ overwrites its input: read after the run, no value would ever lie beyond the
    bounds, and the region would be refused though the points do cross them."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    y = graph.call_function(torch.ops.aten.mul.Tensor, (x, 1.0))
    graph.call_function(torch.ops.aten.clamp_.default, (y, -20.0, 20.0))
    graph.output((y,))
    extra = covering_points(torch.nn.Module(), graph, [_uniform(5)])
    assert any((ins[0].abs() > 20).any() for ins, _ in extra)


def test_a_switch_no_scaling_reaches_refuses_naming_it():
    owner, graph = _graph(lambda s: torch.maximum(s, s - 1.0), torch.randn(4))
    with pytest.raises(NoMatch, match=r"maximum.*both of its sides"):
        covering_points(owner, graph, [_uniform(4)])


def test_rounding_refuses_naming_it():
    owner, graph = _graph(lambda s: torch.floor(s * 1e6) / 1e6, torch.randn(4))
    with pytest.raises(NoMatch, match=r"floor.*rounds or selects"):
        covering_points(owner, graph, [_uniform(4)])


def test_a_region_without_switches_gets_no_points():
    owner, graph = _graph(lambda s, g: s * g.exp(), torch.randn(2, 3), torch.randn(2, 3))
    assert covering_points(owner, graph, [_uniform(2, 3), _uniform(2, 3)]) == []


def test_layout_equality_counts_every_field_but_the_scale():
    layout = Layout({"q": 0, "k": 1, "v": 2, "g": 3, "beta": 4}, True, True, ((4,),) * 5,
                    (1, 2, 4, 4), (1, 2, 4))
    assert layout.same_as(layout.with_scale(0.5))
    assert not layout.same_as(Layout(**{**layout.__dict__, "qk_l2norm": True}))
    assert not layout.same_as(Layout(**{**layout.__dict__, "key_first": False}))


# --- the in-step L2 norm -------------------------------------------------------------------

T, D = 5, 8


class InStepNorm(torch.nn.Module):
    """q and k normalized at each step, einsum readouts, [B, H, T, D] reads."""

    def __init__(self, eps: float = 1e-6, scale: float = 1.0):
        super().__init__()
        self.eps, self.scale = eps, scale

    def forward(self, q, k, v, g, beta, state):
        outs = []
        for t in range(T):
            qt, kt = q[:, :, t], k[:, :, t]
            qt = qt * torch.rsqrt((qt * qt).sum(-1, keepdim=True) + self.eps) * self.scale
            kt = kt * torch.rsqrt((kt * kt).sum(-1, keepdim=True) + self.eps)
            state = state * g[:, :, t].exp()[..., None, None]
            kv = torch.einsum("bhkv,bhk->bhv", state, kt)
            delta = (v[:, :, t] - kv) * beta[:, :, t, None]
            state = state + torch.einsum("bhk,bhv->bhkv", kt, delta)
            outs.append(torch.einsum("bhkv,bhk->bhv", state, qt))
        return torch.stack(outs, 2), state


def _args():
    torch.manual_seed(0)
    b, h = 1, 2
    return (torch.randn(b, h, T, D), torch.randn(b, h, T, D), torch.randn(b, h, T, D),
            -torch.rand(b, h, T), torch.rand(b, h, T), torch.randn(b, h, D, D))


@pytest.mark.parametrize("scale", [1.0, D ** -0.5])
def test_an_in_step_l2_norm_fuses_as_the_ops_own(scale):
    module, args = InStepNorm(scale=scale), _args()
    result = gdn_fx.collapse(torch.export.export(module, args))
    assert result.counts["gated_delta_scan"] == 1, result.explain()
    scan = next(n for n in result.program.graph.nodes if "gated_delta_scan" in str(n.target))
    assert scan.kwargs["qk_l2norm"] is True
    assert scan.kwargs["scale"] == pytest.approx(scale)
    got, want = result.program.module()(*args), module(*args)
    for a, b in zip(got, want):
        assert (a - b).abs().max() <= 1e-5 * b.abs().max()


def test_an_in_step_norm_with_another_epsilon_is_left_alone():
    module, args = InStepNorm(eps=1e-12), _args()
    result = gdn_fx.collapse(torch.export.export(module, args))
    assert result.counts["gated_delta_scan"] == 0
    assert result.misses
