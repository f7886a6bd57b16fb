"""The package's layers import one way (docs/architecture.md, "Layers"), and the runtime runs
without torch.

Every import counts, also those inside functions (the lazy ones): a module may import from
its own layer or the layers below, never above, and no two modules import each other, even
through others. Importing a submodule runs its packages' ``__init__`` too, so those count.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parent.parent
# Source folders and the package names they are installed as (pyproject.toml).
FOLDERS = {"gdn_fx": "gdn_fx", "passes": "gdn_fx.passes", "lowering": "gdn_fx.lowering"}

# Bottom first. A module belongs to the first layer with a prefix of its name.
LAYERS = [
    ("core", ("gdn_fx.errors", "gdn_fx.reference", "gdn_fx.ops", "gdn_fx.contract",
              "gdn_fx.memory")),
    ("passes", ("gdn_fx.passes",)),
    ("lowering", ("gdn_fx.lowering",)),
    # the runtime, and the names it had before it moved (aliases of its modules)
    ("runtime", ("gdn_fx.runtime", "gdn_fx.streaming", "gdn_fx.sampling", "gdn_fx.text",
                 "gdn_fx.parallel")),
    ("export", ("gdn_fx.hf", "gdn_fx.export", "gdn_fx.generalization", "gdn_fx.diff",
                "gdn_fx.tract_check", "gdn_fx.pipeline")),
    ("cli", ("gdn_fx.cli", "gdn_fx.cli_text", "gdn_fx.cli_checks", "gdn_fx.demo_text")),
]
FACADE = "gdn_fx"  # the package itself: public names resolved lazily from every layer


def modules() -> dict[str, Path]:
    """Every production module by its installed name."""
    found = {}
    for folder, package in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = [p for p in path.relative_to(ROOT / folder).with_suffix("").parts
                     if p != "__init__"]
            found[".".join([package, *parts])] = path
    return found


MODULES = modules()


def layer(name: str) -> int:
    for rank, (_, prefixes) in enumerate(LAYERS):
        if any(name == p or name.startswith(p + ".") for p in prefixes):
            return rank
    raise AssertionError(f"{name} is in no layer: add it to LAYERS (and docs/architecture.md)")


def _known(name: str):
    """``name`` or the module that defines it (``gdn_fx.hf.generator.Generator`` -> its
    module), None outside the package."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _with_parents(name: str) -> set:
    """The module and the packages whose ``__init__`` importing it runs."""
    parts = name.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts) + 1)} & set(MODULES)


def imports(name: str) -> set:
    """The package's modules ``name`` imports anywhere in its file (functions included)."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets.update(f"{base}.{alias.name}" for alias in node.names)
    found = set()
    for target in targets:
        module = _known(target) if target.startswith("gdn_fx") else None
        if module:
            found |= _with_parents(module)
    return found - _with_parents(name)  # its own packages run before it anyway


GRAPH = {name: imports(name) for name in MODULES}


def test_every_module_is_in_a_layer():
    for name in MODULES:
        if name != FACADE:
            layer(name)


def test_no_module_imports_from_a_layer_above_its_own():
    upward = [f"{name} ({LAYERS[layer(name)][0]}) imports {target} "
              f"({LAYERS[layer(target)][0]})"
              for name, targets in GRAPH.items() if name != FACADE
              for target in sorted(targets) if target != FACADE and layer(target) > layer(name)]
    assert not upward, "\n".join(upward)


def test_no_import_cycles():
    graph = nx.DiGraph([(a, b) for a, targets in GRAPH.items() for b in targets
                        if FACADE not in (a, b)])
    cycles = [sorted(c) for c in nx.strongly_connected_components(graph) if len(c) > 1]
    assert not cycles, cycles


def _at_import(statements) -> list:
    """The import statements among ``statements`` run when the module is imported (those in
    ``if`` / ``try`` blocks too, not those in functions or classes)."""
    found = []
    for node in statements:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        elif not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            for field in ("body", "orelse", "finalbody", "handlers"):
                found += _at_import(getattr(node, field, []))
    return found


def test_the_facade_imports_only_the_core_at_import_time():
    """gdn_fx/__init__.py resolves its public names on first use; what it imports at once
    is the core only, so ``import gdn_fx`` stays light."""
    eager = set()
    for node in _at_import(ast.parse(MODULES[FACADE].read_text()).body):
        names = [f"{node.module}.{a.name}" for a in node.names] \
            if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
        eager |= {_known(n) for n in names if n.startswith("gdn_fx")}
    assert eager and all(layer(m) == 0 for m in eager), eager


def test_the_check_sees_an_upward_import(tmp_path, monkeypatch):
    """The rule is not vacuous: a lowering module importing the runtime's generator, inside
    a function, is reported."""
    fake = tmp_path / "fake.py"
    fake.write_text("def f():\n    from gdn_fx.runtime.generator import Generator\n")
    monkeypatch.setitem(MODULES, "gdn_fx.lowering.fake", fake)
    targets = imports("gdn_fx.lowering.fake")
    assert "gdn_fx.runtime.generator" in targets
    assert layer("gdn_fx.runtime.generator") > layer("gdn_fx.lowering.fake")


# --- the runtime without torch ---------------------------------------------------------------

BLOCKER = """
import sys

