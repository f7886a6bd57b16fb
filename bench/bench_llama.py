"""llama.cpp beside gdn-fx on the same checkpoint folder: prefill, decode, memory, bytes, load.

llama.cpp is a benchmark PEER here, never a dependency of gdn-fx: this script downloads the
llama.cpp sources that llama-cpp-python 0.3.36's sdist vendors (from PyPI's index), builds
llama-bench, llama-quantize and llama-tokenize (cmake, Release, CPU only) into ``--llama-dir``
(default ~/.cache/gdn_fx_llama; skipped when the binaries are there), and compiles beside them
a small greedy program of this script's own (GREEDY_CPP) against llama.cpp's C API.

One checkpoint folder (bench_checkpoint.write_checkpoint: bf16, random weights, in a child)
with a byte-level BPE tokenizer trained offline (gdn_fx.demo_text.demo_tokenizer, 512 ids, GPT-2
split rule), then per format:
- gdn-fx: ``export_checkpoint`` (bench_checkpoint.export: f32, f16 = the model in f16
  (``--dtype f16``), f16w = f32 model with f16 weights (``--weights f16``: f32 activations;
  llama.cpp's f16 rounds its activations to f16 in each product), q4_0 = f32 model with
  Q4_0 matmul weights and embedding table, one table for a tied head), measured by
  tract_run.run_tract in a fresh ONE-thread Python process that imports the torch-free
  runtime only, as a deployment does: load, prefill of 512 tokens in the Generator's
  automatic chunks, decode ms/token after those 512, the process's peak RSS (Python, numpy
  and tract; glibc as users have it);
- llama.cpp: convert_hf_to_gguf.py (--outtype f32 / f16; f16w runs the f16 GGUF), Q4_0 by
  ``llama-quantize`` from the f32 GGUF (llama.cpp's default Q4_0 mix: the tied embedding /
  head table gets a larger type; ``--pure``: every matmul weight Q4_0); ``llama-bench`` at 1
  and 2 threads (pp512 from an empty cache; tg at depth 512, the 512 tokens of depth not
  timed); load seconds and peak RSS (VmHWM; the GGUF is mmapped, its touched pages count) of
  the greedy program prefilling the same 512 ids as run_tract and decoding 8 tokens, one
  thread.
- gdn-fx on 2 threads: the same artifacts, run_tract with 2 threads (tract 0.23.9's matmuls
  take one whatever the setting: the column shows what a second core gives one sequence).
Engines alternate in ``--rounds`` rounds (the starting engine rotates), so a slow spell hits
both; figures are medians over rounds, a ratio is the median of per-round ratios
(gdn-fx / llama.cpp: above 1x, gdn-fx is slower or larger).

Token check: the prompt PROMPT tokenized by transformers and by llama.cpp (llama-tokenize)
must give the same ids; then greedy tokens (argmax, EOS not stopping) after those ids from
transformers' eager model on the stored weights in f32 (the reference), gdn-fx's Generator
in tract and the greedy program on the GGUF, per format: the count of leading tokens equal to
the reference's; gdn-fx's also against transformers on the weights its artifact stores.
Random weights give flat logits, so a near tie may flip a token in f16 / Q4_0 (or even f32,
by summation order) without either engine being wrong.

    .venv/bin/python bench/bench_llama.py --quick                 # 4 layers, vocab 32k
    .venv/bin/python bench/bench_llama.py --formats q4_0          # the 0.8B shape
    .venv/bin/python bench/bench_llama.py --workdir W --reuse ... # keep W's files
    .venv/bin/python bench/bench_llama.py --llama-dir D --quick   # llama.cpp built in D

The converter refuses a tokenizer it does not know by the hash of its pre-tokenizer's output
(convert_hf_to_gguf_update.py's list): CONVERT wraps it and answers "gpt-2" (the split rule
of tokenizers' ByteLevel pre-tokenizer, which demo_tokenizer uses) where it would refuse;
the tokenizer check above verifies it. No llama.cpp file is edited.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

LLAMA_CPP_PYTHON = "0.3.36"  # the sdist whose vendor/llama.cpp is built
SHAPES = {"quick": "quick", "0.8b": "0.8b", "falcon_h1_0.5b": "falcon_h1_0.5b",
          "granite_h_1b": "granite_h_1b"}  # bench_checkpoint.SHAPES names
FORMATS = ("f32", "f16", "f16w", "q4_0")
GGUF_FORMAT = {"f16w": "f16"}  # llama.cpp's file for a gdn-fx format (f16w: f16 weights)
PROMPT = "The keeper of the north light"
NEW_TOKENS = 64
PAST = 512  # prefill length and decode depth, as bench_generate
THREADS = (1, 2)


# --- llama.cpp: download and build (once per --llama-dir) -------------------------------------

@dataclass
class Llama:
    """The llama.cpp tree and the programs this benchmark runs."""

    src: Path
    bench: Path
    quantize: Path
    tokenize: Path
    greedy: Path


def cmake_flags() -> list:
    """CPU only, the x86 extensions /proc/cpuinfo lists, and no AMX: on the VM this was made
    on, ggml's AMX path crashed on Q4_0 (SIGSEGV in ggml_backend_amx_mul_mat). No
    curl/openssl (no downloads), no server."""
    found = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                found = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    flags = ["-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF", "-DGGML_NATIVE=OFF",
             "-DGGML_OPENMP=ON", "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF",
             "-DGGML_AMX_BF16=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
             "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_APP=OFF"]
    for option, flag in (("AVX", "avx"), ("AVX2", "avx2"), ("BMI2", "bmi2"), ("FMA", "fma"),
                         ("F16C", "f16c"), ("AVX512", "avx512f"),
                         ("AVX512_VBMI", "avx512vbmi"), ("AVX512_VNNI", "avx512_vnni"),
                         ("AVX512_BF16", "avx512_bf16")):
        flags.append(f"-DGGML_{option}={'ON' if flag in found else 'OFF'}")
    return flags


TARGETS = ("llama-bench", "llama-quantize", "llama-tokenize")


def build_llama(root: Path, say=print) -> Llama:
    """llama.cpp under ``root`` (downloaded and built unless its binaries are there)."""
    root = root.expanduser().resolve()
    src = root / f"llama_cpp_python-{LLAMA_CPP_PYTHON}" / "vendor" / "llama.cpp"
    build = root / "build"
    tools = Llama(src, *(build / "bin" / name for name in TARGETS), root / "bin" / "greedy")
    if all(p.exists() for p in (tools.bench, tools.quantize, tools.tokenize)):
        _greedy(tools, build, say)
        return tools
    root.mkdir(parents=True, exist_ok=True)
    if not (src / "convert_hf_to_gguf.py").exists():
        sdist = root / f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"
        if not sdist.exists():
            _download_sdist(sdist, say)
        with tarfile.open(sdist) as archive:
            archive.extractall(root, filter="data")
    _run(["cmake", "-S", str(src), "-B", str(build), *cmake_flags()], say)
    jobs = str(max(1, min(os.cpu_count() or 1, 8)))
    start = time.perf_counter()
    _run(["cmake", "--build", str(build), "--config", "Release", "-j", jobs,
          "--target", *TARGETS], say)
    say(f"[llama.cpp] built in {time.perf_counter() - start:.0f} s under {build}")
    _greedy(tools, build, say)
    return tools


def _download_sdist(into: Path, say) -> None:
    """The sdist file itself, from PyPI's simple index: ``pip download --no-binary :all:``
    also builds every build dependency from source (cmake, ninja: many minutes)."""
    import re
    import urllib.request

    index = "https://pypi.org/simple/llama-cpp-python/"
    say(f"[llama.cpp] {into.name} from {index}")
    page = urllib.request.urlopen(index).read().decode()
    link = re.search(rf'href="([^"#]*{re.escape(into.name)})[#"]', page)
    if link is None:
        raise RuntimeError(f"{into.name} is not listed at {index}")
    urllib.request.urlretrieve(link.group(1).replace("&amp;", "&"), into)


def _run(argv: list, say, label: str = "") -> None:
    say("[llama.cpp] " + (label or " ".join(map(str, argv))))
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{argv[0]} failed ({done.returncode}): {done.stderr[-3000:]}")


# The greedy program: llama.cpp's C API only (no llama.cpp example code), so that llama.cpp's
# side of the token check and of load / memory is a plain process with nothing else in it.
GREEDY_CPP = r"""
// greedy MODEL.gguf THREADS NEW_TOKENS ID,ID,...: greedy continuation of the ids (EOS does
// not stop it), one JSON line of figures on stdout
#include "llama.h"
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

