"""Lowering of fused gdn_fx nodes to tract NNEF, through torch-to-nnef.

``table.TABLE`` lists, per op, the candidates in order (one module per candidate beside it);
``plan_lowering`` shows what an export would choose; ``write_nnef`` (write.py) is the one
entry point that writes the NNEF (``gdn_fx.export_nnef`` is its public face). What routes
around torch-to-nnef and tract lives in ``t2n/``. The native-operator surface shared with
torch-to-nnef's GDN path is re-exported here.
"""

from gdn_fx.lowering.gdn_native import (emit_native_gdn_recurrent, native_gdn_min_version,
                                        native_gdn_reject_reason)
from gdn_fx.lowering.plan import plan_lowering
from gdn_fx.lowering.table import TABLE, Candidate, Decision, decide
from gdn_fx.lowering.target import Target
from gdn_fx.lowering.write import write_nnef

__all__ = ["TABLE", "Candidate", "Decision", "Target", "decide", "emit_native_gdn_recurrent",
           "native_gdn_min_version", "native_gdn_reject_reason", "plan_lowering", "write_nnef"]
