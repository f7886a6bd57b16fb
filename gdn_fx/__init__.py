"""gdn-fx: collapse unrolled gated-delta-net recurrences into one op and lower it to tract.

    import gdn_fx
    result = gdn_fx.collapse(program)        # ExportedProgram or GraphModule, rewritten copy
    result.program, result.counts, result.misses
    gdn_fx.graph_diff(before, after)         # structural diff, readable with str()
    gdn_fx.compare_programs(before, after)   # None when they compute the same, else why
    gdn_fx.export_nnef(result.program, "model.nnef.tgz")   # NNEF for tract
    gdn_fx.generalize(trace)                 # one program symbolic in S, P from fixed traces
    gdn_fx.Generator("model.nnef.tgz")       # generate in tract (gdn_fx.runtime: no torch)

``import gdn_fx`` imports neither torch nor transformers: a machine that only runs exported
files needs tract, numpy and tokenizers (gdn_fx.runtime). Where torch is already imported
(an exporting process), the fused ops ``torch.ops.gdn_fx.*`` are registered at once, so a
program holding them loads and runs; every module that builds them imports gdn_fx.ops itself.
"""

import importlib
import sys

from gdn_fx.errors import GdnFxError, GeneralizeRefused

if "torch" in sys.modules:
    from gdn_fx import ops  # noqa: F401  (registers torch.ops.gdn_fx.*)

# Each public name and the module that defines it, imported on first use: the torch-to-nnef
# plug-in (an entry point, imported by every torch-to-nnef export on the machine) and the CLI
# then pay only for what they run, not for passes/ (networkx, torch.export) and the differ.
_WHERE = {
    "CollapseResult": "gdn_fx.passes", "Miss": "gdn_fx.passes", "collapse": "gdn_fx.passes",
    "compare_programs": "gdn_fx.passes", "find_unrolled": "gdn_fx.passes",
    "GraphDiff": "gdn_fx.diff", "graph_diff": "gdn_fx.diff",
    "export_nnef": "gdn_fx.export", "ExportOptions": "gdn_fx.lowering.options",
    "Generalized": "gdn_fx.generalization", "generalize": "gdn_fx.generalization",
    "Generator": "gdn_fx.runtime", "GenerationResult": "gdn_fx.runtime",
    "BatchGenerator": "gdn_fx.runtime",
}


def __getattr__(name: str):
    """A public name from its module (``_WHERE``), or a submodule (``gdn_fx.passes``), on
    first use. No public name is also a submodule's name: importing that submodule would
    rebind the package attribute to it (why gdn_fx.generalize lives in generalization.py)."""
    if name in _WHERE:
        value = getattr(importlib.import_module(_WHERE[name]), name)
    else:
        try:
            value = importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as error:
            if error.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))


__all__ = ["BatchGenerator", "CollapseResult", "ExportOptions", "GdnFxError", "GeneralizeRefused", "Generalized",
           "GenerationResult", "Generator", "GraphDiff", "Miss",
           "collapse", "compare_programs", "export_nnef", "generalize",
           "find_unrolled", "graph_diff", "ops"]
