"""A corpus of the causal conv1d update as other authors spell it, and one-change mutants.

Every spelling computes, for x [B, C, T] (or [B, T, C], or [B, C] at T = 1), a state of the
last W samples (W = K or K - 1), a depthwise weight [C, K] (or [C, 1, K]) and an optional
bias [C]:

    full = cat(state, x);   out[t] = act(bias + sum_k w[:, k] * full[..., t + 1 + k + W - K])
    new_state = full[..., -W:]

but written the way some author writes it: F.conv1d with groups = C (padding, then the last
positions), unfold windows, shifted multiply-adds, einsum, a state kept by cat + slice, by roll
and assignment of the last column (mamba's step, FLA's short-convolution step), or written
into a buffer; channel-first or channel-last. Nothing here imports gdn_fx.

``SPELLINGS``: each with its example inputs. ``MUTANTS``: one small edit of a spelling (named
by ``base``) that is no longer the update of (x, state, weight, bias); each must stay unfused
with a near-miss. ``LOOKALIKES``: one-change edits that still ARE an update (a bias that is
dropped is an update without bias); a collapse may fuse them, never wrongly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

B, C, K = 2, 6, 4


@dataclass
class Spelling:
    name: str
    module: Callable[[], nn.Module]
    inputs: Callable[[], tuple]
    width: int = K  # samples the state keeps
    layout: str = "bct"  # of x and out: "bct", "btc" or "bc" (T = 1)


@dataclass
class Mutant:
    name: str
    base: str
    module: Callable[[], nn.Module]
    change: str


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def inputs(seq=1, width=K, layout="bct", state_last=False, seed=0):
    """x in ``layout``, a state [B, C, width] (or [B, width, C] when ``state_last``)."""
    def build():
        gen = _gen(seed)
        x = torch.randn(B, C, seq, generator=gen)
        state = torch.randn(B, C, width, generator=gen)
        if layout == "btc":
            x = x.transpose(1, 2).contiguous()
        elif layout == "bc":
            x = x[:, :, 0].contiguous()
        if state_last:
            state = state.transpose(1, 2).contiguous()
        return x, state
    return build


class Depthwise(nn.Module):
    """Holds a depthwise conv's parameters: weight [C, 1, K] (as nn.Conv1d keeps it)."""

    def __init__(self, bias=True, flat=False):
        super().__init__()
        gen = _gen(7)
        weight = torch.randn(C, 1, K, generator=gen) * 0.5
        self.weight = nn.Parameter(weight[:, 0].clone() if flat else weight)
        self.bias = nn.Parameter(torch.randn(C, generator=gen) * 0.1) if bias else None

    def taps(self):
        return self.weight if self.weight.dim() == 2 else self.weight[:, 0]


# --- spellings -----------------------------------------------------------------------------

class Conv1dPadLeft(Depthwise):
    """F.conv1d over the history after a left pad of K-1, then the last T positions."""

    def forward(self, x, state):
        full = torch.cat((state, x), dim=2)
        state.copy_(full[:, :, -state.shape[2]:])
        y = F.conv1d(F.pad(full, (K - 1, 0)), self.weight, self.bias, groups=C)
        return F.silu(y[:, :, -x.shape[2]:])


class Conv1dPaddingArg(Depthwise):
    """conv1d's own padding (both sides), the first L outputs kept, then the last T."""

    def forward(self, x, state):
        full = torch.cat([state, x], -1)
        y = F.conv1d(full, self.weight, self.bias, padding=K - 1, groups=C)[..., :full.shape[-1]]
        new_state = full[..., -K:].clone()
        return F.silu(y[..., -x.shape[-1]:]), new_state


class UnfoldWindows(Depthwise):
    """unfold the history into K-wide windows, multiply by the taps, sum."""

    def forward(self, x, state):
        full = torch.cat([state, x], dim=-1)
        windows = full.unfold(-1, K, 1)[:, :, -x.shape[-1]:]  # [B, C, T, K]
        out = (windows * self.taps()[:, None, :]).sum(-1) + self.bias[:, None]
        state.copy_(full[:, :, -K:])
        return F.silu(out)


