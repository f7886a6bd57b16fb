"""gdn_fx.hf: tiny families, DecodeStep against transformers' own cache flow, and exports."""


import pytest
import torch

from gdn_fx.errors import DTypeError, ShapeError
from gdn_fx.hf import FAMILIES, DecodeStep, hf_continue, tiny_config, tiny_model
from gdn_fx.hf.configs import SAFE_TOKEN_RANGE, families, family
from gdn_fx.hf.patching import RULE_NAMES, modeling_modules
from programs import max_rel, rel_err, tiny

pytestmark = pytest.mark.slow  # whole-model exports (make test-fast skips them)

LINEAR_TYPES = ("linear_attention", "conv")
DELTA_FAMILIES = [f for f in FAMILIES if family(f).mixer in ("gdn", "kda")]
# DecodeStep runs these from given states (Family.steps: not qwen4_exp, whose indexer reads
# a position history kept outside them)
STEPPED = families(steps=True)


model = tiny


def text_config(name):
    return model(name).config.get_text_config(decoder=True)


def prompt_and_ids(seq_len, past_len=4, batch=1, seed=0):
    """The tokens DecodeStep.example_inputs draws, drawn independently here."""
    gen = torch.Generator().manual_seed(seed)
    low, high = SAFE_TOKEN_RANGE
    prompt = torch.randint(low, high, (batch, past_len), generator=gen)
    return prompt, torch.randint(low, high, (batch, seq_len), generator=gen)


# ---------------------------------------------------------------- tiny configs

@pytest.mark.parametrize("name", FAMILIES)
def test_tiny_config_is_small_hybrid_and_runs(name):
    cfg = text_config(name)
    assert cfg.vocab_size <= 128 and cfg.hidden_size <= 64 and cfg.num_hidden_layers <= 4
    for attr in ("pad_token_id", "bos_token_id", "eos_token_id"):
        assert getattr(cfg, attr) is None or getattr(cfg, attr) < cfg.vocab_size
    types = list(getattr(cfg, "layer_types", None) or cfg.layers_block_type)
    assert any(t in (*LINEAR_TYPES, "hybrid") for t in types)  # hybrid: both in one layer
    assert any(t not in (*LINEAR_TYPES, "mlp") for t in types) == family(name).hybrid
    ids = torch.randint(*SAFE_TOKEN_RANGE, (2, 5))
    with torch.no_grad():
        logits = model(name)(input_ids=ids).logits
    assert logits.shape == (2, 5, cfg.vocab_size) and logits.isfinite().all()


def _routed_experts(module) -> bool:
    """A block with a router and a stack of experts, by what transformers' MoE blocks hold."""
    return hasattr(module, "experts") and any(hasattr(module, n) for n in ("gate", "router"))


@pytest.mark.parametrize("name", FAMILIES)
def test_family_flags_say_what_the_model_holds(name):
    """Family.moe, which tests derive their MoE lists from, agrees with the modules."""
    assert family(name).moe == any(_routed_experts(m) for m in model(name).modules()), name


@pytest.mark.parametrize("name", ["qwen3_5", "qwen3_next", "olmo_hybrid", "lara_mini"])
def test_gdn_configs_use_grouped_value_heads(name):
    cfg = text_config(name)
    assert cfg.linear_num_value_heads > cfg.linear_num_key_heads
    assert 8 <= cfg.linear_key_head_dim <= 16


def test_overrides_and_unknown_family():
    assert tiny_config("qwen3_5", num_hidden_layers=2, layer_types=["linear_attention",
                                                                    "full_attention"]
                       ).num_hidden_layers == 2
    with pytest.raises(KeyError, match="known: qwen3_5"):
        tiny_config("nope")
    first, again = tiny_model("lfm2", seed=3), tiny_model("lfm2", seed=3)
    assert all(torch.equal(a, b) for a, b in zip(first.parameters(), again.parameters()))


# ---------------------------------------------------------------- state specs

@pytest.mark.parametrize("name", STEPPED)
def test_specs_follow_layer_types(name):
    cfg, step = text_config(name), DecodeStep(model(name))
    types = list(getattr(cfg, "layer_types", None) or cfg.layers_block_type)
    kinds = {}
    for spec in step.specs:
        kinds.setdefault(spec.layer, []).append(spec.kind)
    for index, layer_type in enumerate(types):
        if layer_type == "conv":
            assert kinds[index] == ["conv"]
        elif layer_type == "linear_attention":
            assert kinds[index] == ["conv", "recurrent"]
        elif layer_type == "hybrid":  # falcon_h1, zamba2: Mamba2 and attention in one layer
            assert kinds[index] == ["conv", "recurrent", "key", "value"]
        elif layer_type == "mlp":  # nemotron_h's MLP-only layers hold nothing
            assert index not in kinds
        else:
            assert kinds[index][:2] == ["key", "value"]
    assert step.input_names[0] == "input_ids" and step.output_names[0] == "logits"
    assert len(set(step.input_names)) == len(step.input_names) == len(step.specs) + 1
    assert all(name.isidentifier() for name in step.input_names + step.output_names)


@pytest.mark.parametrize("name", STEPPED)
def test_expected_fusions_count_linear_layers(name):
    types = list(getattr(text_config(name), "layer_types", None)
                 or text_config(name).layers_block_type)
    step = DecodeStep(model(name))
    mixer = family(name).mixer
    scans = types.count("linear_attention") + types.count("hybrid")
    # zamba's scans are none that reify swaps (Family.dynamic): DecodeStep expects no op there
    swapped = mixer in ("mamba2", "mamba1") and family(name).dynamic
    linear = {"gated_linear_scan": scans} if swapped else {}
    assert step.expected_fusions == {
        "gated_delta_scan": scans if mixer in ("gdn", "kda") else 0, **linear,
        "causal_conv1d_update": sum(t in (*LINEAR_TYPES, "hybrid") for t in types)}


