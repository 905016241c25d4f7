"""`harken serve --aligner`: word timings of final segments on the served path (the tiny random model and
the tiny random aligner: their words and times mean nothing, the plumbing is what is tested).

A session that asks (`Start.word_timings`) gets one `WordTimings` after each final segment: the words
of that segment's committed text as the aligner splits them, times non-decreasing and within the
segment, in the event log with the Transcripts (one event_seq); a session that does not ask gets none
and the same transcript; a resumed stream gets the timings it missed; a server without an aligner says
so in Ready and serves the session without them.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from harken.cloud.model.aligner import split_words
from harken.proto import harken_pb2 as pb
from harken.shared.codec import CODEC_NAME
from server_helpers import (END, OK, Outcome, _wire_event, features_msgs, resume_to_end, run_stream, serving, start_msg,
                            transcript_of)


@pytest.fixture(scope="module")
def audio() -> np.ndarray:
    """The bundled sample (peak-normalised, as the CLI reads files)."""
    from importlib.resources import files

    from harken.edge.audio import load_audio, peak_normalize

    return peak_normalize(load_audio(str(files("harken") / "data" / "sample.wav")))


def timings_of(out: Outcome) -> list[pb.WordTimings]:
    return [m.word_timings for m in out.messages if m.WhichOneof("kind") == "word_timings"]


def logged(out: Outcome) -> list[pb.ServerMessage]:
    """The event log's messages as the stream carried them: Transcripts and WordTimings, in order."""
    return [m for m in out.messages if m.WhichOneof("kind") in ("transcript", "word_timings")]


def event_seq(m: pb.ServerMessage) -> int:
    return getattr(m, m.WhichOneof("kind")).event_seq


def check_timings(messages: list[pb.ServerMessage]) -> None:
    """One WordTimings per final segment, after its final; its words are the segment's committed text's
    words; times non-decreasing and within the segment."""
    text: dict[int, str] = {}
    finals: dict[int, pb.Transcript] = {}
    timed: list[int] = []
    for m in messages:
        if m.WhichOneof("kind") == "transcript":
            t = m.transcript
            text[t.segment_id] = text.get(t.segment_id, "") + t.committed_delta
            if t.is_final:
                finals[t.segment_id] = t
            continue
        w = m.word_timings
        assert w.segment_id in finals, "a segment's timings come after its final"
        final = finals[w.segment_id]
        assert [x.text for x in w.words] == split_words(text[w.segment_id], final.language or "English")
        times = [t for x in w.words for t in (x.start_s, x.end_s)]
        assert times == sorted(times)
        assert all(final.start_s - 1e-6 <= t <= final.end_s + 1e-6 for t in times)
        timed.append(w.segment_id)
    assert timed == sorted(finals) and len(finals) >= 2


def test_a_session_that_asks_gets_the_words_of_every_final_segment_and_one_that_does_not_gets_none(asr, packets):
    msgs = features_msgs(packets)

    async def main():
        async with serving(asr, aligner="tiny") as server:
            with_timings = await run_stream(server.address, [start_msg(codec=CODEC_NAME, word_timings=True)] + msgs
                                            + [END])
            without = await run_stream(server.address, [start_msg(codec=CODEC_NAME)] + msgs + [END])
            return with_timings, without

    with_timings, without = asyncio.run(main())
    assert with_timings.code == OK and without.code == OK, (with_timings.details, without.details)
    assert with_timings.ready.word_timings and not without.ready.word_timings
    check_timings(logged(with_timings))
    assert [event_seq(m) for m in logged(with_timings)] == list(range(1, len(logged(with_timings)) + 1))
    assert any(len(w.words) for w in timings_of(with_timings))
    assert timings_of(without) == []
    # timings are an addition: the transcript is the same
    assert transcript_of(without.events) == transcript_of(with_timings.events)


def test_a_resumed_stream_gets_the_timings_it_missed(asr, packets):
    msgs = features_msgs(packets)

    def first_final(out: Outcome) -> bool:
        return any(t.is_final for t in out.transcripts)

    async def main():
        async with serving(asr, aligner="tiny") as server:
            # the connection drops right after the first final: its timings (and the rest) are missed
            first = await run_stream(server.address, [start_msg(codec=CODEC_NAME, word_timings=True)] + msgs + [END],
                                     stop_after=first_final)
            seen = event_seq(logged(first)[-1])
            return first, await resume_to_end(server.address, first.ready.session_id, seen, msgs, END)

    first, second = asyncio.run(main())
    assert second.code == OK, second.details
    assert second.ready.word_timings  # the session's choice, whatever the resuming Start says
    assert timings_of(first) == []
    events = logged(first) + logged(second)
    assert [event_seq(m) for m in events] == list(range(1, len(events) + 1)), "nothing lost, nothing twice"
    check_timings(events)


def test_a_server_without_an_aligner_says_so_in_ready_and_serves_the_session_without_timings(asr, packets):
    msgs = features_msgs(packets)

    async def main():
        async with serving(asr) as server:
            return await run_stream(server.address, [start_msg(codec=CODEC_NAME, word_timings=True)] + msgs + [END])

    out = asyncio.run(main())
    assert out.code == OK, out.details
    assert not out.ready.word_timings
    assert timings_of(out) == [] and any(t.is_final for t in out.transcripts)
    assert [_wire_event(t)[7] for t in out.transcripts].count(True) >= 2
