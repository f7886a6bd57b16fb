"""Test helpers: build programs in every IR form a user can hand over, run them, compare."""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import fx
from torch.fx.experimental.proxy_tensor import make_fx

from gdn_fx.hf.configs import FAMILIES, family

FORMS = ("training", "functional", "core", "make_fx", "strict")


def export_form(module: torch.nn.Module, args: tuple, form: str, **kwargs) -> Any:
    """The module as torch.export / make_fx leaves it in one of FORMS."""
    if form == "make_fx":
        return make_fx(module)(*args)
    ep = torch.export.export(module, args, strict=(form == "strict"), **kwargs)
    if form == "functional":
        return ep.run_decompositions({})
    if form == "core":
        return ep.run_decompositions()
    return ep


def run(program: Any, args: tuple) -> Any:
    """Run an ExportedProgram (through .module()) or a GraphModule on cloned inputs."""
    args = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)
    if isinstance(program, torch.export.ExportedProgram):
        return program.module()(*args)
    return program(*args)


def graph_of(program: Any) -> fx.Graph:
    if isinstance(program, torch.export.ExportedProgram):
        return program.graph_module.graph
    return program.graph


def count_calls(program: Any, target: Any = None) -> int:
    """call_function nodes in the program (of one target when given)."""
    return sum(1 for n in graph_of(program).nodes if n.op == "call_function"
               and (target is None or n.target is target))


def fused_nodes(program: Any, name: str = "gated_delta_scan") -> list[fx.Node]:
    target = getattr(torch.ops.gdn_fx, name).default
    return [n for n in graph_of(program).nodes if n.target is target]


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """max|got - want| / max|want| in float64."""
    got, want = got.double(), want.double()
    if want.numel() == 0:
        return 0.0
    scale = want.abs().max().item() or 1.0
    return (got - want).abs().max().item() / scale


def max_rel(gots, wants) -> float:
    """The largest rel_err over paired outputs, which must agree in shape and dtype."""
    gots, wants = list(gots), list(wants)
    assert len(gots) == len(wants)
    for g, w in zip(gots, wants):
        assert g.shape == w.shape and g.dtype == w.dtype, (g.shape, w.shape, g.dtype, w.dtype)
    return max((rel_err(g, w) for g, w in zip(gots, wants)), default=0.0)


@functools.lru_cache(maxsize=None)
def tiny(name: str):
    """gdn_fx.hf.tiny_model(name), built once per test session."""
    from gdn_fx.hf import tiny_model

    return tiny_model(name)


def flat(outputs: Any) -> list[torch.Tensor]:
    """Tensor leaves of a (nested) output, in order."""
    leaves = torch.utils._pytree.tree_leaves(outputs)
    return [x for x in leaves if isinstance(x, torch.Tensor)]


def assert_close_outputs(got: Any, want: Any, rtol: float = 1e-5) -> list[float]:
    """Every output within ``rtol`` relative error; returns the errors."""
    got, want = flat(got), flat(want)
    assert len(got) == len(want)
    errors = []
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype, (g.shape, w.shape, g.dtype, w.dtype)
        errors.append(rel_err(g, w))
    assert max(errors, default=0.0) <= rtol, errors
    return errors


# Near-misses a family's decode step is known to leave (a part of the reason): the Mamba
# families' decode updates its state once with no loop (transformers'
# mamba2_selective_state_update, which passes/single_step.py names; Mamba1's
# mamba_selective_state_update, a one-step cluster of the recurrent rule), and nothing fuses
# it yet.
NO_TIME_AXIS = "with no time axis"
KNOWN_DECODE_MISSES = {
    **{f: (NO_TIME_AXIS,) for f in FAMILIES if family(f).mixer == "mamba2"},
    **{f: (NO_TIME_AXIS, "a recurrence step reads one initial state") for f in FAMILIES
       if family(f).mixer == "mamba1"},
    # Zamba v1 updates each Mamba head by its own call, side by side: read as a loop over
    # heads, whose steps chain no state (rightly no recurrence).
    "zamba": (NO_TIME_AXIS, "a recurrence step reads one initial state",
              "gathers nothing from the state of step", "takes nothing from earlier steps")}


def decode_fusions(family_name: str, step) -> dict:
    """``step.expected_fusions`` of a collapsed decode step: without the scans of the
    families whose one-token step nothing fuses yet (KNOWN_DECODE_MISSES)."""
    want = dict(step.expected_fusions)
    if family_name in KNOWN_DECODE_MISSES:
        want.pop("gated_linear_scan", None)
    return want


def unknown_misses(family: str, misses: list) -> list:
    """The near-misses of ``family``'s decode step that are not known to it."""
    known = KNOWN_DECODE_MISSES.get(family, ())
    return [m for m in misses if not any(part in m.reason for part in known)]
