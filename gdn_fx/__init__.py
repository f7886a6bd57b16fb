"""gdn-fx: collapse unrolled gated-delta-net recurrences into one op and lower it to tract."""

from gdn_fx import ops  # noqa: F401  (registers torch.ops.gdn_fx.*)
from gdn_fx.errors import GdnFxError

__all__ = ["GdnFxError", "ops"]
