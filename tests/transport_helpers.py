"""Shared pieces of the edge/transport tests (tests/test_transport_*.py): the SDK client against
the real server (cloud/server.py) on loopback gRPC, the tiny random model with the language forced
(so it writes text: random, but a deterministic function of the features).

The module fixtures `audio` (three utterances, ~8 s) and `thin_reference` (a thin client's events
for it through the server, without faults) are imported by the test modules that need them;
conftest.py's `reference` follows the requesting module's `audio`.
"""

from __future__ import annotations

import asyncio
import socket
from contextlib import asynccontextmanager
from pathlib import Path

import numpy as np
import pytest

from harken.cloud.server import ServerOptions, start_server
from harken.edge.audio import peak_normalize
from harken.edge.client.grpc_client import ClientOptions, TranscriptEvent, TranscriptionClient, audio_pieces
from signals import concat, silence, speech


LANGUAGE = "English"  # forced: the random tiny model then writes text instead of a bare header
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def audio() -> np.ndarray:
    """Three utterances with pauses: three VAD segments, ~8 s."""
    # peak-normalised as the CLI and the embedded engine treat files, so all paths see one signal
    return peak_normalize(concat(silence(0.3), speech("Hello there, this is a test of the system."),
                                 silence(0.8), speech("A second sentence follows now."), silence(0.8),
                                 speech("And the third one ends it."), silence(0.5)))


def _finals(events) -> list[tuple[int, float, float, bool]]:
    return [(e.segment_id, e.start_s, e.end_s, e.is_final) for e in events if e.is_final]


def _frames_applied(events) -> int:
    """Feature frames the server applied, as its final events report them: each covers its
    segment from its first frame to its end."""
    return sum(round((e.end_s - e.start_s) * 100) for e in events if e.is_final)


@asynccontextmanager
async def serving(asr, **kw):
    server = await start_server(asr, ServerOptions(host="127.0.0.1", port=0, **kw))
    try:
        yield server
    finally:
        await server.stop(0)


async def collect(client: TranscriptionClient, source) -> list[TranscriptEvent]:
    return [e async for e in client.stream(source)]


def applied(server, kind: str = "features") -> tuple[float, float]:
    """(messages, payload bytes) the server applied, from its own metrics."""
    r = server.metrics.registry
    return (r.get_sample_value("harken_messages_in_total", {"kind": kind}) or 0.0,
            r.get_sample_value("harken_bytes_in_total", {"kind": kind}) or 0.0)


THIN = ClientOptions(send_audio=True, backoff_initial_s=0.01, backoff_max_s=0.1)


@pytest.fixture(scope="module")
def thin_reference(asr, audio) -> list[TranscriptEvent]:
    """A thin client's events for `audio` through the server, without faults."""

    async def main():
        async with serving(asr) as server:
            return await collect(TranscriptionClient(server.address, language=LANGUAGE, options=THIN),
                                 audio_pieces(audio))

    return asyncio.run(main())


async def live(pieces):
    """Pieces at about 3x real time, like a live source that is a bit ahead: faults then fall
    mid-stream, before the source ends."""
    for piece in pieces:
        await asyncio.sleep(0.03)
        yield piece


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
