"""How a loop's tensors map onto the fused op's operands: one record per layout.

The op takes time-major q, k [B, T, H, Dk], v [B, T, H, Dv], a log gate [B, T, H] or
[B, T, H, Dk], beta [B, T, H] and a key-first state [B, H, Dk, Dv]. A loop may read its tensors
along any time axis, keep batch and heads merged ([B*H, T, D], a bmm loop), carry a value-first
state [.., Dv, Dk], walk a decay exp(g) computed before the loop, or keep size-1 axes
([B, H, T, 1] betas). A :class:`Layout` records which of these a loop uses (step_meaning.py
proves it by evaluation); :func:`operands` turns it into the op's operands, each reached from
the loop's tensor by a permute and, where the axes do not line up, a reshape, emitted outside
the fused node. The state's leading axes are the batch: the last is the op's H, the others
its B.

To add a layout, this file only: a new field of ``Layout`` (``Layout.same_as`` compares
every field, so the steps of one loop must agree on it without more code), the layouts it
allows in ``layouts_for`` (or a pool step_meaning and chunk_meaning try when the others
fail, as ``qk_l2norm``), what the delta rule does under it in ``reference_step`` (the
reference every meaning rule scores against), and what its operands need in
``plan_operands`` / ``_adapt``.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace
from typing import Optional

import torch
from torch import fx

from gdn_fx.passes.bounds import bounds
from gdn_fx.passes.loops import invariant_shapes
from gdn_fx.passes.operands import Operands, scan_operands, _peel_casts
from gdn_fx.passes.program import ATEN, same_sizes, shape
from gdn_fx.passes.result import NoMatch
from gdn_fx.reference import l2norm

ROLES = ("q", "k", "v", "g", "beta")
# The tensors a loop may walk: the op's five, or beta already folded into a copy of k before
# the loop (kb = k * beta[..., None], as DeltaNet papers write it), beta then read off kb.
ROLE_SETS = (ROLES, ("q", "k", "kb", "v", "g"))
# A gated linear recurrence (gated_linear_scan: Mamba, lightning, retention, GLA) walks four:
# no beta, no erase. Which of the two a loop is, is decided by evaluating it against both.
LINEAR_ROLES = ("q", "k", "v", "g")
# ... or three, where the state has no value axis (Mamba1: S [B, D, N], one N-vector per
# channel): the write k (x) v with Dv = 1 is formed before the loop and read whole as k
# (v = 1), and q may have no head axis (one C for every channel).
UNIT_ROLES = ("q", "k", "g")


@dataclass(frozen=True)
class Layout:
    """A loop's layout: which read tensor plays which role, and how the state is held."""

    roles: dict  # role -> index into the loop's groups
    key_first: bool  # state [.., Dk, Dv] (else [.., Dv, Dk])
    log_gate: bool  # the gate is log-decay g (else the decay exp(g) itself)
    features: tuple  # per group: feature dims after the batch axes, size-1 axes dropped
    state_shape: tuple
    out_shape: tuple  # o_t's shape
    scale: float = 1.0  # o = scale * q^T S
    # Grouped value heads (GQA): q and k have this many heads on the state's head axis (its
    # last batch axis), fewer than the state; value head h reads key head h // G (as the op
    # does, G = heads / key_heads), or h % key_heads when ``tiled`` (a ``repeat``: the op is
    # then handed q and k repeated so, outside it). None: q and k have the state's heads.
    key_heads: Optional[int] = None
    tiled: bool = False
    # q and k L2-normalized inside the step (x * rsqrt(sum(x * x) + 1e-6), the op's own
    # qk_l2norm): the op is then handed the q and k the loop reads, with qk_l2norm set.
    qk_l2norm: bool = False
    # the delta rule (gated_delta_scan), else the gated linear recurrence (gated_linear_scan:
    # S = S * decay + k v^T, o = scale * q^T S)
    delta: bool = True
    # the state has no value axis: Dv = 1, the op's [B, H, Dk, 1] held as [B, H, Dk]; k is
    # the formed write (v = 1, UNIT_ROLES); ``shared_q``: q has no head axis (one for all)
    unit_value: bool = False
    shared_q: bool = False

    def with_scale(self, scale: float) -> "Layout":
        return replace(self, scale=scale)

    def same_as(self, other: "Layout") -> bool:
        """The same layout, whatever the scale each was measured at (every other field
        counts, also one added later)."""
        return replace(self, scale=1.0) == replace(other, scale=1.0)

    def key_head(self, head: int) -> int:
        """The key head that value head ``head`` reads."""
        if self.key_heads is None:
            return head
        if self.tiled:
            return head % self.key_heads
        return head // (self.state_shape[-3] // self.key_heads)

    def describe(self) -> str:
        state = "key-first" if self.key_first else "value-first"
        gate = "log gate" if self.log_gate else "decay"
        heads = "" if self.key_heads is None else \
            f", q and k on {self.key_heads} heads ({'tiled' if self.tiled else 'grouped'})"
        norm = ", q and k L2-normalized in the step" if self.qk_l2norm else ""
        rule = "" if self.delta else "gated linear, "
        if self.unit_value:
            state = "no value axis (Dv = 1)" + (", one q for every head" if self.shared_q else "")
        return f"{rule}{state} state, {gate}, scale {self.scale:.6g}{heads}{norm}"

    @property
    def value_role(self) -> str:
        """The read the outputs are linear in (with the initial state): v, or the formed
        write k where the state has no value axis."""
        return "k" if self.unit_value else "v"

    @property
    def op_state_shape(self) -> tuple:
        """The state's shape with its value axis: a unit-value state gains a last axis of 1."""
        return tuple(self.state_shape) + ((1,) if self.unit_value else ())


