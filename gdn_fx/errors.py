"""The gdn-fx error hierarchy.

Every error derives from :class:`GdnFxError` and from the builtin it refines, so callers can
catch either ``GdnFxError`` or the familiar builtin (``ValueError``, ``TypeError``...).
"""


class GdnFxError(Exception):
    """Root of every error gdn-fx raises on purpose."""


class ShapeError(GdnFxError, ValueError):
    """An operand's shape breaks an op contract (the message names the operand and shape)."""


class DTypeError(GdnFxError, TypeError):
    """An operand's dtype breaks an op contract (the message names the operand and dtype)."""


class UnsupportedProgram(GdnFxError, TypeError):
    """The object handed to a pass or exporter is not a program gdn-fx can read."""


class LoweringUnsupported(GdnFxError, NotImplementedError):
    """No lowering candidate accepts a fused node (the message lists every candidate's reason)."""


class UnsupportedModel(GdnFxError, NotImplementedError):
    """A model (or a call it makes) that gdn-fx's transformers helpers cannot handle."""


class ExportRefused(GdnFxError, RuntimeError):
    """An export would be wrong for some input (e.g. a dynamic axis over an unrolled loop)."""


class UsageError(GdnFxError, ValueError):
    """A command-line argument that cannot be used (the message says which and why)."""
