"""edge/client_session: the client's whole session protocol driven by method calls, no network.

As h11's tests drive `Connection`: messages the server would send go in, what the client writes
and what the user sees come out, the clock is an argument. Covered: a whole stream, a dropped call
resumed with exactly the messages the server had not applied, a lost session replayed into a
seeded replacement (committed text not shown twice), server errors, a final that splits an open
segment, End held by the server, the buffer bound, silence, the offline bound and backoff, and
the thin client's trimming, replay and time shift.
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from harken.edge.client.session import (ClientOptions, ClientSession, Disconnect, InputState, ClientLifecycle, Retry,
                                        StreamProgress)
from harken.edge.client.errors import (BufferOverflowError, ServerRejectedError, ServerUnavailableError,
                                TransportSecurityError)
from harken.shared.codec import CODEC_NAME
from harken.shared.protocol import (Ack, Audio, End, FeaturePacket, Features, Finalize, KeepAlive, Ready, ServerError,
                                    SessionSeed, Start, Transcript)
from harken.shared.transcript import TranscriptEvent

SEED = SessionSeed(running_max_log10=2.5, context_tail="hello", next_segment_id=1)


def packet(segment_id: int, first_frame: int, frames: int = 10, start: bool = False, end: bool = False,
           nbytes: int = 100) -> FeaturePacket:
    """A feature packet; the session never decodes payloads, so any bytes do."""
    payload = bytes([segment_id % 256, first_frame % 256]) * (nbytes // 2)
    return FeaturePacket(segment_id, first_frame, frames, start, end, payload, running_max_log10=2.5)


def transcript(segment_id: int, event_seq: int, delta: str = "", partial: str = "", final: bool = False,
               start_s: float = 0.0, end_s: float = 1.0, seed: SessionSeed | None = None) -> Transcript:
    event = TranscriptEvent(segment_id, delta, partial, 0.5, start_s, end_s, "English", final)
    return Transcript(event, event_seq, seed)


def write_all(session: ClientSession) -> list:
    """What a driver writes on the call now: every message the session has, each confirmed."""
    out = []
    while (msg := session.next_message()) is not None:
        session.sent(msg)
        out.append(msg)
    return out


def connect(session: ClientSession, ready: Ready, now: float = 0.0) -> Start:
    start = session.start_message()
    assert session.lifecycle is ClientLifecycle.CONNECTING
    assert session.on_server_message(ready, now) == []
    return start


def test_a_whole_stream():
    s = ClientSession(ClientOptions(language="English", context="names"))
    assert s.lifecycle is ClientLifecycle.IDLE and s.input is InputState.OPEN
    p = [packet(0, 10, start=True), packet(0, 20), packet(0, 30, end=True)]
    # the segment opened at frame 10: no final can start before 0.1 s
    assert s.on_packets(p[:2], new_segment_bound_s=0.05) == StreamProgress(0.05)
    assert s.bound_s() == 0.05

    start = connect(s, Ready("sid", 0), now=1.0)
    assert start == Start(language="English", context="names", codec=CODEC_NAME)
    assert s.lifecycle is ClientLifecycle.STREAMING
    assert write_all(s) == [Features(1, p[0]), Features(2, p[1])]
    assert s.next_message() is None  # the source is still producing: nothing to write now

    partial = s.on_server_message(transcript(0, 1, "Hel", "lo"), now=1.1)
    assert partial == [TranscriptEvent(0, "Hel", "lo", 0.5, 0.0, 1.0, "English", False)]
    assert s.on_packets(p[2:], new_segment_bound_s=0.3) == StreamProgress(0.1)
    assert s.on_packets([], new_segment_bound_s=math.inf) == StreamProgress(0.1)
    s.end_input()
    assert write_all(s) == [Features(3, p[2]), End()]
    assert s.lifecycle is ClientLifecycle.DRAINING and s.input is InputState.END_SENT

    final = s.on_server_message(transcript(0, 2, "lo.", "", final=True, start_s=0.1, end_s=0.4, seed=SEED), 1.2)
    assert final == [TranscriptEvent(0, "lo.", "", 0.5, 0.1, 0.4, "English", True), StreamProgress(math.inf)]
    assert not s.buffer.entries and s.buffer.nbytes == 0 and s.seed == SEED  # final: nothing left to resend
    assert s.on_server_message(Ack(3, 0), 1.3) == []
    assert s.on_call_closed() and s.lifecycle is ClientLifecycle.DONE
    st = s.stats
    assert (st.sessions_opened, st.resumes, st.failed_attempts) == (1, 0, 0)
    assert (st.messages_sent, st.messages_resent, st.frames_sent, st.frames_produced) == (3, 0, 30, 30)
    assert st.payload_bytes_produced == 300


def test_a_dropped_call_resumes_with_exactly_what_the_server_had_not_applied():
    s = ClientSession(ClientOptions(backoff_initial_s=0.1, backoff_max_s=1.0), rng=random.Random(0))
    p = [packet(0, 10 * i, start=i == 0) for i in range(5)]
    s.on_packets(p, 0.0)
    connect(s, Ready("sid", 0))
    assert [m.seq for m in write_all(s)] == [1, 2, 3, 4, 5]
    s.on_server_message(transcript(0, 1, "a", "b"), 0.5)
    s.on_server_message(Ack(3, -1), 0.5)

    retry = s.on_disconnect(Disconnect("Socket closed", code="UNAVAILABLE"), now=1.0)
    assert s.lifecycle is ClientLifecycle.RECONNECTING
    assert not retry.new_session and 0.05 <= retry.delay_s <= 0.1  # the first backoff, jittered
    assert s.stats.failed_attempts == 1 and s.stats.last_failure == "UNAVAILABLE: Socket closed"
    assert s.next_message() is None  # no call: nothing to write

    # the resume names the session and the last event seen; the server applied one more than it acked
    start = connect(s, Ready("sid", 4), now=1.2)
    assert start == Start(codec=CODEC_NAME, session_id="sid", last_event_seq=1)
    assert write_all(s) == [Features(5, p[4])]
    assert (s.stats.resumes, s.stats.messages_sent, s.stats.messages_resent, s.stats.frames_resent) == (1, 6, 1, 10)
    # the server re-sends what it sent after event 1; event 1 itself is dropped
    assert s.on_server_message(transcript(0, 1, "a", "b"), 1.3) == [] and s.stats.duplicate_events == 1
    assert s.on_server_message(transcript(0, 2, "b", ""), 1.3)[0].committed_delta == "b"


def test_a_lost_session_is_replayed_into_a_seeded_one_without_showing_text_twice():
    s = ClientSession(ClientOptions())
    seg0 = [packet(0, 0, start=True), packet(0, 10, end=True)]
    seg1 = [packet(1, 50, start=True), packet(1, 60)]
    s.on_packets(seg0 + seg1, new_segment_bound_s=1.0)
    connect(s, Ready("old", 0))
    write_all(s)
    s.on_server_message(transcript(0, 1, "first.", final=True, end_s=0.2, seed=SEED), 0.1)
    assert [e.segment_id for e in s.buffer.entries] == [1, 1]  # segment 0 is final: only 1 is kept
    shown = s.on_server_message(transcript(1, 2, "hello", " wor"), 0.2)
    assert [(e.committed_delta, e.partial) for e in shown if isinstance(e, TranscriptEvent)] == [("hello", " wor")]

    retry = s.on_disconnect(Disconnect("no session", code="NOT_FOUND"), now=1.0)
    assert retry == Retry(0.0, new_session=True) and s.stats.failed_attempts == 0
    start = connect(s, Ready("new", 0))
    assert start == Start(codec=CODEC_NAME, seed=SEED)  # a new session, seeded, no resume
    assert write_all(s) == [Features(1, seg1[0]), Features(2, seg1[1])]  # renumbered from 1
    assert s.stats.sessions_opened == 2 and s.stats.messages_resent == 2

    # the replacement commits segment 1 again from its start: only what extends the user's text shows
    assert s.on_server_message(transcript(1, 1, "hel", "lo"), 1.1) == []
    shown = s.on_server_message(transcript(1, 2, "lo wor", "ld"), 1.2)
    assert [(e.committed_delta, e.partial) for e in shown if isinstance(e, TranscriptEvent)] == [(" wor", "ld")]
    assert s.stats.replayed_text_chars == len("hello") and s.stats.replay_mismatches == 0
    # a replayed event of segment 0, final long ago, is not shown again
    assert s.on_server_message(transcript(0, 3, "first.", final=True), 1.3) == [StreamProgress(0.5)]
    assert s.stats.duplicate_events == 1


def test_server_errors():
    def streaming() -> ClientSession:
        s = ClientSession(ClientOptions(), target="example:1")
        s.on_packets([packet(0, 0, start=True, frames=7)], 0.0)
        return s

    s = streaming()
    s.start_message()
    with pytest.raises(ServerRejectedError, match="UNAUTHENTICATED: unknown API key") as e:
        s.on_disconnect(Disconnect("unknown API key", code="UNAUTHENTICATED"), now=0.0)
    assert e.value.code == "UNAUTHENTICATED" and s.lifecycle is ClientLifecycle.FAILED

    s = streaming()
    s.start_message()
    with pytest.raises(ServerRejectedError, match="expected Ready, got transcript"):
        s.on_server_message(transcript(0, 1, "x"), 0.0)
    s = streaming()
    s.start_message()
    with pytest.raises(ServerRejectedError, match="server applied seq 5, but only 1 were sent"):
        s.on_server_message(Ready("sid", 5), 0.0)
    assert s.lifecycle is ClientLifecycle.FAILED

    # an Error message mid-call shows nothing: the call's status follows and decides
    s = streaming()
    connect(s, Ready("sid", 0))
    assert s.on_server_message(ServerError("INVALID_ARGUMENT", "bad payload"), 0.1) == []
    with pytest.raises(ServerRejectedError, match="INVALID_ARGUMENT"):
        s.on_disconnect(Disconnect("bad payload", code="INVALID_ARGUMENT"), now=0.1)

    # admission control refuses a new stream at once, but mid-stream the work sent is worth a wait
    s = streaming()
    s.start_message()
    with pytest.raises(ServerRejectedError, match="RESOURCE_EXHAUSTED"):
        s.on_disconnect(Disconnect("too many sessions", code="RESOURCE_EXHAUSTED"), now=0.0)
    s = streaming()
    connect(s, Ready("sid", 0))
    assert s.on_disconnect(Disconnect("too many sessions", code="RESOURCE_EXHAUSTED"), now=0.0).delay_s > 0

    # a TLS mismatch (the driver's verdict) is never retried, and says what was not transcribed
    s = streaming()
    s.start_message()
    with pytest.raises(TransportSecurityError) as tls:
        s.on_disconnect(Disconnect("handshake", code="UNAVAILABLE", tls_mismatch="TLS handshake failed"), now=0.0)
    assert str(tls.value) == "TLS handshake failed; 7 feature frames (1 messages) were not transcribed"
    assert s.stats.failed_attempts == 0


def test_a_final_before_the_segments_end_continues_the_rest_as_the_next_segment():
    """A server shutting down finalises the open segment at frame 20: the packets from frame 20 on
    continue as segment 1 in the replacement session, the edge's next packets of that segment
    too, and the edge's segment 1 goes on the wire as 2."""
    s = ClientSession(ClientOptions())
    p = [packet(0, 0, start=True), packet(0, 10), packet(0, 20), packet(0, 30)]
    s.on_packets(p, new_segment_bound_s=1.0)
    connect(s, Ready("old", 0))
    write_all(s)
    s.on_server_message(transcript(0, 1, "early", final=True, start_s=0.0, end_s=0.2, seed=SEED), 0.1)
    assert s.bound_s() == 0.2  # the continuation opens at frame 20
    assert not s.on_call_closed()  # closed before our End: not done
    s.on_disconnect(Disconnect("the server closed the stream before the end"), now=0.2)
    s.start_message()
    s.on_disconnect(Disconnect("restarted", code="NOT_FOUND"), now=0.3)  # the restarted server lost it
    connect(s, Ready("new", 0))
    s.on_packets([packet(0, 40, end=True), packet(1, 80, start=True)], 0.0)
    sent = write_all(s)
    assert [(m.seq, m.packet.segment_id, m.packet.first_frame, m.packet.segment_start) for m in sent] == [
        (1, 1, 20, True), (2, 1, 30, False), (3, 1, 40, False), (4, 2, 80, True)]
    assert sent[2].packet.segment_end and sent[0].packet.payload == p[2].payload