static long status_kib(const char * key) {  // VmRSS: / VmHWM: of /proc/self/status
    std::ifstream in("/proc/self/status");
    for (std::string line; std::getline(in, line);)
        if (line.rfind(key, 0) == 0) return std::atol(line.c_str() + std::strlen(key));
    return 0;
}

static double now() {
    using namespace std::chrono;
    return duration<double>(steady_clock::now().time_since_epoch()).count();
}

static void quiet(enum ggml_log_level, const char *, void *) {}

int main(int argc, char ** argv) {
    if (argc != 5) {
        std::fprintf(stderr, "usage: %s MODEL.gguf THREADS NEW_TOKENS ID,ID,...\n", argv[0]);
        return 2;
    }
    const int threads = std::atoi(argv[2]), wanted = std::atoi(argv[3]);
    std::vector<llama_token> prompt;
    std::stringstream ids(argv[4]);
    for (std::string item; std::getline(ids, item, ',');) prompt.push_back(std::atoi(item.c_str()));
    if (!std::getenv("GREEDY_VERBOSE")) llama_log_set(quiet, nullptr);

    llama_backend_init();
    const long base = status_kib("VmRSS:");
    double start = now();
    llama_model_params mparams = llama_model_default_params();
    mparams.n_gpu_layers = 0;
    llama_model * model = llama_model_load_from_file(argv[1], mparams);
    if (!model) { std::fprintf(stderr, "cannot load %s\n", argv[1]); return 1; }
    const double load = now() - start;
    const long loaded = status_kib("VmRSS:");

    llama_context_params cparams = llama_context_default_params();
    cparams.n_ctx = prompt.size() + wanted + 16;
    cparams.n_batch = cparams.n_ubatch = prompt.size();  // the prompt in one call
    cparams.n_threads = cparams.n_threads_batch = threads;
    start = now();
    llama_context * ctx = llama_init_from_model(model, cparams);
    if (!ctx) { std::fprintf(stderr, "cannot make a context\n"); return 1; }
    const double context = now() - start;
    const int vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));

    std::vector<llama_token> out;
    std::vector<double> steps;
    llama_token next = 0;
    double prefill = 0;
    for (int i = 0; i < wanted; ++i) {
        start = now();
        llama_batch batch = i == 0 ? llama_batch_get_one(prompt.data(), prompt.size())
                                   : llama_batch_get_one(&next, 1);
        if (llama_decode(ctx, batch) != 0) { std::fprintf(stderr, "decode failed\n"); return 1; }
        const float * logits = llama_get_logits_ith(ctx, -1);
        int best = 0;  // the first of equal maxima, as numpy's and torch's argmax
        for (int v = 1; v < vocab; ++v) if (logits[v] > logits[best]) best = v;
        const double took = now() - start;
        if (i == 0) prefill = took; else steps.push_back(took);
        next = best;
        out.push_back(best);
    }
    std::printf("{\"load\": %.6f, \"context\": %.6f, \"prefill\": %.6f, \"steps\": [",
                load, context, prefill);
    for (size_t i = 0; i < steps.size(); ++i) std::printf("%s%.6f", i ? ", " : "", steps[i]);
    std::printf("], \"tokens\": [");
    for (size_t i = 0; i < out.size(); ++i) std::printf("%s%d", i ? ", " : "", out[i]);
    std::printf("], \"rss_load\": %ld, \"peak_rss\": %ld}\n", (loaded - base) * 1024,
                status_kib("VmHWM:") * 1024);
    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
