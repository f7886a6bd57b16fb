"""An exportable step of a transformers hybrid causal LM, with its cache as explicit tensors.

transformers' own export wrappers fail on linear-attention caches. :class:`DecodeStep` takes
``(input_ids, *states)``, rebuilds the cache the model's forward fills (through the adapter of
the installed release's cache layout, ``gdn_fx.hf.caches``) from the states inside
``forward``, runs the model, and returns ``(logits, *new_states)``: a pure function that
``torch.export`` traces strict or non-strict. Input states are never mutated (they are cloned
into the cache, and the cache's tensors are returned).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor, nn
from torch.export import Dim

from gdn_fx.errors import PatchError, UsageError
from gdn_fx.hf import compat, patching, ssm_dropins
from gdn_fx.hf.caches import adapter, new_cache, read_cache
from gdn_fx.hf.configs import SAFE_TOKEN_RANGE
from gdn_fx.hf.states import StateSpec, check_states, discover_specs, model_device

RULES = ("auto", "recurrent")


class DecodeStep(nn.Module):
    """One step of ``model`` over ``S`` new tokens, continuing from explicit cache states.

    ``rule="auto"`` runs what transformers runs: the recurrent rule and the conv update at
    ``S == 1``, the chunk rule and the padded prefill conv otherwise. ``rule="recurrent"``
    makes every step take the recurrent rule and ``causal_conv1d_update`` (so a prefill
    export unrolls per token and can be collapsed). The swap of transformers' functions
    happens inside ``forward`` and is undone when it returns.
    """

    def __init__(self, model: nn.Module, rule: str = "auto", last_logits: bool = False,
                 whole_windows: bool = False):
        super().__init__()
        if rule not in RULES:
            raise UsageError(f"rule must be one of {RULES}, got {rule!r}")
        if rule == "recurrent":
            compat.require_module_kernels(model, "DecodeStep(rule='recurrent')")
        self.model = model
        self.rule = rule
        self.last_logits = last_logits  # logits of the last position only (a generator's)
        # sliding-window layers keep every token (caches.layers.WholeWindowLayer): a generator's, so
        # that one symbolic P serves every attention cache
        self.whole_windows = whole_windows
        self.specs: list[StateSpec] = discover_specs(model)
        self.modeling: list[patching.ModelingModule] = patching.modeling_modules(model)
        self.fresh_at_zero = ssm_dropins.limits_dt(model)  # see _cache
        self.caches = adapter()

    @property
    def input_names(self) -> list[str]:
        """Names of the forward arguments: ``input_ids`` then one per state."""
        return ["input_ids", *(s.name for s in self.specs)]

    @property
    def output_names(self) -> list[str]:
        """Names of the outputs: ``logits`` then ``new_<state name>`` per state."""
        return ["logits", *(f"new_{s.name}" for s in self.specs)]

    def forward(self, input_ids: Tensor, *states: Tensor) -> tuple[Tensor, ...]:
        return self.run_model(input_ids, states)

    def run_model(self, input_ids: Tensor, states: Sequence[Tensor],
                  **model_kwargs) -> tuple[Tensor, ...]:
        """``forward`` with ``model_kwargs`` passed on to the model (``position_ids``, an
        ``attention_mask``: the batched step, ``gdn_fx.hf.batch``)."""
        check_states(self.specs, states, input_ids.shape[0])
        past = self._past(states)
        if "position_ids" not in model_kwargs and compat.numbers_from_zero(self.model):
            model_kwargs["position_ids"] = generate_positions(input_ids, past or 0)
        swaps = patching.recurrent_swaps(self.modeling) if self.rule == "recurrent" else []
        swaps = swaps + self.caches.step_swaps(self.model)
        with patching.Patches(swaps), ssm_dropins.past_length(past):
            cache = self._cache([s.clone() for s in states], past)
            try:
                keep = {"logits_to_keep": 1} if self.last_logits else {}
                logits = compat.run(self.model, cache, input_ids=input_ids, **keep,
                                    **model_kwargs).logits
                unconsumed = patching.PENDING.entry is not None
            finally:
                patching.PENDING.entry = None
        if unconsumed:  # never return a conv state that was not written
            raise PatchError("a deferred conv-state update was not consumed: some "
                               "causal_conv1d_fn does not know gdn-fx's deferral")
        return (logits, *self.caches.read(cache, self.specs))

    def _past(self, states: Sequence[Tensor]):
        """P, the attention caches' length; None for a model without attention caches."""
        return next((t.shape[s.past_axis] for s, t in zip(self.specs, states)
                     if s.past_axis is not None), None)

    def _cache(self, states: list[Tensor], past=None):
        """The cache the model runs on, holding ``states``.

        A first prompt (P = 0, zero states) of a model whose first prompt and warm step
        differ (``ssm_dropins.limits_dt``) leaves the linear layers empty, as transformers'
        generate starts: its one-token branch is then the prefill's, not the warm step's."""
        forget = (self.fresh_at_zero and isinstance(past, int) and past == 0
                  and not any(t.any() for t in states))
        linear_class = patching.DeferringLinearAttentionLayer if self._can_defer() else None
        return self.caches.filled(self.model, self.specs, states, linear_class=linear_class,
                                  whole_windows=self.whole_windows, forget_linear=forget)

    def dynamic_shapes(self, min_seq: int = 2, max_seq: Optional[int] = None) -> tuple:
        """``dynamic_shapes`` for ``torch.export.export(step, args, ...)``: a dynamic number
        of new tokens, everything else static.

        ``min_seq`` defaults to 2 because transformers branches on ``S == 1`` (export decode
        separately). ``Dim.DYNAMIC`` rather than a named ``Dim``: GQA attention's
        ``repeat_kv`` adds a guard (``Min(a, 2a) == a``) that is true for every S but that a
        strict named Dim refuses. Only a model whose per-token loops are gone (reified)
        exports this way.
        """
        seq = Dim.DYNAMIC(min=min_seq, max=max_seq) if max_seq else Dim.DYNAMIC(min=min_seq)
        return ({1: seq}, tuple(None for _ in self.specs))

    def generator_shapes(self) -> tuple:
        """``dynamic_shapes`` of a generator: ``S`` new tokens (>= 1) after ``P`` cached ones
        (>= 0, one P for every attention cache).

        Export at an example with S >= 2 and P >= 2: torch.export specializes a dimension
        whose example is 0 or 1. transformers' ``S == 1`` tests are decided for the
        multi-token branch under symbolic S without a guard, and that branch carries the
        states when they are given (DecodeStep always gives them).
        """
        past = Dim("P", min=0)
        caches = tuple({s.past_axis: past} if s.past_axis is not None else None
                       for s in self.specs)
        return ({1: Dim("S", min=1)}, caches)

    @property
    def expected_fusions(self) -> dict[str, int]:
        """How many fused nodes a fully collapsed (or reified) step holds, per op name: one
        scan per delta-rule or Mamba layer, one conv update per conv state."""
        has_rule = any(m.rule_kind is not None for m in self.modeling)
        has_ssm = any(m.ssm for m in self.modeling)
        # A conv update the rule can find: a modeling file's function, or (5.5-5.12) a kernel
        # the layers bind themselves; other conv layers (lfm2 before 5.15) are written inline.
        has_conv = (any(m.has_conv for m in self.modeling)
                    or compat.bound_kernel(self.model, "causal_conv1d_update"))
        recurrent = sum(s.kind == "recurrent" for s in self.specs)
        conv = sum(s.kind == "conv" for s in self.specs)
        linear = {"gated_linear_scan": recurrent} if has_ssm else {}  # Mamba models only
        return {"gated_delta_scan": recurrent if has_rule else 0, **linear,
                "causal_conv1d_update": conv if has_conv else 0}

    def _can_defer(self) -> bool:
        """Whether every conv function the model calls consumes deferred conv updates."""
        convs = [getattr(m.module, patching.CONV_FN) for m in self.modeling if m.has_conv]
        return bool(convs) and all(patching.is_consumer(fn) for fn in convs)

    def eager(self, *args: Tensor) -> tuple[Tensor, ...]:
        """The step run eagerly (no autograd): the reference for an exported program."""
        with torch.no_grad():
            return self(*args)

    def example_inputs(self, seq_len: int = 1, batch: int = 1, past_len: int = 4,
                       source: str = "prefill", seed: int = 0) -> tuple[Tensor, ...]:
        """``(input_ids, *states)`` for ``seq_len`` new tokens after ``past_len`` cached ones.

        ``source="prefill"`` takes the states from a real transformers prefill of
        ``past_len`` random tokens (realistic magnitudes; zeros when ``past_len`` is 0);
        ``source="random"`` draws them (stronger tests of state handling).
        """
        gen = torch.Generator().manual_seed(seed)
        prompt = _tokens(gen, batch, past_len, self._device())
        ids = _tokens(gen, batch, seq_len, self._device())
        if source == "prefill":
            states = self.prefill_states(prompt)
        elif source == "random":
            states = [_random_state(s, batch, past_len, gen, self._device()) for s in self.specs]
        else:
            raise UsageError(f"source must be 'prefill' or 'random', got {source!r}")
        return (ids, *states)

    def prefill_states(self, prompt_ids: Tensor) -> list[Tensor]:
        """The states transformers' own prefill of ``prompt_ids`` leaves (zeros if empty)."""
        batch, past_len = prompt_ids.shape
        if past_len == 0:
            return [torch.zeros(s.shape_for(batch, 0), dtype=s.dtype, device=self._device())
                    for s in self.specs]
        cache = new_cache(self.model)
        with torch.no_grad():
            compat.run(self.model, cache, input_ids=prompt_ids)
        return [t.clone() for t in read_cache(cache, self.specs)]

    def _device(self) -> torch.device:
        return model_device(self.model)


