"""What a gdn-fx artifact declares to whoever runs it: the writers (lowering/, gdn_fx.hf)
stamp these names into graph.nnef, the runtime reads them back.

- tract properties (``extension tract_property``): the export's fingerprint, the vocabulary,
  the decode graph's file name, the runtime it was lowered for, the most tokens one call
  may take;
- input declarations (``tract_core_external``): name, dims (ints or symbols), datum type;
- the attention caches, whose past axis is the symbol P in a generation-ready export.
"""

from __future__ import annotations

import re

from gdn_fx.errors import UsageError

FINGERPRINT = "gdn_fx_fingerprint"  # tract property: the weights and config a graph serves
VOCAB = "gdn_fx_vocab"  # tract property: rows of the input embedding (valid ids: [0, VOCAB))
DECODE = "gdn_fx_decode"  # tract property of a main graph: its decode graph's file name, or ""
# tract property: the most tokens one call may take (set where a candidate computes a fixed
# window, lowering/plan.max_tokens; the generator cuts prompts to it)
MAX_TOKENS = "gdn_fx_max_tokens"

RUNTIMES = ("cpu", "cuda")  # the tract runtimes gdn-fx lowers for and runs on


def check_runtime(runtime: str) -> str:
    """``runtime`` if it is one gdn-fx lowers for ("cpu", "cuda"), else UsageError."""
    if runtime not in RUNTIMES:
        raise UsageError(f"runtime {runtime!r} is not one of {', '.join(RUNTIMES)}")
    return runtime


# An input as graph.nnef declares it: name, dims ("1, S" or "1, 2, P, 8"), datum type.
EXTERNAL = re.compile(r"(\w+) = tract_core_external\(shape = \[([^\]]*)\], "
                      r"datum_type = '(\w+)'\)")
DATUM = {"f32": "float32", "f16": "float16", "f64": "float64", "i64": "int64"}  # numpy names

# DecodeStep's attention caches (gdn_fx.hf.states.KINDS: key, value, indexer_key), whose
# past axis is P in a generation-ready export and a number in a one-step export.
PAST_INPUT = re.compile(r"(key|value|indexer_key)_\d+")
