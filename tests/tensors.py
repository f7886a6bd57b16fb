"""Small helpers the spelling corpora's tests share: tensors and the IR forms."""

from __future__ import annotations

import torch


def flat(outputs) -> list:
    """The tensors of a (nested) output, in order."""
    return [x for x in torch.utils._pytree.tree_leaves(outputs) if isinstance(x, torch.Tensor)]


def clone(args: tuple) -> tuple:
    """Fresh copies of ``args`` (for programs that write their inputs in place)."""
    return tuple(a.clone() for a in args)


# torch.export's training IR, then its functional and core-aten decompositions.
FORMS = ("training", "functional", "core_aten")


def in_form(ep: torch.export.ExportedProgram, form: str) -> torch.export.ExportedProgram:
    """``ep`` (training IR) in one of FORMS."""
    if form == "functional":
        return ep.run_decompositions({})
    if form == "core_aten":
        return ep.run_decompositions()
    return ep