def input_kind(role: str, layout: Layout) -> str:
    """How the wide domain draws the tensor playing ``role`` (evaluator.wide_draw): q free,
    k free where the op normalizes it (else a contractive key), v linear, the gate a log
    gate or a decay, beta in [0, 1]."""
    if role == "k" and layout.unit_value:
        return "linear"  # the write itself (v = 1): out and state are linear in it
    if role in ("k", "kb"):
        return "free" if layout.qk_l2norm else "key"
    if role == "g":
        return "gate" if layout.log_gate else "decay"
    return {"q": "free", "v": "linear", "beta": "beta"}[role]


def read_shape(group) -> list:
    """The shape of one position of a group; a group read whole at every position (axis
    None: a decay the same at each) as ``invariant_shape``."""
    source, axis = group
    if axis is None:
        return invariant_shapes(source)[1]
    dims = list(shape(source))
    del dims[axis]
    return dims


def layouts_for(state_shape, groups, out_shape):
    """Every layout the shapes allow: role assignment, state orientation, gate kind.
    ``groups`` are (tensor, time axis) pairs: a loop's reads, or a chunked region's inputs."""
    if len(groups) == len(UNIT_ROLES):
        yield from _unit_layouts(state_shape, groups, out_shape)
        return
    feats = [group_features(read_shape(g), state_shape) for g in groups]
    if any(f is None for f in feats):
        return
    heads = [group_heads(read_shape(g), state_shape) for g in groups]
    d1, d2 = state_shape[-2:]
    for roles_names in ROLE_SETS + (LINEAR_ROLES,):
        if len(roles_names) != len(groups):
            continue
        for key_first in (True, False):
            dk, dv = (d1, d2) if key_first else (d2, d1)
            for roles in itertools.permutations(range(len(groups))):
                assign = dict(zip(roles_names, roles))
                if not _widths_fit(assign, feats, dk, dv):
                    continue
                for key_heads, tiled in _head_maps(assign, heads, state_shape):
                    for log_gate in (True, False):
                        yield Layout(assign, key_first, log_gate, tuple(feats),
                                     tuple(state_shape), tuple(out_shape),
                                     key_heads=key_heads, tiled=tiled,
                                     delta=roles_names is not LINEAR_ROLES)


