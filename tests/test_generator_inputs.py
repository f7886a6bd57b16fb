"""Nothing reaches tract unchecked: the Generator (and ``gdn-fx generate``) refuses, in one
line, a decode graph from another export and every input tract would fail or panic on.

Before this, prompt ids outside the vocabulary made tract's ``gather`` panic and abort the
process (status -6), ``-1`` read the last embedding row, two prompts gave a TractError about
facts, and a decode graph of other weights generated other tokens with status 0. Expected
values come from the tiny config (its vocabulary), from transformers' own ``generate``, or
from the files as the test changes them, never from the Generator.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tarfile
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from gdn_fx import tract_check
from gdn_fx.cli import main
from gdn_fx.errors import (ArtifactError, ArtifactMismatch, GdnFxError, InputUnsupported,
                           MissingFile, UsageError)
from gdn_fx.hf import tiny_model
from gdn_fx.hf.configs import VOCAB
from gdn_fx.hf.generator import Generator, UnverifiedPair, decode_path, export_generator
from gdn_fx.hf.nnef import fingerprint
from gdn_fx.lowering.t2n.unused_inputs import rewrite_graph_file

pytestmark = pytest.mark.slow  # module fixtures export whole models (make test-fast skips them)

FAMILY = "lfm2"  # the fastest tiny family to export; attention caches (P) and conv states
_STAMPS = re.compile(r',\s*\("gdn_fx_(fingerprint|vocab|decode)", "[^"]*"\)')


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    """(model, GeneratorFiles) of one tiny export, main and decode graph, built once."""
    model = tiny_model(FAMILY)
    files = export_generator(model, tmp_path_factory.mktemp("gen") / "m.nnef.tgz",
                             decode=True)
    assert files.decode is not None, files.decode_note
    return model, files


@pytest.fixture(scope="module")
def generators(export):
    """One Generator per prefill chunk the property test feeds the prompt in."""
    _, files = export
    return {chunk: Generator(files.main, files.decode, prefill_chunk=chunk)
            for chunk in (None, 1, 2)}


def copy_export(files, folder: Path, name: str = "c") -> Path:
    """The pair copied to ``folder`` under ``name``; returns the main graph's path."""
    folder.mkdir(parents=True, exist_ok=True)
    main = folder / f"{name}.nnef.tgz"
    shutil.copy(files.main, main)
    shutil.copy(files.decode, decode_path(main))
    return main


def unstamped(path: Path) -> Path:
    """``path`` rewritten without gdn-fx's export stamps: an export as written before them."""
    rewrite_graph_file(path, lambda text: _STAMPS.sub("", text))
    assert "gdn_fx_fingerprint" not in tract_check.nnef_text(path)
    return path


def hf_tokens(model, prompt: list, count: int) -> list:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=count,
                             min_new_tokens=count, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    return out[0, len(prompt):].tolist()


# --- the property: every call generates or raises one line ---------------------------------

GOOD = st.integers(0, VOCAB - 1)
BAD = st.one_of(st.sampled_from([-1, VOCAB, VOCAB + 1, -2 ** 63, 2 ** 63 - 1]),
                st.integers(max_value=-1), st.integers(min_value=VOCAB))  # beyond int64 too
TOKEN = st.one_of(GOOD, BAD)
# most prompts valid, some with one bad id at some position; sometimes a second prompt
CORRUPTION = st.one_of(st.none(), st.none(), st.tuples(st.integers(0, 4), BAD))
SECOND = st.one_of(st.none(), st.none(), st.lists(GOOD, min_size=1, max_size=3))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prompt=st.lists(GOOD, max_size=5), corruption=CORRUPTION, second=SECOND,
       nested=st.booleans(), new_tokens=st.one_of(st.integers(1, 3), st.integers(-1, 0)),
       chunk=st.sampled_from([None, 1, 2]))
def test_generate_either_generates_or_refuses_in_one_line(export, generators, prompt,
                                                          corruption, second, nested,
                                                          new_tokens, chunk):
    model, _ = export
    generator = generators[chunk]
    if corruption is not None and prompt:
        position, value = corruption
        prompt = [*prompt[:position], value, *prompt[position + 1:]][:5]
    batched = second is not None
    given_ids = [prompt, second] if batched else [prompt] if nested else prompt
    valid = (not batched and prompt and all(0 <= t < VOCAB for t in prompt)
             and new_tokens >= 1)
    event("generates" if valid else "refused")  # --hypothesis-show-statistics counts them
    if valid:
        result = generator.generate(given_ids, new_tokens)
        assert result.tokens == hf_tokens(model, prompt, new_tokens)
        return
    with pytest.raises(GdnFxError) as caught:
        generator.generate(given_ids, new_tokens)
    assert "\n" not in str(caught.value) and str(caught.value)
    if batched:
        assert isinstance(caught.value, InputUnsupported)
        assert "batching is not supported yet" in str(caught.value)
    else:
        assert isinstance(caught.value, UsageError)


@settings(max_examples=30, deadline=None)
@given(batch=st.integers(1, 2), length=st.integers(0, 3), decode=st.booleans(),
       token=TOKEN.filter(lambda t: -2 ** 63 <= t < 2 ** 63))
