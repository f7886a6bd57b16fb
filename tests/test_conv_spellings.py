"""Other authors' spellings of the causal conv1d update fuse; one-change mutants do not.

For every spelling in ``conv_spellings.SPELLINGS`` and every IR form (training IR,
``run_decompositions({})``, ``run_decompositions()``): ``gdn_fx.collapse`` makes exactly one
causal_conv1d_update node, no conv near-miss, and the collapsed program computes what the eager
module computes (every output and the state after the run, f32, 1e-5). The eager module is
itself checked against a float64 update written here (not gdn_fx's), so the corpus is right.

For every mutant: nothing fuses, a near-miss says why, the program still computes what the
module computes, and the mutant really differs from its base in eager.
"""

from __future__ import annotations

import functools

import pytest
import torch

import gdn_fx
from conv_spellings import LOOKALIKES, MUTANT, MUTANTS, SPELLING, SPELLINGS
from tensors import FORMS, clone, flat, in_form

TOL = 1e-5
NAME = "causal_conv1d_update"
FUSED = torch.ops.gdn_fx.causal_conv1d_update.default


def update64(x, state, weight, bias, silu):
    """The update one channel at a time in float64: x [B, C, T], state [B, C, W]."""
    x, state, weight = x.double(), state.double(), weight.double().reshape(weight.shape[0], -1)
    b, c, t = x.shape
    kernel, width = weight.shape[1], state.shape[2]
    out = torch.zeros(b, c, t, dtype=torch.float64)
    new = torch.zeros(b, c, width, dtype=torch.float64)
    for i in range(b):
        for j in range(c):
            history = list(state[i, j]) + list(x[i, j])
            history = [torch.tensor(0.0, dtype=torch.float64)] * (kernel - width) + history
            for s in range(t):
                window = history[len(history) - t - kernel + 1 + s:][:kernel]
                y = sum(weight[j, k] * window[k] for k in range(kernel))
                if bias is not None:
                    y = y + bias[j].double()
                out[i, j, s] = y * torch.sigmoid(y) if silu else y
            new[i, j] = torch.stack(history[len(history) - width:])
    return out, new


def assert_same(got, want, what=""):
    got, want = flat(got), flat(want)
    assert len(got) == len(want), f"{what}{len(got)} tensors, expected {len(want)}"
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape, f"{what}tensor {i}: {tuple(g.shape)} != {tuple(w.shape)}"
        size = max(w.abs().max().item(), 1.0)
        torch.testing.assert_close(g.to(w.dtype), w, rtol=TOL, atol=TOL * size,
                                   msg=lambda m, i=i: f"{what}tensor {i}: {m}")


def state_of(module, args):
    """The state the module keeps: its buffer, else its second input."""
    buffers = list(module.buffers())
    return buffers[0] if buffers else args[1]


def run_eager(module, args):
    """(outputs, state after) of the eager module on clones, its buffers restored after."""
    saved = [b.clone() for b in module.buffers()]
    args = clone(args)
    with torch.no_grad():
        out = module(*args)
    after = state_of(module, args).clone()
    for b, s in zip(module.buffers(), saved):
        b.copy_(s)
    return flat(out) + [after]


def run_program(program, module, args):
    callable_ = program.module()
    saved = [b.clone() for b in callable_.buffers()]
    args = clone(args)
    with torch.no_grad():
        out = callable_(*args)
    buffers = list(callable_.buffers())
    after = (buffers[0] if buffers else args[1]).clone()
    for b, s in zip(callable_.buffers(), saved):
        b.copy_(s)
    return flat(out) + [after]


def entry(name):
    if name in SPELLING:
        return SPELLING[name].module, SPELLING[name].inputs
    return MUTANT[name].module, SPELLING[MUTANT[name].base].inputs


@functools.lru_cache(maxsize=None)
def exported(name):
    make, inputs = entry(name)
    module, args = make(), inputs()
    return module, args, torch.export.export(module, clone(args))


