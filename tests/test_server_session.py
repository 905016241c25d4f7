"""The server's sans-IO session core (cloud/hosting/server_session.py), driven by method calls alone: no
network, no event loop, no engine, no clock but the numbers passed in (h11 style). The served
path through gRPC is tested end to end in test_server_*.py."""

from __future__ import annotations

import re

import pytest

from harken.cloud.base.errors import MalformedMessage, OutOfOrder, SessionNotFound, ShuttingDown, Superseded
from harken.cloud.hosting.server_session import (ACK_EVERY, CLOSED_OK, ServerLifecycle, ServerSession, SessionLimits)
from harken.shared.protocol import Audio, End, FeaturePacket, Features, Finalize, KeepAlive, SessionSeed, Start
from harken.shared.transcript import TranscriptEvent


class Wake:
    def __init__(self):
        self.count = 0

    def set(self) -> None:
        self.count += 1


def packet(segment_id: int, first_frame: int, frames: int, start=False, end=False) -> FeaturePacket:
    return FeaturePacket(segment_id, first_frame, frames, start, end, b"payload", None)


def event(segment_id: int, end_s: float, final=False, delta="") -> TranscriptEvent:
    return TranscriptEvent(segment_id=segment_id, committed_delta=delta, partial="" if final else "p",
                           stability=0.5, start_s=0.0, end_s=end_s, language="English", is_final=final)


def session(seed: SessionSeed | None = None, **limits) -> ServerSession:
    return ServerSession("sid", "key", Start(seed=seed), SessionLimits(**limits), now=0.0)


def feed(s: ServerSession, seq: int, p: FeaturePacket, now: float = 0.0) -> bool:
    """What the driver does with one Features message; whether its frames went to the engine."""
    msg = s.admit(Features(seq, p))
    if msg is None:
        return False
    accepted = s.accept(p)
    if accepted:
        s.fed(p, now)
    s.applied(Features(seq, p))
    return accepted


def test_admit_applies_each_seq_once_in_order():
    s = session()
    assert s.admit(KeepAlive()) is None
    with pytest.raises(OutOfOrder, match="start may only be the first"):
        s.admit(Start())
    with pytest.raises(OutOfOrder, match="gap"):
        s.admit(Features(2, packet(0, 0, 10, start=True)))
    assert feed(s, 1, packet(0, 0, 10, start=True))
    assert s.applied_seq == 1
    assert s.admit(Features(1, packet(0, 0, 10, start=True))) is None  # resent after a reconnect
    with pytest.raises(OutOfOrder, match="do not mix"):
        s.admit(Audio(2, b"\0\0", 16_000))


def test_the_one_frame_order_check():
    s = session()
    with pytest.raises(OutOfOrder, match="without segment_start"):
        s.accept(packet(0, 0, 10))
    assert feed(s, 1, packet(0, 0, 10, start=True))
    with pytest.raises(OutOfOrder, match="not contiguous"):
        s.accept(packet(0, 20, 10))
    with pytest.raises(OutOfOrder, match="still open"):
        s.accept(packet(1, 10, 10, start=True))
    assert feed(s, 2, packet(0, 10, 10, end=True))
    with pytest.raises(OutOfOrder, match="does not increase"):
        s.accept(packet(0, 30, 10, start=True))
    with pytest.raises(OutOfOrder, match="before the previous segment's end"):
        s.accept(packet(1, 15, 10, start=True))
    assert s.accept(packet(3, 40, 0))  # a keep-alive packet: always in order
    assert feed(s, 3, packet(3, 40, 10, start=True))


def test_a_seeded_session_ignores_the_segments_its_seed_says_are_final():
    s = session(SessionSeed(1.5, "so far", next_segment_id=4))
    assert s.last_final_segment == 3
    assert not feed(s, 1, packet(3, 0, 10, start=True))  # replayed by the client: its text is there
    assert feed(s, 2, packet(4, 50, 10, start=True))


