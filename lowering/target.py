"""The export target: which tract release the NNEF is for, whether axes are symbolic, and which
tract runtime runs it ("cpu", the default, or "cuda": ``tract.runtime_for_name("cuda")``).

What tract's native operators accept changed across releases, and what runs fast (or runs on
the GPU at all) differs between runtimes, so every lowering check reads the target.
Versions compare as integer tuples: ``Target.parse("0.23.9").version == (0, 23, 9)``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from gdn_fx.errors import ArgumentTypeError, UsageError
# the runtimes and the max-tokens property are the artifact's contract with its runtime
from gdn_fx.contract import MAX_TOKENS, RUNTIMES, check_runtime  # noqa: F401

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
RUNTIME_ATTRIBUTE = "gdn_fx_runtime"  # likewise; also the NNEF property naming the runtime


@dataclass(frozen=True)
class Target:
    """A tract release, whether the export declares symbolic (dynamic) axes, and the runtime.

    ``dynamic`` is True when any input axis is declared symbolic: a lowering then cannot rely
    on the traced extent of an axis (a node traced at S=1 may run at any S). ``runtime`` is
    "cpu" or "cuda" (the table's order and device checks follow it). ``serves_decode`` is
    False for a graph that never runs the one-token calls of decode (a main / decode pair's
    main graph): a candidate slow at S = 1 may then serve its symbolic S.
    """

    version: tuple[int, int, int]
    dynamic: bool = False
    runtime: str = "cpu"
    serves_decode: bool = True

    def __post_init__(self):
        check_runtime(self.runtime)

    @classmethod
    def parse(cls, version: str, dynamic: bool = False, runtime: str = "cpu",
              serves_decode: bool = True) -> "Target":
        """Build a target from a version string such as ``"0.23.9"``."""
        return cls(parse_version(version), dynamic, runtime, serves_decode)

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
    runtime = getattr(target, RUNTIME_ATTRIBUTE, "cpu")
    return Target.parse(version.to_str(), dynamic=dynamic, runtime=runtime)
