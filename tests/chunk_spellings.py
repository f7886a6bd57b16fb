"""A corpus of the CHUNKED gated delta rule as other authors spell it, and one-change mutants.

Each spelling computes what the recurrence computes (o, final state for q, k, v, g, beta, s0),
but by the chunked (WY) algebra: per chunk of C positions, a cumulative decay, the strictly
lower matrix A = beta k k^T e^(G_i - G_j), its inverse (I + A)^-1 by forward substitution, the
intra-chunk part and the part read from the state carried from chunk to chunk. The spellings
are written the way their authors write them (FLA's naive chunk references: einsum / ``@``,
rearranges spelled with torch reshapes, triu masks, the in-loop solve, chunk size 64, their
argument orders and layouts; FLA's KDA, whose chunk is its ``chunk_size`` argument, at 16 or 32:
its unrolled graph is 2-4x smaller, and transformers' own chunk-64 KDA is exported whole by
tests/test_collapse_models.py). Nothing here imports gdn_fx: this is what a recognizer is tested
on. ``reference(args, scan)`` recomputes a spelling's outputs with a canonical-layout ``scan``
the test supplies (the arithmetic of the oracle is the test's own).

``MUTANTS``: one small edit of a spelling that is no longer the delta rule; each must stay
unfused with a near-miss.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn


# --- FLA's naive chunk references, as FLA writes them ---------------------------------------

def _chunks_head_major(x, chunk):
    """'b h (n c) d -> b h n c d' (einops in FLA, a view here)."""
    return x.view(x.shape[0], x.shape[1], -1, chunk, x.shape[-1])


def fla_naive_chunk_gdn(q, k, v, g, beta, chunk_size=64, scale=None, initial_state=None,
                        output_final_state=False, *, solve_mask_diagonal=0, chunk_end=-1,
                        carry=True):
    """Follows fla/ops/gated_delta_rule/naive.py's naive_chunk_gated_delta_rule: head-major
    f32, F.pad to a multiple of the chunk size, v and k scaled by beta before chunking, an
    L mask of exp'd decay differences, the in-loop forward substitution on all chunks at once,
    then a loop over chunks with ``@``. The keyword-only arguments are the mutants' one edit
    (defaults: FLA's spelling)."""
    BT = chunk_size
    if scale is None:
        scale = 1 / (q.shape[-1] ** 0.5)
    q, k, v, beta, g = map(lambda x: x.transpose(1, 2).contiguous().to(torch.float32),
                           [q, k, v, beta, g])
    T = q.shape[-2]
    pad_len = (BT - (T % BT)) % BT
    if pad_len > 0:
        q = F.pad(q, (0, 0, 0, pad_len))
        k = F.pad(k, (0, 0, 0, pad_len))
        v = F.pad(v, (0, 0, 0, pad_len))
        beta = F.pad(beta, (0, pad_len))
        g = F.pad(g, (0, pad_len))
    q, k, v, beta, g = map(lambda x: x.to(torch.float32), [q, k, v, beta, g])
    decay = g
    chunk_size = BT
    b, h, l, d_k = q.shape
    d_v = v.shape[-1]
    q = q * scale
    v = v * beta[..., None]
    k_beta = k * beta[..., None]
    mask = torch.triu(torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device),
                      diagonal=solve_mask_diagonal)
    q, k, v, k_beta, decay = map(lambda x: _chunks_head_major(x, chunk_size),
                                 [q, k, v, k_beta, decay.unsqueeze(-1)])
    decay = decay.squeeze(-1).cumsum(-1)
    decay_exp = decay.exp()[..., None]
    L_mask = ((decay.unsqueeze(-1) - decay.unsqueeze(-2)).tril().exp().float()).tril()
    attn = -((k_beta @ k.transpose(-1, -2)) * L_mask).masked_fill(mask, 0)
    for i in range(1, chunk_size):
        attn[..., i, :i] = attn[..., i, :i].clone() + (
            attn[..., i, :i, None].clone() * attn[..., :i, :i].clone()).sum(-2)
    attn = attn + torch.eye(chunk_size, dtype=torch.float, device=q.device)
    k_cumsum = attn @ v
    k_cumdecay = attn @ (k_beta * decay_exp)
    v = k_cumsum
    S = k.new_zeros(b, h, d_k, d_v)
    if initial_state is not None:
        S = initial_state.to(torch.float32)
    o = torch.zeros_like(v)
    mask = torch.triu(torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device),
                      diagonal=1)
    for i in range(0, l // chunk_size):
        q_i, k_i, v_i = q[:, :, i], k[:, :, i], v[:, :, i]
        attn = (q_i @ k_i.transpose(-1, -2) * L_mask[:, :, i]).masked_fill_(mask, 0)
        v_prime = (k_cumdecay[:, :, i]) @ S
        v_new = v_i - v_prime
        o_inter = (q_i * decay[:, :, i, :, None].exp()) @ S
        o[:, :, i] = o_inter + attn @ v_new
        new_S = S * decay[:, :, i, chunk_end, None, None].exp() + (
            k_i * (decay[:, :, i, chunk_end, None] - decay[:, :, i]).exp()[..., None]
        ).transpose(-1, -2) @ v_new
        S = new_S if carry else S
    if not output_final_state:
        S = None
    o = o.view(o.shape[0], o.shape[1], -1, o.shape[-1])  # 'b h n c d -> b h (n c) d'
    o = o[:, :, :T]
    o = o.transpose(1, 2)
    return o, S


def _chunks_seq_major(x, chunk):
    """'b (n c) h ... -> b h n c ...' (einops in FLA): a view, then heads to the front."""
    b, t, h = x.shape[:3]
    x = x.view(b, t // chunk, chunk, h, *x.shape[3:])
    return x.permute(0, 3, 1, 2, *range(4, x.dim()))


def fla_naive_chunk_kda(q, k, v, g, beta, scale=None, initial_state=None,
                        output_final_state=False, chunk_size=64, *, beta_on_columns=True,
                        qk_gate_sign=1.0, k_tiled=False):
    """Follows fla/ops/kda/naive.py's naive_chunk_kda: sequence-major inputs with T a multiple
    of the chunk size, repeat_interleave for grouped value heads after chunking, per-key
    decays, A built one column at a time by einsum, the in-loop solve, S = new_zeros then
    ``S += initial_state``, Aqk one column at a time inside the chunk loop, ``S +=``. The
    keyword-only arguments are the mutants' one edit (defaults: FLA's spelling)."""
    dtype = v.dtype
    B, T, H, K, HV, V = *q.shape, v.shape[2], v.shape[-1]
    G = HV // H
    BT = chunk_size
    NT = T // BT
    if scale is None:
        scale = K ** -0.5
    q, k = [_chunks_seq_major(x, BT).to(torch.float) for x in [q, k]]
    v, g, beta = [_chunks_seq_major(x, BT).to(torch.float) for x in [v, g, beta]]
    q = q.repeat_interleave(G, dim=1) * scale
    k = k.repeat(1, G, 1, 1, 1) if k_tiled else k.repeat_interleave(G, dim=1)
    g = g.cumsum(-2)
    mask = torch.triu(torch.ones(BT, BT, dtype=torch.bool, device=q.device), diagonal=0)
    A = torch.zeros(*g.shape[:-1], BT, dtype=torch.float, device=q.device)
    for i in range(BT):
        k_i = k[..., i, :]
        g_i = g[..., i:i + 1, :]
        A[..., i] = torch.einsum("... c d, ... d -> ... c", k * (g - g_i).exp(), k_i)
    A = A * beta[..., None]
    A = -A.masked_fill(mask, 0)
    for i in range(1, BT):
        A[..., i, :i] = A[..., i, :i].clone() + (A[..., i, :, None].clone()
                                                 * A[..., :, :i].clone()).sum(-2)
    A = A + torch.eye(BT, dtype=torch.float, device=q.device)
    if beta_on_columns:
        A = A * beta[..., None, :]
    w = A @ (g.exp() * k)
    u = A @ v
    S = k.new_zeros(B, HV, K, V).to(q)
    if initial_state is not None:
        S += initial_state
    o = torch.zeros_like(v)
    mask = torch.triu(torch.ones(BT, BT, dtype=torch.bool, device=q.device), diagonal=1)
    for i in range(0, NT):
        q_i = q[:, :, i]
        k_i = k[:, :, i]
        u_i = u[:, :, i]
        g_i = g[:, :, i]
        w_i = w[:, :, i]
        Aqk = torch.zeros(B, HV, BT, BT, dtype=torch.float, device=q.device)
        for j in range(BT):
            k_j = k[:, :, i, j]
            g_j = g[:, :, i, j:j + 1, :]
            Aqk[..., j] = torch.einsum("... c d, ... d -> ... c",
                                       q_i * (qk_gate_sign * (g_i - g_j)).exp(), k_j)
        Aqk = Aqk.masked_fill(mask, 0)
        v_i = u_i - w_i @ S
        o[:, :, i] = (q_i * g_i.exp()) @ S + Aqk @ v_i
        S = S * g_i[:, :, -1].exp().unsqueeze(-1)  # rearrange 'b h k -> b h k 1'
        S += ((g_i[:, :, -1:] - g_i).exp() * k_i).transpose(-1, -2) @ v_i
    if not output_final_state:
        S = None
    o = o.permute(0, 2, 3, 1, 4)  # 'b h n c d -> b (n c) h d'
    return o.reshape(B, T, HV, V).to(dtype), S


# --- another author: batch and heads merged, everything per chunk, bmm ----------------------

def bmm_chunk_gdn(q, k, v, g, beta, s0, chunk=16, *, decay_inside=True):
    """The chunked rule as one might write it without FLA: [B*H, T, D] tensors, a loop over
    chunks that builds each chunk's WY matrices itself with ``torch.bmm``, the inverse by a
    row-by-row solve written with matmul, q scaled by 1/sqrt(Dk) in the loop, T a multiple
    of the chunk size. Inputs and outputs sequence-major; the state key-first."""
    B, T, H, K = q.shape
    V = v.shape[-1]

    def merge(x):
        return x.transpose(1, 2).reshape(B * H, T, *x.shape[3:])

    q, k, v, g, beta = map(merge, (q, k, v, g, beta))
    S = s0.reshape(B * H, K, V)
    outs = []
    strict = torch.tril(torch.ones(chunk, chunk), diagonal=-1)
    lower = torch.tril(torch.ones(chunk, chunk))
    for start in range(0, T, chunk):
        qc, kc, vc = (x[:, start:start + chunk] for x in (q, k, v))
        gc = g[:, start:start + chunk].cumsum(-1)
        bc = beta[:, start:start + chunk]
        diff = (gc[:, :, None] - gc[:, None, :]) * lower
        A = torch.bmm(kc * bc[..., None], kc.transpose(1, 2)) * diff.exp() * strict
        inv = torch.eye(chunk).expand(B * H, chunk, chunk).clone()
        for r in range(1, chunk):
            inv[:, r] = inv[:, r] - torch.bmm(A[:, r:r + 1, :r], inv[:, :r]).squeeze(1)
        w = torch.bmm(inv, kc * (bc * gc.exp())[..., None])
        u = torch.bmm(inv, vc * bc[..., None])
        new_v = u - torch.bmm(w, S)
        qs = qc * K ** -0.5
        scores = torch.bmm(qs, kc.transpose(1, 2)) * diff.exp() * lower
        inter = torch.bmm(qs * gc.exp()[..., None], S) if decay_inside else torch.bmm(qs, S)
        outs.append(inter + torch.bmm(scores, new_v))
        last = gc[:, -1:]
        S = S * last.exp()[..., None] + torch.bmm(
            (kc * (last - gc).exp()[..., None]).transpose(1, 2), new_v)
    o = torch.cat(outs, 1).reshape(B, H, T, V).transpose(1, 2)
    return o, S.reshape(B, H, K, V)


# --- modules ----------------------------------------------------------------------------

class FlaChunkGDN(nn.Module):
    """FLA's naive_chunk_gated_delta_rule with an initial state and the final state out."""

    def __init__(self, **edit):
        super().__init__()
        self.edit = edit

    def forward(self, q, k, v, g, beta, s0):
        return fla_naive_chunk_gdn(q, k, v, g, beta, initial_state=s0,
                                   output_final_state=True, **self.edit)


class FlaChunkGDNNoState(nn.Module):
    """FLA's naive_chunk_gated_delta_rule called as `o, _ = f(q, k, v, g, beta)`."""

    def forward(self, q, k, v, g, beta):
        o, _ = fla_naive_chunk_gdn(q, k, v, g, beta)
        return o


class FlaChunkKDA(nn.Module):
    """FLA's naive_chunk_kda (grouped value heads allowed), initial and final state."""

    def __init__(self, **edit):
        super().__init__()
        self.edit = edit

    def forward(self, q, k, v, g, beta, s0):
        return fla_naive_chunk_kda(q, k, v, g, beta, initial_state=s0, output_final_state=True,
                                   **self.edit)


class GroupedFlaChunkGDN(nn.Module):
    """Grouped value heads as Qwen3-Next's layer hands them to a chunk kernel: q and k of Hk
    heads repeated to the value heads by the caller (``repeat_interleave`` on the head axis:
    value head h reads key head h // G; ``tiled``: ``repeat``, h % Hk), then FLA's
    naive_chunk_gated_delta_rule."""

    def __init__(self, tiled=False):
        super().__init__()
        self.tiled = tiled

    def forward(self, q, k, v, g, beta, s0):
        groups = v.shape[2] // q.shape[2]
        if self.tiled:
            q, k = (x.repeat(1, 1, groups, 1) for x in (q, k))
        else:
            q, k = (x.repeat_interleave(groups, dim=2) for x in (q, k))
        return fla_naive_chunk_gdn(q, k, v, g, beta, initial_state=s0,
                                   output_final_state=True)


class BmmChunkGDN(nn.Module):
    """A per-chunk loop with bmm, heads merged, chunk size 16."""

    def __init__(self, **edit):
        super().__init__()
        self.edit = edit

    def forward(self, q, k, v, g, beta, s0):
        return bmm_chunk_gdn(q, k, v, g, beta, s0, **self.edit)


class TwoFlaChunkLayers(nn.Module):
    """Two FLA chunk calls in a row, the second reading the first's output and final state
    (keys and queries swapped, gate and beta changed by the caller)."""

    def forward(self, q, k, v, g, beta, s0):
        o1, s1 = fla_naive_chunk_gdn(q, k, v, g, beta, initial_state=s0,
                                     output_final_state=True)
        o2, s2 = fla_naive_chunk_gdn(k, q, o1.contiguous(), g * 0.5, 1 - beta,
                                     initial_state=s1, output_final_state=True)
        return o2, s1, s2


# --- inputs and references ----------------------------------------------------------------

def operands(b, t, h, dk, dv, *, hk=None, kda=False, seed=0) -> dict:
    """Sequence-major operands: q, k [B, T, Hk, Dk] (k of norm ~1, as after an l2norm: the
    chunked algebra is only well conditioned then), v [B, T, H, Dv], g (log decay in
    [-0.5, -0.01]) [B, T, H] or [B, T, H, Dk], beta in [0.05, 0.95] [B, T, H], s0
    [B, H, Dk, Dv]."""
    gen = torch.Generator().manual_seed(seed)
    hk = hk or h

    def unit_rows(*shape):
        x = torch.randn(*shape, generator=gen)
        return x / x.norm(dim=-1, keepdim=True)

    gate = (b, t, h, dk) if kda else (b, t, h)
    return {"q": unit_rows(b, t, hk, dk), "k": unit_rows(b, t, hk, dk),
            "v": torch.randn(b, t, h, dv, generator=gen),
            "g": -(torch.rand(*gate, generator=gen) * 0.49 + 0.01),
            "beta": torch.rand(b, t, h, generator=gen) * 0.9 + 0.05,
            "s0": torch.randn(b, h, dk, dv, generator=gen) * 0.5}


def inputs(b, t, h, dk, dv, *, state=True, **kw) -> Callable[[], tuple]:
    def build():
        x = operands(b, t, h, dk, dv, **kw)
        names = ("q", "k", "v", "g", "beta") + (("s0",) if state else ())
        return tuple(x[n] for n in names)
    return build


def reference(*, state=True, final_state=True, scale="rsqrt", tiled=False):
    """(args, scan) -> outputs, for a module taking (q, k, v, g, beta[, s0]) sequence-major;
    ``scan`` reads q and k of Hk heads grouped (value head h reads key head h // G);
    ``tiled``: the module reads key head h % Hk, so q and k are tiled to the value heads here
    first."""
    def recompute(args, scan):
        q, k = args[:2]
        factor = q.shape[-1] ** -0.5 if scale == "rsqrt" else scale
        if tiled:
            groups = args[2].shape[2] // q.shape[2]
            q, k = (torch.cat([x] * groups, dim=2) for x in (q, k))
        o, s = scan(q, k, *args[2:5], args[5] if state else None, scale=factor, norm=None)
        return (o, s) if final_state else o
    return recompute


@dataclass(frozen=True)
class Spelling:
    name: str
    family: str  # "gdn" or "kda"
    module: Callable[[], nn.Module]
    inputs: Callable[[], tuple]
    reference: Callable


@dataclass(frozen=True)
class Mutant:
    name: str
    base: str  # the Spelling it is one edit away from (its inputs are the base's)
    module: Callable[[], nn.Module]
    change: str


SPELLINGS = [
    # FLA GDN: T = 70 pads to two chunks of 64; T = 64 is one chunk, no pad
    Spelling("fla_chunk_gdn", "gdn", FlaChunkGDN, inputs(1, 70, 2, 8, 6, seed=1),
             reference()),
    Spelling("fla_chunk_gdn_one_chunk", "gdn", FlaChunkGDN, inputs(2, 64, 2, 4, 4, seed=2),
             reference()),
    Spelling("fla_chunk_gdn_no_state", "gdn", FlaChunkGDNNoState,
             inputs(1, 20, 3, 8, 8, state=False, seed=3),
             reference(state=False, final_state=False)),
    # FLA KDA: T a multiple of the chunk (as it requires); one key head per value head; two
    # chunks of 16, one of 32
    Spelling("fla_chunk_kda", "kda", lambda: FlaChunkKDA(chunk_size=16),
             inputs(1, 32, 2, 8, 6, kda=True, seed=4), reference()),
    Spelling("fla_chunk_kda_one_chunk", "kda", lambda: FlaChunkKDA(chunk_size=32),
             inputs(1, 32, 2, 4, 4, kda=True, seed=5), reference()),
    # grouped value heads (GQA): FLA's KDA repeats q and k itself, after chunking; a caller
    # repeats them for FLA's GDN, interleaved (Qwen3-Next's habit) or tiled
    Spelling("fla_chunk_kda_gqa", "kda", lambda: FlaChunkKDA(chunk_size=16),
             inputs(1, 32, 6, 4, 4, hk=3, kda=True, seed=7), reference()),
    Spelling("fla_chunk_gdn_gqa", "gdn", GroupedFlaChunkGDN,
             inputs(1, 70, 4, 8, 6, hk=2, seed=8), reference()),
    Spelling("fla_chunk_gdn_gqa_tiled", "gdn", lambda: GroupedFlaChunkGDN(tiled=True),
             inputs(1, 70, 4, 8, 6, hk=2, seed=9), reference(tiled=True)),
    # another author: chunk 16, bmm, merged heads
    Spelling("bmm_chunk16_gdn", "gdn", BmmChunkGDN, inputs(2, 48, 2, 8, 4, seed=6),
             reference()),
]
SPELLING = {s.name: s for s in SPELLINGS}

MUTANTS = [
    Mutant("fla_gdn_solve_mask_keeps_diagonal", "fla_chunk_gdn",
           lambda: FlaChunkGDN(solve_mask_diagonal=1),
           "the solve's mask keeps the diagonal of A (triu(.., diagonal=1), not 0)"),
    Mutant("fla_gdn_chunk_decay_one_early", "fla_chunk_gdn", lambda: FlaChunkGDN(chunk_end=-2),
           "the state's decay over a chunk read one position early (decay[..., -2])"),
    Mutant("fla_gdn_state_not_carried", "fla_chunk_gdn", lambda: FlaChunkGDN(carry=False),
           "every chunk reads the initial state: the state is not carried"),
    Mutant("fla_kda_beta_off_columns", "fla_chunk_kda",
           lambda: FlaChunkKDA(chunk_size=16, beta_on_columns=False),
           "(I + A)^-1 not scaled by beta on its columns"),
    Mutant("fla_kda_qk_gate_sign", "fla_chunk_kda",
           lambda: FlaChunkKDA(chunk_size=16, qk_gate_sign=-1.0),
           "the intra-chunk q k^T decays e^(G_j - G_i) instead of e^(G_i - G_j)"),
    Mutant("fla_kda_gqa_k_tiled", "fla_chunk_kda_gqa",
           lambda: FlaChunkKDA(chunk_size=16, k_tiled=True),
           "k repeated to the value heads tiled (k.repeat) while q is interleaved: value "
           "head h pairs q of key head h // G with k of key head h % Hk (two chunks: the "
           "repeats act on chunked tensors, so the region must start before them)"),
    Mutant("bmm_inter_without_decay", "bmm_chunk16_gdn",
           lambda: BmmChunkGDN(decay_inside=False),
           "the readout from the carried state misses the in-chunk decay e^G_i"),
]
MUTANT = {m.name: m for m in MUTANTS}