def test_acks_fall_due_every_few_messages_on_segment_ends_and_on_finals():
    s = session()
    wake = Wake()
    a = s.attach(0, now=0.0, wake=wake)
    feed(s, 1, packet(0, 0, 10, start=True))
    for seq in range(2, ACK_EVERY):
        feed(s, seq, packet(0, 10 * (seq - 1), 10))
    assert not a.ack_due
    feed(s, ACK_EVERY, packet(0, 10 * (ACK_EVERY - 1), 10))
    assert a.ack_due
    a.ack_due = False
    feed(s, ACK_EVERY + 1, packet(0, 10 * ACK_EVERY, 10, end=True))
    assert a.ack_due
    a.ack_due = False
    s.record(event(0, 0.6, final=True), SessionSeed(2.0, "tail", 1), now=1.0)
    assert a.ack_due and wake.count >= 3


def test_events_are_numbered_logged_and_replayed_after_a_resume():
    s = session(replay_tail=2)
    feed(s, 1, packet(0, 0, 100, start=True), now=10.0)
    a = s.attach(0, now=10.0, wake=Wake())
    out, latency = s.record(event(0, 1.0), None, now=10.25)
    assert out.event_seq == 1 and out.seed is None
    assert latency.first_partial_s == pytest.approx(0.25)  # the segment's start arrived at 10.0
    assert latency.update_s == pytest.approx(0.25)  # frames up to 1.0 s arrived at 10.0
    s.record(event(0, 1.0), None, now=11.0)
    assert [e.event_seq for e in s.events_after(0)] == [1, 2]
    s.sent(a, 2)
    assert [e.event_seq for e in s.events_after(1)] == [2]  # segment 0 is not final: all held
    s.detach(a, now=12.0)
    assert s.detached_at == 12.0
    b = s.attach(1, now=13.0, wake=Wake())  # a resume that lacks event 2
    assert b.sent_event_seq == 1 and s.detached_at is None


def test_events_of_final_segments_are_forgotten_behind_the_replay_tail():
    s = session(replay_tail=1)
    a = s.attach(0, now=0.0, wake=Wake())
    feed(s, 1, packet(0, 0, 10, start=True, end=True))
    for i in range(3):
        s.record(event(0, 0.1), None, now=0.0)
    s.record(event(0, 0.1, final=True), SessionSeed(0.0, "", 1), now=0.0)
    s.sent(a, 4)
    assert [e.event_seq for e in s.events] == [4]  # the last one sent, which may have been lost
    s.check_resumable(3)
    with pytest.raises(SessionNotFound, match="no longer held"):
        s.check_resumable(2)


def test_the_final_carries_the_engines_seed_and_the_first_partial_its_latency():
    s = session()
    feed(s, 1, packet(0, 0, 10, start=True), now=5.0)
    _, latency = s.record(event(0, 0.1), None, now=5.5)
    assert latency.first_partial_s == pytest.approx(0.5)
    feed(s, 2, packet(0, 10, 10, end=True), now=6.0)
    seed = SessionSeed(2.5, "the tail", 1)
    out, latency = s.record(event(0, 0.2, final=True), seed, now=6.75)
    assert out.seed == seed and latency.final_s == pytest.approx(0.75)
    assert s.last_final_segment == 0


def test_end_drains_until_every_final_is_in_then_the_stream_closes_ok():
    s = session()
    a = s.attach(0, now=0.0, wake=Wake())
    feed(s, 1, packet(0, 0, 10, start=True))
    assert s.admit(End()) == End()
    assert s.finalize(now=1.0) == 0  # the open segment, for the engine to finalise
    s.drain(by_client=True)
    assert s.lifecycle is ServerLifecycle.DRAINING and a.end is None
    # a client that resumed after losing the connection repeats End and resends applied messages
    assert s.admit(End()) is None
    assert s.admit(Features(1, packet(0, 0, 10, start=True))) is None
    with pytest.raises(OutOfOrder, match="no input after end"):
        s.admit(Features(2, packet(0, 10, 10)))
    s.record(event(0, 0.1, final=True), SessionSeed(0.0, "", 1), now=1.5)
    assert s.lifecycle is ServerLifecycle.ENDED and a.end == CLOSED_OK
    assert s.attach(1, now=2.0, wake=Wake()).end == CLOSED_OK  # a late resume gets the rest, then OK


