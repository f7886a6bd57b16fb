"""The docs cannot rot: the family table is the code's, every Python block of README and
docs/ runs as written (here or in test_readme.py), every ``gdn-fx`` command line they show
parses, and the site lists every page (CI builds it with ``mkdocs build --strict``)."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _python_blocks(page: Path) -> list:
    return re.findall(r"```python\n(.*?)```", page.read_text(), re.S)


# The Python blocks each page holds, all run by the tests below (README's: test_readme.py).
# A new block fails here until a test runs it.
RUN = {"README.md": 2, "getting-started.md": 2, "runtime.md": 1, "python-api.md": 3,
       "text.md": 2, "generalize.md": 1}


def _pages() -> list:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def test_every_python_block_is_run():
    held = {p.name: len(_python_blocks(p)) for p in _pages() if _python_blocks(p)}
    assert held == RUN


def _command_lines(page: Path) -> list:
    """``gdn-fx ...`` lines of a page's code (fenced, or indented by four spaces), with
    continuations joined and comments, prompts and ``[optional]`` parts dropped."""
    text = page.read_text()
    code = re.findall(r"```\w*\n(.*?)```", text, re.S)
    code += [line for line in text.splitlines() if line.startswith("    ")]
    lines = re.sub(r"\\\n\s*", " ", "\n".join(code)).splitlines()
    lines = [re.sub(r"\s#.*", "", line).strip().removeprefix("$ ") for line in lines]
    return [re.sub(r"\[[^]]*\]", "", line) for line in lines if line.startswith("gdn-fx ")]


@pytest.mark.parametrize("page", [p.relative_to(ROOT).as_posix() for p in _pages()
                                  if _command_lines(p)])
def test_every_command_line_shown_parses(page):
    import shlex

    from gdn_fx.cli import _parser

    for line in _command_lines(ROOT / page):
        try:
            _parser().parse_args(shlex.split(line)[1:])
        except SystemExit:
            pytest.fail(f"{page}: {line!r} does not parse")


def test_readme_family_table_is_the_codes():
    from gdn_fx.hf.configs import FAMILIES, GENERATING

    rows = [line for line in (ROOT / "README.md").read_text().splitlines()
            if line.startswith("| ") and "`" in line]
    named = {name: row for row in rows for name in re.findall(r"\(`(\w+)`\)", row)}
    assert sorted(named) == sorted(FAMILIES)
    generating = {name for name, row in named.items() if row.rstrip(" |").endswith("yes")}
    assert generating == set(GENERATING)


def test_the_site_lists_every_page():
    nav = (ROOT / "mkdocs.yml").read_text()
    docs = ROOT / "docs"
    pages = {p.relative_to(docs).as_posix() for p in docs.rglob("*.md")}
    listed = set(re.findall(r":\s*([\w./-]+\.md)\s*$", nav, re.M))
    assert listed == pages, (pages - listed, listed - pages)


@pytest.mark.slow  # exports a whole tiny model
def test_getting_started_export_and_generate_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    block = _python_blocks(ROOT / "docs" / "getting-started.md")[0]
    exec(compile(block, "getting-started block 0", "exec"), {})
    tokens = capsys.readouterr().out.strip()
    assert re.fullmatch(r"\[\d+(, \d+){7}\]", tokens), tokens


def test_getting_started_collapse_runs(tmp_path, monkeypatch):
    from spellings import SPELLING

    monkeypatch.chdir(tmp_path)
    spelling = SPELLING[next(iter(SPELLING))]
    given = {"model": spelling.module(), "args": spelling.inputs()}
    exec(compile(_python_blocks(ROOT / "docs" / "getting-started.md")[1],
                 "getting-started block 1", "exec"), given)
    assert given["result"].counts["gated_delta_scan"] == 1
    assert (tmp_path / "model.nnef.tgz").exists()


def test_the_cli_reference_is_the_parsers():
    """docs/cli-reference.md is what the parser prints (``make docs`` rewrites it)."""
    from gdn_fx.cli import reference

    assert (ROOT / "docs" / "cli-reference.md").read_text() == reference() + "\n"


def _demo_export_as(demo_nnef, folder, monkeypatch, name: str) -> None:
    """The demo export (conftest.py's) and its text folder as ``out/NAME.nnef.tgz`` and
    ``out/NAME.text`` under ``folder``, the working directory then."""
    from gdn_fx.runtime.text import text_folder

    (folder / "out").mkdir()
    (folder / "out" / f"{name}.nnef.tgz").symlink_to(demo_nnef)
    (folder / "out" / f"{name}.text").symlink_to(text_folder(demo_nnef))
    monkeypatch.chdir(folder)


@pytest.mark.slow  # reads the demo export (conftest.py)
def test_the_runtime_page_block_runs(demo_nnef, tmp_path, monkeypatch, capsys):
    """docs/runtime.md's block, as written, with the demo export where it reads
    ``out/model.nnef.tgz`` and its text folder beside it."""
    _demo_export_as(demo_nnef, tmp_path, monkeypatch, "model")
    block = _python_blocks(ROOT / "docs" / "runtime.md")[0]
    exec(compile(block, "runtime block 0", "exec"), {})
    assert capsys.readouterr().out.strip()  # an answer, then the streamed pieces


@pytest.mark.slow  # exports a whole tiny model twice
def test_the_python_api_blocks_run(tmp_path, monkeypatch, capsys):
    """docs/python-api.md's blocks in order in one namespace, given what they name of the
    user's: a delta-rule loop of another author (``model``, ``args``) and a prompt."""
    from spellings import SPELLING

    monkeypatch.chdir(tmp_path)
    blocks = _python_blocks(ROOT / "docs" / "python-api.md")
    spelling = SPELLING[next(iter(SPELLING))]
    given = {"model": spelling.module(), "args": spelling.inputs()}
    given["eager_outputs"] = given["model"](*given["args"])
    exec(compile(blocks[0], "python-api block 0", "exec"), given)
    assert given["result"].counts["gated_delta_scan"] == 1
    given["prompt_ids"] = [1, 2, 3]
    for index in (1, 2):
        exec(compile(blocks[index], f"python-api block {index}", "exec"), given)
    assert "every token equal" in capsys.readouterr().out


@pytest.mark.slow  # four exports of a small model
def test_the_generalize_page_block_runs(tmp_path, monkeypatch):
    """docs/generalize.md's block with a model of one's own (``example_inputs(S, P)``)."""
    import torch

    import gdn_fx
    from test_generalize import Hybrid

    monkeypatch.chdir(tmp_path)
    given = {"model": Hybrid().eval(), "torch": torch, "gdn_fx": gdn_fx}
    exec(compile(_python_blocks(ROOT / "docs" / "generalize.md")[0], "generalize block 0",
                 "exec"), given)
    assert given["gen"].sites and (tmp_path / "m.nnef.tgz").exists()


@pytest.mark.slow  # reads the demo export (conftest.py)
def test_the_text_page_blocks_run(demo_nnef, tmp_path, monkeypatch, capsys):
    """docs/text.md's blocks in order, with the demo export where they read
    ``out/keeper.nnef.tgz`` and its text folder beside it."""
    _demo_export_as(demo_nnef, tmp_path, monkeypatch, "keeper")
    given = {}
    for index, block in enumerate(_python_blocks(ROOT / "docs" / "text.md")):
        exec(compile(block, f"text block {index}", "exec"), given)
    assert capsys.readouterr().out.strip()
    assert [len(r.tokens) for r in given["results"]] == [64, 64, 64]
    assert [r.summary.text for r in given["runs"]] != ["", ""]
