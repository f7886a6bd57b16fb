"""Sparse-attention indexers: layers that choose which key positions a query reads by value.

glm5_next's indexer (a top-k over pooled scores, then ``pool_keys[:, keep]``) and qwen4_exp's
QSA indexer (``torch.nonzero`` over the mask row, then ``if num_complete_blocks > 0`` and a
top-k over block scores) select positions by their values, so the sizes of the tensors after
them follow values, not S and P. No NNEF graph computes that at every length: torch.export
either stops on the branch (qwen4_exp: ``GuardOnDataDependentSymNode``) or leaves a size that
export_nnef refuses (glm5_next, after the whole trace). The exports refuse such a model here,
from its modules, before any tracing.
"""

from __future__ import annotations

from typing import Optional

import transformers
from torch import nn

from gdn_fx.errors import ExportRefused


def indexers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(path, module) of every sparse-attention indexer of ``model``: transformers names their
    classes ``...Indexer`` (Glm5NextTextIndexer, Qwen4ExpTextQSAIndexer)."""
    return [(path, module) for path, module in model.named_modules()
            if type(module).__name__.endswith("Indexer")]


def values_dependent_reason(model: nn.Module) -> Optional[str]:
    """Why ``model`` has sizes that depend on values (naming its first indexer), else None."""
    found = indexers(model)
    if not found:
        return None
    path, module = found[0]
    more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
    return (f"its indexer {path} ({type(module).__name__}, transformers "
            f"{transformers.__version__}){more} selects key positions by value (a top-k over "
            "scores, nonzero or a boolean mask), so the sizes after it depend on values (a "
            "data-dependent size), not on S and P: no NNEF graph computes it at every length")


def require_static_sizes(model: nn.Module, name: str = "") -> None:
    """Refuse, before any tracing, a model whose indexer selects positions by value."""
    reason = values_dependent_reason(model)
    if reason is not None:
        label = name or type(model).__name__
        raise ExportRefused(f"{label} ({type(model).__name__}) cannot be exported: {reason}")