def _unit_layouts(state_shape, groups, out_shape):
    """The layouts of a three-read loop over a state without a value axis: [.., H, Dk] read
    as [.., H, Dk, 1], k the write and g the decay on the state's heads, q on them, on a
    divisor of them (groups of heads: head h reads q's h // G), or on none (shared by every
    head)."""
    if len(state_shape) < 3:
        return
    virtual = list(state_shape) + [1]
    batch, dk = virtual[:-2], virtual[-2]
    reads = [read_shape(g) for g in groups]
    for roles in itertools.permutations(range(len(groups))):
        assign = dict(zip(UNIT_ROLES, roles))
        k, g, q = (reads[assign[r]] for r in ("k", "g", "q"))
        if group_features(k, virtual) != [dk] or group_features(g, virtual) not in ([], [dk]) \
                or group_heads(k, virtual) != batch[-1] or group_heads(g, virtual) != batch[-1]:
            continue
        shared = [d for d in q if d != 1] == [d for d in batch[:-1] + [dk] if d != 1]
        if not shared and group_features(q, virtual) != [dk]:
            continue
        heads = None if shared or group_heads(q, virtual) == batch[-1] else \
            group_heads(q, virtual)
        feats = [[dk] if i != assign["g"] else group_features(g, virtual)
                 for i in range(len(groups))]
        for log_gate in (True, False):
            yield Layout(assign, True, log_gate, tuple(feats), tuple(state_shape),
                         tuple(out_shape), key_heads=heads, delta=False, unit_value=True,
                         shared_q=shared)


def _head_maps(assign, heads, state_shape) -> list:
    """(key heads, tiled) pairs a role assignment allows: (None, False) when every read has
    the state's heads; under GQA only q and k may have fewer, the same number, read grouped
    (value head h -> key head h // G) or tiled (h % Hk), which differ unless Hk = 1."""
    full = state_shape[-3] if len(state_shape) > 2 else 0
    fewer = {i for i, h in enumerate(heads) if h != full}
    if not fewer:
        return [(None, False)]
    q, k = assign["q"], assign["k"]
    if fewer != {q, k} or heads[q] != heads[k]:
        return []
    return [(heads[q], False)] + ([(heads[q], True)] if heads[q] > 1 else [])


def _widths_fit(assign, feats, dk, dv) -> bool:
    want = {"q": [dk], "k": [dk], "v": [dv], "beta": [], "kb": [dk]}
    if any(feats[assign[r]] != w for r, w in want.items() if r in assign):
        return False
    return feats[assign["g"]] in ([], [dk])


def reference_step(layout: Layout, s0, ins, inplace: bool = False):
    """The rule's (S', o) for these inputs under ``layout`` (the delta rule, or the gated
    linear recurrence where ``layout.delta`` is False), in the body's layout (one step;
    chunk_meaning.py runs it along a whole sequence, ``inplace``: S' is ``s0``, updated, and
    the returned ``decayed`` is no longer what it was)."""
    if layout.unit_value:  # [.., H, Dk] as [.., H, Dk, 1]; q shared by the heads
        inner = replace(layout, roles={**layout.roles, "v": len(ins)}, unit_value=False,
                        shared_q=False, features=layout.features + ((1,),),
                        state_shape=layout.op_state_shape)
        s_back, o, s_in, x = reference_step(inner, s0[..., None], _unit_reads(layout, s0, ins),
                                            inplace)
        return s_back[..., 0], o, s_in[..., 0], x
    batch = s0.shape[:-2]
    x = {r: _per_value_head(ins[i], bool(layout.features[i]), layout, batch)
         for r, i in layout.roles.items()}
    s = s0 if layout.key_first else s0.transpose(-1, -2)
    decay = x["g"].exp() if layout.log_gate else x["g"]
    decay = decay[..., None] if decay.dim() > len(batch) else decay[..., None, None]
    if layout.qk_l2norm:
        x["q"], x["k"] = l2norm(x["q"]), l2norm(x["k"])
    # in place, readouts as matmuls, the write one addcmul: a chunked region's reference
    # runs every head along the whole sequence, and these passes over S are its cost
    x["decayed"] = s = s.mul_(decay) if inplace else s * decay
    add = s.addcmul_ if inplace else s.addcmul
    if not layout.delta:  # no erase: the value is written as it is
        s = add(x["k"][..., :, None], x["v"][..., None, :])
    else:
        delta = x["v"] - _read(s, x["k"])
        if "beta" in x:
            s = add(x["k"][..., :, None], (delta * x["beta"][..., None])[..., None, :])
        else:  # beta folded into k before the loop: kb = beta * k
            s = add(x["kb"][..., :, None], delta[..., None, :])
    o = _read(s, x["q"])
    s_back = s if layout.key_first else s.transpose(-1, -2)
    return s_back, o, s0 if layout.key_first else s0.transpose(-1, -2), x


