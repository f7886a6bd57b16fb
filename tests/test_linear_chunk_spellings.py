"""Other authors' CHUNKED spellings of the gated linear recurrence fuse into one
gated_linear_scan; one-change mutants do not become an op that computes something else
(the chunk rule's four-input form, held out: tests/linear_chunk_spellings.py).

For every spelling of ``linear_chunk_spellings.SPELLINGS``:

- the corpus is honest: the eager module equals test_linear_spellings' float64 loop of
  S = S * exp(g) + k v^T, o = c q^T S (not gdn_fx's), on ordinary and on wide inputs;
- in the training IR (and, for the first spelling of each author's style, in
  ``run_decompositions({})``, ``run_decompositions()`` and under ``make_fx``),
  ``gdn_fx.collapse`` makes exactly one ``gated_linear_scan`` and no ``gated_delta_scan``,
  leaves no floating cumsum (the whole chunk algebra went, not one chunk of it), and the
  collapsed program computes what the module computes on ordinary inputs and on wide ones
  (log gates down to -50, values and states of order 1e3). A faithful spelling the rule does
  not take yet (``NOT_YET``, its near-miss quoted) is a strict xfail that must still compute
  what the module computes: only ``NotYet`` (not fused, or not whole) counts as the expected
  failure, a wrong result fails.

For every mutant: a change of the recurrence itself (``inside``) fuses nothing (neither op)
and leaves a near-miss; any other change may fuse only into something that computes it;
either way the collapsed program equals the eager mutant on ordinary and wide inputs, and
``gdn_fx.compare_programs(base, mutant)`` does not call them the same.
"""

from __future__ import annotations

import functools

import pytest
import torch

import gdn_fx
from linear_chunk_spellings import MUTANT, MUTANTS, SPELLING, SPELLINGS
from tensors import clone
from test_linear_spellings import (DELTA, LINEAR, assert_computes, assert_differs, assert_honest,
                                   assert_mutant_verdict)
from test_wide_domain import _make_fx, report

FORMS = ("training", "functional", "core", "make_fx")

# Faithful spellings the rule does not take (whole) yet, and their near-misses. (A per-chunk
# loop whose state [B*H, Dk, Dv] also reads as a chunk's output, Dk as long as a chunk or a
# gate per key, fused chunk by chunk once: the swapped reading stopped the extension.)
NOT_YET = {
    "bmm_chunks_buffer": (
        "the chunk outputs written into a zeros buffer made before the loop by slice "
        "(out[:, lo:lo + C] = ...): near-miss 'chunked form by meaning: its value cumsum is "
        "also read by unsqueeze outside it' for every chunk's cumsum; nothing fuses (with no "
        "initial state the last chunk alone would)"),
}


class NotYet(Exception):
    """A faithful spelling not fused whole: the expected failure of a NOT_YET case."""


# --- shared programs -------------------------------------------------------------------------

def _entry(name: str):
    """(module, example inputs, the inputs builder, style) of a spelling or a mutant (a mutant
    takes its base's inputs)."""
    if name in SPELLING:
        s = SPELLING[name]
        return s.module(), s.args("example"), s.args, s.style
    m = MUTANT[name]
    base = SPELLING[m.base]
    return m.module(), base.args("example"), base.args, base.style


def _needs(name: str) -> None:
    if _entry(name)[3] == "hf_mamba2":
        pytest.importorskip("transformers")


@functools.cache
def program_of(name: str, form: str):
    """A spelling or mutant in one of FORMS (built once, shared by every test)."""
    module, args, _, _ = _entry(name)
    if form == "make_fx":
        return _make_fx(module, args)
    if form == "training":
        return torch.export.export(module, clone(args))
    return program_of(name, "training").run_decompositions({} if form == "functional" else None)


@functools.cache
def collapsed(name: str, form: str):
    return gdn_fx.collapse(program_of(name, form))


# also in every form: the padded output (transformers pads to whole chunks inside the region)
EVERY_FORM = ("hf_ssd_c16_t37_groups2",)


