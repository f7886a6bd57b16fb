"""``gdn-fx generate`` with text: its prompt, sampling and output flags, and the run.

    gdn-fx generate --nnef out/m.nnef.tgz --model CKPT --prompt "The keeper" --max-new-tokens 32
    echo "Hello" | gdn-fx generate --nnef out/m.nnef.tgz --model CKPT --prompt - --chat
    gdn-fx generate --nnef out/m.nnef.tgz --model CKPT --prompt-file p.txt --temperature 0.8 \\
        --top-p 0.95 --seed 1 --stop "\\n\\n" --json

The answer goes to stdout as it is decoded (``--json``: one JSON object at the end instead);
the load, the rates (prefill and decode tokens/s, time to first token) and ``--check``'s
verdict go to stderr. The tokenizer, EOS ids and context come from ``--model``'s folder, or
from the folder an export left beside the NNEF (:func:`gdn_fx.runtime.text.text_folder`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Optional

from gdn_fx.errors import UsageError

INTERRUPTED = 130  # a shell's status for a command ended by SIGINT (128 + 2)

SETTINGS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")
CHECKPOINT_DEFAULT = " (default: the checkpoint's generation_config.json, as transformers' " \
    "generate takes it; off without one)"


def add_text_arguments(parser: argparse.ArgumentParser) -> None:
    """The prompt (one of --prompt, --prompt-file, --prompt-ids), chat, sampling, stop and
    output flags of ``generate``."""
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="the prompt text, tokenized as given ('-': read it "
                        "from stdin, one final newline dropped)")
    prompt.add_argument("--prompt-file", type=Path, help="read the prompt text from a file "
                        "(one final newline, as editors add, dropped)")
    prompt.add_argument("--prompt-ids", help="token ids, e.g. 1,2,3")
    prompt.add_argument("--prompts-file", type=Path,
                        help="several prompts, one per line (text where a tokenizer is found, "
                        "else token ids such as 1,2,3); each answer is printed whole, in order "
                        "(--json: one JSON line per prompt)")
    parser.add_argument("--workers", type=int, default=1,
                        help="with --prompts-file: threads generating at once, each with its "
                        "own tract State on the one loaded model")
    parser.add_argument("--batch", type=int, default=None, metavar="B",
                        help="with --prompts-file: run a batched export (export_generator(..., "
                        "batch=B); B must be the one it declares) in one tract State, its B "
                        "slots decoding together, each freed slot taking the next prompt "
                        "(greedy; gdn_fx.hf.batch); with --workers N, N such States on the "
                        "one loaded model, the prompts dealt to them in turn")
    parser.add_argument("--chat", action="store_true",
                        help="wrap the prompt in the tokenizer's chat template (a user turn, "
                        "the assistant's turn opened)")
    parser.add_argument("--system", help="with --chat: a system message before the prompt")
    parser.add_argument("--greedy", action="store_true",
                        help="greedy decoding (transformers' do_sample=False) whatever the "
                        "checkpoint's generation_config.json asks; its repetition_penalty "
                        "still applies, as in transformers (--repetition-penalty 1: off)")
    parser.add_argument("--temperature", type=float, default=None,
                        help="0: greedy; > 0: sample" + CHECKPOINT_DEFAULT)
    parser.add_argument("--top-k", type=int, default=None,
                        help="keep the k likeliest (0: off)" + CHECKPOINT_DEFAULT)
    parser.add_argument("--top-p", type=float, default=None,
                        help="keep the likeliest tokens holding this mass (1: off)"
                        + CHECKPOINT_DEFAULT)
    parser.add_argument("--min-p", type=float, default=None,
                        help="drop tokens below this fraction of the likeliest's (0: off)"
                        + CHECKPOINT_DEFAULT)
    parser.add_argument("--repetition-penalty", type=float, default=None,
                        help="penalize tokens already in the prompt or answer (1: off)"
                        + CHECKPOINT_DEFAULT)
    parser.add_argument("--seed", type=int, default=None, dest="sample_seed", metavar="N",
                        help="the sampling seed (default: a fresh one, said on stderr and "
                        "by --json)")
    parser.add_argument("--stop", action="append", default=[], metavar="TEXT",
                        help="end at this text (not printed; \\n and \\t stand for a new "
                        "line and a tab); repeat for several")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON summary (text, tokens, rates) instead of the text")


def given_settings(args: argparse.Namespace) -> dict:
    """The sampling settings given on the command line (name -> value)."""
    return {name: getattr(args, name) for name in SETTINGS
            if getattr(args, name, None) is not None}


def uses_text_path(args: argparse.Namespace) -> bool:
    """Whether this ``generate`` needs the text path (anything beyond token ids in and out:
    a text prompt, sampling flags, stop strings, --json, several prompts)."""
    return (args.prompt is not None or args.prompt_file is not None or args.chat
            or getattr(args, "prompts_file", None) is not None
            or getattr(args, "batch", None) is not None
            or getattr(args, "workers", 1) != 1
            or bool(given_settings(args)) or bool(args.stop) or args.json
            or getattr(args, "sample_seed", None) is not None)


def check_sampling_flags(args: argparse.Namespace) -> dict:
    """The sampling flags given, each checked on its own (range, type: one-line UsageError
    naming the flag); whether they fit the run (greedy or sampling) is settled later by
    :func:`sampling_of`."""
    from gdn_fx.runtime.sampling import Sampling, spelled_as_given

    given = given_settings(args)
    probe = {**given, "temperature": given.get("temperature") or 1.0}
    try:
        Sampling(**probe, seed=getattr(args, "sample_seed", None))
    except UsageError as error:
        flags = {name: "--" + name.replace("_", "-") for name in (*SETTINGS, "seed")}
        raise UsageError(spelled_as_given(str(error), flags)) from None
    if args.greedy and given.get("temperature", 0) > 0:
        raise UsageError("--greedy and --temperature > 0 exclude each other (greedy takes "
                         "the most likely token)")
    return given


def sampling_of(args: argparse.Namespace, folder: Optional[Path] = None, plain: str = ""):
    """The :class:`~gdn_fx.runtime.sampling.Resolved` sampling of the run: the flags, then the
    checkpoint ``folder``'s generation_config.json, then transformers' defaults
    (:func:`gdn_fx.runtime.sampling.resolve`). ``plain``: the run can only be plain greedy (the
    reason, e.g. --check): the checkpoint's sampling is not used, and said."""
    from gdn_fx.runtime.sampling import resolve
    from gdn_fx.runtime.text import generation_values

    given = check_sampling_flags(args)
    seed = getattr(args, "sample_seed", None)
    config = generation_values(folder) if folder is not None else None
    name = f"{folder.name}/generation_config.json" if folder is not None else ""
    if plain:
        resolved = resolve(None, greedy=True, **given)
        note = plain
        if config is not None:
            try:
                asked = resolve(config, source=name, **given)
            except UsageError:
                asked = None
            if asked is None or asked.sampling != resolved.sampling:
                note += f"; the checkpoint's {name} is not used"
        return dataclasses.replace(resolved, mode_source=note)
    return resolve(config, greedy=args.greedy, source=name, seed=seed, **given)


