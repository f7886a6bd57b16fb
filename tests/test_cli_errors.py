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


# --- checkpoint folders, --out, help (issue 30) ------------------------------------------------

@pytest.fixture
def checkpoint(tmp_path):
    """A checkpoint folder as save_pretrained writes it (tiny lfm2: config.json + weights)."""
    from gdn_fx.hf import tiny_model

    folder = tmp_path / "ckpt"
    tiny_model("lfm2").save_pretrained(folder)
    assert (folder / "model.safetensors").is_file()
    return folder


def test_checkpoint_with_a_corrupt_config(checkpoint, capsys, no_work):
    (checkpoint / "config.json").write_text('{"model_type": "lfm2", "hidden_size": ')
    line = refused(capsys, export("--model", str(checkpoint), "--out",
                                  str(checkpoint.parent / "m.nnef.tgz")))
    assert "CheckpointError" in line and "config.json" in line and "not valid JSON" in line


def test_checkpoint_without_weights(checkpoint, capsys, no_work):
    (checkpoint / "model.safetensors").unlink()
    line = refused(capsys, export("--model", str(checkpoint), "--out",
                                  str(checkpoint.parent / "m.nnef.tgz")))
    assert "holds no weights" in line and str(checkpoint) in line


@pytest.mark.parametrize("keep", [4, 200, -100])  # in the length, in the header, in the data
def test_checkpoint_with_a_truncated_safetensors_file(checkpoint, capsys, no_work, keep):
    weights = checkpoint / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:keep])
    out = checkpoint.parent / "m.nnef.tgz"
    line = refused(capsys, export("--model", str(checkpoint), "--out", str(out)))
    assert "CheckpointError" in line and "model.safetensors" in line
    assert not out.exists()


def test_checkpoint_with_a_missing_shard(tmp_path, capsys, no_work):
    from gdn_fx.hf import tiny_model

    folder = tmp_path / "sharded"
    tiny_model("lfm2").save_pretrained(folder, max_shard_size="40KB")
    shards = sorted(folder.glob("model-*.safetensors"))
    assert len(shards) > 1 and (folder / "model.safetensors.index.json").is_file()
    shards[-1].unlink()
    capsys.readouterr()  # save_pretrained's progress bar
    line = refused(capsys, export("--model", str(folder), "--out", str(tmp_path / "m.nnef")))
    assert shards[-1].name in line and "missing" in line


def test_a_qwen4_exp_checkpoint_is_refused_in_one_line_before_tracing(tmp_path, capsys,
                                                                     monkeypatch):
    """qwen4_exp's QSA indexer selects key positions by value (torch.nonzero over the mask):
    refused from the model's modules, not by torch.export's GuardOnDataDependentSymNode."""
    import torch

    from gdn_fx.hf import tiny_model

    if not configs.family("qwen4_exp").available:
        pytest.skip(f"transformers {transformers.__version__} has no qwen4_exp")
    folder = tmp_path / "qwen4"
    tiny_model("qwen4_exp").save_pretrained(folder)  # model_type qwen4_exp, text and vision
    capsys.readouterr()  # save_pretrained's progress bar

    def traced(*args, **kwargs):
        raise AssertionError("the export traced the model before refusing it")

    monkeypatch.setattr(torch.export, "export", traced)
    out = tmp_path / "q.nnef.tgz"
    status, lines, _ = status_and_lines(capsys, export("--model", str(folder), "--out",
                                                       str(out)))
    assert status == 2 and len(lines) == 1, lines
    assert lines[0].startswith("gdn-fx: ExportRefused: ")
    for part in ("Qwen4ExpTextQSAIndexer", "layers.1.self_attn.indexer", "depend on values",
                 f"transformers {transformers.__version__}"):
        assert part in lines[0], lines[0]
    assert not out.exists()


def test_a_checkpoint_as_saved_passes_the_checks(checkpoint):
    from gdn_fx.cli_checks import check_model_dir

    check_model_dir(checkpoint)  # the checks refuse broken folders, not good ones


def test_out_whose_parent_is_a_file(tmp_path, capsys, no_work):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    for out in (blocker / "m.nnef.tgz", blocker / "sub" / "m.nnef.tgz"):
        line = refused(capsys, export("--family", "qwen3_5", "--out", str(out)))
        assert f"{blocker} is a file, not a folder" in line


def test_out_archive_name_that_is_a_folder(tmp_path, capsys, no_work):
    folder = tmp_path / "m.nnef.tgz"
    folder.mkdir()
    assert "is a folder" in refused(capsys, export("--family", "qwen3_5", "--out", str(folder)))


def help_text(capsys, argv) -> str:
    with pytest.raises(SystemExit) as done:
        main([*argv, "--help"])
    assert done.value.code == 0
    return capsys.readouterr().out


def test_export_help_lists_the_families(capsys):
    text = " ".join(help_text(capsys, ["export"]).split())
    for name in configs.FAMILIES:
        assert name in text.split("families (--family):")[1], name


@pytest.mark.parametrize("command", [[], ["demo"], ["export"], ["generate"], ["diff"]])
def test_every_help_shows_an_example(capsys, command):
    text = help_text(capsys, command)
    assert "example" in text
    shown = [line.strip() for line in text.splitlines() if line.strip().startswith("gdn-fx ")]
    assert shown and all(line.split()[1] in ("demo", "export", "generate", "diff")
                         for line in shown)
    if command:
        assert any(line.split()[1] == command[0] for line in shown)


def status_and_lines(capsys, argv):
    """(status, the gdn-fx lines of stderr, stdout): exports also print torch's warnings."""
    status = main(argv)
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    return status, [ln for ln in captured.err.splitlines() if ln.startswith("gdn-fx:")], \
        captured.out


def test_an_export_that_fails_after_writing_leaves_nothing_at_out(tmp_path, capsys,
                                                                  monkeypatch):
    from gdn_fx.errors import UsageError
    from gdn_fx.hf import generator

    def fails(*args, **kwargs):  # the check after both graphs are written
        raise UsageError("stopped after writing")

    monkeypatch.setattr(generator, "check_generation", fails)
    out = tmp_path / "m.nnef.tgz"
    out.write_bytes(b"an earlier file, left as it was")
    status, lines, _ = status_and_lines(capsys, export("--family", "lfm2", "--out", str(out)))
    assert status == 2 and len(lines) == 1 and "stopped after writing" in lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.nnef.tgz"]  # no decode, no temp
    assert out.read_bytes() == b"an earlier file, left as it was"


def test_an_export_that_fails_its_check_is_not_written(tmp_path, capsys, monkeypatch):
    from gdn_fx.hf import generator

    wrong = generator.GenerationCheck(False, 0, 1.0, 1e-4, [0])
    monkeypatch.setattr(generator, "check_generation", lambda *args, **kwargs: wrong)
    out = tmp_path / "m.nnef.tgz"
    status, lines, stdout = status_and_lines(capsys, export("--family", "lfm2", "--out",
                                                            str(out)))
    assert status == 1 and not lines and stdout.rstrip().endswith(
        "--no-check writes an unchecked generation-ready export)")
    assert "NOT OK" in stdout and list(tmp_path.iterdir()) == []
