"""Property: a step whose state or gate goes through a generated chain of elementwise
operations is never fused as the plain delta rule when it differs from it somewhere on the
wide domain (issue 54, "Must show": the property test).

The chains come from a small grammar (scale by a constant, a tanh cap, a softplus floor, a
logaddexp with a constant, square then sqrt, a trunc-division wrap, a cast through float16,
exp then log, a tiny constant added, the identity, x * 1), one to three of them, put on the
state after the update or on the log gate of transformers-style and einsum-style loops
(``wide_spellings``). For each,
the test decides in eager float64, by itself, whether the loop differs from the plain loop
(relative > 1e-6) at one of a fixed set of wide-domain draws: v and the initial state with
magnitudes log-uniform over 1e-6 .. 1e6 and both signs, q and k over 1e-3 .. 10, log gates
-1e-6 .. -1e4 (log-uniform), beta uniform in [0, 1] with both ends. Where it differs:

- on the state (inside the recurrence) nothing may fuse;
- on the gate a fusion may keep the chain outside the scan: the fused op's gate operand must
  then be computed (not the input gate itself, seen through views), and where float32 can see
  the difference, the collapsed program must compute what the eager loop computes.

Where it equals, nothing is asserted about fusing, except that a chain of syntactic
identities (identity, x * 1) still fuses.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import gdn_fx
from tensors import clone, flat
from wide_spellings import B, BASES, DK, DV, H

T_STEPS = 3
SCAN = "gated_delta_scan"
SCAN_OP = torch.ops.gdn_fx.gated_delta_scan.default

# --- the grammar -----------------------------------------------------------------------------
# (name, parameters, the function of x). Parameters come from small fixed sets.

def _scale(a):
    return lambda x: x * a


def _tanh_cap(c):
    return lambda x: c * torch.tanh(x / c)


def _softplus_floor(c):
    return lambda x: F.softplus(x + c) - c


def _logaddexp_const(c):
    return lambda x: torch.logaddexp(x, torch.full_like(x, c))


def _square_sqrt(_):
    return lambda x: torch.sqrt(x * x)


def _trunc_wrap(c):
    return lambda x: x - c * torch.div(x, c, rounding_mode="trunc")


def _through_f16(_):
    return lambda x: x.to(torch.float16).to(x.dtype)


def _exp_log(_):
    return lambda x: torch.log(torch.exp(x))


def _add_tiny(c):
    return lambda x: x + c


def _identity(_):
    return lambda x: x


def _times_one(_):
    return lambda x: x * 1.0


GRAMMAR = {
    "scale": (_scale, (2.0, 0.5, -1.0, 1.0, 1e-3)),
    "tanh_cap": (_tanh_cap, (10.0, 1e3, 1e5)),
    "softplus_floor": (_softplus_floor, (5.0, 100.0, 1e4)),
    "logaddexp_const": (_logaddexp_const, (-1e4, -30.0, -5.0, 0.0)),
    "square_sqrt": (_square_sqrt, (None,)),
    "trunc_wrap": (_trunc_wrap, (10.0, 1e3, 1e5)),
    "through_f16": (_through_f16, (None,)),
    "exp_log": (_exp_log, (None,)),
    "add_tiny": (_add_tiny, (1e-9, 1e-12)),
    "identity": (_identity, (None,)),
    "times_one": (_times_one, (None,)),
}
IDENTITIES = {"identity", "times_one"}


TERMS = [(name, p) for name in sorted(GRAMMAR) for p in GRAMMAR[name][1]]


def compose(chain):
    fns = [GRAMMAR[name][0](p) for name, p in chain]

    def f(x):
        for fn in fns:
            x = fn(x)
        return x
    return f


def describe(chain) -> str:
    return " then ".join(name if p is None else f"{name}({p:g})" for name, p in chain)


# --- the wide domain ------------------------------------------------------------------------

def _log_uniform(shape, lo, hi, gen, signed=True):
    mag = torch.exp(torch.empty(shape, dtype=torch.float64).uniform_(
        math.log(lo), math.log(hi), generator=gen))
    if not signed:
        return mag
    return mag * (torch.randint(0, 2, shape, generator=gen, dtype=torch.float64) * 2 - 1)


def wide_draw(seed: int) -> dict:
    """Canonical operands over many decades (float64)."""
    gen = torch.Generator().manual_seed(7000 + seed)
    beta = torch.rand(B, T_STEPS, H, generator=gen, dtype=torch.float64)
    beta.view(-1)[0], beta.view(-1)[-1] = 0.0, 1.0
    return {"q": _log_uniform((B, T_STEPS, H, DK), 1e-3, 10.0, gen),
            "k": _log_uniform((B, T_STEPS, H, DK), 1e-3, 10.0, gen),
            "v": _log_uniform((B, T_STEPS, H, DV), 1e-6, 1e6, gen),
            "g": -_log_uniform((B, T_STEPS, H), 1e-6, 1e4, gen, signed=False),
            "beta": beta,
            "s0": _log_uniform((B, H, DK, DV), 1e-6, 1e6, gen)}


DRAWS = [wide_draw(s) for s in range(6)]


def example() -> dict:
    gen = torch.Generator().manual_seed(0)
    return {"q": torch.randn(B, T_STEPS, H, DK, generator=gen),
            "k": torch.randn(B, T_STEPS, H, DK, generator=gen) * 0.5,
            "v": torch.randn(B, T_STEPS, H, DV, generator=gen),
            "g": -torch.rand(B, T_STEPS, H, generator=gen),
            "beta": torch.rand(B, T_STEPS, H, generator=gen),
            "s0": torch.randn(B, H, DK, DV, generator=gen)}


def relative(got, want) -> float:
    """The largest difference over the outputs, relative to each output's largest finite
    magnitude (at least 1e-300); inf where nan or inf entries differ."""
    worst = 0.0
    for a, b in zip(flat(got), flat(want)):
        a, b = a.double(), b.double()
        if not torch.equal(a.isnan(), b.isnan()) or not torch.equal(a == math.inf, b == math.inf) \
                or not torch.equal(a == -math.inf, b == -math.inf):
            return math.inf
        finite = a.isfinite() & b.isfinite()
        if finite.any():
            size = max(b[finite].abs().max().item(), 1e-300)
            worst = max(worst, (a[finite] - b[finite]).abs().max().item() / size)
    return worst


def _call(module, args):
    with torch.no_grad():
        return module(*clone(args))


def _gate_operand_is_the_input(program) -> bool:
    """Whether a fused scan's gate operand is a graph input seen only through views."""
    views = {"view", "reshape", "_unsafe_view", "transpose", "permute", "contiguous", "clone",
             "alias", "unsqueeze", "squeeze", "expand", "slice", "select", "_to_copy", "to"}
    for node in program.graph.nodes:
        if node.target is SCAN_OP:
            g = node.args[3]
            while g.op == "call_function" and \
                    str(g.target).split(".")[1 if str(g.target).startswith("aten.") else 0] \
                    in views:
                g = g.args[0]
            if g.op == "placeholder":
                return True
    return False