def test_shutdown_stops_input_and_ends_the_stream_unavailable():
    s = session()
    a = s.attach(0, now=0.0, wake=Wake())
    s.drain(by_client=False)  # nothing open: ended at once
    assert s.lifecycle is ServerLifecycle.ENDED
    assert isinstance(a.end, ShuttingDown)
    with pytest.raises(ShuttingDown):
        s.admit(Features(1, packet(0, 0, 10, start=True)))


def test_a_failed_session_hands_its_error_to_every_stream():
    s = session()
    a = s.attach(0, now=0.0, wake=Wake())
    error = RuntimeError("the engine's own processing of this session raised")
    s.fail(error)
    assert s.lifecycle is ServerLifecycle.FAILED and s.lifecycle.done
    assert a.end is error
    assert s.attach(0, now=1.0, wake=Wake()).end is error


def test_a_closed_session_takes_no_input_and_no_stream():
    s = session()
    s.close()
    assert s.lifecycle is ServerLifecycle.CLOSED
    with pytest.raises(SessionNotFound):
        s.admit(Features(1, packet(0, 0, 10, start=True)))
    with pytest.raises(SessionNotFound):
        s.attach(0, now=0.0, wake=Wake())
    ended = session()
    ended.drain(by_client=True)
    ended.close()
    assert ended.lifecycle is ServerLifecycle.ENDED  # closing an ended session changes nothing


def test_a_newer_stream_supersedes_the_attached_one():
    s = session()
    old = s.attach(0, now=0.0, wake=Wake())
    assert s.supersede() is old
    assert isinstance(old.end, Superseded)
    new = s.attach(0, now=1.0, wake=Wake())
    s.detach(old, now=2.0)  # the old stream's handler ends later: it detaches nothing
    assert s.attachment is new and s.detached_at is None
    s.drain(by_client=True)
    assert new.end == CLOSED_OK
    assert s.supersede() is new
    assert isinstance(new.end, Superseded)  # a newer stream overrules even the session's own end


def test_a_session_closed_while_its_input_ends_stays_closed():
    s = session()
    s.close()
    s.drain(by_client=True)
    assert s.lifecycle is ServerLifecycle.CLOSED
    failed = session()
    failed.fail(RuntimeError("x"))
    failed.fail(RuntimeError("y"))
    assert str(failed.failure) == "x"


def test_idle_time_counts_only_while_the_server_owes_the_stream_nothing():
    s = session()
    assert s.idle_for(5.0, busy=False) is None  # no stream
    a = s.attach(0, now=0.0, wake=Wake())
    assert s.idle_for(4.0, busy=False) == 4.0
    assert s.idle_for(6.0, busy=True) is None  # e.g. an engine pass due: idle time starts again
    assert s.idle_for(7.0, busy=False) == 1.0
    s.heard(a, now=7.5)
    assert s.idle_for(8.0, busy=False) == 0.5
    s.drain(by_client=True)
    assert s.idle_for(100.0, busy=False) is None


def test_thin_clients_audio_rate_is_fixed_and_finalised_segments_drop_the_vads_rest():
    s = session()
    audio = Audio(1, b"\0\0" * 160, 48_000)
    assert s.admit(audio) is audio
    s.applied(audio)
    with pytest.raises(MalformedMessage, match="sample_rate changed"):
        s.admit(Audio(2, b"\0\0", 16_000))
    first = packet(0, 0, 10, start=True)
    assert s.accept(first, from_front_end=True)
    s.fed(first, 0.0)
    assert s.finalize(now=0.1) == 0
    # the server's VAD goes on with segment 0: dropped up to its end, then segments go on
    assert not s.accept(packet(0, 10, 10), from_front_end=True)
    assert not s.accept(packet(0, 20, 10, end=True), from_front_end=True)
    assert s.accept(packet(1, 40, 10, start=True), from_front_end=True)
    with pytest.raises(MalformedMessage, match="no segment ids left"):
        s.accept(packet(1 << 32, 60, 10, start=True), from_front_end=True)


