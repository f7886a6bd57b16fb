"""The matmul-form candidates of gated_delta_scan ("matmul_step", "matmul", "chunked_unrolled",
"chunked"), exported, loaded AND run by the tract Python package.

The oracle is gdn_fx.reference.recurrent_delta_rule_reference on float64 copies of the inputs
(q/k l2-normalized in float64 when the node asks for it), never the code under test. Widths
are small (B=1, 2 heads, D=16) so that S = 1000 stays fast.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gdn_fx  # noqa: F401  (registers torch.ops.gdn_fx)
from gdn_fx import tract_check
from gdn_fx.errors import LoweringUnsupported
from gdn_fx.export import export_nnef
from gdn_fx.lowering import Target, decide
from gdn_fx.lowering.node_facts import ScanFacts
from gdn_fx.reference import l2norm, recurrent_delta_rule_reference
from lowering_programs import SCAN_NAMES, scan_inputs

LENGTHS = (1, 2, 63, 64, 65, 500, 1000)
SEQ_AXES = {name: {1: "S"} for name in SCAN_NAMES[:5]}
SMALL = dict(b=1, hk=2, dk=16, dv=16)
F16 = torch.float16


class Fused(nn.Module):
    """Only the fused op: its two outputs are the graph's outputs."""

    def __init__(self, scale: float, qk_l2norm: bool = True):
        super().__init__()
        self.scale, self.qk_l2norm = scale, qk_l2norm

    def forward(self, q, k, v, g, beta, s0):
        return torch.ops.gdn_fx.gated_delta_scan(q, k, v, g, beta, s0, scale=self.scale,
                                                 qk_l2norm=self.qk_l2norm)


def oracle(module: Fused, args) -> tuple[torch.Tensor, torch.Tensor]:
    """The float64 recurrence on the same inputs."""
    q, k, v, g, beta, s0 = (x.double() for x in args)
    if module.qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    return recurrent_delta_rule_reference(q, k, v, g, beta, scale=module.scale,
                                          initial_state=s0)


def check_run(model, module: Fused, args, tolerance: float) -> list[float]:
    """Run in tract, compare with the float64 oracle; also check the output dtypes."""
    got = tract_check.run(model, args)
    want_dtypes = [torch.promote_types(args[0].dtype, args[5].dtype), args[5].dtype]
    for out, dtype in zip(got, want_dtypes):
        assert out.dtype == torch.empty(0, dtype=dtype).numpy().dtype
    errors = [tract_check.relative_error(g, w) for g, w in zip(got, oracle(module, args))]
    assert max(errors) <= tolerance, errors
    return errors


def export(module: Fused, args, path, candidate: str, dynamic: bool = False):
    program = torch.export.export(module, args)
    written = export_nnef(program, path, choose={"*": candidate},
                          dynamic_axes=SEQ_AXES if dynamic else None)
    assert tract_check.read_decisions(written) == {"gated_delta_scan": candidate}
    return written


# --- every candidate at S = 1, 2, 63, 64, 65, 500, 1000 -------------------------------------

@pytest.mark.parametrize("candidate", ["chunked", "matmul"])
def test_symbolic_graph_at_every_length(candidate, tmp_path):
    """ONE graph with a symbolic S (traced at S=4) runs right at every length."""
    module = Fused(16 ** -0.5)
    written = export(module, scan_inputs(s=4, **SMALL), tmp_path / "sym.nnef", candidate,
                     dynamic=True)
    text = tract_check.nnef_text(written)
    assert "tract_symbol S" in text and "reset_every_turn = 1" in text
    runnable = tract_check.load(written)
    for s in LENGTHS:
        print(candidate, s, check_run(runnable, module, scan_inputs(s=s, seed=s, **SMALL), 1e-4))


@pytest.mark.parametrize("candidate", ["chunked", "matmul"])
def test_symbolic_batch_and_sequence(candidate, tmp_path):
    """Batch and sequence both symbolic, with GQA: the text reads both at run time."""
    module = Fused(0.25)
    shape = dict(hk=2, dk=16, dv=16, groups=2)
    program = torch.export.export(module, scan_inputs(s=4, b=2, **shape))
    axes = {name: {0: "B", 1: "S"} for name in SCAN_NAMES[:5]}
    axes["s0"] = {0: "B"}
    written = export_nnef(program, tmp_path / "bs.nnef", choose={"*": candidate},
                          dynamic_axes=axes)
    runnable = tract_check.load(written)
    for b, s in ((1, 3), (3, 70)):
        check_run(runnable, module, scan_inputs(s=s, b=b, seed=s, **shape), 1e-4)


