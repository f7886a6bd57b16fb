"""Moved to :mod:`gdn_fx.hf.checkpoint`; this name stays one release for old imports (the
same module object: attributes set on either are seen by both)."""

import sys

from gdn_fx.hf import checkpoint as _moved

sys.modules[__name__] = _moved
