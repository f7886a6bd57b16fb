"""gdn_fx.generalize: programs exported at fixed (S, P), made one program symbolic in S and P.

The expected values are the eager models' own outputs (the hybrid model below, transformers'
model), the reify route's artifact run in tract, or integers written by hand; nothing is
computed by the code under test.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gdn_fx
from gdn_fx import tract_check
from gdn_fx.errors import GeneralizeRefused, UsageError
from gdn_fx.generalization import FAR_MIN, far_point, fit_affine
from gdn_fx.hf.configs import GENERATING
from gdn_fx.hf.configs import family as family_spec
from spellings import fla_naive_recurrent_gdn

# (S, P) never traced: decode (S = 1), a first prefill (P = 0), longer than any trace.
UNTRACED = [(1, 0), (1, 5), (2, 3), (4, 0), (7, 11), (16, 2)]


def naive_gdn(q, k, v, beta, g, initial_state):
    """The gated delta rule as FLA's fla/ops/gated_delta_rule/naive.py writes it (the
    corpus's spelling), with an initial state and the final state out."""
    return fla_naive_recurrent_gdn(q, k, v, beta, g, initial_state=initial_state,
                                   output_final_state=True)


class Hybrid(nn.Module):
    """A small hybrid LM of our own: a causal conv with its state, a GDN layer (FLA's naive
    loop), sinusoidal positions P..P+S-1, causal attention over a KV cache, an LM head.

    forward(ids [B, S], conv_state [B, C, K], rec_state [B, H, Dk, Dk], k_cache [B, Ha, P, D],
    v_cache) -> (logits, new conv_state, new rec_state, new k_cache, new v_cache).
    ``variant`` changes one thing, for the refusals."""

    def __init__(self, variant: str = "", vocab=40, d=24, heads=2, dk=8, kernel=4, att=2):
        super().__init__()
        torch.manual_seed(0)
        self.variant, self.heads, self.dk, self.att, self.kernel = variant, heads, dk, att, kernel
        inner = heads * dk
        self.embed = nn.Embedding(vocab, d)
        self.in_qkv = nn.Linear(d, 3 * inner, bias=False)
        self.conv_w = nn.Parameter(torch.randn(3 * inner, kernel) * 0.5)
        self.in_ab = nn.Linear(d, 2 * heads)
        self.gdn_out = nn.Linear(inner, d, bias=False)
        self.att_qkv = nn.Linear(d, 3 * att * dk, bias=False)
        self.att_out = nn.Linear(att * dk, d, bias=False)
        self.head = nn.Linear(d, vocab, bias=False)
        self.register_buffer("freq", 1.0 / (1.0 + torch.arange(d, dtype=torch.float32)))

    def forward(self, ids, conv_state, rec_state, k_cache, v_cache):
        B, S = ids.shape
        P = k_cache.shape[2]
        x = self.embed(ids)
        mixed = self.in_qkv(x).transpose(1, 2)
        full = torch.cat([conv_state, mixed], dim=-1)
        new_conv = full[:, :, -self.kernel:]
        conv = F.conv1d(full, self.conv_w[:, None, :], groups=full.shape[1])
        mixed = F.silu(conv[:, :, -S:])
        q, k, v = mixed.transpose(1, 2).reshape(B, S, 3, self.heads, self.dk).unbind(2)
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
        a, b = self.in_ab(x).chunk(2, dim=-1)
        o, new_rec = naive_gdn(q, k, v, b.sigmoid(), -F.softplus(a), rec_state)
        x = x + self.gdn_out(o.reshape(B, S, -1))
        if self.variant == "branch" and S >= 5:  # a path taken for long inputs only
            x = x * 2
        if self.variant == "decode" and S == 1:  # a decode-only path, as transformers has
            x = x + 1
        if self.variant == "square":  # a size that is not affine in S
            x = x + torch.arange(S * S).float().mean()
        if self.variant == "float":  # a float literal that follows S
            x = x * (1.0 / S)
        if self.variant == "constant":  # a tensor made at trace time from S
            x = x + torch.tensor([float(i) for i in range(S)])[None, :, None]
        pos = torch.arange(P, P + S).float()
        x = x + torch.sin(pos[None, :, None] * self.freq)
        aq, ak, av = self.att_qkv(x).view(B, S, 3, self.att, self.dk).permute(2, 0, 3, 1, 4)
        ak = torch.cat([k_cache, ak], dim=2)
        av = torch.cat([v_cache, av], dim=2)
        mask = torch.arange(P + S)[None, :] <= torch.arange(S)[:, None] + P
        scores = (aq @ ak.transpose(-1, -2)) / math.sqrt(self.dk)
        y = scores.masked_fill(~mask, float("-inf")).softmax(-1) @ av
        x = x + self.att_out(y.transpose(1, 2).reshape(B, S, -1))
        return self.head(x), new_conv, new_rec, ak, av

    def example_inputs(self, S, P, batch=1, seed=1):
        return self.example(S, P, batch, seed)

    def example(self, S, P, batch=1, seed=1):
        gen = torch.Generator().manual_seed(seed + 7 * S + 13 * P)
        inner = self.heads * self.dk
        return (torch.randint(0, 40, (batch, S), generator=gen),
                torch.randn(batch, 3 * inner, self.kernel, generator=gen),
                torch.randn(batch, self.heads, self.dk, self.dk, generator=gen) * 0.5,
                torch.randn(batch, self.att, P, self.dk, generator=gen),
                torch.randn(batch, self.att, P, self.dk, generator=gen))


