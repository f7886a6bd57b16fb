"""A piecewise operation the validation draws never reach is not fused into the plain op
(issue 30, item 1).

For every mutant of ``piecewise_spellings`` (a clamp, min / max, where, comparison, relu,
sign, hardtanh, threshold, nan_to_num or masked_fill at one site of a delta-rule step, of a
chunked form, or of a conv update):

- the corpus is honest: the base loop is the delta rule (a float64 loop written here); the
  mutant equals its base on ordinary inputs and on uniform [-1, 1] * 0.5 draws, and differs
  from it on inputs that cross its threshold (computed in eager torch, no gdn_fx);
- ``gdn_fx.collapse`` does not make it the plain op. Inside the recurrence (the state, the
  decayed state, the memory read k^T S, the delta) the op cannot be kept outside a fused scan:
  nothing fuses and a near-miss names what it saw. On a per-step input or output (the gate,
  beta, v, k, o_t) the op commutes with the loop: a collapse may fuse with the op kept outside
  the scan, and must then compute it; or leave the loop with a near-miss. Either way the
  collapsed program agrees with the eager module on inputs that cross the threshold.

Controls (must fuse, and compute what the module computes past the thresholds): the bases as
they are, piecewise identities (where on a constant mask), clamps of the inputs before the loop
or of the output after it. Lookalikes (identities a detection may not see through): fused or
not, never wrong.
"""

from __future__ import annotations

import functools
import re

import pytest
import torch

import gdn_fx
from piecewise_spellings import (
    BASES, CHUNK_MUTANT, DK, CHUNK_MUTANTS, CHUNK_T, CONTROL, CONTROLS, CONV_MUTANT, CONV_MUTANTS,
    LOOKALIKE, LOOKALIKES, MUTANT, MUTANTS, PIECES, ChunkedRule, ConvStepRoll, ConvUpdate,
    chunk_operands, conv_inputs, cross, draws, operands,
)
from tensors import clone, flat, in_form

SCAN, CONV = "gated_delta_scan", "causal_conv1d_update"

# the words a near-miss about a piecewise op may use: the op (any spelling of it in the
# graph: clamp, where, a comparison, ...) or the concept
_WORDS = sorted({w for p in PIECES.values() for w in p.ops}
                | {"clamp_min", "clamp_max", "hardtanh", "threshold", "piecewise", "relu",
                   "sign", "where", "nan_to_num", "masked_fill", "maximum", "minimum"})
# (a threshold the translation validation's own draws reach, such as |S| > 4, may be refused
# there, by a miss that says the programs differ)
MENTION = re.compile(r"\b(" + "|".join(map(re.escape, _WORDS)) + r")(_\d+)?\b|piecewise|"
                     r"threshold|switch|data.dependent|compar|translation validation",
                     re.IGNORECASE)


# --- an independent float64 reference ------------------------------------------------------

def rule64(x: dict, scale: float):
    """The gated delta rule on canonical operands, one step at a time in float64: returns
    o [B, T, H, Dv] and the final state [B, H, Dk, Dv]."""
    q, k, v, g, beta, S = (x[n].double() for n in ("q", "k", "v", "g", "beta", "s0"))
    outs = []
    for t in range(q.shape[1]):
        decay = g[:, t].exp()
        decay = decay[..., None] if decay.dim() == 3 else decay[..., None, None]  # KDA / GDN
        S = decay * S
        read = torch.einsum("bhk,bhkv->bhv", k[:, t], S)
        S = S + k[:, t, :, :, None] * (beta[:, t, :, None] * (v[:, t] - read))[:, :, None, :]
        outs.append(scale * torch.einsum("bhk,bhkv->bhv", q[:, t], S))
    return torch.stack(outs, 1), S


def scale_of(base) -> float:
    return DK ** -0.5 if base.scale == "rsqrt" else 1.0


# --- comparisons ---------------------------------------------------------------------------

