"""cloud/server: who gets a session and for how long: TLS and API keys, limits, idle streams.

TLS with API keys round-trips the reference transcript (a wrong key and plaintext are refused), and
a client that streams on right after Start without a key is UNAUTHENTICATED every time. Admission
control: new streams past the per-key or server-wide session limit are refused at once while the
admitted ones carry on; a client flooding queued audio waits on its own limits while others are
still admitted; detached sessions count against their own key only. Slots come back: a silent
stream is reaped past the idle timeout (but not while the engine owes it work), and keepalive
pings find a dead connection and detach its stream. A stream pushing audio faster than its pace
(--max-audio-speed, --audio-burst-s) is slowed, and only it.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import numpy as np

from harken.shared.codec import CODEC_NAME
from harken.proto import harken_pb2 as pb
from harken.proto import harken_pb2_grpc
from server_helpers import (END, KEY_A, KEY_B, OK, Outcome, TIMEOUT, bearer, features_msgs, run_stream, serving,
                            start_msg, transcript_of)
from server_helpers import audio, reference  # module fixtures: pytest finds them here
from tls_files import self_signed


def test_tls_and_api_key_round_trip(asr, packets, reference, tmp_path):
    cert, key = self_signed(tmp_path)
    cert_pem = Path(cert).read_bytes()
    keys = tmp_path / "keys"
    keys.write_text(f"{KEY_A} alice\n")
    credentials = grpc.ssl_channel_credentials(root_certificates=cert_pem)

    async def main():
        async with serving(asr, tls_cert=cert, tls_key=key, api_keys=str(keys)) as server:
            target = f"localhost:{server.port}"
            msgs = [start_msg(codec=CODEC_NAME)] + features_msgs(packets) + [END]
            good = await run_stream(target, msgs, metadata=bearer(KEY_A), credentials=credentials)
            wrong = await run_stream(target, msgs, metadata=bearer(KEY_B), credentials=credentials)
            plaintext = await run_stream(f"127.0.0.1:{server.port}", msgs, metadata=bearer(KEY_A))
            return server.tls, good, wrong, plaintext

    tls, good, wrong, plaintext = asyncio.run(main())
    assert tls
    assert good.code == OK, good.details
    assert transcript_of(good.events) == transcript_of(reference)
    assert (wrong.code, wrong.details) == (grpc.StatusCode.UNAUTHENTICATED, "unknown API key")
    assert plaintext.code == grpc.StatusCode.UNAVAILABLE and not plaintext.messages


def test_a_missing_key_is_unauthenticated_every_time_even_for_a_client_still_writing(asr, tmp_path):
    """50 calls without a key from a client that streams on right after Start (as a live client
    does), read with plain grpc.aio: every status is UNAUTHENTICATED. Before the server read what
    such a client still sent, its write failed and grpc.aio showed INTERNAL about 1 time in 2."""
    keys = tmp_path / "keys"
    keys.write_text(f"{KEY_A}\n")

    async def main():
        codes = []
        async with serving(asr, api_keys=str(keys)) as server, grpc.aio.insecure_channel(server.address) as ch:
            stub = harken_pb2_grpc.TranscriptionStub(ch)
            for _ in range(50):
                async def requests():
                    yield start_msg(codec=CODEC_NAME)
                    for m in _at_floor_packets(20, frames=20):
                        yield m
                        await asyncio.sleep(0)

                try:
                    async for _ in stub.Stream(requests(), timeout=TIMEOUT):
                        pass
                    codes.append(OK)
                except grpc.aio.AioRpcError as e:
                    codes.append(e.code())
        return codes

    codes = asyncio.run(main())
    assert codes == [grpc.StatusCode.UNAUTHENTICATED] * 50, {c.name: codes.count(c) for c in set(codes)}


class FakeClock:
    """The server's clock for grace periods and idle streams: time moves only when told."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def test_overload_refuses_new_streams_at_once_while_admitted_ones_continue(asr, packets, reference, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text(f"{KEY_A}\n{KEY_B}\n")

    async def main():
        async with serving(asr, api_keys=str(keys), max_sessions=3, max_sessions_per_key=2) as server:
            release = asyncio.Event()
            msgs = [start_msg(codec=CODEC_NAME)] + features_msgs(packets) + [END]
            admitted = []

            async def admit(key):
                out = Outcome()
                admitted.append((out, asyncio.create_task(run_stream(
                    server.address, msgs[:-1], metadata=bearer(key), hold_open=release, then=[END], out=out))))
                await out.progress.wait()  # Ready: admitted
                assert out.ready.session_id

            await admit(KEY_A)
            await admit(KEY_A)
            per_key = await run_stream(server.address, msgs, metadata=bearer(KEY_A))
            await admit(KEY_B)
            server_full = await run_stream(server.address, msgs, metadata=bearer(KEY_B))
            # the refusals came while every admitted stream was still open (release is not set)
            assert not any(task.done() for _, task in admitted)
            release.set()
            return per_key, server_full, [await task for _, task in admitted]

    per_key, server_full, admitted = asyncio.run(main())
    assert (per_key.code, per_key.details) == (grpc.StatusCode.RESOURCE_EXHAUSTED,
                                               "this key holds its maximum of 2 sessions")
    assert (server_full.code, server_full.details) == (grpc.StatusCode.RESOURCE_EXHAUSTED,
                                                       "the server holds its maximum of 3 sessions")
    for out in admitted:
        assert out.code == OK, out.details
        assert transcript_of(out.events) == transcript_of(reference)


