"""What the command modules share: the defaults several commands name, argparse's subparsers type and
the readings of options that several commands have. Nothing heavy imported (argparse and harken's
error type): parsing costs nothing."""

from __future__ import annotations

import argparse
from importlib.resources import files

from ..shared.errors import HarkenError

DEFAULT_MODEL = "Qwen/Qwen3-ASR-0.6B"
DEFAULT_ALIGNER = "Qwen/Qwen3-ForcedAligner-0.6B"
CODEC_MODES = ("hifi", "balanced", "low")  # shared/codec.py MODES (not imported here: no numpy at parse time)
Subparsers = argparse._SubParsersAction  # what add_subparsers returns


def given(args: argparse.Namespace, **names: str) -> dict:
    """{keyword: value} of the options the user gave (the others keep the callee's defaults)."""
    return {k: getattr(args, v) for k, v in names.items() if getattr(args, v) is not None}


def output_format(args: argparse.Namespace) -> str:
    """--format, with --json its older spelling of `--format json`."""
    if args.json and args.format not in ("text", "json"):
        raise HarkenError(f"--json and --format {args.format} disagree: give one")
    return "json" if args.json else args.format


def sample_path() -> str:
    """The bundled 20-s speech sample (harken/data/sample.wav)."""
    return str(files("harken") / "data" / "sample.wav")