def tracer(model):
    """The user's own export call: plain torch.export at fixed S and P."""
    return lambda S, P: torch.export.export(model, model.example(S, P))


@pytest.fixture(scope="module")
def hybrid():
    model = Hybrid().eval()
    return model, gdn_fx.generalize(tracer(model))


@pytest.fixture(scope="module")
def hybrid_nnef(hybrid, tmp_path_factory):
    _, gen = hybrid
    return gen.export_nnef(tmp_path_factory.mktemp("gen") / "hybrid.nnef.tgz")


# --- the fit --------------------------------------------------------------------------------

POINTS = [(3, 4), (5, 4), (3, 7), (6, 9)]


@pytest.mark.parametrize("affine", [(1, 0, 0), (0, 1, 0), (1, 1, 0), (1, 1, -1), (-1, 0, 0),
                                    (2, 0, 5), (0, -3, 64)])
def test_fit_affine_finds_integer_forms(affine):
    a, b, c = affine
    assert fit_affine(POINTS, [a * s + b * p + c for s, p in POINTS]) == affine


@pytest.mark.parametrize("form", [lambda s, p: s * p, lambda s, p: s * s, lambda s, p: s // 2,
                                  lambda s, p: max(s, p)])
def test_fit_affine_refuses_other_forms(form):
    assert fit_affine(POINTS, [form(s, p) for s, p in POINTS]) is None


# --- a hybrid model of our own --------------------------------------------------------------

def test_hybrid_generalized_has_the_fused_ops_and_symbolic_inputs(hybrid):
    _, gen = hybrid
    assert gen.counts == {"gated_delta_scan": 1, "causal_conv1d_update": 1}
    assert gen.axes == {"ids": {1: "S"}, "k_cache": {2: "P"}, "v_cache": {2: "P"}}
    assert gdn_fx.find_unrolled(gen.program) == []
    user = [n for n in gen.program.graph.nodes if n.op == "placeholder"][-5:]
    shapes = {n.name: [str(d) for d in n.meta["val"].shape] for n in user}
    assert not shapes["ids"][1].isdigit() and not shapes["k_cache"][2].isdigit()
    assert shapes["k_cache"][2] == shapes["v_cache"][2] != shapes["ids"][1]
    assert shapes["rec_state"] == ["1", "2", "8", "8"]


@pytest.mark.parametrize("S, P", UNTRACED)
def test_hybrid_generalized_runs_like_eager_in_torch(hybrid, S, P):
    model, gen = hybrid
    args = model.example(S, P, seed=3)
    with torch.no_grad():
        want = model(*args)
        got = gen.program.module()(*args)
    for g, w in zip(got, want):
        assert g.shape == w.shape
        assert (g - w).abs().max() <= 1e-4 * w.abs().max()