def agree(got, want, tol=1e-5, floor=1.0) -> str:
    """'' when the outputs agree (the same nan and inf entries, finite ones within ``tol``
    of the largest finite magnitude, or of ``floor`` where that is larger), else what
    differs. (test_wide_domain's too, with a tiny floor: relative at every scale.)"""
    got, want = flat(got), flat(want)
    if len(got) != len(want):
        return f"{len(got)} outputs, expected {len(want)}"
    for i, (a, b) in enumerate(zip(got, want)):
        if a.shape != b.shape:
            return f"output {i}: shape {tuple(a.shape)} != {tuple(b.shape)}"
        a, b = a.double(), b.double()
        if not torch.equal(a.isnan(), b.isnan()):
            return f"output {i}: nan in different places"
        if not torch.equal(a.isinf() & (a > 0), b.isinf() & (b > 0)) or \
                not torch.equal(a.isinf() & (a < 0), b.isinf() & (b < 0)):
            return f"output {i}: inf in different places"
        finite = b.isfinite()
        if finite.any():
            size = max(b[finite].abs().max().item(), floor)
            err = (a[finite] - b[finite]).abs().max().item()
            if err > tol * size:
                return f"output {i}: differs by {err / size:.3g} relative"
    return ""


def run(program, args):
    """(outputs, the inputs after the run) of a program (an ExportedProgram, or a module
    such as make_fx's GraphModule) on clones of ``args``."""
    args = clone(args)
    with torch.no_grad():
        out = (program.module() if isinstance(program, torch.export.ExportedProgram)
               else program)(*args)
    return flat(out) + list(args)


def eager(module, args):
    """The module's outputs and its inputs after the call (the conv writes its state)."""
    args = clone(args)
    with torch.no_grad():
        out = module(*args)
    return flat(out) + list(args)


def mentions(result) -> bool:
    return any(MENTION.search(str(m)) for m in result.misses)


def report(result) -> str:
    return f"counts {result.counts}; misses {[str(m) for m in result.misses]}"


# --- the step loops: entries -----------------------------------------------------------------

def _operands(base, t, seed=0):
    return operands(kda=BASES[base].kda, t=t, seed=seed)


def _draws(base, t, seed=0):
    return draws(kda=BASES[base].kda, t=t, seed=seed)


@functools.lru_cache(maxsize=None)
def exported_mutant(name):
    m = MUTANT[name]
    module = m.module()
    args = BASES[m.base].args(_operands(m.base, m.t))
    return module, torch.export.export(module, clone(args))


def test_the_corpus_covers_every_kind_at_every_site():
    names = [m.name for m in MUTANTS] + [c.name for c in CONTROLS + LOOKALIKES] + \
        [m.name for m in CHUNK_MUTANTS + CONV_MUTANTS]
    assert len(names) == len(set(names))
    state_kinds = {m.piece for m in MUTANTS if m.site == "state"}
    assert state_kinds >= set(PIECES), set(PIECES) - state_kinds
    assert {m.site for m in MUTANTS} >= {"state", "gate", "beta", "v", "out"}
    assert {m.base for m in MUTANTS if m.site == "state"} == set(BASES)
    assert {m.base for m in MUTANTS if m.site == "gate"} == set(BASES)
    assert {c for m in MUTANTS if m.site == "state" and m.piece == "clamp" for c in [m.c]} >= \
        {4.0, 20.0, 1e3}


@pytest.mark.parametrize("base", list(BASES))
def test_base_is_the_delta_rule(base):
    b = BASES[base]
    x = _operands(base, 4)
    got = b.outs(b.module()(*b.args(x)))
    assert not agree(got, rule64(x, scale_of(b)), tol=1e-5), agree(got, rule64(x, scale_of(b)))


@pytest.mark.parametrize("name", [m.name for m in MUTANTS])
def test_mutant_is_hidden_from_ordinary_draws(name):
    """On ordinary operands and on uniform [-1, 1] * 0.5 draws the mutant is its base."""
    m = MUTANT[name]
    b = BASES[m.base]
    for x in (_operands(m.base, m.t, seed=1), _draws(m.base, m.t, seed=2)):
        args = b.args(x)
        why = agree(m.module()(*clone(args)), b.module()(*clone(args)), tol=1e-5)
        assert not why, f"{m.change}: visible on ordinary inputs: {why}"


