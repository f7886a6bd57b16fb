"""The conv-update rule: transformers' causal conv1d update collapses into one fused node.

Oracles are independent of the rule: transformers' own ``causal_conv1d_update``,
``causal_conv1d_fn`` and ``LinearAttentionLayer.update_conv_state`` run eagerly, and the
un-collapsed program run on the same inputs. Outputs agree to 1e-6 relative in f32; states
are compared bit for bit.
"""

from __future__ import annotations

import operator
from collections import Counter

import pytest
import torch
from torch import nn
from torch.export import Dim
from torch.fx.experimental.proxy_tensor import make_fx
from transformers.cache_utils import LinearAttentionLayer
from transformers.models.qwen3_5.modeling_qwen3_5 import causal_conv1d_fn as hf_conv_fn
from transformers.models.qwen3_5.modeling_qwen3_5 import causal_conv1d_update as hf_update

from gdn_fx import passes
from gdn_fx.passes.conv_meaning import NAME, find_conv_updates
from gdn_fx.passes.program import graph_module_of

FUSED = torch.ops.gdn_fx.causal_conv1d_update.default
CONV_TARGETS = (torch.ops.aten.conv1d.default, torch.ops.aten.convolution.default)
B, C, K = 2, 6, 4
FORMS = ("training", "functional", "core", "make_fx")
ATEN = torch.ops.aten
FEEDS = (ATEN.cat.default, ATEN.pad.default, ATEN.constant_pad_nd.default)
WRITES = (ATEN.copy_.default, ATEN.copy.default)
HALF_TOL = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


# --- the modules: transformers' functions, called the way the models call them -----------

class Update(nn.Module):
    """causal_conv1d_update with the state as a mutated input, a buffer, or a returned clone."""

    def __init__(self, holder="input", bias=True, activation="silu", dtype=torch.float32,
                 groups=C, padding=0, out_slice=None):
        super().__init__()
        # the models' conv module pads K-1 for prefill; the update itself convolves with padding
        self.conv = nn.Conv1d(C, C, K, groups=groups, padding=K - 1, bias=bias).to(dtype)
        self.holder, self.activation, self.out_slice = holder, activation, out_slice
        self.padding = padding
        if holder == "buffer":
            self.register_buffer("state", torch.randn(B, C, K, generator=_gen(1)).to(dtype))

    def forward(self, x, state=None):
        if self.holder == "buffer":
            state = self.state
        elif self.holder == "clone":
            state = state.clone()
        if self.out_slice is None and self.padding == 0 and self.conv.groups == C:
            out = hf_update(x, state, self.conv.weight.squeeze(1), self.conv.bias,
                            self.activation)
        else:
            out = _variant_update(x, state, self.conv, self.padding, self.out_slice)
        return (out, state) if self.holder == "clone" else out


def _variant_update(x, state, conv, padding, out_slice):
    """HF's update with one thing changed: the conv's groups or padding, or the kept slice."""
    full = torch.cat([state, x], dim=-1).to(conv.weight.dtype)
    state.copy_(full[:, :, -state.shape[-1]:])
    out = nn.functional.conv1d(full, conv.weight, conv.bias, padding=padding, groups=conv.groups)
    seq = x.shape[-1]
    out = out[:, :, -seq:] if out_slice is None else out[:, :, out_slice(seq)]
    return nn.functional.silu(out).to(x.dtype)


class Prefill(nn.Module):
    """The prefill path of the models: LinearAttentionLayer.update_conv_state, causal_conv1d_fn,
    then the last-S slice. ``fresh``: a new cache (zero history) that returns its state."""

    def __init__(self, fresh=False, bias=True, activation="silu", dtype=torch.float32,
                 padding_delta=0):
        super().__init__()
        self.conv = nn.Conv1d(C, C, K, groups=C, padding=K - 1, bias=bias).to(dtype)
        self.fresh, self.activation, self.padding_delta = fresh, activation, padding_delta

    def forward(self, x, state=None):
        layer = LinearAttentionLayer()
        if not self.fresh:
            layer.conv_states[0], layer.conv_kernel_size[0] = state, K
            layer.is_conv_states_initialized[0] = layer.has_previous_state[0] = True
        full = layer.update_conv_state(x, 0, conv_kernel_size=K)
        weight = self.conv.weight.squeeze(1)
        if self.padding_delta:
            out = nn.functional.conv1d(full.to(weight.dtype), weight.unsqueeze(1), self.conv.bias,
                                       padding=K - 1 + self.padding_delta, groups=C)
            out = nn.functional.silu(out[:, :, :full.shape[-1]]).to(x.dtype)
        else:
            out = hf_conv_fn(full, weight, self.conv.bias, activation=self.activation)
        out = out[:, :, -x.shape[-1]:]
        return (out, layer.conv_states[0]) if self.fresh else out