def test_an_end_the_server_holds_already_is_not_sent_again():
    s = ClientSession(ClientOptions(), rng=random.Random(1))
    p = packet(0, 0, start=True, end=True)
    s.on_packets([p], math.inf)
    s.end_input()
    connect(s, Ready("sid", 0))
    assert write_all(s) == [Features(1, p), End()]
    assert s.check_silence(now=100.0) is not None  # End written: the server owes the finals
    s.on_disconnect(Disconnect("reset", code="UNAVAILABLE"), now=1.0)
    connect(s, Ready("sid", 1))
    assert write_all(s) == [End()]  # End again on the new call
    # ... which this server refuses: it has ours. Resume without it and wait for the finals
    assert s.on_disconnect(Disconnect("End twice", code="FAILED_PRECONDITION"), now=2.0) == Retry(0.0)
    assert s.input is InputState.END_HELD
    connect(s, Ready("sid", 1))
    assert s.lifecycle is ClientLifecycle.DRAINING and s.next_message() is None
    assert s.on_call_closed() and s.lifecycle is ClientLifecycle.DONE


def test_a_full_buffer_fails_the_stream():
    s = ClientSession(ClientOptions(max_buffer_bytes=250), target="example:1")
    s.on_packets([packet(0, 0, start=True), packet(0, 10)], 0.0)
    with pytest.raises(BufferOverflowError, match=r"300 bytes .* buffered \(limit 250\).*example:1"):
        s.on_packets([packet(0, 20)], 0.0)
    assert s.lifecycle is ClientLifecycle.FAILED


