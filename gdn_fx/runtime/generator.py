"""Generation in tract from a gdn-fx artifact: prompt ids in, greedy tokens out, one tract
State per graph kept across calls (needs tract and numpy only, no torch).

    gen = Generator("out/q.nnef.tgz")                     # the export's main graph
    result = gen.generate(prompt_ids, max_new_tokens=64)  # greedy
    for piece in gen.stream("Once upon", tokenizer=tok):  # text, sampling, stop strings
        print(piece.text, end="")

The artifact's contract (inputs ``input_ids [B, S]`` then the caches; outputs the logits, then
each new state) is gdn_fx.hf.generator's; its declarations are read by
:mod:`gdn_fx.runtime.artifact`.
"""

from __future__ import annotations

import copy
import numbers
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Optional, Sequence, Union

import numpy as np

from gdn_fx.contract import DECODE, EXTERNAL, VOCAB, check_runtime
from gdn_fx.errors import ArtifactError, InputUnsupported, UsageError
from gdn_fx.runtime.artifact import (WRITES_ONE, LoadedGraph, _check_caches, _first_lines,
                                     _in_vocabulary, _progress, check_bounds, check_pair,
                                     decode_path, generation_problem, load_graph, prompt_list,
                                     zero_states)


@dataclass
class GenerationResult:
    """Greedy tokens and per-step last-position logits, with the time each phase took."""

    prompt: list
    tokens: list = field(default_factory=list)
    logits: list = field(default_factory=list)  # one [vocab] array per generated token
    prefill_s: float = 0.0
    decode_s: float = 0.0

    def rates(self) -> str:
        prefill = len(self.prompt) / self.prefill_s if self.prefill_s else float("nan")
        steps = len(self.tokens) - 1
        decode = steps / self.decode_s if self.decode_s and steps else float("nan")
        return (f"prefill {len(self.prompt)} tokens in {self.prefill_s * 1e3:.1f} ms "
                f"({prefill:.1f} tokens/s); decode {steps} tokens in "
                f"{self.decode_s * 1e3:.1f} ms ({decode:.1f} tokens/s)")


