"""The next token, chosen as transformers' ``generate`` chooses it.

    sampler = Sampler(Sampling(temperature=0.8, top_k=40, top_p=0.95, seed=1))
    token = sampler.choose(logits, context)      # logits [vocab], context: prompt + tokens

The processing follows transformers 5's ``GenerationMixin._get_logits_processor``: the
repetition penalty first (a logits processor, so greedy decoding takes it too), then, only
when sampling, the warpers temperature, top-k, top-p and min-p in that order; the token is
drawn from the softmax of what is left. Every step is computed in float32, as ``generate``
computes the scores (``next_token_logits`` in float32), so the distributions agree to
rounding (tests/test_sampling.py compares with transformers' own processors).

Greedy is the default: ``temperature == 0`` takes the arg max of the (penalized) logits, as
``do_sample=False`` does. Draws use one numpy generator seeded once: the same seed, the
same logits give the same tokens (not the tokens torch's RNG would draw for that seed: the
runtime needs no torch).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from gdn_fx.errors import UsageError


def _number(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(
            value):
        raise UsageError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def check_max_new_tokens(value) -> int:
    """``value`` when it is an int >= 1, else a one-line UsageError."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise UsageError(f"max_new_tokens must be an int >= 1, got {value!r}")
    return int(value)


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen. ``temperature == 0`` (the default) is greedy; the
    filters (``top_k``, ``top_p``, ``min_p``) need sampling (``temperature > 0``), the
    repetition penalty applies to both. Off values: ``top_k=0``, ``top_p=1``, ``min_p=0``,
    ``repetition_penalty=1``. ``seed=None`` draws a fresh seed (see :attr:`Sampler.seed`).
    Invalid values raise UsageError, one line naming the argument."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: Optional[int] = None

    def __post_init__(self):
        temperature = _number("temperature", self.temperature)
        if temperature < 0:
            raise UsageError(f"temperature must be >= 0 (0: greedy), got {temperature:g}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, numbers.Integral) \
                or self.top_k < 0:
            raise UsageError(f"top_k must be an int >= 0 (0: off), got {self.top_k!r}")
        if not 0 < _number("top_p", self.top_p) <= 1:
            raise UsageError(f"top_p must be in (0, 1] (1: off), got {self.top_p:g}")
        if not 0 <= _number("min_p", self.min_p) <= 1:
            raise UsageError(f"min_p must be in [0, 1] (0: off), got {self.min_p:g}")
        if _number("repetition_penalty", self.repetition_penalty) <= 0:
            raise UsageError(f"repetition_penalty must be > 0 (1: off), got "
                             f"{self.repetition_penalty:g}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(
                self.seed, numbers.Integral) or self.seed < 0):
            raise UsageError(f"seed must be an int >= 0, got {self.seed!r}")
        if temperature == 0 and self.filters():
            raise UsageError(f"{', '.join(self.filters())} filter(s) the sampled tokens: give "
                             "a temperature > 0 (greedy takes the most likely token)")

    @property
    def greedy(self) -> bool:
        """Whether the most likely token is taken (no draw)."""
        return self.temperature == 0

    def filters(self) -> list:
        """The names of the filters that are on (as command-line flags)."""
        on = {"--top-k": self.top_k != 0, "--top-p": self.top_p < 1, "--min-p": self.min_p > 0}
        return [name for name, used in on.items() if used]

    def values(self) -> dict:
        """The settings that change the scores, by transformers' names ({} for plain greedy):
        ``temperature``, ``top_k``, ``top_p``, ``min_p`` when sampling and on,
        ``repetition_penalty`` when not 1."""
        found = {}
        if not self.greedy:
            found["temperature"] = self.temperature
            found.update((name, value) for name, value, off in (
                ("top_k", self.top_k, 0), ("top_p", self.top_p, 1.0),
                ("min_p", self.min_p, 0.0)) if value != off)
        if self.repetition_penalty != 1:
            found["repetition_penalty"] = self.repetition_penalty
        return found


# transformers' GenerationConfig._get_default_generation_params() (5.x): what ``generate``
# takes for a sampling setting that neither its arguments nor generation_config.json give.
# min_p has none (None: off).
TRANSFORMERS_DEFAULTS = {"do_sample": False, "temperature": 1.0, "top_k": 50, "top_p": 1.0,
                         "min_p": None, "repetition_penalty": 1.0}
SETTINGS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")
# generation_config.json settings that change transformers' choice of tokens and that
# Sampling does not apply, with the value that leaves it off (said, never silently dropped).
NOT_APPLIED = {"typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "top_h": None,
               "no_repeat_ngram_size": 0, "min_new_tokens": None, "min_length": 0,
               "bad_words_ids": None, "suppress_tokens": None, "begin_suppress_tokens": None,
               "sequence_bias": None, "forced_bos_token_id": None,
               "forced_eos_token_id": None, "exponential_decay_length_penalty": None,
               "num_beams": 1, "penalty_alpha": None, "renormalize_logits": False}