class BufferFromZero(nn.Module):
    """A buffer-held state written by a prefill that ignores it (zero history, like a fresh
    cache): the fused node then needs a zero state the graph does not hold."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(C, C, K, groups=C, padding=K - 1)
        self.register_buffer("state", torch.randn(B, C, K, generator=_gen(2)))

    def forward(self, x):
        seq = x.shape[-1]
        full = nn.functional.pad(x, (K - seq, 0)) if seq < K else x
        self.state.copy_(full[:, :, -K:])
        return hf_conv_fn(full, self.conv.weight.squeeze(1), self.conv.bias, "silu")[:, :, -seq:]


class IntoInput(nn.Module):
    """A prefill from zero history (S >= K, no pad) that writes its state into an input."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(C, C, K, groups=C, padding=K - 1)

    def forward(self, x, state):
        state.copy_(x[:, :, -K:])
        out = hf_conv_fn(x, self.conv.weight.squeeze(1), self.conv.bias, "silu")
        return out[:, :, -x.shape[-1]:]


class Stateless(nn.Module):
    """causal_conv1d_fn with no cache: a causal conv, but no update (left alone, no miss)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(C, C, K, groups=C, padding=K - 1)

    def forward(self, x):
        return hf_conv_fn(x, self.conv.weight.squeeze(1), self.conv.bias, "silu")


# --- helpers ---------------------------------------------------------------------------------

def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _inputs(module: nn.Module, seq: int, dtype=torch.float32, state_width=K, seed=0):
    gen = _gen(seed)
    x = torch.randn(B, C, seq, generator=gen).to(dtype)
    if getattr(module, "holder", None) == "buffer" or getattr(module, "fresh", False) \
            or isinstance(module, (BufferFromZero, Stateless)):
        return (x,)
    return x, torch.randn(B, C, state_width, generator=gen).to(dtype)


def _export(module: nn.Module, args: tuple, form: str, **kwargs):
    if form == "make_fx":
        params = dict(module.named_parameters())
        return make_fx(lambda *a: torch.func.functional_call(module, params, a))(*args)
    ep = torch.export.export(module, args, **kwargs)
    if form == "functional":
        return ep.run_decompositions({})
    if form == "core":
        return ep.run_decompositions()
    return ep


def collapse_conv(program):
    """(collapsed program, conv fusions, conv near-misses) through ``gdn_fx.passes.collapse``."""
    result = passes.collapse(program)
    misses = [m for m in result.misses if m.rule == NAME]
    return result.program, result.counts[NAME], misses


def _graph(program):
    return graph_module_of(program)[0].graph


def _targets(program) -> Counter:
    return Counter(n.target for n in _graph(program).nodes if n.op == "call_function")


def _count(program, targets) -> int:
    return sum(1 for n in _graph(program).nodes if n.target in targets)


def _callable(program, buffers):
    """A callable running the program, its buffers set to ``buffers`` first (an exported
    program's module shares its buffers with the eager module it came from)."""
    module = program.module() if isinstance(program, torch.export.ExportedProgram) else program
    if not buffers:
        return module, {}
    with torch.no_grad():
        for name, value in buffers.items():
            module.get_buffer(name).copy_(value)
    return module, dict(module.named_buffers())


def _run(program, args, buffers):
    """(outputs, inputs after the call, buffers after the call), on private copies."""
    args = tuple(a.clone() for a in args)
    module, live = _callable(program, buffers)
    with torch.no_grad():
        out = module(*args)
    out = out if isinstance(out, (tuple, list)) else (out,)
    return list(out), list(args), {k: v.clone() for k, v in live.items()}


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def _assert_same(got, want, dtype=torch.float32):
    """Outputs to 1e-6 relative (f32) or a few half ulps; states bit for bit."""
    outs, args, bufs = got
    outs_w, args_w, bufs_w = want
    assert len(outs) == len(outs_w)
    for index, (g, w) in enumerate(zip(outs, outs_w)):
        assert g.shape == w.shape and g.dtype == w.dtype
        if index:  # every module here returns (out, *states)
            assert torch.equal(g, w), "a returned state differs"
        else:
            assert _rel(g, w) <= HALF_TOL.get(dtype, 1e-6)
    for g, w in zip(args + list(bufs.values()), args_w + list(bufs_w.values())):
        assert torch.equal(g, w), "a state differs"


def _check_collapse(module, args, form, dtype=torch.float32, program=None):
    """Collapse, then check count, leftovers, signature, numerics vs eager and vs original."""
    program = program if program is not None else _export(module, args, form)
    before = _targets(program)
    new, fused, misses = collapse_conv(program)
    assert fused == 1 and not misses, misses
    assert _count(new, CONV_TARGETS) == 0 and _count(new, (FUSED,)) == 1
    assert _count(new, FEEDS) == 0, "the state write still reads the region"
    _assert_writes_read_new_state(new)
    assert _targets(program) == before, "the input program was modified"
    buffers = {k: v.clone() for k, v in module.named_buffers()}
    want = _run(program, args, buffers)
    got = _run(new, args, buffers)
    _assert_same(got, want, dtype)
    _assert_same(got, _run(module, args, buffers), dtype)  # transformers' functions, eager
    if isinstance(program, torch.export.ExportedProgram):
        assert _kinds(new) == _kinds(program)
    return new


def _assert_writes_read_new_state(program) -> None:
    """Every state write (copy, copy_, buffer-mutation output) reads the fused new_state."""
    graph = _graph(program)
    written = [n.args[1] for n in graph.nodes if n.target in WRITES]
    if isinstance(program, torch.export.ExportedProgram):
        outputs = list(graph.output_node().args[0])
        kinds = [spec.kind.name for spec in program.graph_signature.output_specs]
        written += [o for o, kind in zip(outputs, kinds) if kind == "BUFFER_MUTATION"]
    assert written
    for node in written:
        assert node.target is operator.getitem and node.args[0].target is FUSED
        assert node.args[1] == 1


def _kinds(ep) -> tuple:
    sig = ep.graph_signature
    return ([(s.kind, s.target) for s in sig.input_specs],
            [(s.kind, s.target) for s in sig.output_specs])


# --- the update: every form, holder and option --------------------------------------------

# make_fx traces a functional_call, which sees buffers as plain inputs: no buffer form there
HOLDERS = [(form, holder) for form in FORMS for holder in ("input", "buffer", "clone")
           if (form, holder) != ("make_fx", "buffer")]


@pytest.mark.parametrize("form, holder", HOLDERS)
def test_update_collapses_in_every_form(form, holder):
    module = Update(holder)
    _check_collapse(module, _inputs(module, 3), form)


# every dtype with and without bias, with and without SiLU, across the forms (pairwise)
OPTIONS = [(True, "silu", torch.float32, "training"), (False, None, torch.float32, "core"),
           (True, None, torch.float16, "functional"), (False, "silu", torch.float16, "core"),
           (True, "silu", torch.bfloat16, "make_fx"), (False, None, torch.bfloat16, "training"),
           (False, "silu", torch.bfloat16, "core")]


@pytest.mark.parametrize("bias, activation, dtype, form", OPTIONS)
def test_update_options(bias, activation, dtype, form):
    module = Update(bias=bias, activation=activation, dtype=dtype)
    new = _check_collapse(module, _inputs(module, 3, dtype), form, dtype)
    node = next(n for n in _graph(new).nodes if n.target is FUSED)
    assert node.args[4] == activation and (node.args[3] is None) == (not bias)


@pytest.mark.parametrize("seq", [1, 2, 4, 5, 17, 64])
def test_update_every_static_length(seq):
    module = Update()
    form = "core" if seq % 2 else "training"
    _check_collapse(module, _inputs(module, seq), form)


@pytest.mark.parametrize("x_dtype", [torch.float16, torch.bfloat16])
def test_update_half_activations_f32_weights(x_dtype):
    """HF casts cat(state, x) to the weight's dtype and the output back to x's dtype; the state
    is written from the f32 concatenation into the half state (exact round trip)."""
    module = Update()  # f32 weights
    x, state = _inputs(module, 3, x_dtype)
    _check_collapse(module, (x, state), "training", x_dtype)
    _check_collapse(module, (x, state), "core", x_dtype)


def test_update_half_weights_f32_activations():
    """The update writes the state after the cast to bf16: the op does the same, bit for bit."""
    module = Update(dtype=torch.bfloat16)
    _check_collapse(module, _inputs(module, 3), "core", torch.bfloat16)


SEQ = Dim("S", min=K + 1, max=128)  # S = K would specialize HF's own shape checks
DYNAMIC = {  # case -> (module, dynamic shapes, (batch, S) to run at)
    "update": (Update, {"x": {2: SEQ}, "state": None}, [(B, n) for n in (5, 6, 40, 128)]),
    "prefill": (Prefill, {"x": {2: SEQ}, "state": None}, [(B, n) for n in (5, 9, 128)]),
    "zero history, dynamic batch": (IntoInput, {"x": {0: Dim("B", max=8), 2: SEQ},
                                                "state": {0: Dim("B", max=8)}},
                                    [(1, 5), (3, 9), (8, 33)]),
}


@pytest.mark.parametrize("case, form", [("update", "training"), ("update", "core"),
                                        ("prefill", "functional"),
                                        ("zero history, dynamic batch", "core")])
def test_dynamic_length_is_right_at_every_length(case, form):
    make, dynamic, runs = DYNAMIC[case]
    module = make()
    program = _export(module, (torch.randn(B, C, 6), torch.randn(B, C, K)), form,
                      dynamic_shapes=dynamic)
    assert find_conv_updates(_graph(program)) == []  # symbolic slices do not freeze S
    new, fused, misses = collapse_conv(program)
    assert fused == 1 and not misses and _count(new, CONV_TARGETS) == 0
    for batch, seq in runs:
        gen = _gen(seq)
        args = (torch.randn(batch, C, seq, generator=gen), torch.randn(batch, C, K, generator=gen))
        _assert_same(_run(new, args, {}), _run(module, args, {}))


class ShiftedAtOtherLengths(Update):
    """The update at the traced S = 6 only: its window starts S - 5 samples into the conv's
    output repeated twice, which is the last S only when S + 1 - S = S - 5."""

    def forward(self, x, state):
        full = torch.cat([state, x], dim=-1)
        state.copy_(full[:, :, -K:])
        out = nn.functional.conv1d(full, self.conv.weight, self.conv.bias, groups=C)
        seq = x.shape[-1]
        return nn.functional.silu(torch.cat([out, out], -1)[:, :, seq - 5:2 * seq - 5])


def test_dynamic_region_right_only_at_the_traced_length_stays():
    """Translation validation runs at the traced sizes, where this region is the update; the
    rule runs it at every length its sizes' arithmetic can change at and refuses it."""
    program = torch.export.export(ShiftedAtOtherLengths(), (torch.randn(B, C, 6),
                                                            torch.randn(B, C, K)),
                                  dynamic_shapes={"x": {2: Dim("S", min=5, max=64)},
                                                  "state": None})
    new, fused, misses = collapse_conv(program)
    assert fused == 0 and _count(new, (FUSED,)) == 0
    assert len(misses) == 1 and "not at" in misses[0].reason, misses
    assert misses[0].kind == passes.CHECK_FAILED


# --- the prefill that feeds a cache ---------------------------------------------------------

@pytest.mark.parametrize("seq, form", [(1, "training"), (1, "core"), (4, "functional"),
                                       (4, "make_fx"), (9, "training"), (9, "core")])
def test_prefill_with_state_collapses(form, seq):
    """update_conv_state's cat(state, x) + causal_conv1d_fn (padding K-1, first K+S) + last S:
    the update with the cached state."""
    module = Prefill()
    _check_collapse(module, _inputs(module, seq), form)


@pytest.mark.parametrize("seq, form", [(1, "training"), (1, "core"), (3, "make_fx"),
                                       (3, "functional"), (4, "training"), (4, "core"),
                                       (9, "functional")])  # pads 3, 1, 0, 0 zeros
def test_fresh_prefill_is_update_from_zero(form, seq):
    """A fresh cache pads x on the left to K when S < K, writes the last K samples, and the
    padded conv starts from zero history: the update with a zero conv_state."""
    module = Prefill(fresh=True)
    program = _export(module, _inputs(module, seq), form)
    new = _check_collapse(module, _inputs(module, seq), form, program=program)
    node = next(n for n in _graph(new).nodes if n.target is FUSED)
    makers = (ATEN.zeros.default, ATEN.full.default)
    assert node.args[1].target in makers  # the cache's own zero state, not a second one
    assert _count(new, makers) == _count(program, makers) == 1


@pytest.mark.parametrize("seq, form", [(2, "training"), (6, "core")])
def test_zero_history_into_a_buffer_gets_a_zero_state(form, seq):
    module = BufferFromZero()
    _check_collapse(module, _inputs(module, seq), form)


def test_prefill_options_and_half():
    for bias, activation, dtype in [(False, None, torch.float16), (True, "silu", torch.bfloat16)]:
        module = Prefill(bias=bias, activation=activation, dtype=dtype)
        _check_collapse(module, _inputs(module, 5, dtype), "functional", dtype)


# --- what changes and what does not ------------------------------------------------------------

@pytest.mark.parametrize("form", ["training", "core"])
def test_only_the_region_changes(form):
    module = Update()
    program = _export(module, _inputs(module, 3), form)
    new, _, _ = collapse_conv(program)
    before, after = _targets(program), _targets(new)
    added, removed = after - before, before - after
    assert added == Counter({FUSED: 1, operator.getitem: 2})
    region = {ATEN.cat.default, ATEN.slice.Tensor, ATEN.unsqueeze.default, ATEN.silu.default,
              ATEN.sigmoid.default, ATEN.mul.Tensor, ATEN.to.dtype,
              ATEN._assert_tensor_metadata.default, *CONV_TARGETS}
    assert set(removed) <= region and removed[ATEN.cat.default] == 1
    assert _count(new, WRITES) == _count(program, WRITES) == 1  # kept, and rewired:
    _assert_writes_read_new_state(new)


def test_training_ir_write_stays_in_place_and_mutates():
    module = Update()
    program = _export(module, _inputs(module, 2), "training")
    new, _, _ = collapse_conv(program)
    write = next(n for n in _graph(new).nodes if n.target is torch.ops.aten.copy_.default)
    assert write.args[0].op == "placeholder" and write.args[0].name == "state"
    x, state = _inputs(module, 2, seed=5)
    expected = state.clone()
    hf_update(x.clone(), expected, module.conv.weight.squeeze(1), module.conv.bias, "silu")
    with torch.no_grad():
        new.module()(x, state)
    assert torch.equal(state, expected)


# --- near-misses: left exactly as they were ---------------------------------------------------

# case -> (module, state width, S, what the near-miss says: the slip conv_meaning names)
NEAR_MISSES = {
    "non-depthwise": (lambda: Update(groups=1), K, 3, "across channels"),
    "other window": (lambda: Update(out_slice=lambda s: slice(-s - 1, -1)), K, 3,
                     "1 sample early"),
    "first window": (lambda: Update(out_slice=lambda s: slice(0, s)), K, 3, "1 sample early"),
    "padding 1": (lambda: Update(padding=1), K, 3, "1 sample late"),
    "prefill padding K": (lambda: Prefill(padding_delta=1), K, 3, "1 sample early"),
    "fresh padding K-2, S<K": (lambda: Prefill(fresh=True, padding_delta=-1), K, 3,
                               "reads samples after t"),  # reads x[t+1]: not causal
    "fresh padding K-2": (lambda: Prefill(fresh=True, padding_delta=-1), K, 5,
                          "reads samples after t"),
    # the prefill writes the f32 samples before the cast; the op would round them through bf16
    "lossy state round trip": (lambda: Prefill(dtype=torch.bfloat16), K, 3, "rounds"),
}


@pytest.mark.parametrize("case", sorted(NEAR_MISSES))
def test_near_miss_left_untouched(case):
    make, state_width, seq, reason = NEAR_MISSES[case]
    form = ("training", "core")[sorted(NEAR_MISSES).index(case) % 2]
    module = make()
    args = _inputs(module, seq, state_width=state_width)
    program = _export(module, args, form)
    code = graph_module_of(program)[0].code
    new, fused, misses = collapse_conv(program)
    assert fused == 0 and _count(new, (FUSED,)) == 0
    assert graph_module_of(new)[0].code == code
    assert len(misses) == 1 and reason in misses[0].reason, misses
    assert misses[0].node is not None and misses[0].rule == NAME
    assert misses[0].kind == passes.CHECK_FAILED  # the rule's own check, not validation
    assert len(find_conv_updates(_graph(new))) >= 1  # the exporter refuses dynamic S here


@pytest.mark.parametrize("form", ("training", "core"))
def test_state_of_k_minus_1_collapses_by_meaning(form):
    """A state of K-1 samples (mamba's convention) is no structural match but computes the
    update: conv_meaning.py fuses it (zero sample in front, sliced back). Oracle: transformers'
    causal_conv1d_update run eagerly on clones."""
    module = Update()
    x, state = _inputs(module, 3, state_width=K - 1)
    program = _export(module, (x.clone(), state.clone()), form)
    new, fused, misses = collapse_conv(program)
    assert fused == 1 and not misses and _count(new, (FUSED,)) == 1, misses
    want_state = state.clone()
    want = hf_update(x.clone(), want_state, module.conv.weight.squeeze(1), module.conv.bias,
                     "silu")
    got_state = state.clone()
    with torch.no_grad():
        got = new.module()(x.clone(), got_state)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_state, want_state, rtol=0, atol=0)


