"""A file to text, in this process, no server:

    python examples/file_to_text.py talk.wav [--model synth-en] [--language English] [--live]

Prints the offline transcript (what `harken transcribe` prints); with `--live`, the file streamed
through the live engine on audio time instead: each segment's final line as it is committed.
"""

from __future__ import annotations

import argparse
import sys

import harken


def main(argv: list[str] | None = None, out=sys.stdout) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("audio", help="an audio file (wav, flac, mp3, ...)")
    parser.add_argument("--model", default="synth-en", help="a Hugging Face id, a checkpoint directory or synth-en")
    parser.add_argument("--language", default=None, help="English, Chinese, ... (default: detected)")
    parser.add_argument("--live", action="store_true", help="stream it through the live engine instead")
    args = parser.parse_args(argv)
    if not args.live:
        print(harken.transcribe(args.audio, model=args.model, language=args.language).text, file=out)
        return 0
    segments: dict[int, str] = {}
    for event in harken.stream(args.audio, model=args.model, language=args.language):
        segments[event.segment_id] = segments.get(event.segment_id, "") + event.committed_delta
        if event.is_final:  # committed text only grows: the segment's text is all its deltas
            print(f"[{event.start_s:6.2f} s] {segments[event.segment_id].strip()}", file=out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