@pytest.mark.parametrize("name", [m.name for m in MUTANTS])
def test_mutant_differs_past_its_threshold(name):
    """Past the threshold the mutant is not the delta rule (not its base, not rule64)."""
    m = MUTANT[name]
    b = BASES[m.base]
    x = cross(m.site, PIECES[m.piece], m.c, _operands(m.base, m.t))
    args = b.args(x)
    got = m.module()(*clone(args))
    assert agree(got, b.module()(*clone(args)), tol=1e-3), f"{m.change}: no difference"
    if PIECES[m.piece].sides != "nonfinite":  # rule64 has no overflow to compare with
        assert agree(b.outs(got), rule64(x, scale_of(b)), tol=1e-3), m.change


def _assert_not_the_plain_op(result, program, module, crossing_args, inside, what):
    fused = result.counts.get(SCAN, 0)
    # never wrong: the collapsed program computes the module past the threshold
    why = agree(run(result.program, crossing_args), eager(module, crossing_args), tol=1e-4)
    assert not why, f"{what}: collapsed program differs from the module past the threshold " \
                    f"({why}); {report(result)}"
    if inside:
        assert fused == 0, f"{what}: fused into the plain op; {report(result)}"
    if fused == 0:
        assert result.misses, f"{what}: left unfused without a near-miss; {report(result)}"
        assert mentions(result), f"{what}: no near-miss names the op; {report(result)}"


@pytest.mark.parametrize("name", [m.name for m in MUTANTS])
def test_mutant_is_not_fused_into_the_plain_op(name):
    m = MUTANT[name]
    module, ep = exported_mutant(name)
    result = gdn_fx.collapse(ep)
    crossing = BASES[m.base].args(cross(m.site, PIECES[m.piece], m.c, _operands(m.base, m.t)))
    _assert_not_the_plain_op(result, ep, module, crossing, m.inside, m.change)


# the core-ATen form decomposes several of them (hardtanh and relu to clamp, threshold to
# where, ...): one mutant per kind, on the state
_CORE_KINDS = ("clamp_inplace", "relu_shift", "nan_to_num", "sign_gate", "hardtanh",
               "threshold", "masked_fill")
_CORE = sorted({m.piece: m.name for m in MUTANTS
                if m.site == "state" and m.t == 4 and m.piece in _CORE_KINDS}.values())


@pytest.mark.parametrize("name", _CORE)
def test_mutant_is_not_fused_in_core_aten(name):
    m = MUTANT[name]
    module, ep = exported_mutant(name)
    result = gdn_fx.collapse(in_form(ep, "core_aten"))
    crossing = BASES[m.base].args(cross(m.site, PIECES[m.piece], m.c, _operands(m.base, m.t)))
    _assert_not_the_plain_op(result, ep, module, crossing, True, m.change + " (core ATen)")


# --- controls and lookalikes ---------------------------------------------------------------

def _control_crossing(c, x):
    """Inputs past every threshold a control's clamps have: betas beyond 1, gates below -5,
    values beyond 20, outputs beyond 20."""
    x = {n: a.clone() for n, a in x.items()}
    x["beta"] = x["beta"] * 3 - 1  # in [-0.85, 1.85]
    x["g"] = x["g"].clone()
    x["g"].view(-1)[::2] -= 8.0
    x["v"] = x["v"] * 40
    x["q"] = x["q"] * 10
    return x


