"""Streamed generation: text or token ids in, tokens and their text out as they are decoded.

    gen = Generator.open("out/q.nnef.tgz")
    tokenizer = gdn_fx.runtime.text.load_tokenizer("ckpt/")
    run = stream(gen, "Once upon a time", tokenizer=tokenizer, max_new_tokens=64,
                 sampling=Sampling(temperature=0.8, top_p=0.95, seed=1),
                 eos=gdn_fx.runtime.text.eos_ids("ckpt/"), stop=["\\n\\n"])
    for piece in run:                         # Piece(token, text), one per token
        print(piece.text, end="", flush=True)
    print(run.summary.rates())                # prefill / decode tokens/s, time to first token

The loop is the Generator's own (one tract State per graph, caches carried from call to
call: ``Generator.prefill`` then ``Generator.step`` on the decode graph), with the next token
chosen by :class:`gdn_fx.runtime.sampling.Sampler` (greedy by default) instead of a bare arg max.
Generation ends at ``max_new_tokens``, at an EOS id (the EOS token is the last token, as in
transformers' ``generate``; its text is not shown), at a stop string (text up to it only), or
where the prompt and the answer fill the model's context (``finish_reason`` "context", which
the summary's ``rates()`` says).
The same loop runs a transformers model in torch (:class:`TorchSession`), which is what the
tests check the tract run against.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Iterator, Optional, Sequence, Union

import numpy as np

from gdn_fx.errors import UsageError
from gdn_fx.runtime.sampling import Sampler, Sampling, check_max_new_tokens
from gdn_fx.runtime.text import Detokenizer, StopStrings, prompt_ids


@dataclass(frozen=True)
class Piece:
    """One generated token and the text it made printable ('' while a character or a
    possible stop string is incomplete; the last piece also carries what was held back)."""

    token: int
    text: str


@dataclass
class Summary:
    """What a finished stream did, and how fast."""

    prompt: list
    tokens: list = field(default_factory=list)
    text: str = ""
    # "eos", "stop", "length" (max_new_tokens), "context" (the model's context is full:
    # fewer tokens than asked), or "interrupted" (Ctrl-C)
    finish_reason: str = ""
    seed: Optional[int] = None  # the sampler's seed (None when greedy)
    prefill_s: float = 0.0
    first_token_s: float = 0.0  # from the start of the stream to the first token chosen
    decode_s: float = 0.0  # the decode calls (one per token after the first)
    context: Optional[int] = None  # the model's context (max_position_embeddings), if known
    asked: Optional[int] = None  # the max_new_tokens asked for (more than fit when cut)

    def rates(self) -> str:
        """One line: prefill and decode tokens/s, time to first token, why it ended."""
        prefill = len(self.prompt) / self.prefill_s if self.prefill_s else float("nan")
        steps = max(len(self.tokens) - 1, 0)
        decode = steps / self.decode_s if steps and self.decode_s else float("nan")
        return (f"prefill {len(self.prompt)} tokens in {self.prefill_s * 1e3:.1f} ms "
                f"({prefill:.1f} tokens/s); first token after {self.first_token_s * 1e3:.1f} "
                f"ms; decode {steps} tokens in {self.decode_s * 1e3:.1f} ms ({decode:.1f} "
                f"tokens/s); {len(self.tokens)} new tokens, {self.ending()}")

    def ending(self) -> str:
        """Why it ended, in words (the context's cut says what was cut)."""
        if self.finish_reason == "context":
            return (f"cut by the context: the prompt's {len(self.prompt)} tokens and "
                    f"{len(self.tokens)} new fill the model's {self.context} "
                    f"(max_position_embeddings); {self.asked} were asked")
        return f"ended by {self.finish_reason}"

    def as_dict(self) -> dict:
        """The summary as JSON-ready values, with the rates in tokens/s."""
        found = asdict(self)
        steps = max(len(self.tokens) - 1, 0)
        found["prefill_tokens_per_s"] = len(self.prompt) / self.prefill_s \
            if self.prefill_s else None
        found["decode_tokens_per_s"] = steps / self.decode_s if steps and self.decode_s else None
        return found


class TractSession:
    """Prefill and decode calls over a :class:`gdn_fx.hf.generator.Generator`: its kept
    tract States, the caches carried as tract Tensors from one call to the next."""

    def __init__(self, generator):
        self.generator = generator
        self.vocab = generator.vocab
        self.caches: list = []

    def start(self, prompt: Sequence[int], max_new_tokens: int) -> np.ndarray:
        """The logits [vocab] after ``prompt`` from zero caches; the lengths the whole run
        reaches are checked against the graphs' bounds first (one-line UsageError)."""
        gen = self.generator
        ids = gen.check_ids(np.array([prompt], dtype=np.int64), prompt=True)
        gen.check_lengths({"P": max(0, len(prompt) + max_new_tokens - 2)})  # the last past
        logits, self.caches = gen.prefill(ids, [z.copy() for z in gen.zero_states])
        return logits[0]

    def next(self, token: int) -> np.ndarray:
        """The logits after one more token, by the decode graph."""
        gen = self.generator
        logits, self.caches = gen.step(gen.decode, np.array([[token]], dtype=np.int64),
                                       self.caches)
        return logits[0]


class TorchSession:
    """The same calls on a transformers causal LM in torch (its own cache)."""

    def __init__(self, model):
        import inspect

        self.model = model
        self.vocab = model.config.get_text_config().vocab_size
        self.cache = None
        # transformers 5.24 renamed forward's past_key_values to cache (the old name warns).
        names = inspect.signature(model.forward).parameters
        self._cache_arg = "cache" if "cache" in names else "past_key_values"

    def _run(self, ids) -> np.ndarray:
        import torch

        with torch.no_grad():
            out = self.model(input_ids=torch.tensor([ids]), use_cache=True,
                             **{self._cache_arg: self.cache})
        found = getattr(out, "cache", None)
        self.cache = found if found is not None else out.past_key_values
        return out.logits[0, -1].float().numpy()

    def start(self, prompt: Sequence[int], max_new_tokens: int) -> np.ndarray:
        """The logits [vocab] after ``prompt`` (a fresh cache)."""
        self.cache = None
        return self._run(list(prompt))

    def next(self, token: int) -> np.ndarray:
        """The logits after one more token."""
        return self._run([token])


def _session(source):
    if hasattr(source, "start") and hasattr(source, "next"):
        return source
    if hasattr(source, "prefill") and hasattr(source, "zero_states"):
        return TractSession(source)
    return TorchSession(source)


def _prompt(prompt, tokenizer, chat: bool, vocab: int) -> list:
    """Token ids of ``prompt``: text through the tokenizer (chat template with ``chat``),
    or ids as given, each in ``[0, vocab)``."""
    from gdn_fx.runtime.artifact import prompt_list

    if isinstance(prompt, str):
        if tokenizer is None:
            raise UsageError("a text prompt needs a tokenizer (a checkpoint folder that holds "
                             "one); or give token ids")
        ids = prompt_ids(tokenizer, prompt, chat=chat)
    elif chat:
        raise UsageError("chat needs a text prompt (the template is applied to text)")
    else:
        ids = prompt_list(prompt)
    for index, token in enumerate(ids):
        if not 0 <= token < vocab:
            raise UsageError(f"prompt id {token} (position {index}) is outside the vocabulary "
                             f"[0, {vocab})")
    return ids


class TextStream:
    """An iterator of :class:`Piece` s for one generation (see :func:`stream`); ``summary``
    fills in as it runs and is complete once iteration ends. It can be iterated once."""

    def __init__(self, session, prompt: list, tokenizer, max_new_tokens: int,
                 sampler: Sampler, eos: Sequence[int], stop: Sequence[str],
                 keep_logits: bool = False, context: Optional[int] = None):
        self.session, self.tokenizer, self.sampler = session, tokenizer, sampler
        self.logits: Optional[list] = [] if keep_logits else None  # raw, one [vocab] a step
        self.eos = set(int(e) for e in eos)
        # the context caps the tokens: the prompt and the answer fit in it
        self.max_new_tokens = max_new_tokens if context is None else min(
            max_new_tokens, context - len(prompt))
        self.detokenizer = Detokenizer(tokenizer) if tokenizer is not None else None
        self.stops = StopStrings(stop)
        seed = None if sampler.sampling.greedy else sampler.seed
        self.summary = Summary(list(prompt), seed=seed, context=context, asked=max_new_tokens)
        self._pieces = self._run()

    def __iter__(self) -> Iterator[Piece]:
        return self._pieces

    def release(self) -> None:
        """Drop the engine session (a Generator's loaded model and caches) once the stream
        has ended; ``summary`` and ``logits`` stay. ``generate --check`` does it before it
        builds transformers' reference, so that memory never holds both models."""
        self.session = None

    def _text(self, token: int) -> str:
        return self.stops.feed(self.detokenizer.push(token)) if self.detokenizer else ""

    def _flush(self) -> str:
        if self.detokenizer is None:
            return ""
        return self.stops.feed(self.detokenizer.finish()) + self.stops.finish()

    def interrupted(self) -> str:
        """End the stream where it is (Ctrl-C): ``finish_reason`` "interrupted", and the text
        held back so far (an incomplete character, a possible start of a stop string) given
        out as what remains to print."""
        self._pieces.close()
        if self.summary.finish_reason:
            return ""
        self.summary.finish_reason = "interrupted"
        rest = self._flush()
        self.summary.text += rest
        return rest

    def _ended(self, token: int, count: int) -> str:
        if token in self.eos:
            return "eos"
        if self.stops.stopped is not None:
            return "stop"
        if count == self.max_new_tokens:
            return "context" if count < self.summary.asked else "length"
        return ""

    def _run(self) -> Iterator[Piece]:
        summary, begin = self.summary, time.perf_counter()
        logits = self.session.start(summary.prompt, self.max_new_tokens)
        summary.prefill_s = time.perf_counter() - begin
        context = list(summary.prompt)  # what the repetition penalty looks at, as in generate
        while True:
            if self.logits is not None:
                self.logits.append(np.array(logits, copy=True))
            token = self.sampler.choose(logits, context)
            context.append(token)
            summary.tokens.append(token)
            if len(summary.tokens) == 1:
                summary.first_token_s = time.perf_counter() - begin
            text = self._text(token)
            reason = self._ended(token, len(summary.tokens))
            if reason and reason != "stop":
                text += self._flush()  # the end: what was held back is final now
                reason = "stop" if self.stops.stopped is not None else reason
            summary.text += text
            if reason:
                summary.finish_reason = reason
            yield Piece(token, text)
            if reason:
                return
            start = time.perf_counter()
            logits = self.session.next(token)
            summary.decode_s += time.perf_counter() - start


def stream(source, prompt: Union[str, Sequence[int]], *, tokenizer=None,
           max_new_tokens: int = 64, sampling: Optional[Sampling] = None,
           eos: Sequence[int] = (), stop: Sequence[str] = (), chat: bool = False,
           context: Optional[int] = None, keep_logits: bool = False) -> TextStream:
    """Generate from ``prompt`` (text, with ``tokenizer``; or token ids) on ``source`` (a
    Generator, a transformers model, or a session with ``start`` / ``next``), one
    :class:`Piece` per token as it is chosen. ``eos``: ids that end it (the id is kept as the
    last token); ``stop``: strings that end it (the text stops before them; needs a
    tokenizer); ``context``: the model's context length: a prompt that fills it is refused,
    and generation stops at it (``finish_reason`` "context" when that is before
    ``max_new_tokens``); ``keep_logits``: the raw logits of every step are kept in the
    stream's ``logits`` (for ``check_generation``). Each setting is what the call is given
    (``max_new_tokens`` 64 unless given); :func:`gdn_fx.runtime.text.generation_length` and
    ``eos_ids`` give a checkpoint's, as ``gdn-fx generate`` takes them. Arguments are checked
    before any model call (one-line UsageError): an empty prompt, ids outside the
    vocabulary, ``max_new_tokens < 1``."""
    max_new_tokens = check_max_new_tokens(max_new_tokens)
    stop = [stop] if isinstance(stop, str) else list(stop)
    session = _session(source)
    ids = _prompt(prompt, tokenizer, chat, session.vocab)
    if stop and tokenizer is None:
        raise UsageError("stop strings need a tokenizer (they are matched on the text)")
    if context is not None:
        check_context(ids, context)
    return TextStream(session, ids, tokenizer, max_new_tokens, Sampler(sampling), eos, stop,
                      keep_logits, context)


def check_context(ids: Sequence[int], context: int, name: str = "the prompt") -> None:
    """UsageError (one line) when ``ids`` leave no room in the model's ``context`` for a
    new token: the prompt and the answer must fit in it."""
    if len(ids) >= context:
        raise UsageError(f"{name} is {len(ids)} tokens, and the model's context is "
                         f"{context} (max_position_embeddings): shorten the prompt")
