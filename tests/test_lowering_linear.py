"""gated_linear_scan's lowering candidates ("matmul_step", "chunked_unrolled", "split",
"chunked", "matmul"), exported, loaded AND run by the tract Python package, and which one the table
picks for each shape and dtype.

The oracle is gdn_fx.reference.recurrent_linear_reference on float64 copies of the inputs,
never the code under test. Every input carries reset gates: in one value head a log gate of
-inf, in another -1e4 (e^-1e4 is 0 in f32 too), at the first, an inner and the last position
in turn, beside heads with ordinary gates. Shapes: G = 1 (two key heads) and G = 2 with
Dv = 1 (batch 2); per-key-channel gates for the step forms. Widths are tiny (Dk = 8) so
that the whole file stays a few seconds: exports are shared through functools.cache, and one
graph with a symbolic S runs every length on one kept tract State (each run must restart from
its own initial state: ``reset_every_turn``).
"""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import gdn_fx  # noqa: F401  (registers torch.ops.gdn_fx)
from gdn_fx import tract_check
from gdn_fx.errors import LoweringUnsupported
from gdn_fx.export import export_nnef
from gdn_fx.lowering import Target, decide
from gdn_fx.lowering.choice import Choice
from gdn_fx.lowering.node_facts import LinearFacts
from gdn_fx.lowering.table import candidate_names
from gdn_fx.reference import recurrent_linear_reference

OP = "gated_linear_scan"
LENGTHS = (1, 2, 3, 16, 100, 300)
# and whole chunk-loop iterations, where "split"'s one step takes an identity token, and one
# token past them, where it takes the last token after the chunks
SYMBOLIC_LENGTHS = LENGTHS + (64, 65, 128)
NAMES = ["q", "k", "v", "g", "s0"]
SEQ_AXES = {name: {1: "S"} for name in NAMES[:4]}
SCALE = 0.35
F16, F32, F64 = torch.float16, torch.float32, torch.float64
TOLERANCE = {F32: 1e-5, F64: 1e-10, F16: 1e-3}  # by the work dtype's narrowest operand
# name: (batch, key heads, value heads per key head, Dk, Dv, gate per key channel)
SHAPES = {"g1": (1, 2, 1, 8, 8, False), "g2_dv1": (2, 1, 2, 8, 1, False),
          "per_key": (1, 1, 2, 8, 4, True)}
SCALAR_GATE = ("g1", "g2_dv1")
CHUNKED = ("chunked_unrolled", "split", "chunked")  # one log decay per value head only


def served(candidates) -> list[tuple[str, str]]:
    """(candidate, shape) pairs, the chunked forms only on scalar gates (test_refusals)."""
    return [(c, shape) for c in candidates for shape in SHAPES
            if shape in SCALAR_GATE or c not in CHUNKED]


# The table's order, written out here (not read from the code under test).
ORDER = ("matmul_step", "chunked_unrolled", "split", "chunked", "matmul")
# the exports shared by the cached builders below, removed when the process ends
_FOLDER = tempfile.TemporaryDirectory(prefix="gdn_fx_linear_")


class Fused(nn.Module):
    """Only the fused op: its two outputs are the graph's outputs."""

    def forward(self, q, k, v, g, s0):
        return torch.ops.gdn_fx.gated_linear_scan(q, k, v, g, s0, scale=SCALE)


