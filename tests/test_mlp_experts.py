"""A dense SwiGLU MLP as a two-expert tract_moe_ffn (lowering/t2n/mlp_experts.py): the law it
rests on at many scales, what it takes and what it leaves, and tract on real models."""

import logging

import pytest
import torch
from torch import nn

from gdn_fx.lowering.t2n import mlp_experts
from gdn_fx.lowering.t2n.moe_ffn import moe_ffn_reference

CHOOSE = {"dense_mlp": "tract_moe_ffn"}


def _mlp_f64(x, wg, wu, wd):
    silu = torch.nn.functional.silu
    return (silu(x @ wg.T) * (x @ wu.T)) @ wd.T


@pytest.mark.parametrize("scale", [1e-30, 1e-6, 1.0, 1e6, 1e15])
def test_two_experts_are_the_mlp_in_float64_at_every_scale(scale):
    """The experts' sum (written here from the operator's definition, float64) equals the
    MLP with the original weights, weights drawn at ``scale`` and inputs over decades."""
    gen = torch.Generator().manual_seed(int(abs(torch.log10(torch.tensor(scale)))))
    d, h = 12, 10
    wg, wu = (torch.randn(h, d, generator=gen, dtype=torch.float64) * scale for _ in "gu")
    wd = torch.randn(d, h, generator=gen, dtype=torch.float64) * scale
    x = torch.randn(5, d, generator=gen, dtype=torch.float64) * torch.logspace(-3, 3, 5,
                                                                               dtype=torch.float64)[:, None]
    ops = mlp_experts.experts(wg, wu, wd)
    assert torch.equal(ops["wg"], torch.zeros(2, d, dtype=torch.float64))
    got = sum(0.5 * (torch.nn.functional.silu(x @ ops["w1"][e]) * (x @ ops["w3"][e]))
              @ ops["w2"][e] for e in range(2))
    want = _mlp_f64(x, wg, wu, wd)
    assert torch.allclose(got, want, rtol=1e-12, atol=0), float((got - want).abs().max())
    # ... and tract's operator as gdn_fx models it (the bridge's eager body, in f32) equals
    # the f32 MLP: both underflow or overflow alike where f32 cannot hold the scale
    f32 = [t.float() for t in (x, wg, wu, wd)]
    got32 = moe_ffn_reference(f32[0], **{k: v.float() for k, v in ops.items()}, k=2,
                              gate="softmax_topk")
    want32 = _mlp_f64(*f32)
    assert torch.equal(got32.isfinite(), want32.isfinite())
    finite = want32.isfinite()
    if finite.any():  # at 1e15 f32 overflows everywhere, in both
        error = (got32[finite] - want32[finite]).abs().max()
        assert error <= 1e-5 * want32[finite].abs().max()


class Mlp(nn.Module):
    def __init__(self, d=16, h=24, bias=False, act=nn.functional.silu, shared_gate=False):
        super().__init__()
        self.gate = nn.Linear(d, h, bias=bias)
        self.up = nn.Linear(d, h, bias=False)
        self.down = nn.Linear(h, d, bias=False)
        self.act, self.shared_gate = act, shared_gate

    def forward(self, x):
        g = self.gate(x)
        y = self.down(self.act(g) * self.up(x))
        return y + g.sum(-1, keepdim=True) if self.shared_gate else y


class TwoInputs(Mlp):
    def forward(self, x, z):
        return self.down(nn.functional.silu(self.gate(x)) * self.up(z))


def _module(model, *args):
    program = torch.export.export(model.eval(), args).run_decompositions({})
    return program.module()


class _Target:
    runtime, version_text = "cpu", "0.23.9"

    def at_least(self, version):
        return True


def _fused(module, weights="f32", target=None):
    return mlp_experts.fuse_dense_mlps(module, target or _Target(), weights)


def test_an_mlp_becomes_one_moe_op_that_computes_it():
    x = torch.randn(2, 3, 16)
    model = Mlp()
    module = _module(model, x)
    assert _fused(module) == 1
    targets = [n.target for n in module.graph.nodes if n.op == "call_function"]
    assert torch.ops.t2n_extra.gdn_fx_moe_ffn.default in targets
    assert torch.ops.aten.linear.default not in targets
    fresh = torch.randn(2, 3, 16)  # fresh values, the traced shape
    assert torch.allclose(module(fresh), model(fresh), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("model, args, why", [
    (Mlp(bias=True), (torch.randn(1, 4, 16),), "a bias"),
    (Mlp(act=nn.functional.gelu), (torch.randn(1, 4, 16),), "gelu, not silu"),
    (Mlp(shared_gate=True), (torch.randn(1, 4, 16),), "the gate read elsewhere"),
    (TwoInputs(), (torch.randn(1, 4, 16), torch.randn(1, 4, 16)), "gate and up of two inputs"),
    (Mlp(h=25), (torch.randn(1, 4, 16),), "an odd hidden width"),
])
def test_what_is_not_that_mlp_stays_plain(model, args, why):
    module = _module(model, *args)
    assert _fused(module) == 0, why
    assert torch.allclose(module(*args), model(*args))


@pytest.mark.parametrize("weights, runtime", [("f16", "cpu"), ("q4_0", "cpu"), ("f32", "cuda")])
def test_formats_and_runtimes_not_measured_stay_plain(weights, runtime, caplog):
    target = _Target()
    target.runtime = runtime
    module = _module(Mlp(), torch.randn(1, 4, 16))
    with caplog.at_level(logging.INFO, logger="gdn_fx.lowering"):
        assert _fused(module, weights, target) == 0
    assert "left as plain ops" in caplog.text


def test_tract_runs_the_experts_as_eager_runs_the_mlp(tmp_path):
    import gdn_fx
    from gdn_fx import tract_check

    model, x = Mlp(d=64, h=96).eval(), torch.randn(1, 7, 64)
    program = torch.export.export(model, (x,))
    path = gdn_fx.export_nnef(program, tmp_path / "mlp.nnef.tgz", choose=CHOOSE)
    assert tract_check.nnef_text(path).count("tract_moe_ffn(") == 1
    assert tract_check.compare(path, (model(x),), (x,)).ok


def test_bad_choice_is_refused():
    from gdn_fx.errors import UsageError

    with pytest.raises(UsageError, match="dense_mlp"):
        mlp_experts.split_choice({"dense_mlp": "threads"})


@pytest.mark.slow  # exports a whole tiny model
@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_a_model_with_mlp_experts_generates_what_transformers_generates(tmp_path, family):
    """Every dense MLP (qwen3_5_moe: its shared experts, beside the routed blocks) becomes
    one tract_moe_ffn, and the artifact generates transformers' tokens."""
    from gdn_fx import tract_check
    from gdn_fx.hf import tiny_model
    from gdn_fx.hf.generator import Generator, check_generation, export_generator

    model = tiny_model(family)
    files = export_generator(model, tmp_path / "m.nnef.tgz", choose=CHOOSE)
    text = tract_check.nnef_text(files.main)
    assert text.count("tract_moe_ffn(") == model.config.num_hidden_layers * (
        2 if family == "qwen3_5_moe" else 1)
    result = Generator(files.main).generate(list(range(3, 40)), max_new_tokens=24)
    found = check_generation(model, result)
    assert found.ok, str(found)
