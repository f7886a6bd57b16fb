"""Grouped-query attention on the key/value heads, for the generation exports.

transformers' "sdpa" attention repeats every key/value head for its G query heads
(``repeat_kv``) unless there is no mask (then ``enable_gqa``) or one query token (its own
``S == 1`` branch, which the symbolic-S export never takes). tract then materializes the
repeated cache, G times its size, on every call: at the 0.8B shape (2 key/value heads, G = 4,
past 512) each attention layer's decode step took ~3.9 ms in tract's profile, ~1.1 without it.

:func:`grouped_attention` serves "sdpa" while a model is exported by computing the same
attention on the key/value heads themselves: the G query heads of a key/value head become G
blocks of rows, ``[B, Hq, S, D] -> [B, Hkv, G * S, D]``, the mask's rows are repeated to match,
and the result is reshaped back. Every output row is the same softmax over the same scores
as before, so the graph computes what transformers computes (the generation checks compare
it with transformers' own generate). Calls it does not cover (no mask, dropout, a position
bias, softcap, attention sinks, attention weights asked for) go to transformers' function.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import Tensor

_UNCOVERED = ("softcap", "position_bias", "s_aux", "sinks")


@contextlib.contextmanager
def grouped_attention():
    """While inside, transformers' "sdpa" attention runs as grouped-query attention on the
    key/value heads (see the module doc); transformers' own function is restored on exit."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    original = ALL_ATTENTION_FUNCTIONS["sdpa"]
    had_local = "sdpa" in ALL_ATTENTION_FUNCTIONS._local_mapping

    def grouped(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                is_causal=None, **kwargs):
        if not _covered(query, key, attention_mask, dropout, kwargs):
            return original(module, query, key, value, attention_mask, dropout=dropout,
                            scaling=scaling, is_causal=is_causal, **kwargs)
        return grouped_sdpa(query, key, value, attention_mask, scaling), None

    ALL_ATTENTION_FUNCTIONS["sdpa"] = grouped
    try:
        yield
    finally:
        if had_local:
            ALL_ATTENTION_FUNCTIONS["sdpa"] = original
        else:
            del ALL_ATTENTION_FUNCTIONS["sdpa"]


def _covered(query: Tensor, key: Tensor, mask, dropout: float, kwargs: dict) -> bool:
    groups, rest = divmod(query.shape[1], key.shape[1])
    return (groups > 1 and rest == 0 and isinstance(mask, Tensor) and mask.dim() == 4
            and mask.shape[1] in (1, query.shape[1]) and not dropout
            and not kwargs.get("output_attentions")
            and all(kwargs.get(name) is None for name in _UNCOVERED))


def grouped_sdpa(query: Tensor, key: Tensor, value: Tensor, mask: Tensor,
                 scaling=None) -> Tensor:
    """Attention of ``query`` [B, Hq, S, D] over ``key`` / ``value`` [B, Hkv, T, D] (Hq = G Hkv,
    query head h reads key/value head h // G, as ``repeat_kv`` lays them out) under ``mask``
    [B or 1, 1 or Hq, S, >= T]; returns [B, S, Hq, Dv] as transformers' attention functions do."""
    batch, heads, seq, width = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    rows = query.reshape(batch, kv_heads, groups * seq, width)
    mask = mask[..., :length]
    if mask.dtype == torch.bool:  # additive, as sdpa applies it, before the rows are repeated:
        # tract 0.23.9's FoldUniformMask fails on a select whose condition is the repeated
        # mask (it folds a [1, 1, G, P + 1] all-true decode mask into a [1, 1, 1, 1] constant)
        mask = torch.where(mask, 0.0, torch.finfo(query.dtype).min).to(query.dtype)
    if mask.shape[1] == 1:  # one mask for every head: repeat its rows for the G blocks
        mask = mask.unsqueeze(2).expand(mask.shape[0], 1, groups, seq, length)
    mask = mask.reshape(mask.shape[0], -1, groups * seq, length)
    out = F.scaled_dot_product_attention(rows, key, value, attn_mask=mask, scale=scaling)
    # [B, Hkv, G S, Dv] -> [B, Hkv, G, S, Dv] -> [B, S, Hkv, G, Dv] -> [B, S, Hq, Dv]. The
    # transpose and copy are transformers' own, and give the copy plain strides: a reshape of
    # sdpa's output itself made torch.export guard on S (S * min(256, 1024 S) == 256 S) and
    # refuse the named dimension; the copy is transposed back (tract folds the pair). Only S
    # moves: Hkv, G, Dv keep their order, the order o_proj's input axis merges them in. A
    # permutation among them (G moved past Hkv, as [B, G, S, Hkv, Dv] -> [B, S, Hkv, G, Dv]
    # did) is pushed by tract 0.23.9 into o_proj's weight, and with a Q4_0 weight tract then
    # computes a wrong product (relative error ~1 on linear(permute(x).reshape(..), W_q4_0)).
    plain = out.transpose(1, 2).contiguous().transpose(1, 2)
    split = plain.unflatten(2, (groups, seq))
    return split.permute(0, 3, 1, 2, 4).reshape(batch, seq, heads, value.shape[-1])