@pytest.mark.parametrize("s", LENGTHS)
def test_unrolled_chunks_static_lengths(s, tmp_path):
    module = Fused(16 ** -0.5)
    args = scan_inputs(s=s, seed=s, **SMALL)
    written = export(module, args, tmp_path / "u.nnef", "chunked_unrolled")
    assert "tract_core_scan" not in tract_check.nnef_text(written)
    print(s, check_run(written, module, args, 1e-4))


def test_matmul_step_is_one_step(tmp_path):
    module = Fused(16 ** -0.5)
    args = scan_inputs(s=1, seed=1, **SMALL)
    written = export(module, args, tmp_path / "m.nnef", "matmul_step")
    text = tract_check.nnef_text(written)
    assert "tract_core_scan" not in text and "tract_transformers" not in text
    print(check_run(written, module, args, 1e-4))


# --- features: GQA, KDA, dtypes, flags, widths, batch ---------------------------------------

# name: (candidate, scan_inputs kwargs, scale, qk_l2norm, tolerance)
FEATURES = {
    "step_gqa_kda": ("matmul_step", dict(s=1, groups=3, kda=True), 0.3, True, 1e-4),
    "step_f16_f16state": ("matmul_step", dict(s=1, dtype=F16, state_dtype=F16), 0.25, True,
                          1e-3),
    "step_no_l2norm_dk_ne_dv": ("matmul_step", dict(s=1, dk=8, dv=24), 0.2, False, 1e-4),
    "matmul_kda_gqa_batch": ("matmul", dict(b=2, s=9, groups=2, kda=True), 0.3, True, 1e-4),
    "matmul_f16_f32state": ("matmul", dict(s=7, dtype=F16), 0.25, True, 1e-4),
    "matmul_no_l2norm": ("matmul", dict(s=6, groups=2, dk=8, dv=12), 0.2, False, 1e-4),
    "unrolled_gqa_batch": ("chunked_unrolled", dict(b=2, s=70, groups=3), 0.25, True, 1e-4),
    "unrolled_f16_f32state": ("chunked_unrolled", dict(s=130, dtype=F16), 0.25, True, 1e-4),
    "unrolled_f16_gate": ("chunked_unrolled", dict(s=9, dtype=F16, gate_dtype=F16), 0.25,
                          True, 1e-4),
    "chunked_gqa_dk_ne_dv": ("chunked", dict(s=65, groups=2, dk=8, dv=24), 0.4, True, 1e-4),
    "chunked_f16_f16state": ("chunked", dict(s=40, dtype=F16, state_dtype=F16), 0.25, True,
                             1e-3),
    "chunked_f64": ("chunked", dict(s=33, dtype=torch.float64, state_dtype=torch.float64), 0.3,
                    True, 1e-10),
}


@pytest.mark.parametrize("case", FEATURES)
def test_features(case, tmp_path):
    candidate, kwargs, scale, l2, tolerance = FEATURES[case]
    module = Fused(scale, l2)
    args = scan_inputs(hk=2, seed=3, **{"dk": 16, "dv": 16, **kwargs})
    written = export(module, args, tmp_path / f"{case}.nnef", candidate)
    print(case, check_run(written, module, args, tolerance))


# --- the reused-State trap (docs/FACTS.md, "tract 0.23.9: traps"): every loop resets its carry

def _two_runs(written, runs: list) -> list:
    state = tract_check.load(written).spawn_state()
    return [tract_check.run(state, args) for args in runs]


@pytest.mark.parametrize("candidate", ["chunked", "matmul"])
def test_one_state_two_initial_states(candidate, tmp_path):
    """One tract State run twice with different initial states (and inputs): both right."""
    module = Fused(0.25)
    runs = [scan_inputs(s=70, seed=1, **SMALL), scan_inputs(s=70, seed=2, **SMALL)]
    written = export(module, runs[0], tmp_path / "s.nnef", candidate)
    for args, got in zip(runs, _two_runs(written, runs)):
        for g, w in zip(got, oracle(module, args)):
            assert tract_check.relative_error(g, w) <= 1e-4


def test_state_trap_is_real_for_chunked(tmp_path):
    """Control: without reset_every_turn the second run is wrong, so the test above can fail."""
    module = Fused(0.25)
    runs = [scan_inputs(s=70, seed=1, **SMALL), scan_inputs(s=70, seed=2, **SMALL)]
    written = export(module, runs[0], tmp_path / "s.nnef", "chunked")
    graph = written / "graph.nnef"
    graph.write_text(graph.read_text().replace("reset_every_turn = 1", "reset_every_turn = 0"))
    second = _two_runs(written, runs)[1]
    errors = [tract_check.relative_error(g, w) for g, w in zip(second, oracle(module, runs[1]))]
    assert max(errors) > 1e-2, errors


