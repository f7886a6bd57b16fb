"""A caller's say over the lowering table: force or forbid candidates per node.

The plain form (``choose=`` of ``gdn_fx.export_nnef``) is a dict whose keys are ``"*"`` (every
fused node), an op name (``"gated_delta_scan"``, ``"causal_conv1d_update"``) or a fused node's
fx name, and whose values are one candidate name to FORCE; the key ``"forbid"`` holds candidate
names to rule out, either a list (everywhere) or a dict of such keys to lists::

    {"*": "scan"}                                 every scan node takes "scan"
    {"gated_delta_scan_1": "native"}              that node must take "native"
    {"forbid": ["native"]}                        no native operator anywhere
    {"forbid": {"causal_conv1d_update": ["native"]}, "gated_delta_scan": "scan"}

A node key beats an op key, which beats ``"*"``; a ``"*"`` value only applies to ops that have
a candidate of that name. A forced candidate that its check rejects is an error, never a
silent fallback.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Optional

from gdn_fx.errors import ArgumentTypeError, UsageError

ALL = "*"
FORBID = "forbid"


@dataclass(frozen=True)
class Choice:
    """Parsed ``choose``: forced candidate per key, forbidden candidates per key."""

    force: Mapping[str, str] = field(default_factory=dict)
    forbid: Mapping[str, frozenset] = field(default_factory=dict)

    @classmethod
    def parse(cls, choose: Optional[Mapping]) -> "Choice":
        """Read the plain dict form documented in the module docstring."""
        if choose is None:
            return cls()
        if not isinstance(choose, Mapping):
            raise ArgumentTypeError(f"choose must be a dict, got {type(choose).__name__}")
        force = {str(k): v for k, v in choose.items() if k != FORBID}
        for key, value in force.items():
            if not isinstance(value, str):
                raise ArgumentTypeError(f"choose[{key!r}] must be one candidate name, got {value!r}")
        return cls(force=force, forbid=_parse_forbid(choose.get(FORBID)))

    def forced(self, node: str, op: str) -> Optional[str]:
        """The candidate forced on this node, if any (node > op > "*")."""
        for key in (node, op):
            if key in self.force:
                return self.force[key]
        return self.force.get(ALL)

    def forbidden(self, node: str, op: str) -> frozenset:
        """Every candidate name forbidden for this node."""
        return frozenset().union(*(self.forbid.get(key, ()) for key in (node, op, ALL)))

    def keys(self) -> set:
        """Every key the caller used (to check them against the program)."""
        return set(self.force) | set(self.forbid)


def _parse_forbid(value) -> dict:
    if value is None:
        return {}
    if isinstance(value, str):
        raise ArgumentTypeError("choose['forbid'] must be a list of candidate names or a dict of lists")
    if isinstance(value, Mapping):
        return {str(k): frozenset(_names(v, k)) for k, v in value.items()}
    return {ALL: frozenset(_names(value, ALL))}


def _names(value, key) -> list:
    names = [value] if isinstance(value, str) else list(value)
    if not all(isinstance(name, str) for name in names):
        raise ArgumentTypeError(f"choose['forbid'][{key!r}] must list candidate names, got {value!r}")
    return names


def validate(choice: Choice, nodes: Mapping[str, str], candidates: Mapping[str, tuple]) -> None:
    """Refuse keys and names that match nothing: a typo must not pass silently.

    ``nodes`` maps fused node names to op names; ``candidates`` op names to candidate names.
    """
    known = set(nodes) | set(candidates) | {ALL}
    unknown = sorted(choice.keys() - known)
    if unknown:
        raise UsageError(f"choose keys {unknown} name no fused node or op; fused nodes: "
                         f"{sorted(nodes)}, ops: {sorted(candidates)}")
    for key, name in choice.force.items():
        _check_names(key, [name], nodes, candidates)
    for key, names in choice.forbid.items():
        _check_names(key, names, nodes, candidates)


def _check_names(key: str, names, nodes, candidates) -> None:
    ops = {nodes[key]} if key in nodes else {key} if key in candidates else set(candidates)
    valid = set().union(*(candidates[op] for op in ops))
    wrong = sorted(set(names) - valid)
    if wrong:
        raise UsageError(f"choose[{key!r}]: no candidate named {wrong}; "
                         f"candidates: {sorted(valid)}")
