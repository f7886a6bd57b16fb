"""The peer: torch-to-nnef-llm's artifact of the Qwen3.5-shaped model, exported and run in tract.

torch-to-nnef-llm (PyPI, 0.24.12) exports Qwen3.5 only in its multimodal checkpoint form
(``Qwen3_5ForConditionalGeneration``, model_type ``qwen3_5``: its handler registers a vision
encoder and a hybrid decoder). So :func:`export_peer` builds the text model exactly as
``bench_generate.build`` does (``gdn_fx.hf.tiny_model("qwen3_5", **shape)``, seed 0), copies
its weights into a ``Qwen3_5ForConditionalGeneration`` whose text config is that model's
config (a one-block 32-wide vision tower, the multimodal ids at the top of the vocabulary,
tied embeddings), writes it with ``save_pretrained`` beside a small word-level tokenizer (the
peer's loader needs a ``tokenizer.json``; its sample input only needs a few tokens), and runs
the peer's own entry point, ``dump_multimodal`` (what ``t2n_export_multimodal_to_tract -d DIR
-e OUT`` calls) in a fresh one-thread process with the peer on its path, with
``no_verify=True`` and ``tract_specific_path`` (``--no-verify --tract-specific-path``) set to
a stand-in answering ``--version`` with tract 0.23.9: otherwise the peer's target downloads a
tract CLI from GitHub, which this machine cannot reach (the artifact is checked in the tract
Python package instead, :func:`check_peer`).

The decoder graph it writes (``OUT/decoder/model.nnef.tgz``) has symbolic S and P: inputs
``input_ids`` [1, S], then per layer ``in_conv_state_i`` [1, conv_dim, K-1] and
``in_rec_state_i`` [1, Hv, Dk, Dv] (GDN) or ``cache_key_i`` / ``cache_value_i`` [1, Hkv, P, D]
(attention), then ``in_image_embeddings`` [N, hidden], ``in_image_grid_thw`` [G, 3],
``in_rope_deltas`` [1, 1]; outputs ``outputs`` (last-position logits [1, 1, V]), the new
states in the order of the inputs, then the three image inputs passed through. Text-only:
no image rows, rope delta 0.

    PYTHONPATH is not needed: the peer's site folder (default /tmp/peer/site, or
    $GDN_FX_PEER_SITE) is put on the export child's path by export_peer.

    .venv/bin/python bench/peer.py --quick [--workdir DIR]   # export, time, check (QUICK)
    .venv/bin/python bench/peer.py [--workdir DIR]           # the 0.8B shape (~25 min export)
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

PEER_SITE = Path(os.environ.get("GDN_FX_PEER_SITE", "/tmp/peer/site"))
# as bench_generate: prefill PREFILL tokens from empty caches, decode after PAST cached tokens
PAST, PREFILL, DECODE_STEPS = 512, 512, 8
TRACT_VERSION = "0.23.9"  # the tract the artifact is run in (gdn-fx targets it too)
_VISION = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64, patch_size=2,
               spatial_merge_size=2, temporal_patch_size=1, num_position_embeddings=16)
_WORDS = ("the a of and to in is was it for on with as by at from that this be are an or "
          "one two three model token text state").split()


# --- export ---------------------------------------------------------------------------------

def build_text(shape: dict):
    """The text model bench_generate.build builds (f32, seed 0)."""
    from gdn_fx.hf import tiny_model

    return tiny_model("qwen3_5", **shape)


def multimodal_of(text):
    """A Qwen3_5ForConditionalGeneration with ``text``'s config and weights (tiny vision)."""
    import torch
    import transformers as tf

    vocab = text.config.vocab_size
    config = tf.Qwen3_5Config(
        text_config=text.config.to_dict(),
        vision_config=dict(_VISION, out_hidden_size=text.config.hidden_size),
        vision_start_token_id=vocab - 4, image_token_id=vocab - 3, video_token_id=vocab - 2,
        vision_end_token_id=vocab - 1, tie_word_embeddings=text.config.tie_word_embeddings)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = tf.Qwen3_5ForConditionalGeneration(config).eval()
    state = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v
             for k, v in text.state_dict().items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or any("language_model" in k or k == "lm_head.weight" for k in missing):
        raise RuntimeError(f"weight copy failed: missing {missing}, unexpected {unexpected}")
    return model


