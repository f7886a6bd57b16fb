"""export_nnef on what users hand it as is: transformers' default MoE kernel (no
prepare_for_nnef), and programs with inputs nothing reads."""

import numpy as np
import pytest
import torch
import transformers.integrations.moe  # noqa: F401  (registers transformers::grouped_mm_fallback)

import gdn_fx
from gdn_fx import tract_check
from gdn_fx.hf import DecodeStep, tiny_model
from gdn_fx.lowering.t2n.moe import grouped_mm_as_gathered_bmm, histc_by_comparison


def test_grouped_mm_plain_ops_compute_what_the_fallback_computes():
    weight = torch.randn(4, 16, 8)
    x = torch.randn(7, 16)
    offs = torch.tensor([2, 2, 5, 6], dtype=torch.int32)  # expert 1 empty, row 6 past the end
    want = torch.ops.transformers.grouped_mm_fallback(x, weight, offs)
    got = grouped_mm_as_gathered_bmm(x, weight, offs)
    assert torch.equal(got[6], torch.zeros(8))
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-6)


def test_histc_by_comparison_counts_like_histc():
    x = torch.tensor([0.0, 1, 1, 3, 3, 3, 2, -1, 4, 2.5])  # -1 and 4 are outside [0, 3]
    assert torch.equal(histc_by_comparison(x, 4, 0, 3), torch.histc(x, 4, 0, 3))
    y = torch.rand(200) * 12 - 1
    assert torch.equal(histc_by_comparison(y, 7, 0.5, 9.0), torch.histc(y, 7, 0.5, 9.0))


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_moe"])
def test_plain_moe_decode_step_reaches_tract(tmp_path, family):
    """torch.export -> collapse -> export_nnef -> tract, nothing else, with transformers'
    default experts kernel (grouped_mm, its custom op in the graph)."""
    step = DecodeStep(tiny_model(family))
    args = step.example_inputs(seq_len=1)
    result = gdn_fx.collapse(torch.export.export(step, args))
    assert sum(result.counts.values()) > 0
    assert any("grouped_mm_fallback" in str(n.target) for n in result.program.graph.nodes)
    path = gdn_fx.export_nnef(result.program, tmp_path / "moe.nnef.tgz",
                              input_names=step.input_names, output_names=step.output_names)
    found = tract_check.compare(path, step.eager(*args), args)
    assert found.ok, found


class Ignores(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(32, 32)

    def forward(self, x, mask, y):  # mask is never read
        return self.proj(x) + y


def _signature(path):
    text = tract_check.nnef_text(path)
    return next(line for line in text.splitlines() if line.startswith("graph "))


@pytest.mark.parametrize("dynamic", [False, True])
def test_unused_input_stays_an_input_in_its_place(tmp_path, dynamic):
    args = (torch.randn(2, 32), torch.randn(3), torch.randn(2, 32))
    program = torch.export.export(Ignores(), args)
    axes = {"x": {0: "B"}, "y": {0: "B"}, "mask": {0: "M"}} if dynamic else None
    path = gdn_fx.export_nnef(program, tmp_path / "m.nnef.tgz", dynamic_axes=axes)
    assert _signature(path).startswith("graph network(x, mask, y)")
    model = tract_check.load(path)
    assert model.input_count() == 3
    want = program.module()(*args)
    assert tract_check.compare(model, [want], args).ok
    other = (args[0], torch.randn(5 if dynamic else 3), args[2])  # its value is ignored
    got = tract_check.run(model, other)[0]
    assert np.allclose(got, want.detach().numpy(), rtol=1e-5, atol=1e-6)


def test_unused_input_nothing_printed(tmp_path, capfd):
    args = (torch.randn(2, 32), torch.randn(3), torch.randn(2, 32))
    gdn_fx.export_nnef(torch.export.export(Ignores(), args), tmp_path / "m.nnef.tgz")
    assert "PyTorch JIT Graph" not in capfd.readouterr().out
