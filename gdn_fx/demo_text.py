"""The text demo end to end: checkpoint folder, generation-ready export, text generation in
tract checked token by token against transformers (``gdn-fx demo --text``).

1. a checkpoint folder (:func:`gdn_fx.text.demo_checkpoint`): a tiny hybrid qwen3_5 and a
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
from pathlib import Path
from typing import Callable

PROMPT = "The keeper of the north light"
TRAIN_STEPS = 150
NEW_TOKENS = 48


def checkpoint_folder(out: Path) -> Path:
    """``out/demo-ckpt`` for ``out/demo.nnef.tgz``: the checkpoint beside the export."""
    from gdn_fx.text import text_folder

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
    from gdn_fx.text import demo_checkpoint, eos_ids, load_tokenizer, save_text_files

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
    from gdn_fx.streaming import stream

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
