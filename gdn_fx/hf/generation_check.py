"""tract's generation checked against transformers' own ``generate`` on the same model.

    check = check_generation(model, result)   # result: Generator.generate's GenerationResult
    check.ok, str(check)                      # every token equal, logits within the bound
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch
from torch import nn

from gdn_fx.runtime.generator import GenerationResult

# Logits of a whole generation against transformers: f16 models accumulate f16 rounding over
# the steps (tract and torch round differently), so their bound is wider.
LOGITS_BOUND = {torch.float32: 1e-4, torch.float16: 1e-2}


def model_dtype(model: nn.Module) -> torch.dtype:
    """The dtype of the model's floating-point weights (its first parameter's)."""
    return next(model.parameters()).dtype


@dataclass(frozen=True)
class GenerationCheck:
    """tract's greedy generation against transformers' ``generate`` on the same model."""

    tokens_equal: bool
    first_difference: Optional[int]  # index of the first differing token
    worst_logits: float  # max over the compared steps of max|tract - hf| / max|hf|
    bound: float
    hf_tokens: list
    tied: tuple = ()  # steps at a router near-tie: compared by token only (router_near_ties)

    @property
    def ok(self) -> bool:
        return self.tokens_equal and self.worst_logits <= self.bound

    def __str__(self) -> str:
        tokens = "every token equal" if self.tokens_equal else (
            f"tokens differ from position {self.first_difference}")
        tied = (f"; steps {list(self.tied)} at a router near-tie compared by token only"
                if self.tied else "")
        return (f"{tokens} ({len(self.hf_tokens)} tokens); logits max relative error "
                f"{self.worst_logits:.2e} (bound {self.bound:g}){tied}")


def router_near_ties(model: nn.Module, sequence: Sequence[int], margin: float) -> list:
    """Positions of ``sequence`` where some top-k router of ``model`` nearly ties: its k-th
    and (k+1)-th largest logits lie within ``margin`` of the row's largest |logit|. There a
    rounding difference (f16) may route to another expert, and the logits jump by far more
    than the rounding bound while both sides are right to their precision. Only the routers
    known to take the top k of their logits are read: transformers' ``*TopKRouter`` modules
    (qwen3_next, qwen3_5_moe), whose forward returns the router logits first."""
    routers = [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")
               and isinstance(getattr(m, "top_k", None), int)]
    if not routers:
        return []
    gaps = []

    def record(module, inputs, output):
        logits = (output[0] if isinstance(output, tuple) else output).float()
        if logits.dim() != 2 or logits.shape[-1] <= module.top_k:
            return  # not the [tokens, experts] logits this reads: no tie known there
        top = logits.topk(module.top_k + 1, dim=-1).values
        gaps.append((top[:, -2] - top[:, -1]) / logits.abs().amax(-1).clamp_min(1e-30))

    hooks = [router.register_forward_hook(record) for router in routers]
    try:
        with torch.no_grad():
            model(torch.tensor([list(sequence)]))
    finally:
        for hook in hooks:
            hook.remove()
    if not gaps:
        return []
    closest = torch.stack(gaps).amin(0)
    return [int(i) for i in torch.nonzero(closest < margin).flatten()]


def check_generation(model: nn.Module, result: GenerationResult,
                     bound: Optional[float] = None) -> GenerationCheck:
    """Run transformers' own greedy ``generate`` from ``result.prompt`` and compare every
    token and every step's logits (raw, before any logits processor) within ``bound``
    (default: LOGITS_BOUND for the model's dtype). Steps whose last position is a router
    near-tie (:func:`router_near_ties` within ``bound``) are compared by token only, and
    said in the check; every step counts when more than half of them would be left out."""
    bound = bound if bound is not None else LOGITS_BOUND.get(model_dtype(model), 1e-4)
    prompt = torch.tensor([result.prompt])
    with torch.no_grad():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt),
                             max_new_tokens=len(result.tokens), min_new_tokens=0,
                             do_sample=False, eos_token_id=None, pad_token_id=0,
                             repetition_penalty=1.0, output_logits=True,
                             return_dict_in_generate=True)
    hf_tokens = out.sequences[0, prompt.shape[1]:].tolist()
    steps = min(len(result.logits), len(out.logits))
    tied = ()
    if steps:
        ties = set(router_near_ties(model, list(result.prompt) + hf_tokens[:steps - 1], bound))
        tied = tuple(j for j in range(steps) if len(result.prompt) - 1 + j in ties)
        if 2 * len(tied) > steps:
            tied = ()
    worst = 0.0
    for step, (got, want) in enumerate(zip(result.logits, out.logits)):
        if step in tied:
            continue
        want = want[0].double().numpy()
        got = got.astype(np.float64)
        error = float(np.abs(got - want).max() / np.abs(want).max())
        worst = max(worst, error if np.isfinite(error) else float("inf"))  # NaN fails too
    differ = [i for i, (a, b) in enumerate(zip(result.tokens, hf_tokens)) if a != b]
    equal = not differ and len(hf_tokens) == len(result.tokens)
    return GenerationCheck(equal, differ[0] if differ else None, worst, bound, hf_tokens, tied)