@pytest.mark.parametrize("name", [c.name for c in CONTROLS])
def test_control_computes_what_it_says(name):
    """The control's eager module is the float64 rule of its (clamped) inputs, clamped
    output; the clamped ones really differ from the plain loop past the thresholds."""
    c = CONTROL[name]
    b = BASES[c.base]
    for x in (_operands(c.base, 4), _control_crossing(c, _operands(c.base, 4))):
        o, s = b.outs(c.module()(*b.args(x)))
        want_o, want_s = rule64(c.before(x) if c.before else x, scale_of(b))
        if c.after:
            want_o = c.after(want_o)
        why = agree((o, s), (want_o, want_s), tol=1e-5)
        assert not why, f"{c.change}: {why}"
    if c.differs:
        args = b.args(_control_crossing(c, _operands(c.base, 4)))
        assert agree(c.module()(*clone(args)), b.module()(*clone(args)), tol=1e-3), c.change


@pytest.mark.parametrize("name", [c.name for c in CONTROLS])
def test_control_still_fuses(name):
    c = CONTROL[name]
    b = BASES[c.base]
    module = c.module()
    args = b.args(_operands(c.base, 4))
    result = gdn_fx.collapse(torch.export.export(module, clone(args)))
    assert result.counts.get(SCAN, 0) == 1, f"{c.change}: {report(result)}"
    for x in (_operands(c.base, 4, seed=3), _control_crossing(c, _operands(c.base, 4, seed=4))):
        args = b.args(x)
        why = agree(run(result.program, args), eager(module, args), tol=1e-4)
        assert not why, f"{c.change}: collapsed differs ({why}); {report(result)}"


@pytest.mark.parametrize("name", [c.name for c in LOOKALIKES])
def test_lookalike_is_an_identity(name):
    c = LOOKALIKE[name]
    b = BASES[c.base]
    for x in (_operands(c.base, 4), _control_crossing(c, _operands(c.base, 4))):
        args = b.args(x)
        assert not agree(c.module()(*clone(args)), b.module()(*clone(args)), tol=1e-6), c.change


@pytest.mark.parametrize("name", [c.name for c in LOOKALIKES])
def test_lookalike_is_never_wrong(name):
    c = LOOKALIKE[name]
    b = BASES[c.base]
    module = c.module()
    args = b.args(_operands(c.base, 4))
    result = gdn_fx.collapse(torch.export.export(module, clone(args)))
    for x in (_operands(c.base, 4, seed=3), _control_crossing(c, _operands(c.base, 4, seed=4))):
        why = agree(run(result.program, b.args(x)), eager(module, b.args(x)), tol=1e-4)
        assert not why, f"{c.change}: collapsed differs ({why}); {report(result)}"
    if result.counts.get(SCAN, 0) == 0:
        assert result.misses, f"{c.change}: unfused without a near-miss; {report(result)}"


# --- the chunked form ---------------------------------------------------------------------

def _chunk_args(x):
    return tuple(x[n] for n in ("q", "k", "v", "g", "beta", "s0"))


@pytest.mark.parametrize("t", [8, CHUNK_T])
def test_chunked_base_is_the_delta_rule_and_fuses(t):
    x = chunk_operands(t)
    module = ChunkedRule()
    got = module(*_chunk_args(x))
    assert not agree(got, rule64(x, DK ** -0.5), tol=1e-5), agree(got, rule64(x, DK ** -0.5))
    result = gdn_fx.collapse(torch.export.export(module, _chunk_args(x)))
    assert result.counts.get(SCAN, 0) == 1, report(result)
    y = chunk_operands(t, seed=9)
    assert not agree(run(result.program, _chunk_args(y)), eager(module, _chunk_args(y)), 1e-4)


@pytest.mark.parametrize("name", [m.name for m in CHUNK_MUTANTS])
def test_chunk_mutant_is_hidden_and_real(name):
    m = CHUNK_MUTANT[name]
    base = ChunkedRule()
    for x in (chunk_operands(m.t, seed=1), {n: a * 0.5 for n, a in chunk_operands(m.t).items()}):
        why = agree(m.module()(*_chunk_args(x)), base(*_chunk_args(x)), tol=1e-5)
        assert not why, f"{name}: visible on ordinary inputs: {why}"
    x = m.cross(chunk_operands(m.t))
    got = m.module()(*_chunk_args(x))
    assert agree(got, base(*_chunk_args(x)), tol=1e-3), f"{name}: no difference"
    assert agree(got, rule64(x, DK ** -0.5), tol=1e-3), f"{name}: no difference from rule64"


