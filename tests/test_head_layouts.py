"""Every head layout the families allow, in every lowering candidate the table may pick,
loaded and run by tract (issue 54, item 5), and the Qwen3-Next shape of the issue end to end.

Head layouts of gated_delta_scan: G = Hv / Hk of 1, 2, 3 and 4 (Qwen3-Next's 16 key heads
over 32 value heads, Qwen3.5's 16 over 32/48/64, the issue's 2 over 6), Dk != Dv both ways,
batch 1 (its own layout code, gdn_chunked_text._heads_first_one) and 2; GDN gates (every
candidate) and KDA gates ("matmul", "scan"). The conv update with kernels 3, 4 and 5. The
programs hold one fused node per layout (each with its own inputs), exported with every node
forced to one candidate; the oracles are float64 code written here (tests/test_reset_gates.py
for the recurrence, a direct depthwise sum below for the conv). Candidates the table takes for
a symbolic S ("split", "chunked", "matmul", "chunked_window") are exported with a symbolic S
and run at two lengths; the CUDA candidates run by the CPU runtime.

The whole-model case: a checkpoint folder of the issue's Qwen3NextConfig (2 key heads over 6
value heads, Dk 8, Dv 12, conv kernel 3, 3 experts) exported by ``gdn-fx export --model``
(which checks tract's generation against transformers'). It failed before: the MoE proof
compared a symbolic size with the expert count, torch pinned the symbol S to its example of 3
(the expert count), and the scans were lowered for S = 3 in a graph that declares S.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch
from torch import nn

import gdn_fx  # noqa: F401  (registers torch.ops.gdn_fx)
from gdn_fx import tract_check
from gdn_fx.errors import InternalError
from gdn_fx.export import export_nnef
from test_reset_gates import recurrence64, relative

SCAN = torch.ops.gdn_fx.gated_delta_scan
CONV = torch.ops.gdn_fx.causal_conv1d_update
TOLERANCE = 1e-5  # q, k normalized; these shapes give ~3e-7


@dataclass(frozen=True)
class Layout:
    batch: int
    key_heads: int
    groups: int
    dk: int
    dv: int
    kda: bool = False

    @property
    def label(self) -> str:
        gate = "kda" if self.kda else "gdn"
        return f"{gate}-b{self.batch}-hk{self.key_heads}-G{self.groups}-{self.dk}x{self.dv}"

    @property
    def scale(self) -> float:
        return self.dk ** -0.5  # the native operator's (it serves only this scale)

    def inputs(self, t: int, seed: int) -> list[torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        b, hk, hv = self.batch, self.key_heads, self.key_heads * self.groups

        def rnd(*shape):
            return torch.randn(*shape, generator=gen)

        gate = -0.5 * torch.rand(b, t, hv, *([self.dk] if self.kda else []), generator=gen)
        return [rnd(b, t, hk, self.dk), rnd(b, t, hk, self.dk), rnd(b, t, hv, self.dv), gate,
                torch.rand(b, t, hv, generator=gen), rnd(b, hv, self.dk, self.dv)]


GDN_LAYOUTS = (Layout(1, 2, 1, 8, 8), Layout(2, 2, 1, 8, 12), Layout(1, 2, 2, 8, 12),
               Layout(2, 2, 2, 8, 8), Layout(1, 2, 3, 8, 12), Layout(2, 2, 3, 8, 8),
               Layout(1, 1, 4, 12, 8), Layout(2, 2, 4, 8, 8))
KDA_LAYOUTS = tuple(Layout(x.batch, x.key_heads, x.groups, x.dk, x.dv, kda=True)
                    for x in GDN_LAYOUTS)
SYMBOLIC = ("split", "chunked", "matmul", "chunked_window")  # the table's symbolic-S choices
STATIC_LENGTH, SYMBOLIC_LENGTHS = 70, (5, 70)  # 70: past one chunk of 64 and two of 32
CUDA = ("chunked_parallel", "chunked_window")


def served(candidate: str) -> tuple[Layout, ...]:
    """The layouts ``candidate`` serves: KDA gates only "matmul", "scan" (and "matmul_step");
    the native operator only square states (Dk = Dv)."""
    if candidate in ("matmul", "scan", "matmul_step"):
        return GDN_LAYOUTS + KDA_LAYOUTS
    if candidate == "native":
        return tuple(x for x in GDN_LAYOUTS if x.dk == x.dv)
    return GDN_LAYOUTS


class Scans(nn.Module):
    """One fused node per layout, six inputs each; the outputs in order (out, final) each."""

    def __init__(self, layouts: tuple[Layout, ...]):
        super().__init__()
        self.layouts = layouts

    def forward(self, *args):
        outs = ()
        for i, layout in enumerate(self.layouts):
            outs += SCAN(*args[6 * i:6 * i + 6], scale=layout.scale, qk_l2norm=True)
        return outs


def _export(candidate: str, layouts: tuple, t: int, path, symbolic: bool):
    args = [x for i, layout in enumerate(layouts) for x in layout.inputs(t, seed=i)]
    names = [f"x{j}" for j in range(len(args))]
    dims, axes = None, None
    if symbolic:  # every node's S the one symbol (its initial state has none)
        seq = torch.export.Dim("S", min=2, max=512)
        dims = tuple(({1: seq} if j % 6 < 5 else None) for j in range(len(args)))
        axes = {name: {1: "S"} for j, name in enumerate(names) if j % 6 < 5}
    program = torch.export.export(Scans(layouts), tuple(args),
                                  dynamic_shapes=dims and (dims,))  # forward(*args)
    written = export_nnef(program, path, choose={"*": candidate}, input_names=names,
                          dynamic_axes=axes, runtime="cuda" if candidate in CUDA else "cpu",
                          serves_decode=candidate != "chunked_window")
    assert set(tract_check.read_decisions(written).values()) == {candidate}
    return written


@pytest.mark.parametrize("candidate", ["matmul_step", "chunked_unrolled", "split", "chunked",
                                       "matmul", "native", "scan", "chunked_parallel",
                                       "chunked_window"])
def test_every_head_layout_in_every_candidate(tmp_path, candidate):
    layouts = served(candidate)
    symbolic = candidate in SYMBOLIC
    lengths = (1,) if candidate == "matmul_step" else (
        SYMBOLIC_LENGTHS if symbolic else (STATIC_LENGTH,))
    written = _export(candidate, layouts, lengths[0] if not symbolic else 4,
                      tmp_path / f"{candidate}.nnef", symbolic)
    runnable = tract_check.load(written)  # the CPU runtime, also for the CUDA candidates
    failures = []
    for t in lengths:
        cases = [layout.inputs(t, seed=100 + i) for i, layout in enumerate(layouts)]
        got = tract_check.run(runnable, [x for case in cases for x in case])
        for i, (layout, case) in enumerate(zip(layouts, cases)):
            want = recurrence64(*case, layout.scale, True)
            errors = [relative(got[2 * i + j], want[j]) for j in range(2)]
            if max(errors) > TOLERANCE:
                failures.append((t, layout.label, errors))
    assert not failures, failures


# --- the conv update: kernels 3, 4 and 5 ------------------------------------------------------

def conv64(x, state, weight, bias, silu: bool):
    """The conv update in float64 numpy: out[t] = sum_j w[j] * full[t + 1 + j] over the last K
    samples ending at t (full = state then x), plus bias, SiLU; new state = the last K."""
    x, state, weight = (np.asarray(a, dtype=np.float64) for a in (x, state, weight))
    full = np.concatenate([state, x], axis=-1)
    k, t = weight.shape[1], x.shape[-1]
    out = np.zeros(x.shape)
    for i in range(t):
        window = full[..., i + 1:i + 1 + k]  # the K samples ending at x[i]
        out[..., i] = (window * weight).sum(-1)
    if bias is not None:
        out = out + np.asarray(bias, dtype=np.float64)[:, None]
    if silu:
        out = out / (1 + np.exp(-out))
    return out, full[..., -k:]


class Convs(nn.Module):
    """One conv update per kernel width, with weights (and bias) as parameters."""

    def __init__(self, kernels: tuple[int, ...], channels: int, bias: bool, silu: bool):
        super().__init__()
        gen = torch.Generator().manual_seed(7)
        self.weights = nn.ParameterList([nn.Parameter(torch.randn(channels, k, generator=gen))
                                         for k in kernels])
        self.biases = nn.ParameterList([nn.Parameter(torch.randn(channels, generator=gen))
                                        for _ in kernels]) if bias else None
        self.activation = "silu" if silu else None

    def forward(self, *args):
        outs = ()
        for i, weight in enumerate(self.weights):
            bias = self.biases[i] if self.biases is not None else None
            outs += CONV(args[2 * i], args[2 * i + 1], weight, bias, self.activation)
        return outs


KERNELS = (3, 4, 5)


@pytest.mark.parametrize("candidate, bias, silu", [("depthwise", True, True),
                                                   ("portable", True, False),
                                                   ("native", False, True)])
@pytest.mark.parametrize("symbolic", [False, True])
def test_every_conv_kernel_in_every_candidate(tmp_path, candidate, bias, silu, symbolic):
    channels, batch = 6, 2
    module = Convs(KERNELS, channels, bias, silu)
    gen = torch.Generator().manual_seed(3)

    def inputs(t):
        return [x for k in KERNELS for x in (torch.randn(batch, channels, t, generator=gen),
                                             torch.randn(batch, channels, k, generator=gen))]

    names = [f"x{j}" for j in range(2 * len(KERNELS))]
    dims, axes = None, None
    if symbolic:
        seq = torch.export.Dim("S", min=2, max=512)
        dims = tuple(({2: seq} if j % 2 == 0 else None) for j in range(len(names)))
        axes = {name: {2: "S"} for j, name in enumerate(names) if j % 2 == 0}
    program = torch.export.export(module, tuple(inputs(4)),
                                  dynamic_shapes=dims and (dims,))  # forward(*args)
    written = export_nnef(program, tmp_path / "conv.nnef", choose={"*": candidate},
                          input_names=names, dynamic_axes=axes)
    assert set(tract_check.read_decisions(written).values()) == {candidate}
    runnable = tract_check.load(written)
    for t in ((1, 7, 40) if symbolic else (4,)):
        args = inputs(t)
        got = tract_check.run(runnable, args)
        for i, k in enumerate(KERNELS):
            bias_i = module.biases[i].detach() if bias else None
            want = conv64(args[2 * i], args[2 * i + 1], module.weights[i].detach(), bias_i,
                          silu)
            errors = [relative(got[2 * i + j], want[j]) for j in range(2)]
            assert max(errors) <= 1e-5, (candidate, t, k, errors)


# --- the issue's Qwen3-Next checkpoint, end to end -------------------------------------------

QWEN3_NEXT = dict(hidden_size=40, linear_num_key_heads=2, linear_num_value_heads=6,
                  linear_key_head_dim=8, linear_value_head_dim=12, linear_conv_kernel_dim=3,
                  num_experts=3, num_experts_per_tok=2, num_hidden_layers=3,
                  layer_types=["full_attention", "linear_attention", "linear_attention"],
                  num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                  intermediate_size=48, moe_intermediate_size=16,
                  shared_expert_intermediate_size=16, vocab_size=64, pad_token_id=0,
                  bos_token_id=1, eos_token_id=2)


@pytest.mark.slow
def test_qwen3_next_shaped_checkpoint_exports_and_generates(tmp_path):
    """The issue's checkpoint (bf16, as released) exports with the checked CLI route (tract's
    greedy tokens against transformers' generate), its scans lowered for the symbolic S."""
    import transformers

    from gdn_fx.cli import main

    torch.manual_seed(0)
    config = transformers.Qwen3NextConfig(**QWEN3_NEXT)
    folder = tmp_path / "qwen3_next"
    transformers.Qwen3NextForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)
    out = tmp_path / "qwen3_next.nnef.tgz"
    assert main(["export", "--model", str(folder), "--out", str(out)]) == 0
    decisions = tract_check.read_decisions(out)
    scans = {v for k, v in decisions.items() if k.startswith("gated_delta_scan")}
    assert scans == {"split"}, decisions  # the symbolic-S choice, not chunks of a fixed S
    assert "tract_moe_ffn" in tract_check.nnef_text(out)  # the 3-expert blocks still fused


