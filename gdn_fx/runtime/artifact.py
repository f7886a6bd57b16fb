"""A generation-ready artifact as the runtime loads it: its graphs in tract, what they declare
(inputs, bounds, gdn-fx's properties), and the checks made before anything reaches tract.

    graph = load_graph("out/q.nnef.tgz")      # LoadedGraph: runnable, inputs, bounds, ...
    generation_problem(graph)                  # '' for the main graph of a generator export
    check_pair(main, decode)                   # a decode graph of the same export, or refused
    zero_states(graph.text)                    # the caches of a first prefill (P = 0)

Needs tract and numpy only (no torch): gdn_fx.runtime.
"""

from __future__ import annotations

import numbers
import re
import sys
import tarfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional, Sequence, Union

import numpy as np

from gdn_fx import contract
from gdn_fx.contract import DECODE, EXTERNAL, FINGERPRINT, MAX_TOKENS, PAST_INPUT
from gdn_fx.errors import ArtifactError, ArtifactMismatch, InputUnsupported, MissingFile, UsageError
from gdn_fx.runtime import engine

DATUM = {name: np.dtype(numpy) for name, numpy in contract.DATUM.items()}


def decode_path(path: Union[str, Path]) -> Path:
    """``X.decode.nnef.tgz`` for ``X.nnef.tgz`` (the same rule for .nnef.tar and .nnef)."""
    path = Path(path)
    for suffix in (".nnef.tgz", ".nnef.tar", ".nnef"):
        if path.name.endswith(suffix):
            return path.with_name(path.name[: -len(suffix)] + ".decode" + suffix)
    raise UsageError(f"NNEF path {path} must end with .nnef.tgz, .nnef.tar or .nnef")


class UnverifiedPair(UserWarning):
    """A main / decode pair without fingerprints (exported before gdn-fx stamped its graphs,
    or written by hand with ``export_nnef``): their shapes are
    checked, whether they hold the same weights cannot be. Warned, not refused: such pairs
    were checked against each other when they were written (``decode_problem``)."""


@dataclass(frozen=True)
class LoadedGraph:
    """One NNEF graph as tract loaded it, with what the Generator checks before each call:
    its declared inputs (name, dims, datum type), the bounds it asserts on its symbols
    (``extension tract_assert S >= 1``) and gdn-fx's tract properties."""

    path: Path
    runnable: object
    text: str  # graph.nnef
    inputs: tuple  # ((name, (dim, ...), datum), ...): dims are ints or symbol expressions
    bounds: tuple  # ((symbol, operator, value), ...)
    properties: dict  # gdn_fx_* properties: fingerprint, vocab, decode
    logits_width: int  # the last axis of the first output (the vocabulary, for old exports)
    input_names: tuple = ()  # every input as tract names them (also those not declared above)

    @property
    def fingerprint(self) -> Optional[str]:
        return self.properties.get(FINGERPRINT)

    @property
    def max_tokens(self) -> Optional[int]:
        """The most tokens one call may take (a windowed candidate's), None: no bound."""
        window = self.properties.get(MAX_TOKENS, "")
        return int(window) if window.isdigit() else None

    def describe(self, index: int) -> str:
        name, dims, datum = self.inputs[index]
        return f"{name} [{', '.join(map(str, dims))}] {datum}"


_ASSERT = re.compile(r"extension tract_assert (\w+) *(>=|<=|>|<|==) *(-?\d+);")
_COMPARE = {">=": lambda a, b: a >= b, "<=": lambda a, b: a <= b, ">": lambda a, b: a > b,
            "<": lambda a, b: a < b, "==": lambda a, b: a == b}


# tract-transformers' model transform that folds each `cat(past, new)` read by a graph output
# (an attention cache) into a stateful DynKeyValueCache op: the State keeps that cache (on the
# GPU under tract's CUDA runtime) and the graph loses those inputs and outputs.
KV_IN_STATE = "detect_kv_cache"