def test_hybrid_nnef_in_tract_equals_eager_at_untraced_lengths(hybrid, hybrid_nnef):
    model, _ = hybrid
    runnable = tract_check.load(hybrid_nnef)
    text = tract_check.nnef_text(hybrid_nnef)
    assert "tract_symbol S" in text and "tract_symbol P" in text
    for S, P in UNTRACED:
        args = model.example(S, P, seed=3)
        with torch.no_grad():
            want = model(*args)
        found = tract_check.compare(runnable, want, args, tolerance=1e-4)
        assert found.ok, (S, P, str(found))


def test_hybrid_nnef_generates_like_eager(hybrid, hybrid_nnef):
    """A prefill at P = 0, then decode steps feeding each step's caches to the next, in one
    kept tract State, against the eager model fed the same way."""
    model, _ = hybrid
    state = tract_check.load(hybrid_nnef).spawn_state()
    ids, conv, rec, kc, vc = model.example(5, 0, seed=4)
    conv, rec = torch.zeros_like(conv), torch.zeros_like(rec)
    eager, got = (ids, conv, rec, kc, vc), (ids, conv, rec, kc, vc)
    for _ in range(6):
        with torch.no_grad():
            want = model(*eager)
        out = [torch.from_numpy(x) for x in tract_check.run(state, got)]
        for o, w in zip(out, want):
            assert o.shape == w.shape and (o - w).abs().max() <= 1e-4 * w.abs().max()
        token = want[0][:, -1:].argmax(-1)
        assert torch.equal(out[0][:, -1:].argmax(-1), token)
        eager, got = (token, *want[1:]), (token, *out[1:])


def test_hybrid_decode_program_in_tract(hybrid, tmp_path):
    model, gen = hybrid
    path = gdn_fx.export_nnef(gen.decode_program(), tmp_path / "d.nnef.tgz",
                              dynamic_axes={"k_cache": {2: "P"}, "v_cache": {2: "P"}},
                              symbol_min={"P": 0})
    runnable = tract_check.load(path)
    for P in (0, 3, 9):
        args = model.example(1, P, seed=5)
        with torch.no_grad():
            want = model(*args)
        assert tract_check.compare(runnable, want, args).ok


# --- refusals -------------------------------------------------------------------------------

def test_refuses_a_branch_on_the_length_naming_the_first_differing_node():
    model = Hybrid("branch").eval()
    with pytest.raises(GeneralizeRefused) as caught:
        gdn_fx.generalize(tracer(model))
    message = str(caught.value)
    assert "(3, 4) and (5, 4)" in message, message
    assert "(mul.Tensor) vs" in message or "vs 'mul" in message, message
    assert "branches on the lengths" in message


def test_refuses_points_across_a_decode_branch():
    """Traced at S = 1 and S > 1, a model with an S == 1 path (as transformers has) gives
    two programs: refused (trace at S >= 2; the multi-token path then serves S = 1)."""
    model = Hybrid("decode").eval()
    with pytest.raises(GeneralizeRefused, match=r"\(1, 4\) and \(3, 4\)"):
        gdn_fx.generalize(tracer(model), [(1, 4), (3, 4), (1, 7), (4, 9)])


def test_refuses_a_literal_that_is_not_affine():
    model = Hybrid("square").eval()
    with pytest.raises(GeneralizeRefused) as caught:
        gdn_fx.generalize(tracer(model))
    message = str(caught.value)
    assert "arange" in message and "[9, 25, 9, 36]" in message, message


def test_refuses_a_float_literal_that_follows_the_length():
    model = Hybrid("float").eval()
    with pytest.raises(GeneralizeRefused, match="float literal"):
        gdn_fx.generalize(tracer(model))


def test_refuses_a_constant_made_from_the_length():
    model = Hybrid("constant").eval()
    with pytest.raises(GeneralizeRefused, match="constant"):
        gdn_fx.generalize(tracer(model))


def test_refuses_an_unrolled_loop():
    """Without collapse the GDN loop unrolls: its node count grows with S."""
    model = Hybrid().eval()
    with pytest.raises(GeneralizeRefused, match="unrolled"):
        gdn_fx.generalize(tracer(model), collapse=False)