def prompt_text(args: argparse.Namespace) -> Optional[str]:
    """The prompt text: --prompt exactly as given (every character reaches the tokenizer);
    from stdin (--prompt -) or --prompt-file with one final newline dropped (what `echo` and
    editors add); None for --prompt-ids."""
    if args.prompt is not None and args.prompt != "-":
        text = args.prompt
    else:
        if args.prompt is not None:
            text = sys.stdin.read()
        elif args.prompt_file is not None:
            try:
                text = args.prompt_file.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as error:
                raise UsageError(f"--prompt-file {args.prompt_file}: cannot read it "
                                 f"({type(error).__name__})") from None
        else:
            return None
        text = text[:-1] if text.endswith("\n") else text
    if not text.strip():
        raise UsageError("the prompt is empty: give some text")
    return text


def prompt_id_list(text: str) -> list:
    """``--prompt-ids 1,2,3`` as ints; one-line UsageError otherwise."""
    try:
        ids = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise UsageError(f"--prompt-ids must be integers separated by commas, got "
                         f"{text!r}") from None
    if not ids:
        raise UsageError("--prompt-ids is empty")
    return ids


def checkpoint_folder(args: argparse.Namespace) -> Optional[Path]:
    """The folder whose config and generation config the run follows: --model's, else the
    X.text folder an export left beside --nnef, else None."""
    from gdn_fx.runtime.text import text_folder

    if getattr(args, "model_dir", None) is not None:
        return args.model_dir
    beside = text_folder(args.nnef)
    return beside if beside.is_dir() else None