def test_a_step_either_runs_or_refuses_in_one_line(generators, batch, length, decode, token):
    # The lower-level call (bench/ and applications use it): ids of any batch and length.
    generator = generators[None]
    state = generator.decode if decode else generator.main
    ids = np.full((batch, length), token, dtype=np.int64)
    valid = batch == 1 and (length == 1 if decode else length >= 1) and 0 <= token < VOCAB
    if valid:
        logits, caches = generator.step(state, ids, generator.zero_states)
        assert logits.shape == (1, VOCAB) and np.isfinite(logits).all()
        return
    with pytest.raises(GdnFxError) as caught:
        generator.step(state, ids, generator.zero_states)
    assert "\n" not in str(caught.value)
    assert isinstance(caught.value, InputUnsupported if batch > 1 else UsageError)


def test_the_reported_crashes_are_refusals(generators):
    generator = generators[None]
    with pytest.raises(UsageError, match=r"prompt id -1 .*outside the vocabulary \[0, 64\)"):
        generator.generate([5, -1, 7], 4)  # read the last embedding row before
    with pytest.raises(UsageError, match=r"prompt id 64 "):
        generator.generate([64], 4)  # tract's gather panicked: status -6
    with pytest.raises(InputUnsupported, match="batching is not supported yet: got 2 prompts"):
        generator.generate([[5, 6], [7, 8]], 4)  # a TractError about facts before
    with pytest.raises(UsageError, match="empty"):
        generator.generate([], 4)
    for count in (0, -3):
        with pytest.raises(UsageError, match="max_new_tokens must be an int >= 1"):
            generator.generate([5], count)
    with pytest.raises(UsageError, match=r"takes 4 caches after input_ids, got 1"):
        generator.step(generator.main, np.array([[5]]), generator.zero_states[:1])


# --- the pair: one export's graphs, or refused ----------------------------------------------

def test_both_graphs_carry_one_fingerprint_of_weights_and_config(export):
    model, files = export
    stamps = [re.search(r'"gdn_fx_fingerprint", "(sha256:[0-9a-f]{64})"',
                        tract_check.nnef_text(p)) for p in (files.main, files.decode)]
    assert all(stamps) and stamps[0].group(1) == stamps[1].group(1)
    # it follows the weights (one value changed), the config and the weight storage
    other = tiny_model(FAMILY)
    assert fingerprint(other) == fingerprint(model)
    with torch.no_grad():
        next(other.parameters()).view(-1)[0] += 1e-3
    assert fingerprint(other) != fingerprint(model)
    assert fingerprint(tiny_model(FAMILY, rms_norm_eps=1e-3)) != fingerprint(model)
    assert fingerprint(model, "q4_0") != fingerprint(model)


def test_the_archive_holds_graph_nnef_first(export):
    # so that the graph text (its properties, its inputs) is read without the weights
    _, files = export
    with tarfile.open(files.main) as archive:
        assert next(iter(archive)).name == "graph.nnef"


def other_fingerprint(path: Path) -> Path:
    """``path`` stamped with another fingerprint than its export's (one digit more)."""
    rewrite_graph_file(path, lambda t: t.replace('"gdn_fx_fingerprint", "sha256:',
                                                 '"gdn_fx_fingerprint", "sha256:0'))
    return path


def test_a_decode_graph_with_another_fingerprint_is_refused(export, tmp_path):
    # (real decode graphs of other models: the slow tests at the end)
    _, files = export
    main = copy_export(files, tmp_path)
    other_fingerprint(decode_path(main))
    with pytest.raises(ArtifactMismatch, match="fingerprints .* differ") as caught:
        Generator(main, decode_path(main))
    assert "\n" not in str(caught.value)


def test_an_unstamped_decode_graph_beside_a_stamped_main_graph_is_refused(export, tmp_path):
    _, files = export
    main = copy_export(files, tmp_path)
    unstamped(decode_path(main))
    with pytest.raises(ArtifactMismatch, match="carries a fingerprint and .* none"):
        Generator(main, decode_path(main))


def test_an_export_without_fingerprints_still_generates_with_a_warning(export, tmp_path):
    # exports before this round carry no fingerprint: shapes checked, then a warning
    model, files = export
    main = copy_export(files, tmp_path)
    for path in (main, decode_path(main)):
        unstamped(path)
    with pytest.warns(UnverifiedPair, match="no fingerprint"):
        generator = Generator(main, decode_path(main))
    assert generator.generate([5, 6, 7], 3).tokens == hf_tokens(model, [5, 6, 7], 3)
    with pytest.raises(UsageError, match="64"):  # no vocab stamp: the logits' width bounds ids
        generator.generate([64], 3)


