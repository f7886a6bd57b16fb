"""The streamed export (gdn_fx.hf.checkpoint, issue 31): the same files as the in-memory route.

Each case saves a tiny model in bf16 (as real checkpoints are), exports it both ways and
compares every file of the two archives byte for byte (every .dat, generated names paired
by content, see _contents); graph.nnef line by line,
without torch-to-nnef's ``export_date`` property and with the counters in generated names
left out (see _graph_text).
"""

from __future__ import annotations

import hashlib
import re
import tarfile

import pytest
import torch

from gdn_fx import tract_check
from gdn_fx.errors import CheckpointError, ExportRefused
from gdn_fx.hf import tiny_model
from gdn_fx.hf.checkpoint import Checkpoint, export_checkpoint, placeholder_model
from gdn_fx.lowering.t2n.placeholders import q4_0_by_rows, streaming
from gdn_fx.lowering.t2n.placeholders import resolve as resolve_placeholder

LIN, FULL = "linear_attention", "full_attention"
SMALL = dict(num_hidden_layers=2, layer_types=[LIN, FULL])  # two layers: the file stays fast
MOE_LOWERINGS = ("tract_moe_ffn", "gathered_bmm")  # choose["transformers_moe"]


def _checkpoint(tmp_path, family: str, **overrides):
    folder = tmp_path / f"{family}_ckpt"
    tiny_model(family, **SMALL, **overrides).to(torch.bfloat16).save_pretrained(folder)
    return folder


def _files(archive, into):
    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")
    return sorted(p.relative_to(into).as_posix() for p in into.rglob("*") if p.is_file())


def _graph_text(path):
    """graph.nnef without its export date, the counters of generated names left out: the
    numbering of torch-to-nnef's names for the stored-weight casts was seen to shift by one
    between two exports of one process (gdn_fx_stored_weight25 / 26, same line otherwise;
    counters inside a name too, e.g. mixed_expert_6_...)."""
    return [re.sub(r"([A-Za-z_])\d+(?=_|\b)", r"\1#", line)
            for line in path.read_text().splitlines() if '"export_date"' not in line]