def test_silence_while_the_server_owes_something_gives_the_call_up():
    s = ClientSession(ClientOptions(silence_timeout_s=2.0))
    s.on_packets([packet(0, 0, start=True, end=True)], math.inf)
    connect(s, Ready("sid", 0), now=10.0)
    write_all(s)
    assert s.check_silence(11.0) is None
    assert s.check_silence(12.5) == "nothing from the server for 2.5 s"
    s.on_server_message(transcript(0, 1, "x", final=True), 12.5)
    s.on_server_message(Ack(1, 0), 12.5)
    assert s.check_silence(100.0) is None  # nothing owed: a quiet server is fine


def test_a_call_with_nothing_to_send_writes_a_keepalive_every_keepalive_s():
    """The server ends streams idle past its --idle-timeout-s; a feature client in silence has no
    packets to send, so it writes `KeepAlive` once nothing has been written for keepalive_s —
    counted from Ready, then from the last write of any kind — and never outside STREAMING."""
    s = ClientSession(ClientOptions(keepalive_s=5.0))
    assert s.next_message(100.0) is None and s.keepalive_in(100.0) is None  # not connected yet
    connect(s, Ready("sid", 0, keep_alive=True), now=10.0)
    assert s.keepalive_in(12.0) == 3.0 and s.next_message(12.0) is None
    msg = s.next_message(15.0)
    assert msg == KeepAlive()
    s.sent(msg)
    assert s.stats.keepalives_sent == 1 and s.stats.messages_sent == 0
    assert s.next_message(19.0) is None and s.keepalive_in(19.0) == 1.0
    s.on_packets([packet(0, 0, start=True)], math.inf)
    msg = s.next_message(19.5)
    assert isinstance(msg, Features)  # input first; its write restarts the count
    s.sent(msg)
    assert s.next_message(24.0) is None and s.keepalive_in(24.0) == 0.5
    assert s.next_message(24.5) == KeepAlive()
    s.end_input()
    assert s.next_message(40.0) == End()  # End, not a KeepAlive, when both are due
    s.sent(End())
    assert s.next_message(100.0) is None and s.keepalive_in(100.0) is None  # draining: only finals due
    never = ClientSession(ClientOptions(keepalive_s=0))
    connect(never, Ready("sid", 0, keep_alive=True), now=0.0)
    assert never.next_message(1e6) is None and never.keepalive_in(1e6) is None


