"""A held-out corpus of Mamba1's selective scan as other authors write it, and one-change
mutants.

Every spelling computes, per channel d of a state without a value axis x [B, D, N]:

    x_t = exp(dt_t A) * x_{t-1} + dt_t B_t u_t ;   y_t = x_t C_t   (sum over the state axis N)

then, where its author adds them, a skip y + u D, a gate y * silu(z), dt + bias and
softplus(dt) before the scan, and the last state out. In gated_linear_scan's canonical layout
that is H = D heads with Dv = 1: q = C and k = B on one key head shared by every channel
(on G heads where B and C come per channel group), v = dt u [B, L, D, 1], the log decay
g = dt A per (channel, state entry) [B, L, D, N], the state [B, D, N, 1].

Each is written the way some other author writes it: transformers' ``mamba_selective_scan``
called directly, mamba_ssm's ``selective_scan_ref`` (kernel layout [B, D, L]: einsums
'bdl,dn->bdln' and 'bdl,bnl,bdl->bdln' before the loop, ys stacked on dim 2), with B and C per
channel group (repeated to the channels before the loop, or broadcast group-wise inside it),
mamba-minimal's [B, L, D] layout (time axis 1), in-place loops into preallocated buffers, a
Mamba1 decode step (mamba.py's ``ssm_step``) run over the sequence, discretizing inside the
loop, mamba.py's sequential scan (the states stacked, read after the loop), and the plain
loop (its state from zeros_like, or its skip and gate inside it). Nothing here imports
gdn_fx (nor transformers at import time).

``SPELLINGS``: the correct ones, as ``linear_spellings.Spelling`` records: ``args(which,
seed)`` ('example': dt of order 0.2, values of order 1; 'wide': dt up to ~10.5 so that dt A
reaches -50 and below, u, z and states of order 1e3) and ``reference(module, args, scan)``:
the module's outputs recomputed by the test's canonical-layout ``scan(q, k, v, g, s0,
scale=)`` (q, k [B, T, Hk, Dk], v [B, T, H, Dv], g [B, T, H, Dk], s0 [B, H, Dk, Dv]; value
head h reads key head h // (H // Hk)).

``MUTANTS``: one edit of ``PlainSelectiveScan`` (its inputs). ``inside``: no op computes the
edited loop from its reads, so nothing may fuse. The others change what the loop reads (the
write is formed before the loop and read whole, so dA * dBu or 2 dBu is just another write,
a shifted or clamped decay just another decay) and may fuse only into what computes them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from linear_spellings import Mutant, Spelling

BATCH, D, N, L = 2, 6, 4, 5  # every axis a different length
G = 2  # channel groups of the grouped variants (D = G * 3)


# --- parameters and inputs -----------------------------------------------------------------

def a_log(d: int = D, n: int = N) -> torch.Tensor:
    """A = -exp(A_log) spread over [-5, -0.5]: with dt up to ~10.5, dt A reaches below -50."""
    return torch.log(torch.linspace(0.5, 5.0, d * n)).reshape(d, n)


class SelectiveParams(nn.Module):
    """Mamba1's parameters: A_log [D, N], the skip D [D], dt's bias [D]."""

    def __init__(self):
        super().__init__()
        self.A_log = nn.Parameter(a_log())
        self.D = nn.Parameter(torch.linspace(-1.0, 1.0, D))
        self.delta_bias = nn.Parameter(torch.linspace(-0.5, 0.5, D))


def selective_args(*, layout: str = "bdl", softplus: bool = False, z: bool = False,
                   groups: int | None = None, state: bool = False):
    """``build(which, seed, batch=BATCH)`` -> (u, dt, B, C[, z][, x0]): u, dt, z [B, D, L]
    ('bdl', the kernel's) or [B, L, D] ('bld'); B, C [B, N, L] or [B, L, N], or [B, groups,
    N, L]; x0 [B, D, N]. dt is positive (0.05 .. 0.3; 'wide': up to 10, every 7th 10) or,
    with ``softplus``, its preimage (softplus(dt + bias) of the same order)."""
    def build(which: str = "example", seed: int = 0, batch: int = BATCH):
        wide = which == "wide"
        gen = torch.Generator().manual_seed(seed + (7919 if wide else 0) + 31)
        big = 1e3 if wide else 1.0

        def rnd(*shape, s=1.0):
            return torch.randn(*shape, generator=gen) * s

        r = torch.rand(batch, D, L, generator=gen)
        if wide:
            dt = 10.0 * r ** 3
            dt.view(-1)[::7] = 10.0
        else:
            dt = 0.05 + 0.25 * r
        if softplus:  # softplus^-1 (the module adds its bias after: within +-0.5)
            dt = torch.where(dt > 20, dt, torch.log(torch.expm1(dt)))
        bc = (batch, N, L) if groups is None else (batch, groups, N, L)
        u, Bm, Cm = rnd(batch, D, L, s=big), rnd(*bc, s=0.5), rnd(*bc)
        out = [u, dt, Bm, Cm]
        if z:
            out.append(rnd(batch, D, L, s=3.0 if wide else 1.0))
        if state:
            out.append(rnd(batch, D, N, s=0.5 * big))
        if layout == "bld":
            out = [x.transpose(1, 2).contiguous() if x.dim() == 3 and x.shape[1:] != (D, N)
                   else x for x in out]
        return tuple(out)
    return build


def selective_reference(*, layout: str = "bdl", bias: bool = False, softplus: bool = False,
                        skip: bool = False, z: bool = False, state: bool = False,
                        last: bool = False):
    """``reference(module, args, scan)`` for a module taking ``selective_args(...)`` inputs,
    A = -exp(module.A_log) (and module.D, module.delta_bias where used), returning y [and
    the last state]: y recomputed in float64 by the test's canonical ``scan``."""
    def reference(module, args, scan):
        args = [a.detach().double() for a in args]
        if layout == "bld":
            args = [a.transpose(1, 2) if a.dim() == 3 and a.shape[1:] != (D, N) else a
                    for a in args]
        u, dt, Bm, Cm = args[:4]
        rest = args[4:]
        gate = rest.pop(0) if z else None
        x0 = rest.pop(0) if state else None
        A = -torch.exp(module.A_log.detach().double())
        if bias:
            dt = dt + module.delta_bias.detach().double()[:, None]
        if softplus:
            dt = F.softplus(dt)

        def keys(m):  # [B, N, L] or [B, G, N, L] -> [B, L, Hk, N]
            return m.transpose(1, 2)[:, :, None] if m.dim() == 3 else m.permute(0, 3, 1, 2)

        v = (dt * u).transpose(1, 2)[..., None]  # [B, L, D, 1]
        g = (dt[..., None] * A[None, :, None, :]).transpose(1, 2)  # [B, L, D, N]
        o, S = scan(keys(Cm), keys(Bm), v, g, None if x0 is None else x0[..., None], scale=1.0)
        y = o[..., 0].transpose(1, 2)  # [B, D, L]
        if skip:
            y = y + u * module.D.detach().double()[:, None]
        if gate is not None:
            y = y * F.silu(gate)
        if layout == "bld":
            y = y.transpose(1, 2)
        return (y, S[..., 0]) if last else y
    return reference


