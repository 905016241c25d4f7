"""A meeting from per-participant tracks: one time-ordered transcript with who said what.

    harken serve --model synth-en &                 # in another terminal (port 50051)
    python examples/meeting_tracks.py alice=alice.wav bob=bob.wav [--server localhost:50051]

Each track streams through a client of its own (resume and replay per track); a line comes out as
soon as no other track can still say something that starts earlier. A live app passes each
participant's audio pieces (an async iterable of 16 kHz float32 arrays) instead of a file.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

import harken


async def transcribe_meeting(server: str, tracks: dict[str, object], key: str | None = None,
                             language: str | None = None, out=sys.stdout) -> list[harken.MeetingLine]:
    """`tracks`: speaker -> audio (a file, an array or async pieces). Prints and returns the lines."""
    meeting = harken.Meeting(server, api_key=key, options=harken.ClientOptions(language=language))
    for speaker, source in tracks.items():
        meeting.add_track(speaker, source)
    lines = []
    async for line in meeting.lines():
        print(f"[{line.start_s:7.2f}] {line.speaker}: {line.text}", file=out, flush=True)
        lines.append(line)
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tracks", nargs="+", metavar="NAME=FILE", help="a participant and their audio file")
    parser.add_argument("--server", default="localhost:50051", help="host:port of `harken serve`")
    parser.add_argument("--key", default=None, help="an API key, if the server asks for one")
    parser.add_argument("--language", default=None, help="English, Chinese, ... (default: detected)")
    args = parser.parse_args(argv)
    tracks = dict(t.split("=", 1) for t in args.tracks)
    asyncio.run(transcribe_meeting(args.server, tracks, args.key, args.language))
    return 0


if __name__ == "__main__":
    sys.exit(main())