@settings(max_examples=25, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(chain=st.lists(st.sampled_from(TERMS), min_size=1, max_size=3),
       site=st.sampled_from(["state", "gate"]),
       base=st.sampled_from(["recurrent_hf", "einsum_step"]))
def test_a_region_that_differs_on_the_wide_domain_is_not_fused_as_the_plain_op(chain, site,
                                                                               base):
    b = BASES[base]
    fn = compose(chain)
    mutant, plain = b.module(site, fn), b.module()
    what = f"{describe(chain)} on the {site} of the {base} loop"

    # eager float64: does the generated loop differ from the plain one on the wide domain?
    worst, where = 0.0, None
    for x in DRAWS:
        err = relative(_call(mutant, b.args(x)), _call(plain, b.args(x)))
        if err > worst:
            worst, where = err, x
    differs = worst > 1e-6

    program = torch.export.export(mutant, clone(b.args(example())))
    result = gdn_fx.collapse(program)
    fused = result.counts.get(SCAN, 0)
    event(f"{site}: {'differs' if differs else 'equal'} on the wide domain, "
          f"{'fused' if fused else 'not fused'}")
    if not differs:
        if all(name in IDENTITIES for name, _ in chain):
            assert fused == 1, f"{what}: an identity chain no longer fuses; {result.misses}"
        return
    if site == "state":
        assert fused == 0, f"{what} differs by {worst:.3g} on the wide domain but is fused " \
                           f"into the plain op; misses {result.misses}"
        return
    if fused:
        assert not _gate_operand_is_the_input(result.program), \
            f"{what} differs by {worst:.3g} but the fused scan reads the input gate itself"
        args32 = tuple(a.float() for a in b.args(where))
        seen32 = relative(_call(mutant, args32), _call(plain, args32))
        if math.isfinite(seen32) and seen32 > 1e-3:
            with torch.no_grad():
                got = result.program.module()(*clone(args32))
            err = relative(got, _call(mutant, args32))
            assert err < 1e-4, f"{what}: the fused program is off by {err:.3g}"
    else:
        assert result.misses, f"{what}: left unfused without a near-miss"
