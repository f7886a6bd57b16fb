"""The searched timestep, written once as plain torch, traced like the user's graph.

One step of the gated delta rule, state S [B, H, Dk, Dv] (key-first):

    S = S * decay_t
    delta = (v_t - sum_k(S * k_t)) * beta_t
    S = S + k_t (outer) delta
    out_t = sum_k(S * q_t)

Two layouts reach it. "gdn" (transformers' torch_recurrent_gated_delta_rule): head-major
[B, H, T, D] operands read at time axis 2, decay ``exp(g_t)[..., None, None]`` (one per head).
"kda" (recurrent_kimi_delta_attention, gdn_fx's own reference): sequence-major [B, T, H, D]
read at time axis 1, decay ``exp(g_t[..., None])`` (one per key channel).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor, fx

from gdn_fx.passes.match import Pattern
from gdn_fx.reference import delta_rule_step


def gdn_step(state, q, k, v, g, beta) -> tuple[Tensor, Tensor]:
    """Head-major step: q, k [B, H, T, Dk], v [B, H, T, Dv], g/beta [B, H, T]."""
    i = 0
    decay = g[:, :, i].exp()[..., None, None]
    return delta_rule_step(state, decay, q[:, :, i], k[:, :, i], v[:, :, i],
                         beta[:, :, i].unsqueeze(-1))


def kda_step(state, q, k, v, g, beta) -> tuple[Tensor, Tensor]:
    """Sequence-major step: q, k [B, T, H, Dk], v [B, T, H, Dv], g [B, T, H, Dk], beta [B, T, H]."""
    i = 0
    decay = g[:, i][..., None].exp()
    return delta_rule_step(state, decay, q[:, i], k[:, i], v[:, i], beta[:, i][..., None])


STEPS = {"gdn": gdn_step, "kda": kda_step}
TIME_AXIS = {"gdn": 2, "kda": 1}
_B, _H, _T, _DK, _DV = 2, 3, 4, 5, 6  # distinct sizes, so no broadcast is ambiguous


def _example(kind: str) -> tuple[Tensor, ...]:
    state = torch.randn(_B, _H, _DK, _DV)
    if kind == "gdn":
        qk, v, g = (_B, _H, _T, _DK), (_B, _H, _T, _DV), (_B, _H, _T)
        beta = g
    else:
        qk, v, g, beta = (_B, _T, _H, _DK), (_B, _T, _H, _DV), (_B, _T, _H, _DK), (_B, _T, _H)
    return state, torch.randn(qk), torch.randn(qk), torch.randn(v), torch.randn(g), torch.rand(beta)


class _Step(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, state, q, k, v, g, beta):
        return self.fn(state, q, k, v, g, beta)


def _signature(graph: fx.Graph) -> tuple:
    return tuple((n.op, str(n.target), str(n.args)) for n in graph.nodes)


def _as_pattern(name: str, graph: fx.Graph) -> Pattern:
    output = next(n for n in graph.nodes if n.op == "output")
    state, out = output.args[0]
    return Pattern(name, graph, {"state": state, "out": out}, anchor="out",
                   select_index_is_time=True)


@functools.cache
def _traced(kind: str, form: str) -> Pattern:
    ep = torch.export.export(_Step(STEPS[kind]), _example(kind))
    if form == "functional":
        ep = ep.run_decompositions({})
    elif form == "core":
        ep = ep.run_decompositions()
    return _as_pattern(kind, ep.graph_module.graph)


def step_patterns(graph_targets: set) -> list[Pattern]:
    """Each step kind, traced through torch.export like the graph being searched.

    The training-IR trace comes first; the decomposed forms are traced (once per process) only
    when the graph lacks one of its op overloads, i.e. when the graph was decomposed further.
    """
    patterns, seen = [], set()
    for kind in STEPS:
        for form in ("training", "functional", "core"):
            pattern = _traced(kind, form)
            if _signature(pattern.graph) not in seen:
                seen.add(_signature(pattern.graph))
                patterns.append(pattern)
            if pattern.targets() <= graph_targets:
                break
    return patterns
