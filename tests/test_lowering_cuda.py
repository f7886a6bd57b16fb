"""The lowering table under tract's CUDA runtime: which candidate each node gets, what is
demoted (runs on the CPU there) and why, and what an export records. Pure table checks plus
exports run by the CPU tract: no GPU needed (tests/test_cuda_runtime.py runs on the GPU).

Expected candidates are written by hand from the measurements on an H200
(bench/bench_cuda.py, bench/RESULTS.md): the native operator's CUDA kernel takes f16
q/k/v/beta with an f32 state, width 128, batch 1 (other dtypes and batches run on the CPU;
f16 of another width fails at run time); "chunked_parallel" is chosen from static S = 256;
every tract_core_scan runs on the CPU. The oracle of numerics is the float64 recurrence.
"""

from __future__ import annotations

import logging

import pytest
import torch

from gdn_fx import tract_check
from gdn_fx.cli import main
from gdn_fx.errors import RuntimeUnavailable, UsageError
from gdn_fx.export import export_nnef
from gdn_fx.lowering import Target, decide
from gdn_fx.lowering.choice import Choice
from gdn_fx.lowering.node_facts import ScanFacts
from gdn_fx.lowering.target import as_target
from lowering_programs import SCAN_NAMES, scan_inputs
from test_lowering_fast import Fused, check_run

F16 = dict(q="f16", k="f16", v="f16", g="f32", beta="f16", initial_state="f32")
F32 = dict.fromkeys(F16, "f32")
F16_STATE = dict(F16, initial_state="f16")
CPU_LOOP = "runs on the CPU under tract's cuda runtime"


def facts(s=1, b=1, dk=128, dtypes=F16, kda=False) -> ScanFacts:
    shapes = dict(q=(b, s, 16, dk), k=(b, s, 16, dk), v=(b, s, 16, dk),
                  g=(b, s, 16, dk) if kda else (b, s, 16), beta=(b, s, 16),
                  initial_state=(b, 16, dk, dk))
    return ScanFacts("n", shapes, dict(dtypes), dk ** -0.5, True)


def cuda(dynamic=False) -> Target:
    return Target.parse("0.23.9", dynamic, runtime="cuda")


# (facts, dynamic, expected candidate, demoted: the decision says it runs on the CPU)
CUDA_TABLE = [
    (facts(s=1), False, "native", False),           # decode: the CUDA kernel
    (facts(s=64), False, "native", False),          # short prefill: the kernel still wins
    (facts(s=255), False, "native", False),
    (facts(s=256), False, "chunked_parallel", False),
    (facts(s=4096), False, "chunked_parallel", False),
    (facts(s=None), True, "native", False),         # symbolic S: only the kernel stays
    (facts(s=1, dtypes=F32), False, "matmul_step", False),  # f32: no kernel
    (facts(s=512, dtypes=F32), False, "chunked_parallel", False),
    (facts(s=None, dtypes=F32), True, "chunked", True),     # every other loop is a scan
    (facts(s=None, dtypes=F16_STATE), True, "chunked", True),
    (facts(s=None, b=2), True, "chunked", True),    # batch 2: the CPU operator
    (facts(s=1, dk=64), False, "matmul_step", False),  # width 64: the kernel would fail
    (facts(s=None, dk=64), True, "chunked", True),
    (facts(s=512, kda=True), False, "matmul", True),   # KDA: only matmul and scan serve it
]


@pytest.mark.parametrize("node, dynamic, expected, demoted", CUDA_TABLE)
def test_cuda_table(node, dynamic, expected, demoted):
    decision = decide(node, cuda(dynamic))
    print(decision)
    assert decision.candidate == expected
    assert (CPU_LOOP in decision.note) == demoted
    assert all(name != expected for name, _ in decision.rejected)


def prefill_graph(runtime="cuda", dynamic=True) -> Target:
    """A main / decode pair's main graph: it never runs decode's one-token calls."""
    return Target.parse("0.23.9", dynamic, runtime=runtime, serves_decode=False)


@pytest.mark.parametrize("node, target, expected", [
    (facts(s=None), prefill_graph(), "chunked_window"),       # the pair's main graph
    (facts(s=None, dtypes=F32), prefill_graph(), "chunked_window"),  # no CUDA kernel needed
    (facts(s=None), cuda(True), "native"),                    # one graph serving decode too
    (facts(s=512), prefill_graph(dynamic=False), "chunked_parallel"),  # static S: its chunks
    (facts(s=None), prefill_graph("cpu"), "split"),           # the CPU keeps its order
    (facts(s=None, kda=True), prefill_graph(), "matmul"),     # KDA: the chunked form refuses
])
def test_window_serves_a_pair_main_graph_under_cuda(node, target, expected):
    decision = decide(node, target)
    print(decision)
    assert decision.candidate == expected


