"""Sessions as the service hosts them: ids bound to keys, order checks, the event log for replay,
attach/detach of client streams, the grace period, and the thin-client audio front end.

    SessionTable    ids -> HostedSession; admission (max sessions, per key); grace expiry; idle
                    streams; shutdown
    HostedSession   one session: what was applied (`seq`), the segment/frame order, the engine's
                    session, the transcript events not yet safe to forget, the attached stream
    Attachment      one client stream's view: which events it has been sent, an Ack due, its end

Owners: the table owns its reaper task and every session; a session owns its event pump task; a
stream handler (cloud/server.py) owns its reader task and its attachment. Each cancels and awaits
what it owns when it closes.

The event log keeps every event of a segment that is not final yet (a resumed client may not have
them) and, of final segments, a tail of `replay_tail` events behind the last one sent (those may
have been lost in flight when the connection dropped). Events produced while no stream is attached
stay until one is. A resume that asks for events no longer held gets NOT_FOUND, and recovers as
from a lost session (seed + replay). An ended session (End, shutdown) frees its engine slot at once
but stays in the table until a stream has sent its last event and closed OK, or its grace period
ends, so a client that loses the connection just before the end can still resume for the finals.

No client holds a slot by doing nothing. An attached stream that sends no message for
`idle_timeout_s` while the server owes its session no work (no message being applied or held back,
no engine pass due or in flight: frames of an open segment short of the next update wait for the
client, not for the engine) is ended with
DEADLINE_EXCEEDED and its session closed at once, as at the end of a grace period: the open
segment is discarded, not finalised (its frames are still with the client, which resumes, gets
NOT_FOUND and replays its unfinished segments into a seeded session, so no committed text is lost).
Detached sessions count against their key's session limit; when the server holds its maximum, a
new session takes the place of the one detached longest (its client recovers the same way), so
sessions in their grace period cannot lock anyone else out.

Thin clients (16 kHz Audio): the front end's checkpoints (edge/checkpoint.py) ride on the seeds of
final events, each the latest taken before the next segment began; a session seeded with one
resumes the front end there, so a replacement segments the client's replayed audio exactly as the
lost session did.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from harken.cloud import wire
from harken.cloud.audio_front_end import AudioFrontEnd
from harken.cloud.errors import MalformedMessage, OutOfOrder, SessionNotFound, ShuttingDown, Superseded
from harken.cloud.metrics import ServerMetrics
from harken.edge.checkpoint import FrontEndCheckpoint
from harken.shared.features_spec import SAMPLE_RATE
from harken.shared.protocol import (Audio, ClientMessage, End, FeaturePacket, Features, Finalize, KeepAlive,
                                    SessionSeed, Start, Transcript)
from harken.shared.transcript import TranscriptEvent

if TYPE_CHECKING:
    from harken.cloud.commit import CommitPolicy

log = logging.getLogger("harken.server")

SHUTDOWN_MESSAGE = "the server is shutting down: open segments were finalised"
ACK_EVERY = 5  # messages between Acks (plus one on every segment end and every final event)


@dataclass(frozen=True)
class SessionLimits:
    max_sessions: int = 256
    max_sessions_per_key: int = 64
    grace_s: float = 60.0
    # an attached stream that sends nothing this long while the engine owes it no work is ended
    # (DEADLINE_EXCEEDED) and its session closed
    idle_timeout_s: float = 30.0
    replay_tail: int = 512  # events of final segments kept behind the last one sent
    max_events_held: int = 20_000  # hard cap on the event log of one session
    # Audio received but not yet encoded (feature frames, 100 a second). Past its session's or its
    # key's limit a stream's next message waits (its reader stops reading, so gRPC's flow control
    # holds the client) until the engine has caught up; past the key's limit the key gets no new
    # session. The engine's own `max_queued_frames` bounds them all: a key's limit is kept below
    # it, so one client cannot make the server refuse everyone else.
    max_queued_frames_per_session: int = 100 * 60
    max_queued_frames_per_key: int = 100 * 60 * 4
    policy: CommitPolicy | None = None  # the sessions' commit policy (None: the engine's default)


@dataclass
class Attachment:
    """One client stream attached to a session. The stream's writer waits on `wake`, then sends
    the events after `sent_event_seq`, an Ack when `ack_due`, and ends when `end` is set
    (None = go on; an exception = fail with it; `CLOSED_OK` = close with OK)."""

    sent_event_seq: int
    quiet_since: float  # clock time since which the stream has been idle (see `HostedSession.idle_for`)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    ack_due: bool = False
    end: BaseException | str | None = None  # str: CLOSED_OK
    reader: asyncio.Task | None = None  # owned by the stream handler; cancelled by a newer attach


CLOSED_OK = "closed-ok"


class Lifecycle(enum.Enum):
    """Where a hosted session is in its life. Input is applied only while ACTIVE.

        ACTIVE ──End / half-close / shutdown──> DRAINING ──every final in──> ENDED
          │                                        │
          └──────── closed (grace expiry, a protocol error, the engine failing) ──> CLOSED
        any ──the engine took this session out (its own fault)──> FAILED

    ENDED and FAILED sessions stay in the table until a stream has taken every event (or the grace
    period ends), so a client that lost its connection at the very end can still resume for them.
    """

    ACTIVE = "active"
    DRAINING = "draining"  # no more input; finals of the open segments pending
    ENDED = "ended"  # every final is in the event log
    FAILED = "failed"  # `failure` says why
    CLOSED = "closed"  # dropped before its end: no engine session, no input

    @property
    def done(self) -> bool:
        """No more events will be produced."""
        return self in (Lifecycle.ENDED, Lifecycle.FAILED, Lifecycle.CLOSED)


@dataclass
class _FrameOrder:
    """The frame timeline as far as applied: segments in order, frames contiguous inside one."""

    open_segment: int | None = None
    next_frame: int = 0
    last_segment_id: int = -1
    last_segment_first_frame: int = 0
    closed_by_finalize: int | None = None  # audio path: VAD frames of this segment are dropped
    seeded_final: int = -1  # segments up to this one were final before the session began (seed)

    def check(self, f: FeaturePacket) -> bool:
        """Raises OutOfOrder; False for frames of a segment the seed says is final (a replacement
        session ignores them, as the engine does: their text is with the client)."""
        if f.frame_count == 0 and not f.segment_start and not f.segment_end:
            return True  # keep-alive
        if self.open_segment is None and f.segment_id <= self.seeded_final:
            return False
        if self.open_segment is None:
            if not f.segment_start:
                raise OutOfOrder(f"features for segment {f.segment_id} without segment_start: no segment is open")
            if f.segment_id <= self.last_segment_id:
                raise OutOfOrder(f"segment id {f.segment_id} does not increase (last was {self.last_segment_id})")
            if f.first_frame < self.last_segment_first_frame:
                raise OutOfOrder(f"segment {f.segment_id} starts at frame {f.first_frame}, before the "
                                 f"previous segment ({self.last_segment_first_frame})")
            return True
        if f.segment_start or f.segment_id != self.open_segment:
            raise OutOfOrder(f"segment {self.open_segment} is still open; got frames of segment "
                             f"{f.segment_id}{' with segment_start' if f.segment_start else ''}")
        if f.first_frame != self.next_frame:
            raise OutOfOrder(f"segment {f.segment_id}: frames not contiguous (expected first_frame "
                             f"{self.next_frame}, got {f.first_frame})")
        return True

    def apply(self, f: FeaturePacket) -> None:
        if f.frame_count == 0 and not f.segment_start and not f.segment_end:
            return
        if f.segment_start:
            self.open_segment = f.segment_id
            self.last_segment_id = f.segment_id
            self.last_segment_first_frame = f.first_frame
        self.next_frame = f.first_frame + f.frame_count
        if f.segment_end:
            self.open_segment = None


class HostedSession:
    """One session on this server. Created by `SessionTable`; driven by stream handlers."""

    def __init__(self, session_id: str, key_id: str, start: Start, scheduler,
                 limits: SessionLimits, metrics: ServerMetrics, executor: Executor,
                 on_ended: Callable[["HostedSession"], None], clock: Callable[[], float] = time.monotonic):
        """Opens the engine's session (EngineOverloaded / StreamInputError when it cannot).
        `clock` times the grace period and idleness (the table's; tests pass a fake one)."""
        from harken.cloud.session import ResumeState, SessionOptions

        self.session_id = session_id  # also the engine's id for it
        self.key_id = key_id
        self.start = start
        self.scheduler = scheduler
        resume = None
        if start.seed is not None:
            resume = ResumeState(start.seed.running_max_log10, start.seed.context_tail,
                                 start.seed.next_segment_id)
        policy = {} if limits.policy is None else {"policy": limits.policy}
        options = SessionOptions(language=start.language or None, context=start.context, resume=resume, **policy)
        _, self._engine_events = scheduler.open_session(options, session_id)
        self.limits = limits
        self.metrics = metrics
        self.executor = executor
        self._on_ended = on_ended
        self._clock = clock
        self.applied_seq = 0
        self.last_final_segment = (start.seed.next_segment_id - 1) if start.seed else -1
        self.input_kind: str | None = None  # "features" or "audio", fixed by the first one
        self.order = _FrameOrder(last_segment_id=self.last_final_segment, seeded_final=self.last_final_segment)
        self.audio: AudioFrontEnd | None = None
        # thin clients: the front end's latest checkpoint per next segment id, for the seeds
        self._checkpoints: dict[int, FrontEndCheckpoint] = {}
        self._cut_by_end: set[int] = set()  # segments the front end's flush ended (End, shutdown)
        self.events: deque[Transcript] = deque()
        self.next_event_seq = 1
        self.delivered_event_seq = 0  # highest event_seq handed to some stream
        self.attachment: Attachment | None = None
        self.detached_at: float | None = clock()
        self.lifecycle = Lifecycle.ACTIVE
        self.ended_by_client = False  # DRAINING / ENDED because the client said End (not shutdown)
        self.failure: BaseException | None = None  # FAILED: the engine took the session out with this
        self._awaiting_final: set[int] = set()  # segments fed frames whose final has not come
        self._apply_lock = asyncio.Lock()
        self.held_back = False  # a received message waits for the queued-audio limits (`wait_for_room`)
        self._msgs_since_ack = 0
        self._arrivals: deque[tuple[int, float]] = deque()  # (frame end, arrival time) for latency
        self._segment_started_at: dict[int, float] = {}
        self._segment_ended_at: dict[int, float] = {}
        self._first_event_seen: set[int] = set()
        self._engine_released = False
        self._pump = asyncio.get_running_loop().create_task(self._pump_events(),
                                                             name=f"events-{session_id[:6]}")

    # ---- streams ---------------------------------------------------------------------------------

    async def attach(self, last_event_seq: int) -> Attachment:
        """Attach a new stream; an attached older one is detached first (its reader cancelled and
        awaited, so nothing it was applying is half done). SessionNotFound when events after
        `last_event_seq` are no longer held: the client must recover as from a lost session."""
        if self.events and last_event_seq + 1 < self.events[0].event_seq:
            raise SessionNotFound(f"events after {last_event_seq} are no longer held; open a new session "
                                  "with the last seed")
        if not self.events and last_event_seq < self.next_event_seq - 1:
            raise SessionNotFound(f"events after {last_event_seq} are no longer held; open a new session "
                                  "with the last seed")
        old = self.attachment
        if old is not None:
            old.end = Superseded("a newer stream attached to this session")
            old.wake.set()
            if old.reader is not None:
                old.reader.cancel()
                await asyncio.wait([old.reader])
        async with self._apply_lock:  # a message being applied finishes first
            if self.lifecycle is Lifecycle.CLOSED:  # dropped meanwhile (grace expiry, given way)
                raise SessionNotFound("the session was closed: open a new session with the last seed")
            a = Attachment(sent_event_seq=min(last_event_seq, self.next_event_seq - 1),
                           quiet_since=self._clock())
            self.attachment = a
            self.detached_at = None
            if self.lifecycle in (Lifecycle.ENDED, Lifecycle.FAILED):
                a.end = CLOSED_OK if self.failure is None else self.failure
            a.wake.set()  # replay what the client has not seen
            return a

    def detach(self, a: Attachment) -> None:
        if self.attachment is a:
            self.attachment = None
            self.detached_at = self._clock()

    def heard(self, a: Attachment) -> None:
        """The stream `a` received a message from its client: it is not idle."""
        a.quiet_since = self._clock()

    def idle_for(self, now: float) -> float | None:
        """How long the attached stream has been idle at clock time `now`: no message from its
        client while the session was ACTIVE and the server had nothing of it to do (no message
        being applied or held back by the queued-audio limits, no pass due or in flight in the
        engine). None while it is not idle (its idle time then starts again from `now`), or when
        no stream is attached."""
        a = self.attachment
        if a is None:
            return None
        if (self.lifecycle is not Lifecycle.ACTIVE or self._apply_lock.locked() or self.held_back
                or (not self._engine_released and self.scheduler.engine.working_on(self.session_id))):
            a.quiet_since = max(a.quiet_since, now)
            return None
        return max(0.0, now - a.quiet_since)

    def queued_frames(self) -> int:
        """Frames this session has given the engine that it has not encoded yet."""
        if self._engine_released:
            return 0
        return self.scheduler.engine.queued_frames(self.session_id)

    def events_after(self, event_seq: int) -> list[Transcript]:
        """Held events with a higher event_seq, in order (what a stream sends next)."""
        if not self.events or self.events[-1].event_seq <= event_seq:
            return []
        start = max(0, event_seq + 1 - self.events[0].event_seq)
        return [self.events[i] for i in range(start, len(self.events))]

    def undelivered(self) -> bool:
        """An attached stream has events still to send."""
        a = self.attachment
        return a is not None and a.sent_event_seq < self.next_event_seq - 1

    def sent(self, a: Attachment, event_seq: int) -> None:
        a.sent_event_seq = event_seq
        self.delivered_event_seq = max(self.delivered_event_seq, event_seq)
        self._trim_events()

    # ---- input -----------------------------------------------------------------------------------

    async def apply(self, item: ClientMessage) -> None:
        """Apply one client message (after `start`). Bad input raises (StreamInputError,
        StreamOrderError, CodecError); what the session has applied changes only once a message
        is known good."""
        if isinstance(item, KeepAlive):
            return  # (the stream's reader takes these; nothing to apply)
        async with self._apply_lock:
            if isinstance(item, Start):
                raise OutOfOrder("start may only be the first message of a stream")
            if self.lifecycle is Lifecycle.CLOSED:
                raise SessionNotFound("the session was closed: open a new session with the last seed")
            if self.lifecycle is not Lifecycle.ACTIVE:
                if not self.ended_by_client:  # a live client still sending when the server stops
                    raise ShuttingDown(SHUTDOWN_MESSAGE)
                # A client that resumes after its connection dropped between End and the last
                # finals repeats End and may resend applied messages: both are replays, not errors.
                if isinstance(item, End) or getattr(item, "seq", 0) <= self.applied_seq:
                    return
                raise OutOfOrder("the session has ended: no input after end")
            if isinstance(item, Finalize):
                self._finalize()
                return
            if isinstance(item, End):
                await self._end()
                return
            if item.seq <= self.applied_seq:
                return  # a duplicate resent after a reconnect: already applied
            if item.seq != self.applied_seq + 1:
                raise OutOfOrder(f"seq {item.seq} leaves a gap: the last applied was {self.applied_seq}")
            kind = "features" if isinstance(item, Features) else "audio"
            if self.input_kind not in (None, kind):
                raise OutOfOrder(f"{kind} in a session that receives {self.input_kind}: do not mix them")
            self.input_kind = kind
            if isinstance(item, Features):
                await self._apply_features(item.packet)
                self.metrics.bytes_in.labels("features").inc(len(item.packet.payload))
            else:
                await self._apply_audio(item)
                self.metrics.bytes_in.labels("audio").inc(len(item.pcm16))
            self.metrics.messages_in.labels(kind).inc()
            self.applied_seq = item.seq
            self._msgs_since_ack += 1
            if self._msgs_since_ack >= ACK_EVERY or (isinstance(item, Features) and item.packet.segment_end):
                self._ack()

    async def _apply_features(self, f: FeaturePacket) -> None:
        if not self.order.check(f):
            return
        frames = await _run(self.executor, wire.decode_features, f)
        self._feed(f, frames)

    async def _apply_audio(self, a: Audio) -> None:
        if self.audio is None:
            seed = self.start.seed
            resume = wire.front_end_checkpoint(seed)
            if resume is not None and a.sample_rate != SAMPLE_RATE:
                raise MalformedMessage(f"start.seed.front_end_state goes on with 16 kHz audio, not {a.sample_rate} Hz")
            seed_max = seed.running_max_log10 if seed is not None else float("-inf")
            self.audio = await _run(self.executor, AudioFrontEnd, a.sample_rate, seed_max,
                                    self.order.last_segment_id + 1, resume)
            self._keep_checkpoints(self.audio.checkpoints_at_start)
        elif a.sample_rate != self.audio.sample_rate:
            raise MalformedMessage(f"audio.sample_rate changed from {self.audio.sample_rate} to {a.sample_rate}")
        packets, checkpoints = await _run(self.executor, self.audio.push, a.samples())
        self._keep_checkpoints(checkpoints)
        await self._feed_packets(packets)

    def _keep_checkpoints(self, checkpoints: list[FrontEndCheckpoint]) -> None:
        for c in checkpoints:
            self._checkpoints[c.next_segment_id] = c  # the latest of a gap replays the least

    def _front_end_after(self, segment_id: int) -> FrontEndCheckpoint | None:
        """The checkpoint a replacement session resumes from once `segment_id` is final: the
        latest taken before any later segment began (replaying a final segment again costs audio,
        not exactness: the replacement ignores its frames). None when the stream's end cut the
        segment short: the rest of its speech belongs to no segment yet, and the client replays it
        from the final's end into a fresh front end."""
        if segment_id in self._cut_by_end:
            return None
        usable = [k for k in self._checkpoints if k <= segment_id + 1]
        if not usable:
            return None
        best = max(usable)
        for k in [k for k in self._checkpoints if k < best]:  # finals come in order: never needed again
            del self._checkpoints[k]
        return self._checkpoints[best]

    async def _feed_packets(self, packets: list[FeaturePacket]) -> None:
        """Frames the server's own front end made: the same path as a client's Features."""
        for p in packets:
            if p.segment_id > wire.MAX_SEGMENT_ID:  # numbered on from a seed near the end of the range
                raise MalformedMessage(f"no segment ids left: a segment would be number {p.segment_id} "
                                       f"(at most {wire.MAX_SEGMENT_ID}); start a session without this seed")
            if self.order.closed_by_finalize == p.segment_id:
                if p.segment_end:
                    self.order.closed_by_finalize = None
                continue
            frames = await _run(self.executor, wire.decode_features, p)
            if self.order.check(p):
                self._feed(p, frames)

    def _feed(self, f: FeaturePacket, frames: np.ndarray) -> None:
        now = time.monotonic()
        if f.segment_start:
            self._segment_started_at[f.segment_id] = now
        if f.frame_count:
            self._arrivals.append((f.first_frame + f.frame_count, now))
            while len(self._arrivals) > 512:
                self._arrivals.popleft()
        if f.segment_end:
            self._segment_ended_at[f.segment_id] = now
        if f.frame_count or f.segment_start or f.segment_end:
            self.scheduler.ingest(self.session_id, f.segment_id, f.first_frame, frames, f.segment_start,
                                  f.segment_end, f.running_max_log10)
        if f.frame_count:
            self._awaiting_final.add(f.segment_id)
        self.order.apply(f)

    def _finalize(self) -> None:
        seg = self.order.open_segment
        if seg is None:
            return
        self._segment_ended_at[seg] = time.monotonic()
        self.scheduler.finalize(self.session_id)
        if self.input_kind == "audio":
            self.order.closed_by_finalize = seg
        self.order.open_segment = None

    async def _end(self, by_client: bool = True) -> None:
        """No more input: flush the audio front end, close the open segment; the session has ended
        once the final of every segment is in."""
        if self.audio is not None:
            packets = await _run(self.executor, self.audio.flush)
            self._cut_by_end.update(p.segment_id for p in packets if p.segment_end)
            await self._feed_packets(packets)
        self._finalize()
        self.lifecycle = Lifecycle.DRAINING
        self.ended_by_client = by_client
        self._check_ended()

    async def close_input_for_shutdown(self) -> None:
        async with self._apply_lock:
            if self.lifecycle is Lifecycle.ACTIVE:
                await self._end(by_client=False)

    def _ack(self) -> None:
        self._msgs_since_ack = 0
        if self.attachment is not None:
            self.attachment.ack_due = True
            self.attachment.wake.set()

    # ---- output ----------------------------------------------------------------------------------

    async def _pump_events(self) -> None:
        """The engine's events -> the event log (with event_seq) -> the attached stream. An
        exception instead of an event: the engine took this session out (its own processing
        raised; the other sessions go on), and the session fails with it."""
        while not self.lifecycle.done:
            item = await self._engine_events.get()
            if isinstance(item, BaseException):
                await self._fail(item)
                return
            self._record(item)
            self._check_ended()

    async def _fail(self, error: BaseException) -> None:
        """End the session with `error` (INTERNAL unless it is one of harken's own errors): the
        attached stream, and any stream that attaches later, gets it; the engine slot is freed."""
        self.failure = error
        self.lifecycle = Lifecycle.FAILED
        if self.attachment is not None:
            self.attachment.end = error
            self.attachment.wake.set()
        await self.release_engine()
        self._on_ended(self)

    def _check_ended(self) -> None:
        if self.lifecycle is not Lifecycle.DRAINING or self._awaiting_final:
            return
        self.lifecycle = Lifecycle.ENDED
        if self.attachment is not None:
            self.attachment.end = CLOSED_OK if self.ended_by_client else ShuttingDown(SHUTDOWN_MESSAGE)
            self.attachment.wake.set()
        self._on_ended(self)

    def _record(self, ev) -> None:
        now = time.monotonic()
        event = TranscriptEvent(segment_id=ev.segment_id, committed_delta=ev.committed_delta, partial=ev.partial,
                                stability=ev.stability, start_s=ev.start_s, end_s=ev.end_s,
                                language=ev.language, is_final=ev.is_final)
        out = Transcript(event, event_seq=self.next_event_seq,
                         seed=_seed(ev.resume, self._front_end_after(ev.segment_id))
                         if ev.is_final and ev.resume is not None else None)
        self.next_event_seq += 1
        self.events.append(out)
        self.metrics.events_out.inc()
        if ev.segment_id not in self._first_event_seen:
            self._first_event_seen.add(ev.segment_id)
            t0 = self._segment_started_at.pop(ev.segment_id, None)
            if t0 is not None:
                self.metrics.first_partial.observe(now - t0)
        if ev.is_final:
            self._awaiting_final.discard(ev.segment_id)
            self.last_final_segment = max(self.last_final_segment, ev.segment_id)
            t_end = self._segment_ended_at.pop(ev.segment_id, None)
            if t_end is not None:
                self.metrics.final_latency.observe(now - t_end)
            self._segment_started_at.pop(ev.segment_id, None)
            self._first_event_seen.discard(ev.segment_id)
        else:
            arrived = self._arrival_of(round(ev.end_s * 100))
            if arrived is not None:
                self.metrics.update_latency.observe(now - arrived)
        self._trim_events()
        if self.attachment is not None:
            if ev.is_final:
                self.attachment.ack_due = True
            self.attachment.wake.set()

    def _arrival_of(self, frame_end: int) -> float | None:
        for end, t in self._arrivals:
            if end >= frame_end:
                return t
        return None

    def _trim_events(self) -> None:
        keep_after = self.delivered_event_seq - self.limits.replay_tail
        while self.events and (
                (self.events[0].event_seq <= keep_after and self.events[0].event.segment_id <= self.last_final_segment)
                or len(self.events) > self.limits.max_events_held):
            self.events.popleft()

    async def release_engine(self) -> None:
        """Stop the event pump and free the engine's session (its KV slot). Idempotent. The event
        log stays, so a client that lost the last events in flight can still resume for them."""
        if self._engine_released:
            return
        self._engine_released = True
        if not self.lifecycle.done:
            self.lifecycle = Lifecycle.CLOSED
        if self._pump is not asyncio.current_task():
            self._pump.cancel()
            await asyncio.wait([self._pump])
        self.scheduler.close_session(self.session_id)

    async def close(self, reason: BaseException | None = None) -> None:
        """End the attached stream (if any; with `reason`, by default UNAVAILABLE) and release the
        engine's session. Idempotent."""
        if self.attachment is not None and self.attachment.end is None:
            self.attachment.end = reason if reason is not None else ShuttingDown("the session was closed")
            self.attachment.wake.set()
        await self.release_engine()


def _seed(r, front_end: FrontEndCheckpoint | None) -> SessionSeed:
    if front_end is None:
        return SessionSeed(r.running_max_log10, r.context_tail, r.next_segment_id)
    return SessionSeed(r.running_max_log10, r.context_tail, r.next_segment_id,
                       front_end_state=front_end.serialize(), audio_sample=front_end.replay_from)


async def _run(executor: Executor, fn, *args):
    """CPU work (codec decoding, the thin clients' front end) off the event loop. The stream's
    reader shields the whole `apply` from cancellation, so this always runs to its end."""
    return await asyncio.get_running_loop().run_in_executor(executor, fn, *args)


def short_id(session_id: str) -> str:
    """Enough of an id to follow one session through the logs."""
    return session_id[:6]
