"""Signed decays and one-slice piecewise changes are not fused into the plain op (issue 61,
"Never silently wrong, round 4", Must show 1).

For every case of ``signed_spellings``:

- the corpus is honest (eager float64, no gdn_fx): every loop is the delta rule over the
  factors it multiplies its state by (a float64 rule written here), the conv bases are the
  update; a signed case is finite on inputs with negative factors, where the plain op's
  reading exp(log(factor)) is NaN (and equals it on positive factors); a one-slice piece
  equals its base within 1e-6 on ordinary draws, differs from it by more than 1e-3 on inputs
  that cross its threshold, and (on a head or batch entry) not on the first and last entries
  of the batch and head axes; no piece adds a switch operation to the graph;
- in the training IR, ``run_decompositions({})``, ``run_decompositions()`` and under
  ``make_fx``, ``gdn_fx.collapse`` with default options does not make it the plain op: the
  collapsed program computes what the eager case computes on crossing inputs (negative
  factors, gates past the floor, states past the cap), compared relative to each output's
  largest magnitude; a change inside the recurrence leaves nothing fused; a region left
  unfused has a near-miss;
- ``gdn_fx.compare_programs`` tells each case from its plain program (a piece's base, a
  signed case's plain-op reading exp(log(factor))), whichever side is the original.

Controls: the same loops over provably positive factors (exp(g), sigmoid(x), exp(-softplus(x))
in the graph) and the pieces' bases fuse (one op) in every form and compute the loop on wide
inputs; chunked forms over cumulative products of a positive factor (no cumsum: the chunk
rule does not see them) stay unrolled and right. Every case runs in the training IR and
under make_fx; the two decompositions run the first case of each base.

Where torch itself cannot build a form (a literal tensor inside a ``scan`` body does not
survive ``run_decompositions``), the case is an xfail naming torch.
"""

from __future__ import annotations

import functools

import pytest
import torch

import gdn_fx
from signed_spellings import (
    BASES, CASE, CHUNK_CONTROLS, CONTROLS, CONV_BASES, CONV_PIECES, DECAYS, DK, MUST_NOT_FUSE,
    PIECES, PLAINS, SIGNED, SIGNED_CASES, decay_of,
)
from tensors import clone
from test_piecewise import eager, run
from test_wide_domain import SWITCH_OPS, _make_fx, agree, report, update64

SCAN, CONV = "gated_delta_scan", "causal_conv1d_update"
FORMS = ("training", "functional", "core", "make_fx")


def op_of(case) -> str:
    return CONV if case.family == "conv" else SCAN


def in64(case, module):
    return module.double() if case.family == "conv" else module


def scale_of(case) -> float:
    return DK ** -0.5 if BASES[case.base].scale == "rsqrt" else 1.0


def rule64(x: dict, scale: float):
    """The delta rule over multiplicative factors d (any sign; [B, T, H] or, a factor per key
    channel, [B, T, H, Dk]), one position at a time in float64."""
    q, k, v, d, beta, S = (x[n].double() for n in ("q", "k", "v", "d", "beta", "s0"))
    outs = []
    for t in range(q.shape[1]):
        f = d[:, t, ..., None] if d.dim() == 4 else d[:, t, :, None, None]
        S = f * S
        err = v[:, t] - torch.einsum("bhk,bhkv->bhv", k[:, t], S)
        S = S + torch.einsum("bhk,bhv->bhkv", k[:, t], beta[:, t, :, None] * err)
        outs.append(scale * torch.einsum("bhk,bhkv->bhv", q[:, t], S))
    return torch.stack(outs, 1), S


def canonical_outputs(case, x: dict):
    """The case's module on canonical float64 operands x: (o [B, T, H, Dv], S [B, H, Dk, Dv])."""
    base = BASES[case.base]
    with torch.no_grad():
        return base.outs(case.module()(*base.args(case.named(x))))


