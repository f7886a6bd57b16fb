"""Tiny random-weight configurations of the transformers hybrid families gdn-fx supports.

Every model here is built from a config in code (no download): a few layers that mix
linear-attention (or short-conv / mamba2) layers with attention layers, hidden size 32-48,
head dims 8-16, grouped value heads (Hv > Hk) where the family allows it. They exist so that
whole-model exports and tests run in seconds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import transformers as tf
from torch import nn

from gdn_fx.errors import FamilyUnavailable, UnknownFamily

# The dtypes a model is built or loaded in, by the names the CLI and the options take.
DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}

VOCAB = 64
# Special ids must be < VOCAB: several families default to ids beyond a tiny vocabulary.
TOKENS = dict(vocab_size=VOCAB, pad_token_id=0, bos_token_id=1, eos_token_id=2)

LIN, FULL = "linear_attention", "full_attention"


@dataclass(frozen=True)
class Family:
    """How to build one tiny model: config class, model class, and config fields.

    The classes are named, not imported: each transformers release has a different set of
    families, so a missing one is reported when it is asked for (:func:`family_classes`).
    """

    name: str
    config_class: str  # a name in the ``transformers`` namespace
    model_class: str
    fields: dict
    mixer: str  # "gdn", "kda", "conv" (short conv only), "mamba2" (SSD) or "mamba1"
    # The capability flags: tests derive their family lists from them, so a new family is
    # tested for what it can do by saying it here (docs/contributing.md).
    # export_generator writes it a generation-ready artifact (glm5_next's and qwen4_exp's
    # indexers have sizes that depend on values: gdn_fx.hf.indexers)
    generates: bool = True
    moe: bool = False  # routed experts in some layers
    hybrid: bool = True  # attention layers too (mamba2 is Mamba2 layers only)
    # DecodeStep runs it from given states (qwen4_exp: its indexer reads a position history
    # that transformers keeps on the cache, outside the states, and torch.export cannot
    # trace its nonzero)
    steps: bool = True
    # reify swaps every scan, so it exports with a symbolic S (zamba: its per-head
    # mamba_selective_scan takes no cached state, dropins._require_ssm_functions)
    dynamic: bool = True

    @property
    def kda(self) -> bool:
        """Kimi-delta attention: a gate per key channel instead of one per head."""
        return self.mixer == "kda"

    @property
    def available(self) -> bool:
        """Whether the installed transformers has this family's classes."""
        return all(hasattr(tf, n) for n in (self.config_class, self.model_class))


_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
            shared_expert_intermediate_size=16)
_ATTN = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8)
_MLA = dict(hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
            num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16,
            qk_nope_head_dim=8, v_head_dim=8, num_experts_per_tok=2)


# Mamba families draw their weights at std 0.3: at transformers' 0.02 a scan's output is
# lost in the residual stream, and a generation check could not see a wrong scan
# (tests/test_mamba_families.py shows the difference).
SSM_INIT = 0.3
_MAMBA_ATTN = dict(initializer_range=SSM_INIT, hidden_size=32, intermediate_size=64,
                   num_attention_heads=4, num_key_value_heads=2)
_MAMBA1 = dict(initializer_range=SSM_INIT, hidden_size=32, num_hidden_layers=2, state_size=8,
               expand=2, conv_kernel=4, time_step_rank=4)
_MAMBA2 = dict(mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=8,
               mamba_chunk_size=16, mamba_expand=2, mamba_d_conv=4)


def _gdn(hk: int, hv: int, dk: int, dv: int) -> dict:
    return dict(linear_num_key_heads=hk, linear_num_value_heads=hv,
                linear_key_head_dim=dk, linear_value_head_dim=dv, linear_conv_kernel_dim=4)


