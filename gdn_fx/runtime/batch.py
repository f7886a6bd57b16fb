"""Batched decode: B sequences with different past lengths in ONE call of the artifact
(numpy and tract only: the export is gdn_fx.hf.batch's).

    files = export_generator(tiny_model("qwen3_5"), "out/q4.nnef.tgz", batch=4)
    gen = BatchGenerator(files.main)
    results = gen.generate([[1, 2, 3], [7] * 40, [5]], max_new_tokens=64)   # greedy, each
    # prompt's tokens exactly as Generator.generate gives them alone

Why batch: decode is bound by reading the weights, and one call that decodes B sequences
reads them once.

The batched graph (``export_generator(..., batch=B)``, B static) takes

- ``input_ids [B, S]``: every row consumes the same S tokens per call (S = 1 while any row
  decodes). So the delta-rule and conv states (``[B, ...]``, one row per sequence) need no
  masking: each row's recurrence sees its own tokens only, and a row is reset on the host
  (its state rows zeroed) when a new sequence takes its slot.
- ``position_ids [B, S]`` (int64): each row's own positions, for RoPE (a joining sequence
  restarts at 0 while its neighbours are far on).
- ``past_mask [B, P]`` (f32, 0 or the lowest finite f32): which of the P cached attention
  columns are the row's own past. The attention caches keep ONE column count P for the
  batch (``[B, Hkv, P, D]``: each call appends S columns to every row); a row sees its own
  columns and the S new ones (causal among them, built in the graph). The lowest finite
  value, not -inf: tract's flash attention kernel gave NaN for a fully masked first key
  block with -inf (docs/FACTS.md). The diagonal is never masked, so no softmax row is empty,
  also for an idle slot whose every past column is masked.
- the caches, as the B = 1 artifact (``gdn_fx.runtime.generator``), batch axis B.

The 4-D additive mask ``[B, 1, S, P + S]`` is built in the graph from ``past_mask`` and given
to transformers per layer type (``attention_mask={"full_attention": mask, "linear_attention":
None}``): transformers 5.24's qwen3_5, qwen3_next and kimi_linear take such a dict as given
and build no mask of their own, so none of their data-dependent mask code is traced; the
linear-attention layers get None (no padding: every row's tokens are real).

:class:`BatchGenerator` serves any number of prompts through the B slots (continuous
batching): a finished sequence's slot goes to the next waiting prompt at once, whose tokens
ride along the others' decode steps (one per call, its outputs ignored until its prompt is
consumed); calls take S > 1 tokens when every active row has that many prompt tokens
pending. Attention columns masked in every row are dropped on the host (compaction), so P
stays the span of the oldest live sequence instead of growing with every call.
"""

from __future__ import annotations

import numbers
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence, Union

import numpy as np

from gdn_fx.errors import ArtifactError, UsageError
from gdn_fx.runtime.parallel import check_workers, serve

BATCH = "gdn_fx_batch"  # tract property of a batched artifact: its B
# The additive mask value of a column a row does not see (see the module doc: not -inf).
MASKED = float(np.finfo(np.float32).min)
EXTRA_INPUTS = ("position_ids", "past_mask")  # between input_ids and the caches


def check_batch(batch) -> int:
    """``batch`` as an int >= 1, else UsageError."""
    if isinstance(batch, bool) or not isinstance(batch, numbers.Integral) or batch < 1:
        raise UsageError(f"batch must be an int >= 1 (or None for the one-sequence graph), "
                         f"got {batch!r}")
    return int(batch)


# --- running it in tract ------------------------------------------------------------------

# Columns every row has stopped seeing are dropped once this many have piled up (or at once
# when the caches are on the host anyway, for a row reset): dropping them copies the
# attention caches out of tract and back, which costs more than a few dead columns do.
COMPACT_MIN = 64
# Longest S of a call while every active row still has prompt tokens pending.
PREFILL_CHUNK = 64


@dataclass
class _Row:
    """One slot's sequence: the prompt's index, its tokens not yet fed, its next position."""

    index: int
    pending: list
    position: int = 0
    joined_s: float = 0.0
    first_s: float = 0.0


