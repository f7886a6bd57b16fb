"""gated_delta_scan exported to NNEF, loaded AND run by the tract Python package, vs torch eager.

This file is about the "native" and "scan" candidates (the fast matmul-form candidates, first
in the table, are tested in test_lowering_fast.py): unless a case forces one, the table picks
between the two with the fast ones forbidden. Each case records which candidate was emitted
(from the NNEF's recorded decisions and the operator found in its text) and the relative error
of every output.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from gdn_fx import tract_check
from gdn_fx.export import export_nnef
from lowering_programs import (NATIVE_GDN, ScanModule, export_checked, scan_inputs,
                                   tolerance_for)

F16, F32 = torch.float16, torch.float32
FAST = ["matmul_step", "chunked_unrolled", "split", "chunked", "matmul"]
NATIVE_OR_SCAN = {"forbid": FAST}

# name: (scan_inputs kwargs, scale or None for 1/sqrt(dk), qk_l2norm, forced candidate (None:
#        the table picks native or scan), expected candidate)
CASES = {
    "f32_native": (dict(), None, True, None, "native"),
    "f32_scan": (dict(), None, True, "scan", "scan"),
    "f16_f32state_native": (dict(dtype=F16), None, True, None, "native"),
    "f16_f16state_native": (dict(dtype=F16, state_dtype=F16), None, True, None, "native"),
    "f16_f32state_scan": (dict(dtype=F16), None, True, "scan", "scan"),
    "f16_f16state_scan": (dict(dtype=F16, state_dtype=F16), None, True, "scan", "scan"),
    "gqa_native": (dict(b=2, s=5, groups=3), None, True, None, "native"),
    "gqa_scan": (dict(b=2, s=5, groups=3), None, True, "scan", "scan"),
    "kda_gqa": (dict(s=5, kda=True, groups=2, dk=8, dv=12), 0.3, True, None, "scan"),
    "no_l2norm": (dict(s=3), 0.2, False, None, "scan"),
    "other_scale": (dict(s=3), 0.7, True, None, "scan"),
    "dk_ne_dv": (dict(dk=8, dv=24), None, True, None, "scan"),
    "f16_gate_native": (dict(gate_dtype=F16), None, True, None, "native"),
    "kda_f16_scan": (dict(kda=True, dtype=F16, groups=2), 0.25, True, None, "scan"),
    "f64_scan": (dict(dtype=torch.float64, state_dtype=torch.float64), 0.3, True, None, "scan"),
}


@pytest.mark.parametrize("case", CASES)
def test_scan_runs_in_tract(case, tmp_path):
    kwargs, scale, l2, forced, expected = CASES[case]
    args = scan_inputs(**kwargs)
    scale = args[0].shape[-1] ** -0.5 if scale is None else scale
    choose = {"gated_delta_scan": forced} if forced else NATIVE_OR_SCAN
    decisions, comparison, text = export_checked(
        ScanModule(scale, l2), args, tmp_path / f"{case}.nnef", tolerance_for(*args),
        choose=choose)
    print(f"{case}: emitted {decisions}; {comparison}")
    assert list(decisions.values()) == [expected]
    assert (NATIVE_GDN in text) == (expected == "native")
    assert ("tract_core_scan" in text) == (expected == "scan")
    assert comparison.ok, comparison


def test_scan_against_float64(tmp_path):
    """A second oracle: the same program evaluated in float64 by torch."""
    args = scan_inputs(b=2, s=9, groups=2, kda=True, dk=8, dv=8, seed=3)
    module = ScanModule(0.4)
    written = export_nnef(torch.export.export(module, args), tmp_path / "kda.nnef")
    want = module(*(a.double() for a in args))
    got = tract_check.run(written, args)
    for g, w in zip(got, want):
        assert tract_check.relative_error(g, w) < 1e-5


def _run_state_twice(written, runs):
    state = tract_check.load(written).spawn_state()
    return [tract_check.run(state, args) for args in runs]


def test_one_state_two_initial_states(tmp_path):
    """tract_core_scan keeps its carry between runs of one State unless reset_every_turn = 1."""
    module = ScanModule(0.25)
    runs = [scan_inputs(s=3, seed=1), scan_inputs(s=3, seed=2)]
    written = export_nnef(torch.export.export(module, runs[0]), tmp_path / "s.nnef",
                          choose={"*": "scan"})
    assert "reset_every_turn = 1" in tract_check.nnef_text(written)
    for args, got in zip(runs, _run_state_twice(written, runs)):
        for g, w in zip(got, module(*args)):
            assert tract_check.relative_error(g, w) < 1e-4


def test_state_reuse_trap_is_real(tmp_path):
    """Control: the same graph WITHOUT reset_every_turn goes wrong on the second run, so the
    test above can fail."""
    module = ScanModule(0.25)
    runs = [scan_inputs(s=3, seed=1), scan_inputs(s=3, seed=2)]
    written = export_nnef(torch.export.export(module, runs[0]), tmp_path / "s.nnef",
                          choose={"*": "scan"})
    graph = written / "graph.nnef"
    graph.write_text(graph.read_text().replace("reset_every_turn = 1", "reset_every_turn = 0"))
    second = _run_state_twice(written, runs)[1]
    assert tract_check.relative_error(second[1], module(*runs[1])[1]) > 1e-2


def test_extra_ops_around_and_two_nodes(tmp_path):
    """Plain layers around two fused scans; per-node choice; both outputs match torch."""

    class TwoLayers(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.proj = torch.nn.Linear(16, 3 * 32)

        def forward(self, x, s0, s1):
            q, k, v = self.proj(x).reshape(1, x.shape[1], 3, 2, 16).unbind(2)
            g = -torch.nn.functional.softplus(x[..., :2])
            beta = torch.sigmoid(x[..., 2:4])
            y0, f0 = torch.ops.gdn_fx.gated_delta_scan(q, k, v, g, beta, s0, scale=0.25,
                                                       qk_l2norm=True)
            y1, f1 = torch.ops.gdn_fx.gated_delta_scan(y0, k, v, g, beta, s1, scale=0.25,
                                                       qk_l2norm=True)
            return y1.sum(-1), f0, f1

    torch.manual_seed(1)
    args = (torch.randn(1, 6, 16), torch.randn(1, 2, 16, 16), torch.randn(1, 2, 16, 16))
    module = TwoLayers()
    program = torch.export.export(module, args)
    names = [n.name for n in program.graph.nodes if "gated_delta_scan" in str(n.target)]
    written = export_nnef(program, tmp_path / "two.nnef.tgz",
                          choose={names[1]: "scan", **NATIVE_OR_SCAN})
    assert written.name == "two.nnef.tgz" and written.is_file()
    assert tract_check.read_decisions(written) == {names[0]: "native", names[1]: "scan"}
    assert tract_check.compare(written, module(*args), args).ok


def test_native_scale_is_exactly_inverse_sqrt_width():
    """The native op scales by 1/sqrt(Dk): a scale off by 1e-3 must not reach it."""
    from gdn_fx.lowering import plan_lowering

    args = scan_inputs(dk=32, dv=32)
    for scale, want in [(1 / math.sqrt(32), "native"), (1.001 / math.sqrt(32), "scan")]:
        program = torch.export.export(ScanModule(scale), args)
        assert [d.candidate for d in plan_lowering(program, choose=NATIVE_OR_SCAN)] == [want]


def test_decisions_survive_a_tar_archive(tmp_path):
    args = scan_inputs()  # static S = 4, GDN gate, q/k l2norm: the unrolled chunked form
    program = torch.export.export(ScanModule(0.3), args)
    written = export_nnef(program, tmp_path / "m.nnef.tar")
    assert written == tmp_path / "m.nnef.tar" and written.is_file()
    assert tract_check.read_decisions(written) == {"gated_delta_scan": "chunked_unrolled"}
    got = tract_check.run(written, args)
    assert np.isfinite(got[0]).all()
