"""Mamba1's selective scan as other authors write it fuses into one gated_linear_scan (a state
without a value axis: H = D channels, Dv = 1, C one q shared by every channel); one-change
mutants do not become an op that computes something else.

For every spelling of ``mamba1_spellings.SPELLINGS``:

- the corpus is honest: the eager module equals a float64 gated linear scan written here (q =
  C, k = B, v = dt u, g = dt A per (channel, state entry)), on ordinary and wide inputs;
- in the training IR (and, for the first spelling of each author's style, after
  ``run_decompositions({})``, ``run_decompositions()`` and under ``make_fx``),
  ``gdn_fx.collapse`` makes exactly one ``gated_linear_scan`` and no ``gated_delta_scan``, and
  the collapsed program computes what the module computes on ordinary inputs and on wide ones
  (dt up to ~10.5 so dt A reaches below -50, u, z and states of order 1e3). A faithful
  spelling the rule does not take yet (``NOT_YET``) is a strict xfail quoting its near-miss,
  and must still compute what the module computes; one on which collapse raises
  (``RAISES``) is a strict xfail naming the error.

With a symbolic batch (a Dim, min 1) transformers' scan still fuses and computes the same at
batch 1 and 3.

For every mutant, in all four forms: a change of the recurrence itself fuses nothing; any
other change may fuse only into something that computes it; either way the collapsed program
equals the eager mutant on ordinary and wide inputs, and ``gdn_fx.compare_programs(plain,
mutant)`` does not call them the same.
"""

from __future__ import annotations

import functools

import pytest
import torch

import gdn_fx
from mamba1_spellings import MUTANT, MUTANTS, SPELLING, SPELLINGS
from tensors import clone
from test_linear_spellings import (assert_computes, assert_differs, assert_honest,
                                   assert_mutant_verdict)
from test_piecewise import eager, run
from test_wide_domain import _make_fx, agree, report

LINEAR, DELTA = "gated_linear_scan", "gated_delta_scan"
FORMS = ("training", "functional", "core", "make_fx")
TOL = {"example": 1e-5, "wide": 1e-4}  # relative to each output's largest magnitude

# Faithful spellings the rule does not take yet: (a part, stable across the IR forms, of)
# their near-miss; None where collapse says nothing of the loop. The training IR's in full:
NOT_YET = {
    # C[:, None, :, i]: the None index before the time index makes one unsqueeze of the
    # whole C per step, so each step reads a tensor of its own. "gated_delta_scan (step 1 of
    # 5, node sum_2): step 1 reads unsqueeze_5, which step 0 does not"
    "inplace_zeros_skip": "which step 0 does not",
    # the discretization exp(dt_t A), dt_t B_t u_t inside the loop: A [D, N], a parameter,
    # is read by the step but does not multiply the state itself. "gated_delta_scan (step 3
    # of 5, node neg): step 3 reads neg, a tensor from outside the loop that is neither the
    # state nor read position by position"
    # (under make_fx A is a constant, copied into the step: its four reads fit no layout)
    "step_loop": ("a tensor from outside the loop that is neither the state nor read",
                  "no layout of q, k, v, gate, beta fits those shapes"),
    # the loop only updates and collects the state; the readout is after it (no near-miss)
    "mambapy_seq": None,
    # the state started as zeros_like(dBu[:, :, 0]): not seen as an initial state.
    # "gated_delta_scan (step 0 of 5, node add): step 0 reads 0 matrix-shaped values from
    # before the loop (none); a recurrence step reads one initial state"
    "zeros_like_state": "reads 0 matrix-shaped values from before the loop (none)",
    # D * u_i inside the loop: "gated_delta_scan (step 3 of 5, node p_d): step 3 reads p_d, a
    # tensor from outside the loop that is neither the state nor read position by position"
    "skip_gate_in_loop": "a tensor from outside the loop that is neither the state nor read",
}

# Cases on which collapse raises (bugs), with a stable part of the message: none now (q on
# groups of channels, and a readout that does not fit beside a state update that does, raised
# once in the unit-value layouts).
RAISES: dict = {}