def test_a_rewrite_that_pins_a_symbolic_axis_is_refused(tmp_path, monkeypatch):
    """A rewrite before the lowering that compares a symbolic size with an int pins the
    symbol to its example in every node; the export is refused (InternalError), never
    written with a lowering planned for the example's extent."""
    from gdn_fx.lowering.t2n import write

    layout = GDN_LAYOUTS[0]
    args = layout.inputs(3, seed=0)
    seq = torch.export.Dim("S", min=2, max=512)
    program = torch.export.export(Scans((layout,)), tuple(args),
                                  dynamic_shapes=(tuple({1: seq} if j < 5 else None
                                                        for j in range(6)),))
    fixes = write.apply_fixes

    def pinning(module):
        placeholder = next(n for n in module.graph.nodes if n.op == "placeholder")
        assert bool(placeholder.meta["val"].shape[1] == 3)  # a guard: S == 3 from now on
        return fixes(module)

    monkeypatch.setattr(write, "apply_fixes", pinning)
    with pytest.raises(InternalError, match="became static"):
        export_nnef(program, tmp_path / "pinned.nnef",
                    dynamic_axes={name: {1: "S"} for name in ("q", "k", "v", "g", "beta")},
                    input_names=["q", "k", "v", "g", "beta", "s0"])
    assert not (tmp_path / "pinned.nnef").exists()