def test_window_refuses_what_it_can_not_compute():
    from gdn_fx.lowering import gdn_chunked_parallel as cp

    assert "static batch" in cp.check_window(facts(s=None, b=None), prefill_graph())
    assert "exceeds the window of 512" in cp.check_window(facts(s=513), prefill_graph())
    assert cp.check_window(facts(s=512), prefill_graph()) is None
    reason = dict(decide(facts(s=None), cuda(True)).rejected)["chunked_window"]
    assert "serves decode" in reason


def test_demoted_native_gives_its_reason_and_cpu_order_breaks_ties():
    decision = decide(facts(s=None, dtypes=F32), cuda(True))
    rejected = dict(decision.rejected)
    assert rejected["native"].startswith(f"demoted: {CPU_LOOP}: the CUDA kernel takes")
    assert rejected["matmul"].startswith(f"demoted: {CPU_LOOP}: its tract_core_scan")
    # chunked (400 ms at S = 4096 on the CPU) is taken before native (2.6 s) and matmul
    assert decision.candidate == "chunked" and "tract_core_scan" in decision.note


def test_native_of_width_64_is_refused_not_demoted_under_cuda():
    reason = dict(decide(facts(s=None, dk=64), cuda(True)).rejected)["native"]
    assert "fails for width 64" in reason and not reason.startswith("demoted")
    assert decide(facts(s=None, dk=64), Target.parse("0.23.9", True)).candidate == "split"


def test_forced_scan_candidate_under_cuda_is_taken_with_its_note():
    decision = decide(facts(s=512), cuda(), Choice.parse({"*": "chunked"}))
    assert decision.candidate == "chunked" and decision.forced
    assert CPU_LOOP in decision.note and CPU_LOOP in str(decision)


def test_demoted_decision_is_logged_as_a_warning(caplog):
    with caplog.at_level(logging.INFO, logger="gdn_fx.lowering"):
        decide(facts(s=None, dtypes=F32), cuda(True))
        decide(facts(s=1), cuda())
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and CPU_LOOP in warnings[0].getMessage()


@pytest.mark.parametrize("s, dynamic", [(None, True), (1, False), (512, False)])
def test_conv_update_takes_tracts_conv_under_cuda_at_every_length(s, dynamic):
    # measured on the whole 0.8B-shaped generator (H100, bench/bench_cuda_generate.py):
    # decode 11.3 ms with "depthwise" against 12.9 with "portable" (one launch against the
    # multiply-adds tract cuts in three); the CPU keeps "portable" for S = 1 and symbolic S
    from test_lowering_table import conv

    assert decide(conv(c=64, s=s), cuda(dynamic)).candidate == "depthwise"
    cpu = Target.parse("0.23.9", dynamic)
    assert decide(conv(c=64, s=s), cpu).candidate == ("depthwise" if s == 512 else "portable")


@pytest.mark.parametrize("s, expected", [(1, "matmul_step"), (512, "chunked_unrolled"),
                                         (4096, "chunked")])
def test_cpu_runtime_keeps_its_order(s, expected):
    decision = decide(facts(s=s), Target.parse("0.23.9"))
    assert decision.candidate == expected and not decision.note
    assert Target.parse("0.23.9").runtime == "cpu"


def test_unknown_runtime_is_refused():
    with pytest.raises(UsageError, match="'tpu' is not one of cpu, cuda"):
        Target.parse("0.23.9", runtime="tpu")


def test_torch_to_nnef_target_carries_the_runtime():
    from gdn_fx.lowering.t2n.offline_target import offline_tract_target

    t2n = offline_tract_target("0.23.9")
    assert as_target(t2n).runtime == "cpu"
    t2n.gdn_fx_runtime = "cuda"
    assert as_target(t2n).runtime == "cuda"


# --- exports for the CUDA runtime, run by the CPU tract -------------------------------------

@pytest.mark.parametrize("s, groups, dtype", [(1, 1, torch.float32), (2, 1, torch.float32),
                                              (65, 1, torch.float32), (300, 2, torch.float32),
                                              (2100, 1, torch.float32), (200, 1, torch.float16)])
