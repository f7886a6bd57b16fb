"""Other authors' spellings of the gated delta recurrence fuse; one-change mutants do not.

For every spelling in ``spellings.SPELLINGS`` and every IR form (the training IR of
``torch.export.export``, ``run_decompositions({})``, ``run_decompositions()``):
``gdn_fx.collapse`` makes exactly the expected number of gated_delta_scan nodes, and the
collapsed program computes what the eager module computes. The eager module itself is checked
against a float64 loop of the delta rule written here (not gdn_fx's), so the corpus is right.

For every mutant: nothing fuses, a near-miss says why, and the program still computes what the
module computes; the mutant really differs from its base spelling in eager. Lookalikes (one
edit, but still a gated delta rule under another gate or scale) may fuse or not, never wrongly.
"""

from __future__ import annotations

import functools

import pytest
import torch

import gdn_fx
from spellings import LOOKALIKES, MUTANT, MUTANTS, SPELLING, SPELLINGS
from tensors import FORMS, clone, flat, in_form

TOL = 1e-5  # f32, relative to each output's largest magnitude


# --- an independent float64 reference ------------------------------------------------------

def scan64(q, k, v, g, beta, s0, *, scale, norm):
    """The gated delta rule, one (batch, head) matrix at a time, in float64.

    q, k [B, T, Hk, Dk], v [B, T, H, Dv], g [B, T, H] or [B, T, H, Dk] (log decay), beta
    [B, T, H], s0 [B, H, Dk, Dv] or None; value head h reads key head h // (H // Hk). ``norm``:
    None, 'rsqrt' (x * rsqrt(|x|^2 + 1e-6)) or 'normalize' (x / max(|x|, 1e-12)) of q and k.
    Returns o [B, T, H, Dv] and the final state [B, H, Dk, Dv]."""
    q, k, v, g, beta = (x.detach().double() for x in (q, k, v, g, beta))
    if norm == "rsqrt":
        q, k = (x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6) for x in (q, k))
    elif norm == "normalize":
        q, k = (x / x.norm(dim=-1, keepdim=True).clamp_min(1e-12) for x in (q, k))
    B, T, Hk, Dk = q.shape
    H, Dv = v.shape[2], v.shape[3]
    group = H // Hk
    state = torch.zeros(B, H, Dk, Dv, dtype=torch.float64) if s0 is None else s0.double().clone()
    out = torch.zeros(B, T, H, Dv, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            M = state[b, h]
            for t in range(T):
                q_t, k_t = q[b, t, h // group], k[b, t, h // group]
                decay = torch.exp(g[b, t, h])
                M = decay.reshape(-1, 1) * M  # a scalar, or one factor per key row (KDA)
                delta = beta[b, t, h] * (v[b, t, h] - k_t @ M)
                M = M + torch.outer(k_t, delta)
                out[b, t, h] = scale * (q_t @ M)
            state[b, h] = M
    return out, state


# --- helpers ---------------------------------------------------------------------------

def assert_same(got, want, tol=TOL, what=""):
    got, want = flat(got), flat(want)
    assert len(got) == len(want), f"{what}{len(got)} outputs, expected {len(want)}"
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape, f"{what}output {i}: shape {tuple(g.shape)} != {tuple(w.shape)}"
        size = max(w.abs().max().item(), 1.0) if w.numel() else 1.0
        torch.testing.assert_close(g.to(w.dtype), w, rtol=tol, atol=tol * size,
                                   msg=lambda m, i=i: f"{what}output {i}: {m}")


def differs(got, want, tol=1e-3) -> bool:
    """True when the outputs differ in number, shape, or by more than ``tol`` relative."""
    got, want = flat(got), flat(want)
    if len(got) != len(want):
        return True
    for g, w in zip(got, want):
        if g.shape != w.shape:
            return True
        if (g - w).abs().max().item() > tol * max(w.abs().max().item(), 1.0):
            return True
    return False


def entry(kind: str, name: str):
    """(module factory, inputs builder) of a spelling or a mutant (a mutant takes its base's
    inputs)."""
    if kind == "spelling":
        return SPELLING[name].module, SPELLING[name].inputs
    return MUTANT[name].module, SPELLING[MUTANT[name].base].inputs


@functools.lru_cache(maxsize=None)
def exported(kind: str, name: str):
    """The module, its example inputs and its training-IR ExportedProgram (built once)."""
    make, inputs = entry(kind, name)
    torch.manual_seed(0)
    module, args = make(), inputs()
    return module, args, torch.export.export(module, clone(args))


def program(kind: str, name: str, form: str):
    module, args, ep = exported(kind, name)
    ep = in_form(ep, form)
    return module, args, ep


def collapse_and_run(kind: str, name: str, form: str):
    module, args, ep = program(kind, name, form)
    result = gdn_fx.collapse(ep)
    want = module(*clone(args))
    got = result.program.module()(*clone(args))
    return result, got, want


# --- the corpus itself -------------------------------------------------------------------

def test_the_corpus_is_as_large_as_promised():
    names = [s.name for s in SPELLINGS] + [m.name for m in MUTANTS + LOOKALIKES]
    assert len(names) == len(set(names))
    assert len(SPELLINGS) >= 32 and len(MUTANTS) >= 16
    assert {s.family for s in SPELLINGS} == {"gdn", "kda"}
    assert all(m.base in SPELLING for m in MUTANTS + LOOKALIKES)


@pytest.mark.parametrize("name", [s.name for s in SPELLINGS])
def test_spelling_computes_the_delta_rule(name):
    """The eager module equals the float64 reference: the spelling is really the recurrence."""
    spelling = SPELLING[name]
    torch.manual_seed(0)
    module, args = spelling.module(), spelling.inputs()
    got = module(*clone(args))
    want = spelling.reference(clone(args), scan64)
    assert_same([x.double() for x in flat(got)], want)


@pytest.mark.parametrize("name", [m.name for m in MUTANTS + LOOKALIKES])
def test_mutant_differs_from_its_base(name):
    """A mutant computes something else than its base spelling on the same inputs."""
    mutant = MUTANT[name]
    base = SPELLING[mutant.base]
    args = base.inputs()
    torch.manual_seed(0)
    assert differs(mutant.module()(*clone(args)), base.module()(*clone(args))), mutant.change


# --- collapse ------------------------------------------------------------------------------

@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("name", [s.name for s in SPELLINGS])
def test_spelling_fuses(name, form):
    spelling = SPELLING[name]
    result, got, want = collapse_and_run("spelling", name, form)
    report = result.explain()
    assert_same(got, want, what=f"collapsed vs eager ({report}): ")
    fused = result.counts.get("gated_delta_scan", 0)
    assert fused == spelling.fusions, f"{fused} fusions, expected {spelling.fusions}; {report}"


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("name", [m.name for m in MUTANTS])
def test_mutant_stays_unfused(name, form):
    result, got, want = collapse_and_run("mutant", name, form)
    report = result.explain()
    assert_same(got, want, what=f"collapsed vs eager ({report}): ")
    fused = result.counts.get("gated_delta_scan", 0)
    assert fused == 0, f"{fused} fusions of a mutant ({MUTANT[name].change}); {report}"
    assert len(result.misses) > 0, f"left unfused without a near-miss saying why; {report}"


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("name", [m.name for m in LOOKALIKES])
def test_lookalike_is_never_wrong(name, form):
    result, got, want = collapse_and_run("mutant", name, form)
    report = result.explain()
    assert_same(got, want, what=f"collapsed vs eager ({report}): ")
    if result.counts.get("gated_delta_scan", 0) == 0:
        assert len(result.misses) > 0, f"left unfused without a near-miss saying why; {report}"