@functools.cache
def program_of(name: str, form: str):
    """The case in one of FORMS (the exports shared by every test)."""
    case = CASE[name]
    if case.hop:  # torch traces a scan body through dynamo, which caches by code object: the
        torch._dynamo.reset()  # bodies of other cases (same code) must not be reused
    if form == "make_fx":
        return _make_fx(case.module(), case.args("example"), case.hop)
    if form == "training":
        return torch.export.export(case.module(), clone(case.args("example")))
    return program_of(name, "training").run_decompositions({} if form == "functional" else None)


def program(name: str, form: str):
    """``program_of``, or an xfail naming torch where torch cannot build that form (a
    literal tensor inside a ``scan`` body does not survive ``run_decompositions``)."""
    try:
        return program_of(name, form)
    except Exception as e:  # torch's own tracing or decomposition, never gdn_fx
        pytest.xfail(f"torch cannot build the {form} form of {name}: {type(e).__name__}: "
                     f"{str(e).splitlines()[0]}")


@functools.cache
def _collapsed(name: str, form: str):
    return gdn_fx.collapse(program_of(name, form))


def collapsed(name: str, form: str):
    program(name, form)
    return _collapsed(name, form)


def _names(cases):
    return [c.name for c in cases]


def _per_form(cases) -> list:
    """(name, form) pairs: every case in the training IR and under make_fx; in the two
    decompositions, the first case of each base (each author's style, each rule): they
    respell the base's ops, not the case's change, and each pair costs an export and a
    collapse (the suite shares its time)."""
    firsts = {}
    for case in cases:
        firsts.setdefault(case.base, case)
    return [(c.name, form) for c in cases for form in FORMS
            if form in ("training", "make_fx") or firsts[c.base] is c]


# --- the corpus -------------------------------------------------------------------------------

def test_the_corpus_covers_every_rule_style_and_slice():
    names = [c.name for c in MUST_NOT_FUSE + CONTROLS + CHUNK_CONTROLS + PLAINS]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
    factor_bases = {b for b, base in BASES.items() if base.log is not True}
    assert {c.base for c in SIGNED_CASES} == factor_bases
    assert {c.decay for c in SIGNED_CASES} == set(SIGNED)
    assert {c.base for c in CONTROLS + CHUNK_CONTROLS} == factor_bases - {"chunk_logabs"}
    assert {c.decay for c in CONTROLS} >= {"exp_before", "sigmoid_before", "exp_neg_softplus"}
    assert {c.family for c in PIECES} == {"step", "scan", "chunk"}
    assert {c.kda for c in PIECES if c.family != "step"} == {False, True}
    assert {c.base for c in PIECES} >= {"hf", "naive", "einsum", "bmm", "kimi", "kda_bmm",
                                        "scan", "scan_kda", "fla_chunk", "fla_chunk_kda"}
    where = " ".join(c.name for c in PIECES)
    assert all(w in where for w in ("head2", "head1", "batch1", "key2"))
    assert {c.base for c in CONV_PIECES} == set(CONV_BASES)
    assert all(not DECAYS[d].signed for d in ("exp_before", "sigmoid_before", "exp_neg_softplus"))


@pytest.mark.parametrize("name", _names(SIGNED_CASES + CONTROLS + CHUNK_CONTROLS + PLAINS))
def test_the_loop_is_the_delta_rule_over_its_factors(name):
    """float64: the loop equals the rule over the factors it multiplies by (signed ones on
    crossing inputs, positive ones on wide inputs), and the conv bases are the update."""
    case = CASE[name]
    if case.family == "conv":
        module = case.module().double()
        x, state = case.args("example", dtype=torch.float64)
        got = eager(module, (x, state))
        want = update64(x, state, module.weight.detach(), module.bias.detach())
        why = agree([got[0], got[2]], list(want), tol=1e-12)
        assert not why, why
        return
    other = {"signed": "cross", "control": "wide"}.get(case.part, "uniform")
    tol = 1e-5 if BASES[case.base].f32 else 1e-9
    for which in ("example", other):
        x = case.tied(case.canonical(which))
        why = agree(canonical_outputs(case, x), rule64(x, scale_of(case)), tol=tol)
        assert not why, f"{case.describe} ({which}): {why}"