# --- transformers: mamba_selective_scan called directly --------------------------------------

class HFSelectiveScan(SelectiveParams):
    """transformers' mamba_selective_scan(u, dt, A, B, C, D, z=z, delta_bias=, softplus,
    return_last_state=) with A = -exp(A_log) a parameter; which of D, z, the bias and the last
    state are passed is the spelling's."""

    skip, gate, bias, last = True, True, True, True

    def forward(self, u, dt, Bm, Cm, *rest):
        from transformers.models.mamba.modeling_mamba import mamba_selective_scan

        A = -torch.exp(self.A_log.float())
        return mamba_selective_scan(u, dt, A, Bm, Cm, self.D if self.skip else None,
                                    z=rest[0] if self.gate else None,
                                    delta_bias=self.delta_bias if self.bias else None,
                                    delta_softplus=self.bias, return_last_state=self.last)


class HFFull(HFSelectiveScan):
    """transformers' mamba_selective_scan with D, z, the bias + softplus and the last state."""


class HFNoZ(HFSelectiveScan):
    """transformers' mamba_selective_scan with D, no z, the last state out."""
    gate = False


class HFNoD(HFSelectiveScan):
    """transformers' mamba_selective_scan with z, no D, y only (return_last_state=False)."""
    skip, last = False, False