@dataclass(frozen=True)
class Resolved:
    """The :class:`Sampling` a run uses and where each of its values came from (a flag, the
    checkpoint's generation_config.json, transformers' default): ``str()`` is the line the
    command prints."""

    sampling: Sampling
    sources: tuple  # ((name, value, source), ...) in SETTINGS order, the ones in use
    mode_source: str  # what decided greedy or sampling
    not_applied: tuple = ()  # generation_config.json settings Sampling does not apply

    def __str__(self) -> str:
        return self.line(self.sampling.seed)

    def line(self, seed: Optional[int] = None) -> str:
        """What the run uses, each value with its source; ``seed``: the sampler's seed (the
        one drawn when none was given), said when sampling."""
        sampling = self.sampling
        parts = [f"{name} {value:g} ({source})" for name, value, source in self.sources]
        head = "greedy" if sampling.greedy else "sampling"
        line = f"{head} ({self.mode_source})" + (": " + ", ".join(parts) if parts else "")
        if not sampling.greedy and seed is not None:
            line += f"; seed {seed}" + ("" if sampling.seed is not None else " (drawn)")
        if self.not_applied:
            line += ("; not applied: " + ", ".join(f"{name} {value!r}" for name, value
                                                   in self.not_applied)
                     + " (generation_config.json)")
        return line


def resolve(config: Optional[dict] = None, *, greedy: bool = False,
            source: str = "generation_config.json", seed: Optional[int] = None,
            **flags) -> Resolved:
    """The sampling of a run, settled as transformers' ``generate`` settles it: a value the
    user gives (``flags``: temperature, top_k, top_p, min_p, repetition_penalty; None: not
    given) wins, then the checkpoint's ``config`` (generation_config.json's values, None
    when the checkpoint has none), then transformers' defaults (:data:`TRANSFORMERS_DEFAULTS`:
    greedy; when sampling temperature 1, top_k 50). Without ``config`` (no checkpoint) a
    setting not given is off, and sampling is what the flags ask.

    Greedy or sampling: ``greedy=True`` asks for greedy (``do_sample=False``: the repetition
    penalty still applies, as in transformers' greedy ``generate``); a temperature of 0 is
    greedy, a temperature > 0 samples; else ``do_sample`` of ``config``. When greedy, the
    filters and the temperature of ``config`` are not used (transformers applies them only
    when sampling); a filter the user gives then is refused (Sampling's check). ``source``
    names the config in messages. UsageError (one line, naming the flag or the file) for a
    value out of range."""
    unknown = set(flags) - set(SETTINGS)
    if unknown:
        raise UsageError(f"resolve: unknown settings {sorted(unknown)}")
    given = {name: value for name, value in flags.items() if value is not None}
    if greedy and given.get("temperature", 0) != 0:
        raise UsageError("--greedy and --temperature > 0 exclude each other (greedy takes the "
                         "most likely token)")
    file = dict(config or {})
    if greedy:
        do_sample, mode = False, "--greedy"
    elif "temperature" in given:
        do_sample, mode = given["temperature"] > 0, "--temperature"
    elif config is not None and file.get("do_sample") is not None:
        do_sample, mode = bool(file["do_sample"]), f"{source}: do_sample " + \
            str(bool(file["do_sample"])).lower()
    else:
        do_sample = False
        mode = (f"{source} sets no do_sample: transformers' default" if config is not None
                else "the default: no checkpoint's generation_config.json")
    values, sources = {}, []
    for name in SETTINGS:
        if name in given:
            value, where = given[name], "--" + name.replace("_", "-")
        elif not do_sample and name != "repetition_penalty":
            continue  # greedy: no temperature, no filters (transformers skips the warpers)
        elif config is not None and file.get(name) is not None:
            value, where = file[name], source
        elif config is not None and TRANSFORMERS_DEFAULTS[name] is not None:
            value, where = TRANSFORMERS_DEFAULTS[name], "transformers' default"
        else:
            continue
        values[name] = value
        sources.append((name, value, where))
    if do_sample and values.get("temperature", 1.0) == 0:
        raise UsageError(f"{source} asks for sampling (do_sample true) at temperature 0, "
                         "which transformers refuses: give --temperature T > 0 or --greedy")
    if not do_sample:
        values.pop("temperature", None)
    elif "temperature" not in values:
        values["temperature"] = 1.0  # sampling asked without one (no checkpoint)
    try:
        sampling = Sampling(**values, seed=seed)
    except UsageError as error:
        where = {name: source for name, _, source in sources}
        raise UsageError(spelled_as_given(str(error), where)) from None
    off = {"temperature": None, "top_k": 0, "top_p": 1.0, "min_p": 0.0,
           "repetition_penalty": 1.0}
    shown = tuple((name, value, where) for name, value, where in sources
                  if (name == "temperature" and do_sample)
                  or (name != "temperature" and value not in (off[name], None)))
    missing = tuple((name, file[name]) for name, neutral in NOT_APPLIED.items()
                    if name in file and file[name] is not None and file[name] != neutral)
    return Resolved(sampling, shown, mode, missing)