def test_points_must_fit_and_check():
    with pytest.raises(UsageError, match="at least 4"):
        gdn_fx.generalize(tracer(Hybrid()), [(3, 4), (5, 4), (3, 7)])
    with pytest.raises(UsageError, match="affinely independent"):
        gdn_fx.generalize(tracer(Hybrid()), [(3, 4), (5, 4), (7, 4), (3, 7)])


# --- windows --------------------------------------------------------------------------------

class SlidingWindowLM(nn.Module):
    """A decoder layer whose attention sees the last ``window`` positions, written as a
    Mistral-style author would, in one of four ways (``spelling``):

    - "rolling": the cache keeps only the last ``window`` keys (``cat(...)[:, :, -window:]``);
    - "python": the same, the start computed in Python (``max(0, P + S - window)``), so the
      traced graph holds no trace of the window;
    - "python_min": the same as ``[:, :, -min(P + S, window):]``, traced as ``-(S + P)``;
    - "mask": the cache keeps every key, a mask hides those ``window`` or more behind;
    - "python+mask": the Python slice of "python" and the mask of "mask".

    forward(ids [B, S], keys [B, H, P, D], values [B, H, P, D]) -> (logits, keys, values).
    """

    def __init__(self, spelling: str, window: int = 16, vocab=32, width=16, heads=2, dim=8):
        super().__init__()
        torch.manual_seed(5)
        self.spelling, self.window, self.heads, self.dim = spelling, window, heads, dim
        self.tokens = nn.Embedding(vocab, width)
        self.qkv = nn.Linear(width, 3 * heads * dim, bias=False)
        self.proj = nn.Linear(heads * dim, width, bias=False)
        self.lm_head = nn.Linear(width, vocab, bias=False)

    def forward(self, ids, keys, values):
        batch, new = ids.shape
        past = keys.shape[2]
        h = self.tokens(ids)
        q, k, v = (t.view(batch, new, self.heads, self.dim).transpose(1, 2)
                   for t in self.qkv(h).chunk(3, -1))  # [B, H, S, D]
        keys, values = torch.cat((keys, k), 2), torch.cat((values, v), 2)
        if self.spelling == "rolling":
            keys, values = keys[:, :, -self.window:], values[:, :, -self.window:]
        if self.spelling == "python_min":
            keep = min(past + new, self.window)
            keys, values = keys[:, :, -keep:], values[:, :, -keep:]
        elif self.spelling.startswith("python"):
            start = max(0, past + new - self.window)
            keys, values = keys[:, :, start:], values[:, :, start:]
        end = past + new
        key_pos = torch.arange(end - keys.shape[2], end)
        query_pos = torch.arange(past, end)[:, None]
        visible = key_pos <= query_pos
        if self.spelling.endswith("mask"):
            visible = visible & (query_pos - key_pos < self.window)
        att = (q @ keys.transpose(-1, -2)) * self.dim ** -0.5
        att = att.masked_fill(~visible, torch.finfo(att.dtype).min).softmax(-1)
        mixed = (att @ values).transpose(1, 2).flatten(2)
        return self.lm_head(h + self.proj(mixed)), keys, values

    def example(self, S, P, seed=0):
        gen = torch.Generator().manual_seed(seed + 31 * S + P)
        cache = (1, self.heads, P, self.dim)
        return (torch.randint(0, 32, (1, S), generator=gen), torch.randn(*cache, generator=gen),
                torch.randn(*cache, generator=gen))


def test_refuses_a_rolling_window_cache_naming_the_slice_and_the_window():
    model = SlidingWindowLM("rolling").eval()
    with pytest.raises(GeneralizeRefused) as caught:
        gdn_fx.generalize(tracer(model))
    message = str(caught.value)
    assert "\n" not in message
    assert "'slice" in message and "keeps the last 16 positions" in message, message


@pytest.mark.parametrize("spelling", ["python", "python_min"])
def test_refuses_a_window_spelled_in_python_by_running_past_the_traced_lengths(spelling):
    """No literal of the window is left in the graph: only the check far out sees it."""
    model = SlidingWindowLM(spelling).eval()
    with pytest.raises(GeneralizeRefused) as caught:
        gdn_fx.generalize(tracer(model))
    message = str(caught.value)
    assert "\n" not in message and "window" in message, message
    assert f"(S, P) = (3, {FAR_MIN - 3})" in message, message


