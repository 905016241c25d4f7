"""Finalize and turn events in the clients: the SDK (`TranscriptionClient.stream(source,
turn_events=True)` with `FINALIZE` in the source), feature and thin clients, over gRPC and the WebRTC
data channel, against a real in-process server (tiny random model: the protocol is tested here; the
text of a finalized item against its offline pass is tested on synth-en in test_synth_paths.py).

- Each segment has one `speech_started` and one `utterance_end`, in that order, the end before the
  segment's final; a finalize mid-sentence ends the open segment at the audio given so far with a
  final that says `from_finalize`, and the rest of the sentence is the next segment.
- A stream that does not ask gets no turn events and the same transcript events.
"""

from __future__ import annotations

import asyncio

import pytest

from harken.edge.client.front_end import FINALIZE
from harken.edge.client.grpc_client import ClientOptions, TranscriptEvent, TranscriptionClient, TurnEvent, audio_pieces
from transport_helpers import LANGUAGE, THIN, serving
from transport_helpers import audio  # module fixture: pytest finds it here

CUT = 15  # 100 ms pieces: 1.5 s in, inside the first sentence


def with_finalize(audio) -> list:
    pieces = audio_pieces(audio)
    return pieces[:CUT] + [FINALIZE] + pieces[CUT:]


def check(items: list) -> None:
    turns = [e for e in items if isinstance(e, TurnEvent)]
    finals = [e for e in items if isinstance(e, TranscriptEvent) and e.is_final]
    assert [e.from_finalize for e in finals] == [True] + [False] * (len(finals) - 1)
    assert len(finals) == 4  # the first sentence cut in two, then two more
    assert finals[0].end_s <= CUT / 10
    assert [(t.kind, t.segment_id) for t in turns] == [
        (kind, f.segment_id) for f in finals for kind in ("speech_started", "utterance_end")]
    for f in finals:  # a segment's onset before its first event, its end before its final
        first = next(i for i, e in enumerate(items) if isinstance(e, TranscriptEvent) and e.segment_id == f.segment_id)
        start = items.index(next(t for t in turns if t.segment_id == f.segment_id and t.kind == "speech_started"))
        end = items.index(next(t for t in turns if t.segment_id == f.segment_id and t.kind == "utterance_end"))
        assert start < first and end < items.index(f)
    cut_end = next(t for t in turns if t.kind == "utterance_end")
    assert cut_end.audio_s <= CUT / 10 and turns[2].audio_s == pytest.approx(cut_end.audio_s)  # nothing lost


@pytest.mark.parametrize("options", [ClientOptions(), THIN], ids=["features", "thin"])
def test_the_sdk_finalizes_on_request_and_yields_turn_events(asr, audio, options):
    async def main():
        async with serving(asr) as server:
            client = TranscriptionClient(server.address, language=LANGUAGE, options=options)
            items = [e async for e in client.stream(with_finalize(audio), turn_events=True)]
            plain = [e async for e in client.stream(audio_pieces(audio))]
            return items, plain, client.stats

    items, plain, stats = asyncio.run(main())
    check(items)
    assert stats.turn_events is None  # the last stream did not ask
    assert not any(isinstance(e, TurnEvent) for e in plain)
    assert not any(e.from_finalize for e in plain) and len([e for e in plain if e.is_final]) == 3


def test_the_webrtc_client_gets_them_over_the_data_channel(asr, audio):
    from harken.edge.client.webrtc_client import WebRTCTranscriptionClient

    async def main():
        async with serving(asr, http_port=0) as server:
            client = WebRTCTranscriptionClient(f"http://127.0.0.1:{server.http_port}", language=LANGUAGE)
            items = [e async for e in client.stream(with_finalize(audio), turn_events=True)]
            return items, client.stats

    items, stats = asyncio.run(main())
    check(items)
    assert stats.turn_events is True