class Generator:
    """Greedy decoding in tract over a generator artifact (and its decode graph, if given).

    ``runtime`` is the tract runtime that runs the graphs: "cpu", or "cuda" (prepared with
    ``tract.runtime_for_name("cuda")``; RuntimeUnavailable, with tract's reason, where there
    is none); either runs any export, best the one lowered for it (``export_generator(...,
    runtime=)``); on "cuda" the default prompt chunk is the whole prompt (the L2 rule is a CPU
    matmul's, and every GPU call pays a fixed cost). ``kv_in_state=True`` (one graph only)
    folds the attention caches into the tract State (``KV_IN_STATE``): they stay there, on the
    GPU under CUDA, instead of travelling in and out on every call; the caches passed and
    returned are then the other states (conv, recurrent), and a call on numpy caches (a new
    sequence: the zero states) starts a fresh State.

    One tract State per graph is spawned once and kept across calls, as an application runs
    it; the cache travels as explicit tensors from one call's outputs to the next's inputs.
    A prompt longer than ``prefill_chunk`` tokens is fed in calls of that many (the artifact
    serves every S and P, so this computes the same): by default the longest chunk that keeps
    every projection's activations within the L2 cache (:func:`prefill_chunk`); ``None`` feeds
    the whole prompt in one call. A main graph that takes at most W tokens a call
    (``gdn_fx_max_tokens``: the CUDA pair's ``chunked_window``) caps the chunk at W.

    Nothing reaches tract unchecked: a decode graph not from the main graph's export is
    refused (:func:`check_pair`), and every call's token ids must lie in ``[0, vocab)`` (an id
    outside makes tract's gather panic and abort the process), with the batch and lengths the
    graphs declare; each refusal is one GdnFxError line.
    """

    def __init__(self, main: Union[str, Path], decode: Optional[Union[str, Path]] = None,
                 prefill_chunk: Union[int, str, None] = "auto", runtime: str = "cpu",
                 kv_in_state: bool = False):
        self.runtime = check_runtime(runtime)
        if kv_in_state and decode:
            raise UsageError("kv_in_state keeps the attention caches in one tract State: it "
                             "takes one graph, not a main / decode pair")
        self.main_graph = load_graph(main, runtime, kv_in_state)
        if self.main_graph.properties.get("gdn_fx_batch"):  # gdn_fx.hf.batch.BATCH
            raise ArtifactError(f"{main} is a batched artifact (B = "
                                f"{self.main_graph.properties['gdn_fx_batch']}): run it with "
                                "gdn_fx.hf.batch.BatchGenerator")
        problem = generation_problem(self.main_graph)
        if problem:
            raise ArtifactError(f"{main} is not a generation-ready export: {problem}; "
                                f"{WRITES_ONE}")
        self.decode_graph = load_graph(decode, runtime) if decode else self.main_graph
        if decode:
            check_pair(self.main_graph, self.decode_graph)
        self.main = self.main_graph.runnable.spawn_state()
        self.decode = self.decode_graph.runnable.spawn_state() if decode else self.main
        text = self.main_graph.text
        kept = {name for name, _, _ in self.main_graph.inputs}
        self.zero_states = [zero for (name, _, _), zero in
                            zip(EXTERNAL.findall(text)[1:], zero_states(text)) if name in kept]
        # caches the State holds (folded attention caches): a call on numpy caches starts a
        # new sequence, so it needs a State holding none
        self.kv_in_state = len(kept) < len(EXTERNAL.findall(text))
        vocab = self.main_graph.properties.get(VOCAB, "")
        self.vocab = int(vocab) if vocab.isdigit() else self.main_graph.logits_width
        if prefill_chunk == "auto":  # the lowering knows its scans' step (lowering/prefill.py)
            from gdn_fx.lowering.prefill import auto_prefill_chunk

            prefill_chunk = auto_prefill_chunk(text) if runtime == "cpu" else None
        if prefill_chunk is not None and (isinstance(prefill_chunk, bool) or not isinstance(
                prefill_chunk, numbers.Integral) or prefill_chunk < 1):
            raise UsageError(f"prefill_chunk must be an int >= 1 (or None), got "
                             f"{prefill_chunk!r}")
        window = self.main_graph.max_tokens  # a windowed main graph: calls of at most that
        if window is not None:
            prefill_chunk = min(prefill_chunk or window, window)
        self.prefill_chunk = prefill_chunk

    @classmethod
    def open(cls, main: Union[str, Path], use_decode: bool = True,
             prefill_chunk: Union[int, str, None] = "auto",
             runtime: str = "cpu", kv_in_state: bool = False) -> "Generator":
        """The export at ``main`` with the decode graph written beside it
        (``decode_path(main)``), as ``gdn-fx generate`` runs it. ArtifactError when the
        export had a decode graph (its main graph says so) that is not there; with
        ``use_decode=False`` the main graph serves decode."""
        decode = decode_path(main)
        if use_decode and decode.exists():
            return cls(main, decode, prefill_chunk, runtime, kv_in_state)
        generator = cls(main, None, prefill_chunk, runtime, kv_in_state)
        declared = generator.main_graph.properties.get(DECODE)
        if use_decode and declared:
            raise ArtifactError(f"{main} was exported with a decode graph (written as "
                                f"{declared}) and {decode} is missing: put it there, "
                                "re-export, or let the main graph serve decode (gdn-fx "
                                "generate --no-decode, Generator(main))")
        return generator

    def fork(self) -> "Generator":
        """A Generator over the same loaded graphs with tract States of its own: one per
        thread (a State is the scratch memory a call writes; the loaded model, tract's
        Runnable, is shared read-only, so a fork costs no second copy of the weights). tract's
        package calls its C library through ctypes, which releases the GIL for each call:
        forks in several threads run on several cores (gdn_fx.runtime.parallel)."""
        twin = copy.copy(self)
        twin.main = self.main_graph.runnable.spawn_state()
        twin.decode = twin.main if self.decode is self.main else \
            self.decode_graph.runnable.spawn_state()
        return twin

    def _graph_of(self, state) -> LoadedGraph:
        return self.decode_graph if state is self.decode else self.main_graph

    def check_ids(self, ids: np.ndarray, graph: Optional[LoadedGraph] = None,
                  prompt: bool = False) -> np.ndarray:
        """``ids`` as the int64 ``[B, S]`` that ``graph`` (default: the main graph) takes,
        else a one-line error: InputUnsupported for a batch other than the declared one,
        UsageError for another S, an S outside the asserted bounds, or an id outside
        ``[0, vocab)``. ``prompt``: ``ids`` is a whole prompt, fed in calls of at most
        ``prefill_chunk`` tokens: the longest call is checked against the bounds."""
        graph = graph or self.main_graph
        ids = np.asarray(ids)
        if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer):
            raise UsageError(f"token ids must be an integer array [batch, tokens], got "
                             f"{ids.dtype} of shape {list(ids.shape)}")
        batch, length = graph.inputs[0][1] if len(graph.inputs[0][1]) == 2 else (None, None)
        if isinstance(batch, int) and ids.shape[0] != batch:
            raise InputUnsupported(f"batching is not supported yet: {graph.path} is a "
                                   f"one-sequence export ({batch} sequence per call), got "
                                   f"{ids.shape[0]}; `gdn-fx export --batch N` writes one "
                                   "that serves N (gdn_fx.hf.batch.BatchGenerator)")
        if isinstance(length, int) and ids.shape[1] != length:
            raise UsageError(f"{graph.path} takes {length} token(s) per call, got "
                             f"{ids.shape[1]}")
        if isinstance(length, str):
            longest = min(ids.shape[1], self.prefill_chunk or ids.shape[1]) if prompt \
                else ids.shape[1]
            self.check_lengths({length: longest}, graph)
        bad = np.flatnonzero((ids < 0) | (ids >= self.vocab))
        if bad.size:
            value = ids.reshape(-1)[bad[0]]
            raise UsageError(f"token id {value} (position {bad[0]}) is outside the "
                             f"vocabulary [0, {self.vocab}) of {graph.path}")
        return ids.astype(np.int64, copy=False)

    def check_lengths(self, values: Mapping[str, int],
                      graph: Optional[LoadedGraph] = None) -> None:
        """UsageError unless every bound ``graph`` (default: the main graph) asserts on these
        symbols holds (e.g. ``{"S": 5, "P": 12}`` against ``S >= 1``, ``P >= 0``)."""
        check_bounds(values, graph or self.main_graph)

    def step(self, state, ids: np.ndarray, caches: list) -> tuple[np.ndarray, list]:
        """One call: (last-position logits [B, V] as numpy, new caches as tract Tensors).

        ``caches``: numpy arrays or the tract Tensors of the previous call, which go back in
        as they are: tract does not consume its inputs, and turning ~33 MB of caches (the 0.8B
        shape at P = 512) into numpy and back cost ~10 of a q4_0 decode step's ~117 ms.
        ``Tensor.to_numpy()`` gives one as an array. ``ids`` and numpy caches are checked
        against the graph's declarations first (:meth:`check_ids`)."""
        graph = self._graph_of(state)
        ids = self.check_ids(ids, graph)
        _check_caches(caches, graph)
        if self.kv_in_state and any(isinstance(c, np.ndarray) for c in caches):
            state = self.main = self.decode = self.main_graph.runnable.spawn_state()
        outputs = _run(state, [ids, *caches], graph)
        return outputs[0].to_numpy()[:, -1], outputs[1:]

    def prefill(self, ids: np.ndarray, caches: list) -> tuple[np.ndarray, list]:
        """``ids`` [B, S] after ``caches``, in calls of at most ``prefill_chunk`` tokens."""
        ids = self.check_ids(ids, prompt=True)
        chunk = self.prefill_chunk or ids.shape[1]
        for start in range(0, ids.shape[1], chunk):
            piece = ids[:, start:start + chunk]
            logits, caches = self.step(self.decode if piece.shape[1] == 1 else self.main,
                                       piece, caches)
        return logits, caches

    def stream(self, prompt, **options):
        """Text or token ids in, one ``gdn_fx.runtime.streaming.Piece`` (token, printable text) out
        per token as it is chosen: ``gdn_fx.runtime.streaming.stream(self, prompt, **options)``
        (``tokenizer``, ``max_new_tokens``, ``sampling``, ``eos``, ``stop``, ``chat``,
        ``context``); the returned stream's ``summary`` has the rates once it ends."""
        from gdn_fx.runtime.streaming import stream

        return stream(self, prompt, **options)

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int,
                 progress: bool = False) -> GenerationResult:
        """Greedy continuation of ``prompt_ids`` (batch 1) by ``max_new_tokens`` tokens.
        Refused in one line before tract runs: several prompts (InputUnsupported), an empty
        prompt, an id outside ``[0, vocab)``, ``max_new_tokens < 1``, a past longer than the
        graphs declare (UsageError)."""
        prompt = prompt_list(prompt_ids, f" for {self.main_graph.path}, a one-sequence "
                             "export")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, numbers.Integral) \
                or max_new_tokens < 1:
            raise UsageError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
        ids = self.check_ids(np.array([_in_vocabulary(prompt, self.vocab)], dtype=np.int64),
                             prompt=True)
        self.check_lengths({"P": len(prompt) + max_new_tokens - 2})  # the last call's past
        result = GenerationResult(list(prompt))
        start = time.perf_counter()
        logits, caches = self.prefill(ids, [z.copy() for z in self.zero_states])
        result.prefill_s = time.perf_counter() - start
        start = time.perf_counter()
        for count in range(max_new_tokens):
            token = int(logits[0].argmax())
            result.tokens.append(token)
            result.logits.append(logits[0])
            if progress:
                _progress(count + 1, max_new_tokens)
            if count + 1 < max_new_tokens:
                logits, caches = self.step(self.decode, np.array([[token]], dtype=np.int64),
                                           caches)
        result.decode_s = time.perf_counter() - start
        if progress:
            print(file=sys.stderr)
        return result


def _run(state, inputs: list, graph: LoadedGraph) -> list:
    """``state.run(inputs)``; a TractError (a graph that fails on inputs it declares) as a
    one-line ArtifactError with tract's chain of causes, not a Rust backtrace."""
    import tract

    try:
        return state.run(inputs)
    except tract.TractError as error:
        raise ArtifactError(f"tract fails running {graph.path}: {_first_lines(error)}"
                            ) from None
