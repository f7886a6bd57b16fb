"""``gdn-fx generate`` honours the checkpoint as transformers' ``generate`` does (issue 54):
its EOS ids, its context, its sampling defaults, the prompt text as given; Ctrl-C, files
that are not generation-ready exports and tract's errors end in one clean line.

Each case runs on the ids path (``--prompt-ids``, "tokens: ..." out) and the text path
(``--prompt``, ``--json``). Expected tokens come from transformers' own ``generate`` on a
checkpoint folder whose generation_config.json / config.json the test writes, loaded by
``AutoModelForCausalLM.from_pretrained`` (so transformers reads the same files); expected
distributions from transformers' logits processors (the ``scores`` its ``generate``
returns); never from gdn_fx. One export of the demo checkpoint serves the module.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from gdn_fx.cli import main

PROMPT = "The keeper of the north light"
# a sampling checkpoint, as Qwen's generation_config.json are (do_sample true, ...)
SAMPLING = {"do_sample": True, "temperature": 0.7, "top_k": 20, "top_p": 0.8,
            "repetition_penalty": 1.3}


# folder (the demo checkpoint), tokenizer (transformers') and demo_nnef (its generation-ready
# export by the command): conftest.py's, shared with test_text.py


@pytest.fixture(scope="module")
def nnef(demo_nnef):
    return demo_nnef


def variant(base: Path, where: Path, generation: dict = None, config: dict = None) -> Path:
    """A copy of the checkpoint ``base`` at ``where`` with generation_config.json (replaced
    by ``generation`` plus the base's EOS and pad ids, unless given) and config.json
    (updated with ``config``) as the test wants them."""
    shutil.copytree(base, where)
    if generation is not None:
        values = {"bos_token_id": 1, "eos_token_id": [2, 4], "pad_token_id": 0, **generation}
        (where / "generation_config.json").write_text(json.dumps(values))
    if config:
        values = json.loads((where / "config.json").read_text())
        values.update(config)
        (where / "config.json").write_text(json.dumps(values))
    return where


def hf_generate(checkpoint: Path, ids: list, count: int, **kwargs) -> list:
    """The new tokens of transformers' generate on the checkpoint as it loads it (its
    generation_config.json), ``kwargs`` as a user would pass them."""
    model = AutoModelForCausalLM.from_pretrained(str(checkpoint)).eval()
    prompt = torch.tensor([ids])
    torch.manual_seed(0)
    with torch.no_grad():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt),
                             max_new_tokens=count, **kwargs)
    return out[0, len(ids):].tolist()


def cli(capsys, *argv):
    status = main(["generate", *map(str, argv)])
    out, err = capsys.readouterr()
    return status, out, err


def refused(capsys, *argv) -> str:
    """The one stderr line of a refusal (status 2, nothing on stdout, no traceback)."""
    status, out, err = cli(capsys, *argv)
    lines = [line for line in err.splitlines() if line.strip()]
    assert status == 2 and len(lines) == 1 and out == "", (status, out, err)
    assert lines[0].startswith("gdn-fx: ") and "Traceback" not in err
    return lines[0]


def ids_of(out: str) -> list:
    line = next(line for line in out.splitlines() if line.startswith("tokens: "))
    return [int(t) for t in line[len("tokens: "):].split(",") if t]


def ids_text(ids) -> str:
    return ",".join(map(str, ids))


# --- 1. the EOS ids of generation_config.json -------------------------------------------------

@pytest.mark.slow  # one generation-ready export (~10 s), shared by the module
def test_the_eos_ids_of_generation_config_end_every_path(folder, tokenizer, nnef, tmp_path,
                                                         capsys):
    ids = tokenizer(PROMPT)["input_ids"]
    free = hf_generate(folder, ids, 24, eos_token_id=None)
    eos = next(t for t in free[3:] if t not in (2, 4))  # a token generation meets
    stop_at = free.index(eos)
    checkpoint = variant(folder, tmp_path / "eos", {"eos_token_id": [eos]})
    want = hf_generate(checkpoint, ids, 24)  # transformers reads the EOS from the file
    assert want == free[:stop_at + 1] and len(want) < 24
    common = ["--nnef", nnef, "--max-new-tokens", 24, "--model", checkpoint]
    status, out, err = cli(capsys, *common, "--prompt-ids", ids_text(ids))  # the ids path
    assert status == 0 and ids_of(out) == want and "ended by eos" in out
    status, out, err = cli(capsys, *common, "--prompt", PROMPT)  # the text path
    assert status == 0 and out == tokenizer.decode(want, skip_special_tokens=True) + "\n"
    assert "ended by eos" in err
    found = json.loads(cli(capsys, *common, "--prompt", PROMPT, "--json")[1])
    assert found["tokens"] == want and found["finish_reason"] == "eos"
    # without --model: the files the export carries beside it (X.text) say the same
    alone = tmp_path / "alone" / "m.nnef.tgz"
    alone.parent.mkdir()
    shutil.copy(nnef, alone)
    variant(checkpoint, tmp_path / "alone" / "m.text")
    status, out, _ = cli(capsys, "--nnef", alone, "--max-new-tokens", 24, "--prompt-ids",
                         ids_text(ids))
    assert status == 0 and ids_of(out) == want


# --- 2, 3. the context --------------------------------------------------------------------

@pytest.mark.slow  # uses the export
def test_a_prompt_longer_than_the_context_is_refused_on_every_path(folder, tokenizer, nnef,
                                                                   tmp_path, capsys):
    checkpoint = variant(folder, tmp_path / "c40", config={"max_position_embeddings": 40})
    long_ids = [5] * 50
    text = "The keeper lit the lamp. " * 8
    assert len(tokenizer(text)["input_ids"]) > 40
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(f"{PROMPT}\n{text}\n")
    common = ["--nnef", nnef, "--model", checkpoint, "--max-new-tokens", 4]
    for argv in (["--prompt-ids", ids_text(long_ids)],
                 ["--prompt-ids", ids_text(long_ids), "--json"],
                 ["--prompt", text], ["--prompt", text, "--json"],
                 ["--prompts-file", prompts]):
        line = refused(capsys, *common, *argv)
        assert "the model's context is 40" in line and "tokens" in line, argv
    assert "prompt 1 of --prompts-file" in refused(capsys, *common, "--prompts-file", prompts)


@pytest.mark.slow  # uses the export
def test_an_answer_cut_by_the_context_says_so(folder, tokenizer, nnef, tmp_path, capsys):
    checkpoint = variant(folder, tmp_path / "c40", {"eos_token_id": []},  # no EOS: it runs on
                         config={"max_position_embeddings": 40})
    text = next(t for t in ("The keeper lit the lamp. " * n for n in range(1, 9))
                if len(tokenizer(t)["input_ids"]) > 25)
    ids = tokenizer(text)["input_ids"]
    room = 40 - len(ids)
    assert 0 < room < 20
    want = hf_generate(checkpoint, ids, 20)[:room]  # transformers runs past the context
    common = ["--nnef", nnef, "--model", checkpoint, "--max-new-tokens", 20]
    status, out, _ = cli(capsys, *common, "--prompt-ids", ids_text(ids))
    assert status == 0 and ids_of(out) == want
    assert (f"cut by the context: the prompt's {len(ids)} tokens and {room} new fill the "
            "model's 40 (max_position_embeddings); 20 were asked") in out
    found = json.loads(cli(capsys, *common, "--prompt-ids", ids_text(ids), "--json")[1])
    assert found["finish_reason"] == "context" and found["tokens"] == want
    status, out, err = cli(capsys, *common, "--prompt", text)
    assert status == 0 and out == tokenizer.decode(want, skip_special_tokens=True) + "\n"
    assert "cut by the context" in err
    # asked for no more than fits: ended by length, as before
    status, out, _ = cli(capsys, *common[:-1], room, "--prompt-ids", ids_text(ids))
    assert status == 0 and ids_of(out) == want and "ended by length" in out


# --- 4. the prompt text as given ------------------------------------------------------------

@pytest.mark.slow  # uses the export
def test_a_final_newline_of_the_prompt_reaches_the_tokenizer(folder, tokenizer, nnef, capsys):
    text = "The keeper of the north light\n"
    want_ids = tokenizer(text)["input_ids"]
    assert want_ids != tokenizer(text[:-1])["input_ids"]  # the newline is a token of its own
    status, out, _ = cli(capsys, "--nnef", nnef, "--model", folder, "--prompt", text, "--json",
                         "--max-new-tokens", 6)
    found = json.loads(out)
    assert status == 0 and found["prompt"] == want_ids
    assert found["tokens"] == hf_generate(folder, want_ids, 6)[:len(found["tokens"])]
    # a chat prompt's text too: the template gets it whole
    chat = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                         add_generation_prompt=True, tokenize=True)
    chat = list(chat["input_ids"] if hasattr(chat, "keys") else chat)
    status, out, _ = cli(capsys, "--nnef", nnef, "--model", folder, "--prompt", text, "--chat",
                         "--json", "--max-new-tokens", 2)
    assert status == 0 and json.loads(out)["prompt"] == chat


# --- 5. the checkpoint's sampling -------------------------------------------------------------

CASES = [  # (generation_config.json, gdn_fx.runtime.sampling.resolve's flags, transformers' kwargs)
    (SAMPLING, {}, {}),
    ({"do_sample": True}, {}, {}),  # transformers' defaults: temperature 1, top_k 50
    ({"do_sample": True, "temperature": 0.6, "top_p": 0.95, "min_p": 0.05}, {}, {}),
    ({"do_sample": False, "temperature": 0.7, "top_k": 5, "repetition_penalty": 1.5}, {},
     {}),  # greedy: the penalty applies, the warpers do not
    ({}, {}, {}),
    (SAMPLING, {"temperature": 1.3, "top_k": 0}, {"temperature": 1.3, "top_k": 0}),
    (SAMPLING, {"greedy": True}, {"do_sample": False}),
    (SAMPLING, {"repetition_penalty": 1.0, "top_p": 0.5}, {"repetition_penalty": 1.0,
                                                           "top_p": 0.5}),
    ({"repetition_penalty": 1.2}, {"temperature": 0.9}, {"do_sample": True,
                                                         "temperature": 0.9}),
    ({"do_sample": True, "top_k": 3}, {"temperature": 0}, {"do_sample": False}),
]


@pytest.mark.parametrize("config, flags, kwargs", CASES, ids=lambda v: json.dumps(v))
def test_the_checkpoint_s_sampling_transforms_logits_as_transformers(folder, config, flags,
                                                                     kwargs):
    # every step of transformers' generate (the model's generation_config set from the
    # file's values): its processed scores against gdn_fx's on the same raw logits
    from gdn_fx.runtime.sampling import process, resolve

    model = AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    model.generation_config = GenerationConfig(**config, pad_token_id=0)
    prompt = torch.tensor([[5, 9, 9, 17, 5, 30, 9, 17]])
    torch.manual_seed(1)
    with torch.no_grad():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8,
                             min_new_tokens=8, eos_token_id=None, output_scores=True,
                             output_logits=True, return_dict_in_generate=True, **kwargs)
    sampling = resolve(config, **flags).sampling
    for step, (raw, scores) in enumerate(zip(out.logits, out.scores)):
        context = out.sequences[0, :prompt.shape[1] + step].tolist()
        got = torch.from_numpy(process(raw[0].numpy(), context, sampling))
        want = scores[0]
        assert torch.equal(torch.isinf(got), torch.isinf(want)), (config, flags, step)
        assert torch.allclose(torch.softmax(got, -1), torch.softmax(want, -1), atol=1e-6,
                              rtol=0), (config, flags, step)


@pytest.mark.slow  # uses the export
def test_greedy_asked_of_a_sampling_checkpoint_is_transformers_greedy(folder, tokenizer, nnef,
                                                                      tmp_path, capsys):
    # a penalty below 1 (repeats favoured): this random model repeats nothing in 16 tokens,
    # so a penalty above 1 would change nothing the test could see
    checkpoint = variant(folder, tmp_path / "sampled", {**SAMPLING, "repetition_penalty": 0.7})
    ids = tokenizer(PROMPT)["input_ids"]
    want = hf_generate(checkpoint, ids, 16, do_sample=False)  # the file's penalty applies
    plain = hf_generate(checkpoint, ids, 16, do_sample=False, repetition_penalty=1.0)
    assert want != plain  # the penalty matters on this model: the test can tell
    common = ["--nnef", nnef, "--model", checkpoint, "--max-new-tokens", 16, "--greedy"]
    status, out, err = cli(capsys, *common, "--prompt-ids", ids_text(ids))
    assert status == 0 and ids_of(out) == want
    line = next(line for line in err.splitlines() if line.startswith("[sampling]"))
    assert line == ("[sampling] greedy (--greedy): repetition_penalty 0.7 "
                    "(sampled/generation_config.json)")
    status, out, err = cli(capsys, *common, "--prompt", PROMPT, "--json")
    assert status == 0 and json.loads(out)["tokens"] == want
    # --repetition-penalty 1 overrides the file: transformers' plain greedy
    status, out, _ = cli(capsys, *common, "--prompt-ids", ids_text(ids),
                         "--repetition-penalty", 1, "--json")
    assert status == 0 and json.loads(out)["tokens"] == plain


@pytest.mark.slow  # uses the export
def test_the_run_says_which_sampling_it_uses(folder, tokenizer, nnef, tmp_path, capsys):
    checkpoint = variant(folder, tmp_path / "sampled", SAMPLING)
    ids = ids_text(tokenizer(PROMPT)["input_ids"])
    common = ["--nnef", nnef, "--model", checkpoint, "--max-new-tokens", 6]

    def said(*argv):
        status, out, err = cli(capsys, *common, *argv)
        assert status == 0, err
        return out, next(line for line in err.splitlines() if line.startswith("[sampling]"))

    source = "(sampled/generation_config.json)"
    for path in (["--prompt-ids", ids], ["--prompt", PROMPT]):
        _, line = said(*path)
        assert line.startswith(f"[sampling] sampling (sampled/generation_config.json: "
                               f"do_sample true): temperature 0.7 {source}, top_k 20 "
                               f"{source}, top_p 0.8 {source}, repetition_penalty 1.3 "
                               f"{source}; seed ") and line.endswith(" (drawn)")
        seed = int(line.split("; seed ")[1].split()[0])
        # the seed said replays the run
        again = said(*path, "--seed", seed, "--json")[0]
        assert json.loads(again)["seed"] == seed
        assert json.loads(said(*path, "--seed", seed, "--json")[0])["tokens"] == \
            json.loads(again)["tokens"]
    _, line = said("--prompt-ids", ids, "--temperature", 1.2, "--top-k", 0, "--seed", 3)
    assert line == (f"[sampling] sampling (--temperature): temperature 1.2 (--temperature), "
                    f"top_p 0.8 {source}, repetition_penalty 1.3 {source}; seed 3")
    # no checkpoint (token ids, no folder beside the export): greedy, and it says so
    bare = tmp_path / "bare" / "m.nnef.tgz"
    bare.parent.mkdir()
    shutil.copy(nnef, bare)
    status, out, err = cli(capsys, "--nnef", bare, "--prompt-ids", ids, "--max-new-tokens", 3)
    assert status == 0 and "[sampling] greedy (the default: no checkpoint's " \
        "generation_config.json)" in err


@pytest.mark.slow  # uses the export
def test_check_runs_plain_greedy_on_a_sampling_checkpoint(folder, tokenizer, nnef, tmp_path,
                                                          capsys):
    checkpoint = variant(folder, tmp_path / "sampled", SAMPLING)
    ids = tokenizer(PROMPT)["input_ids"]
    common = ["--nnef", nnef, "--model", checkpoint, "--max-new-tokens", 8, "--check"]
    status, out, err = cli(capsys, *common, "--prompt-ids", ids_text(ids))
    assert status == 0 and "every token equal" in out and out.rstrip().endswith("OK")
    assert "[sampling] greedy (--check compares plain greedy generation with transformers'; " \
        "the checkpoint's sampled/generation_config.json is not used)" in err
    status, _, err = cli(capsys, *common, "--prompt", PROMPT)
    assert status == 0 and "every token equal" in err and err.rstrip().endswith("OK")


# --- 6. Ctrl-C --------------------------------------------------------------------------------

def _interrupt_after(monkeypatch, count: int) -> None:
    """Ctrl-C as the ``count``-th decode call starts (the tokens before it are chosen)."""
    from gdn_fx.runtime import streaming

    calls = []
    step = streaming.TractSession.next

    def next_or_interrupt(self, token):
        calls.append(token)
        if len(calls) == count:
            raise KeyboardInterrupt
        return step(self, token)

    monkeypatch.setattr(streaming.TractSession, "next", next_or_interrupt)


@pytest.mark.slow  # uses the export
def test_ctrl_c_prints_the_answer_so_far_and_exits_130(folder, tokenizer, nnef, capsys,
                                                       monkeypatch):
    ids = tokenizer(PROMPT)["input_ids"]
    want = hf_generate(folder, ids, 4, eos_token_id=None)
    common = ["--nnef", nnef, "--model", folder, "--max-new-tokens", 30]
    _interrupt_after(monkeypatch, 4)  # the 4 tokens before it were chosen
    status, out, err = cli(capsys, *common, "--prompt", PROMPT)
    assert status == 130 and out == tokenizer.decode(want, skip_special_tokens=True) + "\n"
    assert err.splitlines()[-1] == "gdn-fx: interrupted (Ctrl-C) after 4 new tokens"
    assert "Traceback" not in err
    _interrupt_after(monkeypatch, 4)
    status, out, err = cli(capsys, *common, "--prompt-ids", ids_text(ids))
    assert status == 130 and ids_of(out) == want and "Traceback" not in err
    assert err.splitlines()[-1] == "gdn-fx: interrupted (Ctrl-C) after 4 new tokens"
    _interrupt_after(monkeypatch, 4)
    status, out, err = cli(capsys, *common, "--prompt", PROMPT, "--json")
    found = json.loads(out)
    assert status == 130 and found["tokens"] == want
    assert found["finish_reason"] == "interrupted"


def _sigint_default() -> None:
    # A shell without job control starts `cmd &` with SIGINT ignored, and Python then installs
    # no KeyboardInterrupt handler: the child would run all 30000 tokens. A user's terminal
    # delivers SIGINT with its default action, so the child gets that.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.slow  # uses the export; a process of its own (~10 s)
def test_sigint_during_a_stream_is_a_clean_exit(folder, nnef, tmp_path):
    # the real signal, to the command as a user runs it, once the answer is coming
    checkpoint = variant(folder, tmp_path / "long", {"eos_token_id": []})  # nothing ends it
    process = subprocess.Popen(
        [sys.executable, "-m", "gdn_fx.cli", "generate", "--nnef", str(nnef), "--model",
         str(checkpoint), "--prompt", PROMPT, "--max-new-tokens", "30000"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=_sigint_default)
    first = process.stdout.read(1)  # the answer has begun
    time.sleep(0.3)
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=120)
    err = err.decode()
    assert first and process.returncode == 130, err
    assert err.splitlines()[-1].startswith("gdn-fx: interrupted (Ctrl-C) after ")
    assert "Traceback" not in err and (first + out).endswith(b"\n")


# --- 7. files that are not generation-ready exports -------------------------------------------

ANOTHER_PROGRAM = """version 1.0;

