"""The export options: one frozen record that every export route takes and passes down whole.

``gdn_fx.export_nnef``, ``export_generator`` (one graph, the pair, the batched graph),
``export_generalized``, ``export_nnef_dynamic``, ``export_checkpoint`` and ``plan_lowering``
take ``options=ExportOptions(...)`` or the same fields as keywords (``weights="q4_0"``), and
hand the one record on; its defaults, the tract version's included, are written here only.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Mapping, Optional

from gdn_fx.errors import UsageError
from gdn_fx.lowering.target import Target, check_runtime

TRACT_VERSION = "0.23.9"  # the tract release an export is written for, unless told
FORMATS = ("f32", "f16", "q4_0")  # how the weights are stored (lowering/t2n/weights.py)
Q4_GROUP = 32  # tract's Q4_0 block: 32 weights along the reduction axis


def check_format(weights: str) -> str:
    """``weights`` when it names a format, else UsageError listing the formats."""
    if weights not in FORMATS:
        raise UsageError(f"weights={weights!r} is not a weight format; use one of "
                         f"{', '.join(FORMATS)}")
    return weights


@dataclass(frozen=True)
class ExportOptions:
    """How an export lowers and stores a program.

    weights: "f32", "f16" or "q4_0" (``gdn_fx.export_nnef`` says what each stores);
    runtime: the tract runtime it is lowered for, "cpu" or "cuda";
    choose: candidates forced or forbidden (``gdn_fx.export_nnef``; lowering/choice.py);
    tract_version: the tract release it is written for;
    symbol_min: {symbol: lower bound} declared to tract (every other symbol is >= 1);
    serves_decode: False for a graph that never runs decode's one-token calls (a main /
    decode pair's main graph, ``export_generator(decode=True)``; lowering/target.py).
    Checked when made: a value no route takes is one UsageError.
    """

    weights: str = "f32"
    runtime: str = "cpu"
    choose: Optional[Mapping] = None
    tract_version: str = TRACT_VERSION
    symbol_min: Mapping[str, int] = field(default_factory=dict)
    serves_decode: bool = True

    def __post_init__(self):
        check_format(self.weights)
        check_runtime(self.runtime)
        Target.parse(self.tract_version)  # a version string tract releases are named by

    @classmethod
    def of(cls, options: Optional["ExportOptions"] = None, **fields) -> "ExportOptions":
        """``options`` (default: every default) with ``fields`` set; a name that is no
        field is a UsageError naming the fields."""
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(fields) - set(names))
        if unknown:
            raise UsageError(f"unknown export option {', '.join(unknown)}; the options are "
                             f"{', '.join(names)}")
        return dataclasses.replace(options or cls(), **fields)

    def target(self, dynamic: bool = False) -> Target:
        return Target.parse(self.tract_version, dynamic=dynamic, runtime=self.runtime,
                            serves_decode=self.serves_decode)