def test_no_keepalive_to_a_server_whose_ready_does_not_take_them():
    """A server older than KeepAlive ends a stream over one (INVALID_ARGUMENT) and has no idle
    timeout: its Ready lacks `keep_alive`, and the call writes none, however long it is quiet. A
    resume on a newer server (its Ready says so) writes them again."""
    s = ClientSession(ClientOptions(keepalive_s=5.0))
    connect(s, Ready("sid", 0), now=0.0)
    assert s.keepalive_in(1e6) is None and s.next_message(1e6) is None
    s.on_disconnect(Disconnect("connection reset", code="UNAVAILABLE"), 1e6)
    connect(s, Ready("sid", 0, keep_alive=True), now=2e6)
    assert s.next_message(2e6 + 5.0) == KeepAlive()
    # and back: a resume that reaches an older server again (a rolling downgrade) writes none
    s.on_disconnect(Disconnect("connection reset", code="UNAVAILABLE"), 3e6)
    connect(s, Ready("sid", 0), now=4e6)
    assert s.keepalive_in(5e6) is None and s.next_message(5e6) is None


def test_backoff_grows_and_the_offline_bound_ends_the_stream():
    o = ClientOptions(max_offline_s=1.0, backoff_initial_s=0.1, backoff_max_s=0.4, backoff_multiplier=2.0)
    s = ClientSession(o, target="example:1", rng=random.Random(3))
    s.on_packets([packet(0, 0, start=True, frames=12)], 0.0)
    now, delays = 0.0, []
    with pytest.raises(ServerUnavailableError) as e:
        while True:
            s.start_message()
            delays.append(s.on_disconnect(Disconnect("connection refused", code="UNAVAILABLE"), now).delay_s)
            now += delays[-1]
    # jittered between half and all of 0.1, 0.2, 0.4, 0.4, ...; the last wait ends at max_offline_s
    assert 0.05 <= delays[0] <= 0.1 and 0.1 <= delays[1] <= 0.2 and 0.2 <= delays[2] <= 0.4, delays
    assert max(delays) <= 0.4 and math.isclose(now, 1.0)
    assert "example:1 unreachable for 1.0 s" in str(e.value) and "12 feature frames (1 messages)" in str(e.value)
    assert s.lifecycle is ClientLifecycle.FAILED and s.stats.failed_attempts == len(delays) + 1

    # a call that reached Ready starts the offline clock and the backoff afresh
    s = ClientSession(o, rng=random.Random(3))
    s.start_message()
    s.on_disconnect(Disconnect("refused", code="UNAVAILABLE"), now=0.0)
    connect(s, Ready("sid", 0), now=0.9)
    assert s.on_disconnect(Disconnect("reset", code="UNAVAILABLE"), now=5.0).delay_s <= 0.1