def _digest(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _contents(folder, names):
    """(name, digest) of every weight file, sorted; the counter ending a generated name
    (c111.dat, v13.dat, repeat_of_view8.dat, gdn_fx_moe0_w1.dat) left out: torch-to-nnef
    numbers the anonymous constants from counters that the export before it in the process
    moved (CI saw c111 / c244 for one constant), so those files are paired by content.
    Checkpoint weights keep their whole names."""
    return sorted((n if n.startswith("model.") else re.sub(r"\d+", "#", n),
                   _digest(folder / n)) for n in names if n != "graph.nnef")


def _same_files(tmp_path, folder, weights, **options):
    archives = {}
    for stream in (False, True):
        archives[stream] = tmp_path / f"{'s' if stream else 'm'}_{weights}.nnef.tgz"
        export_checkpoint(folder, archives[stream], weights=weights, stream=stream, **options)
    memory, streamed_ = (tmp_path / f"m_{weights}", tmp_path / f"s_{weights}")
    names, names_streamed = _files(archives[False], memory), _files(archives[True], streamed_)
    assert "graph.nnef" in names and "graph.nnef" in names_streamed
    assert any(n.startswith("model.") and n.endswith(".dat") for n in names)
    assert _contents(memory, names) == _contents(streamed_, names_streamed)
    assert _graph_text(memory / "graph.nnef") == _graph_text(streamed_ / "graph.nnef")


@pytest.fixture(scope="module")
def tied_dense(tmp_path_factory):
    return _checkpoint(tmp_path_factory.mktemp("tied"), "qwen3_5", tie_word_embeddings=True)


@pytest.mark.parametrize("weights", ["f32", "f16", "q4_0"])
def test_dense_tied_checkpoint_streams_the_same_files(tied_dense, tmp_path, weights):
    _same_files(tmp_path, tied_dense, weights)


@pytest.mark.parametrize("lowering", MOE_LOWERINGS)
def test_moe_checkpoint_streams_the_same_files(tmp_path, lowering):
    """Fused, the operator's weights (each expert stack's gate and up halves, transposed to
    tract's layout) are computed from the stored stacks when written: the same bytes."""
    folder = _checkpoint(tmp_path, "qwen3_next")  # f16: the expert stacks converted too
    _same_files(tmp_path, folder, "f16", choose={"transformers_moe": lowering})
    text = (tmp_path / "s_f16" / "graph.nnef").read_text()
    assert text.count("tract_moe_ffn(") == (2 if lowering == "tract_moe_ffn" else 0)


def test_streamed_moe_checkpoint_generates_what_transformers_does(tmp_path):
    """qwen3_5_moe from a bf16 folder, streamed (tract_moe_ffn per layer), against
    transformers' greedy generate on the same stored weights, 32 tokens."""
    from gdn_fx.hf.configs import SAFE_TOKEN_RANGE
    from gdn_fx.hf.generator import Generator, check_generation

    folder = _checkpoint(tmp_path, "qwen3_5_moe")
    files = export_checkpoint(folder, tmp_path / "moe.nnef.tgz", weights="f32")
    assert tract_check.nnef_text(files.main).count("tract_moe_ffn(") == 2  # one per layer
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    low, high = SAFE_TOKEN_RANGE
    prompt = torch.randint(low, high, (9,), generator=torch.Generator().manual_seed(3)).tolist()
    found = check_generation(model, Generator.open(files.main).generate(prompt, 32))
    assert found.ok, found


def test_placeholders_hold_no_weights_and_experts_are_restacked(tmp_path):
    folder = _checkpoint(tmp_path, "qwen3_next")
    model, placeholders = placeholder_model(folder)
    loaded = type(model).from_pretrained(folder, dtype=torch.float32)
    expected = loaded.state_dict()
    stacks = 0
    for name, value in model.state_dict().items():
        source = placeholders.source(value)
        real = resolve_placeholder(value) if source is None else source.values()
        assert torch.equal(real, expected[name]), name
        if source is not None:
            assert all(s == 0 for s in value.stride()) and torch.isnan(value).all()
            stacks += name.endswith("gate_up_proj")
    assert stacks == 2  # both layers' experts, read from the per-expert tensors


CONVERTED = ("olmo_hybrid", "lara_mini", "kimi_linear", "bailing_hybrid")


@pytest.mark.parametrize("family", CONVERTED)
def test_checkpoints_transformers_converts_are_read_as_it_reads_them(tmp_path, family):
    """save_pretrained writes these in their released layout (renamed norms, one conv filter
    per q / k / v, one matrix per expert, one in_proj for four): the streamed reader applies
    transformers' conversion mapping forward, and every parameter equals from_pretrained's."""
    from transformers import AutoModelForCausalLM

    folder = tmp_path / family
    tiny_model(family).to(torch.bfloat16).save_pretrained(folder)
    model, placeholders = placeholder_model(folder)
    expected = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).state_dict()
    stored = set(Checkpoint(folder).files)
    converted = 0
    for name, value in model.state_dict().items():
        source = placeholders.source(value)
        real = resolve_placeholder(value) if source is None else source.load()
        assert torch.equal(real, expected[name]), name
        converted += name not in stored
    assert converted > 0  # the mapping was needed: a test of it


def test_a_converted_checkpoint_streams_the_same_files(tmp_path):
    folder = tmp_path / "kimi"
    tiny_model("kimi_linear").to(torch.bfloat16).save_pretrained(folder)
    _same_files(tmp_path, folder, "f16")


def test_an_unknown_conversion_leaves_its_targets_unread(tmp_path):
    """A converter with an operation the reader does not apply: its parameters are unknown
    (the export says so), never assembled by a guess."""
    from gdn_fx.hf import checkpoint_keys

    class Renaming:
        source_patterns, target_patterns = ["^w$"], ["weight"]

    class Converter:
        source_patterns, target_patterns = ["a$", "b$"], ["ab"]
        operations = [type("Interleave", (), {"dim": 0})()]

    Renaming.__name__, Converter.__name__ = "WeightRenaming", "WeightConverter"
    plain, assembled = checkpoint_keys.parameter_keys(["w", "x.a", "x.b", "y"],
                                                      [Renaming(), Converter()])
    assert plain == {"weight": "w", "y": "y"}
    assert [p[2] for p in assembled["x.ab"].parts] == ["x.a", "x.b"]
    assert not checkpoint_keys.known(assembled["x.ab"])


