"""Export by streaming from the checkpoint folder (issue 31; ``gdn-fx export --model DIR``).

    files = export_checkpoint("ckpt/", "out/m.nnef.tgz", weights="q4_0")  # stream=True

The in-memory route (``from_pretrained`` in f32, then ``export_generator``) holds the whole
model in f32, and more copies while it writes (18.1 GB peak for a 1.5 GB bf16 0.8B). The
streamed route builds the model with its parameters on the meta device, then gives each
matrix weight (``nn.Linear`` and ``nn.Embedding`` weights, MoE expert stacks) a PLACEHOLDER
that holds no memory (gdn_fx.lowering.t2n.placeholders) and the other parameters (norms, conv
filters, decays: small, and read by the constants torch-to-nnef folds) their real values.
It traces and lowers that model as the in-memory route does; when torch-to-nnef writes the
variables, each placeholder is read from the safetensors files (one tensor at a time),
converted to the model's dtype and the artifact's format (f32, f16, q4_0) by the same
functions: the files are byte for byte those of the in-memory route (tests/test_stream_export.py).

What it refuses: a constant computed from a placeholder's values (ExportRefused naming the
NNEF variable), a parameter the checkpoint holds under a layout it does not know
(CheckpointError naming it), ``decode=True`` (the decode graph is checked against the model).
MoE blocks become ``tract_moe_ffn`` as in memory: the fusion proves each block by running it
on random stand-ins for its placeholders (lowering/t2n/moe_ffn.py), and the operator's
weights are placeholders too, computed from the stored expert stacks when written.
The CLI's check of a streamed export (``gdn_fx.pipeline.streamed_source``) is ``gdn-fx generate --check --model
DIR``'s: tract generates from the written file, its model is released, then transformers
generates on the weights the file stores (``stored_reference``), one model in memory at a time.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence, Union

import torch
from torch import nn

from gdn_fx.errors import CheckpointError, CheckpointLayoutUnknown, UsageError
from gdn_fx.hf import checkpoint_keys
from gdn_fx.lowering.t2n.placeholders import Placeholders, streaming

INDEX = "model.safetensors.index.json"


class Checkpoint:
    """The safetensors files of a checkpoint folder, read one tensor at a time, under the
    parameter keys of the model (``mapping``: transformers' conversion mapping of its type,
    gdn_fx.hf.checkpoint_keys)."""

    def __init__(self, folder: Union[str, Path], mapping: Sequence = ()) -> None:
        from safetensors import safe_open

        self.folder = Path(folder)
        index = self.folder / INDEX
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            self.files = {key: self.folder / name for key, name in weight_map.items()}
        else:
            self.files = {}
            for file in sorted(self.folder.glob("*.safetensors")):
                with safe_open(str(file), "pt") as handle:
                    self.files.update({key: file for key in handle.keys()})
        if not self.files:
            raise CheckpointError(f"{self.folder} holds no safetensors weights (--stream reads "
                                  "model.safetensors or its shards)")
        self.plain, self.assembled = checkpoint_keys.parameter_keys(list(self.files), mapping)

    def read(self, key: str) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(str(self.files[key]), "pt") as handle:
            return handle.get_tensor(key)

    def loader(self, names: list, dtype: torch.dtype, shapes: dict
               ) -> Optional[Callable[[], torch.Tensor]]:
        """A function reading the parameter known by ``names`` (its aliases, tied weights)
        in ``dtype``, or None when the checkpoint holds none of them in a known layout
        (``shapes``: every parameter's shape, for the converters that split)."""
        for name in names:
            if name in self.plain:
                return lambda key=self.plain[name]: self.read(key).to(dtype)
            made = self.assembled.get(name)
            if checkpoint_keys.known(made):
                return lambda name=name, made=made: made.build(name, self.read, shapes).to(dtype)
        return None


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Within: every parameter a module registers goes to the meta device (buffers stay:
    rotary frequencies and the like are computed at construction and not in checkpoints)."""
    register = nn.Module.register_parameter

    def on_meta(module, name, param):
        register(module, name, param)
        if param is not None:
            module._parameters[name] = nn.Parameter(param.to("meta"),
                                                    requires_grad=param.requires_grad)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def _streams(module: nn.Module, local: str, param: nn.Parameter, path: str) -> bool:
    """Whether the parameter is a placeholder: a matrix that products or gathers read."""
    if local == "weight" and isinstance(module, (nn.Linear, nn.Embedding)):
        return True
    return param.dim() == 3 and path.rsplit(".", 1)[-1] == "experts"


def placeholder_model(folder: Union[str, Path], dtype: torch.dtype = torch.float32
                      ) -> tuple[nn.Module, Placeholders]:
    """The causal LM of checkpoint ``folder`` in ``dtype``: matrix weights as placeholders
    whose sources read ``folder``'s safetensors, the other parameters and the persistent
    buffers loaded. Raises CheckpointError for a parameter the checkpoint does not hold."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder)
    checkpoint = Checkpoint(folder, checkpoint_keys.conversions(config.model_type))
    with _parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.tie_weights()  # the meta copies above broke the ties made at construction
    placeholders, names, owners = Placeholders(), {}, {}
    for path, module in model.named_modules(remove_duplicate=False):
        for local, param in module._parameters.items():
            if param is not None:
                full = f"{path}.{local}" if path else local
                names.setdefault(id(param), []).append(full)
                owners.setdefault(id(param), []).append((module, local, path))
    shapes = {name: tuple(param.shape) for name, param in model.named_parameters()}
    replaced = {}
    for key, aliases in names.items():
        module, local, path = owners[key][0]
        param = module._parameters[local]
        load = checkpoint.loader(aliases, dtype, shapes)
        if load is None:
            raise CheckpointLayoutUnknown(
                f"{folder} holds no tensor for parameter {aliases[0]} {tuple(param.shape)} "
                "under a layout the streamed export reads (--in-memory: transformers "
                "knows it)")
        value = placeholders.make(aliases[0], param.shape, dtype, load) \
            if _streams(module, local, param, path) else load()
        replaced[key] = nn.Parameter(value, requires_grad=False)
        for owner, name, _ in owners[key]:
            owner._parameters[name] = replaced[key]
    _load_buffers(model, checkpoint, dtype)
    return model.eval(), placeholders


def stored_reference(folder: Union[str, Path], nnef: Union[str, Path],
                     dtype: torch.dtype = torch.float32) -> nn.Module:
    """The causal LM of checkpoint ``folder`` in ``dtype`` holding the weights as ``nnef``
    stores them (f16 rounded, Q4_0 dequantized: what tract multiplies with), built without a
    second copy: :func:`placeholder_model`'s placeholders, each replaced by its stored values
    as they are read from ``nnef``, the other parameters and buffers read from ``folder``. What
    ``gdn-fx generate --check --model DIR`` compares with: ``from_pretrained`` in f32 of a
    4B-shaped bf16 folder alone peaked at 23.1 GiB here (docs/FACTS.md). CheckpointError
    naming a matrix ``nnef`` holds no values for."""
    from gdn_fx.hf.generator import replace_parameter, with_stored_weights

    model, placeholders = placeholder_model(folder, dtype)
    model = with_stored_weights(model, nnef, in_place=True)
    for name, param in list(model.named_parameters()):
        source = placeholders.source(param)
        if source is None:
            continue
        if not name.rsplit(".", 1)[0].endswith(".experts"):
            raise CheckpointError(f"{nnef} stores no values for {name} "
                                  f"{tuple(param.shape)}: is it an export of {folder}?")
        # tract_moe_ffn's operands hold the expert stacks in tract's layout, under names of
        # their own: the stacks come from the checkpoint (f32: what the file stores)
        replace_parameter(model, param, nn.Parameter(source.load(), requires_grad=False))
    return model


def _load_buffers(model: nn.Module, checkpoint: Checkpoint, dtype: torch.dtype) -> None:
    """Persistent buffers the checkpoint holds, loaded (those it lacks keep their init)."""
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name in checkpoint.files:
                real = checkpoint.read(name)
                buffer.copy_(real.to(buffer.dtype if not buffer.is_floating_point()
                                     else dtype))


def export_checkpoint(folder: Union[str, Path], path: Union[str, Path], *,
                      stream: bool = True, dtype: str = "f32",
                      say: Callable[[str], None] = lambda line: None, **options):
    """Write the checkpoint ``folder`` (config.json + safetensors) as a generation-ready NNEF
    at ``path`` (``export_generator``'s artifact; ``options`` are its keyword arguments, the
    export options ``weights=``, ``choose=``, ... among them).

    stream: True (the default here) traces the model without its weights and writes each
    weight from the safetensors files, converted to the weight format on the way (see the module
    doc); peak memory does not grow with the model's f32 size. False: the in-memory route
    (``from_pretrained`` in ``dtype``, then ``export_generator``). Returns GeneratorFiles.
    """
    from gdn_fx.hf.generator import export_generator
    from gdn_fx.hf.configs import DTYPES

    if dtype not in DTYPES:
        raise UsageError(f"dtype={dtype!r}: use one of {', '.join(DTYPES)}")
    if not stream:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(folder, dtype=DTYPES[dtype]).eval()
        return export_generator(model, path, say=say, **options)
    if options.get("decode"):
        raise UsageError("--stream writes one graph: the decode graph is checked against "
                         "the model's outputs, and a streamed export never holds its weights")
    model, placeholders = placeholder_model(folder, DTYPES[dtype])
    with streaming(placeholders):
        return export_generator(model, path, say=say, **options)


def _reference_too_large(model: nn.Module, dtype: torch.dtype) -> Optional[str]:
    """Why transformers' reference of ``model`` in ``dtype`` would not fit in the memory this
    machine has available now (None: it fits, or the available memory is unknown)."""
    needed = sum(p.numel() for p in model.parameters()) * dtype.itemsize
    available = _available_bytes()
    if available is None or needed <= 0.8 * available:
        return None
    return (f"transformers' reference needs ~{needed / 2**30:.1f} GiB in "
            f"{str(dtype).removeprefix('torch.')}, {available / 2**30:.1f} GiB are available")


def _available_bytes() -> Optional[int]:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
