"""Whole transformers hybrids to NNEF: model preparation and the dynamic-length export.

    model = prepare_for_nnef(tiny_model("qwen3_5_moe"))
    step = DecodeStep(model)
    program = export_dynamic(step, seq_len=8)            # reified, symbolic sequence axis
    path = export_nnef_dynamic(step, "prefill.nnef.tgz")  # the same, written as NNEF
    errors = check_dynamic(step, path, lengths=(3, 8, 50))  # tract vs eager at each length

Why the dynamic export goes through :func:`~gdn_fx.hf.reify` and not through collapse: a
program exported at a fixed length (even collapsed) holds that length as literals in every
reshape, slice and arange, so no NNEF symbol can stand for it. Reified, the model exports with
``torch.export`` and a dynamic sequence dim (the per-token loops are gone), and its sizes stay
symbolic computations all the way into the NNEF (gdn_fx.lowering.t2n.traced_sizes).
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Optional, Sequence, Union

import torch
from torch import nn

from gdn_fx.errors import UnsupportedModel, UsageError
from gdn_fx.hf.decode import DecodeStep
from gdn_fx.hf.dropins import reify

SEQ_AXIS = {"input_ids": {1: "S"}}  # the NNEF symbol of the number of new tokens
# transformers' MoE kernel that torch-to-nnef can trace (see prepare_for_nnef).
EXPERTS_FOR_NNEF = "batched_mm"


def prepare_for_nnef(model: nn.Module) -> nn.Module:
    """Make ``model`` (in place) traceable by torch-to-nnef; returns it.

    transformers' default MoE kernel (``grouped_mm``) runs the experts through its own custom
    op ``transformers::grouped_mm_fallback``, which torch-to-nnef has no handler for; the
    ``batched_mm`` kernel computes the same with a gather of each token's expert weights and
    batched matmuls, all plain aten ops. Models without experts are left as they are.
    Optional since ``export_nnef`` spells the custom op as plain ops itself
    (``gdn_fx.lowering.t2n.moe``); the generation exports still call it (one graph less to
    rewrite).
    """
    setter = getattr(model, "set_experts_implementation", None)
    if setter is not None:
        setter(EXPERTS_FOR_NNEF)
    return model


def fused_counts(program: torch.export.ExportedProgram) -> dict[str, int]:
    counts = {"gated_delta_scan": 0, "causal_conv1d_update": 0}
    for node in program.graph.nodes:
        for name in counts:
            if node.target is getattr(torch.ops.gdn_fx, name).default:
                counts[name] += 1
    return counts


def export_dynamic(step: DecodeStep, seq_len: int = 8, min_seq: int = 2,
                   max_seq: Optional[int] = None) -> torch.export.ExportedProgram:
    """``torch.export`` of the reified ``step`` with a dynamic number of new tokens.

    Traced at ``seq_len`` new tokens, valid for any count in ``[min_seq, max_seq]`` (min 2:
    transformers takes another branch at one token; export decode separately). Raises
    UnsupportedModel when the program does not hold exactly ``step.expected_fusions``.
    """
    if step.rule != "auto":
        raise UsageError("export_dynamic needs DecodeStep(model, rule='auto'): reified rules "
                         "already run every step as one scan")
    args = step.example_inputs(seq_len=seq_len)
    with reify(step.model):
        program = torch.export.export(step, args, strict=False,
                                      dynamic_shapes=step.dynamic_shapes(min_seq, max_seq))
    counts = fused_counts(program)
    if counts != step.expected_fusions:
        raise UnsupportedModel(f"reified export holds {counts} fused nodes, expected "
                               f"{step.expected_fusions}")
    return program


def export_nnef_dynamic(step: DecodeStep, path: Union[str, Path], seq_len: int = 8,
                        min_seq: int = 2, max_seq: Optional[int] = None,
                        tract_version: str = "0.23.9",
                        choose: Optional[Mapping] = None) -> Path:
    """Write ``step`` as NNEF whose sequence axis is the symbol ``S`` (see module doc).

    ``input_ids`` is ``[batch, S]``; states keep their shapes, attention caches grow by S.
    ``choose`` forces or forbids lowering candidates as in ``gdn_fx.export_nnef``. Verify the
    result at several lengths with :func:`check_dynamic`. Returns the path written.
    """
    from gdn_fx.export import export_nnef

    program = export_dynamic(step, seq_len, min_seq, max_seq)
    return export_nnef(program, path, tract_version=tract_version, dynamic_axes=SEQ_AXIS,
                       input_names=step.input_names, output_names=step.output_names,
                       choose=choose)


def check_dynamic(step: DecodeStep, path: Union[str, Path],
                  lengths: Sequence[int] = (3, 8, 50)) -> dict:
    """{length: Comparison} of tract running ``path`` against ``step.eager`` (transformers'
    own functions, not reified) at each number of new tokens."""
    from gdn_fx import tract_check

    runnable = tract_check.load(path)
    found = {}
    for length in lengths:
        args = step.example_inputs(seq_len=length)
        found[length] = tract_check.compare(runnable, step.eager(*args), args)
    return found
