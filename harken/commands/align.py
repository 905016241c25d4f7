"""`harken align`: word start and end times of a known transcript in an audio file (Qwen3-ForcedAligner).

    audio file -> 16 kHz mono (peak-normalised as the official package does) -> log-mel (the edge's
    ONNX extractor) -> the aligner (cloud/model/aligner.py) -> one line per word, or JSON

User errors (no file, unreadable audio, empty text, audio beyond the aligner's range, a recogniser
checkpoint given as --model) are `HarkenError`s: one line on stderr, exit 2."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from .options import DEFAULT_ALIGNER, Subparsers
from ..shared.errors import HarkenError
from ..shared.features_spec import SAMPLE_RATE


def register(sub: Subparsers) -> None:
    s = sub.add_parser("align", help="word start/end times of a known transcript (Qwen3-ForcedAligner)",
                       description="Forced alignment, one pass: log-mel (the edge's ONNX extractor) -> "
                                   "Qwen3-ForcedAligner (harken's torch code) -> each word's start and end "
                                   "in seconds. Words are whitespace-separated pieces with punctuation "
                                   "removed (each CJK character a unit of its own), as the official "
                                   "package cuts them.",
                       epilog="example: harken align talk.wav --text \"hello there world\" --json")
    s.add_argument("input", help="audio file (WAV/FLAC/OGG, any rate, width, channels)")
    s.add_argument("--text", help="the transcript to align")
    s.add_argument("--text-file", metavar="FILE", help="read the transcript from a UTF-8 file instead")
    s.add_argument("--model", default=DEFAULT_ALIGNER,
                   help=f"aligner checkpoint dir, Hugging Face id or 'tiny' (a random test model; "
                        f"default {DEFAULT_ALIGNER})")
    s.add_argument("--language", default="English",
                   help="the transcript's language (default English; Japanese and Korean are not supported)")
    s.add_argument("--json", action="store_true",
                   help='print {"words": [{"text", "start", "end"}], "duration", "language", "model"}')
    s.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    s.add_argument("--dtype", help="bf16, fp16 or fp32 (default: bf16 on CUDA, fp32 on CPU)")
    s.set_defaults(run=run)


def run(args: argparse.Namespace) -> int | None:
    return align_command(args.input, text=args.text, text_file=args.text_file, model=args.model,
                         language=args.language, as_json=args.json, device=args.device, dtype=args.dtype)


def read_text(text: str | None, text_file: str | None) -> str:
    """--text or --text-file (exactly one), as a non-empty string."""
    if (text is None) == (text_file is None):
        raise HarkenError("give the transcript with exactly one of --text or --text-file")
    if text_file is not None:
        p = Path(text_file)
        try:
            text = p.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise HarkenError(f"{p}: cannot read the transcript ({e.__class__.__name__}: {e})") from e
    assert text is not None
    if not text.strip():
        raise HarkenError("the transcript is empty: nothing to align")
    return text


def align_command(input_path: str, text: str | None = None, text_file: str | None = None,
                  model: str = "Qwen/Qwen3-ForcedAligner-0.6B", language: str = "English",
                  as_json: bool = False, device: str | None = None, dtype: str | None = None,
                  progress: bool | None = None) -> int:
    """Align `text` to the audio file and print each word's start and end (seconds)."""
    from ..cloud.model.aligner import TINY_ALIGNER, Qwen3ForcedAligner, describe_words, split_words
    from ..edge.audio import load_audio, peak_normalize
    from ..edge.features import log_mel

    transcript = read_text(text, text_file)
    words = split_words(transcript, language)  # Japanese / Korean refused before any work
    if not words:
        raise HarkenError("the transcript has no words to align (only punctuation or symbols)")
    audio = peak_normalize(load_audio(input_path))  # bad audio fails before the model loads
    if len(audio) < 160:
        raise HarkenError(f"{input_path}: under 10 ms of audio, nothing to align")
    duration = len(audio) / SAMPLE_RATE
    show = sys.stderr.isatty() if progress is None else progress

    def say(msg: str) -> None:
        if show:
            print(f"harken align: {msg}", file=sys.stderr, flush=True)

    if model == TINY_ALIGNER:
        print("harken: --model tiny is a tiny RANDOM aligner for tests and plumbing checks; its times are "
              "meaningless", file=sys.stderr)
    say(f"loading {model} ...")
    t0 = time.monotonic()
    aligner = Qwen3ForcedAligner.load(model, dtype=dtype, device=device)
    reach = aligner.config.classify_num * aligner.config.timestamp_segment_time / 1000.0
    if duration > reach:
        raise HarkenError(f"{input_path}: {duration:.1f} s of audio, but this aligner's times reach "
                          f"{reach:.0f} s; cut the file (and its transcript) into shorter pieces")
    say(f"loaded in {time.monotonic() - t0:.1f} s; aligning {len(words)} words in {duration:.1f} s of audio ...")
    t1 = time.monotonic()
    result = aligner.align(log_mel(audio), transcript, language)
    say(f"aligned in {time.monotonic() - t1:.2f} s")
    if as_json:
        print(json.dumps({"words": [w.as_dict() for w in result], "duration": round(duration, 3),
                          "language": language, "model": model}, ensure_ascii=False))
    else:
        print(describe_words(result))
    return 0