class HFBare(HFSelectiveScan):
    """transformers' mamba_selective_scan with neither D nor z, a positive dt (no bias, no
    softplus), the last state out."""
    skip, gate, bias = False, False, False


class HFOutOnly(HFSelectiveScan):
    """transformers' mamba_selective_scan with D and z, y only."""
    last = False


# --- mamba_ssm: selective_scan_ref ----------------------------------------------------------

def ssm_scan_ref(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                 return_last_state=False):
    """mamba_ssm's reference selective scan as its authors lay it out, in other words: the
    kernel layout [B, D, L], f32, the discretization before the loop by einsum, one step per
    position, ys stacked on dim 2, the skip and the silu gate after."""
    in_dtype = u.dtype
    u, delta = u.float(), delta.float()
    if delta_bias is not None:
        delta = delta + delta_bias[..., None].float()
    if delta_softplus:
        delta = F.softplus(delta)
    n_batch, n_chan, n_state = u.shape[0], A.shape[0], A.shape[1]
    B, C = B.float(), C.float()
    deltaA = torch.exp(torch.einsum("bdl,dn->bdln", delta, A))
    if B.dim() == 3:
        deltaB_u = torch.einsum("bdl,bnl,bdl->bdln", delta, B, u)
    else:  # per channel group: repeat each group's B over its channels
        B = B.repeat_interleave(n_chan // B.shape[1], dim=1)
        deltaB_u = torch.einsum("bdl,bdnl,bdl->bdln", delta, B, u)
    if C.dim() == 4:
        C = C.repeat_interleave(n_chan // C.shape[1], dim=1)
    x = A.new_zeros((n_batch, n_chan, n_state))
    ys, last_state = [], None
    for i in range(u.shape[2]):
        x = deltaA[:, :, i] * x + deltaB_u[:, :, i]
        if C.dim() == 3:
            y = torch.einsum("bdn,bn->bd", x, C[:, :, i])
        else:
            y = torch.einsum("bdn,bdn->bd", x, C[:, :, :, i])
        if i == u.shape[2] - 1:
            last_state = x
        ys.append(y)
    y = torch.stack(ys, dim=2)
    out = y if D is None else y + u * D[:, None]
    if z is not None:
        out = out * F.silu(z)
    out = out.to(in_dtype)
    return (out, last_state) if return_last_state else out


class SsmRefFull(SelectiveParams):
    """mamba_ssm's selective_scan_ref with D, z, the bias + softplus and the last state."""

    def forward(self, u, delta, Bm, Cm, z):
        A = -torch.exp(self.A_log.float())
        return ssm_scan_ref(u, delta, A, Bm, Cm, self.D.float(), z, self.delta_bias, True,
                            return_last_state=True)


class SsmRefPlain(SelectiveParams):
    """mamba_ssm's selective_scan_ref without D, z or the bias: y only."""

    def forward(self, u, delta, Bm, Cm):
        return ssm_scan_ref(u, delta, -torch.exp(self.A_log.float()), Bm, Cm)


class SsmRefGroups(SelectiveParams):
    """selective_scan_ref with B and C per channel group [B, G, N, L], repeated over each
    group's channels before the loop; D and the last state."""

    def forward(self, u, delta, Bm, Cm):
        A = -torch.exp(self.A_log.float())
        return ssm_scan_ref(u, delta, A, Bm, Cm, self.D.float(), return_last_state=True)


# --- per channel group, broadcast inside the loop -------------------------------------------

class GroupsInLoop(SelectiveParams):
    """B and C per channel group [B, G, N, L], never repeated: the write formed group-wise
    before the loop, the readout broadcasts each group's C over its channels inside the loop
    (the state viewed [B, G, D / G, N], C read [B, G, N] per position); y only."""

    def forward(self, u, delta, Bm, Cm):
        b, d, l = u.shape
        groups, n = Bm.shape[1], Bm.shape[2]
        A = -torch.exp(self.A_log)
        deltaA = torch.exp(delta[..., None] * A[:, None, :])  # [B, D, L, N]
        du = (delta * u).view(b, groups, d // groups, l)
        deltaB_u = (du[..., None] * Bm.transpose(2, 3)[:, :, None]).reshape(b, d, l, n)
        x = u.new_zeros(b, d, n)
        ys = []
        for i in range(l):
            x = deltaA[:, :, i] * x + deltaB_u[:, :, i]
            C_i = Cm[:, :, :, i]  # [B, G, N]
            y = (x.view(b, groups, d // groups, n) * C_i[:, :, None, :]).sum(-1)
            ys.append(y.reshape(b, d))
        return torch.stack(ys, dim=2)


# --- mamba-minimal (johnma2006): [B, L, D] -------------------------------------------------

class MinimalScan(SelectiveParams):
    """mamba-minimal's selective_scan: [B, L, D] in, deltaA = exp(einsum('b l d, d n -> b l d
    n')), deltaB_u = einsum('b l d, b l n, b l d -> b l d n'), x from zeros, ys stacked on dim
    1, y + u * D."""

    def forward(self, u, delta, Bm, Cm):
        A = -torch.exp(self.A_log.float())
        b, l, d_in = u.shape
        n = A.shape[1]
        deltaA = torch.exp(torch.einsum("b l d, d n -> b l d n", delta, A))
        deltaB_u = torch.einsum("b l d, b l n, b l d -> b l d n", delta, Bm, u)
        x = torch.zeros((b, d_in, n), device=deltaA.device)
        ys = []
        for i in range(l):
            x = deltaA[:, i] * x + deltaB_u[:, i]
            y = torch.einsum("b d n, b n -> b d", x, Cm[:, i, :])
            ys.append(y)
        y = torch.stack(ys, dim=1)
        return y + u * self.D.float()


class MinimalLastState(SelectiveParams):
    """mamba-minimal's loop starting from a given state (a cache), no skip, y and the last
    state out."""

    def forward(self, u, delta, Bm, Cm, x):
        A = -torch.exp(self.A_log.float())
        deltaA = torch.exp(torch.einsum("b l d, d n -> b l d n", delta, A))
        deltaB_u = torch.einsum("b l d, b l n, b l d -> b l d n", delta, Bm, u)
        ys = []
        for i in range(u.shape[1]):
            x = deltaA[:, i] * x + deltaB_u[:, i]
            ys.append(torch.einsum("b d n, b n -> b d", x, Cm[:, i, :]))
        return torch.stack(ys, dim=1), x


# --- in place ----------------------------------------------------------------------------------

class InplaceBuffer(SelectiveParams):
    """`x = x0.clone(); x.mul_(deltaA[:, :, i]).add_(deltaB_u[:, :, i])`, y written into a
    preallocated empty buffer by einsum; kernel layout; y and the state out."""

    def forward(self, u, delta, Bm, Cm, x0):
        A = -torch.exp(self.A_log)
        deltaA = torch.exp(torch.einsum("bdl,dn->bdln", delta, A))
        deltaB_u = torch.einsum("bdl,bnl,bdl->bdln", delta, Bm, u)
        x = x0.clone()
        y = torch.empty_like(u)
        for i in range(u.shape[2]):
            x.mul_(deltaA[:, :, i]).add_(deltaB_u[:, :, i])
            y[:, :, i] = torch.einsum("bdn,bn->bd", x, Cm[:, :, i])
        return y, x


class InplaceZerosSkip(SelectiveParams):
    """In-place `x *= deltaA[..., i]; x += deltaB_u[..., i]` on new_zeros, a zeros buffer
    filled by a broadcast product summed over N, the skip added to the buffer in place."""

    def forward(self, u, delta, Bm, Cm):
        b, d, l = u.shape
        A = -torch.exp(self.A_log)
        deltaA = (delta[..., None] * A[:, None, :]).exp()
        deltaB_u = (delta * u)[..., None] * Bm.transpose(1, 2)[:, None]
        x = u.new_zeros(b, d, A.shape[1])
        y = torch.zeros(b, d, l)
        for i in range(l):
            x *= deltaA[..., i, :]
            x += deltaB_u[..., i, :]
            y[:, :, i] = (x * Cm[:, None, :, i]).sum(-1)
        y += u * self.D[:, None]
        return y


# --- a decode step run over the sequence (mamba.py's ssm_step) --------------------------------

class StepLoop(SelectiveParams):
    """Mamba1's one-token step (mamba.py's ssm_step: deltaA = exp(delta[..., None] * A),
    BX = delta[..., None] * B[:, None] * x[..., None], h = deltaA * h + BX, y = (h @
    C[..., None]).squeeze(2)) called once per position of a [B, L, D] sequence: the
    discretization inside the loop; y + D x, and h out."""

    def step(self, x, delta, Bm, Cm, h, A):
        deltaA = torch.exp(delta.unsqueeze(-1) * A)  # [B, D, N]
        BX = delta.unsqueeze(-1) * Bm.unsqueeze(1) * x.unsqueeze(-1)
        h = deltaA * h + BX
        y = (h @ Cm.unsqueeze(-1)).squeeze(2)
        return y + self.D * x, h

    def forward(self, u, delta, Bm, Cm, h):
        A = -torch.exp(self.A_log)
        ys = []
        for t in range(u.shape[1]):
            y, h = self.step(u[:, t], delta[:, t], Bm[:, t], Cm[:, t], h, A)
            ys.append(y)
        return torch.stack(ys, 1), h


# --- mamba.py (alxndrTL): the states stacked, read after the loop ----------------------------

class MambaPySeq(SelectiveParams):
    """mamba.py's selective_scan_seq: [B, L, ED] in, deltaA = exp(delta[..., None] * A), BX =
    delta[..., None] * B[:, :, None] * x[..., None], h from zeros, the loop only updates h
    and collects it; hs stacked on dim 1 and read after the loop by (hs @ C[..., None])
    .squeeze(3); y + D * x."""

    def forward(self, x, delta, Bm, Cm):
        A = -torch.exp(self.A_log.float())
        deltaA = torch.exp(delta.unsqueeze(-1) * A)  # [B, L, ED, N]
        BX = delta.unsqueeze(-1) * Bm.unsqueeze(2) * x.unsqueeze(-1)
        h = torch.zeros(x.size(0), A.shape[0], A.shape[1])
        hs = []
        for t in range(x.shape[1]):
            h = deltaA[:, t] * h + BX[:, t]
            hs.append(h)
        hs = torch.stack(hs, dim=1)
        y = (hs @ Cm.unsqueeze(-1)).squeeze(3)
        return y + self.D * x


# --- the plain loop (the mutants' base) ---------------------------------------------------------

class PlainSelectiveScan(SelectiveParams):
    """The selective scan written plainly: kernel layout, exp(dt A) and dt B u formed before
    the loop, one step method, list + stack; y and the last state out."""

    def step(self, x, dA, dBu, C_i, i, delta):
        x = dA[:, :, i] * x + dBu[:, :, i]
        return x, torch.einsum("bdn,bn->bd", x, C_i)

    def forward(self, u, delta, Bm, Cm):
        A = -torch.exp(self.A_log)
        dA = torch.exp(torch.einsum("bdl,dn->bdln", delta, A))
        dBu = torch.einsum("bdl,bnl,bdl->bdln", delta, Bm, u)
        x = u.new_zeros(u.shape[0], u.shape[1], A.shape[1])
        ys = []
        for i in range(u.shape[2]):
            x, y = self.step(x, dA, dBu, Cm[:, :, i], i, delta)
            ys.append(y)
        return torch.stack(ys, dim=2), x


class ZerosLikeState(SelectiveParams):
    """The plain loop with its state started as zeros_like(deltaB_u[:, :, 0]) (the shape of
    one position's write); y only."""

    def forward(self, u, delta, Bm, Cm):
        A = -torch.exp(self.A_log)
        dA = torch.exp(torch.einsum("bdl,dn->bdln", delta, A))
        dBu = torch.einsum("bdl,bnl,bdl->bdln", delta, Bm, u)
        x = torch.zeros_like(dBu[:, :, 0])
        ys = []
        for i in range(u.shape[2]):
            x = dA[:, :, i] * x + dBu[:, :, i]
            ys.append(torch.einsum("bdn,bn->bd", x, Cm[:, :, i]))
        return torch.stack(ys, dim=2)


class SkipGateInLoop(SelectiveParams):
    """The plain loop with the skip and the gate applied per position inside it: y_i = (x @
    C_i[..., None]).squeeze(-1) + D * u_i, times silu(z_i); y and the last state."""

    def forward(self, u, delta, Bm, Cm, z):
        A = -torch.exp(self.A_log)
        dA = torch.exp(torch.einsum("bdl,dn->bdln", delta, A))
        dBu = torch.einsum("bdl,bnl,bdl->bdln", delta, Bm, u)
        x = u.new_zeros(u.shape[0], u.shape[1], A.shape[1])
        ys = []
        for i in range(u.shape[2]):
            x = dA[:, :, i] * x + dBu[:, :, i]
            y = (x @ Cm[:, :, i].unsqueeze(-1)).squeeze(-1) + self.D * u[:, :, i]
            ys.append(y * F.silu(z[:, :, i]))
        return torch.stack(ys, dim=2), x


# --- the corpus ----------------------------------------------------------------------------------

_KERNEL = selective_args()
_BLD = dict(layout="bld")


SPELLINGS = [
    Spelling("hf_full", "transformers", HFFull, selective_args(softplus=True, z=True),
             selective_reference(bias=True, softplus=True, skip=True, z=True, last=True)),
    Spelling("hf_no_z", "transformers", HFNoZ, selective_args(softplus=True),
             selective_reference(bias=True, softplus=True, skip=True, last=True)),
    Spelling("hf_no_d_y_only", "transformers", HFNoD, selective_args(softplus=True, z=True),
             selective_reference(bias=True, softplus=True, z=True)),
    Spelling("hf_bare", "transformers", HFBare, _KERNEL, selective_reference(last=True)),
    Spelling("hf_y_only", "transformers", HFOutOnly, selective_args(softplus=True, z=True),
             selective_reference(bias=True, softplus=True, skip=True, z=True)),
    Spelling("ssm_ref_full", "mamba_ssm", SsmRefFull, selective_args(softplus=True, z=True),
             selective_reference(bias=True, softplus=True, skip=True, z=True, last=True)),
    Spelling("ssm_ref_plain", "mamba_ssm", SsmRefPlain, _KERNEL, selective_reference()),
    Spelling("ssm_ref_groups_1", "mamba_ssm", SsmRefGroups, selective_args(groups=1),
             selective_reference(skip=True, last=True)),
    Spelling("ssm_ref_groups_2", "mamba_ssm", SsmRefGroups, selective_args(groups=G),
             selective_reference(skip=True, last=True)),
    Spelling("groups_in_loop_1", "groups", GroupsInLoop, selective_args(groups=1),
             selective_reference()),
    Spelling("groups_in_loop_2", "groups", GroupsInLoop, selective_args(groups=G),
             selective_reference()),
    Spelling("minimal", "minimal", MinimalScan, selective_args(**_BLD),
             selective_reference(skip=True, **_BLD)),
    Spelling("minimal_last_state", "minimal", MinimalLastState,
             selective_args(state=True, **_BLD),
             selective_reference(state=True, last=True, **_BLD)),
    Spelling("inplace_buffer", "inplace", InplaceBuffer, selective_args(state=True),
             selective_reference(state=True, last=True)),
    Spelling("inplace_zeros_skip", "inplace", InplaceZerosSkip, _KERNEL,
             selective_reference(skip=True)),
    Spelling("step_loop", "steps", StepLoop, selective_args(state=True, **_BLD),
             selective_reference(state=True, skip=True, last=True, **_BLD)),
    Spelling("mambapy_seq", "mambapy", MambaPySeq, selective_args(**_BLD),
             selective_reference(skip=True, **_BLD)),
    Spelling("plain", "plain", PlainSelectiveScan, _KERNEL, selective_reference(last=True)),
    Spelling("zeros_like_state", "plain", ZerosLikeState, _KERNEL, selective_reference()),
    Spelling("skip_gate_in_loop", "plain", SkipGateInLoop, selective_args(z=True),
             selective_reference(skip=True, z=True, last=True)),
]

SPELLING = {s.name: s for s in SPELLINGS}


# --- mutants -------------------------------------------------------------------------------------

class DecayAfterWrite(PlainSelectiveScan):
    def step(self, x, dA, dBu, C_i, i, delta):
        x = dA[:, :, i] * (x + dBu[:, :, i])  # the decay applied to the write too
        return x, torch.einsum("bdn,bn->bd", x, C_i)


class ReadoutBeforeWrite(PlainSelectiveScan):
    def step(self, x, dA, dBu, C_i, i, delta):
        x = dA[:, :, i] * x
        y = torch.einsum("bdn,bn->bd", x, C_i)  # reads the decayed state before the write
        return x + dBu[:, :, i], y


class ShiftedDecay(PlainSelectiveScan):
    def step(self, x, dA, dBu, C_i, i, delta):
        x = dA[:, :, min(i + 1, dA.shape[2] - 1)] * x + dBu[:, :, i]  # the next position's
        return x, torch.einsum("bdn,bn->bd", x, C_i)


class DoubledWrite(PlainSelectiveScan):
    def step(self, x, dA, dBu, C_i, i, delta):
        x = dA[:, :, i] * x + 2 * dBu[:, :, i]
        return x, torch.einsum("bdn,bn->bd", x, C_i)


class TanhCap(PlainSelectiveScan):
    def step(self, x, dA, dBu, C_i, i, delta):
        x, y = super().step(x, dA, dBu, C_i, i, delta)
        c = 1e2
        return c * torch.tanh(x / c), y  # a clamp of the state without clamp (after readout)


class ClampDtInLoop(PlainSelectiveScan):
    def step(self, x, dA, dBu, C_i, i, delta):
        A = -torch.exp(self.A_log)
        dt_i = delta[:, :, i].clamp(max=0.2)  # the decay's dt capped, in the loop
        x = torch.exp(dt_i[..., None] * A) * x + dBu[:, :, i]
        return x, torch.einsum("bdn,bn->bd", x, C_i)


class ReadoutOverChannels(PlainSelectiveScan):
    def step(self, x, dA, dBu, C_i, i, delta):
        x = dA[:, :, i] * x + dBu[:, :, i]
        return x, (x * C_i[:, None, :]).sum(1)  # sums the channels, not the state entries


MUTANTS = [
    Mutant("decay_after_write", "plain", DecayAfterWrite,
           "x = dA * (x + dBu): the decay applied after the write (= dA x + (dA dBu): "
           "another formed write)", inside=False),
    Mutant("readout_before_write", "plain", ReadoutBeforeWrite,
           "y reads the decayed state before dBu is written"),
    Mutant("shifted_decay", "plain", ShiftedDecay,
           "x = dA[i + 1] * x + dBu[i] (the last position's twice)", inside=False),
    Mutant("doubled_write", "plain", DoubledWrite,
           "x = dA x + 2 dBu (the write read whole: another formed write)", inside=False),
    Mutant("tanh_cap", "plain", TanhCap, "x = c tanh(x / c), c = 1e2, every step"),
    Mutant("clamp_dt_in_loop", "plain", ClampDtInLoop,
           "the decay exp(min(dt, 0.2) A) formed in the loop (the write's dt unclamped)",
           inside=False),
    Mutant("readout_over_channels", "plain", ReadoutOverChannels,
           "y = sum over D of x * C (a [B, N] readout), not over N (an op could compute it "
           "with the state read transposed: N heads, D keys)", inside=False),
]

MUTANT = {m.name: m for m in MUTANTS}
