"""The text demo end to end: checkpoint folder, generation-ready export, text generation in
tract checked token by token against transformers (``gdn-fx demo --text``).

1. a checkpoint folder (:func:`demo_checkpoint`): a tiny hybrid qwen3_5 and a
   byte-level BPE trained offline on gdn_fx/data/demo_corpus.txt, the model fitted to the
   same text for a few seconds so that the answer is words, not random bytes;
2. the generation-ready export of that folder (``export_generator``), the tokenizer and
   generation config copied beside it (``X.text``: ``gdn-fx generate`` then needs no
   ``--model``);
3. a greedy answer to a text prompt streamed from tract, compared with transformers'
   ``generate`` on the same ids (every token, every step's logits), with tokens/s.
"""

from __future__ import annotations

import sys
import time
from importlib import resources
from pathlib import Path
from typing import Callable, Union

PROMPT = "The keeper of the north light"
TRAIN_STEPS = 150
NEW_TOKENS = 48


def checkpoint_folder(out: Path) -> Path:
    """``out/demo-ckpt`` for ``out/demo.nnef.tgz``: the checkpoint beside the export."""
    from gdn_fx.runtime.text import text_folder

    return text_folder(out).with_name(text_folder(out).stem + "-ckpt")


def _timed(say: Callable[[str], None], stage: str, what: str):
    class _Stage:
        def __enter__(self):
            say(f"[{stage}] {what} ...")
            self.start = time.perf_counter()
            return self

        def __exit__(self, *exc):
            if exc[0] is None:
                say(f"[{stage}] done in {time.perf_counter() - self.start:.2f} s")
    return _Stage()


def run_demo(out: Path, say: Callable[[str], None] = print,
             train_steps: int = TRAIN_STEPS) -> int:
    """Run the three steps (module doc) with the export at ``out``; 0 when tract's answer is
    transformers' token for token, else 1."""
    from transformers import AutoModelForCausalLM

    from gdn_fx.hf.generator import Generator, export_generator
    from gdn_fx.runtime.text import eos_ids, load_tokenizer, save_text_files

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    folder = checkpoint_folder(out)
    with _timed(say, "checkpoint", f"tiny qwen3_5 + BPE tokenizer trained on the demo corpus, "
                f"model fitted for {train_steps} steps -> {folder}"):
        demo_checkpoint(folder, train_steps=train_steps)
    with _timed(say, "export", f"generation-ready NNEF -> {out}"):
        model = AutoModelForCausalLM.from_pretrained(str(folder)).eval()
        files = export_generator(model, out, say=lambda line: say(f"[export] {line}"))
        say(f"[export] tokenizer and generation config -> {save_text_files(folder, out)}")
    with _timed(say, "load", f"tract: {files.main.name}"
                + (f" + {files.decode.name}" if files.decode else "")):
        generator = Generator(files.main, files.decode)
    return _answer(generator, folder, load_tokenizer(folder), eos_ids(folder), out, say)


def _answer(generator, folder: Path, tokenizer, eos, out: Path, say) -> int:
    """Stream the answer to :data:`PROMPT`, then check it against transformers."""
    from transformers import AutoModelForCausalLM

    from gdn_fx.hf.generator import GenerationResult, check_generation
    from gdn_fx.runtime.streaming import stream

    run = stream(generator, PROMPT, tokenizer=tokenizer, max_new_tokens=NEW_TOKENS, eos=eos,
                 keep_logits=True)
    say(f"prompt: {PROMPT!r} ({len(run.summary.prompt)} tokens)")
    print("answer: " + PROMPT, end="", flush=True)
    for piece in run:
        print(piece.text, end="", flush=True)
    print()
    summary = run.summary
    reference = AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    found = check_generation(reference, GenerationResult(
        summary.prompt, list(summary.tokens), list(run.logits), summary.prefill_s,
        summary.decode_s))
    say(f"tract vs transformers' generate: {found}")
    say(f"tract: {summary.rates()}")
    say(f"try: gdn-fx generate --nnef {out} --prompt \"Is the light ever dark?\" --chat")
    say("OK" if found.ok else "NOT OK")
    sys.stdout.flush()
    return 0 if found.ok else 1


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