def test_a_seed_with_a_front_end_state_goes_on_with_16_khz_audio_only():
    s = session(SessionSeed(0.0, "", 2, front_end_state=b"state", audio_sample=2560))
    with pytest.raises(MalformedMessage, match="16 kHz"):
        s.admit(Audio(1, b"\0\0", 48_000))
    assert s.admit(Audio(1, b"\0\0", 16_000)) is not None


def test_word_timings_follow_their_final_in_the_log_and_the_session_ends_once_they_are_in():
    from harken.shared.protocol import WordTimings
    from harken.shared.transcript import SegmentTimings, TimedWord

    s = ServerSession("sid", "key", Start(word_timings=True), SessionLimits(), now=0.0, word_timings=True)
    a = s.attach(0, 0.0, Wake())
    assert feed(s, 1, packet(0, 0, 10, start=True, end=True))
    s.record(event(0, 0.1, final=True, delta="hi there"), SessionSeed(0.0, "hi there", 1), now=1.0)
    s.drain(by_client=True)
    assert s.lifecycle is ServerLifecycle.DRAINING and a.end is None, "the timings of segment 0 are still due"
    words = SegmentTimings(0, (TimedWord("hi", 0.0, 0.05), TimedWord("there", 0.05, 0.1)))
    out = s.record_timings(words)
    assert out == WordTimings(words, event_seq=2) and out.segment_id == 0
    assert s.lifecycle is ServerLifecycle.ENDED and a.end == CLOSED_OK
    assert [e.event_seq for e in s.events_after(0)] == [1, 2] and s.events_after(1) == [out]
    # a session that did not ask ends with its last final
    plain = session()
    assert feed(plain, 1, packet(0, 0, 10, start=True, end=True))
    plain.record(event(0, 0.1, final=True, delta="hi"), SessionSeed(0.0, "hi", 1), now=1.0)
    plain.drain(by_client=True)
    assert plain.lifecycle is ServerLifecycle.ENDED


# ---- finalize and turn events ------------------------------------------------------------------

def turned(seed: SessionSeed | None = None) -> ServerSession:
    return ServerSession("sid", "key", Start(seed=seed, turn_events=True), SessionLimits(), now=0.0)


def logged(s: ServerSession, after: int = 0) -> list[tuple]:
    """The event log after `after` as (kind, segment, detail) tuples, in event_seq order."""
    from harken.shared.protocol import Turn

    out = []
    for e in s.events_after(after):
        if isinstance(e, Turn):
            out.append((e.turn.kind, e.segment_id, e.turn.audio_s))
        else:
            out.append(("final" if e.event.is_final else "partial", e.segment_id, e.event.from_finalize))
    return out


def test_turn_events_come_with_the_frames_that_decide_them_in_order_with_the_text():
    s = turned()
    a = s.attach(0, now=0.0, wake=Wake())
    woken = a.wake.count
    feed(s, 1, packet(0, 50, 20, start=True))
    assert logged(s) == [("speech_started", 0, 0.5)]  # at once: no text yet
    assert a.wake.count > woken
    s.record(event(0, 0.7), None, now=0.2)
    feed(s, 2, packet(0, 70, 13, end=True))
    s.record(event(0, 0.83, final=True), SessionSeed(0.0, "", 1), now=0.4)
    feed(s, 3, packet(1, 100, 20, start=True, end=True))
    assert logged(s) == [("speech_started", 0, 0.5), ("partial", 0, False), ("utterance_end", 0, 0.83),
                         ("final", 0, False), ("speech_started", 1, 1.0), ("utterance_end", 1, 1.2)]
    assert [e.event_seq for e in s.events_after(0)] == list(range(1, 7))  # one log, one counter


def test_sessions_that_do_not_ask_get_no_turn_events():
    s = session()
    feed(s, 1, packet(0, 0, 10, start=True, end=True))
    assert s.events_after(0) == []


def test_a_finalized_packet_makes_its_final_say_from_finalize():
    s = turned()
    feed(s, 1, packet(0, 0, 20, start=True))
    cut = FeaturePacket(0, 20, 5, False, True, b"payload", None, finalized=True)
    feed(s, 2, cut)
    s.record(event(0, 0.25, final=True), SessionSeed(0.0, "", 1), now=1.0)
    feed(s, 3, packet(1, 25, 20, start=True, end=True))  # the speech that went on: an ordinary segment
    s.record(event(1, 0.45, final=True), SessionSeed(0.0, "", 2), now=2.0)
    assert [x for x in logged(s) if x[0] == "final"] == [("final", 0, True), ("final", 1, False)]


