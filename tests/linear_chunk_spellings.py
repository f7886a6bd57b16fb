"""A corpus of the CHUNKED gated linear recurrence as other authors spell it, and one-change
mutants.

Every spelling computes what the gated linear recurrence computes (canonical layout: q, k
[B, T, Hk, Dk], v [B, T, H, Dv], g the log decay [B, T, H] or [B, T, H, Dk], the state
[B, H, Dk, Dv] key-first):

    S_t = diag(exp(g_t)) S_{t-1} + k_t v_t^T;   o_t = scale * S_t^T q_t

but by the chunked (state space duality) algebra: per chunk of C positions a cumulative log
decay G, an intra-chunk part (q_i . k_j) exp(G_i - G_j) on the causal lower triangle, a part
read from the state carried into the chunk (q_i exp(G_i) S), and the carried state passed on
decayed by the chunk's total decay. Each is written the way some other author writes it:

- transformers' own ``mamba2_chunk_scan`` (its torch fallback, imported inside the module):
  dt through softplus(dt + dt_bias) and a clamp, A = -exp(A_log) a parameter, B and C of one
  or two groups repeated to the heads inside, a D skip or none, the inputs padded to whole
  chunks (chunk 16, 32 and 256) and the padded output cut back, the state value-first
  [B, H, P, N] (q = C, k = B, v = dt' x, g = dt' A);
- the Mamba2 paper's minimal discrete SSD, in this corpus's own words: a segment sum by
  cumsum differences under a tril mask, four-operand einsums over the chunks, the chunk
  states passed by a decay matrix between chunk boundaries;
- FLA's naive chunk simple GLA (its naive_chunk_simple_gla, head-major as FLA took it):
  padded to whole chunks, q scaled first, a within-chunk cumsum, the decay mask
  exp(G_i - G_j) on the lower triangle, a Python loop over chunks writing a zeros buffer;
- a retention-style chunkwise form (as torchscale's chunkwise recurrence is written) whose
  per-position log decay is an input tensor: all chunks' key-value sums at once, then a
  Python loop that carries the state and lists each chunk's starting state;
- a per-chunk loop of ``torch.bmm`` with batch and heads merged [B*H, ...], slicing chunks
  of C with a short last chunk (no padding), each chunk's own cumsum, a gate per head or per
  key channel, the outputs listed and cat or written into a zeros buffer by slice;
- a plain chunked loop (the base of most mutants).

Nothing here imports gdn_fx: this is what a recognizer is tested on. ``Spelling`` and
``Mutant`` are tests/linear_spellings.py's: ``args(which, seed)`` builds the module's inputs
('example': log gates in [-0.95, -0.05] (transformers' Mamba2: about [-1.5, -0.04]), values
of order 1; 'wide': log gates down to -50, values and states of order 1e3), and
``reference(module, args, scan)`` recomputes the module's outputs with a canonical-layout
``scan(q, k, v, g, s0, scale=)`` the test supplies.

``MUTANTS``: one small edit of a chunked spelling (its inputs are its base's; transformers'
is edited by patching its module's segment_sum for the call). ``inside``: the edit changes
the recurrence itself (no op computes it from the region's reads), so nothing may fuse; the
others may fuse only into something that computes them (a per-chunk loop's chunks before
the edit are right).
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from linear_spellings import B, DK, DV, H, MOVE, Mutant, Spelling, standard_reference

NEG_INF = float("-inf")


# --- inputs --------------------------------------------------------------------------------

def _gen(which: str, seed: int, t: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed + (7919 if which == "wide" else 0) + 31 * t)


def _log_gates(shape, gen, wide: bool) -> torch.Tensor:
    """Log decays: ordinary in [-0.95, -0.05]; wide in [-50, 0], -50 reached."""
    u = torch.rand(*shape, generator=gen)
    if wide:
        g = -50.0 * u ** 3
        g.view(-1)[::7] = -50.0
        return g
    return -(0.9 * u + 0.05)


def seq_operands(which: str = "example", seed: int = 0, *, t: int, h: int = H, hk=None,
                 dk: int = DK, dv: int = DV, per_key: bool = False) -> dict:
    """Canonical operands of length ``t``: q, k [B, t, Hk, Dk], v [B, t, H, Dv], g [B, t, H]
    or [B, t, H, Dk], s0 [B, H, Dk, Dv]. 'wide': g down to -50, v and s0 * 1e3."""
    wide = which == "wide"
    gen = _gen(which, seed, t)
    hk = hk or h
    big = 1e3 if wide else 1.0

    def rnd(*shape, s=1.0):
        return torch.randn(*shape, generator=gen) * s

    g = _log_gates((B, t, h, dk) if per_key else (B, t, h), gen, wide)
    return {"q": rnd(B, t, hk, dk), "k": rnd(B, t, hk, dk, s=0.5), "v": rnd(B, t, h, dv, s=big),
            "g": g, "s0": rnd(B, h, dk, dv, s=0.5 * big)}


def chunk_args(*, t: int, layout="bthd", state=True, per_key=False, **dims):
    """(q, k, v, g[, s0]) of length ``t`` in ``layout``; the state key-first."""
    def build(which="example", seed=0):
        x = seq_operands(which, seed, t=t, per_key=per_key, **dims)
        return tuple(MOVE[layout](x[n]) for n in ("q", "k", "v", "g")) + \
            ((x["s0"],) if state else ())
    return build


# --- transformers' Mamba2 SSD ---------------------------------------------------------------

class HFMamba2ChunkScan(nn.Module):
    """transformers' own mamba2_chunk_scan (its torch fallback): A = -exp(A_log), dt through
    softplus(dt + dt_bias) and clamp, B and C [B, T, G, N] repeated to the heads inside,
    padded to whole chunks, a D skip when given; the state value-first [B, H, P, N]."""

    def __init__(self, heads: int, chunk: int, *, d_skip=True, final=True):
        super().__init__()
        self.chunk, self.final = chunk, final
        self.A_log = nn.Parameter(torch.log(torch.arange(1, heads + 1, dtype=torch.float32)))
        self.dt_bias = nn.Parameter(torch.linspace(-0.2, 0.2, heads))
        self.D = nn.Parameter(torch.linspace(-1.0, 1.0, heads)) if d_skip else None

    def forward(self, x, dt, Bm, Cm, s0=None):
        from transformers.models.mamba2.modeling_mamba2 import mamba2_chunk_scan

        A = -torch.exp(self.A_log.float())
        return mamba2_chunk_scan(x, dt, A, Bm, Cm, chunk_size=self.chunk, D=self.D,
                                 dt_bias=self.dt_bias, initial_states=s0, dt_softplus=True,
                                 dt_limit=(0.0, float("inf")),
                                 return_final_states=self.final)


def _segment_sum_diagonal_off(x: torch.Tensor) -> torch.Tensor:
    """transformers' segment_sum with one edit: its second mask tril(diagonal=-1) where 0
    is right (-inf on the diagonal: exp gives 0 where it must give 1)."""
    size = x.size(-1)
    x = x[..., None].expand(*x.size(), size)
    below = torch.tril(torch.ones(size, size, dtype=torch.bool), diagonal=-1)
    x = torch.cumsum(x.masked_fill(~below, 0), dim=-2)
    return x.masked_fill(~torch.tril(torch.ones(size, size, dtype=torch.bool), diagonal=-1),
                         NEG_INF)


class HFMamba2SegmentSumOff(HFMamba2ChunkScan):
    """transformers' mamba2_chunk_scan run with its module's segment_sum replaced (for the
    call) by one whose causal mask drops the diagonal."""

    def forward(self, x, dt, Bm, Cm, s0=None):
        from unittest import mock

        from transformers.models.mamba2 import modeling_mamba2

        with mock.patch.object(modeling_mamba2, "segment_sum", _segment_sum_diagonal_off):
            return super().forward(x, dt, Bm, Cm, s0)


def hf_args(*, t: int, heads: int = H, groups: int = 1, p: int = DV, n: int = DK,
            state=True):
    """(x [B, t, H, P], dt (before softplus) [B, t, H], B, C [B, t, G, N][, s0 [B, H, P, N]]).
    dt is the inverse softplus of a step in [0.05, 0.3] ('wide': up to 50 / H, so that
    dt' A reaches -50; x and s0 * 1e3)."""
    def build(which="example", seed=0):
        wide = which == "wide"
        gen = _gen(which, seed + 17, t)
        big = 1e3 if wide else 1.0
        u = torch.rand(B, t, heads, generator=gen)
        if wide:
            step = (50.0 / heads * u ** 3).clamp_min(1e-4)
            step.view(-1)[::7] = 50.0 / heads
        else:
            step = 0.05 + 0.25 * u
        dt = torch.where(step > 20, step, torch.log(torch.expm1(step)))
        out = (torch.randn(B, t, heads, p, generator=gen) * big, dt,
               torch.randn(B, t, groups, n, generator=gen) * 0.5,
               torch.randn(B, t, groups, n, generator=gen))
        return out + ((torch.randn(B, heads, p, n, generator=gen) * 0.5 * big,) if state else ())
    return build


def hf_reference(*, state=True, final=True, d_skip=True):
    def reference(module, args, scan):
        x, dt, Bm, Cm = (a.double() for a in args[:4])
        s0 = args[4].double().transpose(-1, -2) if state else None
        A = -torch.exp(module.A_log.detach().double())
        step = F.softplus(dt + module.dt_bias.detach().double()).clamp_min(0.0)
        o, S = scan(Cm, Bm, step[..., None] * x, step * A, s0, scale=1.0)  # q = C, k = B
        if d_skip:
            o = o + x * module.D.detach().double()[:, None]
        return (o, S.transpose(-1, -2)) if final else o
    return reference


# --- the Mamba2 paper's minimal discrete SSD, in other words ---------------------------------

def pairwise_sums(a: torch.Tensor, diagonal: int = 0) -> torch.Tensor:
    """a [..., L] -> [..., L, L]: at (i, j), j <= i, the sum a[j+1] + ... + a[i] (a
    difference of cumulative sums), -inf above the kept triangle (``diagonal``: tril's)."""
    size = a.shape[-1]
    running = torch.cumsum(a, dim=-1)
    between = running[..., :, None] - running[..., None, :]
    keep = torch.tril(torch.ones(size, size, dtype=torch.bool), diagonal=diagonal)
    return between.masked_fill(~keep, NEG_INF)


def minimal_ssd(X, A, Bm, Cm, block: int, start=None, *, intra_diagonal=0):
    """X [B, T, H, P], A (log decay) [B, T, H], Bm, Cm [B, T, H, N], T a multiple of
    ``block``; ``start`` [B, H, P, N] or None. Returns Y [B, T, H, P] and the last state.
    ``intra_diagonal``: the one edit of a mutant (0 is right)."""
    b, t, h, p = X.shape
    chunks = t // block

    def blocks(z):  # 'b (c l) h d -> b c l h d'
        return z.reshape(b, chunks, block, h, z.shape[-1])

    X, Bm, Cm = blocks(X), blocks(Bm), blocks(Cm)
    A = A.reshape(b, chunks, block, h).permute(0, 3, 1, 2)  # b h c l
    A_run = torch.cumsum(A, dim=-1)

    # within each block: a masked, decayed attention C B^T applied to X
    within = torch.exp(pairwise_sums(A, intra_diagonal))  # b h c l s
    y_within = torch.einsum("bclhn,bcshn,bhcls,bcshp->bclhp", Cm, Bm, within, X)

    # what each block adds to the state, decayed to the block's end
    to_end = torch.exp(A_run[..., -1:] - A_run)  # b h c l
    added = torch.einsum("bclhn,bhcl,bclhp->bchpn", Bm, to_end, X)

    # the states at block boundaries: every earlier block's addition, decayed block by block
    first = start[:, None] if start is not None else torch.zeros_like(added[:, :1])
    added = torch.cat([first, added], dim=1)  # b (c+1) h p n
    across = torch.exp(pairwise_sums(F.pad(A_run[..., -1], (1, 0))))  # b h (c+1) (c+1)
    boundary = torch.einsum("bhzc,bchpn->bzhpn", across, added)
    entering, last = boundary[:, :-1], boundary[:, -1]

    # what the state entering each block gives its positions
    y_carried = torch.einsum("bclhn,bchpn,bhcl->bclhp", Cm, entering, torch.exp(A_run))
    return (y_within + y_carried).reshape(b, t, h, p), last


class MinimalSSD(nn.Module):
    """The Mamba2 paper's ssd_minimal_discrete in other words: (X, A, B, C, initial state)
    discretized by the caller, blocks of 8, the state value-first in and out."""

    def __init__(self, block=8, **edit):
        super().__init__()
        self.block, self.edit = block, edit

    def forward(self, X, A, Bm, Cm, s0):
        return minimal_ssd(X, A, Bm, Cm, self.block, s0, **self.edit)


class MinimalSSDNoState(nn.Module):
    """The minimal SSD from zeros (no initial state), Y and the last state out; blocks of
    8."""

    def forward(self, X, A, Bm, Cm):
        return minimal_ssd(X, A, Bm, Cm, 8)


class MinimalSSDDiscretize(nn.Module):
    """The minimal SSD with the discretization inside: A = -exp(A_log) a parameter, X = dt x
    and A dt before the blocks, no initial state, Y only; blocks of 6."""

    def __init__(self):
        super().__init__()
        self.A_log = nn.Parameter(torch.log(torch.arange(1, H + 1, dtype=torch.float32)))

    def forward(self, x, dt, Bm, Cm):
        A = -torch.exp(self.A_log)
        y, _ = minimal_ssd(x * dt[..., None], A * dt, Bm, Cm, 6)
        return y


def ssd_args(*, t: int):
    """(X = v, A = g, B = k, C = q, the state value-first) of length ``t``."""
    def build(which="example", seed=0):
        x = seq_operands(which, seed, t=t)
        return x["v"], x["g"], x["k"], x["q"], x["s0"].transpose(-1, -2).contiguous()
    return build


def ssd_reference(module, args, scan):
    X, A, Bm, Cm, s0 = args
    o, S = scan(Cm, Bm, X, A, s0.transpose(-1, -2), scale=1.0)
    return o, S.transpose(-1, -2)


def ssd_reference_no_state(module, args, scan):
    X, A, Bm, Cm = args
    o, S = scan(Cm, Bm, X, A, None, scale=1.0)
    return o, S.transpose(-1, -2)


def dt_args(*, t: int):
    """(x [B, t, H, P], dt > 0 [B, t, H], B, C [B, t, H, N]); 'wide': dt up to 50 / H (dt A
    down to -50), x * 1e3."""
    def build(which="example", seed=0):
        wide = which == "wide"
        gen = _gen(which, seed + 23, t)
        u = torch.rand(B, t, H, generator=gen)
        dt = 50.0 / H * u ** 3 if wide else 0.05 + 0.25 * u
        if wide:
            dt.view(-1)[::7] = 50.0 / H
        return (torch.randn(B, t, H, DV, generator=gen) * (1e3 if wide else 1.0), dt,
                torch.randn(B, t, H, DK, generator=gen) * 0.5,
                torch.randn(B, t, H, DK, generator=gen))
    return build


def dt_reference(module, args, scan):
    x, dt, Bm, Cm = (a.double() for a in args)
    A = -torch.exp(module.A_log.detach().double())
    o, _ = scan(Cm, Bm, dt[..., None] * x, dt * A, None, scale=1.0)
    return o


# --- FLA: naive chunk simple GLA -----------------------------------------------------------

def chunk_simple_gla(q, k, v, g, initial_state=None, output_final_state=False, chunk_size=8,
                     scale=None, *, chunk_end=-1):
    """After FLA's naive_chunk_simple_gla, head-major [B, H, T, D] in and out: f32, padded
    to whole chunks, q scaled before chunking, the log decay cumulated within each chunk,
    a decay mask exp(G_i - G_j) on the lower triangle, a loop over chunks writing a zeros
    buffer with ``@``. ``chunk_end``: the mutant's one edit (-1 is right)."""
    q, k, v, g = (x.to(torch.float32) for x in (q, k, v, g))
    if scale is None:
        scale = q.shape[-1] ** -0.5
    length = q.shape[2]
    short = (chunk_size - length % chunk_size) % chunk_size
    if short:
        q, k, v = (F.pad(x, (0, 0, 0, short)) for x in (q, k, v))
        g = F.pad(g, (0, short))
    b, h, padded, dk = q.shape
    dv = v.shape[-1]
    q = q * scale
    n = padded // chunk_size
    q, k, v = (x.reshape(b, h, n, chunk_size, x.shape[-1]) for x in (q, k, v))
    G = g.reshape(b, h, n, chunk_size).cumsum(-1)
    mask = (G.unsqueeze(-1) - G.unsqueeze(-2)).tril().exp().tril()
    S = k.new_zeros(b, h, dk, dv) if initial_state is None else initial_state
    o = torch.zeros_like(v)
    for i in range(n):
        q_i, k_i, v_i, G_i = q[:, :, i], k[:, :, i], v[:, :, i], G[:, :, i]
        scores = q_i @ k_i.transpose(-1, -2) * mask[:, :, i]
        o[:, :, i] = (q_i * G_i[..., None].exp()) @ S + scores @ v_i
        end = G_i[..., chunk_end]
        S = S * end[..., None, None].exp() + \
            (k_i * (end[..., None] - G_i).exp()[..., None]).transpose(-1, -2) @ v_i
    o = o.reshape(b, h, padded, dv)[:, :, :length]
    return o, (S if output_final_state else None)


class FlaChunkSimpleGLA(nn.Module):
    """FLA's naive chunk simple GLA, chunk 8, an initial state and the final state out."""

    def __init__(self, **edit):
        super().__init__()
        self.edit = edit

    def forward(self, q, k, v, g, s0):
        return chunk_simple_gla(q, k, v, g, s0, output_final_state=True, **self.edit)


class FlaChunkSimpleGLANoState(nn.Module):
    """FLA's naive chunk simple GLA, chunk 4, called as `o, _ = f(q, k, v, g)`."""

    def forward(self, q, k, v, g):
        o, _ = chunk_simple_gla(q, k, v, g, chunk_size=4)
        return o


# --- retention, chunkwise, with the log decay an input ---------------------------------------

def chunkwise_retention(q, k, v, g, state, chunk=6, *, cross_decay=True):
    """Sequence-major [B, T, H, D], g [B, T, H]: padded to whole chunks, chunks to
    [B, H, n, C, D]; the inner retention under a -inf masked decay, every chunk's
    key-value sum at once, then a loop carrying the state chunk to chunk (each chunk's
    starting state listed and stacked), the cross retention read from them. Scale
    1/sqrt(Dk). ``cross_decay``: the mutant's one edit (True is right)."""
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    scale = dk ** -0.5
    extra = -t % chunk
    q, k, v = (F.pad(x, (0, 0, 0, 0, 0, extra)) for x in (q, k, v))
    g = F.pad(g, (0, 0, 0, extra))
    n = (t + extra) // chunk

    def split(x):  # 'b (n c) h d -> b h n c d'
        return x.view(b, n, chunk, h, -1).permute(0, 3, 1, 2, 4)

    qc, kc, vc = split(q) * scale, split(k), split(v)
    G = g.view(b, n, chunk, h).permute(0, 3, 1, 2).cumsum(-1)  # b h n c
    total = G[..., -1:]
    causal = torch.ones(chunk, chunk, dtype=torch.bool).tril()
    inner_decay = (G.unsqueeze(-1) - G.unsqueeze(-2)).masked_fill(~causal, NEG_INF).exp()
    inner = (qc @ kc.transpose(-1, -2) * inner_decay) @ vc
    kv = (kc * (total - G).exp().unsqueeze(-1)).transpose(-1, -2) @ vc  # b h n dk dv
    chunk_decay = total.squeeze(-1).exp()  # b h n
    starts = []
    for i in range(n):
        starts.append(state)
        state = state * chunk_decay[:, :, i, None, None] + kv[:, :, i]
    starts = torch.stack(starts, dim=2)
    read = qc * G.exp().unsqueeze(-1) if cross_decay else qc
    out = inner + read @ starts
    out = out.permute(0, 2, 3, 1, 4).reshape(b, n * chunk, h, dv)[:, :t]
    return out, state


class ChunkwiseRetention(nn.Module):
    """Retention chunkwise (torchscale's chunkwise recurrence) with a per-position log
    decay input, chunk 6, the state in and out."""

    def __init__(self, **edit):
        super().__init__()
        self.edit = edit

    def forward(self, q, k, v, g, s0):
        return chunkwise_retention(q, k, v, g, s0, **self.edit)


# --- a per-chunk loop of bmm's, heads merged ---------------------------------------------------

def bmm_chunks(q, k, v, g, s0=None, chunk=5, into_buffer=False, *, last_intra=True,
               stale=False):
    """[B*H, T, D] tensors, a loop over chunks of ``chunk`` sliced from T (the last one
    shorter), each chunk's cumsum, scores and state pass by ``torch.bmm``; a gate per
    head; the outputs listed and cat, or (``into_buffer``) written into a zeros buffer by
    slice. Sequence-major in and out, the state key-first. ``last_intra``, ``stale``: the
    mutants' one edit (the defaults are right)."""
    b, t, h, dk = q.shape
    dv = v.shape[-1]

    def merge(x):
        return x.transpose(1, 2).reshape(b * h, t, *x.shape[3:])

    q, k, v, g = map(merge, (q, k, v, g))
    S = q.new_zeros(b * h, dk, dv) if s0 is None else s0.reshape(b * h, dk, dv)
    outs, out = [], q.new_zeros(b * h, t, dv) if into_buffer else None
    before = S  # the state carried into the previous chunk (the stale mutant reads it)
    for lo in range(0, t, chunk):
        qc, kc, vc = (x[:, lo:lo + chunk] for x in (q, k, v))
        G = g[:, lo:lo + chunk].cumsum(1)  # [BH, c]
        c = G.shape[1]
        lower = torch.ones(c, c).tril()
        decay = ((G[:, :, None] - G[:, None, :]) * lower).exp() * lower
        scores = torch.bmm(qc, kc.transpose(1, 2)) * decay
        if not last_intra and lo + chunk >= t:
            scores = scores * 0  # the short last chunk without its intra-chunk term
        o = torch.bmm(qc * G.exp()[..., None], before if stale else S) + torch.bmm(scores, vc)
        if into_buffer:
            out[:, lo:lo + chunk] = o
        else:
            outs.append(o)
        last = G[:, -1:]
        before, S = S, S * last.exp()[..., None] + torch.bmm(
            (kc * (last - G).exp()[..., None]).transpose(1, 2), vc)
    o = (out if into_buffer else torch.cat(outs, 1)).reshape(b, h, t, dv).transpose(1, 2)
    return o, S.reshape(b, h, dk, dv)


def bmm_chunks_per_key(q, k, v, g, chunk=4):
    """The per-chunk bmm loop with a gate per key channel (g [B, T, H, Dk]): the scores
    sum q_i k_j exp(G_i - G_j) over the key channels under the causal mask (einsum), the
    readout and the state pass by bmm; from zeros, o and the final state out."""
    b, t, h, dk = q.shape
    dv = v.shape[-1]

    def merge(x):
        return x.transpose(1, 2).reshape(b * h, t, x.shape[-1])

    q, k, v, g = map(merge, (q, k, v, g))
    S = q.new_zeros(b * h, dk, dv)
    outs = []
    for lo in range(0, t, chunk):
        qc, kc, vc = (x[:, lo:lo + chunk] for x in (q, k, v))
        G = g[:, lo:lo + chunk].cumsum(1)  # [BH, c, Dk]
        c = G.shape[1]
        lower = torch.ones(c, c).tril()[..., None]
        decay = ((G[:, :, None] - G[:, None]) * lower).exp() * lower  # [BH, c, c, Dk]
        scores = torch.einsum("nid,njd,nijd->nij", qc, kc, decay)
        outs.append(torch.bmm(qc * G.exp(), S) + torch.bmm(scores, vc))
        last = G[:, -1:]  # [BH, 1, Dk]
        S = S * last.exp().transpose(1, 2) + torch.bmm(
            (kc * (last - G).exp()).transpose(1, 2), vc)
    o = torch.cat(outs, 1).view(b, h, t, dv).transpose(1, 2)
    return o, S.view(b, h, dk, dv)


class BmmChunks(nn.Module):
    """A per-chunk loop of bmm's, heads merged, chunks of 5 with a short last one, outputs
    listed and cat, the state in and out."""

    def __init__(self, **edit):
        super().__init__()
        self.edit = edit

    def forward(self, q, k, v, g, s0):
        return bmm_chunks(q, k, v, g, s0, **self.edit)


class BmmChunksBuffer(nn.Module):
    """The per-chunk bmm loop writing each chunk's output into a zeros buffer by slice
    (``out[:, lo:lo + C] = ...``) instead of a list, the state in and out."""

    def forward(self, q, k, v, g, s0):
        return bmm_chunks(q, k, v, g, s0, into_buffer=True)


class BmmChunksFour(nn.Module):
    """The per-chunk bmm loop in chunks of 4 (the last one of 1), the state in and out."""

    def forward(self, q, k, v, g, s0):
        return bmm_chunks(q, k, v, g, s0, chunk=4)


class BmmChunksPerKey(nn.Module):
    """The per-chunk bmm loop with a gate per key channel, chunks of 5 with a short last
    one, from zeros, the final state out."""

    def forward(self, q, k, v, g):
        return bmm_chunks_per_key(q, k, v, g, chunk=5)


# --- the plain chunked loop (the mutants' base) ------------------------------------------------

class PlainChunks(nn.Module):
    """The chunked recurrence written plainly: sequence-major, padded to chunks of 4, one
    cumsum over every chunk, a loop over chunks whose steps are methods (the mutants each
    change one), outputs listed and cat."""

    chunk, diagonal = 4, 0

    def prepare(self, q, k, v, g):
        c, t = self.chunk, q.shape[1]
        extra = -t % c
        q, k, v = (F.pad(x, (0, 0, 0, 0, 0, extra)) for x in (q, k, v))
        g = F.pad(g, (0, 0, 0, extra))
        b, n, h = g.shape[0], g.shape[1] // c, g.shape[2]
        G = g.view(b, n, c, h).cumsum(2)  # [B, n, C, H]
        mask = torch.tril(torch.ones(c, c), diagonal=self.diagonal)[None, :, :, None]
        return q, k, v, G, mask

    def intra(self, q_i, k_i, v_i, G_i, mask):
        decay = ((G_i[:, :, None] - G_i[:, None]) * mask).exp() * mask  # [B, C, C, H]
        scores = torch.einsum("bihd,bjhd->bijh", q_i, k_i) * decay
        return torch.einsum("bijh,bjhv->bihv", scores, v_i)

    def inter(self, S, q_i, G_i):
        return torch.einsum("bihk,bhkv->bihv", q_i * G_i.exp()[..., None], S)

    def carry(self, S, k_i, v_i, G_i):
        end = G_i[:, -1]  # [B, H]
        written = torch.einsum("bchk,bchv->bhkv", k_i * (end[:, None] - G_i).exp()[..., None],
                               v_i)
        return S * end.exp()[..., None, None] + written

    def final(self, S):
        return S

    def forward(self, q, k, v, g, s0):
        t, c = q.shape[1], self.chunk
        q, k, v, G, mask = self.prepare(q, k, v, g)
        S, outs = s0, []
        for i in range(G.shape[1]):
            q_i, k_i, v_i = (x[:, i * c:(i + 1) * c] for x in (q, k, v))
            outs.append(self.inter(S, q_i, G[:, i]) + self.intra(q_i, k_i, v_i, G[:, i], mask))
            S = self.carry(S, k_i, v_i, G[:, i])
        return torch.cat(outs, 1)[:, :t], self.final(S)


# --- the records ------------------------------------------------------------------------------

def _std(*, t, layout="bthd", state=True, final=True, per_key=False, scale=1.0, **dims):
    return dict(args=chunk_args(t=t, layout=layout, state=state, per_key=per_key, **dims),
                reference=standard_reference(layout=layout, state=state, final=final,
                                             scale=scale))


def _hf(t, chunk, *, heads=H, groups=1, n=DK, state=True, d_skip=True, final=True):
    return dict(module=partial(HFMamba2ChunkScan, heads, chunk, d_skip=d_skip, final=final),
                args=hf_args(t=t, heads=heads, groups=groups, n=n, state=state),
                reference=hf_reference(state=state, final=final, d_skip=d_skip))


SPELLINGS = [
    # transformers' Mamba2 SSD: T = 32 two whole chunks of 16; T = 37 padded to 48; 40 to
    # 64 (chunk 32); 20 to one chunk of 256
    Spelling("hf_ssd_c16_t32", "hf_mamba2", **_hf(32, 16)),
    Spelling("hf_ssd_c16_t37_groups2", "hf_mamba2", **_hf(37, 16, heads=4, groups=2, n=6)),
    Spelling("hf_ssd_c32_t40_no_state_no_d", "hf_mamba2", **_hf(40, 32, state=False,
                                                                 d_skip=False)),
    Spelling("hf_ssd_c256_t20_groups2_no_d", "hf_mamba2",
             **_hf(20, 256, heads=4, groups=2, n=6, d_skip=False)),
    Spelling("hf_ssd_c16_t37_y_only", "hf_mamba2", **_hf(37, 16, state=False, final=False)),
    # the paper's minimal SSD: 3 blocks of 8, from a state or from zeros; 3 blocks of 6,
    # discretized inside, from zeros, Y only
    Spelling("minimal_ssd", "minimal_ssd", MinimalSSD, ssd_args(t=24), ssd_reference),
    Spelling("minimal_ssd_no_state", "minimal_ssd", MinimalSSDNoState,
             lambda which="example", seed=0: ssd_args(t=24)(which, seed)[:4],
             ssd_reference_no_state),
    Spelling("minimal_ssd_discretize", "minimal_ssd", MinimalSSDDiscretize, dt_args(t=18),
             dt_reference),
    # FLA's naive chunk simple GLA: T = 19 in chunks of 8 (padded), 14 in chunks of 4
    Spelling("fla_chunk_simple_gla", "fla_chunk_simple_gla", FlaChunkSimpleGLA,
             **_std(t=19, layout="bhtd", scale="rsqrt")),
    Spelling("fla_chunk_simple_gla_no_state", "fla_chunk_simple_gla", FlaChunkSimpleGLANoState,
             **_std(t=14, layout="bhtd", scale="rsqrt", state=False, final=False)),
    # retention chunkwise, the decay an input: T = 23 in chunks of 6
    Spelling("chunkwise_retention", "retention_chunkwise", ChunkwiseRetention,
             **_std(t=23, scale="rsqrt")),
    # a per-chunk bmm loop: T = 17 in chunks of 5 (the last of 2), into a list or a buffer;
    # 13 in chunks of 4 (as long as Dk: a chunk's output [B*H, 4, Dv] is shaped like the
    # state); 13 in chunks of 5 with a gate per key
    Spelling("bmm_chunks", "bmm_chunks", BmmChunks, **_std(t=17)),
    Spelling("bmm_chunks_buffer", "bmm_chunks", BmmChunksBuffer, **_std(t=17)),
    Spelling("bmm_chunks_of_four", "bmm_chunks", BmmChunksFour, **_std(t=13)),
    Spelling("bmm_chunks_per_key", "bmm_chunks", BmmChunksPerKey,
             **_std(t=13, per_key=True, state=False)),
    # the plain loop: T = 15 in chunks of 4
    Spelling("plain_chunks", "plain_chunks", PlainChunks, **_std(t=15)),
]

SPELLING = {s.name: s for s in SPELLINGS}


# --- mutants ---------------------------------------------------------------------------------

class MaskDiagonalOff(PlainChunks):
    diagonal = -1  # the intra-chunk causal mask drops the diagonal: o_t misses k_t v_t^T


class CarryDecayWrongSign(PlainChunks):
    def carry(self, S, k_i, v_i, G_i):
        end = G_i[:, -1]
        written = torch.einsum("bchk,bchv->bhkv", k_i * (end[:, None] - G_i).exp()[..., None],
                               v_i)
        return S * (-end).exp()[..., None, None] + written  # exp(-G_end): grows


class CarryNotDecayed(PlainChunks):
    def carry(self, S, k_i, v_i, G_i):
        end = G_i[:, -1]
        written = torch.einsum("bchk,bchv->bhkv", k_i * (end[:, None] - G_i).exp()[..., None],
                               v_i)
        return S + written  # the carried state misses the chunk's total decay


class IntraDropped(PlainChunks):
    def intra(self, q_i, k_i, v_i, G_i, mask):
        return torch.zeros_like(v_i)  # no intra-chunk term: o reads the carried state only


class StaleState(PlainChunks):
    def forward(self, q, k, v, g, s0):
        t, c = q.shape[1], self.chunk
        q, k, v, G, mask = self.prepare(q, k, v, g)
        S, read, outs = s0, s0, []
        for i in range(G.shape[1]):
            q_i, k_i, v_i = (x[:, i * c:(i + 1) * c] for x in (q, k, v))
            # reads the state carried into the previous chunk: that chunk's writes missed
            outs.append(self.inter(read, q_i, G[:, i]) + self.intra(q_i, k_i, v_i, G[:, i], mask))
            read, S = S, self.carry(S, k_i, v_i, G[:, i])
        return torch.cat(outs, 1)[:, :t], self.final(S)


class FinalDoubled(PlainChunks):
    def final(self, S):
        return 2 * S  # the final state only, doubled


# inside=False: the final state doubled outside a right region; a per-chunk loop's chunks
# before the edit are right (each, or all of them, may fuse; the edited chunk must stay)
MUTANTS = [
    Mutant("mask_diagonal_off", "plain_chunks", MaskDiagonalOff,
           "the intra-chunk causal mask tril(diagonal=-1) where 0 is right"),
    Mutant("carry_decay_wrong_sign", "plain_chunks", CarryDecayWrongSign,
           "the inter-chunk pass decays the state by exp(-G_end)"),
    Mutant("carry_not_decayed", "plain_chunks", CarryNotDecayed,
           "the inter-chunk state is not decayed by the chunk's total decay"),
    Mutant("intra_dropped", "plain_chunks", IntraDropped, "the intra-chunk term dropped"),
    Mutant("stale_state", "plain_chunks", StaleState,
           "each chunk reads the state carried into the chunk before it (one chunk's writes "
           "skipped)"),
    Mutant("final_doubled", "plain_chunks", FinalDoubled, "the final state (only) times 2",
           inside=False),
    Mutant("minimal_ssd_diagonal_off", "minimal_ssd", partial(MinimalSSD, intra_diagonal=-1),
           "the segment sum's mask within blocks tril(diagonal=-1) where 0 is right"),
    Mutant("fla_chunk_end_off", "fla_chunk_simple_gla", partial(FlaChunkSimpleGLA, chunk_end=-2),
           "the chunk's total decay read one position early (G[..., -2])"),
    Mutant("retention_cross_undecayed", "chunkwise_retention",
           partial(ChunkwiseRetention, cross_decay=False),
           "the cross-chunk readout misses the in-chunk decay exp(G_i)"),
    Mutant("hf_segment_sum_diagonal_off", "hf_ssd_c16_t37_groups2",
           partial(HFMamba2SegmentSumOff, 4, 16),
           "transformers' segment_sum (both its uses: within chunks and between chunk "
           "states) with its causal mask tril(diagonal=-1) where 0 is right"),
    Mutant("bmm_last_chunk_without_intra", "bmm_chunks", partial(BmmChunks, last_intra=False),
           "the short last chunk misses its intra-chunk term", inside=False),
    Mutant("bmm_stale_state", "bmm_chunks", partial(BmmChunks, stale=True),
           "each chunk reads the state carried into the chunk before it", inside=False),
]

MUTANT = {m.name: m for m in MUTANTS}