graph g(x) -> (y)
{
  x = external<scalar>(shape = [1, 3]);
  y = relu(x);
}
"""


@pytest.fixture(scope="module")
def one_step(tmp_path_factory):
    """A one-step export with a symbolic sequence and a fixed past (--dynamic-seq): before,
    generate ran it until tract failed (a Python traceback and a Rust backtrace)."""
    out = tmp_path_factory.mktemp("step") / "step.nnef.tgz"
    assert main(["export", "--family", "lfm2", "--seq-len", "2", "--dynamic-seq", "--out",
                 str(out), "--no-check"]) == 0
    return out


@pytest.mark.slow  # one one-step export (~10 s)
def test_a_file_that_is_not_a_generation_ready_export_is_one_line(folder, one_step, tmp_path,
                                                                  capsys):
    other = tmp_path / "other.nnef"
    other.mkdir()
    (other / "graph.nnef").write_text(ANOTHER_PROGRAM)
    for path, words in ((one_step, "a one-step export with a symbolic sequence"),
                        (other, "its first input is x (1,3,f32)")):
        for argv in (["--prompt-ids", "1,2,3"], ["--prompt", PROMPT, "--model", folder]):
            line = refused(capsys, "--nnef", path, *argv)
            assert f"{path} is not a generation-ready export" in line and words in line


def test_tract_failing_on_a_run_is_one_line(tmp_path):
    import tract

    from gdn_fx.errors import ArtifactError
    from gdn_fx.runtime.generator import _run

    class Failing:
        def run(self, inputs):
            raise tract.TractError("Clashing resolution for expression. 4=4 != 6.\n\nStack "
                                   "backtrace:\n   0: <anyhow::Error>::msg")

    graph = type("Graph", (), {"path": tmp_path / "m.nnef.tgz"})()
    with pytest.raises(ArtifactError) as caught:
        _run(Failing(), [], graph)
    assert str(caught.value) == (f"tract fails running {graph.path}: Clashing resolution for "
                                 "expression. 4=4 != 6.")


# --- 8. several prompts for a one-sequence export ---------------------------------------------

@pytest.mark.slow  # uses the export
def test_two_prompts_for_a_one_sequence_export_say_what_serves_several(nnef):
    from gdn_fx.errors import ArtifactMismatch, InputUnsupported
    from gdn_fx.hf.generator import Generator

    generator = Generator(nnef)
    for prompts in ([[5, 6, 7], [8, 9, 10]], torch.tensor([[5, 6], [7, 8]])):
        with pytest.raises(InputUnsupported) as caught:
            generator.generate(prompts, 3)
        text = str(caught.value)
        assert f"for {nnef}, a one-sequence export" in text and "one sequence per call" in text
        assert "`gdn-fx export --batch N`" in text and "\n" not in text
    with pytest.raises(ArtifactMismatch, match="is the main graph itself: leave it out"):
        Generator(nnef, nnef)  # the one graph named as its own decode graph


# --- 9, 10. one line: diff of a file that is not a zip, tract's root cause --------------------

def test_diff_of_a_pt2_that_is_not_a_zip_prints_one_line(tmp_path):
    # a process of its own: torch logs its failed read through logging, which capsys may
    # not see (the handler keeps the stderr it was made with)
    bad = tmp_path / "a.pt2"
    bad.write_bytes(b"not a zip")
    done = subprocess.run([sys.executable, "-m", "gdn_fx.cli", "diff", str(bad), str(bad)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.splitlines() == [
        f"gdn-fx: UnsupportedProgram: {bad} is not a saved program (.pt2) or an NNEF export "
        "(folder, .nnef.tar, .nnef.tgz): not a zip archive, as torch.export.save writes one"]


def test_diff_of_a_zip_that_is_not_a_program_prints_one_line_with_torch_s_reason(tmp_path,
                                                                                 capsys):
    import zipfile

    bad = tmp_path / "z.pt2"
    with zipfile.ZipFile(bad, "w") as archive:
        archive.writestr("x.txt", "hello")
    assert main(["diff", str(bad), str(bad)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1
    assert "is not a saved program" in err and "see the warnings above" not in err.lower()
    assert "check the warnings above" not in err


BROKEN = """version 1.0;

