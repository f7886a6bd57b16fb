"""What a collapse returns: the rewritten program, fusion counts and near-misses."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional


# What left a region alone: a rule's own checks (its structure, its meaning in float64, the
# op's contract), or translation validation (the rewrite ran and disagreed with the program).
CHECK_FAILED = "check failed"
VALIDATION_FAILED = "validation failed"


@dataclass(frozen=True)
class Miss:
    """Why a candidate region was left as it was.

    ``rule`` is the op the region could have become; ``step``/``of`` locate the timestep in an
    unrolled loop when that is known; ``node`` names the graph node where the check failed;
    ``kind`` says which check it was (``CHECK_FAILED`` or ``VALIDATION_FAILED``).
    """

    rule: str
    reason: str
    node: Optional[str] = None
    step: Optional[int] = None
    of: Optional[int] = None
    kind: str = CHECK_FAILED

    def __str__(self) -> str:
        where = []
        if self.step is not None:
            where.append(f"step {self.step}" + (f" of {self.of}" if self.of is not None else ""))
        if self.node is not None:
            where.append(f"node {self.node}")
        place = f" ({', '.join(where)})" if where else ""
        return f"{self.rule}{place}: {self.reason}"


class NoMatch(Exception):
    """Raised inside a rule's checks; the rule turns it into a :class:`Miss`."""

    def __init__(self, reason: str, node: Any = None, step: Optional[int] = None):
        super().__init__(reason)
        self.reason = reason
        self.node = getattr(node, "name", node)
        self.step = step


@dataclass
class CollapseResult:
    """Result of :func:`gdn_fx.collapse`.

    ``program`` is the rewritten program, of the same kind as the input; ``counts`` maps each
    fused op name to the number of nodes created; ``misses`` lists the near-misses.
    """

    program: Any
    counts: dict = field(default_factory=dict)
    misses: list = field(default_factory=list)

    def explain(self) -> str:
        """A short human-readable summary: counts, then one line per near-miss."""
        lines = [", ".join(f"{name}: {n}" for name, n in self.counts.items())]
        lines += [f"  near-miss: {miss}" for miss in self.misses]
        return "\n".join(lines)
