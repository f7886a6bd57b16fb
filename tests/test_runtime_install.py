"""The runtime-only install (``pip install gdn-fx``: tract, numpy, tokenizers, jinja2) runs
the ``gdn-fx`` command: ``--help`` and ``generate`` work from text, and every command that
needs the exporter (torch, transformers, torch-to-nnef: the ``export`` extra) says in one
line what to install, with status 2.

Each run is a process of its own with torch, transformers and torch-to-nnef blocked from
import (tests/test_layers.py's blocker), calling ``gdn_fx.cli.main`` as the console script
does; the tokens are compared with what this process (the full install) gives."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from test_layers import BLOCKER

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "The keeper of the north light"
INSTALL = 'pip install "gdn-fx[export]"'
# what the process prints at its end: the top-level modules it imported after starting (a
# site hook such as setuptools' _distutils_hack is there before gdn_fx is)
IMPORTED = """
import atexit
_at_start = {m.split(".")[0] for m in sys.modules}
atexit.register(lambda: print("IMPORTED " + " ".join(sorted(
    {m.split(".")[0] for m in sys.modules} - _at_start))))
"""


def gdn_fx_blocked(*argv, imported: bool = False) -> subprocess.CompletedProcess:
    """``gdn-fx ARGV`` in a process where torch, transformers and torch_to_nnef cannot be
    imported (``imported``: the last stdout line names every top-level module it loaded)."""
    code = (BLOCKER + (IMPORTED if imported else "")
            + f"from gdn_fx.cli import main\nsys.exit(main({[str(a) for a in argv]!r}))\n")
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=300)


def full_install(capsys, *argv):
    from gdn_fx.cli import main

    status = main([str(a) for a in argv])
    return status, *capsys.readouterr()


def test_help_works_without_the_exporter():
    done = gdn_fx_blocked("--help")
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert done.stdout.startswith("usage: gdn-fx") and "generate" in done.stdout
    done = gdn_fx_blocked("generate", "--help")
    assert done.returncode == 0 and "--max-new-tokens" in done.stdout, done.stderr
    done = gdn_fx_blocked("export", "--help")  # the family list says what to install
    assert done.returncode == 0 and "--family" in done.stdout, done.stderr
    assert f"families (--family): listed here once the exporter's packages are installed " \
        f"({INSTALL})" in " ".join(done.stdout.split())


@pytest.mark.parametrize("argv, what", [
    (["export", "--family", "qwen3_5", "--out", "{tmp}/q.nnef.tgz"], "export"),
    (["export", "--model", "{tmp}", "--out", "{tmp}/m.nnef.tgz"], "export"),
    (["demo"], "demo"),
    (["diff", "{tmp}/a.pt2", "{tmp}/b.pt2"], "diff"),
    (["generate", "--nnef", "{tmp}/m.nnef.tgz", "--prompt-ids", "1,2", "--check", "--family",
      "qwen3_5"], "generate --check"),
    (["generate", "--nnef", "{tmp}/m.nnef.tgz", "--prompt-ids", "1,2", "--family",
      "qwen3_5"], "generate --family"),
])
def test_a_command_that_needs_the_exporter_says_what_to_install(argv, what, tmp_path):
    done = gdn_fx_blocked(*[a.format(tmp=tmp_path) for a in argv])
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.splitlines() == [
        f"gdn-fx: {what} needs the exporter's packages (torch, transformers, torch-to-nnef "
        f"not installed): {INSTALL}"]
    assert list(tmp_path.iterdir()) == []  # nothing written


@pytest.mark.slow  # reads the demo export (conftest.py)
def test_generate_from_text_without_the_exporter_gives_the_full_install_s_tokens(
        demo_nnef, folder, capsys):
    """The demo artifact (the tokenizer and generation config carried beside it, demo.text):
    a text prompt, plain and in the chat template, and token ids, each with the
    checkpoint's length (transformers' default) and with --max-new-tokens; the same prompt
    ids and tokens as the full install, and nothing imported outside the base install."""
    runs = [["--prompt", PROMPT, "--json"],
            ["--prompt", "Do you get lonely out here?", "--chat", "--json",
             "--max-new-tokens", 12],
            ["--prompt", PROMPT, "--model", folder, "--json", "--max-new-tokens", 7],
            ["--prompt-ids", "5,9,17,33", "--max-new-tokens", 9]]
    for argv in runs:
        argv = ["generate", "--nnef", demo_nnef, *argv]
        done = gdn_fx_blocked(*argv, imported=True)
        assert done.returncode == 0, done.stderr
        *lines, imported = done.stdout.splitlines()
        status, out, err = full_install(capsys, *argv)
        assert status == 0, err
        if "--json" in argv:
            got, want = json.loads(lines[-1]), json.loads(out)
            assert (got["prompt"], got["tokens"], got["text"]) == (
                want["prompt"], want["tokens"], want["text"]), argv
            assert len(got["tokens"]) == (12 if "12" in map(str, argv) else
                                          7 if "7" in map(str, argv) else 20)
        else:
            tokens = next(line for line in lines if line.startswith("tokens: "))
            assert tokens == next(line for line in out.splitlines()
                                  if line.startswith("tokens: "))
            assert len(tokens.split(",")) == 9
        said = [line for line in done.stderr.splitlines() if line.startswith("[length] ")]
        assert said == [line for line in err.splitlines() if line.startswith("[length] ")]
        assert len(said) == 1
        assert not {"torch", "transformers", "torch_to_nnef"} & set(imported.split()[1:])
        outside = _distributions(imported.split()[1:]) - _base_install()
        assert outside == set(), (argv, outside)


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_name(text: str) -> str:
    return _normal(re.split(r"[\s<>=!~;\[(]", text.strip(), maxsplit=1)[0])


def _base_install() -> set:
    """The distributions ``pip install gdn-fx`` brings: pyproject's dependencies and theirs
    (as installed here), gdn-fx itself."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    found, todo = {"gdn-fx"}, [_requirement_name(r) for r in project["dependencies"]]
    while todo:
        name = todo.pop()
        if name in found:
            continue
        found.add(name)
        try:
            requires = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        todo += [_requirement_name(r) for r in requires if "extra ==" not in r]
    return found


def _distributions(modules) -> set:
    """The installed distributions that provide ``modules`` (top-level names); the standard
    library's and this checkout's own (gdn_fx, its editable finder) provide none."""
    providers = importlib.metadata.packages_distributions()
    return {_normal(dist) for module in modules if module not in sys.stdlib_module_names
            for dist in providers.get(module, ())}


def test_the_base_install_is_the_runtime_and_the_exporter_an_extra():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert {_requirement_name(r) for r in project["dependencies"]} == {
        "tract", "numpy", "tokenizers", "jinja2"}
    extras = project["optional-dependencies"]
    assert {_requirement_name(r) for r in extras["export"]} == {
        "torch", "transformers", "torch-to-nnef", "networkx"}
    makefile = (ROOT / "Makefile").read_text()
    assert '-e ".[export,test]"' in makefile
    assert makefile.index("torch==") < makefile.index('-e ".[export,test]"')