_FAMILIES = [
    Family("qwen3_5", "Qwen3_5TextConfig", "Qwen3_5ForCausalLM", dict(
        **_ATTN, **_gdn(2, 4, 16, 16), num_hidden_layers=4, intermediate_size=64,
        layer_types=[LIN, FULL, LIN, LIN]), "gdn"),
    Family("qwen3_5_moe", "Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", dict(
        **_ATTN, **_gdn(2, 4, 8, 8), **_MOE, num_hidden_layers=3,
        layer_types=[LIN, LIN, FULL]), "gdn", moe=True),
    Family("qwen3_next", "Qwen3NextConfig", "Qwen3NextForCausalLM", dict(
        **_ATTN, **_gdn(2, 4, 16, 16), **_MOE, num_hidden_layers=4, intermediate_size=64,
        layer_types=[LIN, LIN, LIN, FULL]), "gdn", moe=True),
    Family("olmo_hybrid", "OlmoHybridConfig", "OlmoHybridForCausalLM", dict(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=2, **_gdn(2, 4, 8, 16),
        num_hidden_layers=3, intermediate_size=64, layer_types=[LIN, FULL, LIN]), "gdn"),
    Family("lara_mini", "LaraMiniConfig", "LaraMiniForCausalLM", dict(
        **_ATTN, **_gdn(2, 4, 16, 16), **_MOE, num_hidden_layers=4, sliding_window=128,
        layer_types=[LIN, "sliding_attention", LIN, FULL]), "gdn", moe=True),
    Family("kimi_linear", "KimiLinearConfig", "KimiLinearForCausalLM", dict(
        **_MLA, qk_rope_head_dim=8, num_local_experts=4, linear_num_heads=4,
        linear_head_dim=8, linear_conv_kernel_dim=4, num_hidden_layers=3,
        layer_types=[LIN, FULL, LIN]), "kda", moe=True),
    Family("bailing_hybrid", "BailingHybridConfig", "BailingHybridForCausalLM", dict(
        **_MLA, qk_rope_head_dim=8, num_local_experts=4, head_dim=16, n_group=1, topk_group=1,
        short_conv_kernel_size=4, num_hidden_layers=3, layer_types=[LIN, FULL, LIN],
        first_k_dense_replace=1), "kda", moe=True),
    Family("lfm2", "Lfm2Config", "Lfm2ForCausalLM", dict(
        **_ATTN, intermediate_size=64, block_multiple_of=16, num_hidden_layers=3,
        layer_types=["conv", FULL, "conv"], conv_bias=True, conv_L_cache=3), "conv"),
    Family("lfm2_moe", "Lfm2MoeConfig", "Lfm2MoeForCausalLM", dict(
        **_ATTN, intermediate_size=64, moe_intermediate_size=16, num_experts=4,
        num_experts_per_tok=2, num_dense_layers=1, num_hidden_layers=3,
        layer_types=["conv", FULL, "conv"], conv_bias=True, conv_L_cache=3), "conv", moe=True),
    Family("lfm3", "Lfm3Config", "Lfm3ForCausalLM", dict(
        **_ATTN, intermediate_size=64, num_hidden_layers=3, layer_types=["conv", FULL, "conv"],
        conv_bias=True, conv_L_cache=3), "conv"),
    Family("bamba", "BambaConfig", "BambaForCausalLM", dict(
        **_MAMBA_ATTN, num_hidden_layers=3, attn_layer_indices=[1], **_MAMBA2), "mamba2"),
    Family("mamba2", "Mamba2Config", "Mamba2ForCausalLM", dict(
        initializer_range=SSM_INIT, hidden_size=32, num_hidden_layers=2, num_heads=4,
        head_dim=16, n_groups=2, state_size=8, chunk_size=16, expand=2, conv_kernel=4),
           "mamba2", hybrid=False),
    Family("granitemoehybrid", "GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM", dict(
        **_MAMBA_ATTN, num_hidden_layers=3, layer_types=["mamba", "attention", "mamba"],
        **_MAMBA2, num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=32),
           "mamba2", moe=True),
    Family("nemotron_h", "NemotronHConfig", "NemotronHForCausalLM", dict(
        **_MAMBA_ATTN, hybrid_override_pattern="M*M-", ssm_state_size=8, mamba_num_heads=4,
        mamba_head_dim=16, n_groups=2, chunk_size=16, expand=2, conv_kernel=4), "mamba2"),
    Family("falcon_h1", "FalconH1Config", "FalconH1ForCausalLM", dict(
        **_MAMBA_ATTN, num_hidden_layers=2, **_MAMBA2, head_dim=16, mamba_d_ssm=64),
           "mamba2"),
    Family("mamba", "MambaConfig", "MambaForCausalLM", dict(**_MAMBA1), "mamba1",
           hybrid=False),
    Family("falcon_mamba", "FalconMambaConfig", "FalconMambaForCausalLM", dict(**_MAMBA1),
           "mamba1", hybrid=False),
    Family("jamba", "JambaConfig", "JambaForCausalLM", dict(
        **_MAMBA_ATTN, num_hidden_layers=4, attn_layer_period=2, attn_layer_offset=1,
        expert_layer_period=2, expert_layer_offset=1, num_experts=4, num_experts_per_tok=2,
        mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=4,
        use_mamba_kernels=False), "mamba1", moe=True),
    # Zamba v1: two hybrid layers at least (transformers ties the shared attention block of
    # the first to the others and finds nothing to tie with one).
    Family("zamba", "ZambaConfig", "ZambaForCausalLM", dict(
        **_MAMBA_ATTN, num_hidden_layers=4, attention_head_dim=8, n_mamba_heads=2,
        mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=4,
        layers_block_type=["mamba", "hybrid", "mamba", "hybrid"]), "mamba1",
           generates=False, dynamic=False),
    Family("zamba2", "Zamba2Config", "Zamba2ForCausalLM", dict(
        **_MAMBA_ATTN, mamba_d_state=8, mamba_headdim=16, mamba_ngroups=2, chunk_size=16,
        mamba_expand=2, mamba_d_conv=4, n_mamba_heads=4, num_hidden_layers=3,
        layers_block_type=["mamba", "hybrid", "mamba"]), "mamba2"),
]