def _at_floor_packets(n: int, frames: int = 72) -> list[pb.ClientMessage]:
    """One segment of `n` Features messages of `frames` frames at their floor: 9 bytes each, the
    most audio per byte the wire accepts."""
    from harken.shared.codec import encode_frames

    payload = encode_frames(np.full((128, frames), -3.0, np.float32), floor_log10=-3.0)
    return [pb.ClientMessage(features=pb.Features(seq=i + 1, segment_id=0, first_frame=i * frames,
                                                  frame_count=frames, segment_start=i == 0, payload=payload))
            for i in range(n)]


def test_a_client_flooding_queued_audio_waits_on_itself_and_others_are_admitted(asr, tmp_path):
    """The engine is stalled (the fault: a model that has fallen behind) while key A sends 14 s of
    frames as fast as it can, and opens a second session. Its sessions stop being read at their own
    limit and A gets no third one past its key's limit; key B, and a second session of key A, are
    still admitted: A cannot fill the server's queue alone and make it refuse everyone."""
    keys = tmp_path / "keys"
    keys.write_text(f"{KEY_A} alice\n{KEY_B} bob\n")  # sessions are bound to the names

    async def main():
        async with serving(asr, api_keys=str(keys), max_queued_frames=1000, max_queued_frames_per_session=300,
                           max_queued_frames_per_key=500, shutdown_grace_s=0.2) as server:
            await server._scheduler.stop()  # no more ticks: nothing queued is encoded
            flood = _at_floor_packets(20)  # 1440 frames: past every limit
            hold = asyncio.Event()
            first = Outcome()
            flooding = [asyncio.create_task(run_stream(server.address, [start_msg(codec=CODEC_NAME)] + flood,
                                                       metadata=bearer(KEY_A), hold_open=hold, out=first))]

            def queued(key):
                return server._table.queued_frames_of_key(key)

            while queued("alice") <= 300:  # A's first session reads until past its own limit ...
                await asyncio.sleep(0.02)
            second = Outcome()
            flooding.append(asyncio.create_task(run_stream(
                server.address, [start_msg(codec=CODEC_NAME)] + flood, metadata=bearer(KEY_A), hold_open=hold,
                out=second)))
            await second.progress.wait()  # ... so A still gets a second session
            while queued("alice") <= 500:
                await asyncio.sleep(0.02)
            third = await run_stream(server.address, [start_msg(codec=CODEC_NAME), END], metadata=bearer(KEY_A))
            other = await run_stream(server.address, [start_msg(codec=CODEC_NAME), END], metadata=bearer(KEY_B))
            per_session = [s.queued_frames() for s in server._table.sessions.values() if s.key_id == "alice"]
            for task in flooding:
                task.cancel()
            await asyncio.gather(*flooding, return_exceptions=True)
            return third, other, per_session

    third, other, per_session = asyncio.run(main())
    # the first session stopped one message (72 frames) past its own limit (360), the second one
    # past the key's (the key then holds 504: 5 s)
    assert per_session == [360, 144]
    assert (third.code, third.details) == (grpc.StatusCode.RESOURCE_EXHAUSTED,
                                           "this key has 5 s of audio waiting to be processed")
    assert other.code == OK, other.details


IDLE_S = 0.4  # the idle timeout of these servers, on their fake clock (the reaper looks every 0.1 s)
DEADLINE = grpc.StatusCode.DEADLINE_EXCEEDED


