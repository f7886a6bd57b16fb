"""Text around the token ids: the checkpoint's tokenizer, chat prompts, streamed detokenizing,
end-of-sequence ids, stop strings (the tiny offline tokenizer of the demo: gdn_fx.demo_text).

    tokenizer = load_tokenizer("ckpt/")                  # AutoTokenizer, or FileTokenizer
    ids = prompt_ids(tokenizer, "Hello", chat=True)      # the folder's chat template
    text = Detokenizer(tokenizer)                        # text.push(token) -> printable text

Streaming text must never print half a character: a byte-level BPE splits a multi-byte UTF-8
character (é, 日, an emoji) over several tokens, and decoding a prefix of them gives U+FFFD.
:class:`Detokenizer` holds such text back until the character is complete, so the pieces it
gives, joined, are exactly ``tokenizer.decode(all tokens)``.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional, Sequence, Union

from gdn_fx.errors import CheckpointError, UsageError

# What transformers' tokenizers are saved as: any one of these makes a folder hold one.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json",
                   "spiece.model", "tokenizer.model.v3", "tiktoken.model")
REPLACEMENT = "\ufffd"  # what decoding an incomplete UTF-8 sequence gives


def has_tokenizer(folder: Union[str, Path]) -> bool:
    """Whether ``folder`` holds tokenizer files (:data:`TOKENIZER_FILES`)."""
    return any((Path(folder) / name).exists() for name in TOKENIZER_FILES)


def load_tokenizer(folder: Union[str, Path]):
    """The tokenizer of the checkpoint ``folder``: transformers' ``AutoTokenizer`` where
    transformers is installed, else :class:`FileTokenizer` (its tokenizer.json read by the
    ``tokenizers`` package: what a runtime-only install has). UsageError (one line) when the
    folder holds no tokenizer, CheckpointError when it cannot be loaded."""
    folder = Path(folder)
    if not folder.is_dir():
        raise UsageError(f"{folder} is not a folder: the tokenizer is read from a checkpoint "
                         "folder (tokenizer.json, tokenizer_config.json, ...)")
    if not has_tokenizer(folder):
        raise UsageError(f"{folder} holds no tokenizer ({', '.join(TOKENIZER_FILES[:2])}, ...): "
                         "give token ids (--prompt-ids) or save the tokenizer there")
    try:
        from transformers import AutoTokenizer
    except ImportError:
        return FileTokenizer(folder)
    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except (OSError, ValueError, TypeError, KeyError) as error:
        first = next((line for line in str(error).splitlines() if line.strip()), repr(error))
        raise CheckpointError(f"transformers cannot load the tokenizer in {folder}: "
                              f"{first.strip()[:200]}") from None


class FileTokenizer:
    """A checkpoint's fast tokenizer without transformers: tokenizer.json through the
    ``tokenizers`` package, the special tokens of tokenizer_config.json, and its chat template
    (tokenizer_config.json's ``chat_template`` or chat_template.jinja) rendered with jinja2.
    It answers what this module and the generator ask of a tokenizer (``tok(text)``,
    ``decode``, ``apply_chat_template``, ``eos_token_id``), as transformers' fast tokenizer
    does: a call's text gets the special tokens tokenizer.json's post-processor adds (a BOS),
    a chat prompt none beyond its template's."""

    def __init__(self, folder: Union[str, Path]):
        from tokenizers import Tokenizer

        folder = Path(folder)
        if not (folder / "tokenizer.json").is_file():
            raise CheckpointError(f"{folder} has no tokenizer.json: without transformers only "
                                  "fast tokenizers (tokenizer.json) load; install transformers")
        self.backend = Tokenizer.from_file(str(folder / "tokenizer.json"))
        config = _json(folder / "tokenizer_config.json")
        self.special = {key: _token_text(config.get(key)) for key in
                        ("bos_token", "eos_token", "pad_token", "unk_token")}
        template = folder / "chat_template.jinja"
        self.chat_template = template.read_text() if template.is_file() else \
            config.get("chat_template")

    @property
    def eos_token_id(self) -> Optional[int]:
        token = self.special.get("eos_token")
        return self.backend.token_to_id(token) if token else None

    def __call__(self, text: str) -> dict:
        return {"input_ids": self.backend.encode(text, add_special_tokens=True).ids}

    def decode(self, tokens: Sequence[int], skip_special_tokens: bool = False,
               clean_up_tokenization_spaces: bool = False) -> str:
        return self.backend.decode(list(tokens), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list, add_generation_prompt: bool = False,
                            tokenize: bool = True):
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise UsageError(f"the chat template refuses the messages: {message}")

        environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        environment.globals["raise_exception"] = raise_exception
        text = environment.from_string(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            **{key: value or "" for key, value in self.special.items()})
        if not tokenize:
            return text
        return self.backend.encode(text, add_special_tokens=False).ids


def _token_text(value) -> Optional[str]:
    """A special token as tokenizer_config.json gives it: a string, or {"content": ...}."""
    return value.get("content") if isinstance(value, dict) else value


def prompt_ids(tokenizer, text: str, chat: bool = False,
               system: Optional[str] = None) -> list:
    """``text`` as token ids: encoded as the tokenizer encodes a call's text (its special
    tokens added, e.g. a BOS), or with ``chat`` as one user message (after a ``system``
    message, if given) in the tokenizer's chat template with the assistant's turn opened
    (``add_generation_prompt=True``). UsageError for an empty prompt or a tokenizer without
    a chat template."""
    if not isinstance(text, str) or not text.strip():
        raise UsageError("the prompt is empty: give some text")
    if not chat:
        ids = list(tokenizer(text)["input_ids"])
    else:
        if not getattr(tokenizer, "chat_template", None):
            raise UsageError("--chat: the tokenizer has no chat template (chat_template.jinja "
                             "or tokenizer_config.json's chat_template); leave out --chat")
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": text}]
        found = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                              tokenize=True)
        ids = list(found["input_ids"] if hasattr(found, "keys") else found)
    if not ids:
        raise UsageError("the prompt gives no tokens")
    return [int(i) for i in ids]


