"""The .nnef fragment files shipped in lowering/fragments/, as torch-to-nnef fragments.

A handler returns these objects; torch-to-nnef then writes each definition once into the
exported graph and declares the extensions the file lists.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from torch_to_nnef.op.fragment import Fragment

from gdn_fx.errors import MissingFile

FRAGMENT_DIR = Path(__file__).parent / "fragments"
CORE_EXTENSION = "tract_registry tract_core"


@lru_cache(maxsize=None)
def shipped(name: str) -> Fragment:
    """The fragment file ``fragments/<name>.nnef`` (all the fragments it defines)."""
    path = FRAGMENT_DIR / f"{name}.nnef"
    if not path.is_file():
        raise MissingFile(f"no NNEF fragment file {path}")
    return Fragment.load_file(path)


def generated(name: str, definition: str) -> Fragment:
    """A fragment written by code (e.g. one per kernel width), using tract_core ops."""
    return Fragment(name=name, extensions=(CORE_EXTENSION,), definition=definition.strip() + "\n\n")
