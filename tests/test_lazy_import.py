"""``import gdn_fx`` is cheap (gdn_fx/__init__.py): it loads neither passes/ nor the differ
nor the generalize route until one of their names is used. (The torch-to-nnef plug-in still
reaches passes/ through lowering/t2n: issue 33's boundary item, open.)"""

import subprocess
import sys

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
