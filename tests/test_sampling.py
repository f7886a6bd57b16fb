"""gdn_fx.runtime.sampling against transformers' own logits processors and its ``generate``.

Expected distributions come from transformers (``transformers.generation.logits_process``
and the ``scores`` that ``model.generate`` returns), never from gdn_fx.runtime.sampling.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers.generation import logits_process as lp

from gdn_fx.errors import UsageError
from gdn_fx.hf import tiny_model
from gdn_fx.runtime.sampling import Sampler, Sampling, check_max_new_tokens, distribution

SETTINGS = [
    dict(temperature=0.7),
    dict(temperature=1.3, top_k=20),
    dict(temperature=0.9, top_p=0.8),
    dict(temperature=1.0, min_p=0.05),
    dict(temperature=1.0, repetition_penalty=1.3),
    dict(temperature=0.6, top_k=50, top_p=0.9, min_p=0.02, repetition_penalty=1.2),
    dict(temperature=2.0, top_k=3, top_p=0.5, repetition_penalty=0.7),
    dict(repetition_penalty=1.5),  # greedy: the penalty still applies, as in generate
]


def _hf_processors(setting: dict) -> lp.LogitsProcessorList:
    """The processors in the order transformers 5's ``_get_logits_processor`` appends them."""
    found = lp.LogitsProcessorList()
    if setting.get("repetition_penalty", 1.0) != 1.0:
        found.append(lp.RepetitionPenaltyLogitsProcessor(setting["repetition_penalty"]))
    if setting.get("temperature", 0) == 0:
        return found
    if setting["temperature"] != 1.0:
        found.append(lp.TemperatureLogitsWarper(setting["temperature"]))
    if setting.get("top_k"):
        found.append(lp.TopKLogitsWarper(setting["top_k"]))
    if setting.get("top_p", 1.0) < 1.0:
        found.append(lp.TopPLogitsWarper(setting["top_p"]))
    if setting.get("min_p"):
        found.append(lp.MinPLogitsWarper(setting["min_p"]))
    return found


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: ",".join(f"{k}={v}"
                                                                     for k, v in s.items()))
def test_distribution_equals_transformers_processors(setting):
    random = torch.Generator().manual_seed(0)
    for trial in range(5):
        logits = torch.randn(1, 300, generator=random) * (1 + trial)
        context = torch.randint(0, 300, (1, 40), generator=random)
        want = torch.softmax(_hf_processors(setting)(context, logits.clone()), dim=-1)[0]
        got = torch.from_numpy(distribution(logits[0].numpy(), context[0].tolist(),
                                            Sampling(**setting)))
        assert torch.allclose(got, want, atol=1e-6, rtol=0), (setting, trial)
        assert torch.equal(got == 0, want == 0)  # the same tokens filtered out


@pytest.mark.parametrize("setting", SETTINGS[:7], ids=str)
def test_every_step_of_generate_has_the_same_distribution(setting):
    # transformers decides the order here (its generate builds the processor list): each
    # step's processed scores against gdn_fx.runtime.sampling on the raw logits and the same context.
    model = tiny_model("qwen3_5")
    prompt = torch.tensor([[5, 9, 9, 17, 5, 30, 9]])
    torch.manual_seed(1)
    with torch.no_grad():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=True,
                             max_new_tokens=12, min_new_tokens=12, eos_token_id=None,
                             pad_token_id=0, top_k=setting.get("top_k", 0),
                             top_p=setting.get("top_p", 1.0), min_p=setting.get("min_p"),
                             temperature=setting["temperature"],
                             repetition_penalty=setting.get("repetition_penalty", 1.0),
                             output_scores=True, output_logits=True,
                             return_dict_in_generate=True)
    sampling = Sampling(**setting)
    for step, (raw, scores) in enumerate(zip(out.logits, out.scores)):
        context = out.sequences[0, :prompt.shape[1] + step].tolist()
        want = torch.softmax(scores[0], dim=-1)
        got = torch.from_numpy(distribution(raw[0].numpy(), context, sampling))
        assert torch.allclose(got, want, atol=1e-6, rtol=0), (setting, step)


def _draws(seed: int, count: int = 30) -> list:
    sampler = Sampler(Sampling(temperature=1.0, top_k=40, seed=seed))
    random = np.random.default_rng(7)
    context = []
    for _ in range(count):
        context.append(sampler.choose(random.normal(size=64).astype(np.float32), context))
    return context


def test_the_same_seed_gives_the_same_tokens():
    assert _draws(3) == _draws(3)
    assert _draws(3) != _draws(4)


def test_an_unseeded_sampler_reports_the_seed_that_replays_it():
    first = Sampler(Sampling(temperature=1.0))
    again = Sampler(Sampling(temperature=1.0, seed=first.seed))
    logits = np.zeros(1000, dtype=np.float32)
    assert [first.choose(logits, []) for _ in range(20)] == \
        [again.choose(logits, []) for _ in range(20)]


def test_draws_follow_the_distribution():
    logits = np.log(np.array([0.5, 0.3, 0.2], dtype=np.float32))
    sampler = Sampler(Sampling(temperature=1.0, seed=0))
    counts = np.bincount([sampler.choose(logits, []) for _ in range(4000)], minlength=3)
    assert np.allclose(counts / 4000, [0.5, 0.3, 0.2], atol=0.03), counts


def test_greedy_is_the_default_and_takes_the_arg_max():
    logits = np.random.default_rng(0).normal(size=(10, 80)).astype(np.float32)
    sampler = Sampler()
    assert sampler.sampling.greedy
    assert [sampler.choose(row, [1, 2]) for row in logits] == list(logits.argmax(axis=1))


def test_a_filter_that_removes_all_but_one_token_makes_it_certain():
    logits = np.array([0.1, 3.0, 0.2, -1.0], dtype=np.float32)
    sampler = Sampler(Sampling(temperature=5.0, top_k=1, seed=0))
    assert {sampler.choose(logits, []) for _ in range(50)} == {1}


@pytest.mark.parametrize("setting, words", [
    (dict(temperature=-0.1), "temperature must be >= 0"),
    (dict(temperature=float("nan")), "temperature must be a finite number"),
    (dict(temperature=1.0, top_p=0.0), "top_p must be in (0, 1]"),
    (dict(temperature=1.0, top_p=1.5), "top_p must be in (0, 1]"),
    (dict(temperature=1.0, top_k=-1), "top_k must be an int >= 0"),
    (dict(temperature=1.0, top_k=2.5), "top_k must be an int >= 0"),
    (dict(temperature=1.0, min_p=-0.1), "min_p must be in [0, 1]"),
    (dict(temperature=1.0, min_p=1.1), "min_p must be in [0, 1]"),
    (dict(repetition_penalty=0.0), "repetition_penalty must be > 0"),
    (dict(top_k=5), "give a temperature > 0"),
    (dict(temperature=1.0, seed=-1), "seed must be an int >= 0"),
])
def test_bad_settings_are_one_line_errors(setting, words):
    with pytest.raises(UsageError) as error:
        Sampling(**setting)
    assert words in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("value", [0, -3, 2.0, True, "8"])
def test_max_new_tokens_must_be_a_positive_int(value):
    with pytest.raises(UsageError, match="max_new_tokens must be an int >= 1"):
        check_max_new_tokens(value)
    assert check_max_new_tokens(8) == 8
