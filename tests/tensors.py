"""Small tensor helpers the spelling corpora's tests share."""

from __future__ import annotations

import torch


def flat(outputs) -> list:
    """The tensors of a (nested) output, in order."""
    return [x for x in torch.utils._pytree.tree_leaves(outputs) if isinstance(x, torch.Tensor)]


def clone(args: tuple) -> tuple:
    """Fresh copies of ``args`` (for programs that write their inputs in place)."""
    return tuple(a.clone() for a in args)