def load_graph(path: Union[str, Path], runtime: str = "cpu",
               kv_in_state: bool = False) -> LoadedGraph:
    """Load ``path`` in tract for ``runtime`` ("cpu", or "cuda": prepared by tract's CUDA
    runtime) and read its declarations; one-line errors (MissingFile, ArtifactError) for a
    file that is not there or that tract cannot load (truncated, not NNEF): tract's own
    reason, first lines only; RuntimeUnavailable, with tract's reason, where tract has no
    such runtime. ``kv_in_state``: the attention caches are folded into the State
    (``KV_IN_STATE``); the graph's ``inputs`` are then the ones left."""
    import tract

    path = Path(path)
    if not path.exists():
        raise MissingFile(f"NNEF {path} does not exist")
    try:
        names: list = []
        runnable = engine.load(path, runtime, (KV_IN_STATE,) if kv_in_state else (),
                                    names)
        text = engine.nnef_text(path)
    except (tract.TractError, OSError, EOFError, tarfile.TarError, UnicodeDecodeError) as error:
        raise ArtifactError(f"tract cannot load {path}: {_first_lines(error)}") from None
    inputs = tuple((name, tuple(_dim(d) for d in dims.split(",")), datum)
                   for name, dims, datum in EXTERNAL.findall(text) if name in names)
    bounds = tuple((sym, op, int(value)) for sym, op, value in _ASSERT.findall(text))
    properties = {key: value for key, value in _PROPERTY.findall(text)}
    logits = str(runnable.output_fact(0)).split(",")
    width = int(logits[-2]) if len(logits) >= 2 and logits[-2].isdigit() else 0
    return LoadedGraph(path, runnable, text, inputs, bounds, properties, width, tuple(names))


_PROPERTY = re.compile(r'\(\s*"(gdn_fx_\w+)"\s*,\s*"([^"]*)"\s*\)')


def _dim(text: str) -> Union[int, str]:
    text = text.strip()
    return int(text) if text.lstrip("-").isdigit() else text


def _first_lines(error: BaseException) -> str:
    """An error's text without tract's stack backtrace, on one line: its whole chain of
    causes, the root cause kept when it is long (``engine.error_text``)."""
    return engine.error_text(error)


WRITES_ONE = "`gdn-fx export` without --seq-len writes one"


def generation_problem(graph: LoadedGraph) -> str:
    """Why ``graph`` is not the main graph of a generation-ready export ('' when it is): it
    must take ``input_ids [B, S]`` (i64, S symbolic) first, then its caches, attention caches
    over a symbolic past, and give the logits and one new state per cache. A one-step
    export (--seq-len N, --dynamic-seq), an export's decode graph alone or an NNEF of
    another program would run wrong or fail inside tract (a Rust backtrace)."""
    if not graph.inputs:  # none declared as gdn-fx declares its inputs (tract_core_external)
        if not graph.input_names:
            return "it takes no inputs"
        return (f"its first input is {graph.input_names[0]} "
                f"({graph.runnable.input_fact(0)}), where a generation-ready export takes "
                "input_ids [B, S] i64, then its caches (an NNEF of another program)")
    name, dims, datum = graph.inputs[0]
    if name != "input_ids" or len(dims) != 2 or datum != "i64":
        return (f"its first input is {graph.describe(0)}, where a generation-ready export "
                "takes input_ids [B, S] i64, then its caches (an NNEF of another program)")
    tokens = dims[1]
    if isinstance(tokens, int):
        if graph.fingerprint and DECODE not in graph.properties:
            return (f"it is the decode graph of an export (input_ids [{dims[0]}, {tokens}]): "
                    "give the main graph it was written beside")
        return (f"it takes {tokens} token(s) per call after a past of fixed length "
                f"(input_ids [{dims[0]}, {tokens}]): a one-step export (gdn-fx export "
                f"--seq-len {tokens})")
    fixed = [index for index, (name, dims, _) in enumerate(graph.inputs)
             if PAST_INPUT.fullmatch(name) and all(isinstance(d, int) for d in dims)]
    if fixed:
        return (f"its caches hold a past of fixed length ({graph.describe(fixed[0])}): a "
                "one-step export with a symbolic sequence (gdn-fx export --seq-len N "
                "--dynamic-seq)")
    try:
        outputs = graph.runnable.output_count()
    except Exception:  # noqa: BLE001 (a runtime's runnable without the count: not checked)
        return ""
    if outputs != len(graph.inputs):
        return (f"it gives {outputs} outputs for {len(graph.inputs)} inputs, where a "
                "generation-ready export gives the logits and one new state per cache")
    return ""