class Blocked:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "transformers", "torch_to_nnef"):
            raise ImportError(f"{name} is blocked: the runtime must not import it")

sys.meta_path.insert(0, Blocked())
"""


def _without_torch(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run([sys.executable, "-c", BLOCKER + code], capture_output=True,
                          text=True, env=env, timeout=300)


def test_import_gdn_fx_imports_neither_torch_nor_transformers():
    done = _without_torch("import gdn_fx\nfrom gdn_fx import Generator, BatchGenerator\n"
                          "from gdn_fx.runtime import load_tokenizer\n"
                          "import gdn_fx.runtime.streaming, gdn_fx.runtime.parallel\n"
                          "import gdn_fx.runtime.batch\n"
                          "print(sorted(m for m in sys.modules if m.split('.')[0] in "
                          "('torch', 'transformers')))")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


@pytest.mark.slow
def test_the_runtime_generates_the_full_installs_tokens_without_torch(demo_nnef):
    """The demo artifact (conftest.py's, exported by the CLI) loaded and run from a text
    prompt, plain and in its chat template, with torch, transformers and torch-to-nnef
    blocked: the tokenizer is then read by the ``tokenizers`` package, and the prompt ids
    and the greedy tokens equal what this process (transformers' tokenizer) gives."""
    from gdn_fx.runtime import Generator, load_tokenizer
    from gdn_fx.runtime.text import prompt_ids, text_folder

    path = str(demo_nnef)
    folder = str(text_folder(demo_nnef))
    tokenizer = load_tokenizer(folder)
    assert type(tokenizer).__module__.startswith("transformers")
    generator = Generator(path)
    want = []
    for chat in (False, True):
        ids = prompt_ids(tokenizer, "The keeper of the north light", chat=chat)
        tokens = generator.generate(ids, max_new_tokens=12).tokens
        want.append([ids, tokens, tokenizer.decode(tokens, skip_special_tokens=True)])
    done = _without_torch(f"""
import json
from gdn_fx import Generator
from gdn_fx.runtime import load_tokenizer
from gdn_fx.runtime.text import prompt_ids
tokenizer = load_tokenizer({folder!r})
generator = Generator({path!r})
got = []
for chat in (False, True):
    ids = prompt_ids(tokenizer, "The keeper of the north light", chat=chat)
    tokens = generator.generate(ids, max_new_tokens=12).tokens
    got.append([ids, tokens, tokenizer.decode(tokens, skip_special_tokens=True)])
print(type(tokenizer).__name__)
print(json.dumps(got))
""")
    assert done.returncode == 0, done.stderr
    name, got = done.stdout.strip().split("\n")
    assert name == "FileTokenizer"
    import json

    assert json.loads(got) == want