def test_finalize_before_any_audio_twice_and_after_end_does_nothing():
    s = turned()
    assert s.admit(Finalize()) == Finalize()
    assert s.finalize(now=0.0) is None  # nothing open
    feed(s, 1, packet(0, 0, 20, start=True))
    assert s.finalize(now=0.5) == 0
    assert s.finalize(now=0.6) is None  # twice: the second has nothing to close
    assert logged(s) == [("speech_started", 0, 0.0), ("utterance_end", 0, 0.2)]
    s.record(event(0, 0.2, final=True), SessionSeed(0.0, "", 1), now=0.7)
    assert logged(s)[-1] == ("final", 0, True)
    assert s.admit(End()) == End()
    assert s.finalize(now=0.8) is None  # End's own finalize: nothing open any more
    s.drain(by_client=True)
    assert s.lifecycle is ServerLifecycle.ENDED
    assert s.admit(Finalize()) is None  # after the end: a replay, nothing to do
    assert len([x for x in logged(s) if x[0] == "final"]) == 1  # the final once


def test_turn_events_replay_after_a_resume_like_the_text():
    s = turned()
    s.attach(0, now=0.0, wake=Wake())
    feed(s, 1, packet(0, 0, 20, start=True))
    s.record(event(0, 0.2), None, now=0.1)
    a = s.attach(1, now=1.0, wake=Wake())  # a resume that had the first event only
    assert [e.event_seq for e in s.events_after(a.sent_event_seq)] == [2]
    assert logged(s, 1) == [("partial", 0, False)]


# ---- one call per message: receive ---------------------------------------------------------------

def steps(s: ServerSession, msg, now: float):
    """What `receive` replaces: admit, accept, fed, applied (and finalize / drain), as the driver
    called them one by one; -> (message, packet to feed, segment to finalise)."""
    todo = s.admit(msg)
    if todo is None:
        return None, None, None
    if isinstance(todo, Features):
        p = todo.packet
        ok = s.accept(p)
        if ok:
            s.fed(p, now)
        s.applied(todo)
        return todo, p if ok and (p.frame_count or p.segment_start or p.segment_end) else None, None
    if isinstance(todo, Finalize):
        seg = s.finalize(now)
        s.finalized()
        return todo, None, seg
    if isinstance(todo, End):
        seg = s.finalize(now)
        s.drain(by_client=True)
        return todo, None, seg
    return todo, None, None


def state(s: ServerSession) -> tuple:
    a = s.attachment
    return (s.applied_seq, vars(s.order).copy(), s.lifecycle, s.input_kind, s.next_event_seq,
            [(type(e).__name__, e.event_seq, e.segment_id) for e in s.events], sorted(s._awaiting_final),
            sorted(s._finalized), s._msgs_since_ack, a and (a.ack_due, a.wake.count, a.end),
            dict(s._timing.started_at), dict(s._timing.ended_at), list(s._timing.arrivals))


def script():
    """Messages of a feature client, good and bad: segments, keep-alive packets, replays after a
    reconnect, a gap, a Finalize mid-segment, frames out of order, End and input after it."""
    return [
        Features(1, packet(0, 0, 10, start=True)), KeepAlive(), Features(2, packet(0, 10, 10)),
        Features(2, packet(0, 10, 10)),  # resent after a reconnect
        Features(4, packet(0, 20, 10)),  # a gap
        Features(3, packet(0, 20, 0)),  # a keep-alive packet
        Finalize(), Features(4, packet(0, 20, 10)),  # the finalised segment's frames: out of order
        Features(4, packet(1, 30, 10, start=True)), Features(5, packet(1, 40, 5, end=True)),
        Finalize(),  # nothing open
        Features(6, packet(1, 45, 5, start=True)),  # ids must increase
        Features(6, FeaturePacket(2, 45, 5, True, True, b"payload", None, finalized=True)),
        Start(), Audio(7, b"\0\0", 16_000),  # not after start; no mixing
        Features(7, packet(3, 50, 10, start=True)), End(), Features(8, packet(3, 60, 10)), End(),
        Features(7, packet(3, 50, 10, start=True)),  # after End: a replay
    ]