graph g(input) -> (output)
{
  input = external<scalar>(shape = [1, 3]);
  r = reshape(input, shape = [2, 7]);
  output = add(input, r);
}
"""


def test_tract_s_root_cause_reaches_the_one_line(tmp_path, capsys):
    import tract

    from gdn_fx.tract_check import error_text

    broken = tmp_path / "broken.nnef"
    broken.mkdir()
    (broken / "graph.nnef").write_text(BROKEN)
    with pytest.raises(tract.TractError) as caught:
        tract.nnef().with_tract_transformers().load(str(broken))
    causes = [" ".join(line.split()) for line in
              str(caught.value).split("Stack backtrace")[0].splitlines()
              if line.strip() and line.strip() != "Caused by:"]
    root = causes[-1]
    assert root.endswith("3 should be equal to 14") and len(causes) > 5
    assert error_text(caught.value) == " / ".join(causes)  # short enough: whole
    for limit in (60, 150, 250):  # cut: the root kept whole, whole causes before it
        short = error_text(caught.value, limit)
        parts = short.split(" / ")
        assert parts[-1] == root and "..." in parts and len(short) <= max(limit, len(root) + 60)
        head = parts[0].removesuffix(" ...")  # the first line, cut at a space if it is long
        assert causes[0].startswith(head) and len(head) >= min(40, len(causes[0]))
        assert all(part in causes or part == "..." for part in parts[1:])
    for argv in (["--prompt-ids", "1,2"], ["--prompt-ids", "1,2", "--json"]):
        line = refused(capsys, "--nnef", broken, *argv)
        assert "tract cannot load" in line and line.endswith(root)


# --- 11. the length of generation_config.json -----------------------------------------------
# transformers' generate: max_new_tokens, else max_length (the prompt and the answer
# together; a prompt as long is refused), else its default max_length of 20 counted from the
# end of the prompt; max_new_tokens wins when both are set. The flag overrides the file.

def hf_generate_as_loaded(checkpoint: Path, ids: list, **kwargs) -> list:
    """The new tokens of transformers' generate with the lengths the checkpoint's files give
    (no max_new_tokens passed unless ``kwargs`` says)."""
    model = AutoModelForCausalLM.from_pretrained(str(checkpoint)).eval()
    prompt = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), **kwargs)
    return out[0, len(ids):].tolist()


def said_length(err: str) -> str:
    return next(line for line in err.splitlines() if line.startswith("[length] "))


@pytest.mark.slow  # uses the export
def test_the_length_of_generation_config_is_transformers_on_every_path(folder, tokenizer,
                                                                       nnef, tmp_path, capsys):
    ids = tokenizer(PROMPT)["input_ids"]
    cases = [  # (generation_config.json's lengths, flags, transformers' kwargs, new tokens, line)
        ({"max_new_tokens": 6}, [], {}, 6, "max_new_tokens 6 from g0/generation_config.json"),
        ({"max_length": len(ids) + 5}, [], {}, 5,
         f"max_length {len(ids) + 5} from g1/generation_config.json (the prompt's {len(ids)} "
         "tokens and 5 new)"),
        ({"max_new_tokens": 4, "max_length": len(ids) + 9}, [], {}, 4,
         "max_new_tokens 4 from g2/generation_config.json (its max_length "
         f"{len(ids) + 9} is not used: max_new_tokens wins, as in transformers)"),
        ({}, [], {}, 20, "max_new_tokens 20: transformers' default (g3/generation_config.json "
         "sets neither max_new_tokens nor max_length)"),
        ({"max_new_tokens": 6}, ["--max-new-tokens", 3], {"max_new_tokens": 3}, 3,
         "max_new_tokens 3 from --max-new-tokens (overrides g4/generation_config.json's "
         "max_new_tokens 6)"),
    ]
    for index, (lengths, flags, kwargs, count, line) in enumerate(cases):
        checkpoint = variant(folder, tmp_path / f"g{index}", {"eos_token_id": [], **lengths})
        want = hf_generate_as_loaded(checkpoint, ids, **kwargs)
        assert len(want) == count, (lengths, want)  # nothing else ends it: the length shows
        common = ["--nnef", nnef, "--model", checkpoint, *flags]
        status, out, err = cli(capsys, *common, "--prompt-ids", ids_text(ids))  # the ids path
        assert status == 0 and ids_of(out) == want, (lengths, flags)
        assert said_length(err) == f"[length] {line}"
        status, out, err = cli(capsys, *common, "--prompt", PROMPT, "--json")  # the text path
        assert status == 0 and json.loads(out)["tokens"] == want, (lengths, flags)
        assert said_length(err) == f"[length] {line}"
    # without --model: the files carried beside the export (X.text) say the same
    alone = tmp_path / "alone" / "m.nnef.tgz"
    alone.parent.mkdir()
    shutil.copy(nnef, alone)
    variant(tmp_path / "g0", tmp_path / "alone" / "m.text")
    status, out, err = cli(capsys, "--nnef", alone, "--prompt-ids", ids_text(ids))
    assert status == 0 and len(ids_of(out)) == 6
    assert said_length(err) == "[length] max_new_tokens 6 from m.text/generation_config.json"


@pytest.mark.slow  # uses the export
def test_max_length_counts_each_prompt_and_refuses_one_that_fills_it(folder, tokenizer, nnef,
                                                                     tmp_path, capsys):
    short, long = "The keeper", PROMPT
    lengths = [len(tokenizer(text)["input_ids"]) for text in (short, long)]
    assert lengths[0] < lengths[1]
    total = lengths[1] + 3
    checkpoint = variant(folder, tmp_path / "ml", {"eos_token_id": [], "max_length": total})
    want = [hf_generate_as_loaded(checkpoint, tokenizer(text)["input_ids"])
            for text in (short, long)]
    assert [len(w) for w in want] == [total - n for n in lengths]
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(f"{short}\n{long}\n")
    status, out, err = cli(capsys, "--nnef", nnef, "--model", checkpoint, "--prompts-file",
                           prompts, "--json")
    assert status == 0 and [json.loads(line)["tokens"] for line in out.splitlines()] == want
    assert said_length(err) == (f"[length] max_length {total} from ml/generation_config.json "
                                "(the prompt and the answer together)")
    # a prompt as long as max_length: transformers refuses it, and so does every path
    ids = tokenizer(long)["input_ids"]
    tight = variant(folder, tmp_path / "tight", {"max_length": len(ids)})
    with pytest.raises(ValueError, match="max_length"):
        hf_generate_as_loaded(tight, ids)
    capsys.readouterr()  # transformers' loading bar
    for argv in (["--prompt-ids", ids_text(ids)], ["--prompt", long, "--json"],
                 ["--prompts-file", prompts]):
        line = refused(capsys, "--nnef", nnef, "--model", tight, *argv)
        assert (f"is {len(ids)} tokens, and max_length {len(ids)} (tight/generation_config."
                "json) counts the prompt and the answer") in line, argv
    assert "prompt 1 of --prompts-file" in refused(capsys, "--nnef", nnef, "--model", tight,
                                                   "--prompts-file", prompts)


def test_generation_length_reads_what_transformers_reads(tmp_path):
    """gdn_fx.runtime.text.generation_length on its own: config.json's lengths where the
    folder has no generation_config.json (transformers then builds its generation config
    from config.json), values that are not an int >= 1 refused in one line."""
    from gdn_fx.errors import CheckpointError, UsageError
    from gdn_fx.runtime.text import DEFAULT_NEW_TOKENS, generation_length

    assert DEFAULT_NEW_TOKENS == GenerationConfig()._get_default_generation_params()[
        "max_length"]
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen3_5",
                                                    "text_config": {"max_length": 12}}))
    length = generation_length(folder)
    assert (length.max_new_tokens, length.max_length, length.source) == (
        None, 12, "ckpt/config.json")
    assert length.new_tokens(5) == 7
    with pytest.raises(UsageError, match="the prompt is 12 tokens, and max_length 12"):
        length.new_tokens(12)
    assert generation_length(None).line() == (
        "max_new_tokens 20: transformers' default (no checkpoint's generation_config.json)")
    assert generation_length(None, 7).new_tokens(100) == 7
    for bad in (0, -1, 2.5, "6", True):
        (folder / "generation_config.json").write_text(json.dumps({"max_new_tokens": bad}))
        with pytest.raises(CheckpointError, match="ckpt/generation_config.json: "
                           "max_new_tokens must be an int >= 1"):
            generation_length(folder)
    with pytest.raises(UsageError, match="--max-new-tokens must be an int >= 1"):
        generation_length(None, 0, given_as="--max-new-tokens")
