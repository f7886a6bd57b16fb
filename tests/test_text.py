"""Text in, text out: the checkpoint's tokenizer, chat prompts, streamed detokenizing, EOS and
stop strings, and generation from a text prompt in tract against transformers' ``generate``.

Expected values come from transformers (``AutoTokenizer``, ``apply_chat_template``,
``decode``, ``model.generate``) or are written out by hand, never from gdn_fx.runtime.text or
gdn_fx.runtime.streaming.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from gdn_fx.errors import CheckpointError, GdnFxError, UsageError
from gdn_fx.hf import tiny_model
from gdn_fx.runtime.sampling import Sampling
from gdn_fx.runtime.streaming import stream
from gdn_fx.demo_text import DEMO_CHAT_TEMPLATE, demo_corpus, demo_tokenizer
from gdn_fx.runtime.text import (Detokenizer, StopStrings, context_length, eos_ids,
                                 load_tokenizer, prompt_ids, save_text_files)

TEXTS = ["The keeper lit the lamp.", "café crème brûlée", "日本 is Japan, こんにちは",
         "stars 🌟 and a boat ⛵ 🙂", "naïve → déjà vu ≈ 12°C", "  two  spaces\nand a line"]


# folder, tokenizer (transformers') and demo_nnef: conftest.py's, shared with other modules

@pytest.fixture(scope="module")
def model(folder):
    return AutoModelForCausalLM.from_pretrained(str(folder)).eval()


def _hf_greedy(model, ids, count, eos=None):
    prompt = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                             max_new_tokens=count, eos_token_id=eos, pad_token_id=0)
    return out[0, len(ids):].tolist()


# --- the tokenizer and the demo checkpoint ---------------------------------------------------

def test_the_demo_checkpoint_is_a_folder_transformers_loads(folder, tokenizer, model):
    names = {p.name for p in folder.iterdir()}
    assert {"config.json", "generation_config.json", "tokenizer.json"} <= names
    assert model.config.vocab_size == len(tokenizer) == 512
    assert (tokenizer.pad_token, tokenizer.bos_token, tokenizer.eos_token) == \
        ("<pad>", "<s>", "</s>")
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    generation = json.loads((folder / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [2, tokenizer.convert_tokens_to_ids("<|im_end|>")]


def test_the_demo_tokenizer_is_trained_the_same_every_time():
    assert demo_tokenizer().get_vocab() == demo_tokenizer().get_vocab()


@pytest.mark.parametrize("text", TEXTS)
def test_text_prompts_round_trip_through_the_tokenizer(folder, tokenizer, text):
    ids = prompt_ids(load_tokenizer(folder), text)
    assert ids == tokenizer(text)["input_ids"]
    assert tokenizer.decode(ids) == text


def test_multi_byte_characters_are_split_into_byte_pieces(tokenizer):
    # Without byte pieces the streaming tests below would not meet a split character.
    pieces = [tokenizer.decode([i]) for i in tokenizer("日本 🌟")["input_ids"]]
    assert any("\ufffd" in piece for piece in pieces), pieces
    assert all(char in demo_corpus() for char in "é日本🌟")


def test_a_chat_prompt_equals_transformers_chat_template(folder, tokenizer):
    messages = [{"role": "user", "content": "Is the light ever dark? 日本"}]
    want = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                         tokenize=True)["input_ids"]
    got = prompt_ids(load_tokenizer(folder), messages[0]["content"], chat=True)
    assert got == list(want)
    written = ("<|im_start|>user\nIs the light ever dark? 日本<|im_end|>\n"
               "<|im_start|>assistant\n")  # DEMO_CHAT_TEMPLATE, by hand
    assert tokenizer.decode(got) == written


def test_a_system_message_comes_first(tokenizer):
    got = prompt_ids(tokenizer, "Hi", chat=True, system="Be brief.")
    assert tokenizer.decode(got) == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user"
                                     "\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_eos_ids_and_context_come_from_the_folder(folder, tmp_path):
    assert eos_ids(folder) == [2, 4]
    assert context_length(folder) == json.loads(
        (folder / "config.json").read_text())["max_position_embeddings"]
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert eos_ids(tmp_path) == [7]  # no generation_config.json: config.json's
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 6]}))
    assert eos_ids(tmp_path) == [5, 6]


# --- streamed text ---------------------------------------------------------------------------

def _streamed(tokenizer, tokens) -> list:
    text = Detokenizer(tokenizer)
    pieces = [text.push(t) for t in tokens]
    return pieces + [text.finish()]


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_text_equals_the_decoded_whole(tokenizer, text):
    tokens = tokenizer(text)["input_ids"]
    pieces = _streamed(tokenizer, tokens)
    assert "".join(pieces) == tokenizer.decode(tokens) == text
    assert not any("\ufffd" in piece for piece in pieces)  # never half a character


def test_streamed_random_tokens_equal_the_decoded_whole(tokenizer):
    # Random ids give stray bytes: invalid UTF-8 must come out as decode gives it, no more.
    random = np.random.default_rng(0)
    for _ in range(20):
        tokens = random.integers(0, len(tokenizer), 40).tolist()
        want = tokenizer.decode(tokens, skip_special_tokens=True)
        assert "".join(_streamed(tokenizer, tokens)) == want


def test_a_character_is_given_out_once_complete(tokenizer):
    tokens = tokenizer("日")["input_ids"]
    assert len(tokens) > 1  # a byte per token
    pieces = _streamed(tokenizer, tokens)
    assert pieces[:-2] == [""] * (len(tokens) - 1) and pieces[-2] == "日"


def test_a_sentencepiece_style_decoder_streams_its_spaces():
    # Metaspace drops the leading space of a decoded sequence: each piece must not.
    bpe = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    bpe.normalizer = normalizers.Replace(" ", "\u2581")
    bpe.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    bpe.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    alphabet = [f"<0x{b:02X}>" for b in range(256)]
    bpe.train_from_iterator([demo_corpus()], trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<unk>", *alphabet], show_progress=False))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe)
    for text in TEXTS[:4]:
        tokens = tokenizer(text)["input_ids"]
        assert "".join(_streamed(tokenizer, tokens)) == tokenizer.decode(tokens)


def test_stop_strings_split_over_pieces_are_found_and_not_printed():
    stops = StopStrings(["\n\n", "END"])
    given = [stops.feed(p) for p in ["one\n", "\n", "two"]]
    assert given == ["one", "", ""] and stops.stopped == "\n\n"


def test_text_that_only_began_like_a_stop_string_is_given_out():
    stops = StopStrings(["END"])
    assert [stops.feed(p) for p in ["the E", "N", "d", " of it"]] == \
        ["the ", "", "ENd", " of it"]
    assert stops.stopped is None and stops.finish() == ""
    held = StopStrings(["END"])
    assert held.feed("wE") == "w" and held.finish() == "E"


def test_the_first_stop_string_in_the_text_wins():
    stops = StopStrings(["b", "abc"])
    assert stops.feed("xxabc") == "xx" and stops.stopped == "abc"  # earliest start


# --- generation: EOS, stop strings (transformers in torch) -----------------------------------

PROMPT = "The keeper of the north light"


def test_greedy_streaming_in_torch_equals_transformers_generate(tokenizer, model):
    ids = tokenizer(PROMPT)["input_ids"]
    run = stream(model, PROMPT, tokenizer=tokenizer, max_new_tokens=10)
    pieces = list(run)
    want = _hf_greedy(model, ids, 10)
    assert [p.token for p in pieces] == run.summary.tokens == want
    assert "".join(p.text for p in pieces) == run.summary.text == tokenizer.decode(
        want, skip_special_tokens=True)
    assert run.summary.finish_reason == "length"


def test_an_eos_id_ends_generation_as_in_transformers(tokenizer, model):
    ids = tokenizer(PROMPT)["input_ids"]
    free = _hf_greedy(model, ids, 10)
    eos = free[4]  # a token generation meets: make it the end of the sequence
    want = _hf_greedy(model, ids, 10, eos=[eos])
    run = stream(model, ids, tokenizer=tokenizer, max_new_tokens=10, eos=[eos])
    assert [p.token for p in run] == want == free[:free.index(eos) + 1]
    assert run.summary.finish_reason == "eos"


def test_a_stop_string_ends_generation_before_it(tokenizer, model):
    ids = tokenizer(PROMPT)["input_ids"]
    free = _hf_greedy(model, ids, 12)
    whole = tokenizer.decode(free, skip_special_tokens=True)
    cut = next(i for i in range(3, len(whole) - 3) if whole[i:i + 2].isprintable())
    stop = whole[cut:cut + 2]
    at = whole.find(stop)
    run = stream(model, ids, tokenizer=tokenizer, max_new_tokens=12, stop=[stop])
    text = "".join(p.text for p in run)
    assert text == whole[:at] and run.summary.finish_reason == "stop"
    # it ended at the token that completed the stop string
    done = run.summary.tokens
    assert stop in tokenizer.decode(done) and stop not in tokenizer.decode(done[:-1])


def test_sampling_with_a_seed_repeats(tokenizer, model):
    setting = Sampling(temperature=1.0, top_p=0.9, seed=5)
    runs = [stream(model, PROMPT, tokenizer=tokenizer, max_new_tokens=6, sampling=setting)
            for _ in range(2)]
    tokens = [[p.token for p in run] for run in runs]
    assert tokens[0] == tokens[1] and runs[0].summary.seed == 5


# --- refusals --------------------------------------------------------------------------------

def test_a_folder_without_a_tokenizer_is_one_line(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(UsageError, match="holds no tokenizer") as error:
        load_tokenizer(tmp_path)
    assert "\n" not in str(error.value)


def test_a_broken_tokenizer_is_one_line(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="cannot load the tokenizer") as error:
        load_tokenizer(tmp_path)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("call, words", [
    (lambda m, t: stream(m, "", tokenizer=t), "prompt is empty"),
    (lambda m, t: stream(m, "   ", tokenizer=t), "prompt is empty"),
    (lambda m, t: stream(m, "hi"), "needs a tokenizer"),
    (lambda m, t: stream(m, [1, 2], stop=["x"]), "stop strings need a tokenizer"),
    (lambda m, t: stream(m, [1, 512]), "outside the vocabulary"),
    (lambda m, t: stream(m, [1, -1]), "outside the vocabulary"),
    (lambda m, t: stream(m, [], tokenizer=t), "empty"),
    (lambda m, t: stream(m, "hi", tokenizer=t, max_new_tokens=0), "max_new_tokens"),
    (lambda m, t: stream(m, "hi there", tokenizer=t, context=3), "context is 3"),
    (lambda m, t: stream(m, [1, 2], chat=True), "chat needs a text prompt"),
])
def test_bad_generation_input_is_one_line(model, tokenizer, call, words):
    with pytest.raises(GdnFxError) as error:
        call(model, tokenizer)
    assert words in str(error.value) and "\n" not in str(error.value)


def test_chat_without_a_template_is_refused(tokenizer):
    plain = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(
        tokenizer.backend_tokenizer.to_str()))
    assert DEMO_CHAT_TEMPLATE  # the demo has one; this copy of its vocabulary has none
    with pytest.raises(UsageError, match="no chat template"):
        prompt_ids(plain, "hi", chat=True)


# --- end to end: a text prompt in tract ------------------------------------------------------

@pytest.fixture(scope="module")
def exported(demo_nnef):
    """The demo checkpoint exported generation-ready by the command (conftest.py's, ~20 s
    once a session), which carries the tokenizer beside it (X.text)."""
    from gdn_fx.hf.generator import GeneratorFiles, decode_path

    out = demo_nnef
    assert (out.parent / "demo.text" / "tokenizer.json").is_file()
    decode = decode_path(out)  # none by default: the one graph serves decode
    return GeneratorFiles(out, decode if decode.exists() else None, (), ())


@pytest.mark.slow  # one generation-ready export of the tiny model (~20 s)
def test_a_finished_stream_releases_tract_s_model(tokenizer, exported):
    # what generate --check does before it builds transformers' reference: once released,
    # nothing keeps the Generator (its loaded graph) alive; the summary stays
    import gc
    import weakref

    from gdn_fx.hf.generator import Generator

    generator = Generator(exported.main, exported.decode)
    alive = weakref.ref(generator)
    run = stream(generator, PROMPT, tokenizer=tokenizer, max_new_tokens=4, keep_logits=True)
    del generator
    list(run)
    gc.collect()
    assert alive() is not None  # the run's session still holds it
    run.release()
    gc.collect()
    assert alive() is None and len(run.summary.tokens) == 4 and len(run.logits) == 4


@pytest.mark.slow  # one generation-ready export of the tiny model (~20 s)
def test_tract_generates_from_text_what_transformers_generates(folder, tokenizer, model,
                                                               exported):
    from gdn_fx.hf.generator import Generator

    generator = Generator(exported.main, exported.decode)
    eos = eos_ids(folder)
    for text, chat in ((PROMPT, False), ("Do you get lonely out here? 🙂", True)):
        ids = prompt_ids(tokenizer, text, chat=chat)
        run = stream(generator, text, tokenizer=tokenizer, chat=chat, max_new_tokens=24,
                     eos=eos)
        pieces = list(run)
        want = _hf_greedy(model, ids, 24, eos=eos)
        assert run.summary.prompt == ids
        assert [p.token for p in pieces] == want, (text, chat)
        assert "".join(p.text for p in pieces) == tokenizer.decode(want,
                                                                   skip_special_tokens=True)
        assert run.summary.prefill_s > 0 and run.summary.first_token_s >= run.summary.prefill_s
    sampled = [[p.token for p in generator.stream(PROMPT, tokenizer=tokenizer,
                                                  max_new_tokens=12, sampling=Sampling(
                                                      temperature=0.8, top_k=40, seed=9))]
               for _ in range(2)]
    assert sampled[0] == sampled[1]  # the same seed, the same tokens (the kept States reused)


# --- the command line ------------------------------------------------------------------------

def _cli(argv, capsys, stdin=None, monkeypatch=None):
    from gdn_fx.cli import main

    if stdin is not None:
        import io

        monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
    status = main(["generate", *map(str, argv)])
    out, err = capsys.readouterr()
    return status, out, err


@pytest.mark.slow  # uses the export above
def test_the_command_streams_the_answer_to_a_text_prompt(folder, tokenizer, model, exported,
                                                         capsys, tmp_path, monkeypatch):
    want = _hf_greedy(model, tokenizer(PROMPT)["input_ids"], 16, eos=eos_ids(folder))
    answer = tokenizer.decode(want, skip_special_tokens=True)
    common = ["--nnef", exported.main, "--max-new-tokens", 16]
    status, out, err = _cli([*common, "--model", folder, "--prompt", PROMPT], capsys)
    assert status == 0 and out == answer + "\n"
    assert "tokens/s" in err and "first token after" in err
    (tmp_path / "p.txt").write_text(PROMPT + "\n")
    # no --model: the tokenizer carried beside the export
    assert _cli([*common, "--prompt-file", tmp_path / "p.txt"], capsys)[1] == answer + "\n"
    assert _cli([*common, "--prompt", "-"], capsys, PROMPT + "\n", monkeypatch)[1] == \
        answer + "\n"
    status, out, _ = _cli([*common, "--prompt", PROMPT, "--json"], capsys)
    found = json.loads(out)
    assert status == 0 and found["tokens"] == want and found["text"] == answer
    assert found["finish_reason"] in ("eos", "length") and found["decode_tokens_per_s"] > 0


@pytest.mark.slow  # uses the export above
def test_the_command_checks_a_chat_answer_and_repeats_a_seeded_one(folder, exported, capsys):
    common = ["--nnef", exported.main, "--model", folder, "--max-new-tokens", 12]
    status, _, err = _cli([*common, "--prompt", "Is the light ever dark?", "--chat",
                           "--check"], capsys)
    assert status == 0 and "every token equal" in err and err.rstrip().endswith("OK")
    sampled = ["--prompt", PROMPT, "--temperature", 0.9, "--top-k", 30, "--top-p", 0.9,
               "--min-p", 0.01, "--repetition-penalty", 1.1, "--seed", 4, "--json"]
    first, again = (json.loads(_cli([*common, *sampled], capsys)[1]) for _ in range(2))
    assert first["tokens"] == again["tokens"] and first["seed"] == 4


@pytest.mark.parametrize("argv, words", [
    (["--prompt", "hi", "--temperature", -1], "--temperature must be >= 0"),
    (["--prompt", "hi", "--temperature", 1, "--top-p", 0], "--top-p must be in (0, 1]"),
    (["--prompt", "hi", "--temperature", 1, "--top-p", 1.5], "--top-p must be in (0, 1]"),
    (["--prompt", "hi", "--temperature", 1, "--top-k", -2], "--top-k must be an int >= 0"),
    (["--prompt", "hi", "--temperature", 1, "--min-p", 2], "--min-p must be in [0, 1]"),
    (["--prompt", "hi", "--max-new-tokens", 0], "--max-new-tokens must be >= 1"),
    (["--prompt", "hi", "--max-new-tokens", -5], "--max-new-tokens must be >= 1"),
    (["--prompt", ""], "the prompt is empty"),
    (["--prompt", "hi"], "a text prompt needs a tokenizer"),
    (["--prompt-file", "/nonexistent/p.txt"], "--prompt-file /nonexistent/p.txt"),
    (["--prompt", "hi", "--system", "x"], "--system goes with --chat"),
    (["--prompt", "hi", "--check"], "--check needs the model"),
])
def test_bad_command_lines_are_one_line_and_status_2(argv, words, capsys, tmp_path):
    status, out, err = _cli(["--nnef", tmp_path / "none.nnef.tgz", *argv], capsys)
    assert status == 2 and words in err and err.count("\n") == 1 and out == ""


def test_a_text_prompt_and_a_folder_without_a_tokenizer(capsys, tmp_path, folder):
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        (bare / name).write_bytes((folder / name).read_bytes())
    status, out, err = _cli(["--nnef", tmp_path / "x.nnef.tgz", "--model", bare,
                             "--prompt", "hi"], capsys)
    assert status == 2 and "holds no tokenizer" in err and err.count("\n") == 1 and out == ""


def test_a_missing_nnef_is_one_line(capsys, tmp_path, folder):
    status, out, err = _cli(["--nnef", tmp_path / "none.nnef.tgz", "--model", folder,
                             "--prompt", "hi"], capsys)
    assert status == 2 and "does not exist" in err and err.count("\n") == 1 and out == ""


def test_the_text_files_are_carried_beside_an_export(folder, tmp_path):
    nnef = tmp_path / "m.nnef.tgz"
    carried = save_text_files(folder, nnef)
    assert carried == tmp_path / "m.text"
    assert {p.name for p in carried.iterdir()} == {
        "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
        "chat_template.jinja"}  # no weights
    tokenizer = load_tokenizer(carried)
    assert tokenizer.decode(tokenizer("日本 🌟")["input_ids"]) == "日本 🌟"
    assert eos_ids(carried) == [2, 4] and save_text_files(tmp_path, nnef) is None
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_a_fitted_demo_model_learns_the_corpus(tmp_path):
    from gdn_fx.demo_text import train_on_corpus

    tokenizer = demo_tokenizer()
    model = tiny_model("qwen3_5", vocab_size=len(tokenizer))
    window = torch.tensor([tokenizer(demo_corpus())["input_ids"][:64]])
    with torch.no_grad():
        before = float(model(input_ids=window, labels=window).loss)
    train_on_corpus(model, tokenizer, steps=8)
    with torch.no_grad():
        after = float(model(input_ids=window, labels=window).loss)
    assert after < before - 0.5, (before, after)


def test_a_truncated_nnef_is_one_line(capsys, tmp_path, folder):
    cut = tmp_path / "cut.nnef.tgz"
    cut.write_bytes(b"\x1f\x8b" + b"not a whole archive" * 10)
    status, out, err = _cli(["--nnef", cut, "--model", folder, "--prompt", "hi"], capsys)
    assert status == 2 and "tract cannot load" in err and err.count("\n") == 1 and out == ""
