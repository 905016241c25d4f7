"""edge/meeting: several participant tracks through the real server -> one time-ordered transcript.

The merged lines must be exactly each track's own final segments (as a client streaming that
track alone gets them), labelled with the track's speaker, in (start_s, track order) — and they
must stream: a line comes out while other tracks are still talking, not after everyone ended.
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

import numpy as np
import pytest

from harken.cloud.server import ServerOptions, start_server
from harken.edge.client import Meeting, MeetingLine  # the SDK names, as users import them
from harken.edge.client.grpc_client import ClientOptions, TranscriptionClient, audio_pieces
from signals import concat, silence, speech

LANGUAGE = "English"  # forced: the random tiny model then writes text


@pytest.fixture(scope="module")
def tracks() -> dict[str, np.ndarray]:
    """Two participants taking turns: alice, bob, alice, bob (the pauses leave room for the other)."""
    alice = concat(silence(0.3), speech("Good morning everyone."), silence(3.2), speech("Yes, I agree."),
                   silence(2.5))
    bob = concat(silence(2.2), speech("Morning. Shall we start?"), silence(2.8), speech("Great, let us go."),
                 silence(0.3))
    return {"alice": alice, "bob": bob}


@asynccontextmanager
async def serving(asr):
    server = await start_server(asr, ServerOptions(host="127.0.0.1", port=0))
    try:
        yield server
    finally:
        await server.stop(0)


async def _alone(target: str, speaker: str, audio: np.ndarray, options: ClientOptions) -> list[MeetingLine]:
    """The track streamed on its own: its final segments as meeting lines."""
    client = TranscriptionClient(target, options=options)
    texts: dict[int, str] = {}
    lines = []
    async for e in client.stream(audio_pieces(audio)):
        texts[e.segment_id] = texts.get(e.segment_id, "") + e.committed_delta
        if e.is_final and texts[e.segment_id].strip():
            lines.append(MeetingLine(speaker, e.start_s, e.end_s, texts[e.segment_id].strip(), e.segment_id))
    return lines


@pytest.mark.parametrize("thin", [False, True], ids=["features", "thin-client"])
def test_meeting_merges_tracks_in_time_order(asr, tracks, thin):
    options = ClientOptions(language=LANGUAGE, send_audio=thin)

    async def main():
        async with serving(asr) as server:
            # each track on its own (side by side: the server batches them)
            alone = dict(zip(tracks, await asyncio.gather(
                *(_alone(server.address, name, audio, options) for name, audio in tracks.items()))))
            meeting = Meeting(server.address, options=options)
            for name, audio in tracks.items():
                meeting.add_track(name, audio_pieces(audio))
            merged, active_at_first = [], None
            async for line in meeting.lines():
                if active_at_first is None:
                    active_at_first = meeting.active_speakers
                merged.append(line)
            return alone, merged, active_at_first

    alone, merged, active_at_first = asyncio.run(main())
    order = {name: i for i, name in enumerate(tracks)}
    expected = sorted(alone["alice"] + alone["bob"], key=lambda line: (line.start_s, order[line.speaker]))
    assert merged == expected
    # the turns interleave in time, and the merge keeps them apart by speaker
    turns = [line.speaker for i, line in enumerate(merged) if i == 0 or merged[i - 1].speaker != line.speaker]
    assert turns == ["alice", "bob", "alice", "bob"]
    starts = [line.start_s for line in merged]
    assert starts == sorted(starts)
    if not thin:
        # feature mode knows each track's progress from its own VAD: the first line is out while
        # bob is still streaming
        assert "bob" in active_at_first