class ShiftedMultiplyAdd(Depthwise):
    """sum over k of w[:, k] * the history shifted by k (a Python loop over taps), no SiLU."""

    def forward(self, x, state):
        seq = x.shape[-1]
        full = torch.cat([state, x], dim=-1)
        start = full.shape[-1] - seq - K + 1
        acc = self.bias.view(1, C, 1).expand(x.shape[0], C, seq)
        for k in range(K):
            acc = acc + self.taps()[:, k].view(1, C, 1) * full[:, :, start + k:start + k + seq]
        state.copy_(full[:, :, -K:])
        return acc


class MambaStepRoll(Depthwise):
    """mamba's single-token step: roll the state left in place, write x in the last column,
    sum the state times the taps; x and out are [B, C]."""

    def forward(self, x, conv_state):
        conv_state.copy_(torch.roll(conv_state, shifts=-1, dims=-1))
        conv_state[:, :, -1] = x
        y = torch.sum(conv_state * self.taps(), dim=-1)
        y = y + self.bias
        return F.silu(y)


class FlaStepRollBuffer(Depthwise):
    """FLA-style short-convolution step with the cache in a registered buffer: x [B, C];
    roll, assign the last column, einsum with the [C, K] weight; no bias."""

    def __init__(self):
        super().__init__(bias=False, flat=True)
        self.register_buffer("cache", torch.randn(B, C, K, generator=_gen(3)))

    def forward(self, x):
        cache = self.cache
        cache.copy_(cache.roll(shifts=-1, dims=-1))
        cache[:, :, -1] = x
        y = torch.einsum("bck,ck->bc", cache, self.weight)
        return F.silu(y)


class CausalRefKMinus1(Depthwise):
    """The causal-conv1d package's reference update: the state keeps K-1 samples (state_len
    >= width - 1), cat, copy the last state_len back, conv1d with no padding, last T."""

    def __init__(self):
        super().__init__(flat=True)

    def forward(self, x, conv_state):
        seqlen, state_len = x.shape[-1], conv_state.shape[-1]
        x_new = torch.cat([conv_state, x], dim=-1).to(self.weight.dtype)
        conv_state.copy_(x_new[:, :, -state_len:])
        out = F.conv1d(x_new, self.weight.unsqueeze(1), self.bias, padding=0, groups=C)
        return F.silu(out[:, :, -seqlen:]).to(x.dtype)


class ChannelLast(Depthwise):
    """x and out [B, T, C], the state [B, K, C]: history along dim 1, taps as [K, C]."""

    def forward(self, x, state):
        full = torch.cat([state, x], dim=1)
        seq = x.shape[1]
        start = full.shape[1] - seq - K + 1
        taps = self.taps().t()  # [K, C]
        out = sum(full[:, start + k:start + k + seq, :] * taps[k] for k in range(K))
        out = out + self.bias
        state.copy_(full[:, -K:, :])
        return F.silu(out)


class ChannelLastInput(Depthwise):
    """x comes in [B, T, C] and goes back out [B, T, C]; the state stays [B, C, K]."""

    def forward(self, x, state):
        full = torch.cat([state, x.transpose(1, 2)], dim=-1)
        state.copy_(full[..., -K:])
        y = F.conv1d(full, self.weight, self.bias, groups=C)[..., -x.shape[1]:]
        return F.silu(y).transpose(1, 2)


class CatSliceReturned(Depthwise):
    """Functional: new state = cat(state[..., 1:], x) returned; out from the new state."""

    def forward(self, x, state):
        new_state = torch.cat([state[:, :, 1:], x.unsqueeze(-1)], dim=-1)
        out = (new_state * self.taps().unsqueeze(0)).sum(-1) + self.bias
        return F.silu(out), new_state