def text_source(args: argparse.Namespace) -> Optional[Path]:
    """The folder holding the tokenizer: --model's, else the one beside --nnef, else None."""
    from gdn_fx.runtime.text import has_tokenizer

    folder = checkpoint_folder(args)
    if folder is None or folder == getattr(args, "model_dir", None):
        return folder
    return folder if has_tokenizer(folder) else None


def say_sampling(resolved, seed: Optional[int] = None) -> None:
    """The sampling the run uses, one line on stderr."""
    print(f"[sampling] {resolved.line(seed)}", file=sys.stderr, flush=True)


def length_of(args: argparse.Namespace, folder: Optional[Path]):
    """The :class:`~gdn_fx.runtime.text.Length` of the run: --max-new-tokens, else the
    checkpoint ``folder``'s generation_config.json (max_new_tokens, else max_length), else
    transformers' default (:func:`gdn_fx.runtime.text.generation_length`)."""
    from gdn_fx.runtime.text import generation_length

    return generation_length(folder, args.max_new_tokens, given_as="--max-new-tokens")


def say_length(length, prompt_length: Optional[int] = None) -> None:
    """The length the run uses and where it came from, one line on stderr."""
    print(f"[length] {length.line(prompt_length)}", file=sys.stderr, flush=True)


def generate_text(args: argparse.Namespace) -> int:
    """Run ``generate`` on the text path; 0, or 1 when --check finds a difference."""
    from gdn_fx.runtime.streaming import check_context
    from gdn_fx.runtime.text import context_length, eos_ids, load_tokenizer, prompt_ids

    given = check_sampling_flags(args)
    text = prompt_text(args)
    if args.check and (given.get("temperature", 0) > 0
                       or given.get("repetition_penalty", 1) != 1):
        raise UsageError("--check compares plain greedy generation with transformers': leave "
                         "out --temperature and --repetition-penalty")
    if args.system and not args.chat:
        raise UsageError("--system goes with --chat")
    if args.workers != 1 and args.prompts_file is None:
        raise UsageError("--workers goes with --prompts-file (one prompt runs on one thread)")
    if args.batch is not None and args.prompts_file is None:
        raise UsageError("--batch goes with --prompts-file (the prompts the slots serve)")
    if args.batch is not None and (given.get("temperature", 0) > 0
                                   or given.get("repetition_penalty", 1) != 1 or args.stop):
        raise UsageError("--batch runs greedy generation: leave out --temperature, "
                         "--repetition-penalty and --stop")
    if args.check and not (args.family or args.config or args.model_dir):
        raise UsageError("--check needs the model: --family, --config or --model")
    folder = text_source(args)
    if text is not None and folder is None:
        raise UsageError("a text prompt needs a tokenizer: --model CHECKPOINT_DIR (a folder "
                         "holding one), or an export that carries one beside --nnef")
    tokenizer = load_tokenizer(folder) if folder is not None else None
    source = checkpoint_folder(args)
    plain = ("--check compares plain greedy generation with transformers'" if args.check
             else "--batch runs plain greedy generation" if args.batch is not None else "")
    resolved = sampling_of(args, source, plain)
    length = length_of(args, source)
    context = context_length(source) if source is not None else None
    args.stop = [stop.replace("\\n", "\n").replace("\\t", "\t") for stop in args.stop]
    options = dict(tokenizer=tokenizer, sampling=resolved.sampling,
                   eos=eos_ids(source, tokenizer) if source is not None else [],
                   stop=args.stop, context=context, keep_logits=args.check)
    if args.prompts_file is not None:
        prompts = prompts_of_file(args.prompts_file, tokenizer, args)
        prompts = [prompt_ids(tokenizer, p) if isinstance(p, str) else p for p in prompts]
        if context is not None:
            for index, ids in enumerate(prompts):
                check_context(ids, context, f"prompt {index} of --prompts-file")
        counts = [length.new_tokens(len(ids), f"prompt {index} of --prompts-file")
                  for index, ids in enumerate(prompts)]
        run = _batched if args.batch is not None else _many
        return run(args, prompts, counts, options, resolved, length)
    if text is not None:
        prompt = prompt_ids(tokenizer, text, chat=args.chat, system=args.system)
    else:
        prompt = prompt_id_list(args.prompt_ids)
    if context is not None:
        check_context(prompt, context)
    options["max_new_tokens"] = length.new_tokens(len(prompt))
    return _report(args, _stream(args, prompt, options, resolved, length))


