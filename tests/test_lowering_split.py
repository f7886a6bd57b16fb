"""Candidate "split" of gated_delta_scan (lowering/gdn_split.py): the loop over chunks for
every token but a lone last one (padded to whole chunks), then one matmul step, in ONE graph
of symbolic S (issue 31).

The oracle is gdn_fx.reference.recurrent_delta_rule_reference in float64 (test_lowering_fast's
``oracle``). Lengths around the chunk loop's step W = 64 tokens: S = 1 runs zero chunk
iterations and one step on the token, S = 2 .. W one padded iteration and one identity step,
S = W + 1 one iteration and one step on the last token; tract 0.23.9 returns a scalar for the
state of a scan of zero iterations, so the chunk loop's state is guarded (the control test
shows the guard is needed).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from gdn_fx import tract_check
from gdn_fx.errors import LoweringUnsupported
from gdn_fx.export import export_nnef
from gdn_fx.lowering import Target, decide, plan_lowering
from gdn_fx.lowering.choice import Choice
from gdn_fx.lowering.gdn_split import WHOLE
from lowering_programs import SCAN_NAMES, scan_inputs
from test_lowering_fast import SEQ_AXES, SMALL, Fused, check_run, facts, oracle

C = WHOLE
LENGTHS = (1, 2, C - 1, C, C + 1, 2 * C + 1, 2 * C + 3)
F16 = torch.float16


def _split(module, args, path, axes=SEQ_AXES):
    written = export_nnef(torch.export.export(module, args), path, choose={"*": "split"},
                          dynamic_axes=axes)
    assert tract_check.read_decisions(written) == {"gated_delta_scan": "split"}
    return written


def test_chunks_are_64_tokens():
    assert C == 64  # the lengths below straddle it


def test_split_equals_the_reference_at_every_length(tmp_path):
    """One graph (symbolic S, traced at 4), GDN gate, f32: right at S = 1, 2, C-1, C, C+1,
    2C+1, 2C+3 (zero chunk iterations; padded iterations and an identity step; iterations
    and a step on the last token)."""
    module = Fused(16 ** -0.5)
    written = _split(module, scan_inputs(s=4, **SMALL), tmp_path / "split.nnef")
    text = tract_check.nnef_text(written)
    assert "tract_symbol S" in text and text.count("reset_every_turn = 1") == 1
    runnable = tract_check.load(written)
    for s in LENGTHS:
        print(s, check_run(runnable, module, scan_inputs(s=s, seed=s, **SMALL), 1e-4))


def test_zero_iterations_need_the_guard(tmp_path):
    """Control: with the chunk loop's own last state in place of the guard (its state after
    every iteration, s0 in front, the one after the last sliced out), S = 1 (zero chunk
    iterations) is not computed in tract 0.23.9, whose scan of zero iterations gives a
    scalar for its state (tract aborts the process: the run is a child's); S = C + 1 (one
    iteration) is still right."""
    module = Fused(0.25)
    written = _split(module, scan_inputs(s=4, **SMALL), tmp_path / "bare.nnef")
    graph = written / "graph.nnef"
    text = graph.read_text()
    guard = ['output = [("states", "full", 0, 1),', "s1 = slice(sall, axes = [0], begin = [c],"
             " end = [c1]);", "sall = concat([s0, reshape(sts, shape = [-1], axis_start = 0,"
             " axis_count = 2)], axis = 0);"]
    assert all(line in text for line in guard)
    args = scan_inputs(s=1, seed=5, **SMALL)
    torch.save({"args": args, "want": oracle(module, args)}, tmp_path / "case.pt")
    guarded = _one_token(written, tmp_path / "case.pt")
    assert guarded.returncode == 0 and "right" in guarded.stdout, guarded.stderr[-2000:]
    bare = text.replace(guard[0], 'output = [("final", "last", 0, 1),')
    graph.write_text(bare.replace(guard[1], "s1 = copy(sts);").replace(guard[2], ""))
    print(check_run(tract_check.load(written), module, scan_inputs(s=C + 1, seed=3, **SMALL),
                    1e-4))
    unguarded = _one_token(written, tmp_path / "case.pt")
    assert unguarded.returncode != 0 and "right" not in unguarded.stdout  # an error or abort


def _one_token(written, case):
    """The graph at S = 1 against the oracle, in a child process."""
    return subprocess.run([sys.executable, "-c", _ONE_TOKEN, str(written), str(case)],
                          capture_output=True, text=True, timeout=300)


# The child: the graph at S = 1 against the oracle; prints "right" only where it computes it.
_ONE_TOKEN = """
import sys, torch
from gdn_fx import tract_check
case = torch.load(sys.argv[2])
got = tract_check.run(tract_check.load(sys.argv[1]), case["args"])
errors = [tract_check.relative_error(g, w) for g, w in zip(got, case["want"])]
print("right" if max(errors) <= 1e-4 else f"wrong {errors}")
sys.exit(0 if max(errors) <= 1e-4 else 1)
"""


FEATURES = {  # name: (scan_inputs kwargs, scale, tolerance)
    "gqa_dk_ne_dv": (dict(groups=2, dk=8, dv=24), 0.4, 1e-4),
    # G = 1: the text has no G axis (gdn_chunked_text.flat_layout)
    "odd_key_heads": (dict(hk=3), 0.25, 1e-4),
    "four_key_heads_dk_ne_dv": (dict(hk=4, dk=8, dv=24), 0.4, 1e-4),
    "f16_f32state": (dict(dtype=F16), 0.25, 1e-4),
    "f16_f16state": (dict(dtype=F16, state_dtype=F16), 0.25, 1e-3),
    "f16_gate": (dict(dtype=F16, gate_dtype=F16), 0.25, 1e-4),
}


@pytest.mark.parametrize("case", FEATURES)
def test_features(case, tmp_path):
    """What "chunked" accepts, split serves: GQA, Dk != Dv, f16 operands, f16 state (f64
    is refused: below)."""
    kwargs, scale, tolerance = FEATURES[case]
    module = Fused(scale)
    shape = {**SMALL, **kwargs}
    written = _split(module, scan_inputs(s=4, seed=3, **shape), tmp_path / f"{case}.nnef")
    runnable = tract_check.load(written)
    for s in (1, C + 3):
        print(case, s, check_run(runnable, module, scan_inputs(s=s, seed=s, **shape),
                                 tolerance))


@pytest.mark.parametrize("groups", [1, 2])
def test_symbolic_batch_and_sequence(groups, tmp_path):
    """B > 1 meets the heads in one axis (B * Hk; with G = 1 the text has no G axis)."""
    module = Fused(0.25)
    shape = dict(hk=2, dk=16, dv=16, groups=groups)
    axes = {name: {0: "B", 1: "S"} for name in SCAN_NAMES[:5]}
    axes["s0"] = {0: "B"}
    written = _split(module, scan_inputs(s=4, b=2, **shape), tmp_path / "bs.nnef", axes)
    runnable = tract_check.load(written)
    for b, s in ((1, 1), (3, 70)):
        check_run(runnable, module, scan_inputs(s=s, b=b, seed=s, **shape), 1e-4)


def test_one_state_two_initial_states(tmp_path):
    """Both loops reset their carry: one tract State run twice, at S = 1 then C + 5."""
    module = Fused(0.25)
    written = _split(module, scan_inputs(s=4, **SMALL), tmp_path / "s.nnef")
    state = tract_check.load(written).spawn_state()
    for s, seed in ((C + 5, 1), (C + 5, 2), (1, 3), (1, 4)):
        args = scan_inputs(s=s, seed=seed, **SMALL)
        for g, w in zip(tract_check.run(state, args), oracle(module, args)):
            assert tract_check.relative_error(g, w) <= 1e-4, (s, seed)


def test_static_length_when_forced(tmp_path):
    module = Fused(0.25)
    args = scan_inputs(s=C + 7, seed=7, **SMALL)
    print(check_run(_split(module, args, tmp_path / "st.nnef", axes=None), module, args, 1e-4))


def test_a_symbolic_sequence_takes_split_by_default():
    seq = torch.export.Dim("S", min=1, max=4096)
    program = torch.export.export(Fused(0.25), scan_inputs(s=4, groups=2),
                                  dynamic_shapes=({1: seq},) * 5 + (None,))
    assert [d.candidate for d in plan_lowering(program)] == ["split"]
    static = torch.export.export(Fused(0.25), scan_inputs(s=4))
    assert [d.candidate for d in plan_lowering(static)] == ["chunked_unrolled"]


@pytest.mark.parametrize("node, words", [
    (facts(s=None, kda=True), "KDA"),
    (facts(s=None, l2=False), "qk_l2norm=False"),
    (facts(s=None, dtype="bf16"), "bf16"),
    (facts(s=None, dtype="f64"), "f32 scalar"),
])
def test_split_refuses_what_chunked_refuses(node, words):
    with pytest.raises(LoweringUnsupported, match=words):
        decide(node, Target.parse("0.23.9", True), Choice.parse({"*": "split"}))
    if words != "bf16":  # bf16 has no candidate at all
        assert decide(node, Target.parse("0.23.9", True)).candidate in ("chunked", "matmul")


def test_split_suits_symbolic_s_on_the_cpu_only():
    decision = decide(facts(s=None), Target.parse("0.23.9", True))
    assert decision.candidate == "split"
    static = decide(facts(s=1025), Target.parse("0.23.9"))
    assert static.candidate == "chunked" and "static S=1025" in dict(static.rejected)["split"]
    cuda = decide(facts(s=None), Target.parse("0.23.9", True, runtime="cuda"))
    assert cuda.candidate != "split" and "not measured" in dict(cuda.rejected)["split"]
