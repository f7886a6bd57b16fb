"""Text around the token ids: the checkpoint's tokenizer, chat prompts, streamed detokenizing,
end-of-sequence ids, stop strings, and a tiny offline tokenizer for demos and tests.

    tokenizer = load_tokenizer("ckpt/")                  # transformers' AutoTokenizer
    ids = prompt_ids(tokenizer, "Hello", chat=True)      # the folder's chat template
    text = Detokenizer(tokenizer)                        # text.push(token) -> printable text
    demo_checkpoint("out/demo-ckpt")                     # tiny model + BPE trained offline

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
from importlib import resources
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
    """transformers' ``AutoTokenizer`` of the checkpoint ``folder``. UsageError (one line)
    when the folder holds no tokenizer, CheckpointError when transformers cannot load it."""
    from transformers import AutoTokenizer

    folder = Path(folder)
    if not folder.is_dir():
        raise UsageError(f"{folder} is not a folder: the tokenizer is read from a checkpoint "
                         "folder (tokenizer.json, tokenizer_config.json, ...)")
    if not has_tokenizer(folder):
        raise UsageError(f"{folder} holds no tokenizer ({', '.join(TOKENIZER_FILES[:2])}, ...): "
                         "give token ids (--prompt-ids) or save the tokenizer there")
    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except (OSError, ValueError, TypeError, KeyError) as error:
        first = next((line for line in str(error).splitlines() if line.strip()), repr(error))
        raise CheckpointError(f"transformers cannot load the tokenizer in {folder}: "
                              f"{first.strip()[:200]}") from None


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


# --- a tiny tokenizer made offline ----------------------------------------------------------

DEMO_SPECIALS = ("<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>")  # ids 0 to 4
# A ChatML-like template: each message in <|im_start|>role ... <|im_end|>; the assistant's
# turn ends with <|im_end|>, which the demo checkpoint lists as an EOS id beside </s>.
DEMO_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def demo_corpus() -> str:
    """The text the demo tokenizer is trained on (gdn_fx/data/demo_corpus.txt): a few KB of
    English with accented letters, Japanese and emoji, so that some pieces are bytes."""
    return resources.files("gdn_fx").joinpath("data/demo_corpus.txt").read_text("utf-8")


def demo_tokenizer(vocab_size: int = 512):
    """A byte-level BPE of ``vocab_size`` ids trained on :func:`demo_corpus` with
    ``tokenizers`` (offline, deterministic), as a transformers fast tokenizer: pad ``<pad>``
    (0), BOS ``<s>`` (1), EOS ``</s>`` (2), the chat markers (3, 4) and
    :data:`DEMO_CHAT_TEMPLATE`. The ids 0-2 are those of gdn_fx.hf's tiny configs."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    # Every byte is in the alphabet, so any text encodes, whatever the corpus held.
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(DEMO_SPECIALS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    bpe.train_from_iterator(demo_corpus().splitlines(keepends=True), trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>",
                                        pad_token="<pad>", clean_up_tokenization_spaces=False)
    tokenizer.chat_template = DEMO_CHAT_TEMPLATE
    return tokenizer


def train_on_corpus(model, tokenizer, steps: int, seed: int = 0, length: int = 64,
                    batch: int = 16, rate: float = 3e-3) -> float:
    """Fit ``model`` to :func:`demo_corpus` for ``steps`` AdamW steps on random windows of
    ``length`` tokens (seeded: the same weights every time); returns the last loss. ~0.07 s
    a step for the tiny qwen3_5 (one thread): 150 steps take the loss from 6.2 to ~0.3,
    enough for the demo to continue a line of the corpus in words, not random bytes."""
    import torch

    ids = torch.tensor(tokenizer(demo_corpus())["input_ids"])
    random = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=rate)
    model.train()
    loss = float("nan")
    for _ in range(steps):
        starts = torch.randint(0, len(ids) - length, (batch,), generator=random).tolist()
        window = torch.stack([ids[s:s + length] for s in starts])
        out = model(input_ids=window, labels=window)
        optimizer.zero_grad()
        out.loss.backward()
        optimizer.step()
        loss = out.loss.item()
    model.eval()
    return loss


def demo_checkpoint(folder: Union[str, Path], family: str = "qwen3_5", seed: int = 0,
                    vocab_size: int = 512, train_steps: int = 0) -> Path:
    """Write a checkpoint folder as ``save_pretrained`` writes one: a tiny model of
    ``family`` (``gdn_fx.hf.tiny_model``, random weights seeded by ``seed``; with
    ``train_steps``, fitted to the corpus by :func:`train_on_corpus`) whose vocabulary is the
    demo tokenizer's, the tokenizer itself (:func:`demo_tokenizer`), and a generation config
    whose EOS ids are ``</s>`` and ``<|im_end|>``. Returns the folder."""
    import torch

    from gdn_fx.hf import tiny_model

    folder = Path(folder)
    tokenizer = demo_tokenizer(vocab_size)
    special = dict(pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                   eos_token_id=tokenizer.eos_token_id)
    model = tiny_model(family, seed=seed, vocab_size=len(tokenizer), **special)
    if train_steps:
        threads = torch.get_num_threads()
        # One thread: these tiny matmuls gain nothing from two, and on shared cores two
        # threads that spin-wait on each other made the fit 20x slower (seen: 433 s, not 20).
        torch.set_num_threads(1)
        try:
            with torch.random.fork_rng(devices=[]):  # the fit must not move the global RNG
                torch.manual_seed(seed)
                train_on_corpus(model, tokenizer, train_steps, seed)
        finally:
            torch.set_num_threads(threads)
    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, end_of_turn]
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
