"""Other authors' spellings of the gated linear recurrence fuse into one gated_linear_scan;
one-change mutants do not become an op that computes something else (issue 62, the corpus).

For every spelling of ``linear_spellings.SPELLINGS``:

- the corpus is honest: the eager module equals a float64 loop of S = S * exp(g) + k v^T,
  o = c q^T S written here (not gdn_fx's), on ordinary and on wide inputs;
- in the training IR and under ``make_fx`` (and, for the first spelling of each author's
  style, ``run_decompositions({})`` and ``run_decompositions()``), ``gdn_fx.collapse`` makes
  exactly one ``gated_linear_scan`` and no ``gated_delta_scan``, and the collapsed program
  computes what the module computes on ordinary inputs and on wide ones (log gates down to
  -50, values and states of order 1e3). A spelling the rule does not take yet (``NOT_YET``)
  is an xfail quoting its near-miss, and must still compute what the module computes.

For every mutant: a change of the recurrence itself fuses nothing (neither op) and leaves a
near-miss; any other change may fuse only into something that computes it; either way the
collapsed program equals the eager mutant on ordinary and wide inputs, and
``gdn_fx.compare_programs(plain, mutant)`` does not call them the same.

And every delta-rule spelling of ``spellings.SPELLINGS`` still fuses into gated_delta_scan,
never into gated_linear_scan (training IR).
"""

from __future__ import annotations

import functools

import pytest
import torch

import gdn_fx
import spellings
from linear_spellings import MUTANT, MUTANTS, SPELLING, SPELLINGS
from tensors import clone, flat
from test_piecewise import eager, run
from test_wide_domain import _make_fx, agree, report

LINEAR, DELTA = "gated_linear_scan", "gated_delta_scan"
FORMS = ("training", "functional", "core", "make_fx")
TOL = {"example": 1e-5, "wide": 1e-4}  # relative to each output's largest magnitude

# Faithful spellings the rule does not take yet: their near-miss (passes/loops.py). None now:
# a decay the same at every position (a per-head constant, buffer or parameter, or a view of
# one written in the loop) is read as an input of the step (loops.take_decays).
NOT_YET: dict = {}


# --- an independent float64 reference ------------------------------------------------------

def scan64(q, k, v, g, s0, *, scale):
    """S = S * exp(g_t) + k_t v_t^T; o_t = scale * q_t^T S, in float64, canonical layout:
    q, k [B, T, Hk, Dk], v [B, T, H, Dv] (value head h reads key head h // (H // Hk)), g
    [B, T, H] or [B, T, H, Dk], s0 [B, H, Dk, Dv] or None. Returns o [B, T, H, Dv], S."""
    q, k, v, g = (x.detach().double() for x in (q, k, v, g))
    b, t, hk, dk = q.shape
    h, dv = v.shape[2], v.shape[3]
    group = h // hk
    S = torch.zeros(b, h, dk, dv, dtype=torch.float64) if s0 is None \
        else s0.detach().double().clone()
    out = torch.zeros(b, t, h, dv, dtype=torch.float64)
    for i in range(t):
        q_t, k_t = (x[:, i].repeat_interleave(group, dim=1) for x in (q, k))
        decay = g[:, i].exp()
        S = (decay[..., None] if decay.dim() == 3 else decay[..., None, None]) * S
        S = S + k_t[..., None] * v[:, i][..., None, :]
        out[:, i] = scale * torch.einsum("bhk,bhkv->bhv", q_t, S)
    return out, S


# --- shared programs -------------------------------------------------------------------------

def _entry(name: str):
    """(module, example inputs, the inputs builder) of a spelling or a mutant (a mutant takes
    its base's inputs)."""
    if name in SPELLING:
        s = SPELLING[name]
        return s.module(), s.args("example"), s.args
    m = MUTANT[name]
    build = SPELLING[m.base].args
    return m.module(), build("example"), build


@functools.cache
def program_of(name: str, form: str):
    """A spelling or mutant in one of FORMS (built once, shared by every test)."""
    module, args, _ = _entry(name)
    if form == "make_fx":
        return _make_fx(module, args)
    if form == "training":
        return torch.export.export(module, clone(args))
    return program_of(name, "training").run_decompositions({} if form == "functional" else None)


@functools.cache
def collapsed(name: str, form: str):
    return gdn_fx.collapse(program_of(name, form))


def _per_form(cases, group) -> list:
    """(name, form) pairs: every case in the training IR and under make_fx; in the two
    decompositions, the first case of each group (an author's style, or a mutant's base):
    they respell the group's ops, and each pair costs an export and a collapse."""
    firsts = {}
    for case in cases:
        firsts.setdefault(group(case), case)
    return [(c.name, form) for c in cases for form in FORMS
            if form in ("training", "make_fx") or firsts[group(c)] is c]


def _computes(name: str, form: str, result) -> None:
    module, _, build = _entry(name)
    assert_computes(name, form, result, module, build)


