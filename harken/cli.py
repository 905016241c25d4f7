"""The `harken` command. Each command lives in a module of its own under harken/commands/ (the lab's in
lab/bench/cli.py and lab/training/cli.py) that registers its parser and the function that runs it;
this file assembles them, in the order `harken --help` lists them, and turns errors into one line.

The command modules import their side of the system inside their run functions: an edge install
has no torch, and `harken stream --server`, `harken vad` or `harken --help` must not import the
cloud (torch alone takes 1.3 s here)."""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

from .commands import align, demo, front_end, serve, stream, transcribe
from .shared.errors import HarkenError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="harken",
        description="Live speech-to-text: VAD and log-mel on the edge, Qwen3-ASR in the cloud.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo.register(sub)
    front_end.register_vad(sub)
    front_end.register_features(sub)
    transcribe.register_transcribe(sub)
    align.register(sub)
    transcribe.register_make_tiny_model(sub)
    if importlib.util.find_spec("harken.training") is not None:  # the lab: a checkout, not the wheel
        from .training import cli as training

        training.register_train(sub)
        training.register_eval(sub)
    stream.register(sub)
    serve.register_serve(sub)
    serve.register_health(sub)
    if importlib.util.find_spec("harken.bench") is not None:
        from .bench import cli as bench

        bench.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command in ("stream", "health") and "grpc" not in sys.modules:
        # gRPC's C core logs every failed TLS handshake on stderr; these commands say what failed in
        # one line of their own. Read once, when grpc is first imported; a user's setting wins.
        os.environ.setdefault("GRPC_VERBOSITY", "NONE")
    try:
        return args.run(args) or 0
    except HarkenError as e:
        print(f"harken {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