def generate_positions(input_ids: Tensor, past) -> Tensor:
    """``past + arange(S)`` for every row of ``input_ids [B, S]``: the positions transformers'
    generate passes after ``past`` cached tokens (an int, or a symbolic P)."""
    count = input_ids.shape[1]
    return (torch.arange(count, device=input_ids.device) + past).expand(input_ids.shape[0],
                                                                         count)


def _tokens(gen: torch.Generator, batch: int, length: int, device: torch.device) -> Tensor:
    low, high = SAFE_TOKEN_RANGE
    return torch.randint(low, high, (batch, length), generator=gen).to(device)


def _random_state(spec: StateSpec, batch: int, past_len: int, gen: torch.Generator,
                  device: torch.device) -> Tensor:
    shape = spec.shape_for(batch, past_len)
    scale = 0.5 if spec.kind == "recurrent" else 1.0
    return (torch.randn(shape, generator=gen) * scale).to(spec.dtype).to(device)


def hf_continue(model: nn.Module, prompt_ids: Tensor, input_ids: Tensor,
                specs: Optional[Sequence[StateSpec]] = None) -> tuple[Tensor, ...]:
    """transformers' own flow, independent of DecodeStep: prefill ``prompt_ids`` into a
    ``DynamicCache``, run ``input_ids`` on it (with the positions generate passes, where the
    forward numbers tokens from 0: compat.NUMBERS_FROM_ZERO); returns ``(logits, *states)``
    in spec order."""
    specs = discover_specs(model) if specs is None else specs
    cache = new_cache(model)  # the class transformers builds itself (its own before 5.5)
    after = {}
    if compat.numbers_from_zero(model):  # as generate gives them
        after = {"position_ids": generate_positions(input_ids, prompt_ids.shape[1])}
    with torch.no_grad():
        compat.run(model, cache, input_ids=prompt_ids)
        out = compat.run(model, cache, input_ids=input_ids, **after)
    return (out.logits, *read_cache(cache, specs))
