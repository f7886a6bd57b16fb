"""The export target: which tract release the NNEF is for, and whether axes are symbolic.

What tract's native operators accept changed across releases, so every lowering check reads
the target. Versions compare as integer tuples: ``Target.parse("0.23.9").version == (0, 23, 9)``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from gdn_fx.errors import ArgumentTypeError, UsageError

_VERSION = re.compile(r"^v?(\d+)\.(\d+)\.(\d+)(?:[-+.].*)?$")


def parse_version(text: str) -> tuple[int, int, int]:
    """``"0.23.9"`` (or ``"v0.23.9"``, ``"0.23.9-dev"``) -> ``(0, 23, 9)``."""
    match = _VERSION.match(text.strip())
    if match is None:
        raise UsageError(f"tract version {text!r} is not of the form MAJOR.MINOR.PATCH")
    major, minor, patch = (int(part) for part in match.groups())
    return major, minor, patch


def version_text(version: tuple[int, int, int]) -> str:
    """``(0, 23, 9)`` -> ``"0.23.9"``."""
    return ".".join(str(part) for part in version)


DYNAMIC_ATTRIBUTE = "gdn_fx_dynamic"  # set on a torch-to-nnef target by export_nnef


@dataclass(frozen=True)
class Target:
    """A tract release and whether the export declares symbolic (dynamic) axes.

    ``dynamic`` is True when any input axis is declared symbolic: a lowering then cannot rely
    on the traced extent of an axis (a node traced at S=1 may run at any S).
    """

    version: tuple[int, int, int]
    dynamic: bool = False

    @classmethod
    def parse(cls, version: str, dynamic: bool = False) -> "Target":
        """Build a target from a version string such as ``"0.23.9"``."""
        return cls(parse_version(version), dynamic)

    def at_least(self, version: str) -> bool:
        """True when this target's tract is ``version`` or newer."""
        return self.version >= parse_version(version)

    @property
    def version_text(self) -> str:
        """The version as ``"MAJOR.MINOR.PATCH"``."""
        return version_text(self.version)


def as_target(target) -> Target:
    """A ``Target`` from a ``Target``, a version string, or a torch-to-nnef ``TractNNEF``."""
    if isinstance(target, Target):
        return target
    if isinstance(target, str):
        return Target.parse(target)
    version = getattr(target, "version", None)
    if version is None or not hasattr(version, "to_str"):
        raise ArgumentTypeError(f"cannot read a tract version from {target!r}")
    # export_nnef records what it decided (only axes the program holds static are dynamic to
    # the lowering); a target made elsewhere counts every declared axis.
    dynamic = getattr(target, DYNAMIC_ATTRIBUTE, None)
    if dynamic is None:
        dynamic = bool(getattr(target, "dynamic_axes", None))
    return Target.parse(version.to_str(), dynamic=dynamic)