class NotFused(AssertionError):
    """A NOT_YET spelling left unfused, with its near-miss (the strict xfail's exception)."""


class CollapseRaises(RuntimeError):
    """collapse raised the RAISES error (the strict xfail's exception)."""


# --- an independent float64 reference ------------------------------------------------------

def scan64(q, k, v, g, s0, *, scale):
    """S = S * exp(g_t) + k_t v_t^T; o_t = scale * q_t^T S, in float64, canonical layout:
    q, k [B, T, Hk, Dk], v [B, T, H, Dv] (value head h reads key head h // (H // Hk)), g
    [B, T, H] or [B, T, H, Dk], s0 [B, H, Dk, Dv] or None. Returns o [B, T, H, Dv], S."""
    q, k, v, g = (x.detach().double() for x in (q, k, v, g))
    b, t, hk, dk = q.shape
    h, dv = v.shape[2], v.shape[3]
    S = torch.zeros(b, h, dk, dv, dtype=torch.float64) if s0 is None \
        else s0.detach().double().clone()
    out = torch.zeros(b, t, h, dv, dtype=torch.float64)
    for i in range(t):
        for head in range(h):
            kh = head // (h // hk)
            decay = g[:, i, head].exp()
            decay = decay[:, None, None] if decay.dim() == 1 else decay[:, :, None]
            S[:, head] = decay * S[:, head] + k[:, i, kh, :, None] * v[:, i, head, None, :]
            out[:, i, head] = scale * (q[:, i, kh, :, None] * S[:, head]).sum(-2)
    return out, S


# --- shared programs -------------------------------------------------------------------------

def _entry(name: str):
    """(module, the inputs builder) of a spelling or a mutant (a mutant takes its base's)."""
    if name in SPELLING:
        return SPELLING[name].module(), SPELLING[name].args
    return MUTANT[name].module(), SPELLING[MUTANT[name].base].args


def _needs(name: str) -> None:
    base = name if name in SPELLING else MUTANT[name].base
    if SPELLING[base].style == "transformers":
        pytest.importorskip("transformers")


@functools.cache
def program_of(name: str, form: str):
    """A spelling or mutant in one of FORMS (built once, shared by every test)."""
    module, build = _entry(name)
    if form == "make_fx":
        return _make_fx(module, build("example"))
    if form == "training":
        return torch.export.export(module, clone(build("example")))
    return program_of(name, "training").run_decompositions({} if form == "functional" else None)


@functools.cache
def _collapsed(name: str, form: str):
    return gdn_fx.collapse(program_of(name, form))


def collapsed(name: str, form: str):
    """collapse's result; a RAISES error as CollapseRaises (any other propagates)."""
    try:
        return _collapsed(name, form)
    except RuntimeError as error:
        if name in RAISES and RAISES[name] in str(error):
            raise CollapseRaises(f"{name} ({form}): collapse raises {error}") from error
        raise


def _cases(cases, group, forms) -> list:
    """(name, form) params: every case in the training IR; in the other ``forms``, the first
    case of each group. NOT_YET and RAISES cases are strict xfails."""
    firsts = {}
    for case in cases:
        firsts.setdefault(group(case), case)
    params = []
    for c in cases:
        for form in forms:
            if form != "training" and firsts[group(c)] is not c:
                continue
            marks = ()
            if c.name in NOT_YET:
                marks = pytest.mark.xfail(strict=True, raises=NotFused,
                                          reason=f"not taken yet: {NOT_YET[c.name]}")
            elif c.name in RAISES:
                marks = pytest.mark.xfail(strict=True, raises=CollapseRaises,
                                          reason=f"collapse raises: {RAISES[c.name]}")
            params.append(pytest.param(c.name, form, marks=marks, id=f"{c.name}-{form}"))
    return params


def _computes(name: str, form: str, result) -> None:
    """The collapsed program equals the eager module on ordinary and on wide inputs."""
    module, build = _entry(name)
    assert_computes(name, form, result, module, build)


# --- the corpus ------------------------------------------------------------------------------