def test_the_check_reaches_past_a_window_literal_larger_than_far_min():
    """W = 700 > FAR_MIN, spelled in Python (slice) and in the graph (mask): the check is
    drawn past the mask's literal, where the slice starts to cut."""
    window = 700
    assert window > FAR_MIN
    model = SlidingWindowLM("python+mask", window=window).eval()
    with pytest.raises(GeneralizeRefused) as caught:
        gdn_fx.generalize(tracer(model))
    message = str(caught.value)
    assert "(S, P) = (3, 699)" in message and f"{window} of node" in message, message


def test_far_point_lies_past_the_largest_length_literal():
    points = [(3, 4), (5, 4), (3, 7), (6, 9)]
    assert far_point(points, []) == (3, FAR_MIN - 3)
    assert far_point(points, [("lt", 1000), ("slice_2", 4)]) == (3, 999)
    assert far_point(points, [("lt", 1000)], grow="S") == (998, 4)  # no input carries P


def test_a_masked_window_over_the_whole_cache_generalizes_exact_past_the_window(tmp_path):
    """The window as a mask from the positions: the graph computes it at every length, so
    generalize keeps it; in torch and in tract the result equals eager at S + P past W."""
    model = SlidingWindowLM("mask").eval()
    gen = gdn_fx.generalize(tracer(model))
    assert gen.far == (3, FAR_MIN - 3)
    runnable = tract_check.load(gen.export_nnef(tmp_path / "w.nnef.tgz"))
    for S, P in [(1, 0), (2, 30), (20, 3), (5, 40)]:
        args = model.example(S, P, seed=2)
        with torch.no_grad():
            want = model(*args)
            got = gen.program.module()(*args)
        for g, w in zip(got, want):
            assert g.shape == w.shape and (g - w).abs().max() <= 1e-4 * w.abs().max()
        assert tract_check.compare(runnable, want, args, tolerance=1e-4).ok, (S, P)
    # without the window the same model differs there: the mask is doing the work
    args = model.example(5, 40, seed=2)
    with torch.no_grad():
        assert not torch.allclose(model(*args)[0], SlidingWindowLM("")(*args)[0], atol=1e-3)


@pytest.mark.slow
def test_transformers_sliding_window_family_generalizes_exact_past_the_window():
    """lara_mini's sliding-attention layer (transformers' sliding-window mask) with a window
    of 16, through DecodeStep's whole-window cache: equal to eager past the window."""
    from gdn_fx.hf import DecodeStep, prepare_for_nnef, tiny_model
    from gdn_fx.hf.generalized import generalize_step

    model = prepare_for_nnef(tiny_model("lara_mini", sliding_window=16))
    assert "sliding_attention" in model.config.layer_types
    step = DecodeStep(model, last_logits=True, whole_windows=True)
    gen = generalize_step(step)
    assert gen.far is not None and sum(gen.far) > 16
    for S, P in [(2, 20), (5, 30), (20, 0)]:
        args = step.example_inputs(seq_len=S, past_len=P, source="random", seed=2)
        want = step.eager(*args)
        with torch.no_grad():
            got = gen.program.module()(*args)
        for g, w in zip(got, want):
            assert g.shape == w.shape and (g - w).abs().max() <= 1e-4 * w.abs().max(), (S, P)


# --- a transformers family ------------------------------------------------------------------

# Every family the reify route exports (Family.generates: glm5_next is refused there too,
# sizes that depend on values), but the Mamba ones. Mamba2: transformers pads its SSD by S
# mod chunk, and generalize refuses the plain exports (test_a_padded_ssd_is_refused_by_
# generalize). Mamba1: transformers' own multi-token step on a warm cache starts from zeros
# (tests/test_generator_mamba.py), so a plain export at P > 0 is not the recurrence.
GENERALIZED = [f for f in GENERATING if family_spec(f).mixer not in ("mamba2", "mamba1")]