@pytest.mark.parametrize("name", _names(SIGNED_CASES))
def test_signed_case_is_finite_where_the_log_is_nan(name):
    """On crossing inputs some factors are negative: the loop is finite, log(factor) is NaN
    and so is the plain op's reading exp(log(factor)); on positive factors the reading is the
    loop."""
    case = CASE[name]
    x = case.canonical("cross")
    assert (x["d"] < 0).any() and (x["d"] > 0).any()
    with torch.no_grad():
        factors = decay_of(case.decay).before(*(case.named(x)[n] for n in ("a", "beta")))
    assert torch.allclose(factors, x["d"].to(factors.dtype), atol=1e-9)
    assert torch.log(factors).isnan().any()
    mutant, reading = case.module(), case.plain.module()
    args = case.args("cross", dtype=torch.float64)
    got = eager(mutant, args)
    assert all(t.isfinite().all() for t in got), f"{case.describe}: not finite"
    assert any(t.isnan().any() for t in eager(reading, args)[:2]), case.describe
    for seed in (0, 1):
        args = case.args("uniform", seed, torch.float64)
        why = agree(eager(mutant, args), eager(reading, args), tol=1e-9)
        assert not why, f"{case.describe}: differs from its reading on positive factors: {why}"


def _first_and_last(case, outs):
    """The outputs on the first and last batch entries and heads (canonical layout), or the
    first and last channels of a conv update."""
    if case.family == "conv":
        return [t[:, [0, -1]] for t in outs[:1]] + [outs[2][:, [0, -1]]]
    o, S = outs
    return [o[[0, -1]][:, :, [0, -1]], S[[0, -1]][:, [0, -1]]]


@pytest.mark.parametrize("name", _names(PIECES + CONV_PIECES))
def test_piece_is_hidden_from_ordinary_draws(name):
    """float64: on uniform [-1, 1] and randn * 0.5 draws the piece is its base within 1e-6."""
    case = CASE[name]
    mutant, base = in64(case, case.module()), in64(case, case.plain.module())
    for which in ("uniform", "randn"):
        for seed in (0, 1):
            args = case.args(which, seed, torch.float64)
            why = agree(eager(mutant, args), eager(base, args), tol=1e-6)
            assert not why, f"{case.describe}: visible on {which} draws (seed {seed}): {why}"


@pytest.mark.parametrize("name", _names(PIECES + CONV_PIECES))
def test_piece_differs_past_its_threshold_on_its_slice(name):
    """On crossing inputs the piece differs from its base by more than 1e-3 (float64 and
    float32); a change on a head, a batch entry or a channel leaves the first and last of
    them as they were."""
    case = CASE[name]
    for dtype in (torch.float64, torch.float32):
        mutant = case.module() if dtype == torch.float32 else in64(case, case.module())
        base = case.plain.module() if dtype == torch.float32 else in64(case, case.plain.module())
        args = case.args("cross", 0, dtype)
        assert agree(eager(mutant, args), eager(base, args), tol=1e-3), \
            f"{case.describe}: no difference ({dtype})"
    if "key" in case.name:  # a key channel's change reaches every head and batch entry
        return
    if case.family == "conv":
        got = eager(in64(case, case.module()), case.args("cross", 0, torch.float64))
        want = eager(in64(case, case.plain.module()), case.args("cross", 0, torch.float64))
    else:
        x = case.tied(case.canonical("cross"))
        got, want = canonical_outputs(case, x), canonical_outputs(case.plain, x)
    why = agree(_first_and_last(case, got), _first_and_last(case, want), tol=1e-9)
    assert not why, f"{case.describe}: seen on the first or last entry: {why}"


@pytest.mark.parametrize("name", _names(PIECES + CONV_PIECES))
def test_piece_is_spelled_without_a_switch(name):
    def ops(ep):
        return {str(n.target)[len("aten."):] for gm in ep.graph_module.modules()
                if isinstance(gm, torch.fx.GraphModule) for n in gm.graph.nodes
                if n.op == "call_function" and str(n.target).startswith("aten.")}

    case = CASE[name]
    added = ops(program_of(name, "training")) - ops(program_of(case.plain.name, "training"))
    switches = {op for op in added if op.split(".")[0] in SWITCH_OPS}
    assert not switches, f"{case.describe}: {sorted(switches)}"


