"""gdn_fx.hf.reify: drop-ins equal transformers' eager math, and export with a dynamic S."""

import types

import pytest
import torch
import transformers as tf
from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen

from gdn_fx.hf import DecodeStep, UnsupportedModel, reify, tiny_model
from gdn_fx.hf.configs import SAFE_TOKEN_RANGE, families, family
from gdn_fx.hf.dropins import conv_fn, conv_update, make_rule
from gdn_fx.hf.patching import RULE_NAMES, Patches, modeling_modules
from programs import max_rel, rel_err, tiny

pytestmark = pytest.mark.slow  # whole-model exports (make test-fast skips them)

SCAN = torch.ops.gdn_fx.gated_delta_scan.default
CONV = torch.ops.gdn_fx.causal_conv1d_update.default
LINEAR = torch.ops.gdn_fx.gated_linear_scan.default
# reify swaps every scan of these (Family.dynamic: not zamba, whose per-head scan is handed no
# cached state; not qwen4_exp, which DecodeStep does not run)
REIFIED = families(dynamic=True)
DELTA_OR_CONV = [f for f in REIFIED if family(f).mixer not in ("mamba2", "mamba1")]
CHECK_SEQ = (2, 3, 8, 17, 50)


model = tiny


def fused_counts(ep):
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    linear = {"gated_linear_scan": targets.count(LINEAR)} if LINEAR in targets else {}
    return {"gated_delta_scan": targets.count(SCAN), **linear,
            "causal_conv1d_update": targets.count(CONV)}


def step_inputs(step, name, seq_len, seed=0):
    """Random states; for Mamba1 with its recurrent states zero: transformers' Mamba1 runs
    several tokens from zeros whatever its cache holds, where reify's drop-in continues the
    state (tests/test_generator_mamba.py)."""
    args = step.example_inputs(seq_len=seq_len, source="random", seed=seed)
    if family(name).mixer != "mamba1" or seq_len == 1:
        return args
    return (args[0], *(torch.zeros_like(t) if spec.kind == "recurrent" else t
                       for spec, t in zip(step.specs, args[1:])))


def globals_of(m):
    return [(mm.module, dict(vars(mm.module))) for mm in modeling_modules(m)]


def unchanged(snapshot):
    return all(vars(module)[k] is v for module, before in snapshot for k, v in before.items())


# ---------------------------------------------------------------- the drop-ins alone

def gdn_operands(t, hk=2, hv=4, dk=8, dv=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(1, t, hk, dk, generator=gen) for _ in range(2))
    v = torch.randn(1, t, hv, dv, generator=gen)
    g, beta = -torch.rand(1, t, hv, generator=gen), torch.rand(1, t, hv, generator=gen)
    return q, k, v, g, beta, torch.randn(1, hv, dk, dv, generator=gen)


@pytest.mark.parametrize("t", [1, 5])
@pytest.mark.parametrize("l2", [True, False])
def test_exact_rule_is_bitwise_transformers_recurrent_rule(t, l2):
    q, k, v, g, beta, s0 = gdn_operands(t)
    kwargs = dict(g=g, beta=beta, output_final_state=True, use_qk_l2norm_in_kernel=l2)
    want = qwen.torch_recurrent_gated_delta_rule(q, k, v, initial_state=s0.clone(), **kwargs)
    for form in ("recurrent", "chunk"):
        got = make_rule(qwen, "gdn", form, exact=True)(q, k, v, initial_state=s0.clone(),
                                                       **kwargs)
        assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_canonical_rule_matches_transformers_and_handles_missing_state():
    q, k, v, g, beta, _ = gdn_operands(6, dk=8, dv=12)
    kwargs = dict(g=g, beta=beta, initial_state=None, use_qk_l2norm_in_kernel=True)
    want = qwen.torch_chunk_gated_delta_rule(q, k, v, output_final_state=True, **kwargs)
    got = make_rule(qwen, "gdn", "chunk", exact=False)(q, k, v, output_final_state=True,
                                                        **kwargs)
    assert rel_err(got[0], want[0]) < 1e-5 and rel_err(got[1], want[1]) < 1e-5
    out, final = make_rule(qwen, "gdn", "recurrent", exact=False)(q, k, v, **kwargs)
    assert final is None and out.dtype == q.dtype