def save_checkpoint(shape: dict, folder: Path) -> tuple[Path, int, int]:
    """The multimodal checkpoint (config.json, safetensors, tokenizer.json) in folder/ckpt;
    with the text model's parameter count and embedding size (as bench_generate counts)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    ckpt = folder / "ckpt"
    text = build_text(shape)
    params = sum(p.numel() for p in text.parameters())
    embedding = text.get_input_embeddings().weight.numel()
    model = multimodal_of(text)
    del text
    model.save_pretrained(ckpt)
    vocab = {"[UNK]": 0, **{w: i + 3 for i, w in enumerate(_WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(ckpt)
    return ckpt, params, embedding


def _export_child(shape: dict, folder: str) -> dict:
    """In the child: the checkpoint written, then the peer's dump_multimodal on it (timed)."""
    import logging

    import torch

    torch.set_num_threads(1)
    from torch_to_nnef_llm.multimodal_exporter import dump_multimodal

    folder = Path(folder)
    ckpt, params, embedding = save_checkpoint(shape, folder)
    out = folder / "export"
    shutil.rmtree(out, ignore_errors=True)  # the peer refuses an existing export folder
    # The peer's tract check needs a tract CLI, which TractNNEF downloads from GitHub (in its
    # constructor, even with the check off) unless given one: its --tract-specific-path is a
    # stand-in that only answers --version (the check is off, so nothing else calls it).
    cli = folder / "tract"
    cli.write_text(f'#!/bin/sh\necho "tract {TRACT_VERSION}"\n')
    cli.chmod(0o755)
    start = time.perf_counter()
    dump_multimodal(local_dir=ckpt, export_dirpath=out, no_verify=True,
                    tract_specific_path=str(cli), trust_remote_code=False,
                    log_level=logging.WARNING)
    return dict(seconds=time.perf_counter() - start, ckpt=str(ckpt), params=params,
                embedding=embedding)


