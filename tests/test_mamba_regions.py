"""Mamba regions as transformers writes them: what collapse makes of them.

Mamba1's multi-token forward (MambaForCausalLM, and Jamba's mamba mixer, at S >= 2) runs a
Python loop over time that export unrolls; its conv output is split into x, B, C and dt. The
conv rule used to raise on that split (a region exit that is a list); it is a near-miss.
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
def test_mamba1_multi_token_collapse_leaves_near_misses(seq):
    model, ids, program = _mamba1(seq)
    result = gdn_fx.collapse(program)  # raised AttributeError in the conv rule before
    # the scan loop (its per-(channel, state) decay and B x dt x u read per position) says
    # why it stays
    assert any(m.rule == "gated_delta_scan" and "position by position" in m.reason
               for m in result.misses), result.explain()
    got = result.program.module()(ids)
    want = model(ids)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