def _json(path: Path) -> dict:
    if not path.exists():
        return {}
    try:
        return json.loads(path.read_text())
    except (ValueError, OSError) as error:
        raise CheckpointError(f"{path} is not valid JSON: {error}") from None


def _ids(value) -> list:
    if value is None:
        return []
    return [int(v) for v in (value if isinstance(value, (list, tuple)) else [value])]


def _config_value(config: dict, key: str):
    """``key`` of a config.json, or of its ``text_config`` (multimodal checkpoints)."""
    if key in config:
        return config[key]
    return (config.get("text_config") or {}).get(key)


def eos_ids(folder: Union[str, Path], tokenizer=None) -> list:
    """The end-of-sequence ids that end generation, where transformers' ``generate`` takes
    them: generation_config.json's ``eos_token_id`` (an id or a list) when the folder has
    that file (transformers then reads nothing else: an empty list or none there is no EOS);
    else config.json's; else the tokenizer's EOS token; [] when none says."""
    folder = Path(folder)
    generation = folder / "generation_config.json"
    if generation.is_file():
        return _ids(_config_value(_json(generation), "eos_token_id"))
    found = _ids(_config_value(_json(folder / "config.json"), "eos_token_id"))
    if found:
        return found
    eos = getattr(tokenizer, "eos_token_id", None)
    return _ids(eos)


def generation_values(folder: Union[str, Path]) -> Optional[dict]:
    """The values of the folder's generation_config.json (what transformers' ``generate``
    starts from: do_sample, temperature, top_k, ...), None when it has none; CheckpointError
    for a file that is not a JSON object."""
    path = Path(folder) / "generation_config.json"
    if not path.is_file():
        return None
    values = _json(path)
    if not isinstance(values, dict):
        raise CheckpointError(f"{path} must hold a JSON object")
    return values


# transformers' GenerationConfig default (``_get_default_generation_params``, 5.x: max_length
# 20): with neither max_new_tokens nor max_length set, ``generate`` makes 20 new tokens
# (max_length 20 counted from the end of the prompt), at most up to the model's context.
DEFAULT_NEW_TOKENS = 20
TRANSFORMERS_DEFAULT = "transformers' default"  # the source a Length names then