def test_a_silent_stream_is_reaped_and_its_slot_goes_to_the_next_client(asr, packets, reference):
    """A client sends Start and then nothing, on a server of one session. While the clock stands
    still it holds the slot (the next client is refused); once it has been idle past the timeout
    it is ended DEADLINE_EXCEEDED with a message saying so, its session is closed, and the next
    client gets the slot and its whole transcript."""
    clock = FakeClock()

    async def main():
        async with serving(asr, clock=clock, max_sessions=1, idle_timeout_s=IDLE_S, grace_s=600) as server:
            silent = Outcome()
            silent_task = asyncio.create_task(run_stream(server.address, [start_msg(codec=CODEC_NAME)],
                                                         hold_open=asyncio.Event(), out=silent))
            await silent.progress.wait()  # Ready: it holds the one slot
            msgs = [start_msg(codec=CODEC_NAME)] + features_msgs(packets) + [END]
            refused = await run_stream(server.address, msgs)
            await server._table.next_sweep()
            still_open = not silent_task.done()
            clock.advance(IDLE_S + 0.6)
            await asyncio.wait_for(silent_task, TIMEOUT)
            held = len(server._table.sessions)
            admitted = await run_stream(server.address, msgs)
            errors = server.metrics.registry.get_sample_value("harken_errors_total", {"code": "DEADLINE_EXCEEDED"})
            return refused, still_open, silent, held, admitted, errors

    refused, still_open, silent, held, admitted, errors = asyncio.run(main())
    assert (refused.code, refused.details) == (grpc.StatusCode.RESOURCE_EXHAUSTED,
                                               "the server holds its maximum of 1 sessions")
    assert still_open
    assert silent.code == DEADLINE, silent.details
    assert silent.details == (f"the stream was idle for 1.0 s (limit {IDLE_S:g} s): no message while the server "
                              "had nothing to do for it; the session is closed")
    assert silent.messages[-1].error.code == "DEADLINE_EXCEEDED"
    assert held == 0 and errors == 1
    assert admitted.code == OK, admitted.details
    assert transcript_of(admitted.events) == transcript_of(reference)


def test_a_stream_whose_audio_is_pending_in_the_engine_is_not_reaped(asr, packets):
    """The engine is stalled with an update of this stream due: however long the clock runs, the
    stream is not idle (the server owes it work). Once the engine has done that work, the stream,
    still sending nothing, is idle from then on and is reaped."""
    clock = FakeClock()
    first = packets[:next(i for i, p in enumerate(packets) if p.segment_end)]  # the first segment but its end
    head = features_msgs(first)
    assert head[0].features.segment_start and sum(p.frame_count for p in first) >= 50  # past an update (50 frames)

    async def main():
        async with serving(asr, clock=clock, idle_timeout_s=IDLE_S, grace_s=600) as server:
            await server._scheduler.stop()  # the fault: the engine does not step
            out = Outcome()
            task = asyncio.create_task(run_stream(server.address, [start_msg(codec=CODEC_NAME)] + head,
                                                  hold_open=asyncio.Event(), out=out))
            applied = server.metrics.registry.get_sample_value
            for _ in range(6000):  # until all are applied, the update due (a hang guard, not a timing)
                if applied("harken_messages_in_total", {"kind": "features"}) == len(head):
                    break
                await asyncio.sleep(0.01)
            clock.advance(100.0)
            for _ in range(3):
                await server._table.next_sweep()
            pending_survived = not task.done()
            await server._scheduler.start()
            while not out.transcripts:  # the engine did the update: nothing more is due
                out.progress.clear()
                await out.progress.wait()
            await server._table.next_sweep()
            clock.advance(IDLE_S + 0.6)
            await asyncio.wait_for(task, TIMEOUT)
            return pending_survived, out

    pending_survived, out = asyncio.run(main())
    assert pending_survived
    assert out.code == DEADLINE and out.details.startswith("the stream was idle for 1.0 s"), out.details


def test_detached_sessions_count_against_their_key_not_against_other_keys(asr, packets, reference, tmp_path):
    """Key A opens two sessions and drops both (they wait in their grace period for A to resume):
    A's third session is refused at its key's limit of 2. The server's limit is 2 as well, but key
    B is admitted: the session detached longest gives way (A resuming it gets NOT_FOUND, and would
    replay into a new session), while A's other detached session can still be resumed."""
    keys = tmp_path / "keys"
    keys.write_text(f"{KEY_A}\n{KEY_B}\n")
    clock = FakeClock()

    async def main():
        async with serving(asr, clock=clock, api_keys=str(keys), max_sessions=2, max_sessions_per_key=2,
                           grace_s=600) as server:
            dropped = []
            for _ in range(2):
                out = await run_stream(server.address, [start_msg(codec=CODEC_NAME)], metadata=bearer(KEY_A),
                                       hold_open=asyncio.Event(), stop_after=lambda out: True)
                dropped.append(out.ready.session_id)
                session = server._table.sessions[out.ready.session_id]
                for _ in range(400):  # the handler's cleanup runs after the cancellation comes back
                    if session.detached_at is not None:
                        break
                    await asyncio.sleep(0.01)
                clock.advance(1.0)
            detached = [server._table.sessions[sid].detached_at is not None for sid in dropped]
            third = await run_stream(server.address, [start_msg(codec=CODEC_NAME), END], metadata=bearer(KEY_A))
            other = await run_stream(server.address, [start_msg(codec=CODEC_NAME)] + features_msgs(packets) + [END],
                                     metadata=bearer(KEY_B))
            first_again = await run_stream(server.address, [start_msg(session_id=dropped[0])], metadata=bearer(KEY_A))
            second_again = await run_stream(server.address, [start_msg(session_id=dropped[1]), END],
                                            metadata=bearer(KEY_A))
            return dropped, detached, third, other, first_again, second_again

    dropped, detached, third, other, first_again, second_again = asyncio.run(main())
    assert detached == [True, True]
    assert (third.code, third.details) == (grpc.StatusCode.RESOURCE_EXHAUSTED,
                                           "this key holds its maximum of 2 sessions")
    assert other.code == OK, other.details
    assert transcript_of(other.events) == transcript_of(reference)
    assert first_again.code == grpc.StatusCode.NOT_FOUND, first_again.details
    assert second_again.code == OK, second_again.details
    assert second_again.ready.session_id == dropped[1]


