"""Tiny random-weight configurations of the transformers hybrid families gdn-fx supports.

Every model here is built from a config in code (no download): a few layers that mix
linear-attention (or short-conv / mamba2) layers with attention layers, hidden size 32-48,
head dims 8-16, grouped value heads (Hv > Hk) where the family allows it. They exist so that
whole-model exports and tests run in seconds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import transformers as tf
from torch import nn

VOCAB = 64
# Special ids must be < VOCAB: several families default to ids beyond a tiny vocabulary.
TOKENS = dict(vocab_size=VOCAB, pad_token_id=0, bos_token_id=1, eos_token_id=2)

LIN, FULL = "linear_attention", "full_attention"


@dataclass(frozen=True)
class Family:
    """How to build one tiny model: config class, model class, and config fields."""

    name: str
    config_class: Callable[..., Any]
    model_class: Callable[..., nn.Module]
    fields: dict
    mixer: str  # "gdn", "kda", "conv" (short conv only) or "mamba2"


_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
            shared_expert_intermediate_size=16)
_ATTN = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8)
_MLA = dict(hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
            num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16,
            qk_nope_head_dim=8, v_head_dim=8, num_experts_per_tok=2)


def _gdn(hk: int, hv: int, dk: int, dv: int) -> dict:
    return dict(linear_num_key_heads=hk, linear_num_value_heads=hv,
                linear_key_head_dim=dk, linear_value_head_dim=dv, linear_conv_kernel_dim=4)


_FAMILIES = [
    Family("qwen3_5", tf.Qwen3_5TextConfig, tf.Qwen3_5ForCausalLM, dict(
        **_ATTN, **_gdn(2, 4, 16, 16), num_hidden_layers=4, intermediate_size=64,
        layer_types=[LIN, FULL, LIN, LIN]), "gdn"),
    Family("qwen3_5_moe", tf.Qwen3_5MoeTextConfig, tf.Qwen3_5MoeForCausalLM, dict(
        **_ATTN, **_gdn(2, 4, 8, 8), **_MOE, num_hidden_layers=3,
        layer_types=[LIN, LIN, FULL]), "gdn"),
    Family("qwen3_next", tf.Qwen3NextConfig, tf.Qwen3NextForCausalLM, dict(
        **_ATTN, **_gdn(2, 4, 16, 16), **_MOE, num_hidden_layers=4, intermediate_size=64,
        layer_types=[LIN, LIN, LIN, FULL]), "gdn"),
    Family("olmo_hybrid", tf.OlmoHybridConfig, tf.OlmoHybridForCausalLM, dict(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=2, **_gdn(2, 4, 8, 16),
        num_hidden_layers=3, intermediate_size=64, layer_types=[LIN, FULL, LIN]), "gdn"),
    Family("lara_mini", tf.LaraMiniConfig, tf.LaraMiniForCausalLM, dict(
        **_ATTN, **_gdn(2, 4, 16, 16), **_MOE, num_hidden_layers=4, sliding_window=128,
        layer_types=[LIN, "sliding_attention", LIN, FULL]), "gdn"),
    Family("kimi_linear", tf.KimiLinearConfig, tf.KimiLinearForCausalLM, dict(
        **_MLA, qk_rope_head_dim=8, num_local_experts=4, linear_num_heads=4,
        linear_head_dim=8, linear_conv_kernel_dim=4, num_hidden_layers=3,
        layer_types=[LIN, FULL, LIN]), "kda"),
    Family("bailing_hybrid", tf.BailingHybridConfig, tf.BailingHybridForCausalLM, dict(
        **_MLA, qk_rope_head_dim=8, num_local_experts=4, head_dim=16, n_group=1, topk_group=1,
        short_conv_kernel_size=4, num_hidden_layers=3, layer_types=[LIN, FULL, LIN],
        first_k_dense_replace=1), "kda"),
    Family("lfm2", tf.Lfm2Config, tf.Lfm2ForCausalLM, dict(
        **_ATTN, intermediate_size=64, block_multiple_of=16, num_hidden_layers=3,
        layer_types=["conv", FULL, "conv"], conv_bias=True, conv_L_cache=3), "conv"),
    Family("bamba", tf.BambaConfig, tf.BambaForCausalLM, dict(
        hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        num_hidden_layers=3, attn_layer_indices=[1], mamba_n_heads=4, mamba_d_state=8,
        mamba_chunk_size=16, mamba_d_conv=4), "mamba2"),
]


def _glm5_next_config(**overrides: Any) -> tf.Glm5NextConfig:
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
    return tf.Glm5NextConfig(text_config=text, vision_config=vision, **media)


_GLM5 = Family("glm5_next", _glm5_next_config, tf.Glm5NextForConditionalGeneration, {}, "kda")

FAMILY_SPECS: dict[str, Family] = {f.name: f for f in [*_FAMILIES, _GLM5]}
FAMILIES: tuple[str, ...] = tuple(FAMILY_SPECS)
# Token ids drawn by example inputs stay below this, clear of special and multimodal ids.
SAFE_TOKEN_RANGE = (3, 56)


def family(name: str) -> Family:
    """The :class:`Family` called ``name``; KeyError lists the known names."""
    if name not in FAMILY_SPECS:
        raise KeyError(f"unknown family {name!r}; known: {', '.join(FAMILIES)}")
    return FAMILY_SPECS[name]


def tiny_config(name: str, **overrides: Any):
    """A tiny transformers config of family ``name``; ``overrides`` replace config fields."""
    spec = family(name)
    if spec.name == "glm5_next":
        return _glm5_next_config(**overrides)
    return spec.config_class(**{**TOKENS, **spec.fields, **overrides})


def tiny_model(name: str, dtype: torch.dtype = torch.float32, seed: int = 0,
               **overrides: Any) -> nn.Module:
    """A random-weight causal LM of family ``name`` in eval mode (weights seeded by ``seed``)."""
    config = tiny_config(name, **overrides)
    with torch.random.fork_rng(devices=[]):  # seed the weights without touching global RNG
        torch.manual_seed(seed)
        model = family(name).model_class(config)
    return model.to(dtype).eval()
