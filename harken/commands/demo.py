"""`harken demo`: the whole system on one machine — an in-process gRPC server on a free port and
the edge agent (the SDK client) streaming the bundled sample to it in real time, with the live
transcript in the terminal and what went over the wire at the end.

It uses Qwen/Qwen3-ASR-0.6B when that is in the Hugging Face cache or can be downloaded, else
harken's own small synth-en model (trained on synthetic English speech; a one-line banner says so),
and the tiny random checkpoint only when neither can be had (its words are meaningless).
"""

from __future__ import annotations

import argparse

import asyncio
import sys
import time

import numpy as np

from .options import CODEC_MODES, Subparsers, sample_path

from ..shared.errors import ModelError
from ..shared.features_spec import SAMPLE_RATE

PIECE_S = 0.1
SYNTH_EN_BANNER = (
    "harken demo: Qwen/Qwen3-ASR-0.6B is not available here, so this runs synth-en, harken's own 19 MB "
    "Qwen3-ASR trained on synthetic English speech (a test instrument, not the real model).")
TINY_DEMO_BANNER = (
    "harken demo: Qwen/Qwen3-ASR-0.6B is not available here (no cache, no network), so this runs the\n"
    "tiny random checkpoint: VAD, features, codec, gRPC, sessions and the engine are all real, but the\n"
    "model's words are meaningless. With network access the real model is downloaded once and used.")


def choose_model(requested: str | None) -> tuple[str, str | None]:
    """(model, banner): the requested one, else the real default when it can be had, else synth-en
    when this checkout ships it, else tiny; the banner says what a fallback is."""
    from ..cloud.model.checkpoint import DEFAULT_MODEL, SYNTH_EN, TINY, Checkpoint

    if requested:
        return requested, TINY_DEMO_BANNER if requested == TINY else None
    for name, banner in ((DEFAULT_MODEL, None), (SYNTH_EN, SYNTH_EN_BANNER)):
        try:
            Checkpoint.open(name)
            return name, banner
        except ModelError:
            pass
    return TINY, TINY_DEMO_BANNER


async def _paced(audio: np.ndarray, realtime: bool):
    step = int(PIECE_S * SAMPLE_RATE)
    start = time.monotonic()
    for i in range(0, audio.size, step):
        if realtime:
            await asyncio.sleep(max(0.0, start + i / SAMPLE_RATE - time.monotonic()))
        yield audio[i:i + step]


async def run_demo(input_path: str, model: str | None, realtime: bool = True, out=sys.stdout,
                   codec: str = "balanced") -> str:
    """Serve, stream `input_path` through the SDK (features in codec mode `codec`), print the live
    transcript; return the text."""
    import torch

    from ..cloud.model.asr import Qwen3ASR
    from ..cloud.server import ServerOptions, start_server
    from ..edge.audio import load_audio
    from .terminal import LiveView
    from ..edge.client.grpc_client import ClientOptions, TranscriptionClient
    from ..shared.text import TranscriptText

    audio = load_audio(input_path)  # first: a bad input fails before the model loads
    name, banner = choose_model(model)
    if banner:
        print(banner, file=sys.stderr)
    if not torch.cuda.is_available():
        torch.set_num_threads(1)  # small batched matmuls on a busy CPU: one thread is fastest
    asr = Qwen3ASR.load(name)
    server = await start_server(asr, ServerOptions(host="127.0.0.1", port=0))
    try:
        print(f"harken demo: server on {server.address}, model {name}; streaming "
              f"{audio.size / SAMPLE_RATE:.1f} s of audio{' in real time' if realtime else ''}", file=out)
        client = TranscriptionClient(server.address, options=ClientOptions(codec_mode=codec))
        view, events, text = LiveView(out), [], TranscriptText()
        t0 = time.monotonic()
        async for event in client.stream(_paced(audio, realtime)):
            events.append(event)
            segment_text = text.add(event)
            if event.is_final:
                _final_line(out, view, event, segment_text)
            else:
                view.show(event)
        view.close()
        elapsed = time.monotonic() - t0
    finally:
        await server.stop(grace_s=2.0)
    s = client.stats
    speech_s = s.frames_produced / 100
    kbps = s.payload_bytes_produced * 8 / speech_s / 1000 if speech_s else 0.0
    segments = len({e.segment_id for e in events if e.is_final})
    print(f"{segments} segments, {speech_s:.1f} s of speech sent as {s.frames_produced} feature frames in "
          f"{s.payload_bytes_produced} bytes ({kbps:.1f} kbps during speech; PCM16 is 256 kbps); "
          f"{len(events)} transcript events in {elapsed:.1f} s", file=out)
    return text.text


def _final_line(out, view, event, text: str) -> None:
    """A finished segment: its times, language and text, replacing the live line on a terminal."""
    if view.tty:
        out.write("\r\x1b[K")
    view.width = 0
    language = f" {event.language}" if event.language else ""
    print(f"[{event.start_s:6.2f} - {event.end_s:6.2f} s{language}] {text.strip() or '(no words)'}",
          file=out, flush=True)


def demo_command(input_path: str, model: str | None, realtime: bool, codec: str = "balanced") -> int:
    asyncio.run(run_demo(input_path, model, realtime, codec=codec))
    return 0


def register(sub: Subparsers) -> None:
    s = sub.add_parser("demo", help="the whole system on the bundled sample: server + edge agent, live transcript",
                       description="Start an in-process gRPC server on a free port and stream the bundled "
                                   "sample (or IN) to it through the edge agent in real time, printing the "
                                   "live transcript and what went over the wire. Uses Qwen/Qwen3-ASR-0.6B "
                                   "when cached or downloadable, else the tiny random model (with a banner).")
    s.add_argument("input", nargs="?", help="audio file (default: the bundled sample)")
    s.add_argument("--model", help="model to serve: checkpoint dir, Hugging Face id, 'tiny' or 'synth-en' "
                                   "(default: Qwen/Qwen3-ASR-0.6B if available, else tiny)")
    s.add_argument("--fast", action="store_true", help="stream as fast as possible instead of in real time")
    s.add_argument("--edge-only", action="store_true",
                   help="only the edge pipeline (VAD, features, codec), no server or model: what it would send")
    s.add_argument("--codec", "--mode", dest="codec", choices=CODEC_MODES, default="balanced",
                   help="feature codec mode: hifi, balanced (default, ~25 kbps during speech) or low "
                        "(--mode: the older name)")
    s.set_defaults(run=run)


def run(args: argparse.Namespace) -> int | None:
    if args.edge_only:
        from .front_end import demo_edge

        return demo_edge(args.input or sample_path(), mode=args.codec)
    return demo_command(args.input or sample_path(), args.model, realtime=not args.fast, codec=args.codec)