class BufferWriteMatmul(Depthwise):
    """The window written into a buffer slice by slice; the taps applied with a batched
    matmul; no bias, no activation."""

    def __init__(self):
        super().__init__(bias=False)
        self.register_buffer("state", torch.randn(B, C, K, generator=_gen(4)))

    def forward(self, x):
        window = torch.empty(B, C, K + 1)
        window[:, :, :K] = self.state
        window[:, :, K:] = x
        self.state[:, :, :] = window[:, :, 1:]
        y = torch.matmul(window[:, :, 1:].unsqueeze(-2), self.taps().unsqueeze(-1))
        return y[..., 0]  # [B, C, 1]


class TwoTokens(Depthwise):
    """A T = 2 update with unfold on a cat + slice state and the [C, K] taps via einsum."""

    def forward(self, x, state):
        full = torch.cat([state, x], -1)
        win = full[..., 1:].unfold(2, K, 1)  # [B, C, T, K]
        out = torch.einsum("bctk,ck->bct", win, self.taps()) + self.bias.unsqueeze(-1)
        return F.silu(out), full[..., -K:]


SPELLINGS = [
    Spelling("conv1d_pad_left", Conv1dPadLeft, inputs(seq=3)),
    Spelling("conv1d_padding_arg", Conv1dPaddingArg, inputs(seq=2)),
    Spelling("unfold_windows", UnfoldWindows, inputs(seq=3)),
    Spelling("shifted_multiply_add", ShiftedMultiplyAdd, inputs(seq=2)),
    Spelling("mamba_step_roll", MambaStepRoll, inputs(layout="bc"), layout="bc"),
    Spelling("fla_step_roll_buffer", FlaStepRollBuffer, lambda: (inputs(layout="bc")()[0],),
             layout="bc"),
    Spelling("causal_ref_k_minus_1", CausalRefKMinus1, inputs(seq=2, width=K - 1),
             width=K - 1),
    Spelling("channel_last", ChannelLast, inputs(seq=2, layout="btc", state_last=True),
             layout="btc"),
    Spelling("channel_last_input", ChannelLastInput, inputs(seq=3, layout="btc"),
             layout="btc"),
    Spelling("cat_slice_returned", CatSliceReturned, inputs(layout="bc"), layout="bc"),
    Spelling("buffer_write_matmul", BufferWriteMatmul, lambda: (inputs()()[0],)),
    Spelling("two_tokens_einsum", TwoTokens, inputs(seq=2)),
]
SPELLING = {s.name: s for s in SPELLINGS}


# --- mutants -------------------------------------------------------------------------------

class ReversedTaps(ShiftedMultiplyAdd):
    def forward(self, x, state):
        seq = x.shape[-1]
        full = torch.cat([state, x], dim=-1)
        start = full.shape[-1] - seq - K + 1
        acc = self.bias.view(1, C, 1).expand(x.shape[0], C, seq)
        for k in range(K):  # the change: tap K-1-k on the k-th shifted history
            acc = acc + self.taps()[:, K - 1 - k].view(1, C, 1) * full[:, :, start + k:start + k + seq]
        state.copy_(full[:, :, -K:])
        return acc


class RollByTwo(MambaStepRoll):
    def forward(self, x, conv_state):
        conv_state.copy_(torch.roll(conv_state, shifts=-2, dims=-1))  # the change: -2
        conv_state[:, :, -1] = x
        y = torch.sum(conv_state * self.taps(), dim=-1)
        return F.silu(y + self.bias)


class BiasAfterSilu(UnfoldWindows):
    def forward(self, x, state):
        full = torch.cat([state, x], dim=-1)
        windows = full.unfold(-1, K, 1)[:, :, -x.shape[-1]:]
        out = F.silu((windows * self.taps()[:, None, :]).sum(-1)) + self.bias[:, None]  # change
        state.copy_(full[:, :, -K:])
        return out


class BiasInWindow(UnfoldWindows):
    def forward(self, x, state):
        full = torch.cat([state, x], dim=-1)
        windows = full.unfold(-1, K, 1)[:, :, -x.shape[-1]:]
        windows = windows + self.bias[:, None, None]  # the change: bias on the samples
        out = (windows * self.taps()[:, None, :]).sum(-1)
        state.copy_(full[:, :, -K:])
        return F.silu(out)