def test_stateless_causal_conv_is_not_a_candidate():
    module = Stateless()
    program = _export(module, _inputs(module, 5), "core")
    new, fused, misses = collapse_conv(program)
    assert fused == 0 and misses == [] and _count(new, CONV_TARGETS) == 1


def test_find_conv_updates_names_frozen_slices():
    module = Update()
    program = _export(module, _inputs(module, 3), "training")
    found = find_conv_updates(_graph(program))
    assert len(found) == 1 and "-3:" in found[0] and "conv1d" in found[0]
    new, _, _ = collapse_conv(program)
    assert find_conv_updates(_graph(new)) == []
    prefill = _export(Prefill(), _inputs(Prefill(), 3), "core")
    assert len(find_conv_updates(_graph(prefill))) == 2  # [:K+S] and [-S:]


# --- whole decode steps of the families that carry a conv update ---------------------------

WHOLE_MODELS = [("qwen3_5", 1), ("kimi_linear", 1), ("lfm2", 1), ("bamba", 1), ("lfm2", 3)]


@pytest.mark.slow
@pytest.mark.parametrize("family, seq", WHOLE_MODELS)
def test_every_conv_layer_of_a_decode_step_collapses(family, seq):
    """gdn_fx.hf's decode step (S = 1: HF's causal_conv1d_update; S = 3: its prefill that
    feeds the cache) loses every conv. A conv state keeps the old samples bit for bit; its new
    samples are x, which upstream layers compute to rounding."""
    hf = pytest.importorskip("gdn_fx.hf")
    step = hf.DecodeStep(hf.tiny_model(family))
    args = step.example_inputs(seq_len=seq, source="random")
    program = torch.export.export(step, args)
    layers = sum(spec.kind == "conv" for spec in step.specs)
    assert len(find_conv_updates(_graph(program))) >= layers
    new, fused, misses = collapse_conv(program)
    assert layers >= 2 and fused == layers and not misses, misses
    assert _count(new, CONV_TARGETS) == 0 and find_conv_updates(_graph(new)) == []
    got, original, eager = _run(new, args, {})[0], _run(program, args, {})[0], step.eager(*args)
    for index, spec in enumerate([None, *step.specs]):
        if spec is not None and spec.kind == "conv":
            old = args[index][..., seq:]
            assert torch.equal(got[index][..., :old.shape[-1]], old), spec.name
        assert _rel(got[index], eager[index]) <= 1e-5
        assert _rel(got[index], original[index]) <= 1e-5
