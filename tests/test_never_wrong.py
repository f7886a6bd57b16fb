"""Never silently wrong (issue 14): however a user writes a loop, collapse is right or says why.

The contract, checked by ``assert_fused_equal_or_explained`` for every case:

* ``gdn_fx.collapse`` never raises;
* fused (``counts["gated_delta_scan"] >= 1``): the collapsed program's outputs, and every input
  it writes in place, equal the eager module's within 1e-4 relative, on fresh random inputs
  (not the ones the program was traced with);
* not fused: at least one near-miss in ``result.misses`` (and the program still computes what
  the module computes: leaving a loop alone must not break it either).

The loops are written the way other authors write them (stacks along any axis, buffers and
views of buffers, broadcast gates, einsum, vmap next to the loop, FLA's naive reference), not
the way the project's own references are. Five one-change mutants of the stacked loop compute
something else: they must stay unfused (or, surprisingly, fuse and still agree).

Class 4 of the issue, at the end: a dynamic-axis NNEF export of a loop that collapse left
unrolled must be refused (ExportRefused naming a node), never written frozen at the traced T.
"""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

import gdn_fx
from gdn_fx.errors import ExportRefused
from programs import FORMS, export_form, flat, graph_of, max_rel

RTOL = 1e-4


# --- the contract ------------------------------------------------------------------------

def _fresh_like(args: tuple, seed: int = 1234) -> tuple:
    """New random values shaped like ``args``, in the same range class (log decays stay
    negative, betas in [0, 1]) so the recurrence stays as tame as the traced one."""
    gen = torch.Generator().manual_seed(seed)
    fresh = []
    for a in args:
        if (a <= 0).all():
            x = -torch.rand(a.shape, generator=gen)
        elif ((a >= 0) & (a <= 1)).all():
            x = torch.rand(a.shape, generator=gen)
        else:
            x = torch.randn(a.shape, generator=gen)
        fresh.append(x.to(a.dtype))
    return tuple(fresh)


def _call(program, args: tuple) -> tuple[list, tuple]:
    """Like programs.run, but also hands back the cloned inputs the call may have written."""
    args = tuple(a.clone() for a in args)
    fn = program.module() if isinstance(program, torch.export.ExportedProgram) else program
    return flat(fn(*args)), args


def assert_fused_equal_or_explained(module: nn.Module, args: tuple, form: str,
                                    has_loop: bool = True):
    """Collapse ``module`` exported in ``form``; check the never-silently-wrong contract.

    ``has_loop=False`` for a program with nothing loop-like in it: there is nothing to fuse
    and nothing to explain (an ordinary graph has no near-misses), only outputs to keep.
    """
    program = export_form(module, args, form)
    result = gdn_fx.collapse(program)  # must never raise, whatever the program holds
    fused = result.counts.get("gated_delta_scan", 0)
    if not has_loop:
        assert fused == 0, result.explain()
    elif fused == 0:
        reasons = [str(miss) for miss in result.misses]
        assert reasons, "left unfused without a near-miss saying why"
    fresh = _fresh_like(args)
    want, want_inputs = _call(module, fresh)
    got, got_inputs = _call(result.program, fresh)
    report = f"fused {fused}; {result.explain()}"
    assert max_rel(got, want) <= RTOL, report
    assert max_rel(got_inputs, want_inputs) <= RTOL, f"inputs written differently; {report}"
    return result


# --- inputs and the standard step --------------------------------------------------------

