"""The ``gdn-fx`` command's arguments, checked before any work is done.

Each check raises a :class:`~gdn_fx.errors.GdnFxError` whose message names the argument and
its value; the command prints it as one line and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import zipfile
from pathlib import Path

from gdn_fx.errors import CheckpointError, UsageError

NNEF_SUFFIXES = (".nnef.tgz", ".nnef.tar", ".nnef")


def check(args: argparse.Namespace) -> None:
    """Refuse unusable arguments of any subcommand (cheap checks only: files, numbers, names)."""
    if getattr(args, "out", None) is not None:
        check_out(args.out)
    for flag in ("seq_len", "max_new_tokens"):
        value = getattr(args, flag, None)
        if value is not None and value < 1:
            raise UsageError(f"--{flag.replace('_', '-')} must be >= 1, got {value}")
    chunk = getattr(args, "prefill_chunk", None)
    if chunk is not None and chunk < 0:
        raise UsageError(f"--prefill-chunk must be >= 0 (0: the whole prompt), got {chunk}")
    if getattr(args, "generalize", False) and (args.seq_len is not None or args.dynamic_seq):
        raise UsageError("--generalize writes the generation-ready artifact: it takes no "
                         "--seq-len / --dynamic-seq")
    if getattr(args, "decode_graph", False) and (args.seq_len is not None or args.dynamic_seq):
        raise UsageError("--decode-graph belongs to the generation-ready artifact: it takes "
                         "no --seq-len / --dynamic-seq")
    if getattr(args, "stream", False) and (args.seq_len is not None or args.dynamic_seq):
        raise UsageError("--stream writes the generation-ready export: no --seq-len, "
                         "--dynamic-seq")
    if args.command == "export" and args.batch is not None:
        _check_batched_export(args)
    if args.command == "generate" and args.runtime != "cpu" and args.batch is not None:
        raise UsageError(f"--runtime {args.runtime}: --batch (gdn_fx.hf.batch) runs on the "
                         "CPU runtime only")
    if args.command == "export" and args.runtime != "cpu":
        for flag in ("generalize", "stream"):
            if getattr(args, flag, False):
                raise UsageError(f"--runtime {args.runtime}: --{flag} lowers for the CPU "
                                 "runtime only; the reify route (without it) lowers for "
                                 f"{args.runtime}")
    if args.command == "export":
        _check_weight_route(args)
    if getattr(args, "family", None) is not None:
        check_family(args.family)
    if getattr(args, "config", None) is not None:
        check_config(args.config)
    if getattr(args, "model_dir", None) is not None:
        check_model_dir(args.model_dir)
    if args.command == "diff":
        for path in (args.a, args.b):
            if not path.exists():
                raise UsageError(f"diff: {path} does not exist")


def _check_weight_route(args: argparse.Namespace) -> None:
    """--stream and --in-memory name how --model DIR's weights are read: one of them at most,
    with --model; --stream takes none of the options only the in-memory route takes."""
    if args.stream and args.in_memory:
        raise UsageError("--stream and --in-memory exclude each other")
    for flag in ("stream", "in_memory"):
        if getattr(args, flag) and args.model_dir is None:
            raise UsageError(f"--{flag.replace('_', '-')} reads a checkpoint folder: give "
                             "--model DIR")
    if args.stream:
        for flag in ("generalize", "decode_graph"):
            if getattr(args, flag):
                raise UsageError(f"--stream writes the one-graph reify export: no "
                                 f"--{flag.replace('_', '-')} (--in-memory takes it)")


def _check_batched_export(args: argparse.Namespace) -> None:
    """--batch B: an int >= 1, on the reify route for the CPU runtime (gdn_fx.hf.batch)."""
    if args.batch < 1:
        raise UsageError(f"--batch must be >= 1, got {args.batch}")
    if args.seq_len is not None or args.dynamic_seq:
        raise UsageError("--batch writes the generation-ready artifact: it takes no "
                         "--seq-len / --dynamic-seq")
    for flag in ("generalize", "decode_graph", "stream"):
        if getattr(args, flag):
            raise UsageError(f"--batch is one graph on the reify route: it takes no "
                             f"--{flag.replace('_', '-')}")
    if args.runtime != "cpu":
        raise UsageError(f"--runtime {args.runtime}: --batch (gdn_fx.hf.batch) lowers for the "
                         "CPU runtime only")


def check_out(path: Path) -> None:
    """``--out`` must name an NNEF file or folder that can be written: its nearest existing
    parent a writable folder, and an archive's name not already a folder."""
    if not str(path).endswith(NNEF_SUFFIXES):
        raise UsageError(f"--out {path}: must end with {', '.join(NNEF_SUFFIXES)}")
    for parent in path.parents:
        if not parent.exists():
            continue
        if not parent.is_dir():
            raise UsageError(f"--out {path}: {parent} is a file, not a folder")
        if not os.access(parent, os.W_OK | os.X_OK):
            raise UsageError(f"--out {path}: the folder {parent} is not writable")
        break
    if path.is_dir() and not path.name.endswith(".nnef"):
        raise UsageError(f"--out {path} is a folder; an archive name (.nnef.tgz, .nnef.tar) "
                         "must not be")