def collapse_and_run(name, form):
    module, args, ep = exported(name)
    ep = in_form(ep, form)
    result = gdn_fx.collapse(ep)
    return result, run_program(result.program, module, args), run_eager(module, args)


def fused_nodes(result) -> int:
    return sum(1 for n in result.program.graph.nodes if n.target is FUSED)


def test_the_corpus_is_as_large_as_promised():
    assert len(SPELLINGS) >= 10 and len(MUTANTS) >= 6
    names = [s.name for s in SPELLINGS] + [m.name for m in MUTANTS + LOOKALIKES]
    assert len(names) == len(set(names))
    assert {s.layout for s in SPELLINGS} >= {"bct", "btc", "bc"}


def _canonical(spelling, args, outputs):
    """(x [B, C, T], state [B, C, W]) and (out, new state) in the canonical layout."""
    x, state = args[0], (args[1] if len(args) > 1 else None)
    if spelling.layout == "btc":
        x = x.transpose(1, 2)
    elif spelling.layout == "bc":
        x = x.unsqueeze(-1)
    out = outputs[0]
    out = out.transpose(1, 2) if spelling.layout == "btc" else (
        out.unsqueeze(-1) if spelling.layout == "bc" else out)
    new = outputs[1] if len(outputs) == 3 else outputs[-1]  # returned, else kept
    if new.shape[1] != x.shape[1]:
        new = new.transpose(1, 2)
    if state is not None and state.shape[1] != x.shape[1]:
        state = state.transpose(1, 2)
    return x, state, out, new


@pytest.mark.parametrize("name", [s.name for s in SPELLINGS])
def test_spelling_computes_the_update(name):
    spelling = SPELLING[name]
    module, args = spelling.module(), spelling.inputs()
    initial = state_of(module, args).clone()
    outputs = run_eager(module, args)
    x, _, out, new = _canonical(spelling, args, outputs)
    state = initial if initial.shape[1] == x.shape[1] else initial.transpose(1, 2)
    silu = name not in ("shifted_multiply_add", "buffer_write_matmul")
    want_out, want_new = update64(x, state, module.weight, module.bias, silu)
    assert_same([out.double(), new.double()], [want_out, want_new], "eager vs float64: ")


@pytest.mark.parametrize("name", [m.name for m in MUTANTS + LOOKALIKES])
def test_mutant_differs_from_its_base(name):
    mutant = MUTANT[name]
    base = SPELLING[mutant.base]
    args = base.inputs()
    got, want = run_eager(mutant.module(), args), run_eager(base.module(), args)
    assert any(g.shape != w.shape or (g - w).abs().max() > 1e-3 for g, w in zip(got, want)), \
        mutant.change


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("name", [s.name for s in SPELLINGS])
def test_spelling_fuses(name, form):
    result, got, want = collapse_and_run(name, form)
    report = result.explain()
    assert_same(got, want, f"collapsed vs eager ({report}): ")
    assert result.counts.get(NAME) == 1 and fused_nodes(result) == 1, report
    assert not [m for m in result.misses if m.rule == NAME], report


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("name", [m.name for m in MUTANTS])
def test_mutant_stays_unfused(name, form):
    result, got, want = collapse_and_run(name, form)
    report = result.explain()
    assert_same(got, want, f"collapsed vs eager ({report}): ")
    assert result.counts.get(NAME, 0) == 0 and fused_nodes(result) == 0, \
        f"a mutant fused ({MUTANT[name].change}); {report}"
    assert [m for m in result.misses if m.rule == NAME], f"no near-miss; {report}"


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("name", [m.name for m in LOOKALIKES])
def test_lookalike_is_never_wrong(name, form):
    result, got, want = collapse_and_run(name, form)
    report = result.explain()
    assert_same(got, want, f"collapsed vs eager ({report}): ")
    if result.counts.get(NAME, 0) == 0:
        assert [m for m in result.misses if m.rule == NAME], report