def test_rule_refuses_packed_sequences():
    q, k, v, g, beta, s0 = gdn_operands(3)
    with pytest.raises(UnsupportedModel, match="cu_seqlens"):
        make_rule(qwen, "gdn", "chunk", exact=False)(
            q, k, v, g=g, beta=beta, cu_seqlens=torch.tensor([0, 3]))


@pytest.mark.parametrize("activation", [None, "silu"])
@pytest.mark.parametrize("seq_len", [1, 4])
def test_conv_drop_ins_match_transformers(activation, seq_len):
    gen = torch.Generator().manual_seed(1)
    x, state = torch.randn(2, 6, seq_len, generator=gen), torch.randn(2, 6, 4, generator=gen)
    weight, bias = torch.randn(6, 4, generator=gen), torch.randn(6, generator=gen)
    want_state, got_state = state.clone(), state.clone()
    want = qwen.causal_conv1d_update(x, want_state, weight, bias, activation)
    got = conv_update(x, got_state, weight, bias, activation)
    assert rel_err(got, want) < 1e-6 and torch.equal(got_state, want_state)
    padded = qwen.causal_conv1d_fn(x, weight, bias, activation=activation)
    assert rel_err(conv_fn(x, weight, bias, activation=activation), padded) < 1e-6
    with pytest.raises(UnsupportedModel, match="activation 'gelu'"):
        conv_update(x, state, weight, bias, "gelu")


# ---------------------------------------------------------------- swapping and undoing

def test_reify_swaps_every_rule_and_conv_and_undo_restores():
    m = model("qwen3_5")
    snapshot = globals_of(m)
    handle = reify(m)
    assert handle.module_names == ["transformers.models.qwen3_5.modeling_qwen3_5"]
    for name in (*RULE_NAMES["gdn"], "causal_conv1d_update", "causal_conv1d_fn"):
        assert getattr(qwen, name) is not snapshot[0][1][name]
    handle.undo()
    assert unchanged(snapshot)


def test_nested_reify_skips_what_is_swapped_and_undoes():
    m = model("kimi_linear")
    snapshot = globals_of(m)
    with reify(m, conv=False) as outer:
        assert len(outer.patches.swaps) == 2  # the recurrent and chunk rules
        with reify(m) as inner:
            assert len(inner.patches.swaps) == 2  # only the conv update and conv fn are left
        assert not unchanged(snapshot)
    assert unchanged(snapshot)


def test_patches_refuse_to_undo_out_of_order():
    target = types.SimpleNamespace(f="hf")
    first = Patches([(target, "f", "one")]).apply()
    second = Patches([(target, "f", "two")]).apply()
    with pytest.raises(RuntimeError, match="swapped again since"):
        first.undo()
    second.undo()
    first.undo()
    assert target.f == "hf"


def test_model_without_linear_layers_is_refused():
    cfg = tf.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2)
    with pytest.raises(UnsupportedModel, match="LlamaForCausalLM"):
        reify(tf.LlamaForCausalLM(cfg))


# ---------------------------------------------------------------- whole models, eager

@pytest.mark.parametrize("name", REIFIED)
@pytest.mark.parametrize("seq_len", [1, 8])
def test_reified_eager_equals_transformers(name, seq_len):
    step = DecodeStep(model(name), rule="recurrent" if seq_len > 1 else "auto")
    args = step_inputs(step, name, seq_len)
    want = step.eager(*args)
    with reify(model(name)):
        got = step.eager(*args)
    assert max_rel(got, want) < 1e-5  # measured <= 7e-7 in f32


# exact=True is about the delta rules; the Mamba2 drop-ins sum the SSD in another order than
# transformers' chunks (test_reified_eager_equals_transformers bounds them)
@pytest.mark.parametrize("name", DELTA_OR_CONV)
def test_exact_rules_are_bitwise_in_whole_models(name):
    for rule, seq_len in (("auto", 1), ("recurrent", 8)):
        step = DecodeStep(model(name), rule=rule)
        args = step.example_inputs(seq_len=seq_len, source="random")
        want = step.eager(*args)
        with reify(model(name), exact=True, conv=False):
            assert all(torch.equal(a, b) for a, b in zip(step.eager(*args), want))


