"""Chunked spellings by other authors fuse by what they compute; one-change mutants do not.

For every spelling in ``chunk_spellings.SPELLINGS`` (FLA's naive chunk GDN and KDA references
as FLA writes them, and a per-chunk bmm loop of chunk size 16) and every IR form,
``gdn_fx.collapse`` makes exactly one gated_delta_scan node reading the module's own inputs,
and the collapsed program computes what the eager module computes. The eager modules are
checked against gdn_fx.reference's token-by-token recurrence in float64 (not against the
pass). Every mutant differs from its base in eager, stays unfused, and a near-miss of the
chunked rule says how far off it is.
"""

from __future__ import annotations

import functools

import pytest
import torch

import gdn_fx
from chunk_spellings import MUTANT, MUTANTS, SPELLING, SPELLINGS, TwoFlaChunkLayers, inputs
from gdn_fx.reference import recurrent_delta_rule_reference
from tensors import FORMS, clone, flat, in_form

TOL = 1e-5


def scan64(q, k, v, g, beta, s0, *, scale, norm):
    """The recurrence in float64 (sequence-major, key-first state)."""
    assert norm is None
    return recurrent_delta_rule_reference(
        q.double(), k.double(), v.double(), g.double(), beta.double(), scale=scale,
        initial_state=None if s0 is None else s0.double())


def assert_same(got, want, tol=TOL, what=""):
    got, want = flat(got), flat(want)
    assert len(got) == len(want), f"{what}{len(got)} outputs, expected {len(want)}"
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape, f"{what}output {i}: shape {tuple(g.shape)} != {tuple(w.shape)}"
        error = (g.double() - w.double()).abs().max().item() / max(w.abs().max().item(), 1e-30)
        assert error <= tol, f"{what}output {i} differs by {error:.3g} relative"


@functools.lru_cache(maxsize=None)
def exported(kind: str, name: str):
    """The module, its inputs and its training-IR ExportedProgram (built once)."""
    if kind == "spelling":
        make, inputs = SPELLING[name].module, SPELLING[name].inputs
    else:
        make, inputs = MUTANT[name].module, SPELLING[MUTANT[name].base].inputs
    module, args = make(), inputs()
    return module, args, torch.export.export(module, clone(args))


def collapse(kind: str, name: str, form: str):
    module, args, ep = exported(kind, name)
    ep = in_form(ep, form)
    result = gdn_fx.collapse(ep)
    return result, result.program.module()(*clone(args)), module(*clone(args))


# --- the corpus itself ---------------------------------------------------------------------

def test_the_corpus_is_as_promised():
    names = [s.name for s in SPELLINGS] + [m.name for m in MUTANTS]
    assert len(names) == len(set(names))
    assert {"fla_chunk_gdn", "fla_chunk_kda", "bmm_chunk16_gdn"} <= set(SPELLING)
    assert {s.family for s in SPELLINGS} == {"gdn", "kda"}
    assert len(MUTANTS) >= 7 and all(m.base in SPELLING for m in MUTANTS)
    assert any(SPELLING[s].inputs()[0].shape[2] < SPELLING[s].inputs()[2].shape[2]
               for s in SPELLING), "a spelling with grouped value heads"


@pytest.mark.parametrize("name", [s.name for s in SPELLINGS])
def test_spelling_computes_the_delta_rule(name):
    spelling = SPELLING[name]
    args = spelling.inputs()
    assert_same(spelling.module()(*clone(args)), spelling.reference(clone(args), scan64))


@pytest.mark.parametrize("name", [m.name for m in MUTANTS])
def test_mutant_differs_from_its_base(name):
    mutant = MUTANT[name]
    args = SPELLING[mutant.base].inputs()
    got = flat(mutant.module()(*clone(args)))
    want = flat(SPELLING[mutant.base].module()(*clone(args)))
    assert max((g - w).abs().max().item() / w.abs().max().item()
               for g, w in zip(got, want)) > 1e-3, mutant.change


# --- collapse ------------------------------------------------------------------------------

