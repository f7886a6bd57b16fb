"""Lowering of fused gdn_fx nodes to tract NNEF, through torch-to-nnef.

``table.TABLE`` lists, per op, the candidates in order (one module per candidate beside it);
``plan_lowering`` shows what an export would choose; ``write_nnef`` (t2n/write.py) is the one
entry point that writes the NNEF (``gdn_fx.export_nnef`` is its public face). What routes
around torch-to-nnef and tract lives in ``t2n/``. The native-operator surface shared with
torch-to-nnef's GDN path is re-exported here.
"""

import importlib

# Each public name and its module, imported on first use: the torch-to-nnef plug-in (an entry
# point: every torch-to-nnef export on the machine imports it, and this package with it)
# then loads the table and its candidates only, not write.py and through it passes/.
_WHERE = {
    "emit_native_gdn_recurrent": "gdn_native", "native_gdn_min_version": "gdn_native",
    "native_gdn_reject_reason": "gdn_native", "plan_lowering": "plan", "TABLE": "table",
    "Candidate": "table", "Decision": "table", "decide": "table", "Target": "target",
    "write_nnef": "t2n.write",
}


def __getattr__(name: str):
    """A public name from its module (``_WHERE``) on first use; submodules as usual."""
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))


__all__ = ["TABLE", "Candidate", "Decision", "Target", "decide", "emit_native_gdn_recurrent",
           "native_gdn_min_version", "native_gdn_reject_reason", "plan_lowering", "write_nnef"]
