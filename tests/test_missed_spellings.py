"""Faithful loops that no rule used to see (issue 61, item 3): each fuses, or says why.

transformers' recurrent rule (``torch_recurrent_gated_delta_rule``), its position reads
spelled each way torch keeps a view in some IR (``narrow``, ``tensor_split``,
``index_select`` and ``x[:, :, [i]]`` with a literal index tensor), wrapped in ``torch.no_grad()``
or a disabled ``torch.autocast`` inside forward (the training IR keeps a higher-order wrapper
node there), exported with a symbolic batch (and heads) over a static length, or traced by
``make_fx(tracing_mode="symbolic")``. In every IR form each fuses to one gated_delta_scan and
the collapsed program computes what the module does, also at a batch it was not traced at.
Where a rule cannot (an enabled autocast region in the training IR, the chunked rule on a
symbolic batch, a step whose meaning changes with the batch), a near-miss says why in words.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

import gdn_fx
from chunk_spellings import SPELLINGS as CHUNK_SPELLINGS
from spellings import BmmMerged, PlainLoop, standard_inputs
from tensors import FORMS, clone, flat, in_form

TOL = 1e-5
SIZES = dict(b=2, t=3, h=4, dk=5, dv=6)  # all different: make_fx's symbols stay apart
inputs = standard_inputs(**SIZES, seed=61)
wider = standard_inputs(**{**SIZES, "b": 3, "h": 5}, seed=62)  # other batch and heads
wider_batch = standard_inputs(**{**SIZES, "b": 3}, seed=63)


def hf_recurrent(query, key, value, g, beta, initial_state, prepare, read):
    """transformers' torch_recurrent_gated_delta_rule (qwen3_next), as it writes it, with
    each tensor walked as ``read(prepare(x), i)`` ([B, H, T, ..] -> [B, H, ..])."""
    query, key, value, beta, g = [x.transpose(1, 2).contiguous().to(torch.float32)
                                  for x in (query, key, value, beta, g)]
    batch_size, num_heads, sequence_length, k_head_dim = key.shape
    v_head_dim = value.shape[-1]
    query = query * (1 / (query.shape[-1] ** 0.5))
    core_attn_out = torch.zeros(batch_size, num_heads, sequence_length, v_head_dim).to(value)
    last_recurrent_state = initial_state.to(value)
    query, key, value, g, beta = map(prepare, (query, key, value, g, beta))
    for i in range(sequence_length):
        q_t, k_t, v_t = read(query, i), read(key, i), read(value, i)
        g_t = read(g, i).exp().unsqueeze(-1).unsqueeze(-1)
        beta_t = read(beta, i).unsqueeze(-1)
        last_recurrent_state = last_recurrent_state * g_t
        kv_mem = (last_recurrent_state * k_t.unsqueeze(-1)).sum(dim=-2)
        delta = (v_t - kv_mem) * beta_t
        last_recurrent_state = last_recurrent_state + k_t.unsqueeze(-1) * delta.unsqueeze(-2)
        core_attn_out[:, :, i] = (last_recurrent_state * q_t.unsqueeze(-1)).sum(dim=-2)
    return core_attn_out.transpose(1, 2).contiguous(), last_recurrent_state


def _same(x):
    return x


READS = {  # name -> (prepare, read)
    "select": (_same, lambda x, i: x[:, :, i]),
    "narrow": (_same, lambda x, i: x.narrow(2, i, 1).squeeze(2)),
    "tensor_split": (lambda x: x.tensor_split(x.shape[2], dim=2), lambda p, i: p[i].squeeze(2)),
    "index_select": (_same, lambda x, i: x.index_select(2, torch.tensor([i])).squeeze(2)),
    "index_tensor": (_same, lambda x, i: x[:, :, torch.tensor([i])].squeeze(2)),
}


class HFStyle(nn.Module):
    """transformers' recurrent rule with its reads spelled as ``READS[reads]``."""

    def __init__(self, reads: str = "select"):
        super().__init__()
        self.prepare, self.read = READS[reads]

    def forward(self, q, k, v, g, beta, s0):
        return hf_recurrent(q, k, v, g, beta, s0, self.prepare, self.read)


class NoGradInForward(HFStyle):
    """``with torch.no_grad():`` around the rule, inside forward."""

    def forward(self, q, k, v, g, beta, s0):
        with torch.no_grad():
            return super().forward(q, k, v, g, beta, s0)


class AutocastOffInForward(HFStyle):
    """A disabled autocast region around the rule (models keep one around their f32 math)."""

    def forward(self, q, k, v, g, beta, s0):
        with torch.autocast("cpu", enabled=False):
            return super().forward(q, k, v, g, beta, s0)


class AutocastOnInForward(HFStyle):
    """An enabled bf16 autocast region: its dtypes are chosen when it runs."""

    def forward(self, q, k, v, g, beta, s0):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return super().forward(q, k, v, g, beta, s0)


class OutputOverBatch(PlainLoop):
    """The rule with each output divided by the batch size: a scale that only holds at the
    traced batch, so a symbolic batch must not fuse it."""

    def forward(self, q, k, v, g, beta, s0):
        S, out = s0, torch.zeros_like(v)
        for t in range(q.shape[1]):
            S, o = self.step(S, q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t])
            out[:, t] = o / q.shape[0]
        return out, S


MODULES = {"no_grad": NoGradInForward, "autocast_off": AutocastOffInForward,
           "autocast_on": AutocastOnInForward, "bmm_merged": BmmMerged,
           "output_over_batch": OutputOverBatch,
           **{f"reads_{name}": functools.partial(HFStyle, name) for name in READS}}