# ---------------------------------------------------------------- eager DecodeStep

@pytest.mark.parametrize("name", STEPPED)
@pytest.mark.parametrize("seq_len", [1, 8])
def test_decode_step_equals_transformers_cache_flow(name, seq_len):
    step = DecodeStep(model(name))
    args = step.example_inputs(seq_len=seq_len, past_len=4)
    prompt, ids = prompt_and_ids(seq_len)
    assert torch.equal(args[0], ids)
    # Same code path as transformers' own DynamicCache continuation: bit for bit.
    assert max_rel(step.eager(*args), hf_continue(model(name), prompt, ids, step.specs)) == 0.0


class Spy:
    """Counts calls of a module-global function and records the new-token counts it saw."""

    def __init__(self, fn, seq_arg):
        self.fn, self.seq_arg, self.lengths = fn, seq_arg, []

    def __call__(self, *args, **kwargs):
        self.lengths.append(self.seq_arg(args))
        return self.fn(*args, **kwargs)


def spy_on(monkeypatch, name):
    """Spies on the recurrent rule, chunk rule and conv update of ``name``'s modeling file."""
    spies = {}
    for m in modeling_modules(model(name)):
        names = {"conv_update": "causal_conv1d_update"}
        if m.rule_kind is not None:
            names.update(zip(("recurrent", "chunk"), RULE_NAMES[m.rule_kind]))
        for key, attr in names.items():
            at = (lambda a: a[0].shape[-1]) if key == "conv_update" else (lambda a: a[0].shape[1])
            spies[key] = Spy(getattr(m.module, attr), at)
            monkeypatch.setattr(m.module, attr, spies[key])
    return spies


@pytest.mark.parametrize("name", STEPPED)
def test_recurrent_rule_prefill_runs_per_token_functions_close_to_transformers(
        name, monkeypatch):
    step = DecodeStep(model(name), rule="recurrent")
    args = step.example_inputs(seq_len=8)  # a transformers prefill: spy only after it
    spies = spy_on(monkeypatch, name)
    got = step.eager(*args)
    types = list(getattr(text_config(name), "layer_types", None) or [])
    # a hybrid layer's cache (attention and Mamba2 in one) keeps transformers' own conv
    # state update: its prefill conv stays the padded conv over the concatenation
    convs = step.expected_fusions["causal_conv1d_update"] - types.count("hybrid")
    fusions = step.expected_fusions
    assert spies["conv_update"].lengths == [8] * convs
    if "recurrent" in spies:
        assert spies["recurrent"].lengths == [8] * fusions["gated_delta_scan"]
        assert spies["chunk"].lengths == []
    monkeypatch.undo()
    prompt, ids = prompt_and_ids(8)
    want = hf_continue(model(name), prompt, ids, step.specs)
    assert max_rel(got, want) < 1e-5  # transformers' chunk rule vs the recurrent rule


@pytest.mark.parametrize("name", ["qwen3_5", "kimi_linear"])
def test_auto_rule_prefill_takes_the_chunk_rule(name, monkeypatch):
    step = DecodeStep(model(name))
    args = step.example_inputs(seq_len=8)
    spies = spy_on(monkeypatch, name)
    step.eager(*args)
    assert spies["chunk"].lengths == [8] * step.expected_fusions["gated_delta_scan"]
    assert spies["recurrent"].lengths == [] and spies["conv_update"].lengths == []


@pytest.mark.parametrize("rule", ["auto", "recurrent"])
def test_inputs_are_not_mutated_and_swaps_are_undone(rule):
    m = model("qwen3_5")
    step = DecodeStep(m, rule=rule)
    before = [(mm.module, dict(vars(mm.module))) for mm in modeling_modules(m)]
    args = step.example_inputs(seq_len=3, source="random")
    copies = [a.clone() for a in args]
    step.eager(*args)
    assert all(torch.equal(a, c) for a, c in zip(args, copies))
    for module, globals_before in before:
        assert all(vars(module)[k] is v for k, v in globals_before.items())


def test_batch_two_and_empty_past():
    step = DecodeStep(model("olmo_hybrid"))
    args = step.example_inputs(seq_len=2, batch=2, past_len=0)
    assert all(a.shape[0] == 2 for a in args)
    assert all(not a.any() for a in args[1:])  # nothing cached yet: zero states, empty KV
    prompt, ids = prompt_and_ids(2, past_len=0, batch=2)
    with torch.no_grad():  # an empty past must equal a plain prefill
        want = model("olmo_hybrid")(input_ids=ids).logits
    assert rel_err(step.eager(*args)[0], want) < 1e-6


def test_bad_states_are_refused_by_name():
    step = DecodeStep(model("qwen3_5"))
    args = list(step.example_inputs())
    with pytest.raises(ValueError, match="expected 8 state tensors"):
        step(*args[:-1])
    bad = args.copy()
    bad[2] = torch.zeros(1, 4, 16, 15)
    with pytest.raises(ShapeError, match="recurrent_state_0.*expected \\[1, 4, 16, 16\\]"):
        step(*bad)
    bad = args.copy()
    bad[1] = bad[1].double()
    with pytest.raises(DTypeError, match="conv_state_0.*float64"):
        step(*bad)
    with pytest.raises(ValueError, match="rule must be one of"):
        DecodeStep(model("qwen3_5"), rule="chunk")


def test_sliding_window_past_beyond_window_is_refused():
    m = tiny_model("lara_mini", sliding_window=6)
    step = DecodeStep(m)
    with pytest.raises(ShapeError, match="key_1.*sliding window"):
        step(*step.example_inputs(past_len=5, source="random"))
