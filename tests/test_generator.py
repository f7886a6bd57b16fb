"""Generation-ready exports: one NNEF (or a declared pair) that generates in tract exactly as
transformers' own ``generate`` does, for every hybrid family.

Expected tokens and logits come from transformers (``model.generate``, greedy, raw logits),
never from gdn-fx: a 37-token prompt, 64 new tokens, every token equal and every step's
logits within 1e-4 relative.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from gdn_fx import tract_check
from gdn_fx.cli import main
from gdn_fx.errors import ExportRefused
from gdn_fx.hf import tiny_model
from gdn_fx.hf.configs import GENERATING, SAFE_TOKEN_RANGE, one_of_each
from gdn_fx.hf.decode import DecodeStep
from gdn_fx.lowering.prefill import auto_prefill_chunk
from gdn_fx.hf.generator import (NOT_ASKED, Generator,
                                 check_generation, decode_path, decode_problem,
                                 export_generator)

pytestmark = pytest.mark.slow  # whole-model exports (make test-fast skips them)



def _prompt(length: int = 37, seed: int = 1) -> list:
    low, high = SAFE_TOKEN_RANGE
    return torch.randint(low, high, (length,), generator=torch.Generator().manual_seed(seed)
                         ).tolist()


@pytest.mark.parametrize("family", GENERATING)
def test_tract_generates_what_transformers_generates(shared_export, family):
    model, files = shared_export(family)
    generator = Generator(files.main, files.decode)
    for seed in (1, 2):  # the second run reuses the kept tract States
        result = generator.generate(_prompt(seed=seed), 64)
        found = check_generation(model, result)
        assert found.ok, f"{family} (prompt {seed}): {found}"
        assert len(result.tokens) == 64


def test_a_tied_lm_head_generates_exactly(tmp_path):
    # The tied head is rewritten as a matmul of the transposed embedding (lowering/t2n/fixes.py,
    # so that tract packs it once); the tokens must not change.
    model = tiny_model("qwen3_5", tie_word_embeddings=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    files = export_generator(model, tmp_path / "tied.nnef.tgz")
    found = check_generation(model, Generator(files.main, files.decode).generate(_prompt(), 24))
    assert found.ok, str(found)


def test_a_prompt_fed_in_chunks_generates_what_transformers_generates(shared_export):
    # 37 tokens in calls of 8 (the last one 5) and of 1 (every call a decode-graph step):
    # the artifact carries its caches across calls, so the tokens and logits must not change.
    model, files = shared_export("qwen3_5")
    for chunk in (8, 1):
        result = Generator(files.main, files.decode, prefill_chunk=chunk).generate(_prompt(), 16)
        found = check_generation(model, result)
        assert found.ok, f"chunks of {chunk}: {found}"


def test_caches_go_back_in_as_tract_tensors_unchanged(shared_export):
    # The Generator feeds each call's output Tensors to the next call as they are (no numpy
    # round trip): that is right only while tract neither consumes nor writes its inputs.
    _, files = shared_export("qwen3_5")
    generator = Generator(files.main, files.decode)
    ids = np.array([_prompt(9)], dtype=np.int64)
    _, caches = generator.step(generator.main, ids, generator.zero_states)
    before = [c.to_numpy() for c in caches]
    token = np.array([[int(ids[0, 0])]], dtype=np.int64)
    from_tensors, _ = generator.step(generator.decode, token, caches)
    from_arrays, _ = generator.step(generator.decode, token, before)
    assert all(np.array_equal(c.to_numpy(), b) for c, b in zip(caches, before))
    assert np.array_equal(from_tensors, from_arrays)


def test_the_automatic_prefill_chunk_follows_the_widest_projection(tmp_path):
    # Widest inner dimension from the model's own Linear layers, not from the NNEF text.
    model = tiny_model("qwen3_5")
    widest = max(m.in_features for m in model.modules() if isinstance(m, torch.nn.Linear))
    files = export_generator(model, tmp_path / "q.nnef.tgz", decode=False)
    text = tract_check.nnef_text(files.main)
    assert "fragment gdn_fx_split_" in text  # the one graph's scans are "split"
    assert auto_prefill_chunk(text, l2_bytes=4 * widest * 150) == 128  # 64-token steps
    assert auto_prefill_chunk(text, l2_bytes=4 * widest * 40) == 64  # split: one step at least
    assert auto_prefill_chunk(text, l2_bytes=4 * widest * 3) == 64
    assert auto_prefill_chunk(text, l2_bytes=1 << 40) == 512  # the ceiling
    other = text.replace("gdn_fx_split_", "gdn_fx_chunked_")  # no split scan: the L2 rule
    assert auto_prefill_chunk(other, l2_bytes=4 * widest * 150) == 128
    assert auto_prefill_chunk(other, l2_bytes=4 * widest * 40) == 32  # below one step
    assert auto_prefill_chunk(other, l2_bytes=4 * widest * 3) == 16  # the floor


def test_one_graph_by_default_serving_decode_with_split(tmp_path):
    """Issue 31: one file (one copy of the weights); its delta-rule scans take "split" (chunks,
    then steps: one step at S = 1) and its conv updates "portable"; decode runs on it."""
    model = tiny_model("qwen3_5")
    (tmp_path / "q.decode.nnef.tgz").write_bytes(b"a decode graph of an earlier export")
    files = export_generator(model, tmp_path / "q.nnef.tgz")
    assert files.decode is None and files.decode_note == NOT_ASKED
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q.nnef.tgz"]  # the stale one gone
    assert set(tract_check.read_decisions(files.main).values()) == {"split", "portable"}
    generator = Generator(files.main, files.decode)
    assert generator.decode is generator.main  # one tract State serves both
    found = check_generation(model, generator.generate(_prompt(70), 8))  # 64 + 6: both parts
    assert found.ok, str(found)


def test_the_artifact_declares_symbolic_lengths_and_the_contract_order(tmp_path):
    model = tiny_model("qwen3_5")
    files = export_generator(model, tmp_path / "q.nnef.tgz", decode=True)  # the pair
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q.decode.nnef.tgz", "q.nnef.tgz"]
    text = tract_check.nnef_text(files.main)
    assert "extension tract_symbol S;" in text and "extension tract_symbol P;" in text
    assert "tract_assert P >= 0" in text and "tract_assert S >= 1" in text
    assert re.search(r"input_ids = tract_core_external\(shape = \[1, S\]", text)
    assert re.search(r"key_1 = tract_core_external\(shape = \[1, 2, P, 8\]", text)
    assert files.input_names[0] == "input_ids"
    assert files.output_names == ("logits", *(f"new_{n}" for n in files.input_names[1:]))
    # The decode graph: same inputs and outputs, S fixed at 1, the decode candidates.
    assert files.decode == decode_path(files.main) and files.decode.exists()
    assert set(tract_check.read_decisions(files.decode).values()) == {"matmul_step", "portable"}
    assert "split" in tract_check.read_decisions(files.main).values()
    # Attention runs on the key/value heads (gdn_fx.hf.attention): no cache is repeated
    # (repeat_kv's unsqueeze + tile of the new cache).
    for graph in (files.main, files.decode):
        assert not re.search(r"unsqueeze\(new_(key|value)_\d+", tract_check.nnef_text(graph))


def test_last_position_logits_and_an_empty_past(tmp_path):
    model = tiny_model("olmo_hybrid")
    files = export_generator(model, tmp_path / "o.nnef.tgz", decode=False)
    runnable = tract_check.load(files.main)
    generator = Generator(files.main)
    ids = np.array([_prompt(5)], dtype=np.int64)
    logits = runnable.run([ids, *generator.zero_states])[0].to_numpy()
    assert logits.shape == (1, 1, model.config.vocab_size)
    with torch.no_grad():
        want = model(input_ids=torch.from_numpy(ids)).logits[0, -1].numpy()
    assert np.abs(logits[0, 0] - want).max() / np.abs(want).max() < 1e-4


def test_all_positions_on_request(tmp_path):
    model = tiny_model("lfm2")
    files = export_generator(model, tmp_path / "l.nnef.tgz", decode=False, all_logits=True)
    ids = np.array([_prompt(6)], dtype=np.int64)
    logits = tract_check.load(files.main).run([ids, *Generator(files.main).zero_states])
    assert logits[0].to_numpy().shape == (1, 6, model.config.vocab_size)


def test_a_sliding_window_model_generates_past_its_window(tmp_path):
    # lara_mini's tiny config has a 128-token window: a 160-token prompt in calls of 32, then
    # 64 tokens, runs the mask past the window (its first 32 keys hidden from the last rows:
    # with -inf masks tract's flash kernel gave NaN there, lowering/t2n/fixes.py).
    model = tiny_model("lara_mini")
    assert model.config.sliding_window == 128
    files = export_generator(model, tmp_path / "l.nnef.tgz")
    result = Generator(files.main, files.decode, prefill_chunk=32).generate(_prompt(160), 64)
    found = check_generation(model, result)
    assert found.ok, str(found)


@pytest.mark.parametrize("family", ["glm5_next", "qwen4_exp"])  # sparse-attention indexers
def test_models_that_cannot_generate_from_one_artifact_are_refused(tmp_path, monkeypatch,
                                                                   family):
    def traced(*args, **kwargs):
        raise AssertionError("the export traced the model before refusing it")

    monkeypatch.setattr(torch.export, "export", traced)  # refused from the modules, first
    with pytest.raises(ExportRefused, match="data-dependent size"):
        export_generator(tiny_model(family), tmp_path / "g.nnef.tgz")


def test_cli_export_then_generate_with_check(tmp_path, capsys):
    path = tmp_path / "kimi.nnef.tgz"
    assert main(["export", "--family", "kimi_linear", "--out", str(path)]) == 0
    out = capsys.readouterr().out
    assert "tract generate vs transformers: every token equal" in out
    assert out.rstrip().endswith("OK")
    prompt = ",".join(map(str, _prompt(9)))
    assert main(["generate", "--nnef", str(path), "--prompt-ids", prompt,
                 "--max-new-tokens", "12", "--check", "--family", "kimi_linear"]) == 0
    out = capsys.readouterr().out
    assert "tokens: " in out and "tokens/s" in out and out.rstrip().endswith("OK")


@pytest.mark.parametrize("weights", ["q4_0", "f16"])
def test_cli_generate_check_compares_on_the_weights_the_export_stores(tmp_path, capsys,
                                                                      weights):
    # Q4_0 / f16 weights move the logits far past 1e-4 from the f32 model: --check compares
    # with transformers holding the stored weights, so it passes; the f32 model itself would
    # not (checked below with the stored weights left out)
    from gdn_fx.cli_text import checked_model
    from gdn_fx.hf.generator import Generator

    path = tmp_path / "q.nnef.tgz"
    assert main(["export", "--family", "qwen3_5", "--out", str(path), "--weights", weights,
                 "--no-check"]) == 0
    capsys.readouterr()
    prompt = _prompt(9)
    assert main(["generate", "--nnef", str(path), "--prompt-ids", ",".join(map(str, prompt)),
                 "--max-new-tokens", "12", "--check", "--family", "qwen3_5"]) == 0
    out = capsys.readouterr().out
    assert "every token equal" in out and out.rstrip().endswith("OK")
    result = Generator(path).generate(prompt, 12)
    assert not check_generation(tiny_model("qwen3_5"), result).ok
    import argparse

    args = argparse.Namespace(family="qwen3_5", config=None, model_dir=None, seed=0,
                              nnef=path)
    assert check_generation(checked_model(args)[0], result).ok


def test_cli_export_writes_one_graph_and_the_pair_on_request(tmp_path, capsys):
    one, pair = tmp_path / "one" / "q.nnef.tgz", tmp_path / "pair" / "q.nnef.tgz"
    assert main(["export", "--family", "qwen3_5", "--out", str(one), "--no-check"]) == 0
    out = capsys.readouterr().out
    assert f"decode graph: none ({NOT_ASKED}); the main graph serves decode" in out
    assert "gated_delta_scan -> split" in out and "decode.nnef" not in out
    assert sorted(p.name for p in one.parent.iterdir()) == ["q.nnef.tgz"]
    assert main(["export", "--family", "qwen3_5", "--out", str(pair), "--no-check",
                 "--decode-graph"]) == 0
    out = capsys.readouterr().out
    assert f"nnef: {decode_path(pair)} (decode, S = 1, P >= 0)" in out
    assert "lowering of q.decode.nnef.tgz: " in out and "-> matmul_step" in out
    assert sorted(p.name for p in pair.parent.iterdir()) == ["q.decode.nnef.tgz", "q.nnef.tgz"]
    assert main(["export", "--family", "qwen3_5", "--out", str(pair), "--seq-len", "2",
                 "--decode-graph"]) == 2
    assert "--decode-graph belongs to the generation-ready artifact" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--prompt-ids", "1,x"], "--prompt-ids must be integers"),
    (["--prompt-ids", ""], "--prompt-ids is empty"),
    (["--prompt-ids", "1,2", "--check"], "--check needs the model"),
])
def test_cli_generate_refuses_bad_arguments_in_one_line(tmp_path, capsys, argv, message):
    nnef = tmp_path / "missing.nnef.tgz"
    assert main(["generate", "--nnef", str(nnef), *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_cli_exports_a_checkpoint_folder(tmp_path, capsys):
    folder = tmp_path / "checkpoint"
    tiny_model("lfm2", seed=3).save_pretrained(folder)  # config.json + weights, no tokenizer
    path = tmp_path / "lfm2.nnef.tgz"
    assert main(["export", "--model", str(folder), "--out", str(path)]) == 0
    out = capsys.readouterr().out
    assert "lfm2 from" in out and "every token equal" in out and out.rstrip().endswith("OK")


def test_a_half_precision_model_generates(tmp_path):
    small = one_of_each("qwen3_5")  # a linear and an attention layer: f16 is layer-agnostic
    model = tiny_model("qwen3_5", dtype=torch.float16, **small)
    files = export_generator(model, tmp_path / "q16.nnef.tgz", decode=True)
    assert "datum_type = 'f16'" in tract_check.nnef_text(files.main)
    assert files.decode is not None, files.decode_note
    result = Generator(files.main, files.decode).generate(_prompt(), 32)
    found = check_generation(model, result)  # f16: logits within 1e-2 of transformers
    assert found.ok and found.bound == 1e-2, str(found)
    # the f16 decode check (against the f32 twin, bounds scaled by the main graph's own f16
    # error) still drops a decode graph that computes something else: another seed's weights
    other = export_generator(tiny_model("qwen3_5", dtype=torch.float16, seed=1, **small),
                             tmp_path / "other.nnef.tgz", decode=True)
    step = DecodeStep(model, last_logits=True, whole_windows=True)
    assert decode_problem(files.decode, files.main, step) == ""
    assert "differs" in decode_problem(other.decode, files.main, step)


RUN_ONLY = """
import json, sys
sys.modules["torch_to_nnef"] = sys.modules["nnef_tools"] = None  # a machine that only runs
from gdn_fx.hf.generator import Generator
print(json.dumps(Generator(sys.argv[1]).generate(json.loads(sys.argv[2]), 12).tokens))
"""


def test_generating_needs_neither_torch_to_nnef_nor_nnef_tools(shared_export):
    # A GPU box that runs artifacts exported elsewhere has tract, not the export toolchain
    # (the generator's automatic prompt chunk once imported the lowering's writers).
    import json
    import subprocess
    import sys

    model, files = shared_export("qwen3_5")
    prompt = _prompt(70)
    out = subprocess.run([sys.executable, "-c", RUN_ONLY, str(files.main), json.dumps(prompt)],
                         capture_output=True, text=True, check=True).stdout
    ids = torch.tensor([prompt])
    with torch.no_grad():
        want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12,
                              min_new_tokens=0, do_sample=False, eos_token_id=None,
                              pad_token_id=0)[0, len(prompt):].tolist()
    assert json.loads(out.strip().splitlines()[-1]) == want


@pytest.mark.parametrize("family", ["bamba", "lfm2"])
def test_grouped_attention_without_a_gate_generates_with_q4_0_weights(tmp_path, family):
    """o_proj's input as grouped_sdpa lays it out: tract 0.23.9 multiplies a Q4_0 weight
    wrongly when the axes its input axis is merged from were permuted among themselves
    (docs/facts/tract.md); these families have grouped key/value heads and no output gate
    between the attention and o_proj (qwen3_5's gate hid it). Against transformers holding
    the stored weights: every token and logit."""
    from gdn_fx.hf.generator import with_stored_weights

    model = tiny_model(family)
    files = export_generator(model, tmp_path / "q.nnef.tgz", weights="q4_0")
    result = Generator(files.main).generate(_prompt(17), 16)
    found = check_generation(with_stored_weights(model, files.main), result)
    assert found.ok, str(found)