"""


def _greedy(tools: Llama, build: Path, say) -> None:
    """Compile GREEDY_CPP against the static libraries of the build (when its text changed)."""
    source = tools.greedy.with_suffix(".cpp")
    if tools.greedy.exists() and source.exists() and source.read_text() == GREEDY_CPP:
        return
    tools.greedy.parent.mkdir(parents=True, exist_ok=True)
    source.write_text(GREEDY_CPP)
    libs = [build / "src" / "libllama.a"] + [build / "ggml" / "src" / f"lib{name}.a"
                                            for name in ("ggml", "ggml-cpu", "ggml-base")]
    _run(["g++", "-O2", "-std=c++17", f"-I{tools.src / 'include'}",
          f"-I{tools.src / 'ggml' / 'include'}", str(source), *map(str, libs), "-fopenmp",
          "-lpthread", "-ldl", "-lm", "-o", str(tools.greedy)], say)


# --- GGUF files -----------------------------------------------------------------------------

# convert_hf_to_gguf.py run as __main__ with one method wrapped (module doc): argv is
# LLAMA_SRC CHECKPOINT --outtype T --no-mtp --outfile F. Where the converter would refuse the
# pre-tokenizer's hash, the wrapper answers "gpt-2".
CONVERT = """
import runpy, sys
src = sys.argv.pop(1)
sys.path[:0] = [src, src + "/gguf-py"]
import conversion.base as base
known = base.TextModel.get_vocab_base_pre
def pre_tokenizer(self, tokenizer):
    try:
        return known(self, tokenizer)
    except NotImplementedError:
        return "gpt-2"
