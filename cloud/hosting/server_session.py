"""The server's side of one session, sans-IO: its whole protocol state in one plain object.

`ServerSession` is driven by method calls and answers with what to do; it runs no task, takes no
lock, awaits nothing, reads no clock and calls no engine (the style of h11 and aioquic), so every
rule of the session protocol can be tested with no network, no event loop and no model
(tests/test_server_session.py). `HostedSession` (cloud/hosting/hosted_session.py) is its asyncio driver:
it decodes payloads and runs the thin clients' front end in the executor, hands frames to the
engine, pumps the engine's events in, and wakes the attached stream.

    input    receive(message, now) -> `Received`: what the driver does with one client message
                                      (nothing, frames to decode and feed, a segment to finalise,
                                      audio for the front end), the session's state already moved
             front_end_output(packets, now) -> which of the thin clients' front end's packets to feed
             finalized()           -> a thin client's Finalize is through its front end: Ack due
             end_input(now, by_client) -> no more input (End, shutdown): the segment to finalise;
                                      DRAINING or STOPPING, ENDED once every final is in
             (the steps receive is made of: admit, accept, fed, applied, finalize, drain)
    output   record(event, now)    -> the `Transcript` with its event_seq (and seed on finals)
             record_timings(words) -> the `WordTimings` of a final segment, its event_seq next in line
             (turn events: `fed` and `finalize` log them, for sessions that asked)
             fail(error)           -> FAILED: the attached stream and any later one get `error`
    streams  attach / supersede / detach / heard / idle_for / events_after / sent

The lifecycle (see `ServerLifecycle`; its moves are the table `TRANSITIONS`, any other raises
`LifecycleError`) replaces a set of flags: input is applied only while ACTIVE;
DRAINING and STOPPING differ only in why the input ended (the client's End, the server's
shutdown), which decides how the stream ends once every final is in (and, for a session that gets
word timings, every final segment's timings).

The event log keeps every event of a segment that is not final yet (a resumed client may not have
them) and, of final segments, a tail of `replay_tail` events behind the last one sent (those may
have been lost in flight when the connection dropped). A resume that asks for events no longer
held gets NOT_FOUND, and recovers as from a lost session (seed + replay).
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Protocol

from ..base.errors import MalformedMessage, OutOfOrder, SessionNotFound, ShuttingDown, Superseded
from .frame_order import FrameOrder
from .session_limits import AudioPace, SessionLimits
from ...shared.wire import MAX_SEGMENT_ID
from ...shared.front_end_checkpoint import FrontEndCheckpoint
from ...shared.features_spec import FRAMES_PER_SECOND, SAMPLE_RATE
from ...shared.protocol import (Audio, ClientMessage, Configure, End, FeaturePacket, Features, Finalize, KeepAlive,
                                    LoggedEvent, SessionSeed, SpeakerLabel, Start, Transcript, Turn, WordTimings)
from ...shared.transcript import UTTERANCE_END, SegmentTimings, SpeakerChange, TranscriptEvent, TurnEvent

if TYPE_CHECKING:
    import asyncio

SHUTDOWN_MESSAGE = "the server is shutting down: open segments were finalised"
ACK_EVERY = 5  # messages between Acks (plus one on every segment end and every final event)
CLOSED_OK = "closed-ok"  # `Attachment.end`: close the stream with OK


class ServerLifecycle(enum.Enum):
    """Where a session is in its life. Input is applied only while ACTIVE.

        ACTIVE ──End / half-close──> DRAINING ──┐
          │    ──server shutdown──> STOPPING ───┴─every final in──> ENDED
          └──── closed (grace expiry, a protocol error, idle, given way) ──> CLOSED
        any ──the engine took this session out (its own fault)──> FAILED

    ENDED and FAILED sessions stay in the table until a stream has taken every event (or the grace
    period ends), so a client that lost its connection at the very end can still resume for them.
    """

    ACTIVE = "active"
    DRAINING = "draining"  # the client said End; finals of the open segments pending
    STOPPING = "stopping"  # the server is shutting down; finals of the open segments pending
    ENDED = "ended"  # every final is in the event log
    FAILED = "failed"  # `ServerSession.failure` says why
    CLOSED = "closed"  # dropped before its end: no engine session, no input

    @property
    def done(self) -> bool:
        """No more events will be produced."""
        return self in (ServerLifecycle.ENDED, ServerLifecycle.FAILED, ServerLifecycle.CLOSED)


class Move(enum.Enum):
    """What moves a session from one `ServerLifecycle` state to another."""

    END = "end"  # the client's End (or half-close): no more input
    SHUTDOWN = "shutdown"  # the server stops: no more input
    FINALS_IN = "finals in"  # every final (and word timing) owed is in the event log
    CLOSE = "close"  # dropped before its end: grace expiry, a protocol error, idle, given way
    FAIL = "fail"  # the engine took the session out


_L = ServerLifecycle
# Every move a session can make; `ServerSession._move` refuses any other (LifecycleError).
TRANSITIONS: dict[tuple[ServerLifecycle, Move], ServerLifecycle] = {
    (_L.ACTIVE, Move.END): _L.DRAINING,
    (_L.ACTIVE, Move.SHUTDOWN): _L.STOPPING,
    (_L.DRAINING, Move.FINALS_IN): _L.ENDED,
    (_L.STOPPING, Move.FINALS_IN): _L.ENDED,
    **{(s, Move.CLOSE): _L.CLOSED for s in (_L.ACTIVE, _L.DRAINING, _L.STOPPING)},
    **{(s, Move.FAIL): _L.FAILED for s in (_L.ACTIVE, _L.DRAINING, _L.STOPPING)},
}


class LifecycleError(RuntimeError):
    """A move the lifecycle's table does not have: a bug in the session's driver, not the client's."""


