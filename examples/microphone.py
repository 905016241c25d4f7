"""Live from the microphone to a harken server, text as you speak:

    harken serve --model synth-en &            # in another terminal (port 50051)
    python examples/microphone.py [--server localhost:50051] [--key KEY]

The microphone's 16 kHz mono audio goes out in 100 ms pieces; the edge (this process) runs the VAD
and the log-mel features and sends compressed features; partials print in place and each final on
a line of its own. Ctrl-C ends the stream after its last final. Needs `pip install sounddevice`.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import AsyncIterable, AsyncIterator

import numpy as np

import harken

RATE = 16000
PIECE = RATE // 10  # 100 ms


async def microphone() -> AsyncIterator[np.ndarray]:
    """The default input device's audio, 100 ms float32 pieces, until cancelled."""
    import sounddevice

    loop = asyncio.get_running_loop()
    pieces: asyncio.Queue[np.ndarray] = asyncio.Queue()

    def captured(data, frames, time, status) -> None:  # sounddevice's thread
        loop.call_soon_threadsafe(pieces.put_nowait, data[:, 0].copy())

    with sounddevice.InputStream(samplerate=RATE, channels=1, dtype="float32", blocksize=PIECE, callback=captured):
        while True:
            yield await pieces.get()


async def transcribe_live(server: str, source: AsyncIterable[np.ndarray], key: str | None = None,
                          language: str | None = None, out=sys.stdout) -> list[str]:
    """Stream `source` to `server`; print partials in place and finals as lines; the finals' text."""
    client = harken.TranscriptionClient(server, api_key=key, language=language)
    finals: list[str] = []
    text = ""
    async for event in client.stream(source):
        text += event.committed_delta
        if event.is_final:
            finals.append(text.strip())
            print(f"\r\033[K{finals[-1]}", file=out, flush=True)
            text = ""
        else:
            print(f"\r\033[K{text}{event.partial}", end="", file=out, flush=True)
    return finals


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", default="localhost:50051", help="host:port of `harken serve`")
    parser.add_argument("--key", default=None, help="an API key, if the server asks for one")
    parser.add_argument("--language", default=None, help="English, Chinese, ... (default: detected)")
    args = parser.parse_args(argv)
    try:
        asyncio.run(transcribe_live(args.server, microphone(), args.key, args.language))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