base.TextModel.get_vocab_base_pre = pre_tokenizer
sys.argv[0] = src + "/convert_hf_to_gguf.py"
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def gguf_file(tools: Llama, folder: Path, out: Path, fmt: str, pure: bool, say) -> dict:
    """``out`` in ``fmt`` (f32 / f16 converted; q4_0 quantized from the f32 GGUF beside it)."""
    start = time.perf_counter()
    if fmt in ("f32", "f16"):
        # --no-mtp: Qwen3.5's multi-token-prediction head stays out (gdn-fx has none); the
        # converter refuses the flag for architectures without one (FalconH1): then without
        options = [str(folder), "--outtype", fmt, "--no-mtp", "--outfile", str(out)]
        try:
            _run([sys.executable, "-c", CONVERT, str(tools.src), *options], say,
                 label=f"convert_hf_to_gguf.py (CONVERT's wrapper) {' '.join(options)}")
        except RuntimeError as error:
            if "--mtp / --no-nextn are not supported" not in str(error):
                raise
            options.remove("--no-mtp")
            _run([sys.executable, "-c", CONVERT, str(tools.src), *options], say,
                 label=f"convert_hf_to_gguf.py (CONVERT's wrapper) {' '.join(options)}")
    else:
        f32 = out.with_name(out.name.split(f"-{fmt}")[0] + "-f32.gguf")
        if not f32.exists():
            gguf_file(tools, folder, f32, "f32", pure, say)
            start = time.perf_counter()
        _run([str(tools.quantize), *(["--pure"] if pure else []), str(f32), str(out),
              fmt.upper(), "1"], say)
    return dict(seconds=time.perf_counter() - start, bytes=out.stat().st_size)


# --- what each subprocess runs ------------------------------------------------------------

def add_tokenizer(folder: str) -> dict:
    """The demo's byte-level BPE (trained offline) saved into the checkpoint folder: both
    engines then read their ids from the same files (the vocabulary's other ids exist in the
    model, never in the text)."""
    from gdn_fx.demo_text import demo_tokenizer

    tokenizer = demo_tokenizer(512)
    tokenizer.save_pretrained(folder)
    return dict(ids=tokenizer(PROMPT)["input_ids"], size=len(tokenizer))


def torch_tokens(folder: str, ids: str, new: int, artifact: str = "") -> dict:
    """transformers' greedy tokens after ``ids`` in f32 on the checkpoint's weights (the
    reference), or on the weights ``artifact`` stores (f16-rounded, Q4_0-decoded: what tract
    multiplies with, ``with_stored_weights``) when it is given."""
    import torch
    from transformers import AutoModelForCausalLM, DynamicCache

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    if artifact:
        from gdn_fx.hf.generator import with_stored_weights

        model = with_stored_weights(model, artifact, in_place=True)
    tokens, cache = [], DynamicCache(config=model.config)
    step = torch.tensor([json.loads(ids)])
    with torch.no_grad():
        for _ in range(int(new)):
            logits = model(input_ids=step, cache=cache, use_cache=True, logits_to_keep=1).logits
            tokens.append(int(logits[0, -1].argmax()))
            step = torch.tensor([[tokens[-1]]])
    return dict(tokens=tokens)


