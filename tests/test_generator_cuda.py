"""The generation-ready artifact lowered for tract's CUDA runtime (issue 35).

Written and checked on any machine: ``export_generator(..., runtime="cuda")`` records the
runtime and its CPU fallbacks, and the same file computes on the CPU runtime what
transformers generates. Run on the GPU (skipped, with tract's reason, where tract has no CUDA
runtime): ``Generator(..., runtime="cuda")`` generates transformers' tokens, with the
attention caches passed in and out or kept in tract's State (``kv_in_state``).
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from gdn_fx import tract_check
from gdn_fx.errors import RuntimeUnavailable, UsageError
from gdn_fx.hf import tiny_model
from gdn_fx.hf.configs import SAFE_TOKEN_RANGE
from gdn_fx.hf.generator import Generator, check_generation, export_generator

pytestmark = pytest.mark.slow  # module fixtures export whole models (make test-fast skips them)

MISSING = tract_check.runtime_unavailable("cuda")
on_gpu = pytest.mark.skipif(MISSING is not None, reason=MISSING or "")


def _prompt(length: int = 21, seed: int = 3) -> list:
    low, high = SAFE_TOKEN_RANGE
    return torch.randint(low, high, (length,), generator=torch.Generator().manual_seed(seed)
                         ).tolist()


@pytest.fixture(scope="module")
def cuda_export(tmp_path_factory):
    """The tiny qwen3_5 (f32), exported for CUDA: (model, files)."""
    model = tiny_model("qwen3_5")
    files = export_generator(model, tmp_path_factory.mktemp("cuda") / "q.nnef.tgz",
                             runtime="cuda")
    return model, files


def test_cuda_export_records_its_runtime(cuda_export):
    """The artifact says it is for CUDA; its GDN scans of width 16 (no CUDA kernel takes
    them with a symbolic S) are recorded as CPU fallbacks, none lowered to the native op
    (its CUDA kernel fails at width 16)."""
    _, files = cuda_export
    assert tract_check.read_runtime(files.main) == "cuda"
    decisions = tract_check.read_decisions(files.main)
    scans = {n: c for n, c in decisions.items() if n.startswith("gated_delta_scan")}
    assert len(scans) == 3 and "native" not in scans.values()
    assert sorted(tract_check.read_cpu_fallbacks(files.main)) == sorted(scans)


def test_cuda_export_generates_on_the_cpu_runtime(cuda_export):
    """The same file on the CPU runtime: every token and logit as transformers'."""
    model, files = cuda_export
    result = Generator(files.main).generate(_prompt(), 12)
    found = check_generation(model, result)
    assert found.ok, str(found)


def test_default_export_stays_cpu(shared_export):
    _, files = shared_export("qwen3_5")
    assert tract_check.read_runtime(files.main) == "cpu"
    assert tract_check.read_cpu_fallbacks(files.main) == []


def test_batched_export_refuses_cuda(tmp_path):
    with pytest.raises(UsageError, match="batched export .* CPU runtime only"):
        export_generator(tiny_model("qwen3_5"), tmp_path / "b.nnef.tgz", batch=2,
                         runtime="cuda")


def test_unknown_runtime_is_refused(tmp_path):
    with pytest.raises(UsageError, match="runtime 'tpu' is not one of cpu, cuda"):
        export_generator(tiny_model("qwen3_5"), tmp_path / "t.nnef.tgz", runtime="tpu")


@pytest.mark.skipif(MISSING is None, reason="this machine has tract's CUDA runtime")
def test_generator_without_cuda_says_why(cuda_export):
    with pytest.raises(RuntimeUnavailable, match="tract has no cuda runtime here"):
        Generator(cuda_export[1].main, runtime="cuda")


def test_attention_caches_kept_in_the_state(cuda_export):
    """kv_in_state: tract's detect_kv_cache folds the attention layer's key and value caches
    into the State; prompt chunks continue that State, a new generation starts a fresh one
    (the same tokens twice on one Generator)."""
    model, files = cuda_export
    gen = Generator(files.main, prefill_chunk=8, kv_in_state=True)
    names = [name for name, _, _ in gen.main_graph.inputs]
    assert gen.kv_in_state and not any(n.startswith(("key_", "value_")) for n in names)
    assert len(gen.zero_states) == len(names) - 1
    for _ in range(2):
        found = check_generation(model, gen.generate(_prompt(), 12))
        assert found.ok, str(found)


