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


@pytest.mark.parametrize("moe", [None, "gathered_bmm"])
@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_moe"])
def test_plain_moe_decode_step_reaches_tract(tmp_path, family, moe):
    """torch.export -> collapse -> export_nnef -> tract, nothing else, with transformers'
    default experts kernel (grouped_mm, its custom op in the graph): by default every routed
    block becomes one tract_moe_ffn; forced, the gather + bmm spelling."""
    step = DecodeStep(tiny_model(family))
    args = step.example_inputs(seq_len=1)
    result = gdn_fx.collapse(torch.export.export(step, args))
    assert sum(result.counts.values()) > 0
    grouped = [n for n in result.program.graph.nodes if "grouped_mm_fallback" in str(n.target)]
    assert grouped
    choose = None if moe is None else {"transformers_moe": moe}
    path = gdn_fx.export_nnef(result.program, tmp_path / "moe.nnef.tgz", choose=choose,
                              input_names=step.input_names, output_names=step.output_names)
    blocks = len(grouped) // 2  # two products per block
    assert tract_check.nnef_text(path).count("tract_moe_ffn(") == (blocks if moe is None else 0)
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


# --- tract_moe_ffn (lowering/t2n/moe_ffn.py) ---------------------------------------------------

def _block(family: str, act: str = "silu", norm_topk: bool = True, seed: int = 0):
    """A transformers sparse MoE block with its default (grouped_mm) kernel, random weights."""
    import transformers

    config_class, module = {
        "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "qwen3_5_moe.modeling_qwen3_5_moe"),
        "qwen3_next": ("Qwen3NextConfig", "qwen3_next.modeling_qwen3_next")}[family]
    extra = {} if family == "qwen3_5_moe" else {"norm_topk_prob": norm_topk}
    config = getattr(transformers, config_class)(
        hidden_size=64, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, hidden_act=act, **extra)
    config._experts_implementation = "grouped_mm"
    block_class = {"qwen3_5_moe": "Qwen3_5MoeSparseMoeBlock",
                   "qwen3_next": "Qwen3NextSparseMoeBlock"}[family]
    modeling = __import__(f"transformers.models.{module}", fromlist=[block_class])
    torch.manual_seed(seed)
    block = getattr(modeling, block_class)(config).eval()
    with torch.no_grad():
        for parameter in block.parameters():
            parameter.normal_(0.0, 0.2)
    return block


def _routed_weights(block):
    """tract's canonical layout from transformers' storage: w1/w3 [E, D, H], w2 [E, H, D]."""
    gate_up = block.experts.gate_up_proj.detach()  # [E, 2H, D], gate rows first
    half = gate_up.shape[1] // 2
    return (block.gate.weight.detach(), gate_up[:, :half].transpose(1, 2),
            block.experts.down_proj.detach().transpose(1, 2), gate_up[:, half:].transpose(1, 2))


@pytest.mark.parametrize("family, norm_topk, gate", [
    ("qwen3_5_moe", True, "softmax_topk"), ("qwen3_next", True, "softmax_topk"),
    ("qwen3_next", False, "softmax_all")])
def test_moe_ffn_reference_is_transformers_routed_experts(family, norm_topk, gate):
    """The reading tract_moe_ffn is checked against equals transformers' own router and
    experts (their eager loop over experts), for both gate modes."""
    from gdn_fx.lowering.t2n.moe_ffn import moe_ffn_reference

    block = _block(family, norm_topk=norm_topk)
    tokens = torch.randn(9, 64)
    with torch.no_grad():
        _, scores, chosen = block.gate(tokens)
        want = block.experts(tokens, chosen, scores)
    wg, w1, w2, w3 = _routed_weights(block)
    got = moe_ffn_reference(tokens, wg, w1, w2, w3, 3, gate)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    other = "softmax_all" if gate == "softmax_topk" else "softmax_topk"
    assert not torch.allclose(moe_ffn_reference(tokens, wg, w1, w2, w3, 3, other), want,
                              rtol=1e-3, atol=1e-4)


def _kept_state_runs(path, args, times: int = 3) -> list:
    """The first output of ``times`` runs of ONE tract State (as an application keeps it)."""
    import tract

    state = tract_check.load(path).spawn_state()
    tensors = [tract.Tensor.from_numpy(a.numpy()) for a in args]
    return [state.run(tensors)[0].to_numpy() for _ in range(times)]