def _child(kind: str, *args, pinned: bool = True, threads: int = 1) -> dict:
    """``kind`` in a fresh process; gdn-fx's runs (tract_run) without torch, as deployed."""
    module = {"run_tract": "tract_run", "tract_tokens": "tract_run",
              "write_checkpoint": "bench_checkpoint", "export": "bench_checkpoint"
              }.get(kind, "bench_llama")
    return common.child(kind, *map(str, args), module=module, pinned=pinned, threads=threads,
                        torch=module != "tract_run")


# --- llama.cpp's measurements ---------------------------------------------------------------

def llama_bench(tools: Llama, gguf: Path, reps: int) -> dict:
    """llama-bench at 1 and 2 threads: prefill_T (s for 512 tokens from an empty cache),
    decode_T (s per token at depth 512)."""
    threads = ",".join(map(str, THREADS))
    found = {}
    for test in (["-p", str(PAST), "-n", "0"], ["-p", "0", "-n", "16", "-d", str(PAST)]):
        done = subprocess.run([str(tools.bench), "-m", str(gguf), *test, "-t", threads,
                               "-r", str(reps), "-o", "json"], capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"llama-bench failed: {done.stderr[-2000:]}")
        for row in json.loads(done.stdout):
            seconds = row["avg_ns"] / 1e9
            if row["n_prompt"]:
                found[f"prefill_{row['n_threads']}"] = seconds
            else:
                found[f"decode_{row['n_threads']}"] = seconds / row["n_gen"]
    return found