# --- helpers -------------------------------------------------------------------------------

def dynamic(args: tuple, heads: bool) -> tuple:
    """dynamic_shapes: the batch of every input symbolic (and the heads, when ``heads``)."""
    batch, head = torch.export.Dim("batch", min=2), torch.export.Dim("heads", min=2)
    spec = [{0: batch, 2: head} if heads else {0: batch} for _ in args[:5]]
    return tuple(spec + [{0: batch, 1: head} if heads else {0: batch}])


@functools.cache
def exported(name: str, symbolic: str = ""):
    """(module, training-IR ExportedProgram); ``symbolic``: '', 'batch' or 'batch_heads'."""
    torch.manual_seed(0)
    module = MODULES[name]()
    shapes = dynamic(inputs(), symbolic == "batch_heads") if symbolic else None
    return module, torch.export.export(module, clone(inputs()), dynamic_shapes=shapes)


def assert_computes(program, module, *argsets) -> None:
    """``program`` (an ExportedProgram or GraphModule) computes what ``module`` does."""
    run = program.module() if isinstance(program, torch.export.ExportedProgram) else program
    for args in argsets:
        want, got = flat(module(*clone(args))), flat(run(*clone(args)))
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert g.shape == w.shape
            torch.testing.assert_close(g, w, rtol=TOL, atol=TOL * max(w.abs().max().item(), 1))


def fused(result) -> int:
    return result.counts.get("gated_delta_scan", 0)


# --- the spellings fuse --------------------------------------------------------------------

@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("name", ["reads_narrow", "reads_tensor_split", "reads_index_select",
                                  "reads_index_tensor", "no_grad", "autocast_off"])
def test_the_spelling_fuses_into_one_node(name, form):
    module, ep = exported(name)
    result = gdn_fx.collapse(in_form(ep, form))
    assert fused(result) == 1, result.explain()
    assert_computes(result.program, module, inputs())
    assert gdn_fx.find_unrolled(result.program) == []


def test_an_unfused_wrapped_loop_is_reported_by_find_unrolled():
    _, ep = exported("no_grad")
    assert gdn_fx.find_unrolled(ep), "the loop inside the no_grad wrapper is not seen"


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("name,symbolic", [("reads_select", "batch"), ("reads_narrow", "batch"),
                                           ("reads_select", "batch_heads"),
                                           ("bmm_merged", "batch_heads")])
def test_a_symbolic_batch_over_a_static_length_fuses(name, symbolic, form):
    module, ep = exported(name, symbolic)
    ranges = dict(ep.range_constraints)
    result = gdn_fx.collapse(in_form(ep, form))
    assert fused(result) == 1, result.explain()
    other = wider() if symbolic == "batch_heads" else wider_batch()  # sizes not traced
    assert_computes(result.program, module, inputs(), other)
    assert dict(ep.range_constraints) == ranges  # the pass narrowed no size


@pytest.mark.parametrize("name", ["reads_select", "bmm_merged"])
def test_a_make_fx_symbolic_trace_fuses(name):
    module = MODULES[name]()
    gm = make_fx(module, tracing_mode="symbolic")(*clone(inputs()))
    result = gdn_fx.collapse(gm)
    assert fused(result) == 1, result.explain()
    assert_computes(result.program, module, inputs(), wider())


# --- where a rule cannot, a near-miss in words ------------------------------------------------

@pytest.mark.parametrize("form", FORMS)
def test_an_enabled_autocast_region_is_named_in_the_training_ir(form):
    """The decompositions spell its casts out and it fuses there; the training IR keeps it
    as one wrapper whose dtypes are chosen at run time, and a near-miss says so."""
    module, ep = exported("autocast_on")
    result = gdn_fx.collapse(in_form(ep, form))
    assert_computes(result.program, module, inputs())
    if form != "training":
        assert fused(result) == 1, result.explain()
        return
    assert fused(result) == 0
    text = result.explain()
    assert "torch.autocast('cpu', torch.bfloat16) region" in text, text
    assert "unrolled 3-step loop" in text and "no rule looks inside it" in text, text


@pytest.mark.parametrize("form", FORMS)
def test_a_step_whose_meaning_changes_with_the_batch_does_not_fuse(form):
    module, ep = exported("output_over_batch", "batch")
    result = gdn_fx.collapse(in_form(ep, form))
    assert fused(result) == 0, result.explain()
    text = result.explain()
    assert "is the delta rule at the traced sizes" in text, text
    assert "its output scale there is 0.333333, not 0.5" in text, text
    assert_computes(result.program, module, inputs())


def test_the_chunked_rule_on_a_symbolic_batch_says_why_in_words():
    spelling = next(s for s in CHUNK_SPELLINGS if s.name == "fla_chunk_gdn_one_chunk")
    module, args = spelling.module(), spelling.inputs()
    batch = torch.export.Dim("batch", min=2)
    ep = torch.export.export(module, clone(args),
                             dynamic_shapes=tuple({0: batch} for _ in args))
    result = gdn_fx.collapse(ep)
    chunked = [str(m) for m in result.misses if "chunked form by meaning" in str(m)]
    assert chunked, result.explain()
    assert "has the symbolic size" in chunked[0] and "static sizes only" in chunked[0], chunked
    assert not any("SymIntArrayRef" in str(m) for m in result.misses), result.explain()
