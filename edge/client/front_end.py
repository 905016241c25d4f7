"""What feeds a `ClientSession`: the audio source, and the two front ends that turn it into the
session's messages.

- `FeatureFrontEnd`: the edge pipeline here (VAD + log-mel + codec, `edge/pipeline.py`); feature
  packets, and the stream's progress (how early a segment not yet opened could still start).
- `AudioFrontEnd` (thin client): PCM16 pieces of `audio_piece_ms`; the server runs the pipeline.

Each `run()` consumes the source and ends the session's input; it calls `notify` with the items
for the user (progress) whenever the session may have something new to send. A source may yield
`FINALIZE` between its pieces (the speaker stopped; push-to-talk released): the open segment ends
at the audio given so far and its final comes at once (`from_finalize`); or a `Configure`
(keyterms, context): the model expects them from the next segment on.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np

from ..audio import load_audio, peak_normalize
from .session import ClientOptions, ClientSession, SessionOutput
from ..pipeline import FeatureStream
from ...shared.features_spec import FRAMES_PER_SECOND, SAMPLE_RATE
from ...shared.protocol import Configure, Finalize

FINALIZE = Finalize()
"""Yield it from a stream's source between audio pieces to finalize the open segment now."""

Piece = np.ndarray | Finalize | Configure
AudioSource = Iterable[Piece] | AsyncIterable[Piece] | np.ndarray | str | Path
"""What `TranscriptionClient.stream` takes: 16 kHz mono float32 pieces (sync or async, `FINALIZE`
between them where the speaker stopped), an array or an audio file's path."""

Notify = Callable[[Sequence[SessionOutput]], None]
"""Takes items for the user; called whenever the session may have something new to send."""


def file_pieces(path: str | Path, piece_ms: int = 100) -> list[np.ndarray]:
    """An audio file as 16 kHz mono float32 pieces of `piece_ms`: a ready `stream()` source.
    Peak-normalised as the embedded engine and the official package treat files."""
    return audio_pieces(peak_normalize(load_audio(path)), piece_ms)


def audio_pieces(audio: np.ndarray, piece_ms: int = 100) -> list[np.ndarray]:
    """Cut 16 kHz mono float32 audio into pieces of `piece_ms` (the last may be shorter)."""
    step = SAMPLE_RATE * piece_ms // 1000
    audio = np.asarray(audio, dtype=np.float32)
    return [audio[i:i + step] for i in range(0, audio.size, step)]


async def as_async_pieces(source: AudioSource) -> AsyncIterator[Piece]:
    """Any supported source as an async iterator of float32 pieces. Sync iterables are pulled on
    a worker thread: a microphone iterator blocks until its next block arrives."""
    if isinstance(source, (str, Path)):
        source = await asyncio.to_thread(file_pieces, source)
    elif isinstance(source, np.ndarray):
        source = audio_pieces(source)
    if isinstance(source, AsyncIterable):
        async for piece in source:
            yield piece
        return
    it = iter(source)
    while not isinstance(pulled := await asyncio.to_thread(_pull, it), _Exhausted):
        yield pulled


class _Exhausted:
    pass


def _pull(it: Iterator[Piece]) -> Piece | _Exhausted:
    return next(it, _Exhausted())


class FeatureFrontEnd:
    """Feature mode: VAD + log-mel + codec on this device, `Features` on the wire."""

    def __init__(self, options: ClientOptions):
        self.stream = FeatureStream(mode=options.codec_mode, packet_frames=options.packet_frames)
        self.samples = 0

    async def run(self, pieces: AsyncIterator[Piece], session: ClientSession, notify: Notify) -> None:
        async for pcm in pieces:
            if isinstance(pcm, Finalize):
                notify([session.on_packets(await asyncio.to_thread(self.stream.finalize), -math.inf)])
                continue
            if isinstance(pcm, Configure):
                session.configure(pcm.keyterms, pcm.context)
                notify([])
                continue
            pcm = np.asarray(pcm, dtype=np.float32).reshape(-1)
            # the edge's ONNX work leaves the event loop, so transcript events keep flowing
            packets = await asyncio.to_thread(self.stream.push, pcm)
            self.samples += pcm.size
            # a segment not yet opened starts at least the VAD's worst-case delay before the newest
            # frame: the pipeline keeps exactly that look-back for it
            newest_frame = max(0, (self.samples - 200) // 160)
            bound_s = (newest_frame - self.stream.lookback_frames) / FRAMES_PER_SECOND
            notify([session.on_packets(packets, bound_s)])
        packets = await asyncio.to_thread(self.stream.flush)
        progress = session.on_packets(packets, math.inf)
        session.end_input()
        notify([progress])


class AudioFrontEnd:
    """Thin client: PCM16 `Audio` messages of `audio_piece_ms`; the server runs VAD + features."""

    def __init__(self, options: ClientOptions):
        self.step = SAMPLE_RATE * options.audio_piece_ms // 1000

    async def run(self, pieces: AsyncIterator[Piece], session: ClientSession, notify: Notify) -> None:
        pending = np.zeros(0, np.float32)
        async for pcm in pieces:
            if isinstance(pcm, Configure):
                session.configure(pcm.keyterms, pcm.context)
                notify([])
                continue
            if isinstance(pcm, Finalize):
                if pending.size:  # the audio given so far goes before the Finalize
                    session.on_audio(_pcm16(pending))
                    pending = np.zeros(0, np.float32)
                session.finalize()
                notify([])
                continue
            pending = np.concatenate([pending, np.asarray(pcm, dtype=np.float32).reshape(-1)])
            while pending.size >= self.step:
                session.on_audio(_pcm16(pending[:self.step]))
                pending = pending[self.step:]
            notify([])
            await asyncio.sleep(0)
        if pending.size:
            session.on_audio(_pcm16(pending))
        session.end_input()
        notify([])


def _pcm16(pcm: np.ndarray) -> bytes:
    return np.clip(np.round(pcm * 32768.0), -32768, 32767).astype("<i2").tobytes()


def front_end(options: ClientOptions) -> FeatureFrontEnd | AudioFrontEnd:
    """The front end `options` ask for."""
    return AudioFrontEnd(options) if options.send_audio else FeatureFrontEnd(options)
