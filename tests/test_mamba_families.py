"""transformers' Mamba families, prefill exported as users export it: each Mamba layer's scan
is one gated_linear_scan, and the collapsed program computes what the model computes.

The six Mamba2 families (mamba2, bamba, falcon_h1 with attention and Mamba2 in parallel,
granitemoehybrid with MoE, nemotron_h, zamba2 with its hybrid blocks) run transformers' SSD
chunk scan (chunk 16 here): S = 1 and 2 are one padded chunk, S = 37 three chunks, the last
padded. The three Mamba1 families (mamba, falcon_mamba, jamba) run the per-token loop that
export unrolls (one step at S = 1). Weights are drawn at std 0.3 so that the scans move the logits (at transformers'
default 0.02 a scan's output is lost in the residual: a test that cannot fail); the last test
shows that they do. One family of each kind, without attention, is also exported to NNEF and
run in tract (the hybrids' attention masks, as a plain export traces them, read a ``diff``
with ``prepend`` that torch-to-nnef does not take: the generation exports build their own).
"""

from __future__ import annotations

import functools

import pytest
import torch

import gdn_fx
from gdn_fx import tract_check
from test_mamba_regions import Logits

tf = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow  # whole-model exports; they still run by default

LINEAR, DELTA = "gated_linear_scan", "gated_delta_scan"
TOL = 1e-5  # relative to the logits' largest magnitude
_COMMON = dict(initializer_range=0.3, vocab_size=64, hidden_size=32, num_hidden_layers=2,
               num_attention_heads=2, num_key_value_heads=1, intermediate_size=32)
_MAMBA2 = dict(mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=8,
               mamba_chunk_size=16, mamba_expand=2, mamba_d_conv=4)
_MAMBA1 = dict(initializer_range=0.3, vocab_size=64, hidden_size=16, state_size=4,
               num_hidden_layers=2, expand=2, conv_kernel=4, time_step_rank=2)

# family -> (config, Mamba layers)
FAMILIES = {
    "mamba2": (lambda: tf.Mamba2Config(
        initializer_range=0.3, vocab_size=64, hidden_size=32, num_hidden_layers=2,
        num_heads=4, head_dim=16, n_groups=2, state_size=8, chunk_size=16, expand=2,
        conv_kernel=4), 2),
    "bamba": (lambda: tf.BambaConfig(**_COMMON, attn_layer_indices=[1], **_MAMBA2), 1),
    "falcon_h1": (lambda: tf.FalconH1Config(**_COMMON, **_MAMBA2, head_dim=16,
                                            mamba_d_ssm=64), 2),
    "granitemoehybrid": (lambda: tf.GraniteMoeHybridConfig(
        **_COMMON, layer_types=["mamba", "attention"], **_MAMBA2, num_local_experts=2,
        num_experts_per_tok=1), 1),
    "nemotron_h": (lambda: tf.NemotronHConfig(
        **_COMMON, hybrid_override_pattern="M*", ssm_state_size=8, mamba_num_heads=4,
        mamba_head_dim=16, n_groups=2, chunk_size=16, expand=2, conv_kernel=4), 1),
    "zamba2": (lambda: tf.Zamba2Config(
        **_COMMON, mamba_d_state=8, mamba_headdim=16, mamba_ngroups=2, chunk_size=16,
        mamba_expand=2, mamba_d_conv=4, n_mamba_heads=4,
        layers_block_type=["mamba", "hybrid"]), 2),
    "mamba": (lambda: tf.MambaConfig(**_MAMBA1), 2),
    "falcon_mamba": (lambda: tf.FalconMambaConfig(**_MAMBA1), 2),
    "jamba": (lambda: tf.JambaConfig(
        **_COMMON, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
        expert_layer_offset=1, num_experts=2, num_experts_per_tok=1, mamba_d_state=4,
        mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=4, use_mamba_kernels=False), 1),
}
LENGTHS = (1, 2, 37)


@functools.cache
def _model(family: str):
    torch.manual_seed(0)
    return Logits(tf.AutoModelForCausalLM.from_config(FAMILIES[family][0]()).eval())


@functools.cache
def _collapsed(family: str, seq: int):
    """(ids, the eager logits, the export, collapse's result), built once."""
    model = _model(family)
    ids = torch.randint(0, 64, (1, seq), generator=torch.Generator().manual_seed(seq))
    with torch.no_grad():
        want = model(ids)
    program = torch.export.export(model, (ids,))
    return ids, want, program, gdn_fx.collapse(program)


def _rel(got, want) -> float:
    return float((got - want).abs().max() / want.abs().max())


@pytest.mark.parametrize("seq", LENGTHS)
@pytest.mark.parametrize("family", FAMILIES)
def test_each_mamba_layer_is_one_gated_linear_scan(family, seq):
    ids, want, _, result = _collapsed(family, seq)
    assert result.counts.get(LINEAR, 0) == FAMILIES[family][1], result.explain()
    assert result.counts.get(DELTA, 0) == 0, result.explain()
    if seq > 1:  # nothing else looks like a loop (at one token every size-1 axis does: a
        # Mamba1 step's z gate still leaves a near-miss there)
        assert not result.misses, result.explain()
    with torch.no_grad():
        got = result.program.module()(ids)
    assert _rel(got, want) <= TOL


@pytest.mark.parametrize("family", ["bamba", "jamba"])
def test_the_comparison_sees_the_scans(family):
    """The collapsed program with each op's scale doubled is far from the model: the scans
    move the logits, so the test above would see a wrong op."""
    ids, want, _, result = _collapsed(family, 37)
    module = result.program.module()
    for node in module.graph.nodes:
        if node.target is torch.ops.gdn_fx.gated_linear_scan.default:
            node.kwargs = {**node.kwargs, "scale": 2.0 * node.kwargs["scale"]}
    module.recompile()
    with torch.no_grad():
        assert _rel(module(ids), want) > 1e-2


@pytest.mark.parametrize("family", ["mamba2", "mamba"])
def test_the_collapsed_prefill_runs_in_tract(family, tmp_path):
    ids, want, _, result = _collapsed(family, 37)
    path = tmp_path / f"{family}.nnef.tgz"
    gdn_fx.export_nnef(result.program, str(path))
    found = tract_check.compare(str(path), [want], (ids,))
    assert found.ok, found.errors
