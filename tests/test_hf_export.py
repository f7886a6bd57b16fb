"""gdn_fx.hf.DecodeStep under torch.export: every family, decode and recurrent prefill."""


import pytest
import torch

from gdn_fx.hf import DecodeStep
from gdn_fx.hf.configs import families
from programs import max_rel, tiny

pytestmark = pytest.mark.slow  # whole-model exports; they still run by default


model = tiny
STEPPED = families(steps=True)  # DecodeStep runs them (not qwen4_exp)


def export_and_check(step, args, strict=False):
    ep = torch.export.export(step, args, strict=strict)
    assert len(ep.graph_signature.user_inputs) == len(step.input_names)
    assert len(ep.graph_signature.user_outputs) == len(step.output_names)
    # Inputs are cloned into the cache: the program mutates none of its inputs.
    assert not ep.graph_signature.user_inputs_to_mutate
    assert max_rel(ep.module()(*args), step.eager(*args)) <= 1e-6
    return ep


@pytest.mark.parametrize("name", STEPPED)
def test_export_decode_step(name):
    step = DecodeStep(model(name))
    export_and_check(step, step.example_inputs(seq_len=1, past_len=4))


@pytest.mark.parametrize("name", STEPPED)
def test_export_recurrent_prefill_step(name):
    step = DecodeStep(model(name), rule="recurrent")
    export_and_check(step, step.example_inputs(seq_len=8, past_len=4, source="random"))


@pytest.mark.parametrize("name,rule,seq_len", [("lfm2", "auto", 1),
                                               ("olmo_hybrid", "recurrent", 8)])
def test_export_strict(name, rule, seq_len):
    step = DecodeStep(model(name), rule=rule)
    export_and_check(step, step.example_inputs(seq_len=seq_len), strict=True)


def test_run_decompositions():
    step = DecodeStep(model("olmo_hybrid"), rule="recurrent")
    args = step.example_inputs(seq_len=3)
    core = torch.export.export(step, args).run_decompositions()
    assert max_rel(core.module()(*args), step.eager(*args)) < 1e-6


def test_recurrent_prefill_unrolls_per_token():
    """Each extra token adds the same nodes: the loop the collapse pass folds into one op."""
    def nodes(seq_len):
        step = DecodeStep(model("olmo_hybrid"), rule="recurrent")
        return len(torch.export.export(step, step.example_inputs(seq_len=seq_len)).graph.nodes)

    two, three, four = nodes(2), nodes(3), nodes(4)
    assert four - three == three - two > 0
