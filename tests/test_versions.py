"""gdn_fx.hf on whichever transformers release is installed (marker ``versions``).

``make test`` runs this file on the newest release; ``.ci/run`` runs it again on the oldest
supported ones (transformers 5.15.0, fully supported, and 5.0.0: DecodeStep on its per-model
caches, lfm2's and bamba's refused), each
put in front of the venv with ``pip install --target`` and PYTHONPATH. What each release
has is written below by hand from docs/FACTS.md, "transformers releases".
"""

from __future__ import annotations

import pytest
import torch
import transformers

import gdn_fx
from gdn_fx import tract_check
from gdn_fx.errors import FamilyUnavailable, UnsupportedModel
from gdn_fx.hf import DecodeStep, compat, hf_continue, prepare_for_nnef, tiny_model
from gdn_fx.hf.configs import FAMILIES, available_families, family, tiny_config

pytestmark = pytest.mark.versions

SIX = {"qwen3_5", "qwen3_5_moe", "qwen3_next", "olmo_hybrid", "lfm2", "bamba"}
# the Mamba families every release of the range has, nemotron_h from 5.15 on
MAMBA = {"mamba2", "granitemoehybrid", "falcon_h1", "zamba2", "mamba", "falcon_mamba", "jamba",
         "zamba"}
HAS = {"5.0.0": {"qwen3_next", "lfm2", "lfm2_moe", "bamba"} | MAMBA, "5.10.4": SIX,
       "5.15.0": SIX | MAMBA | {"nemotron_h", "lfm2_moe"},
       "5.24.0": set(FAMILIES), "5.25.0": set(FAMILIES)}
VERSION = transformers.__version__
# Releases whose helpers work end to end: LinearAttentionLayer slots, module-level kernels.
FULL = compat.LINEAR_LAYER is not None and hasattr(compat.LINEAR_LAYER(), "number_of_states")
# Before 5.5 each family has its own cache class: DecodeStep reads Qwen3-Next-style ones
# (gdn_fx/hf/caches/family_lists.py) and refuses lfm2's and bamba's.
PER_MODEL = compat.LINEAR_LAYER is None
OWN_CACHE_LAYOUT = {"lfm2", "lfm2_moe", "bamba"} | MAMBA
AVAILABLE = available_families()
# DecodeStep runs them from given states (Family.steps: not qwen4_exp)
STEPPED = [f for f in AVAILABLE if family(f).steps]


def decode_families() -> list[str]:
    """Families whose DecodeStep this release serves (beyond a refusal), the Mamba ones
    aside (tests/test_generator_mamba.py)."""
    served = [f for f in STEPPED if family(f).mixer not in ("mamba2", "mamba1")]
    return [f for f in served if f not in OWN_CACHE_LAYOUT] if PER_MODEL else served


def exportable(model):
    """Before 5.5 the MoE families' default experts kernel calls torch._grouped_mm, which
    torch.export refuses in f32 on CPU ('Expected inputs of BF16 type'): switch to batched_mm."""
    return prepare_for_nnef(model) if PER_MODEL else model


def test_the_installed_release_has_the_families_docs_say():
    if VERSION not in HAS:
        pytest.skip(f"no record for transformers {VERSION}")
    assert set(AVAILABLE) == HAS[VERSION]


@pytest.mark.parametrize("name", [f for f in FAMILIES if f not in AVAILABLE] or ["none"])
def test_a_missing_family_is_refused_when_asked_for_naming_it_and_the_version(name):
    if name == "none":
        pytest.skip("this release has every family")
    with pytest.raises(FamilyUnavailable) as raised:
        tiny_model(name)
    assert f"'{name}'" in str(raised.value) and VERSION in str(raised.value)


def linear_layers(name: str) -> int:
    config = tiny_config(name).get_text_config(decoder=True)
    types = list(getattr(config, "layer_types", None) or config.layers_block_type)
    return sum(t in ("linear_attention", "conv", "mamba") for t in types)