def prompts_of_file(path: Path, tokenizer, args: argparse.Namespace) -> list:
    """The prompts of ``--prompts-file``, one per non-empty line: text (chat-wrapped with
    --chat) where there is a tokenizer, else token ids (``1,2,3``)."""
    from gdn_fx.runtime.text import prompt_ids

    try:
        lines = [line for line in path.read_text(encoding="utf-8").splitlines()
                 if line.strip()]
    except (OSError, UnicodeDecodeError) as error:
        raise UsageError(f"--prompts-file {path}: cannot read it "
                         f"({type(error).__name__})") from None
    if not lines:
        raise UsageError(f"--prompts-file {path} holds no prompt (one per line)")
    if tokenizer is None:
        found = []
        for number, line in enumerate(lines, 1):
            try:
                found.append(prompt_id_list(line))
            except UsageError as error:
                raise UsageError(f"--prompts-file {path} line {number}: with no tokenizer "
                                 f"each line is token ids: {error}") from None
        return found
    if args.chat:
        return [prompt_ids(tokenizer, line, chat=True, system=args.system) for line in lines]
    return lines


def _open(args):
    """The Generator of --nnef (and its decode graph, unless --no-decode)."""
    from gdn_fx.runtime.generator import Generator

    chunk = "auto" if args.prefill_chunk is None else (args.prefill_chunk or None)
    return Generator.open(args.nnef, use_decode=not args.no_decode, prefill_chunk=chunk,
                          runtime=args.runtime, kv_in_state=args.kv_in_state)


def _load(args):
    """The Generator of --nnef, its load timed on stderr."""
    if not args.nnef.exists():
        raise UsageError(f"--nnef {args.nnef} does not exist")
    start = time.perf_counter()  # said once loaded: a refusal stays the one line on stderr
    generator = _open(args)
    graphs = "main and decode graphs" if generator.decode is not generator.main else \
        "main graph (serves decode)"
    print(f"[load] {args.nnef}: {graphs} in {time.perf_counter() - start:.2f} s",
          file=sys.stderr, flush=True)
    return generator


def _stream(args, prompt, options, resolved, length):
    """The Generator loaded and the stream started; the sampling and the length it uses said
    on stderr."""
    from gdn_fx.runtime.streaming import stream

    run = stream(_load(args), prompt, **options)
    say_sampling(resolved, run.sampler.seed)
    say_length(length, len(prompt))
    return run


def _many(args, prompts: list, counts: list, options: dict, resolved, length) -> int:
    """Every prompt of --prompts-file run to its end (``counts``: each one's new tokens at
    most) by --workers threads; the answers in order (text, or one JSON line each), the
    aggregate rate and --check's verdicts on stderr. 0, or 1 when --check finds a
    difference."""
    from gdn_fx.runtime.parallel import check_workers, serve
    from gdn_fx.runtime.streaming import stream

    workers = check_workers(args.workers)
    generator = _load(args)
    say_sampling(resolved)
    say_length(length)

    def finish(fork, item):
        prompt, count = item
        run = stream(fork, prompt, max_new_tokens=count, **options)
        for _ in run:
            pass
        return run

    start = time.perf_counter()
    runs = serve(generator, list(zip(prompts, counts)), finish, workers)
    elapsed = time.perf_counter() - start
    model = checked_model(args) if args.check else None
    failed = 0
    for index, run in enumerate(runs):
        found = _check(args, run, model) if model is not None else None
        failed += found is not None and not found.ok
        summary = run.summary
        if summary.finish_reason == "context":
            print(f"[context] prompt {index}: {summary.ending()}", file=sys.stderr)
        if args.json:
            values = {"prompt_index": index, **summary.as_dict()}
            if found is not None:
                values["check"] = {"ok": found.ok, "text": str(found)}
            print(json.dumps(values, ensure_ascii=False))
        else:
            print(f"=== prompt {index}")
            print(summary.text if run.tokenizer is not None else
                  "tokens: " + ",".join(map(str, summary.tokens)))
    total = sum(len(run.summary.tokens) for run in runs)
    print(f"tract: {len(runs)} prompts, {total} new tokens in {elapsed:.2f} s "
          f"({total / elapsed:.1f} tokens/s aggregate) on {workers} worker thread(s)",
          file=sys.stderr)
    return 1 if failed else 0


