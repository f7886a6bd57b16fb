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


class Logits(torch.nn.Module):
    """A causal LM as a module of token ids -> logits, no cache (an export as users write it)."""

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
    model = Logits(transformers.MambaForCausalLM(config).eval())
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


class _Mamba2Decode(torch.nn.Module):
    """transformers' Mamba2 decode step, as mamba2_scan_forward calls it for one token: dt
    and A expanded to [H, P, N], the state [B, H, P, N] cloned and updated once."""

    B, H, P, N, G = 2, 4, 8, 6, 2

    def __init__(self):
        super().__init__()
        self.A_log = torch.nn.Parameter(torch.rand(self.H) + 0.5)
        self.D = torch.nn.Parameter(torch.randn(self.H))
        self.dt_bias = torch.nn.Parameter(torch.randn(self.H) * 0.1)

    def forward(self, x, dt, bm, cm, state):
        from transformers.models.mamba2.modeling_mamba2 import mamba2_selective_state_update
        b, h, p, n, g = self.B, self.H, self.P, self.N, self.G
        nxt = state.clone()
        y = mamba2_selective_state_update(
            nxt, x.view(b, h, p), dt.transpose(1, 2).expand(-1, -1, p),
            (-torch.exp(self.A_log.float()))[:, None, None].expand(-1, p, n),
            bm.view(b, g, n), cm.view(b, g, n), self.D[:, None].expand(-1, p), z=None,
            dt_bias=self.dt_bias[:, None].expand(-1, p), dt_softplus=True)
        return y.view(b, 1, -1), nxt


def test_mamba2_decode_step_without_a_loop_leaves_a_near_miss():
    m = _Mamba2Decode()
    b, h, p, n, g = m.B, m.H, m.P, m.N, m.G
    gen = torch.Generator().manual_seed(0)
    args = (torch.randn(b, 1, h * p, generator=gen), torch.randn(b, 1, h, generator=gen),
            torch.randn(b, 1, g * n, generator=gen), torch.randn(b, 1, g * n, generator=gen),
            torch.randn(b, h, p, n, generator=gen))
    result = gdn_fx.collapse(torch.export.export(m, args))
    # before, nothing was said about it (issue: "Mamba2 hybrids report no near-miss at all")
    said = [m for m in result.misses if "with no time axis" in m.reason]
    assert len(said) == 1 and "state [2, 4, 8, 6]" in said[0].reason, result.explain()
    got, want = result.program.module()(*args), m(*args)
    assert all(torch.equal(x, y) for x, y in zip(got, want))  # nothing fused: the same ops


def test_a_loop_the_rules_fuse_leaves_no_single_step_near_miss():
    model, ids, program = _mamba1(4)
    result = gdn_fx.collapse(program)
    assert not [m for m in result.misses if "with no time axis" in m.reason], result.explain()