def _glm5_next_config(**overrides: Any):
    """GLM-5-Next is a vision-language model: a tiny text tower plus a one-block vision tower."""
    text = dict(**TOKENS, **_MLA, q_lora_rank=16, qk_rope_head_dim=0, n_routed_experts=4,
                index_topk=16, index_head_dim=8, index_n_heads=2, index_kpool=4,
                linear_head_dim=8, linear_num_heads=4, linear_conv_kernel_dim=4, hc_mult=2,
                num_hidden_layers=3, layer_types=[LIN, FULL, LIN],
                mlp_layer_types=["dense", "sparse", "sparse"])
    text.update(overrides)
    vision = dict(depth=1, hidden_size=16, num_heads=2, out_hidden_size=32, intermediate_size=32,
                  projection_intermediate_size=32, patch_size=2, image_size=8)
    # Multimodal ids are placed inside the tiny vocabulary, above the random text ids we draw.
    media = dict(image_token_id=58, video_token_id=59, image_start_token_id=60,
                 image_end_token_id=61, video_start_token_id=62, video_end_token_id=63)
    return getattr(tf, _GLM5.config_class)(text_config=text, vision_config=vision, **media)


_GLM5 = Family("glm5_next", "Glm5NextConfig", "Glm5NextForConditionalGeneration", {}, "kda",
               generates=False, moe=True)


def _qwen4_exp_config(**overrides: Any):
    """Qwen4-Exp is a vision-language model too: GDN layers with a per-layer n-gram embedding
    (PLE: hashed token n-grams, an int64 state of the last tokens), an indexed attention layer
    (a QSA indexer), MoE everywhere, hyper-connections; one vision block."""
    text = dict(**TOKENS, **_ATTN, **_gdn(2, 4, 8, 8), **_MOE, num_hidden_layers=3,
                layer_types=[LIN, "indexed_attention", LIN], hc_count=2, hc_lowrank=8,
                ple_layer_ids=[1], ple_embed_dim=16, heads_per_ngram=2,
                ngram_vocab_size_base=101, make_ngram_vocab_size_divisible_by=8,
                indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=8, indexer_budget=4,
                indexer_compress_ratio=2)
    text.update(overrides)
    vision = dict(depth=1, hidden_size=16, num_heads=2, out_hidden_size=32, intermediate_size=32,
                  patch_size=2, num_position_embeddings=16)
    media = dict(image_token_id=58, video_token_id=59, vision_start_token_id=60,
                 vision_end_token_id=61)
    return getattr(tf, _QWEN4.config_class)(text_config=text, vision_config=vision, **media)


