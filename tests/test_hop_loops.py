"""The delta rule written with torch's loop higher-order operators (``scan``, ``while_loop``).

torch.export keeps each as ONE node with a body graph (torch 2.13 exports both on CPU). A
scan whose body is one delta-rule step is fused (passes/hop.py: the body decided by meaning);
every other looping node is never silent: ``collapse`` leaves a near-miss naming the operator
and its node, ``find_unrolled`` reports it, and ``export_nnef`` refuses it in one line instead
of failing inside torch-to-nnef. The expected values are a plain Python loop written here.
"""

import pytest
import torch
from torch import nn
from torch._higher_order_ops.scan import scan
from torch._higher_order_ops.while_loop import while_loop

import gdn_fx
from gdn_fx import tract_check
from gdn_fx.errors import GdnFxError, LoweringUnsupported

B, T, H, DK, DV = 2, 6, 3, 4, 5
SCAN = torch.ops.gdn_fx.gated_delta_scan.default


class ScanDeltaRule(nn.Module):
    """Sequence-major inputs [B, T, H, D], a log gate; the step is handed to ``scan`` over
    time, written with einsums."""

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


class HeadMajorScan(nn.Module):
    """Another author: head-major inputs [B, H, T, D], a value-first state [B, H, Dv, Dk],
    the decay itself (not its log) handed to the step, q scaled inside the step, the
    arguments to the step in another order, and the outputs in [B, H, T, Dv]."""

    def forward(self, q, k, v, log_decay, beta, state_vk):
        decay = log_decay.exp()

        def step(s, xs):
            b_t, k_t, v_t, q_t, d_t = xs
            s = s * d_t[..., None, None]
            err = v_t - (s @ k_t[..., None])[..., 0]
            s = s + (b_t[..., None] * err)[..., :, None] * k_t[..., None, :]
            return s, (s @ (q_t * DK ** -0.5)[..., None])[..., 0]

        xs = [x.movedim(2, 0) for x in (beta, k, v, q, decay)]
        final, out = scan(step, state_vk, xs)
        return out.movedim(0, 2), final


class ScanReadoutFirst(nn.Module):
    """Not the delta rule: the output reads the state before the update."""

    def forward(self, q, k, v, log_decay, beta, state):
        def step(s, xs):
            q_t, k_t, v_t, a_t, b_t = xs
            s = s * a_t.exp()[..., None, None]
            o = (s * q_t[..., None]).sum(-2)
            delta = (v_t - (s * k_t[..., None]).sum(-2)) * b_t[..., None]
            return s + k_t[..., None] * delta[..., None, :], o

        final, out = scan(step, state, [x.transpose(0, 1) for x in (q, k, v, log_decay, beta)])
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
    """The reference: the gated delta rule, one position at a time ([B, T, H, D] inputs,
    [B, H, Dk, Dv] state)."""
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


def head_major(args):
    """``inputs()`` as HeadMajorScan takes them, and its reference outputs."""
    q, k, v, g, beta, state = args
    out, final = python_loop(q * DK ** -0.5, k, v, g, beta, state)
    moved = tuple(x.transpose(1, 2).contiguous() for x in (q, k, v, g, beta))
    return (*moved, state.transpose(-1, -2).contiguous()), (out.transpose(1, 2),
                                                             final.transpose(-1, -2))


def hop_nodes(program, name):
    return [n.name for n in program.graph.nodes if n.op == "call_function"
            and n.target is getattr(torch.ops.higher_order, name)]


def close(got, want):
    return all(g.shape == w.shape and (g - w).abs().max() <= 1e-5 * w.abs().max()
               for g, w in zip(got, want))


# --- a scan whose body is one delta-rule step: fused ----------------------------------------

FUSED = {"time_major": (ScanDeltaRule, lambda a: (a, python_loop(*a))),
         "head_major": (HeadMajorScan, head_major)}


@pytest.fixture(scope="module", params=sorted(FUSED))
def scanned(request):
    module, convert = FUSED[request.param]
    args, _ = convert(inputs())
    program = torch.export.export(module(), args)
    return program, gdn_fx.collapse(program), convert


