"""The rule substrate (passes/rule.py): every rule plans fusions on a graph it only reads, and
``collapse`` rebuilds and validates the fusions of whatever rule RULES lists."""

from __future__ import annotations

import pytest
import torch

import gdn_fx
from gdn_fx import passes
from gdn_fx.passes.program import add_node, fake_mode_of
from gdn_fx.passes.rebuild import Fusion
from programs import export_form, run
from test_collapse_conv import Update, _inputs
from test_collapse_gdn import HFRule, inputs

MUL = torch.ops.aten.mul.Tensor


def _programs() -> list:
    """A program the recurrence rule fuses and one the conv rule fuses."""
    return [export_form(HFRule(), inputs(t=3), "training"),
            export_form(Update(), _inputs(Update(), 1), "training")]


@pytest.mark.parametrize("index", [0, 1])
def test_every_rule_plans_without_touching_the_graph(index):
    program = _programs()[index]
    graph = program.graph_module.graph
    before = graph.python_code("self").src
    planned = 0
    for rule in passes.RULES:
        fusions, _ = rule.plan(graph)
        planned += len(fusions)
        names = {n.name for n in graph.nodes}
        assert all(f.key in names for f in fusions)
        assert graph.python_code("self").src == before, rule.name
    assert planned >= 1  # the program is one the rules fuse: the check above saw a plan


class Toy(torch.nn.Module):
    def forward(self, x, y):
        return (x * y).sin()


class MulRule:
    """Replaces each multiply by ``target(b, a)``: right for mul, wrong for sub."""

    name = op = "toy"

    def __init__(self, target):
        self.target = target

    def unrolled(self, graph):
        return []

    def plan(self, graph):
        mode = fake_mode_of(graph)
        fusions = []
        for node in graph.nodes:
            if node.target is MUL:
                a, b = node.args

                def emit(new, env, a=a, b=b):
                    return {"value": add_node(new, self.target, (env(b), env(a)), mode=mode)}
                fusions.append(Fusion(node.name, node, emit, {a, b}, {node: "value"}))
        return fusions, []


def _toy_args():
    generator = torch.Generator().manual_seed(3)
    return torch.randn(4, 5, generator=generator), torch.randn(4, 5, generator=generator)


def test_any_rule_listed_is_validated_and_its_wrong_fusion_dropped():
    args = _toy_args()
    program = export_form(Toy(), args, "training")
    want = Toy()(*args)
    rules = (MulRule(torch.ops.aten.sub.Tensor),)
    unchecked = gdn_fx.collapse(program, verify=False, rules=rules)
    assert unchecked.counts["toy"] == 1  # the substrate does make what a rule plans ...
    assert not torch.allclose(run(unchecked.program, args), want)
    checked = gdn_fx.collapse(program, rules=rules)
    assert checked.counts["toy"] == 0  # ... unless running it says it is wrong
    (miss,) = checked.misses
    assert miss.kind == passes.VALIDATION_FAILED and miss.node == "mul"
    torch.testing.assert_close(run(checked.program, args), want)


def test_a_right_fusion_of_any_rule_is_made():
    args = _toy_args()
    program = export_form(Toy(), args, "training")
    result = gdn_fx.collapse(program, rules=(MulRule(MUL),))
    assert result.counts["toy"] == 1 and not result.misses
    muls = [n for n in result.program.graph.nodes if n.target is MUL]
    assert [a.name for a in muls[0].args] == ["y", "x"]  # the rule's node, not the original
    torch.testing.assert_close(run(result.program, args), Toy()(*args))


def test_an_unknown_family_is_an_error_not_another_familys_shapes():
    from gdn_fx.errors import UnknownName
    from gdn_fx.hf.dropins import make_rule
    from gdn_fx.hf.rule_kinds import kind_named

    with pytest.raises(UnknownName, match="'gla'"):
        kind_named("gla")
    with pytest.raises(UnknownName, match="'gla'"):
        make_rule(None, "gla", "recurrent", exact=True)
    # the two known ones differ where the families do: function names and q's preparation
    gdn, kda = kind_named("gdn"), kind_named("kda")
    assert gdn.names == ("torch_recurrent_gated_delta_rule", "torch_chunk_gated_delta_rule")
    assert kda.names == ("recurrent_kimi_delta_attention", "chunk_kimi_delta_attention")
    assert (gdn.divides_q, kda.divides_q) == (True, False)


def test_rules_have_distinct_names_and_report_what_they_would_fuse():
    """Each rule names itself (counts are kept per op, several rules fuse into one op), and
    find_unrolled asks each rule: a rule left out reports nothing."""
    names = [rule.name for rule in passes.RULES]
    assert len(set(names)) == len(names)
    assert {rule.op for rule in passes.RULES} == {"gated_delta_scan", "causal_conv1d_update"}
    program = _programs()[0]
    assert gdn_fx.find_unrolled(program)  # the unrolled recurrence
    others = tuple(r for r in passes.RULES if r.name != "recurrence")
    assert gdn_fx.find_unrolled(program, rules=others) == []


def test_a_near_miss_says_which_check_left_the_region():
    """A region a rule's own checks refuse is CHECK_FAILED (a clamp on the state: not the
    delta rule once the clamp is crossed); one that validation rolls back is
    VALIDATION_FAILED (above)."""
    class Clamped(torch.nn.Module):
        def forward(self, q, k, v, g, beta, state):
            outs = []
            for t in range(q.shape[2]):
                state = state * g[:, :, t].exp()[..., None, None]
                kv = (state * k[:, :, t, :, None]).sum(-2)
                delta = (v[:, :, t] - kv) * beta[:, :, t, None]
                state = (state + k[:, :, t, :, None] * delta[..., None, :]).clamp(-20, 20)
                outs.append((state * q[:, :, t, :, None]).sum(-2))
            return torch.stack(outs, 2), state

    g = torch.Generator().manual_seed(1)
    args = (torch.randn(1, 2, 4, 4, generator=g), torch.randn(1, 2, 4, 4, generator=g),
            torch.randn(1, 2, 4, 4, generator=g), -torch.rand(1, 2, 4, generator=g),
            torch.rand(1, 2, 4, generator=g), torch.randn(1, 2, 4, 4, generator=g))
    result = gdn_fx.collapse(torch.export.export(Clamped(), args))
    assert result.counts["gated_delta_scan"] == 0
    assert result.misses and all(m.kind == passes.CHECK_FAILED for m in result.misses)


def test_a_fitted_scale_becomes_the_regions_literal_it_rounds_to():
    """A scale fitted by least squares (0.25000000000000006) is the graph's 0.25 or 1 / 4, so
    traces at other lengths agree on it bit for bit; an infinite fill is never a scale."""
    from gdn_fx.passes.evaluator import exact_scale

    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    masked = graph.call_function(torch.ops.aten.masked_fill.Scalar, (x, x, float("-inf")))
    graph.call_function(torch.ops.aten.div.Tensor, (masked, 4.0))
    assert exact_scale(0.25000000000000006, graph.nodes) == 0.25
    assert exact_scale(0.2500001, graph.nodes) == 0.2500001  # not within rounding: as fitted
    assert exact_scale(3.9999999999999996, graph.nodes) == 4.0
