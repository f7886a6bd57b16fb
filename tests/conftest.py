"""Test-wide settings, and the artifacts several modules share: built once per run, whichever
xdist worker asks first (the others wait on a file lock and read it; a whole-model export
costs ~5-20 s), written under pytest's temporary folder. The tests only read them."""

import hashlib
import json
import os
import pickle
import warnings
from pathlib import Path

import pytest
import torch
import torch.fx
from filelock import FileLock

# The tests run tiny tensors: one thread avoids oversubscribing the shared cores and is faster.
torch.set_num_threads(1)
# torch.export and its decompositions without per-node stack traces (a traceback extracted
# per node: 5-20 % of a small module's export and decompositions, measured). No test reads
# them, except tests/test_stack_traces.py, which switches them on where it needs them.
torch.fx.config.do_not_emit_stack_traces = True


@pytest.fixture(autouse=True)
def _quiet():
    """torch.export and transformers warn about their own internals on every call."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


@pytest.fixture(scope="session")
def built_once(tmp_path_factory):
    """``built_once(key, build)``: ``build(folder)`` run once per test run for ``key`` (a
    string naming what it builds and how), in a folder of its own that every xdist worker
    sees (the workers' temporary folders share a parent); its (picklable) result is returned
    to every caller, in every worker."""
    base = tmp_path_factory.getbasetemp()
    shared = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "built_once"
    shared.mkdir(exist_ok=True)

    def get(key: str, build):
        folder = shared / hashlib.sha256(key.encode()).hexdigest()[:16]
        with FileLock(f"{folder}.lock"):
            result = folder / "result.pickle"
            if not result.exists():
                folder.mkdir()
                made = build(folder)
                result.write_bytes(pickle.dumps(made))
                return made
            return pickle.loads(result.read_bytes())

    return get


@pytest.fixture(scope="session")
def folder(built_once):
    """The demo checkpoint folder (config, random weights, a locally trained tokenizer)."""
    from gdn_fx.demo_text import demo_checkpoint

    return built_once("demo checkpoint", lambda into: demo_checkpoint(into / "demo"))


@pytest.fixture(scope="session")
def tokenizer(folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))  # transformers', not gdn_fx's loader


@pytest.fixture(scope="session")
def demo_nnef(folder, built_once):
    """The demo checkpoint exported generation-ready by the command (unchecked: the tests
    check it); the export carries the tokenizer and configs beside it (demo.text)."""
    from gdn_fx.cli import main

    def build(into: Path) -> Path:
        out = into / "demo.nnef.tgz"
        assert main(["export", "--model", str(folder), "--out", str(out), "--no-check"]) == 0
        return out

    return built_once("demo checkpoint exported by the CLI", build)


@pytest.fixture(scope="session")
def shared_export(built_once):
    """``shared_export(family, overrides=None, **options)`` -> (model, files): the tiny model
    of ``family`` (``tiny_model`` with ``overrides``) exported by ``export_generator`` with
    ``options``, made once a run per key and shared by the tests that only read the artifact
    (a test that writes beside it, or needs its own folder, exports its own). The model is
    the one exported: rebuilt from its seed and prepared for NNEF as the export prepares it,
    in each worker."""
    models = {}

    def get(family: str = "qwen3_5", overrides: dict | None = None, **options):
        from gdn_fx.hf import prepare_for_nnef, tiny_model
        from gdn_fx.hf.generator import export_generator

        key = repr((family, sorted((overrides or {}).items()), sorted(options.items())))
        if key not in models:
            models[key] = tiny_model(family, **(overrides or {}))
        model = models[key]
        files = built_once(f"export_generator {key}", lambda into: export_generator(
            model, into / f"{family}.nnef.tgz", **options))
        prepare_for_nnef(model)  # what the export did to it, where another worker exported
        return model, files

    return get


# --- the slow marker, from measured durations ---------------------------------------------
# A test is slow when it took SLOW_SECONDS or more (setup, call and teardown) in a recorded
# run on the reference machine (2 cores): `make durations` records the whole suite, then the
# fast subset (where a test may pay for a cache that slow tests filled before), each run
# raising the times in DURATIONS (delete it to start again). The modules that export whole
# models also say `slow` themselves. A test not in DURATIONS counts as fast until recorded.
# `make test-fast` runs the others.
SLOW_SECONDS = 0.3
DURATIONS = Path(__file__).with_name("durations.json")


def pytest_addoption(parser):
    parser.addoption("--record-durations", action="store_true",
                     help=f"write each test's duration >= {SLOW_SECONDS}s to {DURATIONS.name}")


def pytest_collection_modifyitems(config, items):
    measured = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
    for item in items:
        if measured.get(item.nodeid, 0.0) >= SLOW_SECONDS:
            item.add_marker(pytest.mark.slow)


_durations: dict = {}


def pytest_runtest_logreport(report):
    _durations[report.nodeid] = _durations.get(report.nodeid, 0.0) + report.duration


def pytest_sessionfinish(session):
    if not session.config.getoption("--record-durations"):
        return
    if hasattr(session.config, "workerinput"):  # an xdist worker: the controller writes
        return
    slow = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
    for nodeid, seconds in _durations.items():
        if seconds >= max(SLOW_SECONDS, slow.get(nodeid, 0.0)):
            slow[nodeid] = round(seconds, 2)
    DURATIONS.write_text(json.dumps(dict(sorted(slow.items())), indent=0) + "\n")