def test_thin_client_trims_replays_from_the_last_final_and_shifts_times():
    s = ClientSession(ClientOptions(send_audio=True, audio_piece_ms=100))
    audio = (np.arange(48_000) % 2000 - 1000).astype("<i2").tobytes()  # 3 s, every sample distinct mod 2000
    for i in range(30):
        s.on_audio(audio[3200 * i:3200 * (i + 1)])
    start = connect(s, Ready("old", 0))
    assert start.codec == ""
    sent = write_all(s)
    assert sent[0] == Audio(1, audio[:3200], 16_000) and len(sent) == 30
    # segment 0 ended at 1.0 s; the server applied everything: audio before the replay grid
    # point at or before 1.0 s (15360 samples: a multiple of the hop and the VAD window) goes
    s.on_server_message(transcript(0, 1, "one", final=True, start_s=0.5, end_s=1.0, seed=SEED), 0.1)
    s.on_server_message(Ack(30, 0), 0.1)
    assert s.buffer.entries[0].first_sample == 9 * 1600 and len(s.buffer.entries) == 21

    s.on_disconnect(Disconnect("lost", code="NOT_FOUND"), now=1.0)
    assert connect(s, Ready("new", 0)).seed == SEED
    replay = write_all(s)
    assert b"".join(m.pcm16 for m in replay) == audio[2 * 15360:]  # from the grid point, all of it once
    assert [m.seq for m in replay] == list(range(1, len(replay) + 1))
    assert s.stats.messages_resent == len(replay)
    # the new session's times start at the replay point, 0.96 s into the stream
    (event,) = s.on_server_message(transcript(1, 1, "two", start_s=0.1, end_s=0.5), 1.1)
    assert isinstance(event, TranscriptEvent) and math.isclose(event.start_s, 1.06)
    assert math.isclose(event.end_s, 1.46)