def test_a_conversion_with_missing_or_misfit_parts_is_refused():
    """Experts 0 and 2 without 1, an in_proj that is not the sum of its four parts: refused by
    name, never stacked or cut as it comes."""
    from gdn_fx.hf import checkpoint_keys

    def op(kind):
        return type(kind, (), {"dim": 0})()

    merge = type("WeightConverter", (), {"source_patterns": ["e.*.w$"],
                                         "target_patterns": ["stack"],
                                         "operations": [op("MergeModulelist")]})()
    _, assembled = checkpoint_keys.parameter_keys(["m.e.0.w", "m.e.2.w"], [merge])
    with pytest.raises(CheckpointError, match="m.e.2.w.*not indices 0 .. 1"):
        assembled["m.stack"].build("m.stack", lambda key: torch.zeros(2), {})
    split = type("WeightConverter", (), {"source_patterns": ["in_proj"],
                                         "target_patterns": ["in_a", "in_b"],
                                         "operations": [op("Split")]})()
    _, assembled = checkpoint_keys.parameter_keys(["x.in_proj.weight"], [split])
    shapes = {"x.in_a.weight": (3, 4), "x.in_b.weight": (2, 4)}
    with pytest.raises(CheckpointError, match="does not split"):
        assembled["x.in_a.weight"].build("x.in_a.weight", lambda key: torch.zeros(6, 4), shapes)
    whole = torch.arange(20.0).reshape(5, 4)
    got = assembled["x.in_b.weight"].build("x.in_b.weight", lambda key: whole, shapes)
    assert torch.equal(got, whole[3:])


def test_a_constant_folded_from_a_placeholder_is_refused(tmp_path):
    """The conv filters stay real in a streamed export because the lowering reshapes them
    (torch-to-nnef folds that into a variable of its own): as a placeholder, the folded
    variable would be NaN, and the writer refuses it, naming it."""
    from gdn_fx.hf.generator import export_generator

    folder = _checkpoint(tmp_path, "qwen3_5")
    model, placeholders = placeholder_model(folder)
    conv = model.model.layers[0].linear_attn.conv1d
    real = conv.weight.detach().clone()
    conv.weight = torch.nn.Parameter(placeholders.make(
        "conv", tuple(real.shape), torch.float32, lambda: real), requires_grad=False)
    with streaming(placeholders), pytest.raises(ExportRefused, match="placeholder"):
        export_generator(model, tmp_path / "x.nnef.tgz")
    assert not (tmp_path / "x.nnef.tgz").exists()


def test_unknown_checkpoint_layout_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    folder = _checkpoint(tmp_path, "qwen3_5")
    file = folder / "model.safetensors"
    tensors = load_file(file)
    tensors["renamed.weight"] = tensors.pop("lm_head.weight")
    save_file(tensors, file, metadata={"format": "pt"})
    assert "renamed.weight" in Checkpoint(folder).files
    with pytest.raises(CheckpointError, match="lm_head.weight"):
        placeholder_model(folder)


def test_cli_streams_a_checkpoint_by_default_and_checks_it(tmp_path, capsys):
    """``export --model DIR`` streams (no --stream needed) and checks the written file
    against transformers on the weights it stores, as ``generate --check --model DIR`` does."""
    from gdn_fx.cli import main

    folder = _checkpoint(tmp_path, "qwen3_5")
    out = tmp_path / "cli.nnef.tgz"
    assert main(["export", "--model", str(folder), "--out", str(out), "--weights", "q4_0"]) == 0
    text = capsys.readouterr().out
    assert "(streamed)" in text and "in memory" not in text
    assert "vs transformers: every token equal" in text and text.rstrip().endswith("OK")
    assert main(["generate", "--nnef", str(out), "--prompt-ids", "5,9,17,33",
                 "--max-new-tokens", "8", "--check", "--model", str(folder)]) == 0
    text = capsys.readouterr().out
    assert "every token equal" in text and text.rstrip().endswith("OK")
    # --in-memory: transformers loads the folder; the same archive contents
    memory = tmp_path / "memory.nnef.tgz"
    assert main(["export", "--model", str(folder), "--out", str(memory), "--weights", "q4_0",
                 "--in-memory", "--no-check"]) == 0
    assert "(streamed)" not in capsys.readouterr().out
    assert _contents(*_unpacked(out, tmp_path / "a")) == \
        _contents(*_unpacked(memory, tmp_path / "b"))