def test_keepalive_pings_find_a_dead_connection_and_detach_its_stream(asr):
    """The network under an attached stream goes silent (a proxy drops every byte, no reset): the
    server's keepalive ping goes unanswered, it closes the connection, and the stream is detached,
    so the session's grace period runs (without pings it stayed attached until the idle timeout,
    here far away)."""
    from faults import CuttingProxy

    async def main():
        async with serving(asr, keepalive_time_s=0.2, keepalive_timeout_s=0.3, idle_timeout_s=600,
                           grace_s=600) as server:
            proxy = await CuttingProxy("127.0.0.1", server.port, max_cuts=0).start()
            out = Outcome()
            task = asyncio.create_task(run_stream(proxy.target, [start_msg(codec=CODEC_NAME)],
                                                  hold_open=asyncio.Event(), out=out))
            await out.progress.wait()
            session = server._table.sessions[out.ready.session_id]
            proxy.stall()
            for _ in range(600):  # bounded: a few keepalive periods, generously
                if session.attachment is None:
                    break
                await asyncio.sleep(0.05)
            detached = session.attachment is None and session.detached_at is not None
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await proxy.close()
            return detached

    assert asyncio.run(main())


def test_audio_pace_counts_audio_seconds_and_pays_long_messages_back():
    """AudioPace on a fake clock: a burst is taken at once, then audio at `speed` x real time; a
    message longer than the burst is taken and paid for by the wait before the next one."""
    from harken.cloud.hosting.server_session import AudioPace

    now = [0.0]
    pace = AudioPace(speed=2.0, burst_s=3.0, clock=lambda: now[0])
    for _ in range(3):
        assert pace.wait_s() == 0.0
        pace.take(1.0)
    assert pace.wait_s() <= 0.002  # just empty: the next message goes as soon as anything is back
    now[0] += 0.002
    assert pace.wait_s() == 0.0
    pace.take(1.0)
    assert 0.498 <= pace.wait_s() <= 0.5  # owed 1 s of audio (less the 4 ms that came back): 0.5 s
    now[0] += 0.5
    assert pace.wait_s() == 0.0
    pace.take(10.0)  # longer than the burst: taken, owed
    assert 4.99 <= pace.wait_s() <= 5.01
    now[0] += 100.0
    assert pace.wait_s() == 0.0 and pace.tokens == 3.0  # refills to the burst, no further
    assert AudioPace(speed=0.0, burst_s=0.0, clock=lambda: 0.0).wait_s() == 0.0  # 0: no pace


def test_a_stream_faster_than_its_pace_is_slowed_and_others_are_not(asr, audio):
    """A thin client pushing its audio at once against --max-audio-speed 2 --audio-burst-s 1 is held
    back: it cannot be applied in less than (seconds - 1 - 0.1) / 2 s, and the time it was held is counted
    in harken_audio_paced_seconds. Another stream's pace is its own: one within its burst is never
    held."""
    from server_helpers import _scrape, audio_msgs

    def paced(port: int) -> float:
        return _scrape(port).get(("harken_audio_paced_seconds_total", ()), 0.0)

    async def main():
        async with serving(asr, metrics_port=0, max_audio_speed=2.0, audio_burst_s=1.0) as server:
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            fast = await run_stream(server.address, [start_msg(language="English")] + audio_msgs(audio) + [END])
            took = loop.time() - t0
            assert fast.code == OK and fast.messages
            # the burst is free, and the last 100-ms message is taken while the bucket is not empty
            owed = (len(audio) / 16000 - 1.0 - 0.1) / 2.0
            assert took >= owed
            held = paced(server.metrics_port)
            assert held > 0  # (less than `owed`: the bucket also refills while the engine catches up)
            short = await run_stream(server.address, [start_msg(language="English")]
                                     + audio_msgs(audio[:8000]) + [END])  # 0.5 s: inside its own burst
            assert short.code == OK and paced(server.metrics_port) == held
    asyncio.run(asyncio.wait_for(main(), TIMEOUT))