def _batched(args, prompts: list, counts: list, options: dict, resolved, length) -> int:
    """Every prompt of --prompts-file through the --batch slots of a batched export
    (``gdn_fx.hf.batch.BatchGenerator``), each to its own count of new tokens (``counts``;
    greedy: the slots run to the largest and each answer is cut to its own): output as
    ``_many`` gives it. 0, or 1 when --check finds a difference."""
    from gdn_fx.runtime.batch import BatchGenerator, check_batch
    from gdn_fx.runtime.parallel import check_workers

    batch, workers = check_batch(args.batch), check_workers(args.workers)
    if not args.nnef.exists():
        raise UsageError(f"--nnef {args.nnef} does not exist")
    start = time.perf_counter()
    generator = BatchGenerator(args.nnef, **({"prefill_chunk": args.prefill_chunk}
                                            if args.prefill_chunk else {}))
    if generator.batch != batch:
        raise UsageError(f"--batch {batch}: {args.nnef} was exported for batch "
                         f"{generator.batch}")
    print(f"[load] {args.nnef}: batched graph (B = {batch}) in "
          f"{time.perf_counter() - start:.2f} s", file=sys.stderr, flush=True)
    say_sampling(resolved)
    say_length(length)
    tokenizer = options["tokenizer"]
    results = generator.generate(prompts, max(counts), keep_logits=args.check,
                                 eos=options["eos"], workers=workers)
    context = options["context"]
    for index, result in enumerate(results):  # the slots ran on: what fits is the answer
        del result.tokens[counts[index]:], result.logits[counts[index]:]
        room = len(result.tokens) if context is None else context - len(result.prompt)
        if len(result.tokens) > room:
            del result.tokens[room:], result.logits[room:]
            print(f"[context] prompt {index}: cut by the context: the prompt's "
                  f"{len(result.prompt)} tokens and {room} new fill the model's {context} "
                  f"(max_position_embeddings)", file=sys.stderr)
    model = checked_model(args) if args.check else None
    failed = 0
    for index, result in enumerate(results):
        found = None
        if model is not None:
            from gdn_fx.hf.generator import check_generation

            found = check_generation(model[0], result)
            print(f"check against transformers ({model[1]}), prompt {index}: {found}",
                  file=sys.stderr)
            failed += not found.ok
        text = tokenizer.decode(result.tokens) if tokenizer is not None else None
        if args.json:
            values = {"prompt_index": index, "prompt": result.prompt, "tokens": result.tokens,
                      "text": text, "prefill_s": result.prefill_s, "decode_s": result.decode_s}
            if found is not None:
                values["check"] = {"ok": found.ok, "text": str(found)}
            print(json.dumps(values, ensure_ascii=False))
        else:
            print(f"=== prompt {index}")
            print(text if text is not None else "tokens: " + ",".join(map(str, result.tokens)))
    states = "one State" if workers == 1 else f"each of {workers} States"
    print(f"tract: {len(results)} prompts, {generator.stats.rates()}, B = {batch} in {states}",
          file=sys.stderr)
    if model is not None:
        print("OK" if not failed else "NOT OK", file=sys.stderr)
    return 1 if failed else 0


def _report(args, run) -> int:
    """Print the answer as it comes (or the JSON summary), the rates, --check's verdict.
    Ctrl-C ends it cleanly: the answer so far printed (the JSON summary so far, finish_reason
    "interrupted"), one line on stderr, status 130."""
    out = sys.stdout
    shows_text = not args.json and run.tokenizer is not None
    try:
        for piece in run:
            if shows_text:
                out.write(piece.text)
                out.flush()
    except KeyboardInterrupt:
        rest = run.interrupted()
        if shows_text:
            out.write(rest)
        _answer_end(args, run)
        if args.json:
            print(json.dumps(run.summary.as_dict(), ensure_ascii=False))
        return interrupted(len(run.summary.tokens))
    summary = run.summary
    _answer_end(args, run)
    print(f"tract: {summary.rates()}", file=sys.stderr)
    found = _check(args, run) if args.check else None
    if args.json:
        values = summary.as_dict()
        if found is not None:
            values["check"] = {"ok": found.ok, "text": str(found)}
        print(json.dumps(values, ensure_ascii=False))
    return 0 if found is None or found.ok else 1


def _answer_end(args, run) -> None:
    """The end of the printed answer: its new line, or the token ids without a tokenizer."""
    if not args.json:
        print() if run.tokenizer is not None else print(
            "tokens: " + ",".join(map(str, run.summary.tokens)))
    sys.stdout.flush()


def interrupted(count: int) -> int:
    """Say on stderr that Ctrl-C ended the run after ``count`` new tokens; the status."""

    print(f"gdn-fx: interrupted (Ctrl-C) after {count} new token{'s' if count != 1 else ''}",
          file=sys.stderr, flush=True)
    return INTERRUPTED


