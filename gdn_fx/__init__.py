"""gdn-fx: collapse unrolled gated-delta-net recurrences into one op and lower it to tract.

    import gdn_fx
    result = gdn_fx.collapse(program)        # ExportedProgram or GraphModule, rewritten copy
    result.program, result.counts, result.misses
    gdn_fx.graph_diff(before, after)         # structural diff, readable with str()
    gdn_fx.compare_programs(before, after)   # None when they compute the same, else why
    gdn_fx.export_nnef(result.program, "model.nnef.tgz")   # NNEF for tract
    gdn_fx.generalize(trace)                 # one program symbolic in S, P from fixed traces
"""

from gdn_fx import ops  # noqa: F401  (registers torch.ops.gdn_fx.*)
from gdn_fx.diff import GraphDiff, graph_diff
from gdn_fx.errors import GdnFxError, GeneralizeRefused
from gdn_fx.export import export_nnef
from gdn_fx.generalize import Generalized, generalize
from gdn_fx.passes import CollapseResult, Miss, collapse, compare_programs, find_unrolled

__all__ = ["CollapseResult", "GdnFxError", "GeneralizeRefused", "Generalized", "GraphDiff", "Miss",
           "collapse", "compare_programs", "export_nnef", "generalize",
           "find_unrolled", "graph_diff", "ops"]