def check_family(name: str) -> None:
    """``--family`` must be a known family that the installed transformers has."""
    from gdn_fx.hf.configs import family_classes

    family_classes(name)  # UnknownFamily / FamilyUnavailable name the family


def check_config(path: Path, flag: str = "--config", error=UsageError) -> dict:
    """``--config`` must be a readable, non-empty JSON object whose ``model_type`` the
    installed transformers has as a causal LM (where transformers is installed: a command
    that builds the model says first that it needs it); returns its values. ``flag`` names
    the file in the message, ``error`` is the class raised."""
    text = _read(path, flag, error)
    if not text.strip():
        raise error(f"{flag} {path} is empty")
    try:
        values = json.loads(text)
    except json.JSONDecodeError as err:
        raise error(f"{flag} {path} is not valid JSON: {err}") from None
    if not isinstance(values, dict):
        raise error(f"{flag} {path} must hold a JSON object, got {type(values).__name__}")
    model_type = values.get("model_type")
    if not model_type:
        raise error(f"{flag} {path} has no \"model_type\" (which transformers model?)")
    try:
        import transformers
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError:  # a runtime-only install: generate reads the folder, not the model
        return values

    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        raise error(f"{flag} {path}: model_type {model_type!r} is unknown to "
                    f"transformers {transformers.__version__}")
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise error(f"{flag} {path}: model_type {model_type!r} is not a causal language "
                    f"model in transformers {transformers.__version__}")
    return values


def check_model_dir(path: Path) -> None:
    """``--model`` must be a checkpoint folder as ``save_pretrained`` writes it: a valid
    config.json (as ``--config``) and complete weights (every safetensors file as long as its
    header says; every shard of an index present)."""
    if not path.is_dir():
        raise UsageError(f"--model {path} is not a folder")
    if not (path / "config.json").is_file():
        raise UsageError(f"--model {path} has no config.json")
    check_config(path / "config.json", "--model", CheckpointError)
    for file in weight_files(path):
        if file.name.endswith(".safetensors"):
            check_safetensors(file)
        elif zipfile.is_zipfile(file) is False and _starts_as_zip(file):
            raise CheckpointError(f"--model {path}: {file.name} is truncated (a zip archive "
                                  "without its end)")


WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
INDEX_SUFFIX = ".index.json"


def weight_files(folder: Path) -> list:
    """The weight files transformers would read from ``folder``: the shards its index lists,
    else the single file; CheckpointError when there are none or a listed shard is missing."""
    for name in WEIGHT_FILES:
        index = folder / (name + INDEX_SUFFIX)
        if index.is_file():
            values = check_config_like(index)
            shards = sorted(set(values.get("weight_map", {}).values()))
            missing = [s for s in shards if not (folder / s).is_file()]
            if not shards or missing:
                raise CheckpointError(f"--model {folder}: {index.name} lists "
                                      f"{', '.join(missing) or 'no shards'} (missing)")
            return [folder / s for s in shards]
        if (folder / name).is_file():
            return [folder / name]
    raise CheckpointError(f"--model {folder} holds no weights ({', '.join(WEIGHT_FILES)} or "
                          "their .index.json): save_pretrained writes them beside config.json")


def check_config_like(path: Path) -> dict:
    """A JSON object file of a checkpoint (an index); CheckpointError naming it otherwise."""
    try:
        values = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{path} cannot be read as JSON: {err}") from None
    if not isinstance(values, dict):
        raise CheckpointError(f"{path} must hold a JSON object")
    return values


def check_safetensors(file: Path) -> None:
    """A safetensors file must hold its whole header and every byte the header describes
    (8-byte little-endian header length, the JSON header, then the data): a truncated copy
    is refused here, before transformers reads it. Only the header is read."""
    size = file.stat().st_size
    with open(file, "rb") as handle:
        head = handle.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else -1
        if length < 0 or length > size - 8:
            raise CheckpointError(f"{file} is truncated or not a safetensors file: {size} "
                                  f"bytes, header length {length}")
        try:
            header = json.loads(handle.read(length))
            ends = [entry["data_offsets"][1] for key, entry in header.items()
                    if key != "__metadata__"]
        except (ValueError, TypeError, KeyError, IndexError, AttributeError) as err:
            raise CheckpointError(f"{file}: its safetensors header cannot be read ({err})"
                                  ) from None
    need = 8 + length + max(ends, default=0)
    if need > size:
        raise CheckpointError(f"{file} is truncated: its header describes {need} bytes, the "
                              f"file has {size}")


def _starts_as_zip(file: Path) -> bool:
    with open(file, "rb") as handle:
        return handle.read(4) == b"PK\x03\x04"


def _read(path: Path, flag: str, error=UsageError) -> str:
    if not path.exists():
        raise error(f"{flag} {path} does not exist")
    if not path.is_file():
        raise error(f"{flag} {path} is not a file")
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError) as err:
        raise error(f"{flag} {path} cannot be read: {err}") from None


def one_line(err: BaseException) -> str:
    """The error as the one line the command prints."""
    text = " ".join(str(err).split())
    return f"gdn-fx: {type(err).__name__}: {text}" if text else f"gdn-fx: {type(err).__name__}"
