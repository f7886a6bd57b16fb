"""mkdocs hook: the package tree as installed, for the reference pages.

``passes/`` and ``lowering/`` are installed as ``gdn_fx.passes`` and ``gdn_fx.lowering``
(pyproject's package-dir); mkdocstrings reads sources from folders and does not follow that
mapping, so the tree it reads is built here: ``build/docs_src/gdn_fx`` holds links to
``gdn_fx/``'s entries and to ``passes/`` and ``lowering/`` under their installed names."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TREE = ROOT / "build" / "docs_src" / "gdn_fx"
PLACED = {"passes": ROOT / "passes", "lowering": ROOT / "lowering"}


def on_startup(**_):
    TREE.mkdir(parents=True, exist_ok=True)
    for link in TREE.iterdir():
        link.unlink()
    entries = {p.name: p for p in (ROOT / "gdn_fx").iterdir() if p.name != "__pycache__"}
    for name, target in {**entries, **PLACED}.items():
        (TREE / name).symlink_to(target)