@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("name", [s.name for s in SPELLINGS])
def test_spelling_fuses(name, form):
    result, got, want = collapse("spelling", name, form)
    report = result.explain()
    assert_same(got, want, what=f"collapsed vs eager ({report}): ")
    assert result.counts["gated_delta_scan"] == 1, report


@pytest.mark.parametrize("name", [s.name for s in SPELLINGS])
def test_fused_node_reads_the_module_inputs(name):
    """The whole region went: the op reads the module's inputs (the state made inside when
    none is given), with FLA's default scale 1/sqrt(Dk), and nothing of the chunk algebra
    (no cumsum, no triu mask, no forward substitution) is left. Grouped value heads: the op
    reads q and k of Hk heads itself (its own h // G), or, tiled (h % Hk), repeated to the
    value heads outside it."""
    result, _, _ = collapse("spelling", name, "training")
    graph = result.program.graph_module.graph
    (node,) = [n for n in graph.nodes if n.target is torch.ops.gdn_fx.gated_delta_scan.default]
    _, args, _ = exported("spelling", name)
    dk = args[0].shape[-1]
    assert node.kwargs["scale"] == pytest.approx(dk ** -0.5)
    tiled = name.endswith("_tiled")
    qk = [a.args[0] if tiled and a.target is torch.ops.aten.repeat.default else a
          for a in node.args[:2]]
    names = [a.name for a in qk + list(node.args[2:5])]
    assert names == ["q", "k", "v", "g", "beta"]
    assert [tuple(a.meta["val"].shape) for a in qk] == [tuple(args[0].shape)] * 2
    left = {n.target for n in graph.nodes}
    assert not left & {torch.ops.aten.cumsum.default, torch.ops.aten.triu.default}
    assert gdn_fx.find_unrolled(result.program) == []
    assert sum(n.op == "call_function" for n in graph.nodes) < 16


@pytest.mark.parametrize("name", [m.name for m in MUTANTS])
def test_mutant_stays_unfused(name):
    result, got, want = collapse("mutant", name, "training")
    report = result.explain()
    assert_same(got, want, what=f"collapsed vs eager ({report}): ")
    assert result.counts["gated_delta_scan"] == 0, f"{MUTANT[name].change}; {report}"
    assert any("chunked form by meaning" in str(m) for m in result.misses), report
    # what stays is frozen at the traced length, and said so (export refuses dynamic axes)
    _, args, _ = exported("mutant", name)
    assert f"chunked recurrence form at node cumsum (length {args[0].shape[1]})" in \
        gdn_fx.find_unrolled(result.program)


@pytest.mark.parametrize("name", [s.name for s in SPELLINGS])
def test_find_unrolled_names_the_chunked_form(name):
    """Every chunked spelling, padded or not, FLA's KDA (no pad: T a multiple of the chunk)
    and the per-chunk bmm loop included, is named frozen at its length before collapse."""
    _, args, program = exported("spelling", name)
    found = gdn_fx.find_unrolled(program)
    assert f"chunked recurrence form at node cumsum (length {args[0].shape[1]})" in found, \
        found


def test_near_miss_names_the_chunk_where_it_goes_wrong():
    result, _, _ = collapse("mutant", "fla_gdn_state_not_carried", "training")
    (miss,) = [m for m in result.misses if "chunked form by meaning" in str(m)]
    assert "position 64, the start of chunk 1" in str(miss), str(miss)


def test_two_stacked_chunk_calls_fuse_each():
    """The second call reads the first one's output (through the caller's contiguous) and its
    final state (also handed out): two regions, two fusions, the same outputs."""
    module, args = TwoFlaChunkLayers(), inputs(1, 70, 2, 8, 8, seed=11)()
    result = gdn_fx.collapse(torch.export.export(module, clone(args)))
    assert result.counts["gated_delta_scan"] == 2, result.explain()
    assert_same(result.program.module()(*clone(args)), module(*clone(args)))
    q, k, v, g, beta, s0 = args
    o1, s1 = scan64(q, k, v, g, beta, s0, scale=8 ** -0.5, norm=None)
    o2, s2 = scan64(k, q, o1, g * 0.5, 1 - beta, s1, scale=8 ** -0.5, norm=None)
    assert_same(module(*clone(args)), (o2, s1, s2))
