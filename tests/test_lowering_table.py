"""The lowering table: which candidate each (tract version, dtypes, widths, GQA, KDA, S, flags)
gets, and how ``choose`` forces or forbids. Pure: no tracing, no tract.

Expected candidates are written from FACTS.md's record of what tract accepted, release by
release; they are not computed by the code under test.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
from nnef_tools.model import Graph as NGraph
from nnef_tools.model import Tensor as NTensor

from gdn_fx.errors import LoweringUnsupported
from gdn_fx.lowering import Target, decide, native_gdn_min_version, native_gdn_reject_reason
from gdn_fx.lowering.choice import Choice, validate
from gdn_fx.lowering.facts import ConvFacts, ScanFacts
from gdn_fx.lowering.table import TABLE, candidate_names

DECODE_F16 = dict(q="f16", k="f16", v="f16", g="f32", beta="f16", initial_state="f32")
ALL_F32 = dict.fromkeys(DECODE_F16, "f32")


def scan(b=1, s=1, hk=2, groups=1, dk=128, dv=None, kda=False, dtypes=None, scale=None,
         l2=True) -> ScanFacts:
    dv = dk if dv is None else dv
    hv = hk * groups
    shapes = dict(q=(b, s, hk, dk), k=(b, s, hk, dk), v=(b, s, hv, dv),
                  g=(b, s, hv, dk) if kda else (b, s, hv), beta=(b, s, hv),
                  initial_state=(b, hv, dk, dv))
    return ScanFacts("n", shapes, dict(DECODE_F16, **(dtypes or {})),
                     dk ** -0.5 if scale is None else scale, l2)


def conv(b=1, c=8, s=1, k=4, dtype="f16", bias=False, act="silu", dtypes=None) -> ConvFacts:
    shapes = dict(x=(b, c, s), conv_state=(b, c, k), weight=(c, k))
    names = dict.fromkeys(shapes, dtype)
    if bias:
        shapes["bias"], names["bias"] = (c,), dtype
    return ConvFacts("n", shapes, dict(names, **(dtypes or {})), bias, act)


def target(version, dynamic=False):
    return Target.parse(version, dynamic)


F16_STATE = dict(DECODE_F16, initial_state="f16")

SCAN_TABLE = [
    # (tract version, dynamic axes, facts, expected candidate)
    ("0.23.4", False, scan(), "scan"),  # no native operator yet
    ("0.23.5", False, scan(), "native"),  # the first form: one f16 decode step, width 128
    ("0.23.5", False, scan(s=4), "scan"),
    ("0.23.5", True, scan(), "scan"),  # S may be symbolic: one-step op is unsafe
    ("0.23.5", False, scan(dk=64), "scan"),
    ("0.23.5", False, scan(groups=2), "scan"),  # no GQA in the first form
    ("0.23.5", False, scan(dtypes=ALL_F32), "scan"),
    ("0.23.5", False, scan(b=3), "native"),  # batch was always fine
    ("0.23.8", False, scan(), "native"),
    ("0.23.8", False, scan(dtypes=ALL_F32), "scan"),  # held to the first form below 0.23.9
    ("0.23.9", True, scan(b=2, s=7, groups=4, dk=64, dtypes=ALL_F32), "native"),
    ("0.23.9", False, scan(s=33, dk=8), "native"),
    ("0.23.9", False, scan(dtypes=F16_STATE), "native"),
    ("0.23.9", False, scan(dtypes=dict(ALL_F32, g="f16")), "native"),  # g widened to f32
    ("0.23.9", False, scan(dtypes=dict(ALL_F32, initial_state="f16")), "scan"),
    ("0.23.9", False, scan(dtypes=dict(DECODE_F16, v="f32")), "scan"),
    ("0.23.9", False, scan(dtypes=dict.fromkeys(DECODE_F16, "f64")), "scan"),
    ("0.23.9", False, scan(kda=True), "scan"),
    ("0.23.9", False, scan(l2=False), "scan"),
    ("0.23.9", False, scan(scale=0.3), "scan"),
    ("0.23.9", False, scan(dk=64, dv=32), "scan"),
    ("0.24.1", False, scan(groups=2, s=5), "native"),
]


@pytest.mark.parametrize("version, dynamic, facts, expected", SCAN_TABLE)
def test_scan_candidate_table(version, dynamic, facts, expected):
    decision = decide(facts, target(version, dynamic))
    print(decision)
    assert decision.candidate == expected
    assert (len(decision.rejected) == 0) == (expected == "native")


CONV_TABLE = [
    ("0.23.4", False, conv(), "portable"),
    ("0.23.5", False, conv(), "native"),  # first form: f16, K=4, one step, batch 1
    ("0.23.5", False, conv(dtype="f32"), "portable"),
    ("0.23.5", False, conv(k=3), "portable"),
    ("0.23.5", False, conv(s=2), "portable"),
    ("0.23.5", False, conv(b=2), "portable"),
    ("0.23.5", True, conv(), "portable"),
    ("0.23.9", True, conv(b=2, s=9, k=3, dtype="f32"), "native"),
    ("0.23.9", False, conv(k=2), "native"),
    ("0.23.9", False, conv(k=5), "native"),
    ("0.23.9", False, conv(k=6), "portable"),
    ("0.23.9", False, conv(k=1), "portable"),
    ("0.23.9", False, conv(bias=True), "portable"),
    ("0.23.9", False, conv(act=None), "portable"),
    ("0.23.9", False, conv(dtypes=dict(weight="f32")), "portable"),
    ("0.23.9", False, conv(dtype="f64"), "portable"),
]


@pytest.mark.parametrize("version, dynamic, facts, expected", CONV_TABLE)
def test_conv_candidate_table(version, dynamic, facts, expected):
    assert decide(facts, target(version, dynamic)).candidate == expected


def test_table_is_one_literal_with_native_first():
    assert candidate_names() == {"gated_delta_scan": ("native", "scan"),
                                 "causal_conv1d_update": ("native", "portable")}
    assert all(callable(c.check) and callable(c.emit) for cs in TABLE.values() for c in cs)


def test_bfloat16_has_no_candidate():
    facts = scan(dtypes=dict.fromkeys(DECODE_F16, "bf16"))
    with pytest.raises(LoweringUnsupported, match="bf16") as info:
        decide(facts, target("0.23.9"))
    assert "native:" in str(info.value) and "scan:" in str(info.value)


def test_every_rejection_is_logged(caplog):
    with caplog.at_level(logging.INFO, logger="gdn_fx.lowering"):
        decision = decide(scan(kda=True, scale=0.3), target("0.23.9"))
    assert decision.candidate == "scan"
    assert decision.rejected[0][0] == "native" and "scale" in decision.rejected[0][1]
    assert any("native rejected" in r.getMessage() and "scale" in r.getMessage()
               for r in caplog.records)


def test_version_parsing():
    assert Target.parse("0.23.9").version == (0, 23, 9)
    assert Target.parse("v0.23.10").at_least("0.23.9")
    assert not Target.parse("0.23.4").at_least(native_gdn_min_version())
    with pytest.raises(ValueError):
        Target.parse("latest")


# ---- choose -------------------------------------------------------------------------------

def test_force_and_forbid():
    t = target("0.23.9")
    assert decide(scan(), t, Choice.parse({"*": "scan"})).candidate == "scan"
    assert decide(scan(), t, Choice.parse({"forbid": ["native"]})).candidate == "scan"
    assert decide(conv(), t, Choice.parse({"*": "scan"})).candidate == "native"  # not its name
    assert decide(conv(), t, Choice.parse({"forbid": {"n": "native"}})).candidate == "portable"
    node_over_op = Choice.parse({"n": "native", "gated_delta_scan": "scan"})
    assert decide(scan(), t, node_over_op).candidate == "native"
    assert decide(scan(), t, Choice.parse({"m": "scan"})).candidate == "native"  # other node


def test_forced_candidate_that_rejects_is_an_error():
    with pytest.raises(LoweringUnsupported, match="KDA"):
        decide(scan(kda=True), target("0.23.9"), Choice.parse({"*": "native"}))
    with pytest.raises(LoweringUnsupported, match="forbidden"):
        decide(scan(), target("0.23.9"), Choice.parse({"forbid": ["native", "scan"]}))


@pytest.mark.parametrize("choose, message", [
    ({"gated_delta_scan_7": "scan"}, "name no fused node"),
    ({"*": "fast"}, "no candidate named"),
    ({"n": "portable"}, "no candidate named"),  # a conv candidate on a scan node
    ({"forbid": {"causal_conv1d_update": ["scan"]}}, "no candidate named"),
])
def test_choose_typos_are_refused(choose, message):
    with pytest.raises(ValueError, match=message):
        validate(Choice.parse(choose), {"n": "gated_delta_scan"}, candidate_names())


@pytest.mark.parametrize("choose", [["scan"], {"*": ["scan"]}, {"forbid": "native"}])
def test_choose_bad_forms(choose):
    with pytest.raises(TypeError):
        Choice.parse(choose)


# ---- the native-operator surface on NNEF tensors ---------------------------------------

def _nnef_operands(layout_shapes, dtypes):
    graph = NGraph("g")
    return [NTensor(graph, name=str(i), shape=shape, dtype=np.dtype(dt).type)
            for i, (shape, dt) in enumerate(zip(layout_shapes, dtypes))]


def test_native_reject_reason_reads_head_major_operands():
    f16, f32 = np.float16, np.float32
    dtypes = [f16, f16, f16, f32, f16, f32]
    head_major = [(1, 2, 1, 128)] * 3 + [(1, 2, 1)] * 2 + [(1, 2, 128, 128)]
    seq_major = [(1, 1, 2, 128)] * 3 + [(1, 1, 2)] * 2 + [(1, 2, 128, 128)]
    assert native_gdn_reject_reason("0.23.5", _nnef_operands(head_major, dtypes), True) is None
    assert native_gdn_reject_reason("0.23.5", _nnef_operands(seq_major, dtypes), False) is None
    # Read as sequence-major, the head-major shapes say S=2: the one-step op refuses them.
    reason = native_gdn_reject_reason("0.23.5", _nnef_operands(head_major, dtypes), False)
    assert reason is not None and "S=2" in reason
    assert "has no" in native_gdn_reject_reason("0.23.4", _nnef_operands(seq_major, dtypes),
                                                 False)
