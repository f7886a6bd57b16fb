"""The batched graph's export: ``export_generator(model, path, batch=B)`` writes one graph
(B static, S and P symbolic) that advances B sequences of different past lengths per call.
What the graph takes and how :class:`~gdn_fx.runtime.batch.BatchGenerator` serves it:
gdn_fx.runtime.batch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Sequence, Union

import torch
from torch import Tensor, nn
from torch.export import Dim

from gdn_fx.errors import UnsupportedModel
from gdn_fx.hf.decode import DecodeStep
from gdn_fx.runtime.batch import (  # noqa: F401  (the names this module had before the split)
    BATCH, EXTRA_INPUTS, MASKED, PREFILL_CHUNK, BatchGenerator, BatchStats, check_batch)

ATTENTION_TYPES = ("full_attention",)
LINEAR_TYPES = ("linear_attention",)


class BatchStep(DecodeStep):
    """``DecodeStep`` over B rows with per-row positions and per-row pasts:
    ``(input_ids [B, S], position_ids [B, S], past_mask [B, P], *states) -> (logits, *new)``
    (see the module doc)."""

    def __init__(self, model: nn.Module, batch: int, last_logits: bool = True):
        super().__init__(model, last_logits=last_logits, whole_windows=True)
        self.batch = check_batch(batch)
        types = set(getattr(model.config, "layer_types", None) or ())
        other = sorted(types - set(ATTENTION_TYPES) - set(LINEAR_TYPES))
        if not types or other:
            raise UnsupportedModel(
                f"batched export needs a model whose layers are {ATTENTION_TYPES + LINEAR_TYPES}"
                f" (config.layer_types); {type(model).__name__} has "
                f"{sorted(types) if types else 'none declared'}")
        self.layer_types = sorted(types)

    @property
    def input_names(self) -> list[str]:
        return ["input_ids", *EXTRA_INPUTS, *(s.name for s in self.specs)]

    def forward(self, input_ids: Tensor, position_ids: Tensor, past_mask: Tensor,
                *states: Tensor) -> tuple[Tensor, ...]:
        dtype = next(self.model.parameters()).dtype
        seq = input_ids.shape[1]
        rows = torch.arange(seq, device=input_ids.device)
        # 1 above the diagonal (a later token of the call), else 0: additive after scaling
        later = (rows[None, :] > rows[:, None]).to(dtype) * torch.finfo(dtype).min
        past = past_mask.to(dtype)[:, None, None, :].expand(-1, 1, seq, -1)
        new = later[None, None].expand(past.shape[0], 1, seq, seq)
        mask = torch.cat([past, new], dim=-1)
        masks = {kind: mask if kind in ATTENTION_TYPES else None for kind in self.layer_types}
        return self.run_model(input_ids, states, position_ids=position_ids,
                              attention_mask=masks)

    def generator_shapes(self) -> tuple:
        past = Dim("P", min=0)
        seq = Dim("S", min=1)
        caches = tuple({s.past_axis: past} if s.past_axis is not None else None
                       for s in self.specs)
        return ({1: seq}, {1: seq}, {1: past}, caches)

    def batch_inputs(self, seq_len: int, past_lens: Sequence[int], seed: int = 0
                     ) -> tuple[Tensor, ...]:
        """Example inputs: row b has ``past_lens[b]`` own columns (the last ones) of
        ``max(past_lens)`` and positions from there; random caches."""
        args = self.example_inputs(seq_len=seq_len, batch=self.batch,
                                   past_len=max(past_lens), source="random", seed=seed)
        width = max(past_lens)
        mask = torch.full((self.batch, width), MASKED)
        positions = torch.zeros((self.batch, seq_len), dtype=torch.long)
        for row, own in enumerate(past_lens):
            mask[row, width - own:] = 0.0
            positions[row] = torch.arange(own, own + seq_len)
        return (args[0], positions, mask, *args[1:])


EXAMPLE_SEQ, EXAMPLE_PAST = 3, 4


def export_batched(model: nn.Module, path: Union[str, Path], batch: int, *,
                   all_logits: bool = False, say: Callable[[str], None] = lambda line: None,
                   options=None, **fields):
    """``export_generator(model, path, batch=B)``: the batched graph (module doc)."""
    from gdn_fx.hf.attention import grouped_attention
    from gdn_fx.hf.dropins import reify
    from gdn_fx.hf.nnef import (GeneratorFiles, fused_counts, generator_options, place_graphs,
                                prepare_for_nnef, stamp_properties, staging, write_graph)

    options = generator_options(options, fields, "a batched export (batch=B)")
    batch = check_batch(batch)
    path = Path(path)
    step = BatchStep(prepare_for_nnef(model), batch, last_logits=not all_logits)
    # the example's rows: other pasts, so that nothing specializes on one row's
    args = step.batch_inputs(EXAMPLE_SEQ, [EXAMPLE_PAST - (b % 2) for b in range(batch)])
    say(f"export the batched step (B = {batch}, symbolic S and P) -> {path}")
    try:
        with reify(step.model), grouped_attention():
            program = torch.export.export(step, args, strict=False,
                                          dynamic_shapes=step.generator_shapes())
    except torch._dynamo.exc.UserError as error:
        raise UnsupportedModel("the batched step does not compute for every S >= 1 and "
                               f"P >= 0: {str(error).splitlines()[0]}") from None
    counts = fused_counts(program)
    if counts != step.expected_fusions:
        raise UnsupportedModel(f"the reified batched export holds {counts} fused nodes, "
                               f"expected {step.expected_fusions}")
    past = {s.name: {s.past_axis: "P"} for s in step.specs if s.past_axis is not None}
    axes = {"input_ids": {1: "S"}, "position_ids": {1: "S"}, "past_mask": {1: "P"}, **past}
    names = dict(input_names=step.input_names, output_names=step.output_names)
    with staging(path) as folder:
        written = write_graph(program, folder / "graph0.nnef", path, axes, names, options, say)
        stamp_properties(written, {BATCH: str(batch)})
        place_graphs([written], [path], model, options.weights)
    return GeneratorFiles(path, None, tuple(step.input_names), tuple(step.output_names),
                          "batched: one graph")
