"""The docs cannot rot: the family table is the code's, the getting-started blocks run as
written, and the site lists every page (CI builds it with ``mkdocs build --strict``)."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _python_blocks(page: Path) -> list:
    return re.findall(r"```python\n(.*?)```", page.read_text(), re.S)


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
    pages = {p.name for p in (ROOT / "docs").glob("*.md")}
    listed = set(re.findall(r":\s*([\w.-]+\.md)\s*$", nav, re.M))
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


@pytest.mark.slow  # reads the demo export (conftest.py)
def test_the_runtime_page_block_runs(demo_nnef, tmp_path, monkeypatch, capsys):
    """docs/runtime.md's block, as written, with the demo export where it reads
    ``out/model.nnef.tgz`` and its text folder beside it."""
    from gdn_fx.runtime.text import text_folder

    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "model.nnef.tgz").symlink_to(demo_nnef)
    (tmp_path / "out" / "model.text").symlink_to(text_folder(demo_nnef))
    monkeypatch.chdir(tmp_path)
    block = _python_blocks(ROOT / "docs" / "runtime.md")[0]
    exec(compile(block, "runtime block 0", "exec"), {})
    assert capsys.readouterr().out.strip()  # an answer, then the streamed pieces