def test_thin_client_with_a_front_end_checkpoint_replays_from_it_and_keeps_its_times():
    """The final's seed carries the server's front-end state: the replacement session is seeded with
    it whole, gets the audio from its `audio_sample` on, and its events keep their times (the
    resumed front end counts the stream as the lost one did)."""
    s = ClientSession(ClientOptions(send_audio=True, audio_piece_ms=100))
    audio = (np.arange(48_000) % 2000 - 1000).astype("<i2").tobytes()  # 3 s
    for i in range(30):
        s.on_audio(audio[3200 * i:3200 * (i + 1)])
    connect(s, Ready("old", 0))
    write_all(s)
    seed = SessionSeed(2.5, "hello", 1, front_end_state=b"front end at 1.12 s", audio_sample=15_360)
    s.on_server_message(transcript(0, 1, "one", final=True, start_s=0.5, end_s=1.3, seed=seed), 0.1)
    s.on_server_message(Ack(30, 0), 0.1)
    assert s.buffer.entries[0].first_sample == 9 * 1600  # the piece holding the replay point

    s.on_disconnect(Disconnect("lost", code="NOT_FOUND"), now=1.0)
    assert connect(s, Ready("new", 0)).seed == seed
    replay = write_all(s)
    assert b"".join(m.pcm16 for m in replay) == audio[2 * 15_360:]
    (event,) = s.on_server_message(transcript(1, 1, "two", start_s=1.6, end_s=2.0), 1.1)
    assert isinstance(event, TranscriptEvent) and (event.start_s, event.end_s) == (1.6, 2.0)


def test_the_front_ends_do_not_mix():
    with pytest.raises(TypeError):
        ClientSession(ClientOptions(send_audio=True)).on_packets([packet(0, 0, start=True)], 0.0)
    with pytest.raises(TypeError):
        ClientSession(ClientOptions()).on_audio(b"\0\0")


# ---- finalize and turn events ------------------------------------------------------------------

def test_a_thin_clients_finalize_goes_out_right_after_the_audio_given_before_it():
    s = ClientSession(ClientOptions(send_audio=True, audio_piece_ms=100))
    pcm = b"\1\0" * 1600
    s.finalize()  # before any audio: goes first (the server has nothing open: no effect there)
    s.on_audio(pcm)
    s.on_audio(pcm)
    s.finalize()
    s.finalize()  # twice with nothing in between: one message
    s.on_audio(pcm)
    connect(s, Ready("sid", 0))
    assert write_all(s) == [Finalize(), Audio(1, pcm, 16_000), Audio(2, pcm, 16_000), Finalize(),
                            Audio(3, pcm, 16_000)]
    assert s.stats.finalizes_sent == 2
    s.finalize()  # after everything sent: at once
    assert write_all(s) == [Finalize()]
    s.end_input()
    s.finalize()  # after the end of input: nothing (End finalises everything)
    assert write_all(s) == [End()]


