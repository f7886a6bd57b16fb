"""Mamba regions as transformers writes them: what collapse makes of them.

Mamba1's multi-token forward (MambaForCausalLM, and Jamba's mamba mixer, at S >= 2) runs a
Python loop over time that export unrolls; its conv output is split into x, B, C and dt. The
conv rule used to raise on that split (a region exit that is a list); it is a near-miss, and
the loop is one gated_linear_scan.
"""

from __future__ import annotations

import functools

import pytest
import torch

import gdn_fx

transformers = pytest.importorskip("transformers")


class _Logits(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(ids, use_cache=False).logits


@functools.cache
def _mamba1(seq: int):
    config = transformers.MambaConfig(vocab_size=64, hidden_size=16, state_size=4,
                                      num_hidden_layers=1, expand=2, conv_kernel=4,
                                      time_step_rank=2)
    torch.manual_seed(0)
    model = _Logits(transformers.MambaForCausalLM(config).eval())
    ids = torch.randint(0, 64, (1, seq), generator=torch.Generator().manual_seed(1))
    return model, ids, torch.export.export(model, (ids,))


@pytest.mark.parametrize("seq", [2, 4])
def test_mamba1_multi_token_scan_fuses_into_gated_linear_scan(seq):
    model, ids, program = _mamba1(seq)
    result = gdn_fx.collapse(program)  # raised AttributeError in the conv rule once
    # the loop's state [B, D, N] has no value axis; it reads exp(A dt) and B dt u, formed
    # before the loop, and C shared by every channel: one op per layer, Dv = 1
    assert result.counts["gated_linear_scan"] == 1, result.explain()
    assert result.counts["gated_delta_scan"] == 0
    got = result.program.module()(ids)
    want = model(ids)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