@dataclass
class BatchStats:
    """What one :meth:`BatchGenerator.generate` did: calls of the artifact, tokens fed
    (every row's, dummies of idle rows included), tokens generated, its wall time, the widest
    P it reached and how many columns compaction dropped."""

    calls: int = 0
    fed: int = 0
    generated: int = 0
    seconds: float = 0.0
    widest: int = 0
    dropped: int = 0
    decode_calls: int = 0  # calls with S = 1

    @classmethod
    def total(cls, parts: Sequence["BatchStats"], seconds: float) -> "BatchStats":
        """The stats of several States run at once (worker threads): counts summed, the
        widest past the widest, ``seconds`` the wall time of them all."""
        return cls(calls=sum(p.calls for p in parts), fed=sum(p.fed for p in parts),
                   generated=sum(p.generated for p in parts), seconds=seconds,
                   widest=max(p.widest for p in parts), dropped=sum(p.dropped for p in parts),
                   decode_calls=sum(p.decode_calls for p in parts))

    def rates(self) -> str:
        rate = self.generated / self.seconds if self.seconds else float("nan")
        return (f"{self.generated} tokens in {self.calls} calls, {self.seconds:.2f} s "
                f"({rate:.1f} tokens/s aggregate); widest past {self.widest} columns, "
                f"{self.dropped} dropped")