def greedy(tools: Llama, gguf: Path, ids: list, new: int, threads: int = 1) -> dict:
    done = subprocess.run([str(tools.greedy), str(gguf), str(threads), str(new),
                           ",".join(map(str, ids))], capture_output=True, text=True,
                          env=dict(os.environ, OMP_NUM_THREADS=str(threads)))
    if done.returncode:
        raise RuntimeError(f"greedy failed ({done.returncode}): {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def llama_run(tools: Llama, gguf: Path, reps: int) -> dict:
    """llama-bench's figures, then load and memory of a one-thread process prefilling
    run_tract's 512 ids and decoding 8 tokens."""
    found = llama_bench(tools, gguf, reps)
    ids = [(i % 1000) + 3 for i in range(3, 3 + PAST)]  # run_tract's prompt
    ran = greedy(tools, gguf, ids, 8)
    found.update(load=ran["load"] + ran["context"], rss_load=ran["rss_load"],
                 peak_rss=ran["peak_rss"], prefill_greedy=ran["prefill"],
                 decode_greedy=statistics.median(ran["steps"][1:]))
    return found


def tokenize(tools: Llama, gguf: Path, text: str) -> list:
    done = subprocess.run([str(tools.tokenize), "-m", str(gguf), "-p", text, "--ids",
                           "--no-bos", "--log-disable"], capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"llama-tokenize failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# --- the parent ---------------------------------------------------------------------------

def prepare(args, tools: Llama, workdir: Path, say) -> tuple:
    """The checkpoint folder with its tokenizer, gdn-fx's artifacts and the GGUF files."""
    folder = workdir / f"{args.shape}-ckpt"
    if not (args.reuse and (folder / "tokenizer.json").exists()):
        made = _child("write_checkpoint", args.shape, folder)
        say(f"[{args.shape}] checkpoint: {made['params'] / 1e9:.2f} B parameters")
        _child("add_tokenizer", folder)
    files = {}
    for fmt in args.formats:
        art = workdir / f"{args.shape}-{fmt}.nnef.tgz"
        if not (args.reuse and art.exists()):
            exported = _child("export", folder, art, fmt, pinned=False)
            say(f"[{fmt}] gdn-fx export {exported['seconds']:.0f} s")
        pure = args.pure and fmt == "q4_0"
        theirs = GGUF_FORMAT.get(fmt, fmt)
        gguf = workdir / f"{args.shape}-{theirs}{'-pure' if pure else ''}.gguf"
        if not ((args.reuse or theirs != fmt) and gguf.exists()):
            made = gguf_file(tools, folder, gguf, theirs, pure, say)
            say(f"[{fmt}] GGUF {made['seconds']:.0f} s")
        files[fmt] = (art, gguf)
    return folder, files


def measure(files: dict, tools: Llama, rounds: int, reps: int, say) -> dict:
    """{(engine, fmt): [figures per round]}, the engines alternating (the first rotates)."""
    engines = {
        "gdn-fx": lambda art, gguf: _child("run_tract", art, "", pinned=False),
        "gdn-fx 2 threads": lambda art, gguf: _child("run_tract", art, "", pinned=False,
                                                     threads=2),
        "llama.cpp": lambda art, gguf: llama_run(tools, gguf, reps),
    }
    found = {(e, f): [] for e in engines for f in files}
    names = list(engines)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            for fmt, (art, gguf) in files.items():
                found[(name, fmt)].append(engines[name](art, gguf))
                say(f"[round {r + 1} {name} {fmt}] {found[(name, fmt)][-1]}")
    return found


def token_check(folder: Path, files: dict, tools: Llama) -> list:
    """Rows: per format, leading tokens equal to transformers' (f32) for gdn-fx and llama.cpp,
    and gdn-fx's against transformers on the weights its artifact stores (the check the
    export itself makes: the reference for f16 and Q4_0, whose rounding flips near ties)."""
    ids = _child("add_tokenizer_ids", folder)["ids"]
    first_gguf = next(iter(files.values()))[1]
    llama_ids = tokenize(tools, first_gguf, PROMPT)
    want = _child("torch_tokens", folder, json.dumps(ids), NEW_TOKENS)["tokens"]
    rows = [["prompt ids", f"transformers {ids}", f"llama.cpp {llama_ids}",
             "same" if ids == llama_ids else "DIFFERENT"]]
    for fmt, (art, gguf) in files.items():
        ours = _child("tract_tokens", art, json.dumps(ids), NEW_TOKENS)["tokens"]
        stored = want if fmt == "f32" else _child("torch_tokens", folder, json.dumps(ids),
                                                  NEW_TOKENS, art)["tokens"]
        theirs = greedy(tools, gguf, ids, NEW_TOKENS)["tokens"]
        rows.append([fmt, f"{_agree(ours, want)}; stored weights {_agree(ours, stored)}",
                     _agree(theirs, want),
                     f"llama.cpp: {theirs[:12]}..." if theirs != want else "-"])
    f32 = first_gguf.with_name(first_gguf.name.split("-")[0] + "-f32.gguf")
    if "f32" not in files and f32.exists():  # q4_0's source, made anyway: the f32 check
        theirs = greedy(tools, f32, ids, NEW_TOKENS)["tokens"]
        rows.append(["f32 (GGUF only)", "-", _agree(theirs, want), "-"])
    rows.append(["transformers f32", f"{want[:12]}...", "", ""])
    return rows


def add_tokenizer_ids(folder: str) -> dict:
    """transformers' ids of PROMPT with the folder's tokenizer."""
    from transformers import AutoTokenizer

    return dict(ids=AutoTokenizer.from_pretrained(folder)(PROMPT)["input_ids"])


def _agree(got: list, want: list) -> str:
    same = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got),
                                                                              len(want)))
    return f"{same}/{len(want)}" + ("" if same == len(want) else f" (then {got[same]} for "
                                                                   f"{want[same]})")


def _med(runs: list, key: str) -> float:
    return statistics.median(r[key] for r in runs)


def _paired(ours: list, theirs: list, key: str, their_key: str = "") -> float:
    return statistics.median(a[key] / b[their_key or key] for a, b in zip(ours, theirs))


def _two(ours: list, theirs: list, key: str, their_key: str, unit: float, spec: str) -> str:
    """The 2-thread cell: gdn-fx / llama.cpp (ratio)."""
    return (f"{_med(ours, key) * unit:{spec}} / {_med(theirs, their_key) * unit:{spec}} "
            f"({common.ratio(_paired(ours, theirs, key, their_key))})")


