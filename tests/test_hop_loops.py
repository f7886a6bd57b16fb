"""The delta rule written with torch's loop higher-order operators (``scan``, ``while_loop``).

torch.export keeps each as ONE node with a body graph. No rule fuses it; what must hold is
that nothing is silent: ``collapse`` leaves a near-miss naming the operator and its node,
``find_unrolled`` reports it, and ``export_nnef`` refuses it in one line instead of failing
inside torch-to-nnef. The expected values are a plain Python loop written here.
"""

import pytest
import torch
from torch._higher_order_ops.scan import scan
from torch._higher_order_ops.while_loop import while_loop
from torch import nn

import gdn_fx
from gdn_fx.errors import GdnFxError, LoweringUnsupported

B, T, H, DK, DV = 2, 6, 3, 4, 5


class ScanDeltaRule(nn.Module):
    """Sequence-major inputs [B, T, H, D]; the step is handed to ``scan`` over time."""

    def forward(self, q, k, v, log_decay, beta, state):
        def step(memory, inputs):
            q_t, k_t, v_t, a_t, b_t = inputs
            memory = memory * a_t.exp()[:, :, None, None]
            recalled = torch.einsum("bhkv,bhk->bhv", memory, k_t)
            correction = b_t[:, :, None] * (v_t - recalled)
            memory = memory + torch.einsum("bhk,bhv->bhkv", k_t, correction)
            return memory, torch.einsum("bhkv,bhk->bhv", memory, q_t)

        over_time = [x.transpose(0, 1) for x in (q, k, v, log_decay, beta)]
        final, out = scan(step, state, over_time)
        return out.transpose(0, 1), final


class WhileDeltaRule(nn.Module):
    """The same recurrence as a counted ``while_loop`` writing each output row in place of a
    preallocated buffer (index_select / index_copy: a tensor counter cannot slice)."""

    def forward(self, q, k, v, log_decay, beta, state):
        length = q.shape[1]

        def running(t, memory, out):
            return t < length

        def advance(t, memory, out):
            at = t.reshape(1)
            q_t, k_t, v_t, a_t, b_t = (x.index_select(1, at)[:, 0]
                                       for x in (q, k, v, log_decay, beta))
            memory = memory * a_t.exp()[..., None, None]
            recalled = (memory * k_t[..., None]).sum(-2)
            memory = memory + k_t[..., None] * ((v_t - recalled) * b_t[..., None])[..., None, :]
            row = (memory * q_t[..., None]).sum(-2)
            return t + 1, memory, out.index_copy(1, at, row[:, None])

        start = (torch.tensor(0), state.clone(), torch.zeros_like(v))
        _, final, out = while_loop(running, advance, start)
        return out, final


def python_loop(q, k, v, log_decay, beta, state):
    """The reference: the gated delta rule, one position at a time."""
    state, outs = state.clone(), []
    for t in range(q.shape[1]):
        state = state * log_decay[:, t].exp()[..., None, None]
        kv = (state * k[:, t, :, :, None]).sum(2)
        delta = (v[:, t] - kv) * beta[:, t, :, None]
        state = state + k[:, t, :, :, None] * delta[:, :, None, :]
        outs.append((state * q[:, t, :, :, None]).sum(2))
    return torch.stack(outs, 1), state


def inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.nn.functional.normalize(torch.randn(B, T, H, DK, generator=gen), dim=-1)
            for _ in range(2))
    return (q, k, torch.randn(B, T, H, DV, generator=gen),
            -torch.rand(B, T, H, generator=gen), torch.rand(B, T, H, generator=gen),
            torch.randn(B, H, DK, DV, generator=gen))


# (module, the higher-order operator's name, the node torch.export gives it)
HOPS = [(ScanDeltaRule, "scan", "scan"), (WhileDeltaRule, "while_loop", "while_loop")]


@pytest.fixture(scope="module", params=HOPS, ids=[h[1] for h in HOPS])
def exported(request):
    module, hop, node = request.param
    return torch.export.export(module(), inputs()), hop, node


def test_exported_program_is_one_hop_node_computing_the_rule(exported):
    program, hop, node = exported
    hops = [n for n in program.graph.nodes if n.op == "call_function"
            and n.target is getattr(torch.ops.higher_order, hop)]
    assert [n.name for n in hops] == [node]
    args = inputs(seed=1)
    with torch.no_grad():
        got, want = program.module()(*args), python_loop(*args)
    for g, w in zip(got, want):
        assert (g - w).abs().max() <= 1e-5 * w.abs().max()


def test_collapse_leaves_a_near_miss_naming_the_hop(exported):
    program, hop, node = exported
    result = gdn_fx.collapse(program)
    assert result.counts["gated_delta_scan"] == 0
    assert [m.node for m in result.misses] == [node]
    text = str(result.misses[0])
    assert f"torch.ops.higher_order.{hop}" in text and f"node {node}" in text, text
    assert node in result.explain()


def test_find_unrolled_reports_the_hop(exported):
    program, hop, node = exported
    found = gdn_fx.find_unrolled(program)
    assert len(found) == 1
    assert f"torch.ops.higher_order.{hop} at node {node}" in found[0], found


def test_export_nnef_refuses_in_one_line_naming_the_node(exported, tmp_path):
    program, hop, node = exported
    with pytest.raises(LoweringUnsupported) as caught:
        gdn_fx.export_nnef(program, tmp_path / "m.nnef.tgz")
    message = str(caught.value)
    assert "\n" not in message and f"higher_order.{hop} at node {node}" in message, message
    assert not (tmp_path / "m.nnef.tgz").exists()


def test_export_nnef_with_dynamic_axes_refuses_naming_the_node(exported, tmp_path):
    program, hop, node = exported
    with pytest.raises(GdnFxError) as caught:
        gdn_fx.export_nnef(program, tmp_path / "m.nnef.tgz", dynamic_axes={"q": {1: "S"}})
    message = str(caught.value)
    assert "\n" not in message and f"at node {node}" in message, message