@pytest.fixture(scope="module")
def cuda_pair(tmp_path_factory):
    """The tiny qwen3_5 (f32) as a main / decode pair for CUDA: (model, files)."""
    model = tiny_model("qwen3_5")
    files = export_generator(model, tmp_path_factory.mktemp("pair") / "q.nnef.tgz",
                             runtime="cuda", decode=True)
    return model, files


def test_pair_main_graph_takes_the_window_and_says_its_bound(cuda_pair):
    """The pair's main graph never runs decode: its scans are "chunked_window" (no CPU
    fallback left, where the one graph's symbolic scans of width 16 had one each); the
    decode graph keeps one step a token. The main graph declares 512 tokens a call."""
    _, files = cuda_pair
    scans = {graph: {n: c for n, c in tract_check.read_decisions(graph).items()
                     if n.startswith("gated_delta_scan")} for graph in (files.main, files.decode)}
    assert set(scans[files.main].values()) == {"chunked_window"}
    assert set(scans[files.decode].values()) == {"matmul_step"}
    assert not tract_check.read_cpu_fallbacks(files.main)
    assert tract_check.read_max_tokens(files.main) == 512
    assert tract_check.read_max_tokens(files.decode) is None
    assert "extension tract_assert S <= 512;" in tract_check.nnef_text(files.main)
    from gdn_fx.pipeline import _lengths

    assert _lengths(files.main) == "1 <= S <= 512 a call"  # what the CLI prints
    gen = Generator.open(files.main)
    assert gen.main_graph.max_tokens == 512 and gen.prefill_chunk == 512
    assert Generator.open(files.main, prefill_chunk=None).prefill_chunk == 512


def test_pair_generates_past_the_window_in_calls_it_takes(cuda_pair):
    """A prompt of 700 tokens (two calls: 512 and 188) on the CPU runtime: every token and
    logit as transformers'; one call of 513 tokens is refused before tract runs."""
    model, files = cuda_pair
    gen = Generator.open(files.main)
    found = check_generation(model, gen.generate(_prompt(700), 8))
    assert found.ok, str(found)
    ids = np.array([_prompt(513)], dtype=np.int64)
    with pytest.raises(UsageError, match=r"S = 513 is outside what .* declares \(S <= 512\)"):
        gen.step(gen.main, ids, [z.copy() for z in gen.zero_states])


def test_kv_in_state_refuses_a_pair(cuda_export):
    with pytest.raises(UsageError, match="kv_in_state .* one graph"):
        Generator(cuda_export[1].main, cuda_export[1].main, kv_in_state=True)


@pytest.mark.parametrize("flag", ["--generalize", "--stream"])
def test_cli_refuses_cuda_for_cpu_only_routes(tmp_path, flag):
    done = subprocess.run([sys.executable, "-m", "gdn_fx.cli", "export", "--family", "qwen3_5",
                           "--out", str(tmp_path / "x.nnef.tgz"), "--runtime", "cuda", flag],
                          capture_output=True, text=True)
    assert done.returncode == 2
    assert f"--runtime cuda: {flag} lowers for the CPU runtime only" in done.stderr


@on_gpu
@pytest.mark.parametrize("kv_in_state", [False, True])
@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next", "bamba"])
def test_cuda_generator_generates_what_transformers_generates(tmp_path, family, kv_in_state):
    """f16 on the GPU: 32 tokens, every one transformers' (logits within the f16 bound).
    bamba (Mamba2 hybrid): its scans "chunked", run on the CPU under CUDA (H100,
    2026-12-08: 32/32 tokens, logits 7.3e-3). jamba (Mamba1) is left out: every token
    equal on the GPU too, but its f16 logits miss the 1e-2 bound (2.4e-2), as they do on the
    CPU runtime (2.1e-2) and as transformers' f16 does against its own f32 (2.35e-2)."""
    model = tiny_model(family, dtype=torch.float16)
    files = export_generator(model, tmp_path / "g.nnef.tgz", runtime="cuda")
    generator = Generator(files.main, runtime="cuda", kv_in_state=kv_in_state)
    result = generator.generate(_prompt(37, 1), 32)
    found = check_generation(model, result)
    assert found.ok, str(found)


@on_gpu
@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_cuda_pair_generates_what_transformers_generates(tmp_path, family):
    """The main / decode pair (the window's prefill) in f16 on the GPU, likewise."""
    model = tiny_model(family, dtype=torch.float16)
    files = export_generator(model, tmp_path / "g.nnef.tgz", runtime="cuda", decode=True)
    generator = Generator.open(files.main, runtime="cuda")
    result = generator.generate(_prompt(37, 1), 32)
    found = check_generation(model, result)
    assert found.ok, str(found)