def export_peer(shape: dict, folder) -> dict:
    """Build, save and export the model with the peer; artifact paths, seconds, NNEF bytes.

    All of it runs in a fresh one-thread child with the peer on its path (this process
    neither imports the peer nor holds the model). ``main`` is the decoder graph (the one
    benchmarked); ``vision`` the encoder graph the peer writes beside it (not counted in
    ``nnef``). ``export`` is the peer's own call (its load of the checkpoint included);
    ``wall`` the whole child, model build and save_pretrained included. ``params``,
    ``weight_bytes`` (f32, the tied table once: what the decoder graph stores) and
    ``flops_per_token`` are bench_generate's keys of the same names. On failure ``main`` is
    "" and ``error`` holds the child's last output."""
    folder = Path(folder) / "peer"
    folder.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(
                   [str(Path(__file__).resolve().parent), str(PEER_SITE),
                    os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    code = ("import json, peer; print('RESULT', json.dumps(peer._export_child("
            f"json.loads({json.dumps(shape)!r}), {str(folder)!r})))")
    start = time.perf_counter()
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    main = folder / "export" / "decoder" / "model.nnef.tgz"
    if not lines or not main.exists():
        return dict(main="", decode="", error=(run.stderr or run.stdout)[-3000:], wall=wall)
    got = json.loads(lines[-1][len("RESULT "):])
    vision = folder / "export" / "vision" / "model.nnef.tgz"
    params = got["params"]
    record = dict(main=str(main), decode="", vision=str(vision) if vision.exists() else "",
                  export=got["seconds"], wall=wall, nnef=main.stat().st_size,
                  vision_nnef=vision.stat().st_size if vision.exists() else 0,
                  ckpt=got["ckpt"], params=params, weight_bytes=params * 4,
                  flops_per_token=2 * (params - got["embedding"]))
    (folder / RECORD).write_text(json.dumps(record, indent=1))
    return record


RECORD = "export.json"  # what export_peer returned, beside the export (previous_export)


def previous_export(folder) -> dict:
    """What an earlier :func:`export_peer` into ``folder`` returned (its export seconds are
    that run's, on that run's machine load)."""
    return json.loads((Path(folder) / "peer" / RECORD).read_text())


# --- running the artifact in tract ----------------------------------------------------------

def load(path: str) -> tuple:
    """(tract runnable, input names, zero inputs for every input after input_ids, output
    names): the artifact loaded and optimized by tract as gdn_fx.tract_check.load does; a
    symbolic size (P, IMG_STATE, IMG_GRID) is 0 in the zero inputs."""
    import numpy as np
    import tract

    model = tract.nnef().with_tract_transformers().with_tract_extra().load(str(path))
    names = [model.input_name(i) for i in range(model.input_count())]
    outputs = [model.output_name(i) for i in range(model.output_count())]
    zeros = [np.zeros(_shape(model.input_fact(i)), dtype=_dtype(model.input_fact(i)))
             for i in range(1, len(names))]
    return model.into_runnable(), names, zeros, outputs


def _shape(fact) -> tuple:
    """A fact's shape with every symbol (P, IMG_STATE, IMG_GRID) at 0."""
    text = str(fact)  # e.g. "1,2,P,256,F32"
    dims = text.split(",")[:-1]
    return tuple(int(d) if d.strip().isdigit() else 0 for d in dims)


def _dtype(fact):
    import numpy as np

    kind = str(fact).split(",")[-1].strip().upper()
    return {"F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32}[kind]


def step(state, names, ids, carried, passthrough) -> tuple:
    """One call: (logits [1, V] of the last position, the new states, in input order)."""
    import tract

    arrays = [t.to_numpy() for t in state.run(
        [tract.Tensor.from_numpy(x) for x in [ids, *carried, *passthrough]])]
    n = len(carried)
    return arrays[0].reshape(arrays[0].shape[0], -1, arrays[0].shape[-1])[:, -1], arrays[1:1 + n]


def _split(zeros, names):
    """(the state/cache inputs, the three image inputs) of the zero inputs."""
    n = sum(1 for name in names[1:] if not name.startswith("in_image")
            and name != "in_rope_deltas")
    return zeros[:n], zeros[n:]


def run_peer(path: str, chunk: str = "") -> dict:
    """tract_run.run_tract's measurement of the peer artifact: load, prefill, decode.

    One State kept across calls; ``load`` is tract's load, into_runnable and spawn_state;
    prefill of PREFILL tokens from empty caches, best of 2, in one call (``prefill_whole``)
    and in calls of ``chunk`` tokens (``prefill``; one call when ``chunk`` is "", as
    run_tract's Generator does with its automatic chunk); decode is the median over
    DECODE_STEPS - 1 steps after the PAST-token prefill. A kept State of this artifact reads
    the recurrent states passed in only on its first call (tract's scan keeps its state in the
    State; check_peer), so every prefill after the first here starts from the previous call's
    recurrent states: the same work, so the same time, but not the same logits."""
    import numpy as np

    start = time.perf_counter()
    runnable, names, zeros, _ = load(path)
    state = runnable.spawn_state()
    load_s = time.perf_counter() - start
    carried0, passthrough = _split(zeros, names)
    ids = np.arange(3, 3 + PREFILL, dtype=np.int64)[None] % 1000 + 3
    size = int(chunk) if chunk else PREFILL
    timed = {}
    for name, piece in (("prefill_whole", PREFILL), ("prefill", size)):
        if piece == PREFILL and timed:  # the same calls as prefill_whole
            timed[name] = timed["prefill_whole"]
            continue
        runs = []
        for _ in range(2):
            begin = time.perf_counter()
            carried = [z.copy() for z in carried0]
            for first in range(0, PREFILL, piece):
                logits, carried = step(state, names, ids[:, first:first + piece], carried,
                                       passthrough)
            runs.append(time.perf_counter() - begin)
        timed[name] = min(runs)
    steps = []
    for _ in range(DECODE_STEPS):
        token = np.array([[int(logits[0].argmax())]], dtype=np.int64)
        begin = time.perf_counter()
        logits, carried = step(state, names, token, carried, passthrough)
        steps.append(time.perf_counter() - begin)
    return dict(load=load_s, decode=statistics.median(steps[1:]), **timed,
                **({"chunk": size} if chunk else {}))


# --- correctness ----------------------------------------------------------------------------

def check_peer(shape: dict, path: str, prompt: int = PREFILL, steps: int = DECODE_STEPS) -> dict:
    """The peer artifact against torch eager on the same weights: relative L2 error
    (||tract - torch|| / ||torch||) of the prefill logits (``prompt`` tokens from empty
    caches), of the first decode step's logits, and the largest over ``steps`` decode steps
    (torch's greedy tokens fed to both). Three ways of running tract:

    - "kept State": one State for every call, as run_peer runs it, and a first call on
      another prompt before the checked prefill (a State that kept its own recurrent state
      instead of the zeros passed in would show here);
    - "fresh State per call": a new State for every call;
    - "recurrent states zeroed": the first decode step fed zero recurrent states instead of
      the prefill's (the figure a graph that ignored the recurrent state it is given would
      match)."""
    import numpy as np
    import torch
    from transformers import DynamicCache

    model = build_text(shape)
    ids = np.arange(3, 3 + prompt, dtype=np.int64)[None] % 1000 + 3
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        ref = [model(input_ids=torch.from_numpy(ids), cache=cache, use_cache=True,
                     logits_to_keep=1).logits[:, -1].numpy()]
        tokens = []
        for _ in range(steps):
            tokens.append(np.array([[int(ref[-1][0].argmax())]], dtype=np.int64))
            ref.append(model(input_ids=torch.from_numpy(tokens[-1]), cache=cache,
                             use_cache=True).logits[:, -1].numpy())
    del model

    def rel(a, b):
        return float(np.linalg.norm(a - b) / np.linalg.norm(b))

    runnable, names, zeros, _ = load(path)
    carried0, passthrough = _split(zeros, names)
    result = {}
    for mode in ("kept State", "fresh State per call"):
        state = runnable.spawn_state()
        fresh = mode != "kept State"
        if not fresh:  # another prompt first, through the same State
            step(state, names, ids[:, ::-1].copy(), [z.copy() for z in carried0], passthrough)
        logits, carried = step(state, names, ids, [z.copy() for z in carried0], passthrough)
        errors = [rel(logits, ref[0])]
        for token, want in zip(tokens, ref[1:]):
            if fresh:
                state = runnable.spawn_state()
            logits, carried = step(state, names, token, carried, passthrough)
            errors.append(rel(logits, want))
        result[mode] = dict(prefill=errors[0], decode=errors[1], decode_max=max(errors[1:]))
    state = runnable.spawn_state()
    logits, carried = step(state, names, ids, [z.copy() for z in carried0], passthrough)
    blind = [np.zeros_like(c) if n.startswith("in_rec_state") else c
             for n, c in zip(names[1:], carried)]
    decoded, _ = step(runnable.spawn_state(), names, tokens[0], blind, passthrough)
    result["recurrent states zeroed"] = dict(decode=rel(decoded, ref[1]))
    return result


# --- command line ---------------------------------------------------------------------------

def main(argv=None) -> None:
    import argparse
    import tempfile

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import common

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--artifact", default=None, help="skip the export, use this decoder graph")
    ap.add_argument("--no-check", action="store_true")
    args = ap.parse_args(argv)
    shape = common.QUICK if args.quick else common.SHAPE
    folder = args.workdir or Path(tempfile.mkdtemp(prefix="gdn_fx_peer_"))
    if args.artifact:
        art = dict(main=args.artifact)
    else:
        art = export_peer(shape, folder)
        print("EXPORT", json.dumps(art), flush=True)
        if not art["main"]:
            sys.exit(1)
    timing = common.child("peer.run_peer", art["main"])  # a fresh one-thread process
    print("RUN", json.dumps(timing), flush=True)
    if not args.no_check:
        import torch

        torch.set_num_threads(1)
        print("CHECK", json.dumps(check_peer(shape, art["main"])), flush=True)


if __name__ == "__main__":
    main()
