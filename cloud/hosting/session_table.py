"""The server's table of sessions: every `HostedSession` by id, admission (per key, server-wide,
queued audio), the reaper of expired sessions and idle streams, and shutdown's finals."""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable
from concurrent.futures import Executor

from ..base.errors import IdleTimeout, NotYourSession, Overloaded, SessionNotFound, ShuttingDown
from ..base.metrics import ServerMetrics
from .hosted_session import HostedSession, short_id
from .server_session import SessionLimits
from ...shared.protocol import Start

log = logging.getLogger("harken.server")


class SessionTable:
    """Every session on the server, by id; admission control; the reaper of expired sessions and
    idle streams. `clock` (monotonic seconds) times both; tests pass a fake one."""

    def __init__(self, scheduler, limits: SessionLimits, metrics: ServerMetrics, executor: Executor,
                 clock: Callable[[], float] = time.monotonic):
        self.scheduler = scheduler
        self.limits = limits
        self.metrics = metrics
        self.executor = executor
        self.clock = clock
        self.sessions: dict[str, HostedSession] = {}
        self.shutting_down = False
        self.failed: Exception | None = None
        self._sweep_waiters: list[asyncio.Future] = []
        self._reaper = asyncio.get_running_loop().create_task(self._reap(), name="session-reaper")
        self._closing: set[asyncio.Task] = set()

    async def open(self, key_id: str, start: Start) -> HostedSession:
        if self.failed is not None:
            raise self.failed
        if self.shutting_down:
            raise ShuttingDown("the server is shutting down")
        held = sum(1 for s in self.sessions.values() if s.key_id == key_id)  # detached ones too
        if held >= self.limits.max_sessions_per_key:
            raise Overloaded(f"this key holds its maximum of {self.limits.max_sessions_per_key} sessions")
        queued = self.queued_frames_of_key(key_id)
        if queued > self.limits.max_queued_frames_per_key:
            raise Overloaded(f"this key has {queued / 100:.0f} s of audio waiting to be processed")
        while len(self.sessions) >= self.limits.max_sessions:
            # a session in its grace period holds no one's place: the one detached longest goes
            detached = [s for s in self.sessions.values() if s.detached_at is not None]
            if not detached:
                raise Overloaded(f"the server holds its maximum of {self.limits.max_sessions} sessions")
            oldest = min(detached, key=lambda s: s.detached_at or 0.0)
            await self._drop(oldest, "session expired early: the server is full")
            if self.failed is not None or self.shutting_down:  # meanwhile
                raise self.failed or ShuttingDown("the server is shutting down")
        session_id = secrets.token_urlsafe(18)
        s = HostedSession(session_id, key_id, start, self.scheduler, self.limits, self.metrics,
                          self.executor, self._ended, clock=self.clock)
        self.sessions[session_id] = s
        self.metrics.sessions.set(len(self.sessions))
        log.info("session opened", extra={"fields": {"session": short_id(session_id), "key": key_id,
                                                     "seeded": start.seed is not None}})
        return s

    def queued_frames_of_key(self, key_id: str) -> int:
        return sum(s.queued_frames() for s in self.sessions.values() if s.key_id == key_id)

    async def wait_for_room(self, s: HostedSession, audio_s: float = 0.0) -> None:
        """Return once the session and its key are within their queued-audio limits and the stream
        within its pace (`AudioPace`), then count the message's `audio_s` against the pace: a
        stream calls this before applying each message, so a client that sends faster than the
        engine processes, claims many frames in few bytes, or pushes audio much faster than real
        time waits on itself and on nobody else."""
        limits = self.limits
        s.held_back = True  # not idle meanwhile: the server holds the stream back
        try:
            while (s.queued_frames() > limits.max_queued_frames_per_session
                   or self.queued_frames_of_key(s.key_id) > limits.max_queued_frames_per_key):
                try:  # a tick normally ends sooner; the timeout only re-checks after a stall
                    await asyncio.wait_for(self.scheduler.next_tick(), timeout=1.0)
                except asyncio.TimeoutError:  # (not the builtin before Python 3.11)
                    pass
            if audio_s > 0:
                while (wait := s.pace.wait_s()) > 0:
                    step = min(wait, 1.0)
                    self.metrics.audio_paced.inc(step)
                    await asyncio.sleep(step)
                s.pace.take(audio_s)
        finally:
            s.held_back = False

    def attached_streams(self) -> int:
        """Client streams attached to a session now (the metric, read at scrape time: from any thread)."""
        return sum(1 for s in list(self.sessions.values()) if s.attachment is not None)

    def find(self, key_id: str, session_id: str) -> HostedSession:
        if self.failed is not None:
            raise self.failed
        if self.shutting_down:
            raise ShuttingDown("the server is shutting down")
        s = self.sessions.get(session_id)
        if s is None:
            raise SessionNotFound("unknown session id: the server restarted or the session expired; "
                                  "open a new session with the last seed")
        if s.key_id != key_id:
            raise NotYourSession("this session belongs to another API key")
        return s

    def _ended(self, s: HostedSession) -> None:
        """A session's last final is in its event log (End or shutdown): free its engine session
        now; the session itself stays until a stream has sent it all (`done`) or the grace
        period ends."""
        log.info("session ended", extra={"fields": {"session": short_id(s.session_id), "key": s.key_id,
                                                    "events": s.core.next_event_seq - 1}})
        t = asyncio.get_running_loop().create_task(s.release_engine())
        self._closing.add(t)
        t.add_done_callback(self._closing.discard)

    async def discard(self, s: HostedSession) -> None:
        """Drop a session: its stream closed OK after its last event, or its input broke the
        protocol (what it was fed cannot be continued)."""
        if self.sessions.get(s.session_id) is s:
            del self.sessions[s.session_id]
            self.metrics.sessions.set(len(self.sessions))
        await s.close()

    async def sweep(self, now: float) -> None:
        """Close the sessions whose grace period has run out at clock time `now`, and end the
        streams idle for longer than `idle_timeout_s` (DEADLINE_EXCEEDED), closing their sessions."""
        limits = self.limits
        for s in list(self.sessions.values()):
            if s.detached_at is not None and now - s.detached_at > limits.grace_s:
                await self._drop(s, "session expired")
            elif (idle_s := s.idle_for(now)) is not None and idle_s > limits.idle_timeout_s:
                await self._drop(s, "idle stream ended", IdleTimeout(
                    f"the stream was idle for {idle_s:.1f} s (limit {limits.idle_timeout_s:g} s): no message "
                    "while the server had nothing to do for it; the session is closed"))

    async def next_sweep(self) -> None:
        """Wait until the reaper's next sweep has ended."""
        waiter = asyncio.get_running_loop().create_future()
        self._sweep_waiters.append(waiter)
        await waiter

    async def _drop(self, s: HostedSession, why: str, reason: BaseException | None = None) -> None:
        """Take `s` out of the table and close it, its stream ending with `reason` if one is attached."""
        log.info(why, extra={"fields": {"session": short_id(s.session_id), "key": s.key_id}})
        if self.sessions.get(s.session_id) is s:
            del self.sessions[s.session_id]
            self.metrics.sessions.set(len(self.sessions))
        await s.close(reason)

    async def _reap(self) -> None:
        limits = self.limits
        while True:
            await asyncio.sleep(min(1.0, limits.grace_s / 4, limits.idle_timeout_s / 4))
            await self.sweep(self.clock())
            waiters, self._sweep_waiters = self._sweep_waiters, []
            for w in waiters:
                if not w.done():
                    w.set_result(None)

    async def finish_all(self, timeout_s: float) -> None:
        """Shutdown, first half: no new sessions; every session finalises its open segments and
        its finals go to the attached streams (waited for up to `timeout_s`)."""
        self.shutting_down = True
        sessions = list(self.sessions.values())
        for s in sessions:
            try:
                await s.close_input_for_shutdown()
            except Exception as e:  # one session's failure must not stop the others' finals
                log.warning("finalise on shutdown failed", extra={"fields": {
                    "session": short_id(s.session_id), "error": type(e).__name__}})
        deadline = time.monotonic() + timeout_s
        while any(not s.lifecycle.done or s.undelivered() for s in sessions) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)

    async def fail_all(self, error: Exception) -> None:
        """The engine failed: end every stream with `error`, drop every session, admit none."""
        self.failed = error
        for s in list(self.sessions.values()):
            if s.attachment is not None:
                s.attachment.notify(end=error)
            del self.sessions[s.session_id]
            await s.close()
        self.metrics.sessions.set(0)

    async def close(self) -> None:
        self._reaper.cancel()
        await asyncio.wait([self._reaper])
        for s in list(self.sessions.values()):
            await s.close()
        self.sessions.clear()
        if self._closing:
            await asyncio.wait(list(self._closing))