def head_major(b=1, h=2, t=4, dk=4, dv=4, seed=0, gate=None) -> tuple:
    """q, k [B, H, T, Dk], v [B, H, T, Dv], g (log decay) and beta [B, H, T] (or g shaped
    ``gate``), state [B, H, Dk, Dv]."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(b, h, t, dk, generator=gen), torch.randn(b, h, t, dk, generator=gen),
            torch.randn(b, h, t, dv, generator=gen),
            -torch.rand(*(gate or (b, h, t)), generator=gen),
            torch.rand(b, h, t, generator=gen), torch.randn(b, h, dk, dv, generator=gen))


def time_major(b=1, h=2, t=4, dk=4, dv=4, seed=0) -> tuple:
    """The same operands sequence-major: q, k [B, T, H, Dk], v [B, T, H, Dv], g, beta
    [B, T, H], state [B, H, Dk, Dv]."""
    q, k, v, g, beta, s0 = head_major(b, h, t, dk, dv, seed)
    return (*(x.transpose(1, 2).contiguous() for x in (q, k, v, g, beta)), s0)


def step(S, q_t, k_t, v_t, g_t, b_t):
    """One gated delta step, written with [..., None] indexing (not the project's unsqueeze)."""
    S = S * torch.exp(g_t)[..., None, None]
    kv = (S * k_t[..., None]).sum(-2)
    delta = (v_t - kv) * b_t[..., None]
    S = S + k_t[..., None] * delta[..., None, :]
    return S, (S * q_t[..., None]).sum(-2)


def head_major_steps(q, k, v, g, beta, s0):
    """Yield (t, state, o_t) along a head-major loop."""
    S = s0
    for t in range(q.shape[2]):
        S, o = step(S, q[:, :, t], k[:, :, t], v[:, :, t], g[:, :, t], beta[:, :, t])
        yield t, S, o


# --- 1. the output gathered along another axis than the op's -----------------------------

STACKS = {
    "stack0": lambda outs: torch.stack(outs),                          # [T, B, H, Dv]
    "stack_last": lambda outs: torch.stack(outs, dim=-1),              # [B, H, Dv, T]
    "stack1": lambda outs: torch.stack(outs, dim=1),                   # [B, T, H, Dv]
    "stack2": lambda outs: torch.stack(outs, dim=2),                   # [B, H, T, Dv]
    "stack0_permuted": lambda outs: torch.stack(outs).permute(1, 2, 0, 3),
    "stack1_transposed": lambda outs: torch.stack(outs, dim=1).transpose(1, 2),
    "stack2_transposed": lambda outs: torch.stack(outs, dim=2).transpose(1, 2),
    "stack1_reshaped": lambda outs: torch.stack(outs, dim=1).flatten(1, 2),
    "stack2_reshaped": lambda outs: torch.stack(outs, dim=2).flatten(1, 2),
    "stack_last_flat": lambda outs: torch.stack(outs, dim=-1).flatten(-2),
    "cat_last": lambda outs: torch.cat(outs, dim=-1),                  # [B, H, T * Dv]
}


class Stacked(nn.Module):
    """The loop's outputs collected in a list and stacked (or cat) at the end."""

    def __init__(self, gather: str):
        super().__init__()
        self.gather = gather

    def forward(self, q, k, v, g, beta, s0):
        outs, S = [], s0
        for _, S, o in head_major_steps(q, k, v, g, beta, s0):
            outs.append(o)
        return STACKS[self.gather](outs), S


BUFFERS = ("time_major", "time_major_permuted", "time_major_reshaped", "time_last")


class Buffered(nn.Module):
    """The outputs written into a preallocated buffer inside the loop."""

    def __init__(self, layout: str):
        super().__init__()
        self.layout = layout

    def forward(self, q, k, v, g, beta, s0):
        b, h, t, dv = v.shape
        last = self.layout == "time_last"
        buf = v.new_zeros(b, h, dv, t) if last else v.new_zeros(t, b, h, dv)
        S = s0
        for i, S, o in head_major_steps(q, k, v, g, beta, s0):
            if last:
                buf[..., i] = o
            else:
                buf[i] = o
        if self.layout == "time_major_permuted":
            buf = buf.permute(1, 2, 0, 3)
        elif self.layout == "time_major_reshaped":
            buf = buf.reshape(t * b, h, dv)
        return buf, S


# T == H hides a time/head axis swap in the shapes; Dk != Dv hides nothing of the state's.
SQUARE_TH = dict(b=2, h=3, t=3, dk=4, dv=6)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("gather", STACKS)
def test_stacked_outputs(gather, form):
    assert_fused_equal_or_explained(Stacked(gather), head_major(**SQUARE_TH), form)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("layout", BUFFERS)
def test_buffered_outputs(layout, form):
    assert_fused_equal_or_explained(Buffered(layout), head_major(**SQUARE_TH), form)


# --- 2. outputs written through a view ---------------------------------------------------

class ThroughView(nn.Module):
    """The loop writes into a view; what is returned is the base (or the view and the base)."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind

    def forward(self, q, k, v, g, beta, s0):
        b, h, t, dv = v.shape
        if self.kind == "transposed":      # a [B, T, H, Dv] result filled head-major
            base = q.new_zeros(b, t, h, dv)
            buf = base.transpose(1, 2)
        elif self.kind == "tail_slice":    # the last T of a longer buffer
            base = q.new_zeros(b, h, t + 2, dv)
            buf = base[:, :, 2:]
        else:                              # viewed before the loop, both returned
            buf = q.new_zeros(b, h, t, dv)
            base = buf.view(b, h * t, dv)
        S = s0
        for i, S, o in head_major_steps(q, k, v, g, beta, s0):
            buf[:, :, i] = o
        if self.kind == "viewed_before":
            return buf, base, S
        return base, S


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("kind", ["transposed", "tail_slice", "viewed_before"])
def test_outputs_written_through_a_view(kind, form):
    assert_fused_equal_or_explained(ThroughView(kind), head_major(b=1, h=2, t=4, dv=6), form)


class IntoCallerBuffers(nn.Module):
    """Outputs written into a caller's buffer and the state written back: mutated inputs."""

    def forward(self, q, k, v, g, beta, s0, out):
        S = s0
        for i, S, o in head_major_steps(q, k, v, g, beta, s0):
            out[:, :, i] = o
        s0.copy_(S)
        return S * 1.0  # a fresh tensor: the written inputs are what is compared


@pytest.mark.parametrize("form", FORMS)
def test_outputs_and_state_written_into_inputs(form):
    args = head_major(b=2, h=2, t=4, dk=4, dv=6)
    args = args + (torch.zeros(2, 2, 4, 6),)
    assert_fused_equal_or_explained(IntoCallerBuffers(), args, form)


# --- 3. a gate broadcast across heads or time --------------------------------------------

GATES = {  # g's shape for B=2, H=2, T=4, and how step t reads it (all broadcast over H or T)
    "heads_T1": ((2, 4, 1), lambda g, t: g[:, t]),        # [B, 1]: one decay for all heads
    "heads_1T": ((2, 1, 4), lambda g, t: g[:, :, t]),     # [B, 1]
    "time_constant": ((2, 2), lambda g, t: g),            # [B, H] at every step
    "time_index0": ((2, 2, 1), lambda g, t: g[:, :, 0]),  # [B, H], the same index each step
}


class BroadcastGate(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.read = GATES[kind][1]

    def forward(self, q, k, v, g, beta, s0):
        outs, S = [], s0
        for t in range(q.shape[2]):
            S, o = step(S, q[:, :, t], k[:, :, t], v[:, :, t], self.read(g, t), beta[:, :, t])
            outs.append(o)
        return torch.stack(outs, dim=2), S


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("kind", GATES)
def test_gate_broadcast_across_heads_or_time(kind, form):
    args = head_major(b=2, h=2, t=4, dk=4, dv=6, gate=GATES[kind][0])
    assert_fused_equal_or_explained(BroadcastGate(kind), args, form)


# --- 4. torch.vmap in the program --------------------------------------------------------

class VmapMaskAndLoop(nn.Module):
    """A causal mask built by vmap over positions (a cumulative sum of v), next to the loop."""

    def forward(self, q, k, v, g, beta, s0):
        pos = torch.arange(q.shape[2])
        mask = torch.vmap(lambda i: (pos <= i).to(v.dtype))(pos)  # [T, T]
        running = torch.einsum("ts,bhsd->bhtd", mask, v)
        outs, S = [], s0
        for _, S, o in head_major_steps(q, k, v, g, beta, s0):
            outs.append(o)
        return torch.stack(outs, dim=2) + running, S


class VmapOnly(nn.Module):
    """vmap and no loop at all: collapse has nothing to do and must not break it."""

    def forward(self, q, k, v, g, beta, s0):
        # vmap over batch then heads (in_dims=1 trips torch.export itself, torch 2.13)
        per_row = torch.vmap(torch.vmap(lambda x, y: (x.softmax(-1) * y).sum(-1)))
        return per_row(q, k), s0.sum(-1)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("module", [VmapMaskAndLoop, VmapOnly], ids=lambda m: m.__name__)
def test_programs_with_vmap(module, form):
    assert_fused_equal_or_explained(module(), head_major(t=5), form,
                                    has_loop=module is not VmapOnly)


# --- 5. algebraically identical steps written differently --------------------------------

class EinsumStep(nn.Module):
    """The step with einsum readouts of k and q against the state."""

    def forward(self, q, k, v, g, beta, s0):
        outs, S = [], s0
        for t in range(q.shape[2]):
            k_t = k[:, :, t]
            S = S * g[:, :, t].exp()[..., None, None]
            delta = (v[:, :, t] - torch.einsum("bhk,bhkv->bhv", k_t, S)) * beta[:, :, t, None]
            S = S + torch.einsum("bhk,bhv->bhkv", k_t, delta)
            outs.append(torch.einsum("bhk,bhkv->bhv", q[:, :, t], S))
        return torch.stack(outs, dim=2), S


class FlaNaive(nn.Module):
    """In the style of FLA's naive recurrent reference: sequence-major operands made
    head-major and float32 inside, scaled q, a preallocated output, einsum readout."""

    def forward(self, q, k, v, g, beta, s0):
        dtype = v.dtype
        q, k, v, g, beta = (x.transpose(1, 2).contiguous().float() for x in (q, k, v, g, beta))
        q = q * q.shape[-1] ** -0.5
        S = s0.float()
        o = torch.zeros_like(v)
        for i in range(q.shape[2]):
            k_i, v_i = k[:, :, i], v[:, :, i]
            S = S * g[:, :, i].exp()[..., None, None]
            v_i = (v_i - (S * k_i[..., None]).sum(-2)) * beta[:, :, i][..., None]
            S = S + k_i.unsqueeze(-1) * v_i.unsqueeze(-2)
            o[:, :, i] = torch.einsum("bhd,bhdm->bhm", q[:, :, i], S)
        return o.transpose(1, 2).contiguous().to(dtype), S


@pytest.mark.parametrize("form", FORMS)
def test_einsum_step(form):
    assert_fused_equal_or_explained(EinsumStep(), head_major(b=2, t=5, dk=4, dv=8), form)


@pytest.mark.parametrize("form", FORMS)
def test_fla_naive_reference(form):
    assert_fused_equal_or_explained(FlaNaive(), time_major(b=2, t=5, dk=6, dv=4), form)


# --- 6. one-change mutants of the stacked loop: another algebra --------------------------

class Mutant(nn.Module):
    """Case 1's stacked loop with one change at every step (or, for "order", two indices
    swapped). None of these is the op; Dk == Dv so no mutant is stopped by a shape."""

    def __init__(self, change: str):
        super().__init__()
        self.change = change

    def forward(self, q, k, v, g, beta, s0):
        outs, S, c = [], s0, self.change
        for t in range(q.shape[2]):
            i = {1: 2, 2: 1}.get(t, t) if c == "order" else t
            q_t, k_t, v_t, decay = q[:, :, i], k[:, :, i], v[:, :, i], g[:, :, i].exp()
            if c != "decay_after_update":
                S = S * decay[..., None, None]
            delta = v_t - (S * k_t[..., None]).sum(-2)
            if c != "no_beta":
                delta = delta * beta[:, :, i, None]
            before = S
            S = S + k_t[..., None] * delta[..., None, :]
            if c == "decay_after_update":
                S = S * decay[..., None, None]
            read = before if c == "read_before_update" else S
            outs.append((read * (k_t if c == "qk_swapped" else q_t)[..., None]).sum(-2))
        return torch.stack(outs, dim=2), S


MUTANTS = ["read_before_update", "decay_after_update", "no_beta", "qk_swapped", "order"]


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("change", MUTANTS)
def test_mutants_are_not_fused_wrongly(change, form):
    assert_fused_equal_or_explained(Mutant(change), head_major(t=4), form)


# --- class 4: dynamic export of a loop left unrolled is refused --------------------------

T_TRACED = 4
DYNAMIC = {  # module, its inputs at the traced T, the axis of T in q, k, v, g, beta
    "einsum_step": (EinsumStep, head_major(t=T_TRACED), 2),
    "fla_naive": (FlaNaive, time_major(t=T_TRACED), 1),
}


def _named_nodes(message: str, program) -> list[str]:
    """Node names the message cites that exist in the program (or its functional form,
    which export_nnef traces)."""
    from gdn_fx.lowering.t2n.traceable import traceable_module

    names = {n.name for n in graph_of(program).nodes}
    names |= {n.name for n in traceable_module(program).graph.nodes}
    return [m for m in re.findall(r"node '?(\w+)", message) if m in names]


@pytest.mark.parametrize("case", DYNAMIC)
def test_dynamic_export_of_an_unrolled_loop_is_refused(case, tmp_path):
    module, args, axis = DYNAMIC[case]
    result = gdn_fx.collapse(torch.export.export(module(), args))
    axes = {name: {axis: "S"} for name in ("q", "k", "v", "g", "beta")}
    path = tmp_path / "m.nnef.tgz"
    if result.counts.get("gated_delta_scan", 0) and not gdn_fx.find_unrolled(result.program):
        # Once collapse learns the loop nothing is frozen at T_TRACED: the export may proceed.
        gdn_fx.export_nnef(result.program, path, dynamic_axes=axes)
        return
    with pytest.raises(ExportRefused) as refused:
        gdn_fx.export_nnef(result.program, path, dynamic_axes=axes)
    assert _named_nodes(str(refused.value), result.program), str(refused.value)
    assert not path.exists()
