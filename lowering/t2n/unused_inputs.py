"""Program inputs that nothing reads stay inputs of the NNEF, in their place.

torch-to-nnef 0.24.12 leaves out of the NNEF every traced input with no use, then finds fewer
graph inputs than ``input_names``, prints the whole traced graph to stdout and raises (or,
without names, renames the remaining inputs after the wrong ones). A program keeps an unread
input when a model takes an argument it ignores (a mask at S = 1, a state a layer type does
not need), and a caller that feeds the program's inputs in order expects the NNEF to take the
same ones. So the export hands torch-to-nnef only the names of the inputs that are read, and
afterwards declares each unread one in graph.nnef (``tract_core_external`` with its shape and
dtype, symbols where ``dynamic_axes`` puts them) at its place in the signature. tract accepts
such an input and ignores its value.
"""

from __future__ import annotations

import io
import re
import shutil
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional

import torch
import torch.fx as fx

from gdn_fx.errors import ExportRefused

GRAPH_FILE = "graph.nnef"
_SIGNATURE = re.compile(r"^graph (\w+)\(([^)]*)\) -> \(", re.MULTILINE)
_EXTERNAL = re.compile(r"^\s*(\w+) = tract_core_external\(")


@dataclass(frozen=True)
class UnusedInput:
    """An input no node reads: its NNEF name, declared shape (ints or symbols) and datum."""

    name: str
    shape: tuple
    datum: str

    def declaration(self) -> str:
        dims = ", ".join(str(d) for d in self.shape)
        return f"    {self.name} = tract_core_external(shape = [{dims}], " \
               f"datum_type = '{self.datum}');"


def unused_inputs(module: fx.GraphModule, names: list, examples: tuple,
                  dynamic_axes: Optional[Mapping]) -> list[UnusedInput]:
    """The inputs of ``module`` no node reads (``names``: their NNEF names, in order)."""
    from torch_to_nnef.dtypes import TORCH_DTYPE_TO_TRACT_STR

    placeholders = [n for n in module.graph.nodes if n.op == "placeholder"]
    found = []
    for node, name, example in zip(placeholders, names, examples):
        if node.users or not isinstance(example, torch.Tensor):
            continue
        axes = (dynamic_axes or {}).get(name) or {}
        shape = tuple(axes.get(axis, size) if isinstance(axes, Mapping) else size
                      for axis, size in enumerate(example.shape))
        found.append(UnusedInput(name, shape, TORCH_DTYPE_TO_TRACT_STR[example.dtype]))
    return found


def drop_unused(module: fx.GraphModule) -> int:
    """Remove the placeholders no node reads from ``module`` (in place); how many: traced
    without them, torch-to-nnef names the inputs it keeps after the right arguments."""
    unread = [n for n in module.graph.nodes if n.op == "placeholder" and not n.users]
    for node in unread:
        module.graph.erase_node(node)
    if unread:
        module.graph.lint()
        module.recompile()
    return len(unread)


def declare_unused(text: str, unused: list[UnusedInput], names: list) -> str:
    """``text`` (graph.nnef) with each of ``unused`` declared and put back in the signature at
    its place in ``names``; tract symbols they alone carry are declared too."""
    match = _SIGNATURE.search(text)
    if match is None:
        raise ExportRefused("torch-to-nnef wrote a graph.nnef without a 'graph name(...) -> "
                            f"(...)' signature: cannot declare the unread inputs {sorted(u.name for u in unused)}")
    present = [s.strip() for s in match.group(2).split(",") if s.strip()]
    missing = {u.name for u in unused}
    order = [n for n in names if n in present or n in missing]
    order += [n for n in present if n not in order]  # anything torch-to-nnef added
    start, end = match.span(2)
    text = text[:start] + ", ".join(order) + text[end:]
    # tract numbers the inputs in the order of their declarations in the body (not of the
    # signature): each one goes before the declaration of the next input that has one.
    lines = text.split("\n")
    for item in unused:
        declared = {m.group(1): i for i, line in enumerate(lines)
                    if (m := _EXTERNAL.match(line))}
        later = [declared[n] for n in order[order.index(item.name) + 1:] if n in declared]
        if later:
            at = later[0]
        elif declared:
            at = max(declared.values()) + 1
        else:  # no other input: right after the graph's opening brace
            at = next(i for i, line in enumerate(lines) if line.strip() == "{"
                      and i > text[:match.start()].count("\n")) + 1
        lines.insert(at, item.declaration())
    text = "\n".join(lines)
    symbols = sorted({d for u in unused for d in u.shape if isinstance(d, str)})
    new = [s for s in symbols if f"extension tract_symbol {s};" not in text]
    if new:
        head = text.index("\n") + 1  # after "version 1.0;"
        text = text[:head] + "".join(f"extension tract_symbol {s};\n" for s in new) + text[head:]
    return text


def rewrite_graph_file(path: Path, edit) -> None:
    """Apply ``edit`` (str -> str) to graph.nnef in the export at ``path`` (folder or tar)."""
    if path.is_dir():
        target = path / GRAPH_FILE
        target.write_text(edit(target.read_text()))
        return
    with tempfile.NamedTemporaryFile(dir=path.parent, delete=False, suffix=".tmp") as handle:
        temporary = Path(handle.name)
    try:
        with tarfile.open(path) as source, tarfile.open(temporary, "w") as dest:
            for member in source.getmembers():
                data = source.extractfile(member) if member.isfile() else None
                if Path(member.name).name == GRAPH_FILE and data is not None:
                    body = edit(data.read().decode("utf8")).encode("utf8")
                    member.size = len(body)
                    data = io.BytesIO(body)
                dest.addfile(member, data)
        shutil.move(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