def test_the_corpus_covers_what_was_asked():
    names = [s.name for s in SPELLINGS] + [m.name for m in MUTANTS]
    assert len(names) == len(set(names))
    assert {s.style for s in SPELLINGS} >= {"transformers", "mamba_ssm", "minimal", "inplace",
                                           "groups"}
    assert len(MUTANTS) >= 7 and all(m.base in SPELLING for m in MUTANTS)
    assert set(NOT_YET) <= set(SPELLING) and set(RAISES) <= set(names)
    assert not set(NOT_YET) & set(RAISES)


@pytest.mark.parametrize("name", [s.name for s in SPELLINGS])
def test_spelling_computes_the_selective_scan(name):
    """The eager module equals the float64 scan: the spelling really is Mamba1's."""
    _needs(name)
    assert_honest(SPELLING[name], scan64)


@pytest.mark.parametrize("name", [m.name for m in MUTANTS])
def test_mutant_differs_from_its_base(name):
    assert_differs(MUTANT[name], SPELLING[MUTANT[name].base])


# --- collapse ----------------------------------------------------------------------------------

@pytest.mark.parametrize("name, form", _cases(SPELLINGS, lambda s: s.style, FORMS))
def test_spelling_fuses_into_one_gated_linear_scan(name, form):
    _needs(name)
    result = collapsed(name, form)
    fused, delta = result.counts.get(LINEAR, 0), result.counts.get(DELTA, 0)
    assert delta == 0, f"{name} ({form}): a selective scan became {DELTA}; {report(result)}"
    assert fused <= 1, f"{name} ({form}): {fused} {LINEAR}; {report(result)}"
    _computes(name, form, result)
    if fused == 0 and name in NOT_YET:
        said = [str(m) for m in result.misses]
        if NOT_YET[name] is None:
            assert not said, f"{name} ({form}): a near-miss now: {said}"
        else:
            texts = NOT_YET[name] if isinstance(NOT_YET[name], tuple) else (NOT_YET[name],)
            assert any(text in m for m in said for text in texts), \
                f"{name} ({form}): another near-miss; {report(result)}"
        raise NotFused(f"{name} ({form}): near-miss {said[0] if said else None}")
    assert fused == 1, f"{name} ({form}): {fused} {LINEAR}; {report(result)}"


def test_symbolic_batch_fuses_and_computes_at_batch_1_and_3():
    """transformers' scan exported with the batch a Dim (min 1): one op, and the collapsed
    program equals the module at batch 1 and 3, ordinary and wide inputs."""
    pytest.importorskip("transformers")
    spelling = SPELLING["hf_full"]
    module = spelling.module()
    batch = torch.export.Dim("batch", min=1)
    each = {0: batch}  # HFSelectiveScan.forward(u, dt, Bm, Cm, *rest): z in rest
    program = torch.export.export(module, clone(spelling.args("example")),
                                  dynamic_shapes=(each,) * 4 + ((each,),))
    result = gdn_fx.collapse(program)
    assert result.counts.get(LINEAR, 0) == 1 and result.counts.get(DELTA, 0) == 0, \
        report(result)
    for size in (1, 3):
        for which in ("example", "wide"):
            args = spelling.args(which, 4, batch=size)
            why = agree(run(result.program, args), eager(module, args), tol=TOL[which])
            assert not why, f"batch {size}, {which} inputs: {why}; {report(result)}"


@pytest.mark.parametrize("name, form", _cases(MUTANTS, lambda m: m.name, FORMS))
def test_mutant_is_never_fused_wrongly(name, form):
    result = collapsed(name, form)
    assert_mutant_verdict(name, form, MUTANT[name], result)
    _computes(name, form, result)


@pytest.mark.parametrize("name", [m.name for m in MUTANTS])
def test_compare_programs_tells_mutant_from_plain(name):
    said = gdn_fx.compare_programs(program_of(MUTANT[name].base, "training"),
                                   program_of(name, "training"))
    assert said is not None, f"{name} ({MUTANT[name].change}): compare_programs says the same"