@dataclass(frozen=True)
class Length:
    """How many new tokens a run makes, and where that came from (:func:`generation_length`):
    a count of new tokens (``max_new_tokens``), or ``max_length``, the prompt and the answer
    together (``max_new_tokens`` None), as transformers' ``generate`` counts it."""

    max_new_tokens: Optional[int]
    max_length: Optional[int]
    source: str  # "--max-new-tokens", "m.text/generation_config.json", "transformers' default"
    note: str = ""  # what else was there and is not used, or why the default

    def new_tokens(self, prompt_length: int, name: str = "the prompt") -> int:
        """The new tokens after a prompt of ``prompt_length`` tokens; UsageError (one line,
        as transformers' ValueError) when ``max_length`` leaves no room for one."""
        if self.max_new_tokens is not None:
            return self.max_new_tokens
        room = self.max_length - prompt_length
        if room < 1:
            raise UsageError(f"{name} is {prompt_length} tokens, and max_length "
                             f"{self.max_length} ({self.source}) counts the prompt and the "
                             "answer: no room for a new token (transformers' generate refuses "
                             "it too); give max_new_tokens (--max-new-tokens N)")
        return room

    def line(self, prompt_length: Optional[int] = None) -> str:
        """What the run uses and where it came from, as the command says it on stderr."""
        if self.max_new_tokens is not None:
            head = f"max_new_tokens {self.max_new_tokens}"
        else:
            head = f"max_length {self.max_length}"
            tail = (f"the prompt's {prompt_length} tokens and {self.max_length - prompt_length}"
                    " new" if prompt_length is not None else "the prompt and the answer together")
        text = head + (f": {self.source}" if self.source == TRANSFORMERS_DEFAULT
                       else f" from {self.source}")
        if self.max_new_tokens is None:
            text += f" ({tail})"
        return text + (f" ({self.note})" if self.note else "")


def _length_value(values: dict, key: str, where: str) -> Optional[int]:
    value = values.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise CheckpointError(f"{where}: {key} must be an int >= 1, got {value!r}")
    return value


def generation_length(folder: Union[str, Path, None] = None,
                      max_new_tokens: Optional[int] = None, *,
                      given_as: str = "max_new_tokens") -> Length:
    """The length of a run, settled as transformers' ``generate`` settles it: a
    ``max_new_tokens`` given (a flag, named ``given_as``) wins; else the checkpoint
    ``folder``'s generation_config.json (config.json's values when the folder has none, as
    transformers then reads them): its ``max_new_tokens``, else its ``max_length`` (the
    prompt and the answer together, :meth:`Length.new_tokens`), else transformers' default
    of :data:`DEFAULT_NEW_TOKENS` new tokens; also without a folder. ``max_new_tokens`` wins
    over ``max_length`` when the file sets both, as in transformers. The Python calls
    (``Generator.stream``, ``generate``) take the length they are given: this gives them the
    checkpoint's. UsageError / CheckpointError (one line) for a value that is not an int >= 1."""
    if max_new_tokens is not None and (isinstance(max_new_tokens, bool) or not isinstance(
            max_new_tokens, int) or max_new_tokens < 1):
        raise UsageError(f"{given_as} must be an int >= 1, got {max_new_tokens!r}")
    values, where = {}, "no checkpoint's generation_config.json"
    if folder is not None:
        folder = Path(folder)
        values = generation_values(folder)
        where = f"{folder.name}/generation_config.json"
        if values is None:  # transformers builds its generation config from config.json's
            config = _json(folder / "config.json")
            values = {key: _config_value(config, key) for key in ("max_new_tokens",
                                                                  "max_length")}
            where = f"{folder.name}/config.json"
    new = _length_value(values, "max_new_tokens", where)
    total = _length_value(values, "max_length", where)
    found = [f"{key} {value}" for key, value in (("max_new_tokens", new), ("max_length", total))
             if value is not None]
    if max_new_tokens is not None:
        note = f"overrides {where}'s {' and '.join(found)}" if found else ""
        return Length(int(max_new_tokens), None, given_as, note)
    if new is not None:
        note = (f"its max_length {total} is not used: max_new_tokens wins, as in transformers"
                if total is not None else "")
        return Length(new, None, where, note)
    if total is not None:
        return Length(None, total, where)
    note = (f"{where} sets neither max_new_tokens nor max_length" if folder is not None
            else where)
    return Length(DEFAULT_NEW_TOKENS, None, TRANSFORMERS_DEFAULT, note)


def context_length(folder: Union[str, Path]) -> Optional[int]:
    """The model's context (config.json's ``max_position_embeddings``), None if not given."""
    value = _config_value(_json(Path(folder) / "config.json"), "max_position_embeddings")
    return int(value) if isinstance(value, int) and value > 0 else None