@pytest.mark.parametrize("name", [m.name for m in CHUNK_MUTANTS])
def test_chunk_mutant_is_not_fused(name):
    m = CHUNK_MUTANT[name]
    module = m.module()
    ep = torch.export.export(module, _chunk_args(chunk_operands(m.t)))
    result = gdn_fx.collapse(ep)
    crossing = _chunk_args(m.cross(chunk_operands(m.t)))
    _assert_not_the_plain_op(result, ep, module, crossing, True, name)


# --- the conv update --------------------------------------------------------------------------

def _conv_base(m):
    return {"update": ConvUpdate, "roll": ConvStepRoll}[m.base]()


def update64(x, state, weight, bias):
    """The conv update in float64, one channel at a time: x [B, C, T] or [B, C] (then the
    state keeps K samples and out is [B, C]), weight [C, 1, K] or [C, K]."""
    step = x.dim() == 2
    x = x[..., None] if step else x
    x, state = x.double(), state.double()
    weight = weight.double().reshape(weight.shape[0], -1)
    kernel, seq = weight.shape[1], x.shape[-1]
    full = torch.cat([state, x], -1)
    out = torch.zeros(x.shape, dtype=torch.float64)
    for c in range(x.shape[1]):
        for s in range(seq):
            end = full.shape[-1] - seq + s + 1
            y = (full[:, c, end - kernel:end] * weight[c]).sum(-1) + bias[c].double()
            out[:, c, s] = y * torch.sigmoid(y)
    out = out[..., 0] if step else out
    return out, full[..., -state.shape[-1]:]


@pytest.mark.parametrize("base", ["update", "roll"])
def test_conv_base_is_the_update_and_fuses(base):
    module = {"update": ConvUpdate, "roll": ConvStepRoll}[base]()
    x, state = conv_inputs(step=base == "roll")
    got = eager(module, (x, state))
    want = update64(x, state, module.weight.detach(), module.bias.detach())
    assert not agree([got[0], got[2]], list(want), tol=1e-5), agree([got[0], got[2]], list(want))
    result = gdn_fx.collapse(torch.export.export(module, clone((x, state))))
    assert result.counts.get(CONV, 0) == 1, report(result)
    big = (x * 30, state * 30)
    assert not agree(run(result.program, big), eager(module, big), tol=1e-4)


@pytest.mark.parametrize("name", [m.name for m in CONV_MUTANTS])
def test_conv_mutant_is_hidden_and_real(name):
    m = CONV_MUTANT[name]
    base = _conv_base(m)
    for args in (m.inputs(), tuple(a * 0.5 for a in m.inputs())):
        why = agree(eager(m.module(), args), eager(base, args), tol=1e-5)
        assert not why, f"{name}: visible on ordinary inputs: {why}"
    args = m.inputs(large=True)
    assert agree(eager(m.module(), args), eager(base, args), tol=1e-3), f"{name}: no difference"


@pytest.mark.parametrize("name", [m.name for m in CONV_MUTANTS])
def test_conv_mutant_is_not_fused_into_the_plain_op(name):
    """A conv update is one step: a piecewise op on its input, state or output may be kept
    outside a fused update (then it must be computed), or the update left with a near-miss."""
    m = CONV_MUTANT[name]
    module = m.module()
    ep = torch.export.export(module, clone(m.inputs()))
    result = gdn_fx.collapse(ep)
    why = agree(run(result.program, m.inputs(large=True)), eager(module, m.inputs(large=True)),
                tol=1e-4)
    assert not why, f"{name}: collapsed program differs past the threshold ({why}); " \
                    f"{report(result)}"
    if result.counts.get(CONV, 0) == 0:
        assert result.misses and mentions(result), f"{name}: {report(result)}"