def test_the_scan_programs_compute_the_rule(scanned):
    program, _, convert = scanned
    assert hop_nodes(program, "scan") == ["scan"]
    args, want = convert(inputs(seed=1))
    with torch.no_grad():
        assert close(program.module()(*args), want)


def test_collapse_fuses_a_scan_whose_body_is_one_step(scanned):
    _, result, convert = scanned
    assert result.counts["gated_delta_scan"] == 1 and result.misses == []
    graph = result.program.graph
    assert hop_nodes(result.program, "scan") == []
    assert [n.target for n in graph.nodes].count(SCAN) == 1
    assert gdn_fx.find_unrolled(result.program) == []
    args, want = convert(inputs(seed=2))
    with torch.no_grad():
        assert close(result.program.module()(*args), want)


def test_the_fused_scan_runs_in_tract_like_the_loop(scanned, tmp_path):
    _, result, convert = scanned
    path = gdn_fx.export_nnef(result.program, tmp_path / "s.nnef.tgz")
    args, want = convert(inputs(seed=3))
    found = tract_check.compare(path, want, args, tolerance=1e-5)
    assert found.ok, str(found)


def test_a_scan_whose_body_is_not_the_rule_leaves_a_near_miss_naming_it():
    program = torch.export.export(ScanReadoutFirst(), inputs())
    result = gdn_fx.collapse(program)
    assert result.counts["gated_delta_scan"] == 0
    assert [m.node for m in result.misses] == ["scan"]
    text = str(result.misses[0])
    assert "torch.ops.higher_order.scan" in text and "not one delta-rule step" in text, text
    assert "before the update" in text, text


# --- loops no rule fuses: named everywhere --------------------------------------------------

# (module, the higher-order operator's name, the node torch.export gives it)
LEFT = [(WhileDeltaRule, "while_loop", "while_loop"), (ScanReadoutFirst, "scan", "scan")]


@pytest.fixture(scope="module", params=LEFT, ids=[m[0].__name__ for m in LEFT])
def left(request):
    module, hop, node = request.param
    return torch.export.export(module(), inputs()), hop, node


def test_the_while_loop_program_is_one_node_computing_the_rule():
    program = torch.export.export(WhileDeltaRule(), inputs())
    assert hop_nodes(program, "while_loop") == ["while_loop"]
    args = inputs(seed=1)
    with torch.no_grad():
        assert close(program.module()(*args), python_loop(*args))


def test_collapse_leaves_a_near_miss_naming_the_hop(left):
    program, hop, node = left
    result = gdn_fx.collapse(program)
    assert result.counts["gated_delta_scan"] == 0
    assert [m.node for m in result.misses] == [node]
    text = str(result.misses[0])
    assert f"torch.ops.higher_order.{hop}" in text and f"node {node}" in text, text
    assert node in result.explain()


def test_find_unrolled_reports_the_hop(left):
    program, hop, node = left
    found = gdn_fx.find_unrolled(gdn_fx.collapse(program).program)
    assert len(found) == 1
    assert f"torch.ops.higher_order.{hop} at node {node}" in found[0], found


def test_export_nnef_refuses_in_one_line_naming_the_node(left, tmp_path):
    program, hop, node = left
    with pytest.raises(LoweringUnsupported) as caught:
        gdn_fx.export_nnef(program, tmp_path / "m.nnef.tgz")
    message = str(caught.value)
    assert "\n" not in message and f"higher_order.{hop} at node {node}" in message, message
    assert not (tmp_path / "m.nnef.tgz").exists()


def test_export_nnef_with_dynamic_axes_refuses_naming_the_node(left, tmp_path):
    program, hop, node = left
    with pytest.raises(GdnFxError) as caught:
        gdn_fx.export_nnef(program, tmp_path / "m.nnef.tgz", dynamic_axes={"q": {1: "S"}})
    message = str(caught.value)
    assert "\n" not in message and f"at node {node}" in message, message


def test_an_uncollapsed_scan_is_refused_by_export_nnef(tmp_path):
    """The refusal is the lowering's own (a program handed to it as exported)."""
    program = torch.export.export(ScanDeltaRule(), inputs())
    with pytest.raises(LoweringUnsupported, match="higher_order.scan at node scan"):
        gdn_fx.export_nnef(program, tmp_path / "m.nnef.tgz")