@pytest.mark.parametrize("turns", [False, True])
def test_receive_is_the_four_steps_in_one_call(turns):
    """Every message of the script: receive gives what the steps gave (or raises what they
    raised), and leaves the same state behind, events, Acks and wake-ups included."""
    one = ServerSession("sid", "key", Start(turn_events=turns), SessionLimits(), now=0.0)
    four = ServerSession("sid", "key", Start(turn_events=turns), SessionLimits(), now=0.0)
    one.attach(0, now=0.0, wake=Wake())
    four.attach(0, now=0.0, wake=Wake())
    for i, msg in enumerate(script()):
        now = 0.1 * i
        try:
            expected = steps(four, msg, now)
        except Exception as e:  # noqa: BLE001 - the same error is what the test wants
            with pytest.raises(type(e), match=re.escape(str(e))):
                one.receive(msg, now)
        else:
            got = one.receive(msg, now)
            assert (got.message, got.feed, got.finalize) == expected, msg
        assert state(one) == state(four), msg
        if i == 9:  # the final of segment 0 and 1 come in between
            for s in (one, four):
                s.record(event(0, 0.2, final=True), SessionSeed(0.0, "", 1), now=now)
                s.record(event(1, 0.45, final=True), SessionSeed(0.0, "", 2), now=now)
    assert one.lifecycle is four.lifecycle is ServerLifecycle.DRAINING  # segment 3's final is owed


def test_receive_of_a_thin_client_leaves_the_front_ends_work_to_the_driver():
    s = session()
    audio = Audio(1, b"\0\0" * 160, 16_000)
    got = s.receive(audio, now=0.0)
    assert got.message is audio and got.feed is None and s.applied_seq == 1
    assert s.front_end_output([packet(0, 0, 10, start=True), packet(0, 10, 0)], now=0.1) == [packet(0, 0, 10, start=True)]
    got = s.receive(Finalize(), now=0.2)
    assert got.front_end and got.finalize is None  # the front end cuts the segment, then `finalized`
    got = s.receive(End(), now=0.3)
    assert got.front_end and s.lifecycle is ServerLifecycle.ACTIVE
    assert s.end_input(now=0.4, by_client=True) == 0  # the open segment, once the front end is flushed
    assert s.lifecycle is ServerLifecycle.DRAINING


def test_every_lifecycle_move_in_the_table_is_made_and_every_other_refused():
    from harken.cloud.hosting.server_session import TRANSITIONS, LifecycleError, Move
    for state_ in ServerLifecycle:
        for move in Move:
            s = session()
            s.lifecycle = state_
            if (state_, move) in TRANSITIONS:
                s._move(move)
                assert s.lifecycle is TRANSITIONS[state_, move]
            else:
                with pytest.raises(LifecycleError):
                    s._move(move)
                assert s.lifecycle is state_
    # done states move no more; every state but ENDED's two ways in is reached from ACTIVE only
    assert not any(k[0].done for k in TRANSITIONS)
    assert {to for to in TRANSITIONS.values()} == set(ServerLifecycle) - {ServerLifecycle.ACTIVE}


def test_the_sessions_own_calls_move_only_along_the_table():
    """drain, close, fail and the last final: each a move of the table, or (on a session that has
    moved past it) nothing, never a move the table lacks."""
    s = session()
    feed(s, 1, packet(0, 0, 10, start=True, end=True))
    s.drain(by_client=False)
    assert s.lifecycle is ServerLifecycle.STOPPING
    s.drain(by_client=True)  # input already ended: nothing
    s.record(event(0, 0.1, final=True), SessionSeed(0.0, "", 1), now=1.0)
    assert s.lifecycle is ServerLifecycle.ENDED
    s.fail(RuntimeError("late"))
    s.close()
    assert s.lifecycle is ServerLifecycle.ENDED and s.failure is None
