"""lowering/t2n/fixes.py, float_position_compares: a compare of two position tensors (int64
from ``arange`` plus sizes) is cast to float32 first, where every value provably stays below
2^24 under the symbol bounds the export then declares; any other compare stays int64.

The mask is spelled as transformers' sdpa_mask builds it (``kv_idx <= q_idx`` over
``cache_position = arange(S) + P`` and ``arange(P + S)``); the mutants compare token values,
positions without a bound (a product of sizes) and positions past float32's exact range."""

import pytest
import torch
from torch import nn
from torch.export import Dim

from gdn_fx import tract_check
from gdn_fx.export import export_nnef
from gdn_fx.lowering.t2n.fixes import (POSITION_SYMBOL_MAX, float_position_compares,
                                       ranges_with_offsets)
from gdn_fx.lowering.t2n.traceable import traceable_module


class CausalMask(nn.Module):
    """[S, P + S] additive mask of S new tokens after P cached ones."""

    def forward(self, ids, past):
        s, p = ids.shape[1], past.shape[2]
        q_idx = torch.arange(s) + p
        kv_idx = torch.arange(p + s)
        allowed = kv_idx[None, :] <= q_idx[:, None]
        return torch.where(allowed, 0.0, -1e9) + past.sum() * 0


class TokenCompare(nn.Module):  # values, not positions: no bound
    def forward(self, ids, past):
        return (ids <= torch.arange(ids.shape[1]) + 5).float() + past.sum() * 0


class ProductPositions(nn.Module):  # arange(S * P): no bound from the symbols' bounds
    def forward(self, ids, past):
        s, p = ids.shape[1], past.shape[2]
        return (torch.arange(s * p)[None, :] >= torch.arange(p)[:, None]).float() + ids.sum() * 0


class FarPositions(nn.Module):  # offset 2^24: past float32's exact integers
    def forward(self, ids, past):
        s = ids.shape[1]
        return (torch.arange(s) + 2 ** 24 > torch.arange(s) + past.shape[2]).float()


def inputs(s=3, p=4):
    return torch.arange(s)[None] + 7, torch.zeros(1, 2, p, 8)


DYNAMIC = ({1: Dim("S", min=2)}, {2: Dim("P", min=2)})
AXES = {"ids": {1: "S"}, "past": {2: "P"}}


def casts(module: nn.Module) -> int:
    program = torch.export.export(module, inputs(), dynamic_shapes=DYNAMIC)
    return float_position_compares(traceable_module(program))


def test_causal_mask_is_compared_in_float32_and_computes_the_same(tmp_path):
    assert casts(CausalMask()) == 1
    program = torch.export.export(CausalMask(), inputs(), dynamic_shapes=DYNAMIC)
    path = export_nnef(program, tmp_path / "m.nnef", dynamic_axes=AXES,
                       input_names=["ids", "past"], symbol_min={"P": 0})
    text = tract_check.nnef_text(path)
    assert f"tract_assert P <= {POSITION_SYMBOL_MAX};" in text
    assert f"tract_assert S <= {POSITION_SYMBOL_MAX};" in text
    assert "to = 'f32'" in text
    runnable = tract_check.load(path)
    for s, p in [(1, 0), (5, 0), (1, 9), (7, 30), (64, 448)]:
        args = inputs(s, p)
        got = tract_check.run(runnable, args)[0]
        assert (got == CausalMask()(*args).numpy()).all(), (s, p)


@pytest.mark.parametrize("module", [TokenCompare(), ProductPositions(), FarPositions()],
                         ids=["token values", "product of sizes", "past 2^24"])
def test_other_compares_stay_int64(module):
    assert casts(module) == 0


class FloatRange(nn.Module):  # a float range plus a size: not rewritten
    def forward(self, ids, past):
        return torch.arange(ids.shape[1], dtype=torch.float32) + past.shape[2]


class RangePlusTensor(nn.Module):  # a range plus token values: not rewritten
    def forward(self, ids, past):
        return torch.arange(ids.shape[1]) + ids[0]


@pytest.mark.parametrize("module, rewritten", [(CausalMask(), 1), (FloatRange(), 0),
                                               (RangePlusTensor(), 0)])
def test_range_plus_size_becomes_a_range_from_it(module, rewritten):
    """``arange(S) + P`` as ``arange(P, P + S)``: the same values (run here at other sizes
    than traced), one op fewer (tract adds a size to a range element by element)."""
    program = torch.export.export(module, inputs(), dynamic_shapes=DYNAMIC)
    plain = traceable_module(program)
    assert ranges_with_offsets(plain) == rewritten
    plain.recompile()
    for s, p in [(1, 0), (6, 11)]:
        want, got = module(*inputs(s, p)), plain(*inputs(s, p))
        got = got[0] if isinstance(got, (tuple, list)) else got
        assert torch.equal(got, want)


def test_export_without_position_compare_declares_no_upper_bound(tmp_path):
    program = torch.export.export(TokenCompare(), inputs(), dynamic_shapes=DYNAMIC)
    path = export_nnef(program, tmp_path / "t.nnef", dynamic_axes=AXES,
                       input_names=["ids", "past"])
    assert " <= " not in tract_check.nnef_text(path).split("graph ")[0]