@pytest.mark.slow
@pytest.mark.parametrize("family", GENERALIZED)
def test_plain_export_generalized_equals_the_reify_route(tmp_path, family, shared_export):
    """A plain torch.export of DecodeStep at fixed (S, P) (prefill path: the chunk rule and
    the conv with its state), generalized: in tract it equals export_generator's artifact
    and eager at untraced (S, P), S = 1 and S = 70 (two chunks) included, and generates 64
    tokens as transformers' generate does. The family's model with one layer of each of its
    kinds (``one_of_each``: six traces of it make this test; test_generator.py generates
    from the whole tiny models)."""
    from gdn_fx.hf import DecodeStep, prepare_for_nnef, tiny_model
    from gdn_fx.hf.configs import one_of_each
    from gdn_fx.hf.generator import Generator, check_generation

    model = prepare_for_nnef(tiny_model(family, **one_of_each(family)))
    step = DecodeStep(model, last_logits=True, whole_windows=True)
    gen = gdn_fx.generalize(lambda S, P: torch.export.export(  # random: see generalize_step
        step, step.example_inputs(seq_len=S, past_len=P, source="random"), strict=False))
    assert gen.counts == step.expected_fusions
    path = gen.export_nnef(tmp_path / "q.nnef.tgz", input_names=step.input_names,
                           output_names=step.output_names)
    # export_generator's artifact of the same tiny model (conftest.py's, shared: it prepares
    # its model for NNEF in place, as done here)
    reified = shared_export(family, one_of_each(family))[1].main
    ours, theirs = tract_check.load(path), tract_check.load(reified)
    for S, P in [(1, 0), (1, 5), (2, 3), (6, 0), (70, 4)]:
        args = step.example_inputs(seq_len=S, past_len=P, source="random", seed=2)
        assert tract_check.compare(ours, step.eager(*args), args).ok, (S, P)
        want = [torch.from_numpy(x) for x in tract_check.run(theirs, args)]
        assert tract_check.compare(ours, want, args, tolerance=1e-5).ok, (S, P)
    result = Generator(path).generate(list(range(3, 40)), max_new_tokens=64)
    check = check_generation(model, result)
    assert check.ok, str(check)


@pytest.mark.slow
def test_a_padded_ssd_is_refused_by_generalize():
    """bamba's plain exports at fixed (S, P) each fuse their padded SSD, but what the fused
    node is given changes with S in more than integer sizes: generalize refuses, in words,
    rather than write a file for lengths it did not see (export_generator is the route)."""
    from gdn_fx.errors import GeneralizeRefused
    from gdn_fx.hf import DecodeStep, tiny_model
    from gdn_fx.hf.configs import one_of_each

    step = DecodeStep(tiny_model("bamba", **one_of_each("bamba")), last_logits=True,
                      whole_windows=True)
    with pytest.raises(GeneralizeRefused, match="changes with the lengths"):
        gdn_fx.generalize(lambda S, P: torch.export.export(
            step, step.example_inputs(seq_len=S, past_len=P, source="random"), strict=False))


def test_cli_generalize_takes_no_fixed_length(tmp_path, capsys):
    from gdn_fx.cli import main

    status = main(["export", "--family", "qwen3_5", "--generalize", "--seq-len", "3",
                   "--out", str(tmp_path / "x.nnef.tgz")])
    assert status == 2 and "--generalize" in capsys.readouterr().err


def test_generalize_route_stamps_both_graphs_with_one_fingerprint(tmp_path):
    """export_generalized writes its pair as export_generator does: staged, then stamped
    with the export's fingerprint (config and weights), so the Generator runs it without the
    unverified-pair warning and refuses a decode graph of another export."""
    import re
    import warnings

    from gdn_fx.hf import tiny_model
    from gdn_fx.hf.generalized import export_generalized
    from gdn_fx.hf.generator import Generator, UnverifiedPair
    from gdn_fx.hf.nnef import fingerprint

    model = tiny_model("lfm2")
    files = export_generalized(model, tmp_path / "g.nnef.tgz", decode=True)
    assert files.decode is not None, files.decode_note
    stamps = [re.search(r'"gdn_fx_fingerprint", "(sha256:[0-9a-f]{64})"',
                        tract_check.nnef_text(p)).group(1) for p in (files.main, files.decode)]
    assert stamps[0] == stamps[1] == fingerprint(model)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g.decode.nnef.tgz", "g.nnef.tgz"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnverifiedPair)
        result = Generator(files.main).generate([1, 2, 3], max_new_tokens=4)
    assert len(result.tokens) == 4