def _unpacked(archive, into):
    return into, _files(archive, into)


def test_cli_streams_and_checks_a_moe_checkpoint(tmp_path, capsys):
    """The routed experts become tract_moe_ffn's operands (stored in tract's layout, under
    names of their own): the check's reference reads those stacks from the checkpoint."""
    from gdn_fx.cli import main

    folder = _checkpoint(tmp_path, "qwen3_next")
    out = tmp_path / "moe.nnef.tgz"
    assert main(["export", "--model", str(folder), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "(streamed)" in text and "tract_moe_ffn" in tract_check.nnef_text(out)
    assert "vs transformers: every token equal" in text and text.rstrip().endswith("OK")


def test_cli_loads_in_memory_what_it_cannot_stream(tmp_path, capsys, monkeypatch):
    """olmo_hybrid's checkpoint names its norms as its original release did (transformers
    renames attention_layer_norm to input_layernorm when it loads); without the conversion
    mapping (a transformers that has none: simulated) the streamed reader does not know the
    name: by default the export says so and loads it in memory, checked; --stream refuses it
    by name. Options only the in-memory route takes are refused with --stream."""
    from gdn_fx.cli import main
    from gdn_fx.hf import checkpoint_keys

    monkeypatch.setattr(checkpoint_keys, "conversions", lambda model_type: [])

    folder = tmp_path / "olmo"
    tiny_model("olmo_hybrid").save_pretrained(folder)
    out = tmp_path / "x.nnef.tgz"
    assert main(["export", "--model", str(folder), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "loaded in memory" in text and "input_layernorm" in text
    assert "every token equal" in text and text.rstrip().endswith("OK")
    assert main(["export", "--model", str(folder), "--out", str(out), "--stream"]) == 2
    assert "input_layernorm" in capsys.readouterr().err
    for argv, status in ((["--stream", "--decode-graph"], 2), (["--stream", "--in-memory"], 2)):
        assert main(["export", "--model", str(folder), "--out", str(out), *argv]) == status
        assert "--" in capsys.readouterr().err
    assert main(["export", "--family", "qwen3_5", "--out", str(out), "--in-memory"]) == 2
    assert "--model DIR" in capsys.readouterr().err
    assert main(["export", "--model", str(folder), "--out", str(out), "--stream",
                 "--seq-len", "2"]) == 2


def test_the_file_holds_each_weight_once(tied_dense, tmp_path):
    """Issue 31's one copy: each matrix of the model (tied tables once, as the model holds
    them) is the data of exactly one .dat of the archive (after NNEF's 128-byte header), and
    no two large .dat files hold the same bytes."""
    from transformers import AutoModelForCausalLM

    archive = tmp_path / "once.nnef.tgz"
    export_checkpoint(tied_dense, archive, weights="f32")
    with tarfile.open(archive) as tar:
        data = {m.name: tar.extractfile(m).read()[128:] for m in tar.getmembers()
                if m.name.endswith(".dat")}
    large = [d for d in data.values() if len(d) > 4096]
    assert len(large) > 8 and len(set(large)) == len(large)
    model = AutoModelForCausalLM.from_pretrained(tied_dense, dtype=torch.float32)
    for name, param in model.named_parameters():  # tied: listed once
        values = param.detach().numpy().tobytes()
        if len(values) > 4096:
            assert sum(d == values for d in data.values()) == 1, name


def test_q4_0_by_rows_writes_the_whole_tensors_bytes(tmp_path):
    """The streamed writer quantizes large matrices a block of rows at a time: the file must
    be the one quantizing the whole matrix writes (codes and scales alike)."""
    from torch_to_nnef.tensor.quant import fp_to_tract_q4_0_with_min_max_calibration

    from gdn_fx.lowering.t2n.offline_target import offline_tract_target

    values = torch.randn(37, 96, generator=torch.Generator().manual_seed(0))
    values[5, :32] = 0  # an all-zero group: scale 0
    target = offline_tract_target("0.23.9", {}, {})
    whole, blocks = tmp_path / "whole", tmp_path / "blocks"
    whole.mkdir(), blocks.mkdir()
    fp_to_tract_q4_0_with_min_max_calibration(values).write_in_file(str(whole), "w", target)
    q4_0_by_rows(values, rows=5).write_in_file(str(blocks), "w", target)
    assert (whole / "w.dat").read_bytes() == (blocks / "w.dat").read_bytes()
    assert len((whole / "w.dat").read_bytes()) > 37 * 96 // 2


@pytest.mark.slow
def test_streamed_moe_fuses_at_real_widths_in_f16(tmp_path):
    """Qwen3.5-MoE's expert widths (hidden 2048, experts of 512, top-8) in f16: the proof's
    stand-ins are scaled as trained weights are; unit draws overflowed f16 there and the
    blocks stayed plain ops (found by bench/bench_checkpoint.py --shapes moe)."""
    folder = _checkpoint(tmp_path, "qwen3_5_moe", hidden_size=2048, moe_intermediate_size=512,
                         shared_expert_intermediate_size=512, num_experts=16,
                         num_experts_per_tok=8, vocab_size=1024)
    files = export_checkpoint(folder, tmp_path / "wide.nnef.tgz", dtype="f16")
    assert tract_check.nnef_text(files.main).count("tract_moe_ffn(") == 2


@pytest.mark.parametrize("weights", ["f32", "q4_0"])
def test_stored_reference_is_from_pretrained_holding_the_stored_weights(tied_dense, tmp_path,
                                                                         weights):
    """What generate --check --model DIR compares with, built without a second copy: every
    parameter and buffer equal to from_pretrained's model given the file's stored weights;
    it generates what the file generates."""
    from transformers import AutoModelForCausalLM

    from gdn_fx.hf.generator import Generator, check_generation, with_stored_weights
    from gdn_fx.hf.checkpoint import stored_reference

    files = export_checkpoint(tied_dense, tmp_path / "t.nnef.tgz", weights=weights)
    built = stored_reference(tied_dense, files.main)
    loaded = with_stored_weights(AutoModelForCausalLM.from_pretrained(
        tied_dense, dtype=torch.float32), files.main, in_place=True)
    mine, theirs = dict(built.named_parameters()), dict(loaded.named_parameters())
    assert mine.keys() == theirs.keys()
    for name, value in mine.items():
        assert torch.equal(value, theirs[name]), name
    buffers = dict(loaded.named_buffers())
    for name, value in built.named_buffers():
        assert torch.equal(value, buffers[name]), name
    found = check_generation(built.eval(), Generator.open(files.main).generate([5, 9, 17], 12))
    assert found.ok, found
    # a file of another model stores none of this one's matrices: refused by name
    other = export_checkpoint(_checkpoint(tmp_path, "qwen3_next"), tmp_path / "o.nnef.tgz")
    with pytest.raises(CheckpointError, match=r"stores no values for model\.layers\.\d+\."):
        stored_reference(tied_dense, other.main)


@pytest.mark.parametrize("family", ["falcon_h1", "granitemoehybrid"])
@pytest.mark.parametrize("weights", ["q4_0", "f16"])
def test_cli_streams_a_mamba_hybrid_checkpoint_and_checks_it(tmp_path, capsys, family,
                                                            weights):
    """A Falcon-H1 and a Granite-4.0-H checkpoint folder (bf16, their families' tiny shapes)
    through ``export --model DIR``: streamed, one scan per Mamba layer, and every token of
    the export's check equal to transformers holding the weights the file stores."""
    from gdn_fx.cli import main

    folder = tmp_path / f"{family}_ckpt"
    tiny_model(family).to(torch.bfloat16).save_pretrained(folder)
    out = tmp_path / "m.nnef.tgz"
    assert main(["export", "--model", str(folder), "--out", str(out), "--weights",
                 weights]) == 0
    text = capsys.readouterr().out
    assert "(streamed)" in text and "gated_linear_scan 2/2" in text
    assert "vs transformers: every token equal" in text and text.rstrip().endswith("OK")