def table(found: dict, files: dict) -> str:
    gib = 2 ** 30
    rows = []
    for fmt, (art, gguf) in files.items():
        ours, theirs = found[("gdn-fx", fmt)], found[("llama.cpp", fmt)]
        both = found[("gdn-fx 2 threads", fmt)]
        rows.append([
            fmt,
            f"{_med(ours, 'prefill'):.2f} / {_med(theirs, 'prefill_1'):.2f} "
            f"({common.ratio(_paired(ours, theirs, 'prefill', 'prefill_1'))})",
            _two(both, theirs, "prefill", "prefill_2", 1, ".2f"),
            f"{_med(ours, 'decode') * 1e3:.1f} / {_med(theirs, 'decode_1') * 1e3:.1f} "
            f"({common.ratio(_paired(ours, theirs, 'decode', 'decode_1'))})",
            _two(both, theirs, "decode", "decode_2", 1e3, ".1f"),
            f"{_med(ours, 'peak_rss') / gib:.2f} / {_med(theirs, 'peak_rss') / gib:.2f}",
            f"{_med(ours, 'rss_load') / gib:.2f} / {_med(theirs, 'rss_load') / gib:.2f}",
            f"{common.human_bytes(art.stat().st_size)} / "
            f"{common.human_bytes(gguf.stat().st_size)}",
            f"{_med(ours, 'load'):.2f} / {_med(theirs, 'load'):.2f}",
            f"{_med(theirs, 'prefill_greedy'):.2f} / {_med(theirs, 'decode_greedy') * 1e3:.1f}",
        ])
    return common.markdown(
        ["format", f"prefill {PAST} s: gdn-fx / llama.cpp, 1 thread (ratio)",
         "2 threads: gdn-fx / llama.cpp (ratio)",
         f"decode ms/token at P={PAST}: gdn-fx / llama.cpp, 1 thread (ratio)",
         "2 threads: gdn-fx / llama.cpp (ratio)", "peak RSS GiB gdn-fx / llama.cpp",
         "RSS the load adds GiB", "file bytes gdn-fx / llama.cpp", "load s gdn-fx / llama.cpp",
         "llama.cpp greedy program: prefill s / decode ms (1 thread)"], rows)


def main(argv=None) -> None:
    parser = common.parser(__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=list(SHAPES), default="0.8b")
    parser.add_argument("--formats", nargs="+", choices=FORMATS, default=list(FORMATS))
    parser.add_argument("--reuse", action="store_true",
                        help="keep the checkpoint, artifacts and GGUF files WORKDIR holds")
    parser.add_argument("--llama-dir", type=Path, default=Path("~/.cache/gdn_fx_llama"),
                        help="where llama.cpp is downloaded and built (kept; reused)")
    parser.add_argument("--pure", action="store_true",
                        help="llama-quantize --pure: every matmul weight Q4_0, the tied "
                        "embedding / head table included")
    parser.add_argument("--reps", type=int, default=3, help="llama-bench -r (repetitions)")
    parser.add_argument("--no-tokens", action="store_true", help="skip the token check")
    args = parser.parse_args(argv)
    if args.quick:
        args.shape = "quick"
    rounds = common.rounds_for(args, full=2, quick=2)

    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    tools = build_llama(args.llama_dir, say)
    workdir = common.workdir(args, "llama")
    folder, files = prepare(args, tools, workdir, say)
    found = measure(files, tools, rounds, args.reps, say)
    checked = None if args.no_tokens else token_check(folder, files, tools)
    common.emit(common.header(
        "llama.cpp beside gdn-fx on one checkpoint folder",
        f"shape {args.shape} (bench_checkpoint's, bf16 checkpoint, random weights, demo BPE "
        f"tokenizer), llama.cpp of llama-cpp-python {LLAMA_CPP_PYTHON}'s sdist"
        f"{' (Q4_0 --pure)' if args.pure else ''}; gdn-fx: tract_run.run_tract (no torch), one "
        f"thread, prefill in the Generator's chunks; llama.cpp: llama-bench -r {args.reps} "
        f"(pp{PAST}; tg16 at depth {PAST}), load / RSS of the greedy program ({PAST} ids + 8 "
        f"tokens, 1 thread); {rounds} round(s), medians, ratio = gdn-fx / llama.cpp"))
    common.emit(table(found, files))
    busy = os.getloadavg()[0]
    common.emit(f"\nllama.cpp 2 threads: every core of this machine ({os.cpu_count()}); under a "
                f"load average of {busy:.1f} its threads wait on each other's time slices "
                "(then slower than 1 thread: read it on an idle machine only).")
    if checked:
        common.emit(f"\nGreedy tokens after the prompt {PROMPT!r}: leading tokens equal to "
                    f"transformers' ({NEW_TOKENS}, f32 eager on the stored weights)\n")
        common.emit(common.markdown(["format", "gdn-fx (tract)", "llama.cpp", "note"],
                                    checked))


if __name__ == "__main__":
    main()