class BatchGenerator:
    """Greedy decoding of several prompts through a batched artifact's B slots in tract.

    Continuous batching (module doc): prompts take slots in order; a slot whose sequence has
    its ``max_new_tokens`` goes to the next waiting prompt before the next call. A slot
    taken over is reset on the host: its conv and recurrent rows zeroed, its mask starting
    at the current column (its old attention columns unseen), its positions at 0. Each
    prompt then generates what :class:`~gdn_fx.runtime.generator.Generator` gives it alone (the
    tests check every sequence against transformers' own generate).

    Between calls the caches stay tract Tensors (as Generator keeps them); they come to the
    host (numpy) only to reset a row or to drop columns.
    """

    def __init__(self, main: Union[str, Path], prefill_chunk: int = PREFILL_CHUNK):
        from gdn_fx.contract import VOCAB
        from gdn_fx.runtime.artifact import DATUM, load_graph

        self.graph = load_graph(main)
        declared = self.graph.properties.get(BATCH, "")
        if not declared.isdigit():
            raise ArtifactError(f"{self.graph.path} is not a batched artifact (no {BATCH} "
                                "property): export it with export_generator(..., batch=B), "
                                "or run it with Generator")
        self.batch = int(declared)
        names = [name for name, _, _ in self.graph.inputs]
        if names[1:3] != list(EXTRA_INPUTS):
            raise ArtifactError(f"{self.graph.path} declares inputs {names[:3]}, a batched "
                                f"artifact input_ids, {', '.join(EXTRA_INPUTS)} first")
        self.caches = self.graph.inputs[3:]
        self.past_axes = [dims.index("P") if "P" in dims else None
                          for _, dims, _ in self.caches]
        self.zero_states = [np.zeros([0 if d == "P" else d for d in dims], dtype=DATUM[datum])
                            for _, dims, datum in self.caches]
        vocab = self.graph.properties.get(VOCAB, "")
        self.vocab = int(vocab) if vocab.isdigit() else self.graph.logits_width
        self.prefill_chunk = check_batch(prefill_chunk)  # the same rule: an int >= 1
        self.state = self.graph.runnable.spawn_state()
        self.stats = BatchStats()

    def fork(self) -> "BatchGenerator":
        """A BatchGenerator over the same loaded graph with a tract State of its own (one
        per thread; see Generator.fork)."""
        import copy

        twin = copy.copy(self)
        twin.state = self.graph.runnable.spawn_state()
        twin.stats = BatchStats()
        return twin

    def step(self, ids: np.ndarray, positions: np.ndarray, past_mask: np.ndarray,
             caches: Sequence) -> tuple[np.ndarray, list]:
        """One call: (last-position logits [B, V], new caches as tract Tensors). UsageError,
        naming the shapes, for inputs other than the graph declares: ``ids`` and
        ``positions`` int ``[B, S]``, ``past_mask`` ``[B, P]`` with P the caches' past
        length, ids in ``[0, vocab)``."""
        ids, positions, past_mask = (np.asarray(ids), np.asarray(positions),
                                     np.asarray(past_mask))
        if ids.ndim != 2 or ids.shape[0] != self.batch or not ids.shape[1] or \
                not np.issubdtype(ids.dtype, np.integer):
            raise UsageError(f"{self.graph.path} takes input_ids as integers [{self.batch}, S]"
                             f" (S >= 1), got {ids.dtype} {list(ids.shape)}")
        if positions.shape != ids.shape or not np.issubdtype(positions.dtype, np.integer):
            raise UsageError(f"position_ids must be integers of input_ids' shape "
                             f"{list(ids.shape)}, got {positions.dtype} {list(positions.shape)}")
        if len(caches) != len(self.caches):
            raise UsageError(f"{self.graph.path} takes {len(self.caches)} caches, got "
                             f"{len(caches)}")
        past = self._past_length(caches)
        if past_mask.ndim != 2 or past_mask.shape[0] != self.batch or (
                past is not None and past_mask.shape[1] != past):
            raise UsageError(f"past_mask must be [{self.batch}, {'P' if past is None else past}]"
                             f" (batch, the caches' past length), got {list(past_mask.shape)}")
        bad = np.flatnonzero((ids < 0) | (ids >= self.vocab))
        if bad.size:
            raise UsageError(f"token id {ids.reshape(-1)[bad[0]]} is outside the vocabulary "
                             f"[0, {self.vocab}) of {self.graph.path}")
        outputs = self.state.run([ids.astype(np.int64, copy=False),
                                  positions.astype(np.int64, copy=False),
                                  past_mask.astype(np.float32, copy=False), *caches])
        caches = list(outputs[1:])
        first = next((i for i, axis in enumerate(self.past_axes) if axis is not None), None)
        if first is not None:
            self._made = (caches[first], past_mask.shape[1] + ids.shape[1])
        return outputs[0].to_numpy()[:, -1], caches

    def _past_length(self, caches: Sequence) -> Optional[int]:
        """P of ``caches``: from the first attention cache if it is a numpy array (checked
        for its rank), from the call that made it if it is that call's tract Tensor (tract
        Tensors do not tell their shape without a copy to numpy), else None (not checked)."""
        for cache, axis, (name, dims, _) in zip(caches, self.past_axes, self.caches):
            if axis is None:
                continue
            if isinstance(cache, np.ndarray):
                if cache.ndim != len(dims):
                    raise UsageError(f"cache {name} is {list(cache.shape)}; {self.graph.path} "
                                     f"declares [{', '.join(map(str, dims))}]")
                return int(cache.shape[axis])
            made = getattr(self, "_made", None)
            return made[1] if made is not None and made[0] is cache else None
        return 0

    def generate(self, prompts: Sequence, max_new_tokens: int,
                 keep_logits: bool = False, eos: Sequence[int] = (), workers: int = 1) -> list:
        """Greedy continuation of every prompt (token ids) by ``max_new_tokens`` tokens:
        one ``GenerationResult`` per prompt, in order (``logits`` filled with
        ``keep_logits``; ``prefill_s`` from the prompt's slot to its first token,
        ``decode_s`` from there to its last). A sequence also ends at a token of ``eos``
        (kept), and its slot goes to the next prompt. ``self.stats`` says what the run did.
        ``workers`` > 1: that many threads, each a :meth:`fork` (its own State and B slots on
        the one loaded graph), the prompts dealt to them in turn (prompt i to worker
        i mod workers): tract's calls release the GIL, so the States run on as many cores.
        Refused
        in one line before tract runs: no prompts, an empty prompt, an id outside the
        vocabulary, ``max_new_tokens < 1`` (UsageError, naming the prompt)."""
        from gdn_fx.runtime.artifact import _in_vocabulary, prompt_list
        from gdn_fx.runtime.generator import GenerationResult

        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, numbers.Integral) \
                or max_new_tokens < 1:
            raise UsageError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
        if isinstance(prompts, (str, bytes)) or not len(prompts):
            raise UsageError("prompts must be a non-empty list of token-id lists")
        checked = []
        for number, prompt in enumerate(prompts):
            try:
                checked.append(_in_vocabulary(prompt_list(prompt), self.vocab))
            except UsageError as error:
                raise UsageError(f"prompt {number}: {error}") from None
        results = [GenerationResult(list(p)) for p in checked]
        limit, eos = int(max_new_tokens), frozenset(int(e) for e in eos)
        workers = min(check_workers(workers), len(checked))
        if workers == 1:
            return self._run(checked, results, limit, keep_logits, eos)
        shares = [list(range(k, len(checked), workers)) for k in range(workers)]

        def serve_share(fork, share):
            fork._run([checked[i] for i in share], [results[i] for i in share], limit,
                      keep_logits, eos)
            return fork.stats

        begin = time.perf_counter()
        parts = serve(self, shares, serve_share, workers, label="worker")
        self.stats = BatchStats.total(parts, time.perf_counter() - begin)
        return results

    def _run(self, prompts: list, results: list, limit: int, keep_logits: bool,
             eos: frozenset) -> list:
        batch = self.batch
        stats = self.stats = BatchStats()
        clock = time.perf_counter
        begin = clock()
        caches: list = [z.copy() for z in self.zero_states]
        width = 0  # P: attention columns the caches hold
        start = np.full(batch, np.iinfo(np.int64).max)  # a row's first own column; idle: none
        rows: list = [None] * batch
        waiting = iter(range(len(prompts)))
        upcoming = next(waiting, None)
        while True:
            free = [b for b in range(batch) if rows[b] is None]
            if free and upcoming is not None:  # join: reset the rows on the host
                caches = self._host(caches)
                for b in free:
                    if upcoming is None:
                        break
                    rows[b] = _Row(upcoming, list(prompts[upcoming]), joined_s=clock())
                    self._reset(caches, b)
                    start[b] = width
                    upcoming = next(waiting, None)
            active = [b for b in range(batch) if rows[b] is not None]
            if not active:
                break
            first = min(int(start[b]) for b in active)
            if first and (isinstance(caches[0], np.ndarray) or first >= COMPACT_MIN):
                caches, width = self._drop(caches, first), width - first
                start[active] -= first
                stats.dropped += first
            pending = [len(rows[b].pending) for b in active]
            seq = min(min(pending), self.prefill_chunk) if min(pending) else 1
            ids = np.zeros((batch, seq), dtype=np.int64)
            positions = np.tile(np.arange(seq, dtype=np.int64), (batch, 1))
            for b in active:
                row = rows[b]
                if row.pending:
                    ids[b] = row.pending[:seq]
                else:
                    ids[b] = results[row.index].tokens[-1]
                positions[b] += row.position
            columns = np.arange(width)
            mask = np.where(columns[None, :] >= start[:, None], 0.0, MASKED).astype(np.float32)
            logits, caches = self.step(ids, positions, mask, caches)
            width += seq
            stats.calls += 1
            stats.fed += batch * seq
            stats.decode_calls += seq == 1
            stats.widest = max(stats.widest, width)
            for b in active:
                row = rows[b]
                row.position += seq
                if row.pending:
                    del row.pending[:seq]
                    if row.pending:
                        continue  # its prompt goes on: outputs ignored
                result = results[row.index]
                token = int(logits[b].argmax())
                result.tokens.append(token)
                if keep_logits:
                    result.logits.append(logits[b].copy())
                now = clock()
                if len(result.tokens) == 1:
                    row.first_s = now
                    result.prefill_s = now - row.joined_s
                if len(result.tokens) == limit or token in eos:
                    result.decode_s = now - row.first_s
                    rows[b] = None
                    start[b] = np.iinfo(np.int64).max
        stats.generated = sum(len(r.tokens) for r in results)
        stats.seconds = clock() - begin
        return results

    def _host(self, caches: list) -> list:
        """The caches as numpy arrays of their own (tract's outputs copied out)."""
        return [c if isinstance(c, np.ndarray) else np.array(c.to_numpy()) for c in caches]

    def _reset(self, caches: list, row: int) -> None:
        """Zero ``row`` of every conv and recurrent state (numpy caches, in place)."""
        for cache, axis in zip(caches, self.past_axes):
            if axis is None:
                cache[row] = 0

    def _drop(self, caches: list, count: int) -> list:
        """The caches without their first ``count`` attention columns."""
        out = []
        for cache, axis in zip(self._host(caches), self.past_axes):
            if axis is not None:
                index = [slice(None)] * cache.ndim
                index[axis] = slice(count, None)
                cache = np.ascontiguousarray(cache[tuple(index)])
            out.append(cache)
        return out