@pytest.mark.parametrize("seq", [1, 6])
@pytest.mark.parametrize("family, norm_topk", [("qwen3_5_moe", True), ("qwen3_next", False)])
def test_moe_block_becomes_tract_moe_ffn(tmp_path, family, norm_topk, seq):
    """A plain export of the block: the routed part is one tract_moe_ffn (its gate mode read
    off the router), the shared expert stays plain ops; tract equals eager, and a kept State
    answers the same on every run."""
    block = _block(family, norm_topk=norm_topk)
    args = (torch.randn(1, seq, 64),)
    with torch.no_grad():
        want = block(*args)
    path = gdn_fx.export_nnef(torch.export.export(block, args), tmp_path / "b.nnef.tgz")
    text = tract_check.nnef_text(path)
    gate = "softmax_topk" if norm_topk else "softmax_all"
    assert text.count("tract_moe_ffn(") == 1 and f"gate = '{gate}'" in text and "k = 3" in text
    assert "tract_core_gather" not in text.split("tract_moe_ffn(")[0].split("graph ")[-1]
    found = tract_check.compare(path, [want], args)
    assert found.ok, found
    for got in _kept_state_runs(path, args):
        assert np.allclose(got, want.numpy(), rtol=1e-5, atol=1e-6)


def test_gathered_moe_is_right_on_a_kept_state(tmp_path):
    """The plain-op spelling on a State run three times: torch-to-nnef's cumsum (a
    tract_core_scan that keeps its sum between runs) made the offsets, and every routed row,
    wrong from the second run on; the offsets are now a masked sum."""
    block = _block("qwen3_5_moe")
    args = (torch.randn(1, 5, 64),)
    with torch.no_grad():
        want = block(*args).numpy()
    path = gdn_fx.export_nnef(torch.export.export(block, args), tmp_path / "g.nnef.tgz",
                              choose={"transformers_moe": "gathered_bmm"})
    assert "tract_moe_ffn(" not in tract_check.nnef_text(path)
    for got in _kept_state_runs(path, args):
        assert np.allclose(got, want, rtol=1e-5, atol=1e-6)


def test_moe_block_with_another_activation_stays_plain(tmp_path, caplog):
    """tract_moe_ffn's SwiGLU is SiLU-gated: a GELU-gated block does not prove itself, is
    left to the gather + bmm spelling (the log says why), and is still right in tract."""
    block = _block("qwen3_5_moe", act="gelu")
    args = (torch.randn(1, 4, 64),)
    with torch.no_grad():
        want = block(*args)
    with caplog.at_level("INFO", logger="gdn_fx.lowering"):
        path = gdn_fx.export_nnef(torch.export.export(block, args), tmp_path / "a.nnef.tgz")
    assert "tract_moe_ffn(" not in tract_check.nnef_text(path)
    assert "left as plain ops: no reading of the block" in caplog.text
    assert tract_check.compare(path, [want], args).ok


def test_moe_choice_is_checked_and_needs_tract_0_23_9():
    from gdn_fx.errors import UsageError
    from gdn_fx.lowering.t2n.moe_ffn import fusion_refused, split_choice
    from gdn_fx.lowering.target import Target

    assert split_choice({"transformers_moe": "gathered_bmm", "*": "scan"}) == \
        ("gathered_bmm", {"*": "scan"})
    with pytest.raises(UsageError, match="transformers_moe"):
        split_choice({"transformers_moe": "fast"})
    assert "first in 0.23.9" in fusion_refused(Target.parse("0.23.8"))
    assert fusion_refused(Target.parse("0.23.9")) is None


def test_moe_block_with_tied_router_rows_is_warned_about(tmp_path, caplog):
    """Two experts with the same router row tie on every token: torch keeps the lower index,
    tract (tract_moe_ffn, and tract_core_topk in the plain spelling alike) may keep the other,
    so the export says so."""
    block = _block("qwen3_5_moe")
    with torch.no_grad():
        block.gate.weight[5] = block.gate.weight[2]
    args = (torch.randn(1, 4, 64),)
    with caplog.at_level("WARNING", logger="gdn_fx.lowering"):
        path = gdn_fx.export_nnef(torch.export.export(block, args), tmp_path / "t.nnef.tgz")
    assert "tract_moe_ffn(" in tract_check.nnef_text(path)
    assert "router has 1 repeated rows of 8" in caplog.text


def test_near_tie_tokens_are_left_out_of_the_proof_not_the_others():
    """The MoE proof compares the program and the f32 reference only on tokens whose k-th
    and next router logits differ by more than the bound: at a near-tie the two may route
    differently. Tokens routed clearly are all kept."""
    from gdn_fx.lowering.t2n.moe_ffn import _decided

    wg = torch.eye(4)  # logits = the tokens themselves
    x = torch.tensor([[4.0, 3.0, 2.0, 1.0],      # top-2 {0, 1}, gap 1 to the third
                      [4.0, 2.0, 2.0 - 1e-4, 1.0],  # the second and third nearly tie
                      [4.0, 3.0, 3.0, 1.0]])     # an exact tie
    assert _decided(x, wg, 2, 5e-3).tolist() == [True, False, False]
    assert _decided(x, wg, 4, 5e-3).tolist() == [True, True, True]  # k = E: nothing to tie