_QWEN4 = Family("qwen4_exp", "Qwen4ExpConfig", "Qwen4ExpForConditionalGeneration", {}, "gdn",
                generates=False, moe=True, steps=False, dynamic=False)
# Families whose config is built by a function (a text and a vision config), by name.
_BUILDERS = {"glm5_next": _glm5_next_config, "qwen4_exp": _qwen4_exp_config}

FAMILY_SPECS: dict[str, Family] = {f.name: f for f in [*_FAMILIES, _GLM5, _QWEN4]}
FAMILIES: tuple[str, ...] = tuple(FAMILY_SPECS)
GENERATING: tuple[str, ...] = tuple(f for f in FAMILIES if FAMILY_SPECS[f].generates)


def families(**flags: Any) -> tuple[str, ...]:
    """The families whose fields and flags equal ``flags``: ``families(moe=True,
    mixer="gdn")``."""
    return tuple(f for f, spec in FAMILY_SPECS.items()
                 if all(getattr(spec, k) == v for k, v in flags.items()))
# Token ids drawn by example inputs stay below this, clear of special and multimodal ids.
SAFE_TOKEN_RANGE = (3, 56)


def family(name: str) -> Family:
    """The :class:`Family` called ``name``; UnknownFamily (a KeyError) lists the known names."""
    if name not in FAMILY_SPECS:
        raise UnknownFamily(f"unknown family {name!r}; known: {', '.join(FAMILIES)}")
    return FAMILY_SPECS[name]


def available_families() -> tuple[str, ...]:
    """The families the installed transformers has (a subset of :data:`FAMILIES`)."""
    return tuple(f for f in FAMILIES if FAMILY_SPECS[f].available)


def family_classes(name: str) -> tuple[Any, Any]:
    """(config class, model class) of family ``name`` in the installed transformers.

    FamilyUnavailable names the family and the installed version when that release does not
    have it (e.g. ``lara_mini`` before transformers 5.24).
    """
    spec = family(name)
    if not spec.available:
        have = ", ".join(available_families()) or "none"
        raise FamilyUnavailable(f"family {name!r} needs transformers' {spec.model_class}, which "
                                f"transformers {tf.__version__} does not have (it has: {have})")
    return getattr(tf, spec.config_class), getattr(tf, spec.model_class)


def tiny_config(name: str, **overrides: Any):
    """A tiny transformers config of family ``name``; ``overrides`` replace config fields."""
    config_class, _ = family_classes(name)
    if name in _BUILDERS:
        return _BUILDERS[name](**overrides)
    return config_class(**{**TOKENS, **family(name).fields, **overrides})


def one_of_each(name: str) -> dict:
    """Config overrides that keep one layer of each of family ``name``'s layer types, in their
    first order (``qwen3_5``: one linear-attention layer, then one full-attention layer): the
    smallest model that still runs each of the family's code paths, for tests where the
    number of layers does not matter (a whole-model trace costs about its layer count). {}
    for a family whose layer kinds are not listed by ``layer_types``."""
    types = family(name).fields.get("layer_types")
    if types is None:
        return {}
    kept = list(dict.fromkeys(types))
    return dict(num_hidden_layers=len(kept), layer_types=kept)


def tiny_model(name: str, dtype: torch.dtype = torch.float32, seed: int = 0,
               **overrides: Any) -> nn.Module:
    """A random-weight causal LM of family ``name`` in eval mode (weights seeded by ``seed``)."""
    config = tiny_config(name, **overrides)
    with torch.random.fork_rng(devices=[]):  # seed the weights without touching global RNG
        torch.manual_seed(seed)
        model = family_classes(name)[1](config)
    return model.to(dtype).eval()