def spelled_as_given(text: str, sources: dict) -> str:
    """A Sampling message about a setting (it starts with its name) spelled with where the
    value came from (``sources``: name -> "--flag" or a file name)."""
    for name, where in sources.items():
        if text.startswith(name + " "):
            return (where + text[len(name):] if where.startswith("--")
                    else f"{where}: {text}")
    return text


def penalize(scores: np.ndarray, context: Sequence[int], penalty: float) -> np.ndarray:
    """Repetition penalty (CTRL's): every distinct id of ``context`` inside the vocabulary
    has its score divided by ``penalty`` when positive and multiplied when negative (so
    ``penalty > 1`` makes a repeat less likely either way)."""
    if penalty == 1 or not len(context):
        return scores
    seen = np.array(sorted({int(t) for t in context if 0 <= t < scores.shape[-1]}),
                    dtype=np.int64)
    old = scores[seen]
    out = scores.copy()
    out[seen] = np.where(old < 0, old * np.float32(penalty), old / np.float32(penalty))
    return out


def keep_top_k(scores: np.ndarray, k: int) -> np.ndarray:
    """Scores below the k-th largest become -inf (ties with it are kept)."""
    if k == 0 or k >= scores.shape[-1]:
        return scores
    kth = np.sort(scores)[::-1][k - 1]
    return np.where(scores < kth, np.float32(-math.inf), scores)


def softmax(scores: np.ndarray) -> np.ndarray:
    """float32 softmax (-inf scores give 0)."""
    shifted = np.exp(scores - scores.max())
    return shifted / shifted.sum(dtype=np.float32)


def keep_top_p(scores: np.ndarray, top_p: float) -> np.ndarray:
    """Nucleus filter: a token goes when the probability of it and of every less likely
    token together is at most ``1 - top_p``; the most likely token always stays."""
    if top_p >= 1:
        return scores
    order = np.argsort(scores, kind="stable")  # least likely first: mass from the tail
    tail_mass = np.cumsum(softmax(scores[order]), dtype=np.float32)
    drop_sorted = tail_mass <= np.float32(1 - top_p)
    drop_sorted[-1] = False
    drop = np.zeros_like(drop_sorted)
    drop[order] = drop_sorted
    return np.where(drop, np.float32(-math.inf), scores)


def keep_min_p(scores: np.ndarray, min_p: float) -> np.ndarray:
    """Tokens less likely than ``min_p`` times the most likely one become -inf."""
    if min_p == 0:
        return scores
    probs = softmax(scores)
    drop = probs < np.float32(min_p) * probs.max()
    drop[probs.argmax()] = False
    return np.where(drop, np.float32(-math.inf), scores)


def process(logits, context: Sequence[int], sampling: Sampling) -> np.ndarray:
    """The scores ``generate`` draws from (float32 [vocab], -inf where filtered): the
    repetition penalty, then when sampling temperature, top-k, top-p, min-p."""
    scores = np.asarray(logits, dtype=np.float32).reshape(-1)
    scores = penalize(scores, context, sampling.repetition_penalty)
    if sampling.greedy:
        return scores
    scores = scores / np.float32(sampling.temperature)
    scores = keep_top_k(scores, sampling.top_k)
    scores = keep_top_p(scores, sampling.top_p)
    return keep_min_p(scores, sampling.min_p)


def distribution(logits, context: Sequence[int], sampling: Sampling) -> np.ndarray:
    """The probabilities of the next token after :func:`process` (float32 [vocab])."""
    return softmax(process(logits, context, sampling))


class Sampler:
    """Chooses tokens one after the other with one seeded numpy generator (PCG64)."""

    def __init__(self, sampling: Optional[Sampling] = None):
        self.sampling = sampling or Sampling()
        # A fresh seed is drawn and kept when none is given, so a run can be replayed.
        self.seed = self.sampling.seed if self.sampling.seed is not None else int(
            np.random.SeedSequence().entropy % (1 << 31))
        self.random = np.random.default_rng(self.seed)

    def choose(self, logits, context: Sequence[int]) -> int:
        """The next token after ``context`` (prompt and tokens so far) given its logits."""
        scores = process(logits, context, self.sampling)
        if self.sampling.greedy:
            return int(scores.argmax())
        # inverse CDF in float64: the first token whose cumulative mass passes a uniform draw
        mass = np.cumsum(softmax(scores), dtype=np.float64)
        token = int(np.searchsorted(mass, self.random.random() * mass[-1], side="right"))
        return min(token, len(mass) - 1)