class SiluOnState(CatSliceReturned):
    def forward(self, x, state):
        new_state = F.silu(torch.cat([state[:, :, 1:], x.unsqueeze(-1)], dim=-1))  # the change
        out = (new_state * self.taps().unsqueeze(0)).sum(-1) + self.bias
        return F.silu(out), new_state


class PadWrongSide(Conv1dPadLeft):
    def forward(self, x, state):
        full = torch.cat((state, x), dim=2)
        state.copy_(full[:, :, -state.shape[2]:])
        y = F.conv1d(F.pad(full, (0, K - 1)), self.weight, self.bias, groups=C)  # the change
        return F.silu(y[:, :, -x.shape[2]:])


class FutureLeak(ShiftedMultiplyAdd):
    def forward(self, x, state):
        seq = x.shape[-1]
        full = F.pad(torch.cat([state, x], dim=-1), (0, 1))  # one zero after x
        start = full.shape[-1] - seq - K + 1  # the change: windows end one sample later
        acc = self.bias.view(1, C, 1).expand(x.shape[0], C, seq)
        for k in range(K):
            acc = acc + self.taps()[:, k].view(1, C, 1) * full[:, :, start + k:start + k + seq]
        state.copy_(full[:, :, -K - 1:-1])
        return acc


class StaleState(TwoTokens):
    def forward(self, x, state):
        full = torch.cat([state, x], -1)
        win = full[..., 1:].unfold(2, K, 1)
        out = torch.einsum("bctk,ck->bct", win, self.taps()) + self.bias.unsqueeze(-1)
        return F.silu(out), full[..., -K - 1:-1]  # the change: the window one sample early


class ChannelMixing(ChannelLast):
    def forward(self, x, state):
        full = torch.cat([state, x], dim=1)
        seq = x.shape[1]
        start = full.shape[1] - seq - K + 1
        taps = self.taps().t()
        out = sum(full[:, start + k:start + k + seq, :].flip(-1) * taps[k] for k in range(K))
        out = out + self.bias  # the change above: channels reversed before the taps
        state.copy_(full[:, -K:, :])
        return F.silu(out)


MUTANTS = [
    Mutant("reversed_taps", "shifted_multiply_add", ReversedTaps,
           "the taps meet the history in reverse order"),
    Mutant("roll_by_two", "mamba_step_roll", RollByTwo, "the state is shifted by two"),
    Mutant("bias_in_window", "unfold_windows", BiasInWindow,
           "the bias is missing from the output (added to the samples before the taps)"),
    Mutant("silu_on_state", "cat_slice_returned", SiluOnState,
           "the activation is applied to the state"),
    Mutant("pad_wrong_side", "conv1d_pad_left", PadWrongSide, "the padding is on the right"),
    Mutant("future_leak", "shifted_multiply_add", FutureLeak,
           "each output reads the next sample (a leak from the future)"),
    Mutant("stale_state", "two_tokens_einsum", StaleState,
           "the new state is the window one sample early"),
    Mutant("channel_mixing", "channel_last", ChannelMixing,
           "channels are reversed before the taps: not depthwise"),
]


class BiasDropped(UnfoldWindows):
    def forward(self, x, state):
        full = torch.cat([state, x], dim=-1)
        windows = full.unfold(-1, K, 1)[:, :, -x.shape[-1]:]
        out = (windows * self.taps()[:, None, :]).sum(-1)  # the change: no bias
        state.copy_(full[:, :, -K:])
        return F.silu(out)


LOOKALIKES = [
    Mutant("bias_dropped", "unfold_windows", BiasDropped,
           "no bias added: still an update, with bias None"),
    Mutant("bias_after_silu", "unfold_windows", BiasAfterSilu,
           "the bias added after the activation: an update without bias, then an add"),
]
MUTANT = {m.name: m for m in MUTANTS + LOOKALIKES}
