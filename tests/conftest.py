"""Test-wide settings, and the artifacts several modules share (built once per session, per
xdist worker: a whole-model export costs ~10-20 s; the tests only read them)."""

import warnings

import pytest
import torch

# The tests run tiny tensors: one thread avoids oversubscribing the shared cores and is faster.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _quiet():
    """torch.export and transformers warn about their own internals on every call."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


@pytest.fixture(scope="session")
def folder(tmp_path_factory):
    """The demo checkpoint folder (config, random weights, a locally trained tokenizer)."""
    from gdn_fx.text import demo_checkpoint

    return demo_checkpoint(tmp_path_factory.mktemp("ckpt") / "demo")


@pytest.fixture(scope="session")
def tokenizer(folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))  # transformers', not gdn_fx's loader


@pytest.fixture(scope="session")
def demo_nnef(folder, tmp_path_factory):
    """The demo checkpoint exported generation-ready by the command (unchecked: the tests
    check it); the export carries the tokenizer and configs beside it (demo.text)."""
    from gdn_fx.cli import main

    out = tmp_path_factory.mktemp("nnef") / "demo.nnef.tgz"
    assert main(["export", "--model", str(folder), "--out", str(out), "--no-check"]) == 0
    return out


@pytest.fixture(scope="session")
def shared_export(tmp_path_factory):
    """``shared_export(family, overrides=None, **options)`` -> (model, files): the tiny model
    of ``family`` (``tiny_model`` with ``overrides``) exported by ``export_generator`` with
    ``options``, made once a session per key and shared by the tests that only read the
    artifact (a test that writes beside it, or needs its own folder, exports its own)."""
    made = {}

    def get(family: str = "qwen3_5", overrides: dict | None = None, **options):
        from gdn_fx.hf import tiny_model
        from gdn_fx.hf.generator import export_generator

        key = (family, tuple(sorted((overrides or {}).items())), tuple(sorted(options.items())))
        if key not in made:
            model = tiny_model(family, **(overrides or {}))
            folder = tmp_path_factory.mktemp(f"{family}_export")
            made[key] = model, export_generator(model, folder / f"{family}.nnef.tgz", **options)
        return made[key]

    return get
