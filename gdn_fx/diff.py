"""Structural diff of two FX graphs (or NNEF exports), through networkx.

Each node gets a structural key: its op, target and literal arguments, plus the keys of its
inputs (graph inputs are keyed by name: a parameter's path, an argument's name). Nodes whose
key appears in both graphs are unchanged, whatever their names. Of the rest, a node present by
name in both graphs with the same local signature is "rewired" (it reads rewritten inputs);
with another signature it is "changed"; the remaining ones are "removed" or "added".
"""

from __future__ import annotations

import contextlib
import hashlib
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

import networkx as nx
import torch
from torch import fx

from gdn_fx.errors import GdnFxError, UnsupportedProgram
from gdn_fx.runtime.engine import nnef_text


def _graph_of(program: Any) -> fx.Graph:
    if isinstance(program, torch.export.ExportedProgram):
        return program.graph_module.graph
    if isinstance(program, fx.GraphModule):
        return program.graph
    if isinstance(program, fx.Graph):
        return program
    raise UnsupportedProgram(f"graph_diff takes ExportedProgram, GraphModule or Graph, got "
                             f"{type(program)}")


def _target_name(node: fx.Node) -> str:
    target = node.target
    name = target if isinstance(target, str) else getattr(target, "__name__", str(target))
    return str(target).replace("torch.ops.", "") if hasattr(target, "_schema") else name


def _literal(arg: Any) -> Any:
    return fx.node.map_arg(arg, lambda _: "<node>")


def local_signature(node: fx.Node) -> str:
    """Op, target and literal arguments: what a node is, apart from what it reads."""
    return f"{node.op}:{_target_name(node)}{_literal(node.args)}{_literal(node.kwargs)}"


def to_networkx(program: Any) -> nx.DiGraph:
    """The program's graph as a DiGraph; node attributes: op, target, signature, order.

    ``program`` is an ExportedProgram, GraphModule, fx.Graph, or already a DiGraph (as
    :func:`nnef_graph` makes).
    """
    if isinstance(program, nx.DiGraph):
        return program
    graph = nx.DiGraph()
    for order, node in enumerate(_graph_of(program).nodes):
        graph.add_node(node.name, op=node.op, target=_target_name(node),
                       signature=local_signature(node), order=order)
        for position, source in enumerate(node.all_input_nodes):
            graph.add_edge(source.name, node.name, position=position)
    return graph


def structural_keys(graph: nx.DiGraph) -> dict:
    """Name -> key that depends only on structure (not on node names)."""
    keys = {}
    for name in nx.topological_sort(graph):
        data = graph.nodes[name]
        own = f"input:{data['target']}" if data["op"] == "placeholder" else data["signature"]
        inputs = sorted(graph.in_edges(name, data="position"), key=lambda e: e[2])
        text = own + "|" + ",".join(keys[src] for src, _, _ in inputs)
        keys[name] = hashlib.sha1(text.encode()).hexdigest()[:16]
    return keys


@dataclass
class GraphDiff:
    """What changed from graph ``a`` to graph ``b``; ``str()`` gives a readable report."""

    added: list = field(default_factory=list)
    removed: list = field(default_factory=list)
    changed: list = field(default_factory=list)
    rewired: list = field(default_factory=list)
    ops_before: Counter = field(default_factory=Counter)
    ops_after: Counter = field(default_factory=Counter)

    def __bool__(self) -> bool:
        return bool(self.added or self.removed or self.changed or self.rewired)

    def op_delta(self) -> dict:
        """Target -> (count before, count after) for every target whose count moved."""
        names = set(self.ops_before) | set(self.ops_after)
        return {t: (self.ops_before[t], self.ops_after[t]) for t in sorted(names)
                if self.ops_before[t] != self.ops_after[t]}

    def __str__(self) -> str:
        total_a, total_b = sum(self.ops_before.values()), sum(self.ops_after.values())
        lines = [f"nodes {total_a} -> {total_b}: {len(self.removed)} removed, "
                 f"{len(self.added)} added, {len(self.changed)} changed, "
                 f"{len(self.rewired)} rewired"]
        lines += [f"  {t}: {a} -> {b}" for t, (a, b) in self.op_delta().items()]
        for title, items in (("added", self.added), ("changed", self.changed),
                             ("rewired", self.rewired)):
            if items:
                lines.append(f"{title}: " + ", ".join(items[:20])
                             + (f", ... ({len(items)} in all)" if len(items) > 20 else ""))
        return "\n".join(lines)