def test_a_finalize_waits_for_the_audio_before_it_across_a_resume_and_is_sent_once():
    s = ClientSession(ClientOptions(send_audio=True, audio_piece_ms=100))
    pcm = b"\1\0" * 1600
    for _ in range(3):
        s.on_audio(pcm)
    s.finalize()
    connect(s, Ready("sid", 0))
    first = s.next_message()
    s.sent(first)
    s.on_disconnect(Disconnect("lost", code="UNAVAILABLE"), now=1.0)
    connect(s, Ready("sid", 1), now=1.5)  # the server applied seq 1
    assert write_all(s) == [Audio(2, pcm, 16_000), Audio(3, pcm, 16_000), Finalize()]
    s.on_disconnect(Disconnect("lost", code="UNAVAILABLE"), now=2.0)
    connect(s, Ready("sid", 3), now=2.5)
    assert write_all(s) == []  # the Finalize went out once


def test_a_feature_client_finalizes_in_its_front_end():
    with pytest.raises(ValueError, match="FeatureStream.finalize"):
        ClientSession(ClientOptions()).finalize()


def test_turn_events_once_each_and_on_the_users_timeline():
    from harken.shared.protocol import Turn
    from harken.shared.transcript import TurnEvent

    s = ClientSession(ClientOptions(turn_events=True))
    s.on_packets([packet(0, 0, start=True), packet(0, 10, end=True), packet(1, 50, start=True)], 1.0)
    start = connect(s, Ready("old", 0, turn_events=True))
    assert start.turn_events and s.stats.turn_events is True
    write_all(s)
    began = TurnEvent("speech_started", 0, 0.0)
    assert s.on_server_message(Turn(began, 1), 0.1) == [began]
    assert s.on_server_message(Turn(began, 1), 0.1) == []  # a resume's replay: once
    ended = TurnEvent("utterance_end", 0, 0.2)
    assert s.on_server_message(Turn(ended, 2), 0.2) == [ended]
    s.on_server_message(transcript(0, 3, "first.", final=True, end_s=0.2, seed=SEED), 0.3)
    second = TurnEvent("speech_started", 1, 0.5)
    assert s.on_server_message(Turn(second, 4), 0.4) == [second]
    # the server lost the session: the replacement repeats segment 1's onset, which is not shown again
    s.on_disconnect(Disconnect("no session", code="NOT_FOUND"), now=1.0)
    connect(s, Ready("new", 0, turn_events=True))
    write_all(s)
    assert s.on_server_message(Turn(second, 1), 1.1) == []
    assert s.on_server_message(Turn(TurnEvent("utterance_end", 1, 0.9), 2), 1.2) == [TurnEvent("utterance_end", 1, 0.9)]


def test_a_configure_goes_out_after_the_messages_before_it_and_again_first_on_every_later_call():
    from harken.shared.protocol import Configure

    s = ClientSession(ClientOptions(send_audio=True, audio_piece_ms=100, keyterms=("alpha",)))
    pcm = b"\1\0" * 1600
    s.on_audio(pcm)
    s.configure(("harken", "Qwen"), context="notes")
    s.on_audio(pcm)
    start = connect(s, Ready("sid", 0))
    assert start.keyterms == ("alpha",) or start.keyterms == ("harken", "Qwen")
    assert write_all(s) == [Audio(1, pcm, 16_000), Configure(("harken", "Qwen"), "notes"), Audio(2, pcm, 16_000)]
    s.on_disconnect(Disconnect("lost", code="UNAVAILABLE"), now=1.0)
    assert connect(s, Ready("sid", 2), now=1.5).keyterms == ("harken", "Qwen")
    assert write_all(s) == [Configure(("harken", "Qwen"), "notes")]  # the server may not have had it
    s.on_disconnect(Disconnect("no session", code="NOT_FOUND"), now=2.0)
    replacement = connect(s, Ready("new", 0), now=2.5)
    assert (replacement.keyterms, replacement.context) == (("harken", "Qwen"), "notes")