def check_pair(main: LoadedGraph, decode: LoadedGraph) -> None:
    """Refuse (ArtifactMismatch, one line) a decode graph that is not the main graph's: other
    fingerprints (other weights, config or weight storage), or other declared inputs than
    the main graph's at S = 1 (a model of other shapes: tract would fail mid-run, "Clashing
    resolution for expression"). A pair where neither graph has a fingerprint (exports
    before fingerprints) is let through with an UnverifiedPair warning: its shapes are
    checked, its weights cannot be."""
    if main.fingerprint != decode.fingerprint:
        if main.fingerprint and decode.fingerprint:
            raise ArtifactMismatch(
                f"the decode graph {decode.path} is not from the export of {main.path}: "
                f"fingerprints {decode.fingerprint[:19]}... and {main.fingerprint[:19]}... "
                "differ (other weights or config); re-export both, or let the main graph "
                "serve decode (gdn-fx generate --no-decode)")
        has, lacks = (main, decode) if main.fingerprint else (decode, main)
        raise ArtifactMismatch(f"{has.path} carries a fingerprint and {lacks.path} none: "
                               "not the two graphs of one export; re-export both")
    if len(decode.inputs) and len(decode.inputs[0][1]) == 2 and \
            not isinstance(decode.inputs[0][1][1], int):
        same = Path(decode.path).resolve() == Path(main.path).resolve()
        what = ("the main graph itself" if same else
                f"a main graph (it takes {decode.describe(0)}), not an S = 1 decode graph")
        raise ArtifactMismatch(f"the decode graph {decode.path} is {what}: leave it out "
                               "(Generator(main); one graph serves prefill and decode)")
    _check_same_inputs(main, decode)
    if main.fingerprint is None:
        warnings.warn(f"{main.path} and {decode.path} carry no fingerprint (written before "
                      "gdn-fx stamped its graphs, or not by export_generator / "
                      "export_generalized): their shapes match, whether they hold the same "
                      "weights cannot be checked", UnverifiedPair, stacklevel=3)


def _check_same_inputs(main: LoadedGraph, decode: LoadedGraph) -> None:
    """The decode graph must declare the main graph's inputs, ``input_ids`` at S = 1."""
    if len(main.inputs) != len(decode.inputs) or not main.inputs:
        raise ArtifactMismatch(f"the decode graph {decode.path} has {len(decode.inputs)} "
                               f"inputs, the main graph {main.path} {len(main.inputs)}: "
                               "graphs of other models")
    for index, (want, got) in enumerate(zip(main.inputs, decode.inputs)):
        if index == 0:  # input_ids [B, S] against [B, 1]
            want = (want[0], want[1][:-1] + (1,), want[2])
        if want != got:
            name, dims, datum = want
            expected = f"{name} [{', '.join(map(str, dims))}] {datum}"
            raise ArtifactMismatch(
                f"the decode graph {decode.path} declares {decode.describe(index)}, where "
                f"the main graph {main.path} needs {expected}: graphs of other shapes; "
                "re-export both")
    if main.logits_width != decode.logits_width:
        raise ArtifactMismatch(f"the decode graph {decode.path} gives {decode.logits_width} "
                               f"logits, the main graph {main.path} {main.logits_width}")


def check_bounds(values: Mapping[str, int], graph: LoadedGraph) -> None:
    """UsageError unless every bound that ``graph`` asserts on the symbols of ``values``
    holds (symbols ``values`` does not name are not checked)."""
    for symbol, operator, bound in graph.bounds:
        if symbol in values and not _COMPARE[operator](values[symbol], bound):
            raise UsageError(f"{symbol} = {values[symbol]} is outside what {graph.path} "
                             f"declares ({symbol} {operator} {bound})")


