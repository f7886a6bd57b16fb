"""Batched decode (gdn_fx.hf.batch, issue 34): B sequences of their own pasts in one call.

Each prompt must generate exactly what transformers' greedy ``generate`` gives for it alone
(expected tokens and raw logits from transformers, never from gdn-fx), whatever ran beside
it in the batch, whichever slot it took and when it joined.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gdn_fx.errors import ArtifactError, UnsupportedModel, UsageError
from gdn_fx.hf import tiny_model
from gdn_fx.hf.batch import BatchStep
from gdn_fx.runtime.batch import MASKED, BatchGenerator
from gdn_fx.hf.configs import SAFE_TOKEN_RANGE
from gdn_fx.hf.generator import Generator, check_generation, export_generator

pytestmark = pytest.mark.slow  # whole-model exports (make test-fast skips them)

LIN, FULL = "linear_attention", "full_attention"
SMALL = dict(num_hidden_layers=2, layer_types=[LIN, FULL])  # two layers: the file stays fast
# GDN, GDN + MoE, KDA (MLA), Mamba2, Mamba1 + MoE (the last two at their own tiny sizes)
FAMILIES = ("qwen3_5", "qwen3_next", "kimi_linear", "bamba", "jamba")
OWN_SIZE = ("bamba", "jamba")
SLOTS = 3
# More prompts than slots: the 4th to 6th join mid-way, into slots freed at other times;
# lengths 1 and 100 included.
LENGTHS = (1, 100, 7, 33, 2, 64)


def _prompt(length: int, seed: int) -> list:
    low, high = SAFE_TOKEN_RANGE
    return torch.randint(low, high, (length,), generator=torch.Generator().manual_seed(seed)
                         ).tolist()


@pytest.fixture(scope="module", params=FAMILIES)
def exported(request, tmp_path_factory):
    model = tiny_model(request.param, **({} if request.param in OWN_SIZE else SMALL))
    files = export_generator(model, tmp_path_factory.mktemp("batch") / "b.nnef.tgz",
                             batch=SLOTS)
    return request.param, model, files


def _check_all(model, results, prompts, family):
    assert [r.prompt for r in results] == prompts  # in the order asked
    for index, result in enumerate(results):
        found = check_generation(model, result)
        assert found.ok, f"{family} prompt {index} ({len(prompts[index])} tokens): {found}"


def test_every_sequence_generates_what_transformers_gives_it_alone(exported):
    family, model, files = exported
    generator = BatchGenerator(files.main)
    prompts = [_prompt(length, seed) for seed, length in enumerate(LENGTHS)]
    results = generator.generate(prompts, 64, keep_logits=True)
    _check_all(model, results, prompts, family)
    assert all(len(r.tokens) == 64 for r in results)
    stats = generator.stats
    # slots were reused (6 prompts, 3 slots) and dead columns dropped: P stayed bounded by
    # the longest-lived sequences, not the 300 calls' total
    assert stats.dropped > 0, stats.rates()
    assert stats.widest <= 100 + 64 + 1, stats.rates()


def test_fewer_prompts_than_slots_and_prompt_chunks(exported):
    family, model, files = exported
    generator = BatchGenerator(files.main)
    # two prompts for three slots: the idle row rides along, every past column masked; the
    # first call takes 20 tokens of both prompts (S = 20), the rest of the 40 one at a time
    prompts = [_prompt(40, 11), _prompt(20, 12)]
    results = generator.generate(prompts, 24, keep_logits=True)
    _check_all(model, results, prompts, family)
    assert generator.stats.calls == 1 + 20 + 23, generator.stats.rates()
    # the same generator again: nothing of the first run is left in its State
    again = generator.generate(prompts[::-1], 24)
    assert [r.tokens for r in again] == [r.tokens for r in results[::-1]]


def test_one_prompt_per_call_of_a_generator_fork(exported):
    family, model, files = exported
    generator = BatchGenerator(files.main)
    fork = generator.fork()
    assert fork.graph.runnable is generator.graph.runnable and fork.state is not generator.state
    prompt = _prompt(9, 5)
    (result,) = fork.generate([prompt], 16, keep_logits=True)
    _check_all(model, [result], [prompt], family)


def test_worker_threads_each_serve_their_share_through_slots_of_their_own(exported,
                                                                           monkeypatch):
    # 2 States (forks) of 3 slots on one loaded graph, prompts dealt in turn: each prompt
    # still generates what transformers gives it alone, results in the order asked
    family, model, files = exported
    generator = BatchGenerator(files.main)
    forks, fork = [], BatchGenerator.fork
    monkeypatch.setattr(BatchGenerator, "fork", lambda self: forks.append(fork(self)) or forks[-1])
    prompts = [_prompt(length, 20 + seed) for seed, length in enumerate((3, 41, 1, 12, 8))]
    results = generator.generate(prompts, 12, keep_logits=True, workers=2)
    _check_all(model, results, prompts, family)
    assert len(forks) == 1 and forks[0].stats.generated == 2 * 12  # prompts 1 and 3
    assert generator.stats.generated == 5 * 12
    with pytest.raises(UsageError, match="workers must be an int >= 1"):
        generator.generate(prompts, 4, workers=0)


def test_the_batched_step_is_refused_with_bad_inputs_naming_the_shape(exported):
    _, _, files = exported
    generator = BatchGenerator(files.main)
    zeros = [z.copy() for z in generator.zero_states]
    ok_ids, ok_pos = np.zeros((SLOTS, 1), np.int64), np.zeros((SLOTS, 1), np.int64)
    no_past = np.zeros((SLOTS, 0), np.float32)
    with pytest.raises(UsageError, match=r"input_ids as integers \[3, S\].*got int64 \[2, 1\]"):
        generator.step(np.zeros((2, 1), np.int64), np.zeros((2, 1), np.int64), no_past, zeros)
    with pytest.raises(UsageError, match=r"position_ids .* shape \[3, 1\], got int64 \[3, 2\]"):
        generator.step(ok_ids, np.zeros((SLOTS, 2), np.int64), no_past, zeros)
    with pytest.raises(UsageError, match=r"past_mask must be \[3, 0\].*got \[3, 4\]"):
        generator.step(ok_ids, ok_pos, np.zeros((SLOTS, 4), np.float32), zeros)
    with pytest.raises(UsageError, match=r"outside the vocabulary"):
        generator.step(ok_ids + generator.vocab, ok_pos, no_past, zeros)
    logits, caches = generator.step(ok_ids, ok_pos, no_past, zeros)  # the right shapes run
    assert logits.shape == (SLOTS, generator.vocab)
    with pytest.raises(UsageError, match=r"past_mask must be \[3, 1\].*got \[3, 0\]"):
        generator.step(ok_ids, ok_pos, no_past, caches)  # P = 1 after that call
    with pytest.raises(UsageError, match=r"^prompt 1: prompt_ids is empty"):
        generator.generate([[1], []], 4)
    with pytest.raises(UsageError, match="max_new_tokens must be an int >= 1"):
        generator.generate([[1]], 0)
    with pytest.raises(ArtifactError, match=r"batched artifact \(B = 3\).*BatchGenerator"):
        Generator(files.main)


@pytest.mark.parametrize("batch", [0, -2, 1.5, True, "4"])
def test_batch_must_be_a_positive_int(tmp_path, batch):
    with pytest.raises(UsageError, match="batch must be an int >= 1"):
        export_generator(tiny_model("qwen3_5", **SMALL), tmp_path / "b.nnef.tgz", batch=batch)
    assert not (tmp_path / "b.nnef.tgz").exists()


def test_batched_export_has_no_decode_graph(tmp_path):
    with pytest.raises(UsageError, match="batched export .* decode=True"):
        export_generator(tiny_model("qwen3_5", **SMALL), tmp_path / "b.nnef.tgz", batch=2,
                         decode=True)


def test_a_model_with_sliding_layers_is_refused_naming_them():
    with pytest.raises(UnsupportedModel, match="sliding_attention"):
        BatchStep(tiny_model("lara_mini"), 2)


def test_a_one_sequence_artifact_is_not_run_as_a_batch(tmp_path):
    files = export_generator(tiny_model("qwen3_5", **SMALL), tmp_path / "one.nnef.tgz")
    with pytest.raises(ArtifactError, match="not a batched artifact"):
        BatchGenerator(files.main)


def test_the_batched_step_computes_each_row_as_its_own_sequence():
    # Eager, no tract: row b of the batched step (its own past columns unmasked among
    # others', its own positions) gives what the one-sequence step gives for that row alone.
    model = tiny_model("qwen3_5", **SMALL)
    step = BatchStep(model, 2)
    args = step.batch_inputs(2, [5, 0], seed=4)
    ids, positions, mask, *states = args
    assert mask[1].eq(MASKED).all() and positions[1].tolist() == [0, 1]
    batched = step.eager(*args)
    for row, own in ((0, 5), (1, 0)):
        alone = [s[row:row + 1] for s in states]
        alone = [a[:, :, a.shape[2] - own:] if spec.past_axis == 2 else a
                 for a, spec in zip(alone, step.specs)]
        single = step.eager(ids[row:row + 1], positions[row:row + 1],
                            mask[row:row + 1, mask.shape[1] - own:], *alone)
        for got, want in zip(batched, single):
            got = got[row:row + 1]
            if got.shape != want.shape:  # attention caches: the row's own columns
                got = got[:, :, got.shape[2] - want.shape[2]:]
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_cli_generates_one_line_per_prompt_through_the_slots(exported, tmp_path, capsys):
    family, model, files = exported
    if family != "qwen3_5":
        pytest.skip("the CLI is the same for every family")
    import json

    from gdn_fx.cli import main
    from gdn_fx.hf.generator import GenerationResult

    prompts = [_prompt(6, 1), _prompt(40, 2), _prompt(2, 3), _prompt(1, 4), _prompt(9, 5)]
    listing = tmp_path / "prompts.txt"
    listing.write_text("".join(",".join(map(str, p)) + "\n" for p in prompts))
    code = main(["generate", "--nnef", str(files.main), "--prompts-file", str(listing),
                 "--batch", str(SLOTS), "--max-new-tokens", "8", "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    lines = [json.loads(line) for line in captured.out.splitlines() if line]
    assert [line["prompt_index"] for line in lines] == list(range(len(prompts)))
    for line, prompt in zip(lines, prompts):
        found = check_generation(model, GenerationResult(prompt, line["tokens"]))
        assert found.tokens_equal and len(line["tokens"]) == 8, str(found)
    assert "B = 3 in one State" in captured.err
    code = main(["generate", "--nnef", str(files.main), "--prompts-file", str(listing),
                 "--batch", str(SLOTS), "--workers", "2", "--max-new-tokens", "8", "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    again = [json.loads(line) for line in captured.out.splitlines() if line]
    assert [line["tokens"] for line in again] == [line["tokens"] for line in lines]
    assert "B = 3 in each of 2 States" in captured.err
    code = main(["generate", "--nnef", str(files.main), "--prompts-file", str(listing),
                 "--batch", "2"])
    assert code == 2 and "--batch 2: " in capsys.readouterr().err
    code = main(["generate", "--nnef", str(files.main), "--prompt-ids", "1,2", "--batch", "3"])
    assert code == 2 and "--batch goes with --prompts-file" in capsys.readouterr().err


def test_cli_export_batch_writes_the_batched_graph_checked_through_its_slots(tmp_path, capsys):
    from gdn_fx.cli import main

    out = tmp_path / "b2.nnef.tgz"
    code = main(["export", "--family", "qwen3_5", "--out", str(out), "--batch", "2",
                 "--weights", "f16"])
    captured = capsys.readouterr()
    assert code == 0, captured.out + captured.err
    # its own check: 3 prompts through 2 slots (one slot taken over), each against
    # transformers on the stored f16 weights
    assert "every token of 3 prompts equal" in captured.out
    assert "inputs: input_ids, position_ids, past_mask," in captured.out
    generator = BatchGenerator(out)
    assert generator.batch == 2
    model = tiny_model("qwen3_5")
    from gdn_fx.hf.generator import with_stored_weights

    prompts = [_prompt(5, 11), _prompt(17, 12)]
    results = generator.generate(prompts, 8, keep_logits=True)
    _check_all(with_stored_weights(model, out), results, prompts, "qwen3_5")


@pytest.mark.parametrize("extra, says", [
    (["--batch", "0"], "--batch must be >= 1, got 0"),
    (["--batch", "2", "--decode-graph"], "--batch is one graph on the reify route: it takes "
                                         "no --decode-graph"),
    (["--batch", "2", "--generalize"], "it takes no --generalize"),
    (["--batch", "2", "--seq-len", "4"], "--batch writes the generation-ready artifact"),
    (["--batch", "2", "--runtime", "cuda"], "--runtime cuda: --batch (gdn_fx.hf.batch) lowers "
                                            "for the CPU runtime only"),
])
def test_cli_export_batch_refusals_come_before_any_work(tmp_path, capsys, monkeypatch, extra,
                                                        says):
    from gdn_fx import pipeline
    from gdn_fx.cli import main

    def built(*args, **kwargs):
        raise AssertionError("the command started work before refusing its arguments")

    monkeypatch.setattr(pipeline, "build_model", built)
    code = main(["export", "--family", "qwen3_5", "--out", str(tmp_path / "b.nnef.tgz"),
                 *extra])
    err = capsys.readouterr().err
    assert code == 2 and says in err and len(err.strip().splitlines()) == 1, err
