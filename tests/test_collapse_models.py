"""Whole transformers hybrids, exported as they stand: every linear-attention layer collapses.

Decode steps (recurrent rule, conv update) in the IR forms a user can hand over, and prefill
steps (the chunked rule and the padded prefill conv) at one and several chunks. The prefill
steps trace the family's model with one layer of each kind (``one_of_each``: a linear layer's
chunk loop is ~1000 nodes a chunk, and every linear layer of a family is the same code).
"""

from __future__ import annotations

import pytest
import torch

import gdn_fx
from gdn_fx import tract_check
from gdn_fx.hf import DecodeStep, tiny_model
from gdn_fx.hf.configs import families, one_of_each
from programs import assert_close_outputs, count_calls, decode_fusions, run, unknown_misses

pytestmark = pytest.mark.slow  # whole-model exports (make test-fast skips them)

DECODE = families(steps=True)  # every family's decode step that DecodeStep runs collapses


def collapsed(family, seq_len, form="training", rule="auto"):
    overrides = one_of_each(family) if seq_len > 1 else {}
    step = DecodeStep(tiny_model(family, **overrides), rule=rule)
    args = step.example_inputs(seq_len=seq_len)
    program = torch.export.export(step, args, strict=False)
    if form == "core":
        program = program.run_decompositions()
    result = gdn_fx.collapse(program)
    want = decode_fusions(family, step) if seq_len == 1 else step.expected_fusions
    assert {op: result.counts.get(op, 0) for op in want} == want, result.explain()
    assert unknown_misses(family, result.misses) == [], result.explain()
    assert gdn_fx.find_unrolled(result.program) == []
    assert_close_outputs(run(result.program, args), run(program, args), rtol=1e-5)
    return step, args, program, result


@pytest.mark.parametrize("family", DECODE)
def test_decode_steps_collapse(family):
    collapsed(family, 1)


@pytest.mark.parametrize("family", ["qwen3_5", "kimi_linear"])
def test_decode_steps_collapse_in_core_aten(family):
    collapsed(family, 1, form="core")


@pytest.mark.parametrize("seq_len", [8, 70, 130])  # one chunk, two and a pad, three
@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next", "olmo_hybrid", "kimi_linear"])
def test_prefill_steps_collapse(family, seq_len):
    step, _, program, result = collapsed(family, seq_len)
    before, after = count_calls(program), count_calls(result.program)
    assert before - after > 700 * step.expected_fusions["gated_delta_scan"], (before, after)


@pytest.mark.parametrize("family", ["qwen3_5_moe", "lara_mini", "bailing_hybrid", "glm5_next"])
def test_prefill_of_the_other_families_collapses(family):
    """Same chunked rules inside other blocks (MoE, sliding window, other KDA hybrids)."""
    step, _, program, result = collapsed(family, 70)
    before, after = count_calls(program), count_calls(result.program)
    assert before - after > 700 * step.expected_fusions["gated_delta_scan"], (before, after)


def test_chunked_prefill_runs_in_tract(tmp_path):
    step, args, _, result = collapsed("qwen3_5", 70)
    path = gdn_fx.export_nnef(result.program, tmp_path / "prefill.nnef.tgz",
                              input_names=step.input_names, output_names=step.output_names)
    found = tract_check.compare(path, step.eager(*args), args)
    assert found.ok, str(found)
