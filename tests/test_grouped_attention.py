"""Grouped-query attention on the key/value heads (gdn_fx/hf/attention.py) against
transformers' own "sdpa" attention function, which repeats the key/value heads."""

from __future__ import annotations

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from gdn_fx.hf.attention import grouped_attention, grouped_sdpa


class _Layer:  # what transformers' attention functions read from the calling module
    num_key_value_groups = 4
    is_causal = True


def _inputs(seq: int, length: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 8, seq, 16, generator=gen)
    k, v = torch.randn(2, 2, length, 16, generator=gen), torch.randn(2, 2, length, 8, generator=gen)
    return q, k, v, gen


def _masks(seq: int, length: int, gen: torch.Generator) -> dict:
    causal = torch.ones(seq, length, dtype=torch.bool).tril(length - seq)
    return {"bool, shared": causal[None, None].expand(2, 1, seq, length),
            "float, shared": torch.randn(1, 1, seq, length, generator=gen),
            "float, per head": torch.randn(2, 8, seq, length, generator=gen)}


@pytest.mark.parametrize("seq, length", [(1, 9), (5, 9), (6, 6)])
def test_grouped_attention_computes_what_transformers_sdpa_computes(seq, length):
    q, k, v, gen = _inputs(seq, length)
    for name, mask in _masks(seq, length, gen).items():
        want, _ = sdpa_attention_forward(_Layer(), q, k, v, mask, scaling=0.3)
        got = grouped_sdpa(q, k, v, mask, 0.3)
        assert got.shape == want.shape == (2, seq, 8, 8)
        assert torch.allclose(got, want, atol=1e-6, rtol=0), f"{name}: {(got - want).abs().max()}"


def test_the_key_value_heads_are_not_repeated():
    # Query head h reads key/value head h // 4: swapping two key heads swaps 4 query heads.
    q, k, v, gen = _inputs(3, 7)
    mask = _masks(3, 7, gen)["float, shared"]
    out = grouped_sdpa(q, k, v, mask)
    swapped = grouped_sdpa(q[:, [4, 5, 6, 7, 0, 1, 2, 3]], k.flip(1), v.flip(1), mask)
    assert torch.allclose(swapped[:, :, :4], out[:, :, 4:], atol=1e-6)


def test_only_export_time_calls_are_served_and_transformers_is_restored():
    original = ALL_ATTENTION_FUNCTIONS["sdpa"]
    q, k, v, gen = _inputs(4, 6)
    with grouped_attention():
        served = ALL_ATTENTION_FUNCTIONS["sdpa"]
        assert served is not original
        # No mask: transformers' own path (enable_gqa), the same numbers.
        got, _ = served(_Layer(), q, k, v, None)
        want, _ = original(_Layer(), q, k, v, None)
        assert torch.equal(got, want)
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is original
