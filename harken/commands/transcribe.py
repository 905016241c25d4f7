"""The cloud's command-line actions: `harken transcribe` and `harken make-tiny-model`.

Each takes plain arguments (the dispatcher parsed them), prints its result and returns an exit code;
user errors surface as `HarkenError` (one line, exit 2, from the dispatcher).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from ..shared.errors import HarkenError
from ..shared.features_spec import SAMPLE_RATE

TINY_BANNER = ("harken: --model tiny is a tiny RANDOM checkpoint for tests and plumbing checks; "
               "its output is meaningless")


def transcribe_command(input_path: str, model: str, language: str | None = None, context: str = "",
                       as_json: bool = False, device: str | None = None, dtype: str | None = None,
                       max_pass_s: float | None = None, progress: bool | None = None,
                       decode_limits: bool = True, decoder: str = "own", output_format: str = "text") -> int:
    """Offline: audio file -> log-mel (edge ONNX path) -> Qwen3-ASR -> text, one pass per piece.

    Audio up to `max_pass_s` (default 1200 s, the official limit) is one pass; longer audio is cut
    at quiet points as the official package does (`split_at_quiet_points`) and each piece is a pass
    of its own, so memory is set by the piece, not the file. Every pass is bounded by its audio
    (`DecodeLimits`: token budget and loop guard; `decode_limits=False` decodes as the official
    package does, up to 512 tokens with no loop guard). Progress goes to stderr when it is a terminal
    (or with `progress=True`). `decoder` "vllm": the decode runs on vLLM (cloud/inference/vllm_decoder.py).

    `output_format` "srt" / "vtt": subtitles, one cue per segment with the streaming engine's segment
    times (the file goes through the edge pipeline and the engine, as `harken stream` does, on
    audio time); "json" is `as_json`."""
    if output_format == "json":
        as_json = True
    elif output_format not in ("text", "srt", "vtt"):
        raise HarkenError(f"--format: one of text, json, srt, vtt, got {output_format!r}")
    from ..cloud.inference.vllm_decoder import check_decoder

    check_decoder(decoder)  # without vLLM: one line saying how to install it, before any work
    from ..edge.audio import MAX_PASS_SECONDS, load_audio, peak_normalize, split_at_quiet_points

    audio = peak_normalize(load_audio(input_path))  # before loading the model: bad input fails fast
    limit = MAX_PASS_SECONDS if max_pass_s is None else max_pass_s
    if limit <= 0:
        raise HarkenError("--max-pass-s must be > 0")

    from ..cloud.inference.offline import transcribe_audio
    from ..cloud.model.asr import Qwen3ASR
    from ..cloud.model.checkpoint import TINY, TINY_UNTIED
    from ..cloud.model.prompt import forced_language

    forced_language(language)  # an unsupported language fails before the model loads
    if model in (TINY, TINY_UNTIED):
        print(TINY_BANNER, file=sys.stderr)
    asr = Qwen3ASR.load(model, dtype=dtype, device=device)
    if output_format in ("srt", "vtt"):
        return _subtitles(audio, asr, language, context, output_format, decoder)
    transcribe = asr.transcribe
    if decoder == "vllm":
        from functools import partial

        from ..cloud.inference.vllm_decoder import VllmDecoder, offline_max_model_len, transcribe_vllm

        longest_s = max(b - a for a, b in split_at_quiet_points(audio, limit)) / SAMPLE_RATE
        vllm = VllmDecoder(asr, max_seqs=1, max_model_len=offline_max_model_len(asr, longest_s, asr.max_new_tokens))
        transcribe = partial(transcribe_vllm, asr, vllm)
    show = sys.stderr.isatty() if progress is None else progress
    total_s = len(audio) / SAMPLE_RATE

    def shown(i: int, n: int, end_s: float) -> None:
        print(f"transcribe: {end_s:.0f}/{total_s:.0f} s ({i + 1}/{n} passes)", file=sys.stderr, flush=True)

    out = transcribe_audio(asr, audio, language, context, limit, decode_limits, transcribe,
                           progress=shown if show else None)
    text = out.text
    if as_json:
        ids = [p.token_ids for p in out.pieces]
        doc = {"text": text, "language": out.language,
               "token_ids": ids[0] if len(ids) == 1 else [t for piece in ids for t in piece]}
        if len(out.pieces) > 1:
            doc["pieces"] = [{"start_s": round(p.start_s, 5), "end_s": round(p.end_s, 5), "text": p.text,
                              "language": p.language} for p in out.pieces]
        print(json.dumps(doc, ensure_ascii=False))
    else:
        print(text)
    return 0


def _subtitles(audio: np.ndarray, asr, language: str | None, context: str, output_format: str,
               decoder: str) -> int:
    """`harken transcribe --format srt|vtt`: the audio through the edge pipeline and the streaming
    engine (on audio time), one cue per finished segment."""
    from ..cloud.embedded import stream_audio
    from ..cloud.inference.engine import EngineConfig
    from ..cloud.inference.decoder_stream import SessionOptions
    from ..cloud.inference.vllm_decoder import engine_class
    from .stream import TranscriptPrinter

    options = SessionOptions(language=language, context=context or "")
    engine = engine_class(decoder)(asr, EngineConfig(max_sessions=1, max_batch=1, slot_policy=options.policy))
    printer = TranscriptPrinter(sys.stdout, output_format)
    for event in stream_audio(audio, engine, options):
        printer.show(event)
    printer.close()
    return 0


def make_tiny_model_command(out_dir: str, seed: int = 0, vocab: str = "real", head: str = "tied",
                            head_dim: int | None = None, layers: int | None = None, hidden: int | None = None) -> int:
    """Write a tiny random checkpoint in the official format to `out_dir`."""
    from ..cloud.model.tiny import make_tiny_model, tiny_config

    d = Path(out_dir)
    if d.exists() and not d.is_dir():
        raise HarkenError(f"{d}: exists and is not a directory")
    if d.is_dir() and (d / "model.safetensors").exists():
        raise HarkenError(f"{d}: already holds a checkpoint; choose an empty or new directory")
    try:
        cfg = tiny_config(head_dim, layers, hidden)
    except ValueError as e:
        raise HarkenError(f"--head-dim / --layers / --hidden: {e}") from e
    make_tiny_model(d, seed=seed, vocab=vocab, head=head, cfg=cfg)
    print(f"wrote a tiny random Qwen3-ASR checkpoint (seed {seed}, {vocab} vocabulary, {head} head) to {d}",
          file=sys.stderr)
    return 0


def stream_command(input_path: str | None, model: str, language: str | None = None, context: str = "",
                   output_format: str = "text", mic: bool = False, server: str | None = None,
                   device: str | None = None, dtype: str | None = None, codec: str = "balanced",
                   decoder: str = "own", word_timings: bool = False, aligner: str | None = None,
                   word_cues: bool = False) -> int:
    """`harken stream IN.wav --model M`: the edge pipeline (codec mode `codec`) and the streaming
    engine in-process, on audio time. Prints what `output_format` says (harken/commands/stream.py
    `TranscriptPrinter`: live text, JSON events, SRT or WebVTT cues as segments finish)."""
    if server:
        raise HarkenError("--server is not available yet; without it the engine runs in-process (--model)")
    if bool(mic) == bool(input_path):
        raise HarkenError("give an input audio file or --mic (not both)")
    from ..edge.audio import load_audio, microphone_chunks, peak_normalize
    from .stream import TranscriptPrinter

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
    events = stream_pieces(source, engine, options, codec_mode=codec, turns=printer.asks_turns)
    if word_timings:
        from ..cloud.model.aligner import DEFAULT_ALIGNER, Qwen3ForcedAligner
        from ..cloud.inference.word_timings import SegmentAligner, SegmentWords, stream_with_word_timings

        timings = SegmentAligner(Qwen3ForcedAligner.load(aligner or DEFAULT_ALIGNER, dtype=dtype, device=device))
        events = stream_with_word_timings(source, engine, options, timings, codec_mode=codec, turns=printer.asks_turns)
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