def test_chunked_parallel_matches_float64(tmp_path, s, groups, dtype):
    """Forced at S = 1 (the table gives S = 1 to one step), chosen by the table otherwise;
    S = 2100 takes the long chunks (128)."""
    module = Fused(16 ** -0.5)
    args = scan_inputs(s=s, hk=2, groups=groups, dk=16, dv=16, dtype=dtype)
    path = export_nnef(torch.export.export(module, args), tmp_path / "cp.nnef", runtime="cuda",
                       input_names=SCAN_NAMES, choose={"*": "chunked_parallel"} if s == 1
                       else None)
    assert tract_check.read_decisions(path) == {"gated_delta_scan": "chunked_parallel"}
    assert tract_check.read_runtime(path) == "cuda" and not tract_check.read_cpu_fallbacks(path)
    check_run(path, module, args, 1e-4 if dtype == torch.float32 else 2e-3)


@pytest.mark.parametrize("s, groups", [(300, 2), (2100, 1)])
def test_chunked_parallel_whole_matrix_inverse_matches_float64(tmp_path, monkeypatch, s,
                                                                groups):
    """The whole-matrix inverse (the window's) serves a static S too when asked
    (``STATIC_WHOLE``; block stacks by default, measured within noise)."""
    from gdn_fx.lowering import gdn_chunked_parallel as cp

    monkeypatch.setattr(cp, "STATIC_WHOLE", True)
    module = Fused(16 ** -0.5)
    args = scan_inputs(s=s, hk=2, groups=groups, dk=16, dv=16)
    path = export_nnef(torch.export.export(module, args), tmp_path / "cp.nnef", runtime="cuda",
                       input_names=SCAN_NAMES)
    assert "lowerleft64" in tract_check.nnef_text(path)
    check_run(path, module, args, 1e-4)


def test_window_inverts_whole_matrices_and_static_s_block_stacks():
    """Measured on an H100 (bench/RESULTS.md, 2026-12-06 08:20): the window's call is bound by
    launches and takes the whole-matrix inverse (129 GPU ops a layer against 149); a static
    S keeps the block stacks (within noise at S = 512 and 4096)."""
    from gdn_fx.lowering import gdn_chunked_parallel as cp

    assert cp.WINDOW_WHOLE and not cp.STATIC_WHOLE
    whole = cp.definitions(facts(s=512), 128, 4, "_w", whole=True)
    blocks = cp.definitions(facts(s=512), 128, 4, "_b")
    assert "lowerleft128" in whole and "kb16" not in whole
    assert "kb16" in blocks and "lowerleft" not in blocks
    # q and k normalized before the padding in both: no key norm folded into the chunk terms
    assert all("rkr" not in text and "kn = mul(k, rsqrt(" in text for text in (whole, blocks))


@pytest.mark.parametrize("groups, dtype, b, dv", [(1, torch.float32, 1, 16),
                                                  (2, torch.float32, 1, 16),
                                                  (1, torch.float16, 1, 16),
                                                  (1, torch.float32, 2, 16),  # batch 2
                                                  (3, torch.float32, 1, 32)])  # Dv != Dk
def test_window_matches_float64_at_every_length_and_refuses_more(tmp_path, groups, dtype, b,
                                                                 dv):
    """ONE graph, symbolic S (traced at S = 4): the tokens padded to the 512-token window,
    right at S = 1 .. 512 (the padded tokens leave the state as it is); past the window tract
    fails the call with its reason (the pad's length is negative), nothing computed wrong;
    the NNEF says how many tokens a call may take."""
    import tract

    module = Fused(16 ** -0.5)
    shape = dict(b=b, hk=2, groups=groups, dk=16, dv=dv, dtype=dtype)
    axes = {name: {1: "S"} for name in SCAN_NAMES[:5]}
    path = export_nnef(torch.export.export(module, scan_inputs(s=4, **shape)),
                       tmp_path / "w.nnef", runtime="cuda", input_names=SCAN_NAMES,
                       dynamic_axes=axes, serves_decode=False)
    assert tract_check.read_decisions(path) == {"gated_delta_scan": "chunked_window"}
    assert '("gdn_fx_max_tokens", "512")' in tract_check.nnef_text(path)
    runnable = tract_check.load(path)
    for s in (1, 2, 63, 64, 65, 300, 511, 512):
        check_run(runnable, module, scan_inputs(s=s, seed=s, **shape),
                  1e-4 if dtype == torch.float32 else 2e-3)
    with pytest.raises(tract.TractError, match="too large"):
        tract_check.run(runnable, scan_inputs(s=513, **shape))


