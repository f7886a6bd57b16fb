"""The generation-ready artifact by the generalize route (``gdn_fx.generalize``).

    files = export_generalized(tiny_model("qwen3_5"), "out/q.nnef.tgz")

The same artifact contract as :func:`gdn_fx.hf.generator.export_generator` (inputs
``input_ids [B, S]`` then DecodeStep's states, outputs the last logits then the new states,
symbolic S >= 1 and P >= 0, a decode graph beside it when tract serves it), made another way:
no function of transformers is swapped. DecodeStep is exported plainly with torch.export at a
few fixed (S, P), each program is collapsed, and ``gdn_fx.generalize`` makes one program
symbolic in S and P from them. The points have S >= 2 (transformers' ``S == 1`` branch is
another program: traced at S = 1 and S > 1 the graphs differ and generalize refuses); the
multi-token branch carries the given states, so it serves S = 1 too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Mapping, Sequence, Union

import torch
from torch import nn

from gdn_fx.generalization import DEFAULT_POINTS, Generalized, generalize
from gdn_fx.hf.decode import DecodeStep
from gdn_fx.hf.generator import (NOT_ASKED, GeneratorFiles, decode_path, decode_problem,
                                 generator_options, place_graphs)
from gdn_fx.hf.nnef import prepare_for_nnef, staging


def generalize_step(step: DecodeStep, points: Sequence = DEFAULT_POINTS) -> Generalized:
    """``step`` exported plainly (non-strict torch.export) at each (S, P) of ``points``,
    collapsed and generalized (and checked at a far point past every window, generalize's
    doc). The example states are drawn at random: a transformers prefill keeps only
    ``window - 1`` tokens in a sliding layer, which the step's whole-window cache does not."""
    def trace(seq: int, past: int) -> torch.export.ExportedProgram:
        args = step.example_inputs(seq_len=seq, past_len=past, source="random")
        return torch.export.export(step, args, strict=False)

    return generalize(trace, points)


def export_generalized(model: nn.Module, path: Union[str, Path], *, decode: bool = False,
                       points: Sequence = DEFAULT_POINTS,
                       say: Callable[[str], None] = lambda line: None, options=None,
                       **fields) -> GeneratorFiles:
    """Write ``model`` (a transformers hybrid causal LM) as a generation-ready NNEF by the
    generalize route (see the module doc); arguments and result as ``export_generator``'s.
    Raises GeneralizeRefused (naming the node) where no single program serves every S, P."""
    options = generator_options(options, fields, "the generalized export (gdn_fx.generalize)")
    weights = options.weights
    step = DecodeStep(prepare_for_nnef(model), last_logits=True, whole_windows=True)
    say(f"torch.export at (S, P) = {list(points)}, collapse, generalize")
    gen = generalize_step(step, points)
    names = dict(input_names=step.input_names, output_names=step.output_names,
                 options=options)
    path = Path(path)
    finals = [path, decode_path(path)]
    with staging(path) as folder:  # nothing at path until both graphs are written and checked
        say(f"write {path}")
        written = [gen.export_nnef(folder / "graph0.nnef", **names)]
        note = NOT_ASKED
        if decode:
            written.append(_write_decode(gen, step, folder / "graph1.nnef", finals[1], names,
                                         say))
            note = decode_problem(written[1], written[0], step, weights)
            if note:
                say(f"decode graph dropped: {note}; the main graph serves decode")
        kept = finals[:1] if note else finals
        place_graphs(written[:len(kept)], kept, model, weights)
    return GeneratorFiles(path, None if note else finals[1], tuple(step.input_names),
                          tuple(step.output_names), note)


def _write_decode(gen: Generalized, step: DecodeStep, folder: Path, final: Path,
                  names: Mapping, say: Callable[[str], None]) -> Path:
    """The decode graph (S = 1, symbolic P) of the generalized program."""
    from gdn_fx.export import export_nnef

    say(f"write {final}")
    past = {k: v for k, v in gen.dynamic_axes(step.input_names).items() if "P" in v.values()}
    return export_nnef(gen.decode_program(), folder, dynamic_axes=past, **names)