def _per_form(cases, group) -> list:
    """(name, form) params: every case in the training IR; the first case of each group
    (an author's style, or a mutant's base) also in the decompositions and under make_fx.
    NOT_YET cases are strict xfails that only ``NotYet`` satisfies."""
    firsts = {}
    for case in cases:
        firsts.setdefault(group(case), case)
    params = []
    for case in cases:
        for form in FORMS:
            if form != "training" and firsts[group(case)] is not case and \
                    case.name not in EVERY_FORM:
                continue
            marks = [pytest.mark.xfail(strict=True, raises=NotYet, reason=NOT_YET[case.name])] \
                if case.name in NOT_YET else []
            params.append(pytest.param(case.name, form, marks=marks, id=f"{case.name}-{form}"))
    return params


def _graph(program):
    return program.graph_module.graph if isinstance(program, torch.export.ExportedProgram) \
        else program.graph


def _cumsums(result) -> list:
    """The floating cumsums left in the collapsed program (a chunk's cumulative decay)."""
    return [n.name for n in _graph(result.program).nodes
            if n.target is torch.ops.aten.cumsum.default
            and n.meta.get("val") is not None and n.meta["val"].dtype.is_floating_point]


def _computes(name: str, form: str, result) -> None:
    """The collapsed program equals the eager module on ordinary and on wide inputs."""
    module, _, build, _ = _entry(name)
    assert_computes(name, form, result, module, build)


# --- the corpus ------------------------------------------------------------------------------

def test_the_corpus_covers_what_was_asked():
    names = [s.name for s in SPELLINGS] + [m.name for m in MUTANTS]
    assert len(names) == len(set(names))
    assert {s.style for s in SPELLINGS} >= {"hf_mamba2", "minimal_ssd", "fla_chunk_simple_gla",
                                           "retention_chunkwise", "bmm_chunks"}
    assert all(m.base in SPELLING for m in MUTANTS)
    assert set(NOT_YET) <= set(SPELLING)
    hf = [s.module() for s in SPELLINGS if s.style == "hf_mamba2"]
    assert {(m.chunk, m.D is None) for m in hf} >= {(16, False), (32, True), (256, True)}


@pytest.mark.parametrize("name", [s.name for s in SPELLINGS])
def test_spelling_computes_the_gated_linear_recurrence(name):
    """The eager module equals the float64 loop: the spelling really is the recurrence."""
    _needs(name)
    assert_honest(SPELLING[name])


@pytest.mark.parametrize("name", [m.name for m in MUTANTS])
def test_mutant_differs_from_its_base(name):
    _needs(name)
    assert_differs(MUTANT[name], SPELLING[MUTANT[name].base])


# --- collapse ----------------------------------------------------------------------------------

@pytest.mark.parametrize("name, form", _per_form(SPELLINGS, lambda s: s.style))
def test_spelling_fuses_into_one_gated_linear_scan(name, form):
    _needs(name)
    result = collapsed(name, form)
    fused, delta = result.counts.get(LINEAR, 0), result.counts.get(DELTA, 0)
    assert delta == 0, f"{name} ({form}): a gated linear region became {DELTA}; {report(result)}"
    _computes(name, form, result)  # first: a wrong result is never the expected failure
    left = _cumsums(result)
    if name in NOT_YET and (fused != 1 or left):
        assert fused or result.misses, f"{name} ({form}): left without a near-miss"
        raise NotYet(f"{fused} {LINEAR}, cumsums left {left}; {report(result)}")
    assert fused == 1, f"{name} ({form}): {fused} {LINEAR}; {report(result)}"
    assert not left, f"{name} ({form}): the chunk algebra is left ({left}): one chunk fused, " \
                     f"not the region; {report(result)}"


@pytest.mark.parametrize("name, form", _per_form(MUTANTS, lambda m: m.base))
def test_mutant_is_never_fused_wrongly(name, form):
    _needs(name)
    result = collapsed(name, form)
    _computes(name, form, result)
    assert_mutant_verdict(name, form, MUTANT[name], result)


@pytest.mark.parametrize("name", [m.name for m in MUTANTS])
def test_compare_programs_tells_mutant_from_its_base(name):
    _needs(name)
    said = gdn_fx.compare_programs(program_of(MUTANT[name].base, "training"),
                                   program_of(name, "training"))
    assert said is not None, f"{name} ({MUTANT[name].change}): compare_programs says the same"