@dataclass(frozen=True)
class Received:
    """What the driver does with one client message `ServerSession.receive` took (the session's
    state has moved already; the driver only does the work that needs IO or CPU time):

        nothing to do        message None (a keep-alive, a replay of what was applied)
        Features             `feed`: decode the packet's payload and hand its frames to the engine
                             (None: its frames are not for the engine, the seed says final)
        Audio                run the thin clients' front end on it, then `front_end_output`
        Finalize, End        `finalize`: the segment to finalise in the engine (feature clients);
                             a thin client's front end is finalised/flushed first (`front_end` true)
        Configure            the model's context changes
    """

    message: ClientMessage | None
    feed: FeaturePacket | None = None
    finalize: int | None = None
    front_end: bool = False  # a thin client's Finalize or End: its front end's work comes first


NOTHING = Received(None)


class Wake(Protocol):
    """What the driver waits on for a stream (an `asyncio.Event` in `HostedSession`)."""

    def set(self) -> None: ...


@dataclass
class Attachment:
    """One client stream attached to a session. The stream's writer waits on `wake`, then sends
    the events after `sent_event_seq`, an Ack when `ack_due`, and ends when `end` is set
    (None = go on; an exception = fail with it; `CLOSED_OK` = close with OK)."""

    sent_event_seq: int
    quiet_since: float  # clock time since which the stream has been idle (see `ServerSession.idle_for`)
    wake: Wake
    ack_due: bool = False
    end: BaseException | str | None = None  # str: CLOSED_OK
    reader: asyncio.Task | None = None  # the driver's reader; cancelled when a newer stream attaches

    def notify(self, *, ack: bool = False, end: BaseException | str | None = None, overrule: bool = False) -> None:
        """Wake the stream for an Ack and/or its end. The first reason to end a stream is the one it
        ends with, unless `overrule` (the session's own end, a newer stream)."""
        self.ack_due = self.ack_due or ack
        if end is not None and (self.end is None or overrule):
            self.end = end
        self.wake.set()


@dataclass(frozen=True)
class Latency:
    """What one recorded event says about latency (seconds; None = not measured by this event)."""

    first_partial_s: float | None = None  # segment start received -> its first event
    final_s: float | None = None  # segment end received -> its final
    update_s: float | None = None  # the frames a partial covers received -> the partial


@dataclass
class _Timing:
    arrivals: deque[tuple[int, float]] = field(default_factory=deque)  # (frame end, arrival time)
    started_at: dict[int, float] = field(default_factory=dict)
    ended_at: dict[int, float] = field(default_factory=dict)
    first_event_seen: set[int] = field(default_factory=set)

    def arrival_of(self, frame_end: int) -> float | None:
        for end, t in self.arrivals:
            if end >= frame_end:
                return t
        return None