def generate_ids(args: argparse.Namespace) -> int:
    """``generate --prompt-ids`` without the text path's flags: the token ids out on stdout
    ("tokens: ..."), the rates and --check's verdict too, a progress bar on stderr. The
    checkpoint the run follows (--model's folder, else the X.text folder beside --nnef) gives
    the EOS ids, the context and the sampling (generation_config.json), as on the text path.
    0, or 1 when --check finds a difference."""
    from gdn_fx.runtime.streaming import check_context, stream
    from gdn_fx.runtime.text import context_length, eos_ids

    prompt = prompt_id_list(args.prompt_ids)
    if args.check and not (args.family or args.config or args.model_dir):
        raise UsageError("--check needs the model: --family, --config or --model")
    folder = checkpoint_folder(args)
    plain = "--check compares plain greedy generation with transformers'" if args.check else ""
    resolved = sampling_of(args, folder, plain)
    length = length_of(args, folder)
    context = context_length(folder) if folder is not None else None
    if context is not None:
        check_context(prompt, context)
    max_new = length.new_tokens(len(prompt))
    if not args.nnef.exists():
        raise UsageError(f"--nnef {args.nnef} does not exist")
    generator = _open(args)
    run = stream(generator, prompt, max_new_tokens=max_new, sampling=resolved.sampling,
                 eos=eos_ids(folder) if folder is not None else [], context=context,
                 keep_logits=args.check)
    del generator
    say_sampling(resolved, run.sampler.seed)
    say_length(length, len(prompt))
    total = run.max_new_tokens
    try:
        for count, _ in enumerate(run, 1):
            _progress(count, total)
    except KeyboardInterrupt:
        run.interrupted()
        print(file=sys.stderr)
        _answer_end(args, run)
        return interrupted(len(run.summary.tokens))
    print(file=sys.stderr)
    summary = run.summary
    print("tokens: " + ",".join(map(str, summary.tokens)))
    print(f"tract: {summary.rates()}")
    if not args.check:
        return 0
    import gc

    from gdn_fx import tract_check
    from gdn_fx.hf.generator import GenerationResult, check_generation

    run.release()  # tract's copy of the weights goes before transformers' comes
    gc.collect()
    tract_check.release_freed_memory()
    model, name = checked_model(args)
    result = GenerationResult(summary.prompt, list(summary.tokens), list(run.logits),
                              summary.prefill_s, summary.decode_s)
    found = check_generation(model, result)
    print(f"check against transformers ({name}): {found}")
    print("OK" if found.ok else "NOT OK")
    return 0 if found.ok else 1


def _progress(done: int, total: int, width: int = 30) -> None:
    filled = width * done // total
    print(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} tokens", end="",
          file=sys.stderr, flush=True)


def checked_model(args):
    """(model, name) that --check compares with: the model of --family / --config / --model
    holding the weights as --nnef stores them (f16 rounded, Q4_0 dequantized: what tract
    multiplies with; read one weight at a time, in place: no second copy of the model)."""
    from gdn_fx.hf.generator import with_stored_weights
    from gdn_fx.pipeline import Job, build_model

    if args.model_dir is not None:  # the checkpoint's small parameters, the file's matrices
        from gdn_fx.hf.checkpoint import stored_reference

        model = stored_reference(args.model_dir, args.nnef).eval()
        return model, f"{model.config.model_type} from {args.model_dir}"
    model, name = build_model(Job(family=args.family, config=args.config,
                                  model_dir=args.model_dir, seed=args.seed))
    return with_stored_weights(model, args.nnef, in_place=True), name


def _check(args, run, checked=None):
    """Every token and logit against transformers' generate on the same model."""
    from gdn_fx.hf.generator import GenerationResult, check_generation

    if checked is None:  # the one prompt's run: tract's model goes before transformers' comes
        import gc

        from gdn_fx import tract_check

        run.release()
        gc.collect()
        tract_check.release_freed_memory()
    model, name = checked or checked_model(args)
    summary = run.summary
    result = GenerationResult(summary.prompt, list(summary.tokens), list(run.logits),
                              summary.prefill_s, summary.decode_s)
    found = check_generation(model, result)
    print(f"check against transformers ({name}): {found}", file=sys.stderr)
    print("OK" if found.ok else "NOT OK", file=sys.stderr)
    return found