def inputs(shape: str, s: int, dtype=F32, state_dtype=None, seed: int = 0) -> tuple:
    """q, k, v, g, s0 of ``SHAPES[shape]`` at length ``s``, with reset gates (module
    docstring); g in f32 for f16 operands, as models keep it."""
    b, hk, groups, dk, dv, per_key = SHAPES[shape]
    hv = hk * groups
    gen = torch.Generator().manual_seed(seed * 1000 + s)

    def rnd(*size):
        return torch.randn(*size, generator=gen)

    g = -0.5 * torch.rand(b, s, hv, *([dk] if per_key else []), generator=gen)
    g[:, (seed + 1) * s // 3 % s, 0] = float("-inf")
    g[:, s - 1 - seed % s, hv - 1] = -1e4
    gate_dtype = F32 if dtype == F16 else dtype
    return (rnd(b, s, hk, dk).to(dtype), rnd(b, s, hk, dk).to(dtype),
            rnd(b, s, hv, dv).to(dtype), g.to(gate_dtype),
            (0.5 * rnd(b, hv, dk, dv)).to(state_dtype or dtype))


def oracle(args) -> tuple[torch.Tensor, torch.Tensor]:
    """The float64 recurrence on the same inputs."""
    q, k, v, g, s0 = (x.double() for x in args)
    return recurrent_linear_reference(q, k, v, g, scale=SCALE, initial_state=s0)


def check_run(model, args) -> list[float]:
    """Run in tract (a path, runnable or State), check the output dtypes (out in
    promote(q, state), the final state in the state's) and compare with the oracle."""
    got = tract_check.run(model, args)
    want_dtypes = [torch.promote_types(args[0].dtype, args[4].dtype), args[4].dtype]
    for out, dtype in zip(got, want_dtypes):
        assert out.dtype == torch.empty(0, dtype=dtype).numpy().dtype
    errors = [tract_check.relative_error(g, w) for g, w in zip(got, oracle(args))]
    assert all(np.isfinite(e) for e in errors), errors
    assert max(errors) <= TOLERANCE[min(args[0].dtype, args[4].dtype, key=_width)], errors
    return errors


def _width(dtype: torch.dtype) -> int:
    return torch.finfo(dtype).bits


@functools.cache
def program(shape: str, s: int, dtype=F32, state_dtype=None) -> torch.export.ExportedProgram:
    return torch.export.export(Fused(), inputs(shape, s, dtype, state_dtype))


@functools.cache
def written(candidate: str, shape: str, s: int, dynamic: bool = False, dtype=F32,
            state_dtype=None) -> Path:
    """The NNEF of one forced candidate (exported once per run), its decision checked."""
    name = f"{candidate}_{shape}_{s}_{dynamic}_{dtype}_{state_dtype}.nnef".replace("torch.", "")
    path = export_nnef(program(shape, s, dtype, state_dtype), Path(_FOLDER.name) / name,
                       choose={OP: candidate}, input_names=NAMES,
                       dynamic_axes=SEQ_AXES if dynamic else None)
    assert tract_check.read_decisions(path) == {OP: candidate}
    return path


# --- every candidate against the float64 recurrence, S = 1, 2, 3, 16, 100, 300 -------------

@pytest.mark.parametrize("candidate, shape", served(["split", "chunked", "matmul"]))
def test_symbolic_graph_at_every_length(candidate, shape):
    """ONE graph with a symbolic S (traced at S = 4) at every length, on ONE kept State."""
    path = written(candidate, shape, 4, dynamic=True)
    text = tract_check.nnef_text(path)
    assert "tract_symbol S" in text and "reset_every_turn = 1" in text
    state = tract_check.load(path).spawn_state()
    for s in SYMBOLIC_LENGTHS:
        print(candidate, shape, s, check_run(state, inputs(shape, s, seed=s % 3)))


@pytest.mark.parametrize("shape", SCALAR_GATE)
@pytest.mark.parametrize("s", LENGTHS)
def test_unrolled_chunks_static_lengths(s, shape):
    path = written("chunked_unrolled", shape, s)
    assert "tract_core_scan" not in tract_check.nnef_text(path)
    print(s, shape, check_run(path, inputs(shape, s)))


@pytest.mark.parametrize("candidate, shape", served(["matmul_step", "chunked", "matmul"]))
def test_static_length_one_and_three(candidate, shape):
    """The static graphs of the loops (and the one step at S = 1)."""
    for s in (1,) if candidate == "matmul_step" else (1, 3):
        path = written(candidate, shape, s)
        text = tract_check.nnef_text(path)
        assert ("tract_core_scan" in text) == (candidate != "matmul_step")
        print(candidate, shape, s, check_run(path, inputs(shape, s)))


# --- dtypes ---------------------------------------------------------------------------------

# (candidate, shape, S, operand dtype, state dtype)
DTYPES = [("matmul_step", "g1", 1, F16, F16), ("matmul", "per_key", 5, F16, F32),
          ("chunked", "g2_dv1", 40, F16, F32), ("chunked_unrolled", "g1", 7, F16, F16),
          ("chunked", "g1", 33, F64, F64), ("matmul", "g2_dv1", 6, F32, F64),
          ("split", "g1", 65, F16, F32), ("split", "g2_dv1", 64, F64, F64)]


@pytest.mark.parametrize("candidate, shape, s, dtype, state_dtype", DTYPES)
def test_dtypes(candidate, shape, s, dtype, state_dtype):
    path = written(candidate, shape, s, dtype=dtype, state_dtype=state_dtype)
    print(candidate, dtype, state_dtype,
          check_run(path, inputs(shape, s, dtype=dtype, state_dtype=state_dtype)))


# --- which candidate the table picks --------------------------------------------------------

def facts(b=1, s=1, hk=1, groups=24, dk=128, dv=64, per_key=False, dtype="f32",
          state="f32") -> LinearFacts:
    hv = hk * groups
    shapes = dict(q=(b, s, hk, dk), k=(b, s, hk, dk), v=(b, s, hv, dv),
                  g=(b, s, hv, dk) if per_key else (b, s, hv), initial_state=(b, hv, dk, dv))
    dtypes = dict(q=dtype, k=dtype, v=dtype, g="f32" if dtype == "f16" else dtype,
                  initial_state=state)
    return LinearFacts("n", shapes, dtypes, 1.0)


def target(dynamic: bool = False, runtime: str = "cpu", decodes: bool = True) -> Target:
    return Target.parse("0.23.9", dynamic, runtime, serves_decode=decodes)


# (facts, target, expected candidate), from the candidates' documented rules and the order
# measured by bench/bench_linear_scan.py (docs/lowering.md)
CHOICES = [
    (facts(), target(), "matmul_step"),  # decode
    (facts(dtype="f16", state="f16"), target(), "matmul_step"),
    (facts(s=1, per_key=True, groups=1536, dk=16, dv=1), target(), "matmul_step"),  # Mamba1
    (facts(s=1), target(dynamic=True), "split"),  # traced at S = 1, but S is symbolic
    (facts(s=64), target(), "chunked_unrolled"),
    (facts(s=1024, b=2, dtype="f64", state="f64"), target(), "chunked_unrolled"),
    (facts(s=1025), target(), "chunked"),  # 17 chunks: the loop
    (facts(s=None), target(), "split"),
    (facts(s=None), target(dynamic=True, decodes=False), "chunked"),  # a pair's main graph
    (facts(s=64, per_key=True), target(), "matmul"),  # GLA, Mamba1
    (facts(s=None, per_key=True), target(dynamic=True), "matmul"),
    (facts(s=512), target(runtime="cuda"), "chunked_unrolled"),  # no loop: stays on the GPU
    # demoted, but nothing else serves it ("split" is no choice under CUDA: not measured)
    (facts(s=None), target(dynamic=True, runtime="cuda"), "chunked"),
]


@pytest.mark.parametrize("node, where, expected", CHOICES)
def test_candidate_table(node, where, expected):
    decision = decide(node, where)
    print(decision)
    assert decision.candidate == expected
    if where.runtime == "cpu":  # every candidate ahead of the winner tried and rejected
        assert [name for name, _ in decision.rejected] == list(ORDER[:ORDER.index(expected)])


def test_table_order():
    assert candidate_names()[OP] == ORDER


def test_refusals():
    """Every candidate refuses bfloat16 (named in the error); the chunked forms refuse a
    gate per key channel, and a forced candidate that refuses is an error."""
    cpu = target()
    with pytest.raises(LoweringUnsupported, match="bf16") as info:
        decide(facts(s=8, dtype="bf16"), cpu)
    assert all(f"{name}:" in str(info.value) for name in ORDER)
    rejected = dict(decide(facts(s=8, per_key=True), cpu).rejected)
    assert all("key channel" in rejected[name] for name in ("chunked_unrolled", "split",
                                                            "chunked"))
    with pytest.raises(LoweringUnsupported, match="key channel"):
        decide(facts(s=8, per_key=True), cpu, Choice.parse({OP: "chunked"}))
    with pytest.raises(LoweringUnsupported, match="S=8"):
        decide(facts(s=8), cpu, Choice.parse({OP: "matmul_step"}))


def test_default_export_records_its_choice(tmp_path):
    """Without ``choose`` a static prefill takes the unrolled chunks, end to end."""
    path = export_nnef(program("g1", 16), tmp_path / "auto.nnef", input_names=NAMES)
    assert tract_check.read_decisions(path) == {OP: "chunked_unrolled"}
    check_run(path, inputs("g1", 16))