# --- collapse ------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, form", _per_form(MUST_NOT_FUSE))
def test_not_fused_into_the_plain_op(name, form):
    case = CASE[name]
    program_ = program(name, form)
    result = collapsed(name, form)
    fused = result.counts.get(op_of(case), 0)
    crossing = case.args("cross")
    if case.inside:
        assert fused == 0, f"{case.describe} ({form}): fused; {report(result)}"
    if fused == 0:
        assert result.misses, f"{case.describe} ({form}): left without a near-miss; " \
                              f"{report(result)}"
    got = run(result.program, crossing)
    torch_changed = agree(run(program_, crossing), eager(case.module(), crossing), tol=1e-4)
    if torch_changed:  # torch's own decomposition changed what the program computes
        why = agree(got, run(program_, crossing), tol=1e-4)
        assert not why, f"{case.describe} ({form}): the collapsed program differs from the " \
                        f"program on crossing inputs ({why}); {report(result)}"
        pytest.xfail(f"torch: the {form} program is not the module on crossing inputs "
                     f"({torch_changed})")
    why = agree(got, eager(case.module(), crossing), tol=1e-4)
    assert not why, f"{case.describe} ({form}): the collapsed program differs from the module " \
                    f"on crossing inputs ({why}); {report(result)}"


@pytest.mark.parametrize("form", ["training"])  # compare_programs reads any form alike
@pytest.mark.parametrize("name", _names(MUST_NOT_FUSE))
def test_compare_programs_tells_it_from_the_plain_program(name, form):
    case = CASE[name]
    said = gdn_fx.compare_programs(program(case.plain.name, form), program(name, form))
    assert said is not None, f"{case.describe} ({form}): compare_programs(plain, case) says " \
                             f"they are the same"
    assert isinstance(said, str) and said


@pytest.mark.parametrize("form", ["training"])
@pytest.mark.parametrize("name", _names(SIGNED_CASES))
def test_compare_programs_from_the_signed_side(name, form):
    """The signed loop as the original (what translation validation does): its reading
    exp(log(factor)) is not the same program."""
    case = CASE[name]
    said = gdn_fx.compare_programs(program(name, form), program(case.plain.name, form))
    assert said is not None, f"{case.describe} ({form}): compare_programs(case, reading) says " \
                             f"they are the same"


# --- controls ------------------------------------------------------------------------------------

def _assert_fuses_and_computes(case, form, inputs):
    result = collapsed(case.name, form)
    assert result.counts.get(op_of(case), 0) == 1, f"{case.describe} ({form}): {report(result)}"
    module = case.module()
    for which, seed in inputs:
        args = case.args(which, seed)
        why = agree(run(result.program, args), eager(module, args), tol=1e-4)
        assert not why, f"{case.describe} ({form}, {which}): collapsed differs ({why}); " \
                        f"{report(result)}"


@pytest.mark.parametrize("name, form", _per_form(CONTROLS))
def test_positive_factor_control_fuses(name, form):
    _assert_fuses_and_computes(CASE[name], form, [("example", 3), ("wide", 4)])


@pytest.mark.parametrize("name", _names(CHUNK_CONTROLS))
def test_positive_factor_chunked_control_stays_correct(name):
    """A chunked form over cumulative products (cumprod, P_i / P_j) of a positive factor is
    the delta rule over log(factor), but the chunk rule anchors on a cumsum of log gates:
    it is left unrolled, and must stay what it computed."""
    case = CASE[name]
    result = collapsed(name, "training")
    args = case.args("wide", 4)
    why = agree(run(result.program, args), eager(case.module(), args), tol=1e-4)
    assert not why, f"{case.describe}: collapsed differs ({why}); {report(result)}"


@pytest.mark.parametrize("name, form", _per_form(PLAINS))
def test_plain_base_fuses(name, form):
    _assert_fuses_and_computes(CASE[name], form, [("example", 3), ("wide", 4)])