@pytest.mark.parametrize("s", [300, 2100])
def test_chunked_parallel_stays_batched(tmp_path, s):
    """tract splits an op read only through slices into one op per piece: the batched chunk
    terms and block inverse must reach the runnable as batched ops, or the GPU launches one
    kernel per block and chunk (the text before measured 497 kernels at S = 4096)."""
    import json

    import numpy as np

    module = Fused(16 ** -0.5)
    args = scan_inputs(s=s, hk=2, dk=16, dv=16)
    path = export_nnef(torch.export.export(module, args), tmp_path / "cp.nnef", runtime="cuda",
                       input_names=SCAN_NAMES)
    runnable = tract_check.load(path, "cpu")
    arrays = [a.detach().numpy() for a in args]
    nodes = json.loads(runnable.profile_json(arrays))["nodes"]
    split = [n["node_name"] for n in nodes if ".split-" in n.get("node_name", "")]
    # the one expected: the output trimmed back from whole chunks to S ("o4", the last op)
    assert len(split) <= 1 and all("_o4." in name for name in split), split[:5]
    assert np.isfinite(runnable.run(arrays)[0].to_numpy()).all()


@pytest.mark.parametrize("s", [2, 300, 4096])
def test_chunked_parallel_matmuls_take_operands_contracted_last(s):
    """tract's CUDA GEMM copies a right operand that is not [.., N, K] (a full-size
    GpuMoveAxis per matmul, measured on an H200): every matmul of the text is transposeB
    but the prologue's cumulative sums (a constant right operand) and the block inverse's
    own products (the leaf's product form, T A T per doubling), and A's blocks come from the
    keys' own block stacks (no [C, C] mask below the last level)."""
    import re

    from gdn_fx.lowering import gdn_chunked_parallel as cp

    chunk = cp.chunk_for(s)
    text = cp.definitions(facts(s=s), chunk, -(-s // chunk), "_t")
    lines = [line.strip() for line in text.splitlines() if "matmul(" in line]
    plain = {line.split(" = ")[0]: line.count("matmul(") for line in lines
             if line.count("matmul(") != line.count("transposeB = true")}
    sizes = cp.widths(chunk)
    leaf = 2 * (sizes[0].bit_length() - 2)  # log2(leaf) - 1 squarings and products
    assert [plain.pop(n) for n in ("wr", "fr", "rr")] == [1, 1, 1]  # sums of the gate parts
    assert sorted(plain) == sorted([f"bip{i + 2}" for i in range(leaf // 2)]
                                   + [f"bit{i + 1}" for i in range(leaf // 2)]
                                   + [f"tb{b}" for b in sizes[1:]]), plain
    assert all(plain[f"tb{b}"] == 2 for b in sizes[1:])
    for b in sizes:
        assert f"ab{b} = mul(matmul(ksb{b}, kb{b}, transposeB = true)" in text
        assert f"kb{b} = reshape(kk, shape = [-1, 1, {chunk // b}, {b}," in text


def test_export_records_cpu_fallback_and_runtime(tmp_path):
    module = Fused(16 ** -0.5)
    args = scan_inputs(s=4, hk=2, dk=16, dv=16)
    axes = {name: {1: "S"} for name in SCAN_NAMES[:5]}
    path = export_nnef(torch.export.export(module, args), tmp_path / "f.nnef", runtime="cuda",
                       input_names=SCAN_NAMES, dynamic_axes=axes)
    assert tract_check.read_decisions(path) == {"gated_delta_scan": "chunked"}
    assert tract_check.read_cpu_fallbacks(path) == ["gated_delta_scan"]
    plain = export_nnef(torch.export.export(module, args), tmp_path / "p.nnef",
                        input_names=SCAN_NAMES, dynamic_axes=axes)
    assert tract_check.read_runtime(plain) == "cpu" and not tract_check.read_cpu_fallbacks(plain)


def test_loading_for_a_missing_runtime_says_why(tmp_path):
    missing = tract_check.runtime_unavailable("cuda")
    if missing is None:
        pytest.skip("this machine has tract's CUDA runtime")
    module = Fused(16 ** -0.5)
    args = scan_inputs(s=1, hk=2, dk=16, dv=16)
    path = export_nnef(torch.export.export(module, args), tmp_path / "m.nnef", runtime="cuda",
                       input_names=SCAN_NAMES)
    with pytest.raises(RuntimeUnavailable, match="tract has no cuda runtime here"):
        tract_check.load(path, "cuda")
    assert tract_check.runtime_unavailable("cpu") is None