class ServerSession:
    """One session's protocol state on the server (see the module docstring)."""

    def __init__(self, session_id: str, key_id: str, start: Start, limits: SessionLimits, now: float,
                 word_timings: bool = False):
        """`word_timings`: the session asked for them and the server has an aligner: each final
        segment's timings follow its final, and the session ends only once they are all in. Turn
        events are logged when the session asked for them (`start.turn_events`)."""
        self.session_id = session_id  # also the engine's id for it
        self.key_id = key_id
        self.start = start
        self.word_timings = word_timings
        self._awaiting_timings: set[int] = set()  # final segments whose word timings have not come
        self.limits = limits
        self.applied_seq = 0
        self.last_final_segment = (start.seed.next_segment_id - 1) if start.seed else -1
        self.input_kind: str | None = None  # "features" or "audio", fixed by the first one
        self.order = FrameOrder(last_segment_id=self.last_final_segment, seeded_final=self.last_final_segment)
        # thin clients: the front end's latest checkpoint per next segment id, for the seeds
        self._checkpoints: dict[int, FrontEndCheckpoint] = {}
        self._cut_by_end: set[int] = set()  # segments the front end's flush ended (End, shutdown)
        self.events: deque[LoggedEvent] = deque()
        self.next_event_seq = 1
        self.delivered_event_seq = 0  # highest event_seq handed to some stream
        self.attachment: Attachment | None = None
        self.detached_at: float | None = now
        self.lifecycle = ServerLifecycle.ACTIVE
        self.failure: BaseException | None = None  # FAILED: the engine took the session out with this
        self._awaiting_final: set[int] = set()  # segments fed frames whose final has not come
        self._finalized: set[int] = set()  # segments ended by a finalize request: their finals say so
        self._msgs_since_ack = 0
        self._timing = _Timing()
        self._audio_rate = 0  # thin clients: the sample rate of the session's audio
        self._by_client = False  # DRAINING (the client's End) rather than STOPPING (shutdown)

    # ---- streams ---------------------------------------------------------------------------------

    def supersede(self) -> Attachment | None:
        """A newer stream is about to attach: the attached one (if any) is told to end ABORTED and
        returned, so the driver can stop its reader before `attach`."""
        old = self.attachment
        if old is not None:
            old.notify(end=Superseded("a newer stream attached to this session"), overrule=True)
        return old

    def check_resumable(self, last_event_seq: int) -> None:
        """SessionNotFound when events after `last_event_seq` are no longer held: the client must
        recover as from a lost session."""
        oldest_held = self.events[0].event_seq if self.events else self.next_event_seq
        if last_event_seq + 1 < oldest_held:
            raise SessionNotFound(f"events after {last_event_seq} are no longer held; open a new session "
                                  "with the last seed")

    def attach(self, last_event_seq: int, now: float, wake: Wake) -> Attachment:
        """A stream that has the events up to `last_event_seq` (see `check_resumable`) attaches.
        SessionNotFound when the session was closed. A stream attaching to an ENDED or FAILED
        session is sent what it lacks and then closed OK (or fails with the failure)."""
        if self.lifecycle is ServerLifecycle.CLOSED:  # dropped (grace expiry, given way)
            raise SessionNotFound("the session was closed: open a new session with the last seed")
        a = Attachment(sent_event_seq=min(last_event_seq, self.next_event_seq - 1), quiet_since=now, wake=wake)
        self.attachment = a
        self.detached_at = None
        if self.lifecycle in (ServerLifecycle.ENDED, ServerLifecycle.FAILED):
            a.end = CLOSED_OK if self.failure is None else self.failure
        a.wake.set()  # replay what the client has not seen
        return a

    def detach(self, a: Attachment, now: float) -> None:
        if self.attachment is a:
            self.attachment = None
            self.detached_at = now

    def heard(self, a: Attachment, now: float) -> None:
        """The stream `a` received a message from its client: it is not idle."""
        a.quiet_since = now

    def idle_for(self, now: float, busy: bool) -> float | None:
        """How long the attached stream has been idle at clock time `now`: no message from its
        client while the session was ACTIVE and the server had nothing of it to do (`busy`: a
        message being applied or held back by the queued-audio limits, a pass due or in flight in
        the engine). None while it is not idle (its idle time then starts again from `now`), or
        when no stream is attached."""
        a = self.attachment
        if a is None:
            return None
        if self.lifecycle is not ServerLifecycle.ACTIVE or busy:
            a.quiet_since = max(a.quiet_since, now)
            return None
        return max(0.0, now - a.quiet_since)

    def events_after(self, event_seq: int) -> list[LoggedEvent]:
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

    def receive(self, msg: ClientMessage, now: float) -> Received:
        """One client message (after `start`): checks it against the session's state and moves the
        state as if it had been applied in full (a payload that then fails to decode is the
        input's error: the session is dropped, so no later message sees the moved state). Raises
        for what breaks the protocol. One call instead of admit, accept, fed, applied (and, for
        Finalize and End of feature clients, finalize and drain)."""
        todo = self.admit(msg)
        if todo is None:
            return NOTHING
        if isinstance(todo, Features):
            p = todo.packet
            feed = self.accept(p)
            if feed:
                self.fed(p, now)
            self.applied(todo)
            return Received(todo, feed=p if feed and (p.frame_count or p.segment_start or p.segment_end) else None)
        if isinstance(todo, Audio):
            self.applied(todo)
            return Received(todo)
        thin = self.input_kind == "audio"
        if isinstance(todo, Finalize):
            if thin:
                return Received(todo, front_end=True)  # then `front_end_output`, `finalized`
            seg = self.finalize(now)
            self.finalized()
            return Received(todo, finalize=seg)
        if isinstance(todo, End):
            if thin:
                return Received(todo, front_end=True)  # then `front_end_output`, `end_input`
            return Received(todo, finalize=self.end_input(now, by_client=True))
        return Received(todo)  # Configure

    def front_end_output(self, packets: list[FeaturePacket], now: float) -> list[FeaturePacket]:
        """The thin clients' front end made `packets`: those whose frames go to the engine (each
        taken as fed), in order."""
        out = []
        for p in packets:
            if self.accept(p, from_front_end=True):
                self.fed(p, now)
                if p.frame_count or p.segment_start or p.segment_end:
                    out.append(p)
        return out

    def end_input(self, now: float, by_client: bool) -> int | None:
        """No more input (End, shutdown; a thin client's front end flushed first): the open
        segment to finalise, if any; DRAINING or STOPPING, ENDED once every final is in."""
        seg = self.finalize(now) if self.lifecycle is ServerLifecycle.ACTIVE else None
        self.drain(by_client)
        return seg

    def admit(self, msg: ClientMessage) -> ClientMessage | None:
        """Check one client message (after `start`) against the session's state: the message to
        apply, or None when there is nothing to do (a keep-alive; a message resent after a
        reconnect that was applied already). Raises for what breaks the protocol."""
        if isinstance(msg, KeepAlive):
            return None
        if isinstance(msg, Start):
            raise OutOfOrder("start may only be the first message of a stream")
        if self.lifecycle is ServerLifecycle.CLOSED:
            raise SessionNotFound("the session was closed: open a new session with the last seed")
        if self.lifecycle is not ServerLifecycle.ACTIVE:
            if not self._by_client:  # a live client still sending when the server stops
                raise ShuttingDown(SHUTDOWN_MESSAGE)
            # A client that resumes after its connection dropped between End and the last finals
            # repeats End and may resend applied messages: both are replays, not errors.
            if isinstance(msg, End) or getattr(msg, "seq", 0) <= self.applied_seq:
                return None
            raise OutOfOrder("the session has ended: no input after end")
        if isinstance(msg, (Finalize, End, Configure)):
            return msg
        if msg.seq <= self.applied_seq:
            return None  # a duplicate resent after a reconnect: already applied
        if msg.seq != self.applied_seq + 1:
            raise OutOfOrder(f"seq {msg.seq} leaves a gap: the last applied was {self.applied_seq}")
        kind = "features" if isinstance(msg, Features) else "audio"
        if self.input_kind not in (None, kind):
            raise OutOfOrder(f"{kind} in a session that receives {self.input_kind}: do not mix them")
        if isinstance(msg, Audio):
            if self.input_kind == "audio" and self._audio_rate != msg.sample_rate:
                raise MalformedMessage(f"audio.sample_rate changed from {self._audio_rate} to {msg.sample_rate}")
            seed = self.start.seed
            if self.input_kind is None and seed is not None and seed.front_end_state and msg.sample_rate != SAMPLE_RATE:
                raise MalformedMessage(f"start.seed.front_end_state goes on with 16 kHz audio, not {msg.sample_rate} Hz")
            self._audio_rate = msg.sample_rate
        self.input_kind = kind  # fixed by the first message, whether or not it is applied in full
        return msg

    def applied(self, msg: Features | Audio) -> None:
        """`msg` (admitted) has been applied in full."""
        self.applied_seq = msg.seq
        self._msgs_since_ack += 1
        if self._msgs_since_ack >= ACK_EVERY or (isinstance(msg, Features) and msg.packet.segment_end):
            self._ack()

    def accept(self, p: FeaturePacket, from_front_end: bool = False) -> bool:
        """Whether `p`'s frames go to the engine: raises OutOfOrder for frames out of order;
        False for frames of a segment the seed says is final, and (thin clients) for the VAD's
        frames of a segment the client has finalised."""
        if from_front_end:
            if p.segment_id > MAX_SEGMENT_ID:  # numbered on from a seed near the end of the range
                raise MalformedMessage(f"no segment ids left: a segment would be number {p.segment_id} "
                                       f"(at most {MAX_SEGMENT_ID}); start a session without this seed")
            if self.order.closed_by_finalize == p.segment_id:
                if p.segment_end:
                    self.order.closed_by_finalize = None
                return False
        return self.order.check(p)

    def fed(self, p: FeaturePacket, now: float) -> None:
        """`p` (accepted) is with the engine."""
        t = self._timing
        if p.segment_start:
            t.started_at[p.segment_id] = now
        if p.frame_count:
            t.arrivals.append((p.first_frame + p.frame_count, now))
            while len(t.arrivals) > 512:
                t.arrivals.popleft()
            self._awaiting_final.add(p.segment_id)
        if p.segment_end:
            t.ended_at[p.segment_id] = now
            if p.finalized:
                self._finalized.add(p.segment_id)
        self.order.apply(p)
        for turn in p.turns():
            self._turn(turn)

    def finalize(self, now: float) -> int | None:
        """Close the open segment now (Finalize, End): its id, for the engine to finalise."""
        seg = self.order.open_segment
        if seg is None:
            return None
        self._timing.ended_at[seg] = now
        if self.input_kind == "audio":
            self.order.closed_by_finalize = seg
        self.order.open_segment = None
        self._finalized.add(seg)
        self._turn(TurnEvent(UTTERANCE_END, seg, self.order.next_frame / FRAMES_PER_SECOND))
        return seg

    def _turn(self, turn: TurnEvent) -> None:
        """A turn event -> the event log (sessions that asked for them). Wakes the stream."""
        if not self.start.turn_events:
            return
        self.events.append(Turn(turn, event_seq=self.next_event_seq))
        self.next_event_seq += 1
        self._trim_events()
        if self.attachment is not None:
            self.attachment.notify()

    def finalized(self) -> None:
        """A Finalize has been applied: an Ack now (its seq is the last message before it), so a
        client knows every event the audio before it decided is in (a turn that opened a segment
        came before this Ack; the segment's final follows)."""
        self._ack()

    def front_end_checkpoints(self, checkpoints: list[FrontEndCheckpoint]) -> None:
        for c in checkpoints:
            self._checkpoints[c.next_segment_id] = c  # the latest of a gap replays the least

    def cut_by_end(self, segment_ids: list[int]) -> None:
        """The thin clients' front end ended these segments only because the input ended."""
        self._cut_by_end.update(segment_ids)

    def drain(self, by_client: bool) -> None:
        """No more input (the open segment was finalised): DRAINING (End) or STOPPING (shutdown);
        ENDED as soon as every final is in."""
        if self.lifecycle is not ServerLifecycle.ACTIVE:  # closed or failed while the input was ending
            return
        self._move(Move.END if by_client else Move.SHUTDOWN)
        self._by_client = by_client
        self._check_ended()

    def close(self) -> None:
        """Dropped before its end (if it had not ended): no more input, no more events."""
        if not self.lifecycle.done:
            self._move(Move.CLOSE)

    def _move(self, move: Move) -> None:
        """The lifecycle's one way to change: a move of `TRANSITIONS`, or LifecycleError."""
        to = TRANSITIONS.get((self.lifecycle, move))
        if to is None:
            raise LifecycleError(f"no move {move.value!r} from {self.lifecycle.value}")
        self.lifecycle = to

    def _ack(self) -> None:
        self._msgs_since_ack = 0
        if self.attachment is not None:
            self.attachment.notify(ack=True)

    # ---- output ----------------------------------------------------------------------------------

    def record(self, ev: TranscriptEvent, seed: SessionSeed | None, now: float,
               speaker: str = "") -> tuple[Transcript, Latency]:
        """An engine event (with the engine's seed on finals) -> the event log, its event_seq and,
        on finals of thin clients, the front end's checkpoint on the seed; `speaker` on a final of a
        session that asked for speaker labels. Wakes the stream."""
        t = self._timing
        if seed is not None and ev.is_final:
            seed = self._with_front_end(seed, ev.segment_id)
        from_finalize = ev.is_final and ev.segment_id in self._finalized
        out = Transcript(TranscriptEvent(segment_id=ev.segment_id, committed_delta=ev.committed_delta,
                                         partial=ev.partial, stability=ev.stability, start_s=ev.start_s,
                                         end_s=ev.end_s, language=ev.language, is_final=ev.is_final,
                                         from_finalize=from_finalize, word_confidence=ev.word_confidence,
                                         speaker=speaker if ev.is_final else ""),
                         event_seq=self.next_event_seq, seed=seed if ev.is_final else None)
        self.next_event_seq += 1
        self.events.append(out)
        first = final = update = None
        if ev.segment_id not in t.first_event_seen:
            t.first_event_seen.add(ev.segment_id)
            if (t0 := t.started_at.pop(ev.segment_id, None)) is not None:
                first = now - t0
        if ev.is_final:
            self._awaiting_final.discard(ev.segment_id)
            self._finalized.discard(ev.segment_id)
            if self.word_timings:
                self._awaiting_timings.add(ev.segment_id)
            self.last_final_segment = max(self.last_final_segment, ev.segment_id)
            if (t_end := t.ended_at.pop(ev.segment_id, None)) is not None:
                final = now - t_end
            t.started_at.pop(ev.segment_id, None)
            t.first_event_seen.discard(ev.segment_id)
        elif (arrived := t.arrival_of(round(ev.end_s * 100))) is not None:
            update = now - arrived
        self._trim_events()
        if self.attachment is not None:
            self.attachment.notify(ack=ev.is_final)
        self._check_ended()
        return out, Latency(first, final, update)

    def record_timings(self, timings: SegmentTimings) -> WordTimings:
        """The word timings of a final segment -> the event log (the next event_seq). Wakes the stream."""
        out = WordTimings(timings, event_seq=self.next_event_seq)
        self.next_event_seq += 1
        self.events.append(out)
        self._awaiting_timings.discard(timings.segment_id)
        self._trim_events()
        if self.attachment is not None:
            self.attachment.notify()
        self._check_ended()
        return out

    def record_relabels(self, changes: list[SpeakerChange]) -> None:
        """Better speakers for segments already final -> the event log (sessions that asked for
        speaker labels), right after the final that decided them. Wakes the stream."""
        for change in changes:
            self.events.append(SpeakerLabel(change, event_seq=self.next_event_seq))
            self.next_event_seq += 1
        if changes:
            self._trim_events()
            if self.attachment is not None:
                self.attachment.notify()

    def fail(self, error: BaseException) -> None:
        """The engine took the session out with `error`: the attached stream, and any stream that
        attaches later, gets it."""
        if self.lifecycle.done:
            return
        self.failure = error
        self._move(Move.FAIL)
        if self.attachment is not None:
            self.attachment.notify(end=error, overrule=True)

    def _check_ended(self) -> None:
        if (self.lifecycle not in (ServerLifecycle.DRAINING, ServerLifecycle.STOPPING) or self._awaiting_final
                or self._awaiting_timings):
            return
        self._move(Move.FINALS_IN)
        if self.attachment is not None:
            self.attachment.notify(end=CLOSED_OK if self._by_client else ShuttingDown(SHUTDOWN_MESSAGE), overrule=True)

    def _with_front_end(self, seed: SessionSeed, segment_id: int) -> SessionSeed:
        """Thin clients: the seed carries the checkpoint a replacement session resumes from once
        `segment_id` is final: the latest taken before any later segment began (replaying a final
        segment again costs audio, not exactness: the replacement ignores its frames). None when
        the stream's end cut the segment short: the rest of its speech belongs to no segment yet,
        and the client replays it from the final's end into a fresh front end."""
        if segment_id in self._cut_by_end:
            return seed
        usable = [k for k in self._checkpoints if k <= segment_id + 1]
        if not usable:
            return seed
        best = max(usable)
        for k in [k for k in self._checkpoints if k < best]:  # finals come in order: never needed again
            del self._checkpoints[k]
        c = self._checkpoints[best]
        return replace(seed, front_end_state=c.serialize(), audio_sample=c.replay_from)

    def _trim_events(self) -> None:
        keep_after = self.delivered_event_seq - self.limits.replay_tail
        while self.events and (
                (self.events[0].event_seq <= keep_after and self.events[0].segment_id <= self.last_final_segment)
                or len(self.events) > self.limits.max_events_held):
            self.events.popleft()