def graph_diff(a: Any, b: Any) -> GraphDiff:
    """Structural diff of two programs (ExportedProgram, GraphModule or fx.Graph)."""
    ga, gb = to_networkx(a), to_networkx(b)
    ka, kb = structural_keys(ga), structural_keys(gb)
    left, right = Counter(ka.values()), Counter(kb.values())
    common = left & right
    only_a = _unmatched(ka, ga, common)
    only_b = _unmatched(kb, gb, common)
    diff = GraphDiff(ops_before=_op_counts(ga), ops_after=_op_counts(gb))
    for name in sorted(set(only_a) & set(only_b), key=lambda n: gb.nodes[n]["order"]):
        same = ga.nodes[name]["signature"] == gb.nodes[name]["signature"]
        (diff.rewired if same else diff.changed).append(name)
    paired = set(diff.rewired) | set(diff.changed)
    diff.removed = [n for n in only_a if n not in paired]
    diff.added = [n for n in only_b if n not in paired]
    return diff


def _unmatched(keys: dict, graph: nx.DiGraph, common: Counter) -> list:
    """Node names whose structural key is not (or no longer) matched in the other graph."""
    budget = Counter(common)
    left = []
    for name in sorted(keys, key=lambda n: graph.nodes[n]["order"]):
        if budget[keys[name]] > 0:
            budget[keys[name]] -= 1
        else:
            left.append(name)
    return left


def _op_counts(graph: nx.DiGraph) -> Counter:
    return Counter(data["target"] for _, data in graph.nodes(data=True)
                   if data["op"] == "call_function")


_ASSIGN = re.compile(r"^\s*\(?([\w\s,]+?)\)?\s*=\s*([\w:]+)\s*(?:<[^>]*>)?\s*\((.*)\)\s*;\s*$")
_NAME = re.compile(r"[A-Za-z_]\w*")


def nnef_graph(path: Union[str, Path]) -> nx.DiGraph:
    """An NNEF export (folder, .tar or .tgz) as a DiGraph, comparable with :func:`graph_diff`.

    One node per assignment in ``graph.nnef`` (named after its results); its target is the NNEF
    op; attributes given as ``name = value`` make the signature; tensor arguments the edges.
    """
    graph, produced_by = nx.DiGraph(), {}
    for line in nnef_text(path).splitlines():
        found = _ASSIGN.match(line)
        if not found:
            continue
        outputs = [o.strip() for o in found.group(1).split(",")]
        op, args = found.group(2), found.group(3)
        name = ",".join(outputs)  # one node per assignment, even with several results
        graph.add_node(name, op="placeholder" if op == "external" else "call_function",
                       target=op, order=len(graph), signature=f"{op}({_attributes(args)})")
        inputs = [produced_by[n] for n in _NAME.findall(_strip_attributes(args))
                  if n in produced_by]
        for position, source in enumerate(inputs):
            graph.add_edge(source, name, position=position)
        produced_by.update({out: name for out in outputs})
    return graph


def _strip_attributes(args: str) -> str:
    return re.sub(r"\b\w+\s*=\s*(\[[^\]]*\]|\"[^\"]*\"|[^,()]+)", "", args)


def _attributes(args: str) -> str:
    return ",".join(m.group(0).replace(" ", "") for m in
                    re.finditer(r"\b\w+\s*=\s*(\[[^\]]*\]|\"[^\"]*\"|[^,()]+)", args))


def load_graph(path: Union[str, Path]) -> Any:
    """A saved program (``.pt2`` from torch.export.save) or an NNEF export, for diffing.
    UnsupportedProgram (one line) for anything else: a ``.pt2`` that is not a zip archive
    is refused before torch reads it, and torch's own report of a failed read (a logged
    traceback, warnings) is held back: the one line says it."""
    import zipfile

    path = Path(path)
    if path.suffix == ".pt2" and path.is_file() and not zipfile.is_zipfile(path):
        raise UnsupportedProgram(f"{path} is not a saved program (.pt2) or an NNEF export "
                                 "(folder, .nnef.tar, .nnef.tgz): not a zip archive, as "
                                 "torch.export.save writes one")
    logged: list = []
    try:
        if path.suffix == ".pt2":
            with _quiet_torch_export() as logged:
                return torch.export.load(str(path))
        return nnef_graph(path)
    except GdnFxError:
        raise
    except Exception as err:  # whatever the reader met: the file is not one of the two
        err = logged[0] if logged else err  # the reason torch logged, not "see above"
        detail = " ".join(str(err).split())[:200]
        raise UnsupportedProgram(f"{path} is not a saved program (.pt2) or an NNEF export "
                                 f"(folder, .nnef.tar, .nnef.tgz): {type(err).__name__}: "
                                 f"{detail}") from None


@contextlib.contextmanager
def _quiet_torch_export():
    """torch.export.load without its own reports: the failed deserialization it logs with a
    traceback (logger ``torch.export``, torch >= 2.13) and its warnings. Yields the list of
    the exceptions those log records carried (the reason of a failed read)."""
    import logging
    import warnings

    logger = logging.getLogger("torch.export")
    caught: list = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.exc_info and record.exc_info[1] is not None:
                caught.append(record.exc_info[1])

    saved = (logger.handlers[:], logger.propagate)
    logger.handlers[:] = [Keep()]
    logger.propagate = False
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield caught
    finally:
        logger.handlers[:], logger.propagate = saved
