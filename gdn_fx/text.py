"""Moved to :mod:`gdn_fx.runtime.text`; this name stays one release for old imports (the
same module object: attributes set on either are seen by both)."""

import sys

from gdn_fx.runtime import text as _moved

sys.modules[__name__] = _moved
