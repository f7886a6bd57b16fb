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


class FamilyUnavailable(UnsupportedModel):
    """A tiny-model family the installed transformers release does not have (names both)."""


class UnknownName(GdnFxError, KeyError):
    """A name gdn-fx does not know, e.g. a lowering candidate (the message lists the known)."""

    def __str__(self) -> str:  # KeyError would print the message quoted
        return str(self.args[0]) if self.args else ""


class UnknownFamily(UnknownName):
    """A tiny-model family name gdn-fx does not know (the message lists the known ones)."""


class UsageError(GdnFxError, ValueError):
    """An argument (of a function or the command line) that cannot be used; the message says
    which and why."""


class ArgumentTypeError(GdnFxError, TypeError):
    """An argument of the wrong kind (e.g. ``choose`` not a dict); the message says which."""


class MissingFile(GdnFxError, FileNotFoundError):
    """A file gdn-fx needs is not there (an NNEF graph, a fragment); the message names it."""


class RuntimeUnavailable(GdnFxError, RuntimeError):
    """A tract runtime (e.g. "cuda") that this machine does not have (no GPU, no driver); the
    message carries tract's own reason."""


class PatchError(GdnFxError, RuntimeError):
    """A swap of transformers' functions that cannot be applied or undone as asked."""


class GeneralizeRefused(ExportRefused):
    """Programs traced at fixed lengths that no single program symbolic in S and P can stand
    for (``gdn_fx.generalize``): the message names the node (a branch on the length, a
    literal that is not affine in S and P)."""


class InternalError(GdnFxError, AssertionError):
    """A broken invariant inside gdn-fx (a bug to report), never the user's input."""


class InputUnsupported(GdnFxError, NotImplementedError):
    """A well-formed input that gdn-fx does not handle yet (e.g. a batch of several prompts
    for the Generator); the message says what and what works instead."""


class ArtifactError(GdnFxError, ValueError):
    """An NNEF artifact that cannot serve as asked: tract cannot load it (missing, truncated,
    not NNEF), or it declares inputs the caller does not give; the message names the file."""


class ArtifactMismatch(ArtifactError):
    """Graphs used together that do not belong to one export: a main graph and a decode graph
    whose fingerprints (weights and config) or declared inputs differ."""


class CheckpointError(GdnFxError, ValueError):
    """A checkpoint folder that transformers could not load (a corrupt config.json, no weights,
    a truncated weights file); the message names the file and what is wrong with it."""


class CheckpointLayoutUnknown(CheckpointError):
    """A checkpoint that holds a parameter under a name or layout the streamed export does not
    read (transformers renames or merges it when it loads); the in-memory route reads it."""
