"""``import gdn_fx`` is cheap (gdn_fx/__init__.py): it loads neither passes/ nor the differ
nor the generalize route until one of their names is used; the torch-to-nnef plug-in (an
entry point every torch-to-nnef export imports) loads no pass either. The core lowering
never imports its torch-to-nnef plumbing (lowering/t2n/)."""

import ast
import subprocess
import sys
from pathlib import Path

import gdn_fx


def test_import_loads_no_pass_and_names_resolve_on_use():
    code = ("import sys, gdn_fx; "
            "print(sorted(m for m in ('gdn_fx.passes', 'gdn_fx.diff', 'gdn_fx.generalization') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
    from gdn_fx.generalization import generalize
    from gdn_fx.passes import collapse

    assert gdn_fx.generalize is generalize and gdn_fx.collapse is collapse  # not the modules
    assert set(gdn_fx.__all__) <= set(dir(gdn_fx))


def test_unknown_name_is_an_attribute_error():
    try:
        gdn_fx.no_such_name
    except AttributeError as error:
        assert "no_such_name" in str(error)
    else:
        raise AssertionError("gdn_fx.no_such_name resolved")


def test_the_plugin_loads_no_pass():
    code = ("import sys, gdn_fx.lowering.t2n.plugin; "
            "print(sorted(m for m in sys.modules if m.startswith('gdn_fx.passes')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_core_lowering_imports_no_t2n_module():
    """t2n/ is built on the core (table, candidates, facts), never the other way; the
    package's own __init__ names t2n's write_nnef lazily, as its public face."""
    core = Path(__file__).resolve().parents[1] / "lowering"
    found = []
    for path in sorted(core.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else \
                [a.name for a in node.names] if isinstance(node, ast.Import) else []
            found += [f"{path.name}: {n}" for n in names if "lowering.t2n" in n]
    assert found == []
    assert len(list(core.glob("*.py"))) > 10  # the folder the check reads is the core