def assert_computes(name: str, form: str, result, module, build) -> None:
    """The collapsed program equals the eager module on ordinary and on wide inputs
    (``build(which, seed)`` makes them; the other corpora's tests ask it too)."""
    for which in ("example", "wide"):
        args = build(which, 3)
        why = agree(run(result.program, args), eager(module, args), tol=TOL[which])
        assert not why, f"{name} ({form}, {which} inputs): the collapsed program differs from " \
                        f"the module ({why}); {report(result)}"


def assert_mutant_verdict(name: str, form: str, mutant, result) -> None:
    """A change of the recurrence itself fuses nothing; whatever does not fuse is said."""
    fused = result.counts.get(LINEAR, 0) + result.counts.get(DELTA, 0)
    if mutant.inside:
        assert fused == 0, f"{name} ({mutant.change}, {form}): fused; {report(result)}"
    if fused == 0:
        assert result.misses, f"{name} ({form}): left without a near-miss; {report(result)}"


# --- the corpus ------------------------------------------------------------------------------

def test_the_corpus_covers_what_was_asked():
    names = [s.name for s in SPELLINGS] + [m.name for m in MUTANTS]
    assert len(names) == len(set(names))
    assert len(SPELLINGS) >= 16 and len(MUTANTS) >= 9
    assert {s.style for s in SPELLINGS} >= {"fla_simple_gla", "fla_gla", "retention", "mamba2",
                                           "merged", "layouts", "inplace"}
    assert all(m.base in SPELLING for m in MUTANTS)
    assert set(NOT_YET) <= set(SPELLING)


def assert_honest(spelling, scan=None) -> None:
    """The eager module equals the float64 ``scan`` (this file's ``scan64`` by default) on
    ordinary and wide inputs: the spelling really is the recurrence (the corpora of chunked
    forms and Mamba1 loops ask it too)."""
    module = spelling.module()
    for which in ("example", "wide"):
        args = spelling.args(which, 1)
        with torch.no_grad():
            got = flat(module(*clone(args)))
            want = flat(spelling.reference(module, clone(args), scan or scan64))
        why = agree(got, want, tol=TOL[which])
        assert not why, f"{spelling.name} ({which}): {why}"


def assert_differs(mutant, base) -> None:
    """The mutant differs from the spelling it edits on ordinary inputs or on wide ones (a
    cap c tanh(S / c) shows only there)."""
    assert any(agree(eager(mutant.module(), args), eager(base.module(), args), tol=1e-3)
               for args in (base.args("example", 2), base.args("wide", 2))), \
        f"{mutant.name}: the same as {mutant.base} ({mutant.change})"


@pytest.mark.parametrize("name", [s.name for s in SPELLINGS])
def test_spelling_computes_the_gated_linear_recurrence(name):
    assert_honest(SPELLING[name])


@pytest.mark.parametrize("name", [m.name for m in MUTANTS])
def test_mutant_differs_from_its_base(name):
    assert_differs(MUTANT[name], SPELLING[MUTANT[name].base])


# --- collapse ----------------------------------------------------------------------------------

@pytest.mark.parametrize("name, form", _per_form(SPELLINGS, lambda s: s.style))
def test_spelling_fuses_into_one_gated_linear_scan(name, form):
    result = collapsed(name, form)
    fused, delta = result.counts.get(LINEAR, 0), result.counts.get(DELTA, 0)
    assert delta == 0, f"{name} ({form}): a gated linear loop became {DELTA}; {report(result)}"
    if fused == 0 and name in NOT_YET:
        assert result.misses, f"{name} ({form}): left without a near-miss; {report(result)}"
        _computes(name, form, result)
        pytest.xfail(f"{NOT_YET[name]}; near-miss: {result.misses[0]}")
    assert fused == 1, f"{name} ({form}): {fused} {LINEAR}; {report(result)}"
    _computes(name, form, result)


@pytest.mark.parametrize("name, form", _per_form(MUTANTS, lambda m: m.base))
def test_mutant_is_never_fused_wrongly(name, form):
    result = collapsed(name, form)
    assert_mutant_verdict(name, form, MUTANT[name], result)
    _computes(name, form, result)


@pytest.mark.parametrize("name", [m.name for m in MUTANTS])
def test_compare_programs_tells_mutant_from_plain(name):
    said = gdn_fx.compare_programs(program_of(MUTANT[name].base, "training"),
                                   program_of(name, "training"))
    assert said is not None, f"{name} ({MUTANT[name].change}): compare_programs says the same"


# --- delta rules stay delta rules ---------------------------------------------------------------

@pytest.mark.parametrize("name", [s.name for s in spellings.SPELLINGS])
def test_delta_rule_spelling_never_becomes_gated_linear(name):
    spelling = spellings.SPELLING[name]
    torch.manual_seed(0)
    module, args = spelling.module(), spelling.inputs()
    result = gdn_fx.collapse(torch.export.export(module, clone(args)))
    assert result.counts.get(LINEAR, 0) == 0, f"{name}: {report(result)}"
    assert result.counts.get(DELTA, 0) == spelling.fusions, f"{name}: {report(result)}"
