"""The lowering table: which candidate each (tract version, dtypes, widths, GQA, KDA, S, flags)
gets, and how ``choose`` forces or forbids. Pure: no tracing, no tract.

Expected candidates are written by hand: the default choice from the candidates' documented
rules (lowering/gdn_matmul.py, gdn_chunked.py, conv_portable.py) and the table order measured
in bench/; the native operators' answers from docs/FACTS.md's record of what tract accepted,
release by release. None is computed by the code under test.
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
from gdn_fx.lowering.node_facts import ConvFacts, ScanFacts
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

# The table order, written out here (not read from the code under test).
GDN_ORDER = ("matmul_step", "chunked_unrolled", "split", "chunked", "matmul", "native", "scan",
             "chunked_parallel", "chunked_window")  # the last two: for the CUDA runtime only
CONV_ORDER = ("depthwise", "portable", "native")
LINEAR_ORDER = ("matmul_step", "chunked_unrolled", "split", "chunked", "matmul")  # issue 62
FAST = ["matmul_step", "chunked_unrolled", "split", "chunked", "matmul"]
ONLY_NATIVE_OR_SCAN = Choice.parse({"forbid": FAST})
ONLY_NATIVE_CONV = Choice.parse({"forbid": ["depthwise", "portable"]})

SCAN_TABLE = [
    # (tract version, dynamic axes, facts, default candidate, candidate among native/scan)
    # Default, from the candidates' documented rules: matmul_step takes static S = 1;
    # chunked_unrolled static S of at most 16 chunks of 64 (GDN gate, q/k l2norm in the node);
    # split a symbolic S on the same conditions (chunks, then steps: issue 31), chunked any
    # longer static S; matmul the rest. All take f16/f32/f64 only.
    # native/scan, from docs/FACTS.md's record of what tract accepted, release by release.
    ("0.23.4", False, scan(), "matmul_step", "scan"),  # no native operator yet
    ("0.23.5", False, scan(), "matmul_step", "native"),  # first form: one f16 step, width 128
    ("0.23.5", False, scan(s=4), "chunked_unrolled", "scan"),
    ("0.23.5", True, scan(), "split", "scan"),  # S may be symbolic: one-step ops are unsafe
    ("0.23.5", False, scan(dk=64), "matmul_step", "scan"),
    ("0.23.5", False, scan(groups=2), "matmul_step", "scan"),  # no GQA in the first form
    ("0.23.5", False, scan(dtypes=ALL_F32), "matmul_step", "scan"),
    ("0.23.5", False, scan(b=3), "matmul_step", "native"),  # batch was always fine
    ("0.23.8", False, scan(), "matmul_step", "native"),
    ("0.23.8", False, scan(dtypes=ALL_F32), "matmul_step", "scan"),  # first form below 0.23.9
    ("0.23.9", True, scan(b=2, s=7, groups=4, dk=64, dtypes=ALL_F32), "split", "native"),
    ("0.23.9", False, scan(s=33, dk=8), "chunked_unrolled", "native"),
    ("0.23.9", False, scan(dtypes=F16_STATE), "matmul_step", "native"),
    ("0.23.9", False, scan(dtypes=dict(ALL_F32, g="f16")), "matmul_step", "native"),
    ("0.23.9", False, scan(dtypes=dict(ALL_F32, initial_state="f16")), "matmul_step", "scan"),
    ("0.23.9", False, scan(dtypes=dict(DECODE_F16, v="f32")), "matmul_step", "scan"),
    ("0.23.9", False, scan(dtypes=dict.fromkeys(DECODE_F16, "f64")), "matmul_step", "scan"),
    ("0.23.9", False, scan(kda=True), "matmul_step", "scan"),
    ("0.23.9", False, scan(l2=False), "matmul_step", "scan"),
    ("0.23.9", False, scan(scale=0.3), "matmul_step", "scan"),
    ("0.23.9", False, scan(dk=64, dv=32), "matmul_step", "scan"),
    ("0.24.1", False, scan(groups=2, s=5), "chunked_unrolled", "native"),
    # The shape classes of the default order.
    ("0.23.9", False, scan(s=8), "chunked_unrolled", "native"),  # static prefill
    ("0.23.9", False, scan(s=8, groups=2, scale=0.3), "chunked_unrolled", "scan"),  # any scale
    ("0.23.9", False, scan(s=1024), "chunked_unrolled", "native"),  # 16 chunks of 64
    ("0.23.9", False, scan(s=1025), "chunked", "native"),  # 17 chunks: the loop
    ("0.23.9", True, scan(s=None), "split", "native"),  # symbolic S
    ("0.23.9", False, scan(s=None), "split", "native"),  # symbolic S, no dynamic axis declared
    ("0.23.9", True, scan(s=1), "split", "native"),  # traced S = 1, but axes are symbolic
    ("0.23.9", False, scan(s=8, kda=True), "matmul", "scan"),
    ("0.23.9", True, scan(s=None, kda=True, groups=2), "matmul", "scan"),
    ("0.23.9", False, scan(s=8, l2=False), "matmul", "scan"),
    ("0.23.9", True, scan(s=None, l2=False), "matmul", "scan"),
    ("0.23.9", False, scan(s=8, dtypes=dict.fromkeys(DECODE_F16, "f64")), "chunked_unrolled",
     "scan"),
]


@pytest.mark.parametrize("version, dynamic, facts, expected, fallback", SCAN_TABLE)
def test_scan_candidate_table(version, dynamic, facts, expected, fallback):
    decision = decide(facts, target(version, dynamic))
    print(decision)
    assert decision.candidate == expected
    # Every candidate ahead of the winner was tried and rejected, none after it.
    assert [name for name, _ in decision.rejected] == list(GDN_ORDER[:GDN_ORDER.index(expected)])
    assert not decision.forced


@pytest.mark.parametrize("version, dynamic, facts, expected, fallback", SCAN_TABLE)
def test_scan_native_or_scan_table(version, dynamic, facts, expected, fallback):
    decision = decide(facts, target(version, dynamic), ONLY_NATIVE_OR_SCAN)
    print(decision)
    assert decision.candidate == fallback
    rejected = dict(decision.rejected)
    assert all(rejected[name] == "forbidden by choose" for name in FAST)
    assert ("native" in rejected) == (fallback == "scan")


CONV_TABLE = [
    # (tract version, dynamic axes, facts, default candidate, native's answer: "native" or None
    # for a rejection). The default for every f16/f32/f64 node: "portable" for a static S = 1
    # or a symbolic S (tract's conv of symbolic length is im2col + matmul, bench_conv.py),
    # "depthwise" for a longer static S.
    ("0.23.4", False, conv(), "portable", None),
    ("0.23.5", False, conv(), "portable", "native"),  # first form: f16, K=4, one step, batch 1
    ("0.23.5", False, conv(dtype="f32"), "portable", None),
    ("0.23.5", False, conv(k=3), "portable", None),
    ("0.23.5", False, conv(s=2), "depthwise", None),
    ("0.23.5", False, conv(b=2), "portable", None),
    ("0.23.5", True, conv(), "portable", None),
    ("0.23.9", True, conv(b=2, s=9, k=3, dtype="f32"), "portable", "native"),
    ("0.23.9", False, conv(s=None, dtype="f32"), "portable", "native"),  # a symbolic S
    ("0.23.9", False, conv(k=2), "portable", "native"),
    ("0.23.9", False, conv(k=5), "portable", "native"),
    ("0.23.9", False, conv(k=6), "portable", None),
    ("0.23.9", False, conv(k=1), "portable", None),
    ("0.23.9", False, conv(bias=True), "portable", None),
    ("0.23.9", False, conv(act=None), "portable", None),
    ("0.23.9", False, conv(dtypes=dict(weight="f32")), "portable", None),
    ("0.23.9", False, conv(dtype="f64"), "portable", None),
    ("0.23.9", False, conv(s=64, c=6144, dtype="f32"), "depthwise", "native"),  # Qwen3.5 prefill
    ("0.23.9", False, conv(dtype="bf16"), None, None),  # no bf16 in tract
]


@pytest.mark.parametrize("version, dynamic, facts, expected, native", CONV_TABLE)
def test_conv_candidate_table(version, dynamic, facts, expected, native):
    if expected is None:
        with pytest.raises(LoweringUnsupported, match="depthwise: .*portable: .*native: "):
            decide(facts, target(version, dynamic))
        return
    decision = decide(facts, target(version, dynamic))
    assert decision.candidate == expected
    assert [name for name, _ in decision.rejected] == list(CONV_ORDER[:CONV_ORDER.index(expected)])


@pytest.mark.parametrize("version, dynamic, facts, expected, native", CONV_TABLE)
def test_conv_native_table(version, dynamic, facts, expected, native):
    if native is None:
        with pytest.raises(LoweringUnsupported, match="native: ") as info:
            decide(facts, target(version, dynamic), ONLY_NATIVE_CONV)
        assert "portable: forbidden by choose" in str(info.value)
        return
    assert decide(facts, target(version, dynamic), ONLY_NATIVE_CONV).candidate == native


def test_table_is_one_literal_in_measured_order():
    assert candidate_names() == {"gated_delta_scan": GDN_ORDER, "causal_conv1d_update": CONV_ORDER,
                                 "gated_linear_scan": LINEAR_ORDER}
    assert all(callable(c.check) and callable(c.emit) for cs in TABLE.values() for c in cs)


@pytest.mark.parametrize("dynamic, s", [(False, 1), (False, 8), (True, None)])
def test_bfloat16_has_no_candidate(dynamic, s):
    facts = scan(s=s, dtypes=dict.fromkeys(DECODE_F16, "bf16"))
    with pytest.raises(LoweringUnsupported, match="bf16") as info:
        decide(facts, target("0.23.9", dynamic))
    assert all(f"{name}:" in str(info.value) for name in GDN_ORDER)


def test_every_rejection_is_logged(caplog):
    with caplog.at_level(logging.INFO, logger="gdn_fx.lowering"):
        decision = decide(scan(s=8, kda=True, scale=0.3), target("0.23.9"),
                          Choice.parse({"forbid": ["matmul"]}))
    assert decision.candidate == "scan"
    rejected = dict(decision.rejected)
    assert list(rejected) == ["matmul_step", "chunked_unrolled", "split", "chunked", "matmul",
                              "native"]
    assert "S=8" in rejected["matmul_step"] and "KDA" in rejected["chunked"]
    assert "KDA" in rejected["split"]
    assert rejected["matmul"] == "forbidden by choose" and "scale" in rejected["native"]
    messages = [r.getMessage() for r in caplog.records]
    for name, reason in decision.rejected:
        assert any(f"{name} rejected" in m and reason in m for m in messages), name


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
    assert decide(scan(), t, Choice.parse({"*": "native"})).candidate == "native"
    assert decide(scan(), t, Choice.parse({"forbid": ["matmul_step"]})).candidate == (
        "chunked_unrolled")  # one chunk of 2 serves S = 1
    assert decide(scan(), t, Choice.parse({"forbid": FAST + ["native"]})).candidate == "scan"
    assert decide(conv(), t, Choice.parse({"*": "scan"})).candidate == "portable"  # not its name
    assert decide(conv(), t, Choice.parse({"forbid": {"n": "portable"}})).candidate == "native"
    assert decide(conv(), t, Choice.parse({"*": "native"})).candidate == "native"
    node_over_op = Choice.parse({"n": "native", "gated_delta_scan": "scan"})
    assert decide(scan(), t, node_over_op).candidate == "native"
    assert decide(scan(), t, Choice.parse({"m": "scan"})).candidate == "matmul_step"  # other node


def test_forced_candidate_that_rejects_is_an_error():
    with pytest.raises(LoweringUnsupported, match="KDA"):
        decide(scan(kda=True), target("0.23.9"), Choice.parse({"*": "native"}))
    with pytest.raises(LoweringUnsupported, match="S=8"):
        decide(scan(s=8), target("0.23.9"), Choice.parse({"*": "matmul_step"}))
    with pytest.raises(LoweringUnsupported, match="forbidden"):
        decide(scan(), target("0.23.9"), Choice.parse({"forbid": FAST + ["native", "scan"]}))


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


def test_a_shape_class_preference_yields_to_choose():
    """depthwise can serve S = 1 but is not the measured default there; forcing it works."""
    facts = conv(s=1, dtype="f32")
    decision = decide(facts, target("0.23.9"))
    assert decision.candidate == "portable" and "S = 1" in dict(decision.rejected)["depthwise"]
    forced = decide(facts, target("0.23.9"), Choice.parse({"*": "depthwise"}))
    assert forced.candidate == "depthwise" and forced.forced


def test_every_candidate_is_in_the_cuda_order():
    """The CUDA order is checked against the table (at import): a candidate left out of it,
    or a name the table lacks, is an error, not a candidate never tried under CUDA."""
    from gdn_fx.errors import InternalError
    from gdn_fx.lowering.table import CUDA_ORDER, TABLE, check_orders

    check_orders(TABLE, CUDA_ORDER)
    left_out = {**CUDA_ORDER, "gated_delta_scan": CUDA_ORDER["gated_delta_scan"][1:]}
    with pytest.raises(InternalError, match="not a permutation"):
        check_orders(TABLE, left_out)
    unknown = {**CUDA_ORDER, "causal_conv1d_update": ("depthwise", "portable", "nativ")}
    with pytest.raises(InternalError, match="not a permutation"):
        check_orders(TABLE, unknown)