def prompt_list(prompt_ids, serves: str = "") -> list:
    """``prompt_ids`` (token ids: a list, array or tensor; ``[[...]]`` for a batch of one) as
    a list of ints. UsageError for anything but a non-empty list of ints; InputUnsupported
    for several prompts (a one-sequence artifact serves one; ``serves`` names it in the
    message, e.g. " for x.nnef.tgz, a one-sequence export")."""
    if hasattr(prompt_ids, "tolist"):  # a numpy array or a torch tensor
        prompt_ids = prompt_ids.tolist()
    if isinstance(prompt_ids, (str, bytes, Mapping)) or not hasattr(prompt_ids, "__iter__"):
        raise UsageError(f"prompt_ids must be a list of token ids, got "
                         f"{type(prompt_ids).__name__}")
    items = list(prompt_ids)
    if items and all(isinstance(x, (list, tuple)) for x in items):
        if len(items) > 1:
            raise InputUnsupported(f"batching is not supported yet: got {len(items)} prompts"
                                   f"{serves or ' for a one-sequence export'}, which serves "
                                   "one sequence per call: call "
                                   "generate once per prompt, or export with `gdn-fx export "
                                   "--batch N` (export_generator(..., batch=N)), whose "
                                   "BatchGenerator serves N sequences per call")
        items = list(items[0])
    for index, item in enumerate(items):
        if isinstance(item, bool) or not isinstance(item, numbers.Integral):
            raise UsageError(f"prompt_ids[{index}] is {item!r}, not a token id (an int)")
    if not items:
        raise UsageError("prompt_ids is empty: give at least one token id")
    return items


def _in_vocabulary(prompt: list, vocab: int) -> list:
    """``prompt`` unchanged, or UsageError naming the first id outside ``[0, vocab)`` (checked
    on Python ints: an id beyond int64 must not wrap around on the way to numpy)."""
    for index, token in enumerate(prompt):
        if not 0 <= token < vocab:
            raise UsageError(f"prompt id {token} (position {index}) is outside the vocabulary "
                             f"[0, {vocab})")
    return prompt


def _check_caches(caches: Sequence, graph: LoadedGraph) -> None:
    """As many caches as the graph declares after ``input_ids``, and each numpy array of
    the declared dtype and shape (a symbol takes one value across the caches); tract Tensors
    are outputs of an earlier call and pass as they are."""
    declared = graph.inputs[1:]
    if len(caches) != len(declared):
        raise UsageError(f"{graph.path} takes {len(declared)} caches after input_ids, got "
                         f"{len(caches)}")
    symbols: dict = {}
    for (name, dims, datum), cache in zip(declared, caches):
        if not isinstance(cache, np.ndarray):
            continue
        fits = cache.dtype == DATUM.get(datum) and cache.ndim == len(dims) and all(
            size == dim if isinstance(dim, int) else symbols.setdefault(dim, size) == size
            for size, dim in zip(cache.shape, dims))
        if not fits:
            raise UsageError(f"cache {name} is {cache.dtype} {list(cache.shape)}; {graph.path} "
                             f"declares [{', '.join(map(str, dims))}] {datum}")
    check_bounds(symbols, graph)


def zero_states(graph_text: str) -> list:
    """Zero caches for a first prefill, from the NNEF's input declarations (every input after
    ``input_ids``): P = 0 for attention caches, zeros of their shape for the other states."""
    found = EXTERNAL.findall(graph_text)
    zeros = []
    for name, dims, datum in found[1:]:
        shape = [0 if d.strip() == "P" else int(d) for d in dims.split(",")]
        zeros.append(np.zeros(shape, dtype=DATUM[datum]))
    return zeros


def _progress(done: int, total: int, width: int = 30) -> None:
    filled = width * done // total
    print(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} tokens", end="",
          file=sys.stderr, flush=True)