@pytest.mark.parametrize("name", STEPPED)
def test_decode_step_follows_the_release_cache_api(name):
    model = tiny_model(name)
    if PER_MODEL and name in OWN_CACHE_LAYOUT:  # before 5.5: refused with the version named
        with pytest.raises(UnsupportedModel, match=VERSION):
            DecodeStep(model)
        return
    if not FULL and name == "olmo_hybrid":  # 5.5-5.12 keep its states outside DynamicCache
        with pytest.raises(UnsupportedModel, match=VERSION):
            DecodeStep(model)
        return
    step = DecodeStep(model)
    assert sum(s.kind in ("conv", "recurrent") for s in step.specs) >= linear_layers(name)
    gen = torch.Generator().manual_seed(0)
    prompt, ids = torch.randint(3, 56, (1, 4), generator=gen), torch.randint(3, 56, (1, 1),
                                                                              generator=gen)
    args = (ids, *step.prefill_states(prompt))
    got, want = step.eager(*args), hf_continue(model, prompt, ids, step.specs)
    assert len(got) == len(want)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("name", decode_families())
def test_decode_step_collapses_fully_and_computes_the_same(name):
    if not FULL and not PER_MODEL:
        pytest.skip(f"transformers {VERSION}: decode collapse is checked from 5.15 and below 5.5")
    step = DecodeStep(exportable(tiny_model(name)))
    args = step.example_inputs(seq_len=1)
    program = torch.export.export(step, args, strict=False)
    result = gdn_fx.collapse(program)
    delta = family(name).mixer in ("gdn", "kda")
    layers = linear_layers(name)
    # lfm2 / bamba: every linear layer holds a conv; gdn / kda layers a conv and a scan.
    assert result.counts.get("causal_conv1d_update", 0) == layers
    assert result.counts.get("gated_delta_scan", 0) == (layers if delta else 0)
    assert gdn_fx.compare_programs(program, result.program) is None


def test_prefill_collapses_through_this_release_chunk_rule():
    if not FULL and not PER_MODEL:
        pytest.skip(f"transformers {VERSION}: prefill collapse is checked from 5.15 and below 5.5")
    step = DecodeStep(exportable(tiny_model("qwen3_next")))
    program = torch.export.export(step, step.example_inputs(seq_len=8), strict=False)
    result = gdn_fx.collapse(program)
    # three linear-attention layers: each a scan and a conv update (from a fresh cache)
    assert result.counts.get("gated_delta_scan", 0) == 3, result.explain()
    assert result.counts.get("causal_conv1d_update", 0) == 3, result.explain()
    assert gdn_fx.compare_programs(program, result.program) is None


def test_this_release_chunked_rule_collapses_on_its_own():
    """transformers' chunked GDN rule as a plain module: the chunk rule's template comes from
    whichever family this release ships (5.0 has qwen3_next's, not qwen3_5's)."""
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    class Chunked(torch.nn.Module):
        def forward(self, q, k, v, g, beta, s0):
            return torch_chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=4, initial_state=s0,
                                                output_final_state=True,
                                                use_qk_l2norm_in_kernel=True)

    gen = torch.Generator().manual_seed(0)
    b, t, h, d = 1, 8, 2, 4
    args = (torch.randn(b, t, h, d, generator=gen), torch.randn(b, t, h, d, generator=gen),
            torch.randn(b, t, h, d, generator=gen), -torch.rand(b, t, h, generator=gen),
            torch.rand(b, t, h, generator=gen), torch.randn(b, h, d, d, generator=gen))
    program = torch.export.export(Chunked(), args, strict=False)
    result = gdn_fx.collapse(program)
    assert result.counts.get("gated_delta_scan", 0) == 1, result.explain()
    assert gdn_fx.compare_programs(program, result.program) is None


def test_a_collapsed_decode_step_runs_in_tract(tmp_path):
    if not FULL and not PER_MODEL:
        pytest.skip(f"transformers {VERSION}: NNEF is checked from 5.15 and below 5.5")
    step = DecodeStep(prepare_for_nnef(tiny_model("qwen3_next")))
    args = step.example_inputs(seq_len=1)
    program = gdn_fx.collapse(torch.export.export(step, args, strict=False)).program
    path = gdn_fx.export_nnef(program, tmp_path / "q.nnef.tgz", input_names=step.input_names,
                              output_names=step.output_names)
    found = tract_check.compare(tract_check.load(path), step.eager(*args), args)
    assert len(found.errors) == len(step.output_names) and max(found.errors) <= 1e-4, found
