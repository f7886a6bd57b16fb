"""Which stored tensors make each parameter: transformers' load-time key conversions, read forward.

transformers 5 loads some checkpoints through a conversion mapping of their model type
(``transformers.conversion_mapping.get_checkpoint_conversion_mapping``), and ``save_pretrained``
writes the checkpoint back in that stored layout: olmo_hybrid keeps ``attention_layer_norm``
for ``input_layernorm`` and one conv filter per q, k, v; qwen3_next one matrix per expert;
lara_mini one ``in_proj`` for four projections. The streamed export reads a parameter without
transformers' loader, so it applies the same mapping, forward, to the stored keys:

- a renaming (``WeightRenaming``): a regex substitution of the key, in the mapping's order;
- a converter (``WeightConverter``) whose operations are ``MergeModulelist`` (stack the tensors
  of the ``*`` index, e.g. the experts, along its dim), ``Concatenate`` (join the source
  patterns' tensors, in the pattern order, along its dim) or ``Split`` (cut one tensor along its
  dim into the targets, each as long as its parameter).

A converter with any other operation makes its targets unknown (the export then says so and
the in-memory route reads them): a tensor is never assembled by a guess.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from gdn_fx.errors import CheckpointError

KNOWN_OPERATIONS = {"MergeModulelist", "Concatenate", "Split"}
_INDEX = re.compile(r"\.(\d+)\.")


def conversions(model_type: str) -> list:
    """transformers' conversion mapping of ``model_type`` ([] where the installed transformers
    has none or no such API: its checkpoints are stored under the model's own keys)."""
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    except ImportError:
        return []
    try:
        return list(get_checkpoint_conversion_mapping(model_type) or [])
    except (KeyError, ValueError):
        return []


@dataclass
class Assembly:
    """How one parameter is made from stored tensors: ``parts`` are (source pattern index,
    ``*`` index or None, stored key); ``operations`` the converter's, as (name, dim)."""

    operations: list
    targets: list  # every parameter key the converter makes from these parts (Split)
    parts: list = field(default_factory=list)

    def build(self, name: str, read: Callable[[str], torch.Tensor],
              shapes: dict) -> torch.Tensor:
        ops = dict(self.operations)
        if "Split" in ops:
            (_, _, key), = self.parts
            sizes = [shapes[target][ops["Split"]] for target in self.targets]
            whole = read(key)
            if whole.dim() <= ops["Split"] or sum(sizes) != whole.shape[ops["Split"]]:
                raise CheckpointError(f"{key} {tuple(whole.shape)} does not split into "
                                      f"{', '.join(self.targets)} of {sizes} along axis "
                                      f"{ops['Split']}")
            chunks = torch.split(whole, sizes, dim=ops["Split"])
            return chunks[self.targets.index(name)].contiguous()
        groups = []
        for pattern in sorted({p for p, _, _ in self.parts}):
            parts = sorted((i, k) for p, i, k in self.parts if p == pattern)
            if "MergeModulelist" in ops and [i for i, _ in parts] != list(range(len(parts))):
                raise CheckpointError(f"the checkpoint holds {name}'s parts "
                                      f"{[k for _, k in parts]}: not indices 0 .. "
                                      f"{len(parts) - 1} each once")
            tensors = [read(key) for _, key in parts]
            if "MergeModulelist" in ops:
                tensors = [torch.stack(tensors, dim=ops["MergeModulelist"])]
            groups.extend(tensors)
        return groups[0] if len(groups) == 1 else torch.cat(groups, dim=ops.get("Concatenate", 0))


def parameter_keys(stored: list[str], mapping: list) -> tuple[dict, dict]:
    """({parameter key: stored key} for renamed tensors, {parameter key: Assembly} for those a
    converter makes) under ``mapping``; a stored key no entry changes maps to itself."""
    renames = [entry for entry in mapping if type(entry).__name__ == "WeightRenaming"]
    converters = [entry for entry in mapping if type(entry).__name__ == "WeightConverter"]
    plain, assembled = {}, {}
    for key in stored:
        renamed = _renamed(key, renames)
        if not any(_convert(renamed, key, c, assembled) for c in converters):
            plain[renamed] = key
    return plain, assembled


def _renamed(key: str, renames: list) -> str:
    for entry in renames:
        targets = entry.target_patterns
        for index, source in enumerate(entry.source_patterns):
            key = re.sub(source, targets[min(index, len(targets) - 1)], key)
    return key


def _convert(renamed: str, key: str, converter, assembled: dict) -> bool:
    """Record ``key`` as a part of the parameters ``converter`` makes from it (True), or leave
    it (False: no source pattern of the converter matches)."""
    for pattern, source in enumerate(converter.source_patterns):
        found = re.search(source, renamed)
        if found is None:
            continue
        index = _INDEX.search(found.group(0)) if "*" in source else None
        targets = [renamed[:found.start()] + t + renamed[found.end():]
                   for t in converter.target_patterns]
        operations = [(type(op).__name__, getattr(op, "dim", 0))
                      for op in converter.operations]
        for target in targets:
            entry = assembled.setdefault(target, Assembly(operations, targets))
            entry.parts.append((pattern, int(index[1]) if index else None, key))
        return True
    return False


def known(assembly: Optional[Assembly]) -> bool:
    """Whether every operation of ``assembly`` is one this module applies."""
    return assembly is not None and all(name in KNOWN_OPERATIONS
                                        for name, _ in assembly.operations)