def _unit_reads(layout: Layout, s0, ins) -> list:
    """A unit-value step's reads as a four-read step's: q on every head, v = 1."""
    batch = s0.shape[:-1]
    ins = list(ins)
    q = layout.roles["q"]
    if layout.shared_q:
        ins[q] = ins[q].reshape(*batch[:-1], 1, -1).expand(*batch, -1)
    ones = ins[layout.roles["k"]].new_ones(*batch, 1)
    return ins + [ones]


def _read(s: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """sum_k key_k S_kv, as a matmul: [.., Dk] with [.., Dk, Dv] -> [.., Dv]."""
    return (key[..., None, :] @ s).squeeze(-2)


def _per_value_head(read: torch.Tensor, features: bool, layout: Layout, batch):
    """A read as [*batch, features] (or [*batch]); q or k on fewer heads (GQA) indexed to
    the value heads by the layout's map."""
    lead = tuple(read.shape[:len(batch)])
    read = read.reshape(*lead, -1) if features else read.reshape(lead)
    if lead == tuple(batch):
        return read
    index = torch.tensor([layout.key_head(h) for h in range(batch[-1])])
    return read.index_select(len(batch) - 1, index)


def group_features(read_shape: list, state_shape) -> Optional[list]:
    """Feature dims of a tensor read at one position, once the state's batch axes are off its
    front (size-1 axes dropped); None when its leading axes are not the state's batch (its
    head axis may have fewer heads, a divisor of the state's: q and k under GQA)."""
    if group_heads(read_shape, state_shape) is None:
        return None
    return [d for d in read_shape[len(state_shape) - 2:] if d != 1]


def group_heads(read_shape: list, state_shape) -> Optional[int]:
    """The heads of a read on the state's head axis (its last batch axis; 0 when the state
    has no batch axes): the state's, or a proper divisor of them; None when the read's
    leading axes are not the state's batch."""
    batch = list(state_shape[:-2])
    lead = list(read_shape[:len(batch)])
    if not batch:
        return 0
    if len(lead) != len(batch) or lead[:-1] != batch[:-1]:
        return None
    heads = lead[-1]
    return heads if heads == batch[-1] or (0 < heads and batch[-1] % heads == 0) else None


def batch_heads(state_shape) -> tuple[int, int]:
    """(B, H) for the op: the state's last batch axis is H, the others are B."""
    batch = list(state_shape[:-2])
    return (math.prod(batch[:-1]), batch[-1]) if batch else (1, 1)


@dataclass
class Plan:
    """What the fusion needs besides the operands: how its two results reach the region's."""

    operands: Operands
    out_steps: Optional[list]  # (op, args) from the op's [B, T, H, Dv] output; None: a permute
    final_steps: list  # (op, args) applied to the op's [B, H, Dk, Dv] final state


def plan_operands(layout: Layout, groups: list, state: fx.Node, value_shape, axis: int,
                  length: int) -> Plan:
    """The op's operands for a loop of ``layout`` reading ``groups`` (source, axis)."""
    sources = {r: groups[i] for r, i in layout.roles.items()}
    if "kb" in sources:
        sources["beta"] = _unfold_beta(sources.pop("kb"), sources["k"])
    axes = [a for _, a in sources.values()]
    head_major = axes.count(2) > axes.count(1)
    ops = scan_operands({r: s for r, (s, _) in sources.items()}, state, head_major=head_major,
                        delta=layout.delta)
    ops.scale *= layout.scale
    b, h = batch_heads(layout.op_state_shape)
    hk = h if layout.key_heads is None else layout.key_heads  # (no bool() of a SymInt)
    keyed = ("q",) if layout.unit_value else ("q", "k")  # (a unit-value k is the write)
    wants = {role: [b, length, hk if role in keyed else h] + ([] if role == "beta" else
             list(layout.features[layout.roles[role]])) for role in sources}
    if layout.shared_q:  # one q for every head: [B, T, 1, Dk], expanded below
        wants["q"][2] = 1
    invariant = {role for role, (_, time_axis) in sources.items() if time_axis is None}
    odd = {role for role, (source, time_axis) in sources.items()
           if role not in invariant and not _standard(source, time_axis, head_major,
                                                      wants[role])}
    # q and k are peeled together (l2norm, scale, GQA): undo both; tiled heads are repeated
    # from what the loop reads; a step that normalizes them itself takes them as it reads them
    if odd & {"q", "k"} or layout.tiled or layout.qk_l2norm or layout.unit_value:
        odd |= {"q", "k"}
        ops.qk_l2norm, ops.scale = layout.qk_l2norm, layout.scale
    for role in odd:
        source, time_axis = sources[role]
        ops.nodes[role] = _peel_casts(source)
        ops.to_time_major.discard(role)
        ops.adapters[role] = _adapt(shape(source), time_axis, wants[role])
        if layout.tiled and role in ("q", "k"):  # [B, T, Hk, D] -> [B, T, H, D], h % Hk
            ops.adapters[role].append((ATEN.repeat.default, ([1, 1, h // hk, 1],)))
    for role in invariant:  # the same at every position: viewed as the step reads it,
        source = sources[role][0]  # broadcast over B and T
        own, drawn = invariant_shapes(source)
        ops.nodes[role] = source
        ops.to_time_major.discard(role)
        ops.adapters[role] = [(ATEN.reshape.default, (own,)), (ATEN.expand.default, (drawn,)),
                              (ATEN.reshape.default, ([b, 1] + wants[role][2:],)),
                              (ATEN.expand.default, (wants[role],))]
    if not layout.log_gate:  # the loop walks exp(g): hand the op g (peeled, or log taken)
        _log_of_decay(ops)
    if layout.unit_value:
        return _unit_plan(layout, ops, state, value_shape, axis, length, b, h)
    dv = layout.state_shape[-1] if layout.key_first else layout.state_shape[-2]
    state_steps = [] if len(layout.state_shape) == 4 else [(ATEN.reshape.default, ([b, h] + list(
        layout.state_shape[-2:]),))]
    if not layout.key_first:
        state_steps.append((ATEN.transpose.int, (-1, -2)))
    ops.nodes["state"] = _peel_casts(state, up=False)
    if state_steps:
        ops.adapters["state"] = state_steps
    final_steps = ([(ATEN.transpose.int, (-1, -2))] if not layout.key_first else []) + (
        [(ATEN.reshape.default, (list(layout.state_shape),))] if len(layout.state_shape) != 4
        else [])
    return Plan(ops, _out_steps(layout, value_shape, axis, length, b, h, dv), final_steps)


def _unit_plan(layout: Layout, ops: Operands, state, value_shape, axis: int, length: int,
               b, h) -> Plan:
    """A state without a value axis: the op's state [B, H, Dk, 1], v = 1 beside k (the
    formed write), q expanded over the heads where it has none."""
    dk = layout.op_state_shape[-2]
    if layout.shared_q:
        ops.adapters["q"].append((ATEN.expand.default, ([b, length, h, dk],)))
    elif layout.key_heads is not None:  # q on groups of heads; k on every head, as the op
        # wants q: head h reads group h // G
        ops.adapters["q"].append((ATEN.repeat_interleave.self_int,
                                  (h // layout.key_heads, 2)))
    ops.nodes["v"] = ops.nodes["k"]
    ops.adapters["v"] = ops.adapters.get("k", []) + [
        (ATEN.new_ones.default, ([b, length, h, 1],))]
    ops.nodes["state"] = _peel_casts(state, up=False)
    ops.adapters["state"] = [(ATEN.reshape.default, ([b, h, dk, 1],))]
    final_steps = [(ATEN.reshape.default, (list(layout.state_shape),))]
    return Plan(ops, _out_steps(layout, value_shape, axis, length, b, h, 1), final_steps)


def _log_of_decay(ops: Operands) -> None:
    """Hand the op the log of the decay the loop multiplies its state by: the exponent of an
    exp, else log taken outside the node. log is exact only where the decay is not
    negative (NaN below 0, where the loop is finite), and only the graph can prove that it
    never is (bounds.py); a decay it does not prove non-negative is refused, naming it."""
    decay = ops.nodes["g"]
    if decay.target is ATEN.exp.default and shape(decay.args[0]) == shape(decay):
        ops.nodes["g"] = decay.args[0]
        return
    lo = bounds(decay)[0]
    if not lo >= 0.0:
        reach = "may be any value" if lo == -math.inf else f"may reach {lo:.3g}"
        raise NoMatch(f"the state is multiplied by {decay.name}, a decay computed before the "
                      f"loop that the graph does not prove non-negative (it {reach}: not exp, "
                      "sigmoid or softplus of something); the op takes the decay's log, "
                      "which is NaN where the decay is negative", node=decay)
    ops.adapters["g"] = ops.adapters.get("g", []) + [(ATEN.log.default, ())]


def _unfold_beta(kb, k) -> tuple:
    """beta for kb = k * beta[..., None] (either order, through casts), on kb's time axis."""
    (node, axis), (k_node, _) = kb, k
    node = _peel_casts(node)
    if node.target is ATEN.mul.Tensor and len(node.args) == 2:
        for a, b in (node.args, node.args[::-1]):
            if isinstance(a, fx.Node) and isinstance(b, fx.Node) and \
                    _peel_casts(a) is _peel_casts(k_node) and b.target is ATEN.unsqueeze.default \
                    and b.args[1] % len(shape(b)) == len(shape(b)) - 1:
                return b.args[0], axis
    raise NoMatch(f"the loop walks {kb[0].name}, k with beta folded in, and beta cannot be "
                  "read off it (expected k * beta[..., None] before the loop)", node=kb[0])


def _standard(source: fx.Node, time_axis: int, head_major: bool, want: list) -> bool:
    """The shape scan_operands handles: [B, T, H, ..] or [B, H, T, ..] with the op's axes."""
    dims = list(shape(source))
    if time_axis != (2 if head_major else 1):
        return False
    if head_major:
        dims[1], dims[2] = dims[2], dims[1]
    return same_sizes(dims, want)


def _adapt(dims, time_axis: int, want: list) -> list:
    """permute (time first), reshape to [T, B, H, ..], permute to [B, T, H, ..]; nothing or
    one transpose where the tensor is [B, T, H, ..] or [B, H, T, ..] already (a loop's q and
    k are undone together when one of them is odd, and tiled heads are undone always)."""
    rank = len(dims)
    if same_sizes(dims, want) and time_axis == 1:
        return []
    if rank >= 3 and time_axis == 2 and same_sizes([dims[0], dims[2], dims[1], *dims[3:]], want):
        return [(ATEN.transpose.int, (1, 2))]
    first = [time_axis] + [i for i in range(rank) if i != time_axis]
    steps = [(ATEN.permute.default, (first,))]
    steps.append((ATEN.reshape.default, ([want[1], want[0], want[2]] + want[3:],)))
    steps.append((ATEN.permute.default, ([1, 0, 2] + list(range(3, len(want))),)))
    return steps


def _out_steps(layout: Layout, value_shape, axis: int, length: int, b: int, h: int, dv: int
               ) -> list:
    """From the op's [B, T, H, Dv] output to the region's gathered value."""
    standard = [b, h, dv]
    standard.insert(axis, length)
    if same_sizes(layout.out_shape, [b, h, dv]) and same_sizes(value_shape, standard) and \
            len(layout.state_shape) == 4:
        return None  # scan_fusion moves the time axis with one permute
    rank = len(layout.out_shape) + 1
    to_axis = list(range(1, axis + 1)) + [0] + list(range(axis + 1, rank))
    return [(ATEN.permute.default, ([1, 0, 2, 3],)),
            (ATEN.reshape.default, ([length] + list(layout.out_shape),)),
            (ATEN.permute.default, (to_axis,)),
            (ATEN.reshape.default, (list(value_shape),))]