def test_two_nodes_share_fragments(tmp_path):
    """Two fused nodes of the same configuration: one set of fragments, both outputs right."""

    class Two(nn.Module):
        def forward(self, q, k, v, g, beta, s0):
            y, s1 = torch.ops.gdn_fx.gated_delta_scan(q, k, v, g, beta, s0, scale=0.25,
                                                      qk_l2norm=True)
            return torch.ops.gdn_fx.gated_delta_scan(y, k, v, g, beta, s1, scale=0.25,
                                                     qk_l2norm=True)

    args = scan_inputs(s=20, **SMALL)
    written = export_nnef(torch.export.export(Two(), args), tmp_path / "two.nnef",
                          choose={"*": "chunked_unrolled"})
    text = tract_check.nnef_text(written)
    assert text.count("fragment gdn_fx_chunked_chunk_") == 1
    q, k, v, g, beta, s0 = (x.double() for x in args)
    y, s1 = recurrent_delta_rule_reference(l2norm(q), l2norm(k), v, g, beta, scale=0.25,
                                           initial_state=s0)
    want = recurrent_delta_rule_reference(l2norm(y), l2norm(k), v, g, beta, scale=0.25,
                                          initial_state=s1)
    for got, w in zip(tract_check.run(written, args), want):
        assert tract_check.relative_error(got, w) <= 1e-4


# --- which candidate the table picks, and why the others say no ------------------------------

def facts(s=1, groups=1, kda=False, l2=True, dtype="f32", dk=128) -> ScanFacts:
    hv = 2 * groups
    shapes = dict(q=(1, s, 2, dk), k=(1, s, 2, dk), v=(1, s, hv, dk),
                  g=(1, s, hv, dk) if kda else (1, s, hv), beta=(1, s, hv),
                  initial_state=(1, hv, dk, dk))
    return ScanFacts("n", shapes, dict.fromkeys(shapes, dtype), dk ** -0.5, l2)


ORDER = [
    # (facts, dynamic axes, expected candidate): the default order of the table
    (facts(s=1), False, "matmul_step"),
    (facts(s=1, kda=True), False, "matmul_step"),
    (facts(s=1), True, "split"),  # traced at S=1 but S is symbolic: chunks, then steps
    (facts(s=2), False, "chunked_unrolled"),
    (facts(s=512, groups=2), False, "chunked_unrolled"),
    (facts(s=1024), False, "chunked_unrolled"),
    (facts(s=1025), False, "chunked"),  # 17 chunks: past the unrolled limit
    (facts(s=None), False, "split"),
    (facts(s=512, kda=True), False, "matmul"),
    (facts(s=512, l2=False), False, "matmul"),
    (facts(s=7, kda=True), True, "matmul"),
    (facts(s=64, dtype="f16"), False, "chunked_unrolled"),
]


@pytest.mark.parametrize("case", range(len(ORDER)))
def test_default_order(case):
    node, dynamic, expected = ORDER[case]
    assert decide(node, Target.parse("0.23.9", dynamic)).candidate == expected


REFUSALS = [
    # (candidate, facts, dynamic, words the reason must contain)
    ("matmul_step", facts(s=2), False, "S=2"),
    ("matmul_step", facts(s=1), True, "symbolic axes"),
    ("chunked_unrolled", facts(s=None), False, "static S"),
    ("chunked_unrolled", facts(s=1025), False, "17 chunks"),
    ("chunked_unrolled", facts(s=64, kda=True), False, "KDA"),
    ("chunked", facts(s=64, kda=True), False, "KDA"),
    ("chunked", facts(s=64, l2=False), False, "qk_l2norm=False"),
    ("matmul", facts(dtype="bf16"), False, "bf16"),
    ("chunked", facts(dtype="bf16"), False, "bf16"),
]


@pytest.mark.parametrize("case", range(len(REFUSALS)))
def test_refusals_name_the_reason(case):
    name, node, dynamic, words = REFUSALS[case]
    with pytest.raises(LoweringUnsupported, match=words):
        decide(node, Target.parse("0.23.9", dynamic), _force(name))


def _force(name: str):
    from gdn_fx.lowering.choice import Choice

    return Choice.parse({"*": name})
