"""transformers' two families of delta rules, one record each: everything that differs.

GDN (qwen3_5, qwen3_next, olmo_hybrid, lara_mini: a scalar gate per head) and KDA
(kimi_linear, glm5_next, bailing_hybrid: a gate per key channel) differ, for the helpers that
swap transformers' rules, in the names of their functions and in how the recurrent rule
prepares q.
The transformers helpers (patching.py, dropins.py) read these records instead of testing
names; a name no record has is an error, never another family's.

To add a family: one more record in ``KINDS``.
"""

from __future__ import annotations

from dataclasses import dataclass

from gdn_fx.errors import UnknownName


@dataclass(frozen=True)
class DeltaKind:
    """One family of transformers' delta rules."""

    name: str  # "gdn", "kda": how tests and callers name it
    recurrent: str  # the modeling files' function names
    chunk: str
    # How the recurrent rule prepares q and k, which an exact drop-in repeats bit for bit:
    # on dense copies (else on the layer's views as they come), and q divided by sqrt(Dk)
    # (else multiplied by 1 / sqrt(Dk)).
    dense_operands: bool
    divides_q: bool

    @property
    def names(self) -> tuple[str, str]:
        """(recurrent, chunk) function names."""
        return self.recurrent, self.chunk


GDN = DeltaKind("gdn", "torch_recurrent_gated_delta_rule", "torch_chunk_gated_delta_rule",
                dense_operands=True, divides_q=True)
KDA = DeltaKind("kda", "recurrent_kimi_delta_attention", "chunk_kimi_delta_attention",
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

