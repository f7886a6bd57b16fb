"""The gdn-fx command refuses bad input with one line on stderr and exit status 2.

Every case here is a user error: the refusal must name the bad value, come before any export
work, and never be a traceback.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
import transformers

from gdn_fx import pipeline
from gdn_fx.cli import main
from gdn_fx.hf import configs

# A Llama: attention only, nothing gdn-fx fuses.
LLAMA = dict(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64,
             num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
             pad_token_id=0, bos_token_id=1, eos_token_id=2)


def refused(capsys, argv):
    """Run the command; return its one stderr line (asserting status 2 and one line)."""
    status = main(argv)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert status == 2, err
    assert len(lines) == 1, err
    assert lines[0].startswith("gdn-fx: ") and "Traceback" not in err
    return lines[0]


@pytest.fixture
def no_work(monkeypatch):
    """Fail the test if the command starts building a model (the check came too late)."""
    def built(*args, **kwargs):
        raise AssertionError("the command started work before refusing its arguments")
    monkeypatch.setattr(pipeline, "build_model", built)


def export(*extra):
    return ["export", *extra]


def test_malformed_config(tmp_path, capsys, no_work):
    path = tmp_path / "bad.json"
    path.write_text('{"model_type": "qwen3_5",')
    line = refused(capsys, export("--config", str(path), "--out", str(tmp_path / "m.nnef.tgz")))
    assert str(path) in line and "not valid JSON" in line


def test_empty_config(tmp_path, capsys, no_work):
    path = tmp_path / "empty.json"
    path.write_text("\n")
    line = refused(capsys, export("--config", str(path), "--out", str(tmp_path / "m.nnef.tgz")))
    assert str(path) in line and "empty" in line


def test_missing_config(tmp_path, capsys, no_work):
    path = tmp_path / "absent.json"
    line = refused(capsys, export("--config", str(path), "--out", str(tmp_path / "m.nnef.tgz")))
    assert str(path) in line and "does not exist" in line


def test_config_that_is_not_an_object_or_has_no_known_model_type(tmp_path, capsys, no_work):
    out = str(tmp_path / "m.nnef.tgz")
    listed = tmp_path / "list.json"
    listed.write_text("[1, 2]")
    assert "JSON object" in refused(capsys, export("--config", str(listed), "--out", out))
    untyped = tmp_path / "untyped.json"
    untyped.write_text('{"hidden_size": 32}')
    assert "model_type" in refused(capsys, export("--config", str(untyped), "--out", out))
    unknown = tmp_path / "unknown.json"
    unknown.write_text('{"model_type": "no_such_model"}')
    assert "'no_such_model'" in refused(capsys, export("--config", str(unknown), "--out", out))


def test_unknown_family(tmp_path, capsys, no_work):
    line = refused(capsys, export("--family", "qwen9", "--out", str(tmp_path / "m.nnef.tgz")))
    assert "'qwen9'" in line and "qwen3_5" in line  # the bad name and the known ones


def test_family_the_installed_transformers_lacks(tmp_path, capsys, no_work, monkeypatch):
    spec = configs.FAMILY_SPECS["lara_mini"]
    monkeypatch.setitem(configs.FAMILY_SPECS, "lara_mini",
                        dataclasses.replace(spec, model_class="NoSuchModelForCausalLM"))
    line = refused(capsys, export("--family", "lara_mini", "--out", str(tmp_path / "m.nnef.tgz")))
    assert "'lara_mini'" in line and transformers.__version__ in line


@pytest.mark.parametrize("value", ["0", "-3"])
def test_seq_len_below_one(tmp_path, capsys, no_work, value):
    line = refused(capsys, export("--family", "qwen3_5", "--seq-len", value,
                                  "--out", str(tmp_path / "m.nnef.tgz")))
    assert f"--seq-len must be >= 1, got {value}" in line


@pytest.mark.parametrize("out", ["x.onnx", "model.tgz", "model"])
def test_out_that_is_not_nnef_is_refused_before_export(capsys, no_work, out):
    line = refused(capsys, export("--family", "qwen3_5", "--out", out))
    assert out in line and ".nnef.tgz" in line


def test_demo_out_checked_too(capsys, no_work):
    assert "x.onnx" in refused(capsys, ["demo", "--out", "x.onnx"])


def test_model_folder_without_config(tmp_path, capsys, no_work):
    line = refused(capsys, export("--model", str(tmp_path), "--out", str(tmp_path / "m.nnef")))
    assert str(tmp_path) in line and "config.json" in line


def test_diff_of_missing_files(tmp_path, capsys):
    present = tmp_path / "a.pt2"
    present.write_bytes(b"")
    absent = tmp_path / "nope.pt2"
    line = refused(capsys, ["diff", str(present), str(absent)])
    assert str(absent) in line and "does not exist" in line


@pytest.mark.parametrize("name, content", [("a.pt2", b"not a zip"), ("a.txt", b"hello"),
                                           ("a.nnef.tgz", b"\x1f\x8b garbage")])
def test_diff_of_files_that_are_not_programs(tmp_path, capsys, name, content):
    bad = tmp_path / name
    bad.write_bytes(content)
    line = refused(capsys, ["diff", str(bad), str(bad)])
    assert str(bad) in line and "is not a saved program" in line


def test_a_model_with_nothing_to_fuse_says_so(tmp_path, capsys):
    path = tmp_path / "llama.json"
    path.write_text(json.dumps(LLAMA))
    out = tmp_path / "m.nnef.tgz"
    for extra in ([], ["--seq-len", "1"]):  # generation-ready and one-step exports
        status = main(export("--config", str(path), "--out", str(out), *extra))
        captured = capsys.readouterr()
        assert status == 2, captured.err
        lines = [line for line in captured.err.splitlines() if line.startswith("gdn-fx:")]
        assert len(lines) == 1 and "nothing to fuse" in lines[0] and "llama" in lines[0]
        assert "Traceback" not in captured.err and "OK" not in captured.out
        assert not out.exists()


def test_the_installed_command_prints_no_traceback(tmp_path):
    done = subprocess.run([sys.executable, "-m", "gdn_fx.cli", "export", "--family", "qwen3_5",
                           "--seq-len", "0", "--out", str(tmp_path / "m.nnef.tgz")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == ["gdn-fx: UsageError: --seq-len must be >= 1, "
                                                "got 0"]


def test_negative_prefill_chunk(tmp_path, capsys):
    line = refused(capsys, ["generate", "--nnef", str(tmp_path / "m.nnef.tgz"),
                            "--prompt-ids", "1,2", "--prefill-chunk", "-1"])
    assert "--prefill-chunk must be >= 0" in line and "-1" in line