class Detokenizer:
    """Text of a growing token sequence, given out as it becomes printable.

    Each :meth:`push` decodes a short window of the latest tokens twice, without and with the
    new one, and gives the difference, unless it ends in U+FFFD (an incomplete character):
    then nothing is given until a later token completes it. The window starts one emitted
    piece back, so what a decoder does to the first token of a sequence (SentencePiece drops
    its leading space) happens in both decodes and cancels. :meth:`finish` gives what is
    held back at the end. Joined, the pieces equal ``tokenizer.decode(tokens)``."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.tokens: list = []
        self._start = 0  # window start: one emitted piece before _read
        self._read = 0  # tokens up to here are given out as text

    def _decode(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=self.skip,
                                     clean_up_tokenization_spaces=False)

    def push(self, token: int) -> str:
        """Add ``token``; the text that is now complete ('' while a character is not)."""
        self.tokens.append(int(token))
        before = self._decode(self.tokens[self._start:self._read])
        after = self._decode(self.tokens[self._start:])
        if after.endswith(REPLACEMENT) or not after.startswith(before):
            return ""
        self._start, self._read = self._read, len(self.tokens)
        return after[len(before):]

    def finish(self) -> str:
        """The text still held back (an incomplete character at the end, as decode gives it)."""
        before = self._decode(self.tokens[self._start:self._read])
        after = self._decode(self.tokens[self._start:])
        self._start = self._read = len(self.tokens)
        return after[len(_common_prefix(before, after)):]


def _common_prefix(a: str, b: str) -> str:
    import os.path

    return os.path.commonprefix([a, b])


class StopStrings:
    """Text given out up to the first stop string (which is not given out).

    Text that could be the start of a stop string is held back until it is known not to
    be: a stop string split over tokens must neither be printed in part nor missed."""

    def __init__(self, stops: Iterable[str] = ()):
        self.stops = [s for s in stops if s]
        self.text = ""
        self._sent = 0
        self.stopped: Optional[str] = None  # the stop string found, once found

    def feed(self, piece: str) -> str:
        """Add ``piece``; the text safe to give out now."""
        if self.stopped is not None:
            return ""
        self.text += piece
        hits = [(self.text.find(s, self._sent), s) for s in self.stops]
        hits = [(at, s) for at, s in hits if at >= 0]
        if hits:
            at, self.stopped = min(hits)
            return self._send(at)
        return self._send(len(self.text) - self._held())

    def finish(self) -> str:
        """What is held back, once no more text comes (no stop string was completed)."""
        return "" if self.stopped is not None else self._send(len(self.text))

    def _held(self) -> int:
        """The longest end of the unsent text that begins some stop string."""
        tail = self.text[self._sent:]
        return max((k for s in self.stops for k in range(min(len(s) - 1, len(tail)), 0, -1)
                    if s.startswith(tail[-k:])), default=0)

    def _send(self, end: int) -> str:
        piece, self._sent = self.text[self._sent:end], max(self._sent, end)
        return piece


# --- what generation needs, carried beside an export ----------------------------------------

# Copied beside an export: what load_tokenizer, eos_ids and context_length read.
TEXT_FILES = (*TOKENIZER_FILES, "generation_config.json", "config.json", "chat_template.jinja",
              "chat_template.json", "special_tokens_map.json", "added_tokens.json", "merges.txt")


def text_folder(nnef: Union[str, Path]) -> Path:
    """``X.text`` beside the export ``X.nnef.tgz`` (or .nnef.tar, .nnef): the tokenizer,
    generation config and config that ``gdn-fx generate`` reads when no --model is given."""
    path = Path(nnef)
    for suffix in (".nnef.tgz", ".nnef.tar", ".nnef"):
        if path.name.endswith(suffix):
            return path.with_name(path.name[: -len(suffix)] + ".text")
    return path.with_name(path.name + ".text")


def save_text_files(checkpoint: Union[str, Path], nnef: Union[str, Path]) -> Optional[Path]:
    """Copy the tokenizer and generation files of ``checkpoint`` (:data:`TEXT_FILES`, no
    weights) to :func:`text_folder` of ``nnef``; None (and nothing written) when the folder
    holds no tokenizer. Written in a hidden folder and renamed: a folder at the final place is
    always complete; one of an earlier export there is replaced."""
    checkpoint, final = Path(checkpoint), text_folder(nnef)
    if not has_tokenizer(checkpoint):
        return None
    staged = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        for name in TEXT_FILES:
            if (checkpoint / name).is_file():
                shutil.copy2(checkpoint / name, staged / name)
        if final.exists():
            shutil.rmtree(final)
        os.replace(staged, final)
    finally:
        if staged.exists():
            shutil.rmtree(staged)
    return final
