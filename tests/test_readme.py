"""README's Python blocks run as written (in a temporary folder; the first one, which reads a
model and its arguments of the user's, is given a delta-rule loop of another author)."""

import re
from pathlib import Path

import pytest

from spellings import SPELLING

pytestmark = pytest.mark.slow  # the second block exports a whole model

README = Path(__file__).resolve().parents[1] / "README.md"


def _blocks() -> list:
    return re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def test_readme_has_its_two_quickstarts():
    blocks = _blocks()
    assert len(blocks) == 2, len(blocks)
    assert "gdn_fx.collapse(program)" in blocks[0] and "export_generator(" in blocks[1]


@pytest.mark.parametrize("index", [0, 1])
def test_readme_block_runs(index, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    spelling = SPELLING[next(iter(SPELLING))]
    given = {"model": spelling.module(), "args": spelling.inputs()} if index == 0 else {}
    exec(compile(_blocks()[index], f"README block {index}", "exec"), given)
    out = capsys.readouterr().out
    if index == 0:
        from gdn_fx import tract_check

        assert given["result"].counts["gated_delta_scan"] == 1, out
        found = tract_check.compare(tmp_path / "model.nnef.tgz",
                                    given["model"](*given["args"]), given["args"])
        assert found.ok, str(found)
    else:
        assert "every token equal" in out