@pytest.mark.parametrize("name", ["qwen3_5", "kimi_linear"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_exact_rules_are_bitwise_in_half_precision(name, dtype):
    step = DecodeStep(tiny_model(name, dtype=dtype), rule="recurrent")
    args = step.example_inputs(seq_len=4, source="random")
    want = step.eager(*args)
    with reify(step.model, exact=True, conv=False):
        assert all(torch.equal(a, b) for a, b in zip(step.eager(*args), want))


@pytest.mark.parametrize("name", ["qwen3_5", "kimi_linear", "lfm2"])
def test_reified_plain_forward_without_cache(name):
    ids = torch.randint(*SAFE_TOKEN_RANGE, (2, 9))
    with torch.no_grad():
        want = model(name)(input_ids=ids).logits
        with reify(model(name)):
            got = model(name)(input_ids=ids).logits
    assert rel_err(got, want) < 1e-5


# ---------------------------------------------------------------- export

@pytest.mark.slow
@pytest.mark.parametrize("name", REIFIED)
def test_reified_decode_exports_with_one_node_per_layer(name):
    step = DecodeStep(model(name))
    args = step.example_inputs(seq_len=1)
    with reify(model(name)):
        ep = torch.export.export(step, args)
        assert fused_counts(ep) == step.expected_fusions
        assert max_rel(ep.module()(*args), step.eager(*args)) <= 1e-6


@pytest.mark.slow
@pytest.mark.parametrize("name", REIFIED)
def test_reified_prefill_exports_with_dynamic_sequence(name):
    m = model(name)
    step, reference = DecodeStep(m), DecodeStep(m, rule="recurrent")
    with reify(m):
        ep = torch.export.export(step, step.example_inputs(seq_len=8),
                                 dynamic_shapes=step.dynamic_shapes())
        assert fused_counts(ep) == step.expected_fusions
        run = ep.module()
        for seq_len in CHECK_SEQ:
            args = step_inputs(step, name, seq_len, seed=seq_len)
            assert max_rel(run(*args), step.eager(*args)) <= 1e-6
    # ... and against transformers' own (unreified) recurrent rule, at every length.
    for seq_len in CHECK_SEQ:
        args = step_inputs(step, name, seq_len, seed=seq_len)
        assert max_rel(run(*args), reference.eager(*args)) < 1e-5


@pytest.mark.slow
def test_reified_mamba2_export_holds_across_ssd_chunk_edges():
    """transformers pads its SSD to whole chunks and branches on the pad; a plain export is
    specialized to 2 <= S < chunk. Reified, the scan is one op: the program holds at every S,
    on both sides of each chunk edge, and refuses none of them."""
    m = model("bamba")
    step = DecodeStep(m)
    chunk = m.config.mamba_chunk_size
    with reify(m):
        ep = torch.export.export(step, step.example_inputs(seq_len=8),
                                 dynamic_shapes=step.dynamic_shapes())
    assert fused_counts(ep) == step.expected_fusions
    run = ep.module()
    for seq_len in (2, chunk - 1, chunk, chunk + 1, 3 * chunk + 5):
        args = step.example_inputs(seq_len=seq_len, source="random")
        assert max_rel(run(*args), step.eager(*args)) <= 1e-5, seq_len


@pytest.mark.slow
def test_reified_export_strict_and_decomposed():
    m = model("qwen3_5")
    step = DecodeStep(m)
    with reify(m):
        ep = torch.export.export(step, step.example_inputs(seq_len=8),
                                 dynamic_shapes=step.dynamic_shapes(), strict=True)
        core = ep.run_decompositions()
        assert fused_counts(core) == step.expected_fusions
        args = step.example_inputs(seq_len=5, source="random")
        assert max_rel(core.module()(*args), step.eager(*args)) <= 1e-6
