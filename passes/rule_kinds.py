"""transformers' two families of delta rules, one record each: everything that differs.

GDN (qwen3_5, qwen3_next, olmo_hybrid, lara_mini: a scalar gate per head) and KDA
(kimi_linear, glm5_next, bailing_hybrid: a gate per key channel) differ in the gate's shape,
in the names and modules of their functions, and in how their recurrent rule prepares q.
The chunk templates (chunk_templates.py, gdn_chunk.py) and the transformers helpers
(gdn_fx/hf/patching.py, gdn_fx/hf/dropins.py) read these records instead of testing names;
a name no record has is an error, never another family's shapes.

To add a family: one more record in ``KINDS``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from gdn_fx.errors import UnknownName


@dataclass(frozen=True)
class DeltaKind:
    """One family of transformers' delta rules."""

    name: str  # "gdn", "kda": how tests and callers name it
    label: str  # how messages name it
    per_key_gate: bool  # gate [B, T, H, Dk] (else [B, T, H])
    recurrent: str  # the modeling files' function names
    chunk: str
    # (module under transformers.models, function) holding the chunk rule, first found wins:
    # releases differ in which families they ship (5.0 has qwen3_next's rule, not qwen3_5's)
    chunk_places: tuple
    # How the recurrent rule prepares q and k, which an exact drop-in repeats bit for bit:
    # on dense copies (else on the layer's views as they come), and q divided by sqrt(Dk)
    # (else multiplied by 1 / sqrt(Dk)).
    dense_operands: bool
    divides_q: bool

    @property
    def names(self) -> tuple[str, str]:
        """(recurrent, chunk) function names."""
        return self.recurrent, self.chunk

    def gate_shape(self, b: int, t: int, h: int, dk: int) -> tuple:
        return (b, t, h, dk) if self.per_key_gate else (b, t, h)

    def chunked_gate_rank(self) -> int:
        """Rank of the padded gate chunked as [B, H, n, C] (+ [Dk]) that the chunk rule
        takes a cumsum of."""
        return 5 if self.per_key_gate else 4


GDN = DeltaKind("gdn", "GDN", False, "torch_recurrent_gated_delta_rule",
                "torch_chunk_gated_delta_rule",
                (("qwen3_5.modeling_qwen3_5", "torch_chunk_gated_delta_rule"),
                 ("qwen3_next.modeling_qwen3_next", "torch_chunk_gated_delta_rule")),
                dense_operands=True, divides_q=True)
KDA = DeltaKind("kda", "KDA", True, "recurrent_kimi_delta_attention",
                "chunk_kimi_delta_attention",
                (("kimi_linear.modeling_kimi_linear", "chunk_kimi_delta_attention"),),
                dense_operands=False, divides_q=False)
KINDS = {kind.name: kind for kind in (GDN, KDA)}


def kind_named(name: str | DeltaKind) -> DeltaKind:
    """The record called ``name`` (a record is returned as it is)."""
    if isinstance(name, DeltaKind):
        return name
    try:
        return KINDS[name]
    except KeyError:
        raise UnknownName(f"no delta-rule family {name!r}; known: {sorted(KINDS)}") from None


def kind_of_chunked_gate(rank: int) -> Optional[DeltaKind]:
    """The family whose chunked gate has ``rank`` axes, or None."""
    return next((k for k in KINDS.values() if k.chunked_gate_rank() == rank), None)
