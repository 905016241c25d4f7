"""Sessions as the service hosts them: the asyncio driver of each session's sans-IO core.

    SessionTable    ids -> HostedSession; admission (max sessions, per key); grace expiry; idle
                    streams; shutdown (cloud/hosting/session_table.py)
    HostedSession   one session: drives its `ServerSession` (cloud/hosting/server_session.py: the order
                    checks, the event log, the lifecycle, what each stream is owed), decodes
                    payloads and runs the thin clients' front end in the executor, hands frames to
                    the engine and pumps the engine's events in
    Attachment      one client stream's view of its session (cloud/hosting/server_session.py)

Owners: the table owns its reaper task and every session; a session owns its event pump task; a
stream handler (cloud/hosting/stream_handler.py) owns its reader task and its attachment. Each cancels and awaits
what it owns when it closes. One message is applied at a time (`_apply_lock`): what the session
has applied changes only once a message is known good, and a newer stream attaches only between
two messages.

No client holds a slot by doing nothing. An attached stream that sends no message for
`idle_timeout_s` while the server owes its session no work (no message being applied or held back,
no engine pass due or in flight: frames of an open segment short of the next update wait for the
client, not for the engine) is ended with DEADLINE_EXCEEDED and its session closed at once, as at
the end of a grace period: the open segment is discarded, not finalised (its frames are still with
the client, which resumes, gets NOT_FOUND and replays its unfinished segments into a seeded
session, so no committed text is lost). Detached sessions count against their key's session limit;
when the server holds its maximum, a new session takes the place of the one detached longest (its
client recovers the same way), so sessions in their grace period cannot lock anyone else out.
An ended session (End, shutdown) frees its engine slot at once but stays in the table until a
stream has sent its last event and closed OK, or its grace period ends, so a client that loses the
connection just before the end can still resume for the finals.

Word timings (a session that asked, `Start.word_timings`, on a server with an aligner): the session
keeps each segment's frames as the engine got them and its committed text (`SegmentTap`) until the
segment's final event, then hands them to the scheduler's aligner (`Scheduler.align`); the words'
times come back on the engine's event queue and go into the event log after that final.

Thin clients (16 kHz Audio): the front end's checkpoints (shared/front_end_checkpoint.py) ride on the seeds of
final events, each the latest taken before the next segment began; a session seeded with one
resumes the front end there, so a replacement segments the client's replayed audio exactly as the
lost session did.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import Executor
from typing import TYPE_CHECKING

import numpy as np

from ...shared import wire
from .audio_front_end import ThinClientFrontEnd
from ..base.errors import ShuttingDown
from ..base.metrics import ServerMetrics
from .server_session import Attachment, AudioPace, ServerLifecycle, ServerSession, SessionLimits
from ...shared.protocol import (Audio, ClientMessage, Configure, End, FeaturePacket, Features, Finalize,
                                    KeepAlive, LoggedEvent, Start, model_context)
from ..inference.decoder_stream import SessionOptions
from ..inference.diarization import SegmentFrames, SessionDiarizer, encoder_available, session_diarizer
from ..inference.word_timings import SegmentTap
from ..inference.word_timings import SegmentWords, segment_language

log = logging.getLogger("harken.server")

if TYPE_CHECKING:
    from ..inference.scheduler import Scheduler


class HostedSession:
    """One session on this server. Created by `SessionTable`; driven by stream handlers."""

    def __init__(self, session_id: str, key_id: str, start: Start, scheduler: Scheduler,
                 limits: SessionLimits, metrics: ServerMetrics, executor: Executor,
                 on_ended: Callable[["HostedSession"], None], clock: Callable[[], float] = time.monotonic):
        """Opens the engine's session (Overloaded / StreamInputError when it cannot).
        `clock` times the grace period and idleness (the table's; tests pass a fake one)."""

        timings = start.word_timings and scheduler.aligner is not None
        self.core = ServerSession(session_id, key_id, start, limits, clock(), word_timings=timings)
        # each segment's frames and text until its final, for the aligner (sessions that asked only)
        self._tap: SegmentTap | None = SegmentTap() if timings else None
        # speaker labels (sessions that asked, on a server with the speaker encoder): each segment's
        # frames until its final; the diarizer (its encoder loaded by the first such session) is made
        # at the first final, off the event loop
        self.diarize = start.diarize and encoder_available()
        self._speaker_frames: SegmentFrames | None = SegmentFrames() if self.diarize else None
        self._diarizer: SessionDiarizer | None = None
        policy = {} if limits.policy is None else {"policy": limits.policy}
        options = SessionOptions(language=start.language or None, context=start.model_context, resume=start.seed,
                                 **policy)
        _, self._engine_events = scheduler.open_session(options, session_id)
        self.scheduler = scheduler
        self.context, self.keyterms = start.context, start.keyterms  # what Configure changes
        self.metrics = metrics
        self.executor = executor
        self._on_ended = on_ended
        self._clock = clock
        self.audio: ThinClientFrontEnd | None = None
        self._apply_lock = asyncio.Lock()
        self.held_back = False  # a received message waits for the queued-audio limits (`wait_for_room`)
        # the stream's pace (wall-clock, whatever `clock` is: it paces real senders)
        self.pace = AudioPace(limits.max_audio_speed, limits.audio_burst_s, time.monotonic)
        self._engine_released = False
        self._reported_ended = False
        self._pump = asyncio.get_running_loop().create_task(self._pump_events(),
                                                             name=f"events-{session_id[:6]}")

    # what the table and the stream handlers read of the core
    @property
    def session_id(self) -> str:
        return self.core.session_id

    @property
    def key_id(self) -> str:
        return self.core.key_id

    @property
    def applied_seq(self) -> int:
        return self.core.applied_seq

    @property
    def last_final_segment(self) -> int:
        return self.core.last_final_segment

    @property
    def lifecycle(self) -> ServerLifecycle:
        return self.core.lifecycle

    @property
    def attachment(self) -> Attachment | None:
        return self.core.attachment

    @property
    def detached_at(self) -> float | None:
        return self.core.detached_at

    # ---- streams ---------------------------------------------------------------------------------

    async def attach(self, last_event_seq: int) -> Attachment:
        """Attach a new stream; an attached older one is detached first (its reader cancelled and
        awaited, so nothing it was applying is half done). SessionNotFound when events after
        `last_event_seq` are no longer held: the client must recover as from a lost session."""
        self.core.check_resumable(last_event_seq)
        old = self.core.supersede()
        if old is not None and old.reader is not None:
            old.reader.cancel()
            await asyncio.wait([old.reader])
        async with self._apply_lock:  # a message being applied finishes first
            return self.core.attach(last_event_seq, self._clock(), asyncio.Event())

    def detach(self, a: Attachment) -> None:
        self.core.detach(a, self._clock())

    def heard(self, a: Attachment) -> None:
        """The stream `a` received a message from its client: it is not idle."""
        self.core.heard(a, self._clock())

    def idle_for(self, now: float) -> float | None:
        """`ServerSession.idle_for`: busy while a message is being applied or held back by the
        queued-audio limits, or the engine has a pass of this session due or in flight."""
        busy = (self._apply_lock.locked() or self.held_back
                or (not self._engine_released and self.scheduler.engine.working_on(self.session_id)))
        return self.core.idle_for(now, busy)

    def queued_frames(self) -> int:
        """Frames this session has given the engine that it has not encoded yet."""
        if self._engine_released:
            return 0
        return self.scheduler.engine.queued_frames(self.session_id)

    @property
    def turn_events(self) -> bool:
        """This session gets turn events (it asked: `Start.turn_events`)."""
        return self.core.start.turn_events

    @property
    def speaker_labels(self) -> bool:
        """This session gets speaker labels (it asked, and the server has the speaker encoder)."""
        return self.diarize

    @property
    def word_timings(self) -> bool:
        """This session gets word timings (it asked, and the server has an aligner)."""
        return self.core.word_timings

    def events_after(self, event_seq: int) -> list[LoggedEvent]:
        return self.core.events_after(event_seq)

    def undelivered(self) -> bool:
        return self.core.undelivered()

    def sent(self, a: Attachment, event_seq: int) -> None:
        self.core.sent(a, event_seq)

    # ---- input -----------------------------------------------------------------------------------

    async def apply(self, msg: ClientMessage) -> None:
        """Apply one client message (after `start`): one `ServerSession.receive`, then the work it
        names. Bad input raises (StreamInputError, OutOfOrder, CodecError); a message that breaks
        the protocol changes nothing, one whose payload fails to decode drops the session."""
        if isinstance(msg, KeepAlive):
            return  # (the stream's reader takes these; nothing to apply)
        async with self._apply_lock:
            todo = self.core.receive(msg, time.monotonic())
            m = todo.message
            if m is None:
                return
            if isinstance(m, Features):
                if todo.feed is not None:
                    self._feed(todo.feed, await _run(self.executor, wire.decode_features, todo.feed))
                self.metrics.bytes_in.labels("features").inc(len(m.packet.payload))
                self.metrics.messages_in.labels("features").inc()
            elif isinstance(m, Audio):
                await self._apply_audio(m)
                self.metrics.bytes_in.labels("audio").inc(len(m.pcm16))
                self.metrics.messages_in.labels("audio").inc()
            elif isinstance(m, Finalize):
                if todo.front_end:
                    await self._finalize_front_end()
                    self.core.finalized()
                elif todo.finalize is not None:
                    self.scheduler.finalize(self.session_id)
            elif isinstance(m, End):
                if todo.front_end:
                    await self._end(by_client=True)
                else:
                    if todo.finalize is not None:
                        self.scheduler.finalize(self.session_id)
                    self._report_if_ended()
            else:
                assert isinstance(m, Configure)
                self._configure(m)

    async def _apply_audio(self, a: Audio) -> None:
        if self.audio is None:
            seed = self.core.start.seed
            seed_max = seed.running_max_log10 if seed is not None else float("-inf")
            first_id = self.core.order.last_segment_id + 1
            # (the seed's checkpoint is parsed with the front end's start, off the event loop)
            self.audio = await _run(self.executor, lambda: ThinClientFrontEnd(a.sample_rate, seed_max, first_id,
                                                                         wire.front_end_checkpoint(seed)))
            self.core.front_end_checkpoints(self.audio.checkpoints_at_start)
        front_end = self.audio
        packets, checkpoints = await _run(self.executor, lambda: front_end.push(a.samples()))
        self.core.front_end_checkpoints(checkpoints)
        await self._feed_front_end(packets)

    async def _feed_front_end(self, packets: list[FeaturePacket]) -> None:
        """Packets the server's own front end made: the same path as a client's Features."""
        for p in self.core.front_end_output(packets, time.monotonic()):
            self._feed(p, await _run(self.executor, wire.decode_features, p))

    def _feed(self, p: FeaturePacket, frames: np.ndarray) -> None:
        """Frames of `p` (taken by the core) -> the engine."""
        n = self.scheduler.ingest(self.session_id, p.segment_id, p.first_frame, frames, p.segment_start,
                                  p.segment_end, p.running_max_log10)
        if self._tap is not None and n:  # what the engine applied: a resent overlap is not kept twice
            self._tap.add_frames(p.segment_id, frames[:, frames.shape[1] - n:])
        if self._speaker_frames is not None and n:
            self._speaker_frames.add(p.segment_id, frames[:, frames.shape[1] - n:])

    def _configure(self, c: Configure) -> None:
        """The client's Configure: the model's context from the next audio item on."""
        if c.context is not None:
            self.context = c.context
        self.keyterms = c.keyterms
        self.scheduler.configure(self.session_id, model_context(self.context, self.keyterms))

    async def _finalize_front_end(self) -> None:
        """A thin client's Finalize: its front end cuts its open segment at the audio taken so far
        (the rest of the speech is its next segment). (A feature client's open segment ends at the
        frames received, in `receive`: its later frames of that segment are out of order; a
        feature client cuts its own segments, `FeaturePacket.finalized`.)"""
        if self.audio is not None:
            front_end = self.audio
            await self._feed_front_end(await _run(self.executor, front_end.finalize))

    async def _end(self, by_client: bool) -> None:
        """No more input: flush the audio front end, close the open segment; the session has ended
        once the final of every segment is in."""
        if self.audio is not None:
            packets = await _run(self.executor, self.audio.flush)
            self.core.cut_by_end([p.segment_id for p in packets if p.segment_end])
            await self._feed_front_end(packets)
        if self.core.end_input(time.monotonic(), by_client) is not None:
            self.scheduler.finalize(self.session_id)
        self._report_if_ended()

    async def close_input_for_shutdown(self) -> None:
        async with self._apply_lock:
            if self.core.lifecycle is ServerLifecycle.ACTIVE:
                await self._end(by_client=False)

    # ---- output ----------------------------------------------------------------------------------

    async def _pump_events(self) -> None:
        """The engine's events -> the core's event log (with event_seq) -> the attached stream. An
        exception instead of an event: the engine took this session out (its own processing
        raised; the other sessions go on), and the session fails with it: the attached stream,
        and any stream that attaches later, gets it; the engine slot is freed. With word timings,
        a final event sends its segment to the aligner, whose `SegmentWords` come on the same queue."""

        while not self.core.lifecycle.done:
            item = await self._engine_events.get()
            if isinstance(item, BaseException):
                self.core.fail(item)
                await self.release_engine()
                self._on_ended(self)
                return
            if isinstance(item, SegmentWords):
                self.core.record_timings(item.shared())
                self.metrics.events_out.inc()
                self._report_if_ended()
                continue
            speaker, relabels = "", []
            if self._speaker_frames is not None and item.is_final:
                frames = self._speaker_frames.take(item.segment_id)
                try:
                    speaker, relabels = await _run(self.executor, self._label, item.segment_id, frames,
                                                   item.start_s, item.end_s)
                except Exception as e:  # the labels fail, not the session: its text goes on unlabelled
                    log.error("speaker labels failed; the session goes on without them", exc_info=e,
                              extra={"fields": {"session": self.session_id}})
                    self._speaker_frames = None
            _, latency = self.core.record(item, item.resume, time.monotonic(), speaker)
            self.core.record_relabels(relabels)
            if self._tap is not None and (final := self._tap.on_event(item)) is not None:
                features, text = final
                self.scheduler.align(self.session_id, item.segment_id, features, text, item.start_s,
                                     segment_language(item.language, self.core.start.language))
            self.metrics.events_out.inc()
            if latency.first_partial_s is not None:
                self.metrics.first_partial.observe(latency.first_partial_s)
            if latency.final_s is not None:
                self.metrics.final_latency.observe(latency.final_s)
            if latency.update_s is not None:
                self.metrics.update_latency.observe(latency.update_s)
            self._report_if_ended()

    def _label(self, segment_id: int, frames, start_s: float, end_s: float):
        """A final segment's speaker and the relabels it decided (in the executor: the encoder's pass)."""
        if self._diarizer is None:
            self._diarizer = session_diarizer()
        return self._diarizer.label(segment_id, frames, start_s, end_s)

    def _report_if_ended(self) -> None:
        if self.core.lifecycle is ServerLifecycle.ENDED and not self._reported_ended:
            self._reported_ended = True
            self._on_ended(self)

    async def release_engine(self) -> None:
        """Stop the event pump and free the engine's session (its KV slot). Idempotent. The event
        log stays, so a client that lost the last events in flight can still resume for them."""
        if self._engine_released:
            return
        self._engine_released = True
        self.core.close()
        if self._pump is not asyncio.current_task():
            self._pump.cancel()
            await asyncio.wait([self._pump])
        self.scheduler.close_session(self.session_id)

    async def close(self, reason: BaseException | None = None) -> None:
        """End the attached stream (if any; with `reason`, by default UNAVAILABLE) and release the
        engine's session. Idempotent."""
        if self.core.attachment is not None:
            self.core.attachment.notify(end=reason if reason is not None else ShuttingDown("the session was closed"))
        await self.release_engine()


async def woken(a: Attachment) -> None:
    """Wait until there is something for the stream `a` (events, an Ack, its end)."""
    wake = a.wake
    assert isinstance(wake, asyncio.Event)  # what `HostedSession.attach` gives every stream
    await wake.wait()
    wake.clear()


async def _run(executor: Executor, fn, *args):
    """CPU work (codec decoding, the thin clients' front end) off the event loop. The stream's
    reader shields the whole `apply` from cancellation, so this always runs to its end."""
    return await asyncio.get_running_loop().run_in_executor(executor, fn, *args)


def short_id(session_id: str) -> str:
    """Enough of an id to follow one session through the logs."""
    return session_id[:6]
