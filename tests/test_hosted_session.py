"""The server's sessions without the network: `SessionTable` and `HostedSession` (the asyncio
driver of cloud/hosting/server_session.py) on the real tiny model's engine, fed the edge's packets as
`shared/protocol` messages, with a fake clock for grace periods and idleness. gRPC and WebRTC add
only bytes in and out (tests/test_server_*.py, tests/test_webrtc.py)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from harken.cloud.base.errors import IdleTimeout, Overloaded, SessionNotFound
from harken.cloud.hosting.hosted_session import woken
from harken.cloud.server import ServerOptions, start_core
from harken.cloud.hosting.server_session import CLOSED_OK, ServerLifecycle
from harken.edge.audio import peak_normalize
from harken.shared.codec import CODEC_NAME
from harken.shared.protocol import End, Features, Start
from harken.shared.text import events_text
from signals import concat, silence, speech

LANGUAGE = "English"  # forced: the tiny random model then writes text


@pytest.fixture(scope="module")
def audio() -> np.ndarray:
    """Two utterances with a pause: two VAD segments."""
    return peak_normalize(concat(silence(0.3), speech("Hello there, this is a test."), silence(0.8),
                                 speech("A second sentence follows."), silence(0.5)))


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def start(**kw) -> Start:
    return Start(language=LANGUAGE, codec=CODEC_NAME, **kw)


async def run_session(table, key: str, packets, st: Start | None = None):
    """Open, attach, apply every packet and End, collect events until the stream's end."""
    session = await table.open(key, st or start())
    a = await session.attach(0)
    for seq, p in enumerate(packets, 1):
        await session.apply(Features(seq, p))
    await session.apply(End())
    events = []
    while True:
        await woken(a)
        for t in session.events_after(a.sent_event_seq):
            events.append(t.event)
            session.sent(a, t.event_seq)
        if a.end is not None:
            return session, a, events


def test_a_session_driven_without_grpc_gives_the_in_process_transcript(asr, packets, reference):
    async def main():
        core = await start_core(asr, ServerOptions(max_sessions=2))
        try:
            session, a, events = await run_session(core.table, "k", packets)
            engine = core.scheduler.engine
            for _ in range(500):  # the slot is released by a task the end started, on the engine's tick
                if not engine.sessions:
                    break
                await asyncio.sleep(0.01)
            return session, a, events, len(engine.sessions)
        finally:
            await core.close(1.0)

    session, a, events, engine_sessions = asyncio.run(main())
    assert a.end == CLOSED_OK and session.lifecycle is ServerLifecycle.ENDED
    assert events_text(events) == events_text(reference) and events_text(events)
    assert [e for e in events if e.is_final] == [e for e in reference if e.is_final]
    assert engine_sessions == 0  # ended: its engine slot is free, the session waits to be discarded


def test_a_session_failing_in_the_engine_fails_alone_and_frees_its_slot(asr, packets, reference, monkeypatch):
    """The failed-session contract: the engine's exception reaches the session's stream as the
    session's end (the server sends it as INTERNAL), later streams get it too, its KV slot is
    freed, and a session beside it finishes with the full transcript."""
    from harken.cloud.inference.decoder_stream import DecoderStream

    finish_job = DecoderStream.finish_job
    fault = RuntimeError("simulated fault in one session's processing")

    def fragile(self, job, tokens, *probs):
        if self.state.options.context == "fail here" and self.state.events >= 2:
            raise fault
        return finish_job(self, job, tokens, *probs)

    monkeypatch.setattr(DecoderStream, "finish_job", fragile)

    async def main():
        core = await start_core(asr, ServerOptions(max_sessions=2))
        try:
            (bad, bad_a, _), (good, good_a, good_events) = await asyncio.gather(
                run_session(core.table, "k", packets, start(context="fail here")),
                run_session(core.table, "k", packets))
            first_end = bad_a.end
            again = await bad.attach(0)  # a resume (the old stream is superseded)
            return bad, first_end, again, good_a, good_events, core.scheduler.engine
        finally:
            await core.close(1.0)

    bad, first_end, again, good_a, good_events, engine = asyncio.run(main())
    assert bad.lifecycle is ServerLifecycle.FAILED and first_end is fault and again.end is fault
    assert good_a.end == CLOSED_OK and events_text(good_events) == events_text(reference)
    assert not engine.sessions and engine.cache.num_free() == engine.cache.max_slots


def test_grace_expiry_idle_streams_and_admission_on_a_fake_clock(asr, packets):
    async def main():
        clock = Clock()
        options = ServerOptions(max_sessions=2, max_sessions_per_key=2, grace_s=10.0, idle_timeout_s=5.0)
        core = await start_core(asr, options, clock=clock)
        table = core.table
        try:
            first = await table.open("alice", start())
            with_stream = await table.open("alice", start())
            with pytest.raises(Overloaded, match="this key holds its maximum of 2"):
                await table.open("alice", start())
            a = await with_stream.attach(0)
            await with_stream.apply(Features(1, packets[0]))
            # the server is full, but `first` has been detached since it opened: it gives way
            bob = await table.open("bob", start())
            assert first.session_id not in table.sessions and first.lifecycle is ServerLifecycle.CLOSED
            # the attached stream sent nothing for longer than the idle timeout while the engine
            # owed it nothing (its frames are short of the first update): ended, session closed
            while with_stream.idle_for(clock.now) is None:  # until the engine has taken the frames
                await asyncio.sleep(0.01)
            clock.now += 6.0
            await table.sweep(clock.now)
            assert isinstance(a.end, IdleTimeout) and with_stream.session_id not in table.sessions
            # bob's session is detached: it outlives the idle timeout, not its grace period
            assert bob.session_id in table.sessions
            clock.now += 10.0
            await table.sweep(clock.now)
            with pytest.raises(SessionNotFound, match="expired"):
                table.find("bob", bob.session_id)
        finally:
            await core.close(1.0)

    asyncio.run(main())


def test_the_engines_reports_reach_the_servers_metrics(talkative_asr, packets):
    """`EngineObserver`: every decode the engine cut (its own count, `Engine.truncations`) is in
    `harken_decode_truncated_total` by reason, and every tick that served sessions is in
    `harken_batch_size` (a model that writes on: budget cuts happen)."""
    async def main():
        core = await start_core(talkative_asr, ServerOptions(max_sessions=2))
        try:
            await run_session(core.table, "k", packets)
            engine = core.scheduler.engine
            return dict(engine.truncations), core.metrics.registry
        finally:
            await core.close(1.0)

    truncations, registry = asyncio.run(main())
    assert sum(truncations.values()) > 0
    for reason in ("budget", "loop"):
        got = registry.get_sample_value("harken_decode_truncated_total", {"reason": reason}) or 0.0
        assert got == truncations.get(reason, 0)
    assert registry.get_sample_value("harken_batch_size_count") >= 1
    assert registry.get_sample_value("harken_batch_size_sum") >= registry.get_sample_value("harken_batch_size_count")