def test_missing_and_truncated_graphs_are_one_line_errors(export, tmp_path):
    _, files = export
    with pytest.raises(MissingFile, match="does not exist"):
        Generator(tmp_path / "absent.nnef.tgz")
    for keep in (100, files.main.stat().st_size // 2):
        cut = tmp_path / f"cut{keep}.nnef.tgz"
        cut.write_bytes(files.main.read_bytes()[:keep])
        with pytest.raises(ArtifactError, match=f"tract cannot load {cut}") as caught:
            Generator(cut)
        assert "\n" not in str(caught.value) and "Stack backtrace" not in str(caught.value)
    main = copy_export(files, tmp_path / "pair")
    decode = decode_path(main)
    decode.write_bytes(files.decode.read_bytes()[: files.decode.stat().st_size // 2])
    with pytest.raises(ArtifactError, match=f"tract cannot load {decode}"):
        Generator(main, decode)


def test_open_refuses_an_export_whose_decode_graph_is_missing(export, tmp_path):
    model, files = export
    main = tmp_path / "alone.nnef.tgz"
    shutil.copy(files.main, main)
    with pytest.raises(ArtifactError, match="alone.decode.nnef.tgz is missing"):
        Generator.open(main)
    result = Generator.open(main, use_decode=False).generate([5, 6], 3)
    assert result.tokens == hf_tokens(model, [5, 6], 3)


# --- the same through the command ------------------------------------------------------------

def refused(capsys, argv) -> str:
    status = main(argv)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert status == 2, err
    assert len(lines) == 1 and lines[0].startswith("gdn-fx: ") and "Traceback" not in err, err
    return lines[0]


def generate(path, ids="5,6,7", *extra):
    return ["generate", "--nnef", str(path), "--prompt-ids", ids, "--max-new-tokens", "3",
            *extra]


@pytest.mark.parametrize("ids, bad", [("5,64", "64"), ("5,-1", "-1"), ("5,99999999999", "9")])
def test_cli_ids_outside_the_vocabulary(export, capsys, ids, bad):
    line = refused(capsys, generate(export[1].main, ids))
    assert f"prompt id {bad}" in line and "outside the vocabulary [0, 64)" in line


def test_cli_truncated_main_or_decode_graph(export, tmp_path, capsys):
    _, files = export
    cut = tmp_path / "cut.nnef.tgz"
    cut.write_bytes(files.main.read_bytes()[:5000])
    assert "tract cannot load" in refused(capsys, generate(cut))
    pair = copy_export(files, tmp_path / "pair")
    decode_path(pair).write_bytes(files.decode.read_bytes()[:5000])
    line = refused(capsys, generate(pair))
    assert "tract cannot load" in line and str(decode_path(pair)) in line


def test_cli_missing_main_or_decode_graph(export, tmp_path, capsys):
    _, files = export
    assert "does not exist" in refused(capsys, generate(tmp_path / "absent.nnef.tgz"))
    alone = tmp_path / "alone.nnef.tgz"
    shutil.copy(files.main, alone)
    assert "--no-decode" in refused(capsys, generate(alone))
    assert main(generate(alone, "5,6,7", "--no-decode")) == 0
    assert "tokens: " in capsys.readouterr().out


def test_cli_decode_graph_of_another_export(export, tmp_path, capsys):
    _, files = export
    pair = copy_export(files, tmp_path)
    other_fingerprint(decode_path(pair))
    line = refused(capsys, generate(pair))
    assert "ArtifactMismatch" in line and "fingerprints" in line


def test_the_installed_command_does_not_abort_on_ids_outside_the_vocabulary(export):
    # in-process tests cannot see an abort: the command as a user runs it
    done = subprocess.run([sys.executable, "-m", "gdn_fx.cli", *generate(export[1].main,
                                                                         "3,70")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("gdn-fx:")]
    assert lines == ["gdn-fx: UsageError: prompt id 70 (position 1) is outside the "
                     "vocabulary [0, 64)"], done.stderr
    assert "Traceback" not in done.stderr and "panicked" not in done.stderr


# --- other models' decode graphs (two more exports) ------------------------------------------

@pytest.fixture(scope="module")
def others(tmp_path_factory):
    """Exports of the same config with other weights, and of other shapes (4 KV heads)."""
    folder = tmp_path_factory.mktemp("others")
    return (export_generator(tiny_model(FAMILY, seed=1), folder / "seed1.nnef.tgz",
                             decode=True),
            export_generator(tiny_model(FAMILY, num_key_value_heads=4),
                             folder / "kv4.nnef.tgz", decode=True))


@pytest.mark.slow
@pytest.mark.parametrize("which", ["other weights", "other shapes"])
def test_a_decode_graph_of_another_model_is_refused(export, others, tmp_path, capsys, which):
    _, files = export
    other = others[0] if which == "other weights" else others[1]
    pair = copy_export(files, tmp_path)
    shutil.copy(other.decode, decode_path(pair))
    with pytest.raises(ArtifactMismatch, match="fingerprints .* differ"):
        Generator(pair, decode_path(pair))
    assert "ArtifactMismatch" in refused(capsys, generate(pair))
    if which == "other shapes":  # without fingerprints the shapes still refuse it
        for path in (pair, decode_path(pair)):
            unstamped(path)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # refused before any warning
            with pytest.raises(ArtifactMismatch, match=r"key_1 \[1, 4, P, 8\] f32.*"
                               r"\[1, 2, P, 8\] f32: graphs of other shapes"):
                Generator(pair, decode_path(pair))
