"""Candidate "native" for causal_conv1d_update: ``tract_transformers_causal_conv1d_update``.

The operator takes input [b, C, S], weight [C, K], state [b, C, K] and returns
(silu(conv(cat(state, input)))[..., -S:], cat(state, input)[..., -K:]): SiLU is always
applied and there is no bias. What it accepts depends on the release:

- before 0.23.5: no such operator;
- 0.23.5 to 0.23.8 (held to the first form): all f16, K == 4, one step of one sequence
  (S == 1, batch 1, no symbolic axes);
- 0.23.9: all f16 or all f32, K = 2..5, any S and batch (docs/FACTS.md, "tract: native
  operators, release by release").
"""

from __future__ import annotations

from typing import Optional

from gdn_fx.lowering.node_facts import ConvFacts
from gdn_fx.lowering.nnef_emit import EmitContext
from gdn_fx.lowering.target import Target

OP = "tract_transformers_causal_conv1d_update"
MIN_VERSION = "0.23.5"
WIDE_VERSION = "0.23.9"
WIDE_KERNELS = range(2, 6)


def _first_form_reason(facts: ConvFacts, target: Target, dtype: str) -> Optional[str]:
    version = target.version_text
    if dtype != "f16":
        return f"tract {version} takes f16 only; node is {dtype}"
    if facts.kernel != 4:
        return f"tract {version} takes K=4 only; node has K={facts.kernel}"
    if target.dynamic:
        return f"tract {version} runs one step and the export has symbolic axes"
    if facts.seq != 1 or facts.batch != 1:
        shape = f"B={facts.batch}, S={facts.seq}".replace("None", "symbolic")
        return f"tract {version} runs one step of one sequence; node has {shape}"
    return None


def check(facts: ConvFacts, target: Target) -> Optional[str]:
    """Why the native operator can not serve this node on this target (None: it can)."""
    if not target.at_least(MIN_VERSION):
        return f"tract {target.version_text} has no {OP} (first in {MIN_VERSION})"
    if facts.activation != "silu":
        return f"the op always applies SiLU; node has activation={facts.activation}"
    if facts.has_bias:
        return "the op has no bias; node has one"
    dtypes = {facts.dtypes[name] for name in ("x", "conv_state", "weight")}
    if len(dtypes) != 1 or not dtypes <= {"f16", "f32"}:
        return f"the op wants x, state and weight all f16 or all f32; node has {facts.dtypes}"
    dtype = dtypes.pop()
    if not target.at_least(WIDE_VERSION):
        return _first_form_reason(facts, target, dtype)
    if facts.kernel not in WIDE_KERNELS:
        return f"the op takes K=2..5; node has K={facts.kernel}"
    return None


def emit(ctx: EmitContext) -> list:
    """Write the operator; the node's dtypes are uniform, so no cast is needed."""
    ops = ctx.operands
    dtype = ctx.facts.dtypes["x"]
    outputs = (ctx.output_tensor(0, ops["x"].shape, dtype),
               ctx.output_tensor(1, ops["conv_state"].shape, dtype))
    ctx.apply_multi(OP, [ops["x"], ops["weight"], ops["conv_state"]], outputs)
    return ["tract_transformers"]
