"""lowering/t2n/noop_scatters.py: a scatter that writes back its base's own values is removed,
any other stays. The main case is transformers' own Qwen3.5 mRoPE module (code we did not
write); the mutants are scatters whose source differs from the base somewhere."""

import pytest
import torch
from torch import nn

from gdn_fx.lowering.t2n.noop_scatters import noop_scatters
from gdn_fx.lowering.t2n.traceable import traceable_module

aten = torch.ops.aten
SCATTERS = (aten.slice_scatter.default, aten.select_scatter.default)


def scatters(module) -> int:
    return sum(node.target in SCATTERS for node in module.graph.nodes)


def rewritten(module: nn.Module, args: tuple, dynamic=None, decompose=False):
    """(the exported program's plain module before, after noop_scatters, how many went)."""
    program = torch.export.export(module, args, strict=False, dynamic_shapes=dynamic)
    if decompose:
        program = program.run_decompositions()
    before, after = traceable_module(program), traceable_module(program)
    removed = noop_scatters(after)
    after.recompile()
    return before, after, removed


def same(before, after, *args) -> bool:
    want, got = before(*args), after(*args)
    return len(want) == len(got) and all(torch.equal(w, g) for w, g in zip(want, got))


def rotary(**rope):
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding

    config = Qwen3_5TextConfig(hidden_size=64, num_attention_heads=2, head_dim=64, **rope)
    return Qwen3_5TextRotaryEmbedding(config).eval()


class Rope(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x, position_ids):
        return self.inner(x, position_ids)


@pytest.mark.parametrize("decompose", [False, True])  # run_decompositions spells select_scatter
def test_text_mrope_loses_every_scatter_and_keeps_its_values(decompose):  # as a where
    x = torch.zeros(1, 5, 64, dtype=torch.float16)
    positions = torch.arange(5)[None]
    seq = torch.export.Dim("S", min=2, max=4096)
    before, after, removed = rewritten(Rope(rotary()), (x, positions),
                                       ({1: seq}, {1: seq}), decompose)
    assert scatters(before) > 0 and removed > 0 and scatters(after) == 0
    assert not any(node.target is aten.where.self for node in after.graph.nodes)
    for length in (1, 7, 300):
        positions = torch.randint(0, 100_000, (1, length))
        x = torch.zeros(1, length, 64, dtype=torch.float16)
        assert same(before, after, x, positions)


def test_mrope_with_distinct_rows_keeps_its_scatters():
    """3-D position ids (a vision prompt: t, h and w rows differ) are not uniform."""
    x = torch.zeros(1, 5, 64)
    positions = torch.stack([torch.arange(5), torch.arange(5) * 2, torch.arange(5) * 3])[:, None]
    before, after, removed = rewritten(Rope(rotary()), (x, positions))
    assert removed == 0 and scatters(after) == scatters(before) > 0
    assert same(before, after, x, positions)


class RowCopy(nn.Module):
    """rows[0][..., 1::3] = rows[k][..., 1::3], rows made by ``make``."""

    def __init__(self, make, k=1, step=3):
        super().__init__()
        self.make, self.k, self.step = make, k, step

    def forward(self, x):
        rows = self.make(x)
        first = rows[0]
        first[..., 1::self.step] = rows[self.k][..., 1::self.step]
        return rows * 1.0


def expanded(x):
    return (x[None] * 2.0).expand(3, -1, -1).clone() + 0.0


def expanded_no_clone(x):
    return torch.sin(x.unsqueeze(0).expand(3, -1, -1) * 3.0)


def distinct(x):
    return torch.stack([x, x + 1.0, x * 2.0]) * 1.0


@pytest.mark.parametrize("make, k, step, goes", [
    (expanded_no_clone, 1, 3, True),   # uniform along the rows: both writes are no-ops
    (expanded_no_clone, 0, 2, True),   # a row onto itself
    (distinct, 1, 3, False),           # the rows differ
    (distinct, 0, 3, True),            # the same row, written back
    (expanded, 2, 3, True),            # through clone and a broadcast add of a scalar
])
@pytest.mark.parametrize("decompose", [False, True])
def test_hand_written_row_copies(make, k, step, goes, decompose):
    x = torch.randn(4, 12)
    before, after, removed = rewritten(RowCopy(make, k, step), (x,), None, decompose)
    assert (removed > 0) == goes
    if goes:
        assert scatters(after) == 0
    for sample in (x, torch.randn(4, 12)):
        assert same(before, after, sample)


class ShiftedCopy(nn.Module):
    """rows[0][..., 0:4] = rows[0][..., 1:5]: the same tensor, another window: kept."""

    def forward(self, x):
        rows = expanded_no_clone(x)
        first = rows[0]
        first[..., 0:4] = rows[1][..., 1:5]
        return rows * 1.0


def test_another_window_of_the_same_values_is_kept():
    x = torch.randn(4, 12)
    before, after, removed = rewritten(ShiftedCopy(), (x,))
    assert removed == 0
    assert same(before, after, x)


class RowOntoAnother(nn.Module):
    """rows[2] = rows[0] of rows that differ: a select_scatter whose source index equals its
    dim (0) but not its index (2): kept."""

    def forward(self, x):
        rows = distinct(x)
        rows[2] = rows[0]
        return rows * 1.0


@pytest.mark.parametrize("decompose", [False, True])
def test_a_row_written_onto_another_row_is_kept(decompose):
    x = torch.randn(4, 12)
    before, after, removed = rewritten(RowOntoAnother(), (x,), None, decompose)
    assert removed == 0
    assert same(before, after, x)


class InputWritten(nn.Module):
    """x[0] = y and x[:, 1:3] = y2, sources that are program inputs: kept."""

    def forward(self, x, y, y2):
        x = x * 1.0
        x[0] = y
        x[:, 1:3] = y2
        return x


@pytest.mark.parametrize("decompose", [False, True])
def test_inputs_written_into_a_tensor_are_kept(decompose):
    args = (torch.randn(4, 12), torch.randn(12), torch.randn(4, 2))
    before, after, removed = rewritten(InputWritten(), args, None, decompose)
    assert removed == 0
    assert same(before, after, *args)
