"""The ``gdn-fx`` command's arguments, checked before any work is done.

Each check raises a :class:`~gdn_fx.errors.GdnFxError` whose message names the argument and
its value; the command prints it as one line and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from gdn_fx.errors import UsageError

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
    if getattr(args, "runtime", "cpu") != "cpu" and args.seq_len is None and \
            not args.dynamic_seq:
        raise UsageError(f"--runtime {args.runtime}: the generation-ready export "
                         "(gdn_fx.hf.generator) lowers for the CPU runtime only for now; give "
                         "--seq-len N (one step) or --dynamic-seq")
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


def check_out(path: Path) -> None:
    """``--out`` must name an NNEF file or folder."""
    if not str(path).endswith(NNEF_SUFFIXES):
        raise UsageError(f"--out {path}: must end with {', '.join(NNEF_SUFFIXES)}")


def check_family(name: str) -> None:
    """``--family`` must be a known family that the installed transformers has."""
    from gdn_fx.hf.configs import family_classes

    family_classes(name)  # UnknownFamily / FamilyUnavailable name the family


def check_config(path: Path) -> None:
    """``--config`` must be a readable, non-empty JSON object with a ``model_type``."""
    text = _read(path, "--config")
    if not text.strip():
        raise UsageError(f"--config {path} is empty")
    try:
        values = json.loads(text)
    except json.JSONDecodeError as err:
        raise UsageError(f"--config {path} is not valid JSON: {err}") from None
    if not isinstance(values, dict):
        raise UsageError(f"--config {path} must hold a JSON object, got {type(values).__name__}")
    model_type = values.get("model_type")
    if not model_type:
        raise UsageError(f"--config {path} has no \"model_type\" (which transformers model?)")
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        raise UsageError(f"--config {path}: model_type {model_type!r} is unknown to "
                         f"transformers {transformers.__version__}")


def check_model_dir(path: Path) -> None:
    """``--model`` must be a folder holding a config.json."""
    if not path.is_dir():
        raise UsageError(f"--model {path} is not a folder")
    if not (path / "config.json").is_file():
        raise UsageError(f"--model {path} has no config.json")


def _read(path: Path, flag: str) -> str:
    if not path.exists():
        raise UsageError(f"{flag} {path} does not exist")
    if not path.is_file():
        raise UsageError(f"{flag} {path} is not a file")
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError) as err:
        raise UsageError(f"{flag} {path} cannot be read: {err}") from None


def one_line(err: BaseException) -> str:
    """The error as the one line the command prints."""
    text = " ".join(str(err).split())
    return f"gdn-fx: {type(err).__name__}: {text}" if text else f"gdn-fx: {type(err).__name__}"
