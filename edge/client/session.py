"""`ClientSession`: one client stream's whole state and lifecycle, sans-IO.

No asyncio, no grpc, no proto: the network drivers (`edge/client/grpc_client.py` over gRPC,
`edge/client/webrtc_client.py` over a WebRTC data channel) move shared/protocol messages between the
network and this object, which says what to send and what the user sees:

    session = ClientSession(options)
    session.on_packets(packets, bound_s) / session.on_audio(pcm16)   # from a front end (edge/client/front_end.py)
    session.finalize()                                              # thin client: the speaker stopped
    session.end_input()                                             # the source is exhausted
    call: write(session.start_message())
          session.on_server_message(msg, now) -> [TranscriptEvent | SegmentTimings | TurnEvent
                                                   | StreamProgress]               (Ready first)
          while (msg := session.next_message()) is not None: write(msg); session.sent(msg)
          session.check_silence(now) -> reason to give the call up, or None
          session.on_call_closed() -> True when the stream is done
    session.on_disconnect(Disconnect(...), now) -> Retry(delay_s, new_session), or raises

The session semantics (those of `proto/harken.proto`):

- Every message not yet safe to forget stays in the resend buffer (`edge/client/replay.py`): feature
  packets until their segment is final, thin-client audio until applied and behind the last final.
- A dropped call is retried with jittered, capped exponential backoff. The retry resumes the same
  session (`Start{session_id, last_event_seq}`); the server answers `Ready{resume_after_seq}`,
  re-sends the transcript events lost in flight, and the client re-sends every message after
  `resume_after_seq`: exactly those not applied.
- NOT_FOUND on resume means the server lost the session (restart, expiry): a new session at once,
  seeded with the `SessionSeed` of the last final event, fed every unfinished message from seq 1.
  The replacement session re-sends committed text the user already has; the client keeps, per
  segment, what it delivered and passes on only what extends it (`ReplayFilter`).
- A call that carries nothing for `silence_timeout_s` while the server owes something (acks,
  finals, the end) is taken for dead (a network dropping packets without a reset) and resumed.
- A final that comes before the segment's end (a server shutting down finalises open segments)
  does not lose the rest: it continues as a new segment, and later segment ids move up by one.
- Word timings (`ClientOptions(word_timings=True)`): the Start asks for them; the Ready says whether
  the server sends them (`stats.word_timings`); each final segment's `SegmentTimings` then follows
  its final event, de-duplicated by event_seq like the transcript (a resume replays those missed).
  A server that lost the session loses the timings of segments it had finalised but not yet timed.
- Turn events (`ClientOptions(turn_events=True)`): the Start asks for them; each `TurnEvent`
  (speech started, utterance end) comes as soon as the server has applied the frames that decide
  it, once per segment and kind (a replacement session's repeats of unfinished segments are dropped).
- Finalize: a feature client cuts its own segment (`FeatureStream.finalize`: the packet that ends
  it is `finalized`); a thin client calls `finalize()`, and a `Finalize` goes out after the audio
  given so far. Either way the segment's final comes at once, `from_finalize`. A Finalize lost with
  a dropped call is not repeated (the segment then ends at the server VAD's end of speech).
- The buffer is bounded (`max_buffer_bytes`) and so is the time without a server
  (`max_offline_s`): past either the stream fails with a `TransportError` saying so.

Thin client (`ClientOptions(send_audio=True)`): PCM16 `Audio` messages, the server runs the edge
pipeline. The seed of a final event carries the server's front end as it was at a quiet point
(`SessionSeed.front_end_state`, opaque here) and the sample its replay starts at: the client keeps
its audio from there, and after the server lost the session it replays that audio into a session
seeded with it, which resumes the front end exactly: the same segments, ids, times and transcript
as without the fault, by construction as in feature mode. A seed without one (the stream's end cut
a segment short, a server that makes none) falls back to replaying the audio since the end of the
last final segment (on the log-mel hop and VAD window grid) into a fresh front end, whose times
are shifted back by the replay offset. What differs between the two modes lives in
`edge/client/replay.py`'s buffers.
"""

from __future__ import annotations

import enum
import logging
import random
import secrets
from dataclasses import dataclass, field, replace

from .options import ClientOptions, StreamProgress, TransportStats
from .errors import BufferOverflowError, ServerRejectedError, ServerUnavailableError, TransportSecurityError
from .replay import AudioBuffer, FeatureBuffer, PendingMessage, ReplayFilter, ResendBuffer
from ...shared.features_spec import SAMPLE_RATE
from ...shared.protocol import (Ack, ClientMessage, Configure, End, FeaturePacket, Finalize, KeepAlive, Ready,
                                    ServerMessage, SessionSeed, SpeakerLabel, Start, Transcript, Turn, WordTimings)
from ...shared.transcript import SegmentTimings, SpeakerChange, TimedWord, TranscriptEvent, TurnEvent

log = logging.getLogger("harken.transport")

# Status codes after which the same request may succeed later: the connection, not the request,
# was the problem. Everything else except NOT_FOUND (session lost -> replacement) is final.
RETRYABLE_STATUS = frozenset({"UNAVAILABLE", "INTERNAL", "UNKNOWN", "CANCELLED", "DEADLINE_EXCEEDED", "ABORTED"})


class ClientLifecycle(enum.Enum):
    """Where the stream is, from the first call to the end."""

    IDLE = "idle"  # no call yet
    CONNECTING = "connecting"  # Start written on a new call; the server's Ready is due
    STREAMING = "streaming"  # Ready came: buffered messages go out as they come
    DRAINING = "draining"  # all sent, End included (or the server holds ours): the finals and the close are due
    RECONNECTING = "reconnecting"  # the call ended early: another follows (`on_disconnect` said when)
    DONE = "done"  # the server closed the call after our End: every final is in
    FAILED = "failed"  # no point in another call: the error was raised


class InputState(enum.Enum):
    """How far the input is, End included; END_SENT and END_HELD are per server session."""

    OPEN = "open"  # the source is still producing
    FINISHED = "finished"  # every message is buffered; End not yet sent in this session
    END_SENT = "end_sent"  # End went out in this session (on this call or an earlier one)
    END_HELD = "end_held"  # the server refused a repeated End: it holds ours, only the finals are due


# what the user sees of a stream, in order: transcript events, word timings, turn events and speaker
# relabels (when asked for), progress
SessionOutput = TranscriptEvent | SegmentTimings | TurnEvent | SpeakerChange | StreamProgress


@dataclass(frozen=True)
class Disconnect:
    """Why a call ended before the stream was done, as the driver saw it."""

    details: str  # in words
    code: str | None = None  # the call's gRPC status code name; None: no status (no Ready, silence, ...)
    tls_mismatch: str | None = None  # the driver's verdict: a TLS mismatch no retry can fix (one line)


@dataclass(frozen=True)
class Retry:
    """What `on_disconnect` decided: the next call after `delay_s`; `new_session`: it opens a seeded
    replacement session (the server lost ours) that gets every unfinished message from seq 1."""

    delay_s: float
    new_session: bool = False


@dataclass
class ClientSession:
    """One stream's state, from the first `Start` to the last final (see the module docstring).
    `target` names the server in error messages; `rng` jitters the backoff."""

    options: ClientOptions = field(default_factory=ClientOptions)
    target: str = "the server"
    rng: random.Random = field(default_factory=random.Random)
    lifecycle: ClientLifecycle = ClientLifecycle.IDLE
    input: InputState = InputState.OPEN
    stats: TransportStats = field(default_factory=TransportStats)
    session_id: str = ""  # the server's session ("" until the first Ready, and after it lost ours)
    seed: SessionSeed | None = None  # from the last final event: seeds a replacement session
    last_event_seq: int = 0
    last_final_segment: int = -1
    sent_through: int = 0  # highest seq written on the current call
    acked_seq: int = 0  # highest seq the current session acknowledged
    last_heard: float = 0.0  # clock time of the server's latest message on the current call
    new_segment_bound_s: float = 0.0  # features: where the next segment can start at the earliest
    texts: ReplayFilter = field(default_factory=ReplayFilter)  # what the user has, per segment
    # Sent as the `session_id` metadata of every call of this stream (resumes and replacement
    # sessions too): a session-affine router in front of several servers (Ray Serve's
    # ConsistentHashRouter, Envoy/Istio consistent hashing) then sends them all to the server that
    # holds the session. Chosen here, not by the server, because the first call needs it too.
    route_key: str = field(default_factory=lambda: secrets.token_urlsafe(12))
    buffer: ResendBuffer = field(init=False)
    _offline_since: float | None = field(default=None, init=False, repr=False)
    _failures: int = field(default=0, init=False, repr=False)  # failed calls since the last Ready
    _connected_this_call: bool = field(default=False, init=False, repr=False)
    _writing: PendingMessage | None = field(default=None, init=False, repr=False)
    _now: float = field(default=0.0, init=False, repr=False)  # the clock at the latest `next_message`
    _last_written: float = field(default=0.0, init=False, repr=False)  # clock time of this call's last write
    _keep_alive_ok: bool = field(default=False, init=False, repr=False)  # this call's Ready: the server takes KeepAlive
    # thin client: Finalize requests not yet written, each due once the message of this seq is out
    _finalize_after: list[int] = field(default_factory=list, init=False, repr=False)
    # the latest Configure, and the seq after which it is due on this call (None: sent on it)
    _configure: Configure | None = field(default=None, init=False, repr=False)
    _configure_after: int | None = field(default=None, init=False, repr=False)
    # turn events passed on, per segment not yet final: a replacement session repeats them
    _turns_seen: set[tuple[int, str]] = field(default_factory=set, init=False, repr=False)

    def __post_init__(self) -> None:
        self.route_key = self.options.route_key or self.route_key
        self.stats.route_key = self.route_key
        o = self.options
        self.buffer = AudioBuffer(piece_samples=SAMPLE_RATE * o.audio_piece_ms // 1000) if o.send_audio \
            else FeatureBuffer()

    # ---- input: what the front end produces -------------------------------------------------

    def on_packets(self, packets: list[FeaturePacket], new_segment_bound_s: float) -> StreamProgress:
        """Feature mode: the edge pipeline's packets; `new_segment_bound_s`: no segment not yet
        opened can start before this (inf at the end). Returns the stream's progress."""
        self.new_segment_bound_s = max(self.new_segment_bound_s, new_segment_bound_s)
        for p in packets:
            self.buffer.add_packet(p)
            self.stats.frames_produced += p.frame_count
            self.stats.payload_bytes_produced += len(p.payload)
            self._check_buffer()
        return StreamProgress(self.bound_s())

    def on_audio(self, pcm16: bytes) -> None:
        """Thin client: one piece of little-endian PCM16 mono audio at 16 kHz."""
        self.buffer.add_audio(pcm16)
        self._check_buffer()

    def finalize(self) -> None:
        """Thin client: the speaker stopped (push-to-talk released): a `Finalize` goes out right
        after the audio given so far, and the server ends the open segment there at once. A feature
        client cuts its segment in its own front end instead (`FeatureStream.finalize`)."""
        if not self.options.send_audio:
            raise ValueError("a feature client finalizes in its front end (FeatureStream.finalize: the packet "
                             "that ends the segment is `finalized`), not with a Finalize message")
        if self.input is InputState.OPEN and (not self._finalize_after
                                              or self._finalize_after[-1] < self.buffer.next_seq - 1):
            self._finalize_after.append(self.buffer.next_seq - 1)

    def configure(self, keyterms: tuple[str, ...], context: str | None = None) -> None:
        """From the next segment on, the model expects these keyterms (and, given, this context): a
        `Configure` goes out after the messages given so far, and again first on every later call
        (the server keeps no record of it for a resume); a replacement session's Start carries them."""
        self.options = replace(self.options, keyterms=tuple(keyterms),
                               context=self.options.context if context is None else context)
        self._configure = Configure(tuple(keyterms), context if context is not None else self.options.context)
        self._configure_after = self.buffer.next_seq - 1

    def end_input(self) -> None:
        """The source is exhausted: End follows the last buffered message."""
        if self.input is InputState.OPEN:
            self.input = InputState.FINISHED

    def bound_s(self) -> float:
        """Lower bound on the start of any final event still to come (for the meeting merger)."""
        # the buffer holds whole unfinished segments, oldest first: its head opens the oldest one
        head = self.buffer.entries[0] if self.buffer.entries else None
        if head is None or head.segment_start_s is None:
            return self.new_segment_bound_s
        return min(self.new_segment_bound_s, head.segment_start_s)

    # ---- one call ---------------------------------------------------------------------------

    def start_message(self) -> Start:
        """The first message of a new call: a new session, a resume, or a seeded replacement."""
        self.lifecycle = ClientLifecycle.CONNECTING
        self._connected_this_call = False
        o = self.options
        return Start(language=o.language, context=o.context, codec=self.buffer.codec, session_id=self.session_id,
                     last_event_seq=self.last_event_seq if self.session_id else 0,
                     seed=None if self.session_id else self.seed, word_timings=o.word_timings,
                     turn_events=o.turn_events, keyterms=o.keyterms, diarize=o.diarize)

    def on_server_message(self, msg: ServerMessage | None, now: float) -> list[SessionOutput]:
        """A message from the server (None: an empty one) at clock time `now`; returns what the
        user sees, in order. The first message of a call must be `Ready`."""
        self.last_heard = now
        if self.lifecycle is ClientLifecycle.CONNECTING:
            if not isinstance(msg, Ready):
                got = type(msg).__name__.lower() if msg is not None else None
                raise self._fail(ServerRejectedError("PROTOCOL", f"expected Ready, got {got}"))
            self._on_ready(msg)
            return []
        if isinstance(msg, Transcript):
            return self._on_transcript(msg)
        if isinstance(msg, WordTimings):
            return self._on_word_timings(msg)
        if isinstance(msg, Turn):
            return self._on_turn(msg)
        if isinstance(msg, SpeakerLabel):
            return self._on_speaker_label(msg)
        if isinstance(msg, Ack):
            return self._on_ack(msg)
        return []  # an Error: the call's status follows with the same code, and is handled there

    def next_message(self, now: float | None = None) -> ClientMessage | None:
        """The next message to write on the call (then call `sent` with it), or None: nothing to
        send now (more input will come), or nothing more on this call (`lifecycle` is DRAINING:
        half-close it). Given the clock `now`, a `KeepAlive` when the call has written nothing
        for `keepalive_s` (see `keepalive_in`)."""
        if self.lifecycle is not ClientLifecycle.STREAMING:
            return None
        if now is not None:
            self._now = now
        self._writing = self.buffer.after(self.sent_through)
        if self._configure_after is not None and (self._writing is None or self._configure_after <= self.sent_through):
            self._writing = None
            assert self._configure is not None  # set together
            return self._configure
        if self._finalize_after and (self._writing is None or self._finalize_after[0] <= self.sent_through):
            self._writing = None
            return Finalize()
        if self._writing is not None:
            return self._writing.message()
        if self.input in (InputState.FINISHED, InputState.END_SENT):
            return End()
        if now is not None and (due := self.keepalive_in(now)) is not None and due <= 0:
            return KeepAlive()
        return None

    def keepalive_in(self, now: float) -> float | None:
        """Seconds until this call is due a `KeepAlive` (<= 0: due now), None: none will be (not
        streaming, `keepalive_s` is 0, or the call's Ready did not say the server takes them: an
        older server would end the stream over one). A driver waiting for input wakes up by then and asks
        `next_message(now)`."""
        if self.lifecycle is not ClientLifecycle.STREAMING or self.options.keepalive_s <= 0 or not self._keep_alive_ok:
            return None
        return self._last_written + self.options.keepalive_s - now

    def sent(self, msg: ClientMessage) -> None:
        """`msg`, from `next_message`, is written."""
        self._last_written = self._now
        if isinstance(msg, KeepAlive):
            self.stats.keepalives_sent += 1
            return
        if isinstance(msg, Configure):
            self._configure_after = None
            return
        if isinstance(msg, Finalize):
            self._finalize_after.pop(0)
            self.stats.finalizes_sent += 1
            return
        if isinstance(msg, End):
            self.input = InputState.END_SENT
            self.lifecycle = ClientLifecycle.DRAINING
            return
        entry, self._writing = self._writing, None
        assert entry is not None and entry.seq == getattr(msg, "seq", None), "sent() takes next_message()'s message"
        self.sent_through = entry.seq
        self.stats.messages_sent += 1
        self.stats.frames_sent += entry.frames
        if entry.times_sent:
            self.stats.messages_resent += 1
            self.stats.frames_resent += entry.frames
        entry.times_sent += 1
        self._drain_if_all_sent()

    def check_silence(self, now: float) -> str | None:
        """Why the call should be given up (the server owes us something, an ack, finals or the
        end, and has sent nothing for `silence_timeout_s`), or None."""
        end_written = self.lifecycle is ClientLifecycle.DRAINING and self.input is InputState.END_SENT
        owed = self.sent_through > self.acked_seq or end_written or bool(self.buffer.entries)
        quiet_s = now - self.last_heard
        if owed and quiet_s > self.options.silence_timeout_s:
            return f"nothing from the server for {quiet_s:.1f} s"
        return None

    def on_call_closed(self) -> bool:
        """The server closed the call with OK. True: after our End, so every final is in (DONE);
        False: before it (a server shutting down): resume, or replay into a new session."""
        if self.lifecycle is ClientLifecycle.DRAINING or self.input is InputState.END_HELD:
            self.lifecycle = ClientLifecycle.DONE
            return True
        return False

    def on_disconnect(self, failure: Disconnect, now: float) -> Retry:
        """The call ended before the stream was done (at clock time `now`). Returns when to make
        the next one; raises the stream's error when another cannot help: a status retrying cannot
        fix, a TLS mismatch, a server away for longer than `max_offline_s`."""
        o, code = self.options, failure.code
        if code == "NOT_FOUND" and self.session_id:
            # a replacement session at once, not after a backoff: the server is evidently up
            log.info("session %s… lost on the server (%s): replaying %d messages into a new one",
                     self.session_id[:6], failure.details, len(self.buffer.entries))
            self._prepare_replacement()
            self.lifecycle = ClientLifecycle.RECONNECTING
            return Retry(0.0, new_session=True)
        if code == "FAILED_PRECONDITION" and self.input is InputState.END_SENT:
            # our End reached the server on an earlier call, and this server refuses a second
            # one: resume once more without it and wait for the finals
            self.input = InputState.END_HELD
            self.lifecycle = ClientLifecycle.RECONNECTING
            return Retry(0.0)
        # admission control refuses a new stream at once; mid-stream (a replacement session after
        # a restart) the work already sent is worth waiting for, within max_offline_s
        busy = code == "RESOURCE_EXHAUSTED" and self.stats.sessions_opened > 0
        if code is not None and code not in RETRYABLE_STATUS and not busy:
            raise self._fail(ServerRejectedError(code, failure.details))
        if failure.tls_mismatch is not None:
            raise self._fail(TransportSecurityError(
                failure.tls_mismatch + (self.not_transcribed() if self.buffer.entries else "")))
        reason = f"{code}: {failure.details}" if code else failure.details
        log.info("stream to %s broke (%s); session %s…", self.target, reason, self.session_id[:6])
        if self._connected_this_call:
            self._offline_since, self._failures = None, 0
        self.stats.failed_attempts += 1
        self.stats.last_failure = reason
        if self._offline_since is None:
            self._offline_since = now
        offline_s = now - self._offline_since
        if offline_s >= o.max_offline_s:
            raise self._fail(ServerUnavailableError(
                f"server {self.target} unreachable for {offline_s:.1f} s (max_offline_s="
                f"{o.max_offline_s:g}); last error: {reason}" + self.not_transcribed()))
        delay = min(o.backoff_max_s, o.backoff_initial_s * o.backoff_multiplier ** self._failures)
        delay *= 0.5 + 0.5 * self.rng.random()  # jitter: clients cut off together retry apart
        self._failures += 1
        self.lifecycle = ClientLifecycle.RECONNECTING
        return Retry(min(delay, o.max_offline_s - offline_s))

    def not_transcribed(self) -> str:
        """What an error message adds: what is still in the buffer."""
        pending = sum(e.frames for e in self.buffer.entries)
        return f"; {pending} feature frames ({len(self.buffer.entries)} messages) were not transcribed"

    # ---- inside ---------------------------------------------------------------------------

    def _on_ready(self, ready: Ready) -> None:
        if not self.session_id:
            self.stats.sessions_opened += 1
        else:
            self.stats.resumes += 1
        self.session_id = ready.session_id
        if ready.resume_after_seq >= self.buffer.next_seq:
            raise self._fail(ServerRejectedError("PROTOCOL", f"server applied seq {ready.resume_after_seq}, "
                                                              f"but only {self.buffer.next_seq - 1} were sent"))
        self.sent_through = self.acked_seq = ready.resume_after_seq
        self._keep_alive_ok = ready.keep_alive
        if self.options.word_timings:
            if not ready.word_timings and self.stats.word_timings is not False:
                log.warning("the server at %s sends no word timings (it has no aligner: harken serve --aligner "
                            "MODEL)", self.target)
            self.stats.word_timings = ready.word_timings
        if self.options.turn_events:
            self.stats.turn_events = ready.turn_events
        if self.options.diarize:
            if not ready.diarize and self.stats.diarize is not False:
                log.warning("the server at %s gives no speaker labels (no speaker encoder: pip install "
                            "resemblyzer==0.1.4 --no-deps)", self.target)
            self.stats.diarize = ready.diarize
        self._last_written = self._now = self.last_heard
        if self._configure is not None and self._configure_after is None:
            self._configure_after = self.sent_through  # sent on an earlier call: again, first on this one
        self._connected_this_call = True
        self.lifecycle = ClientLifecycle.STREAMING
        self._drain_if_all_sent()

    def _drain_if_all_sent(self) -> None:
        """The server holds our End: once the rest is out, only its finals are due."""
        if self.input is InputState.END_HELD and self.buffer.after(self.sent_through) is None:
            self.lifecycle = ClientLifecycle.DRAINING

    def _on_transcript(self, t: Transcript) -> list[SessionOutput]:
        if t.event_seq and t.event_seq <= self.last_event_seq:
            self.stats.duplicate_events += 1
            return []
        self.last_event_seq = max(self.last_event_seq, t.event_seq)
        out: list[SessionOutput] = []
        event = self._visible(t.event)
        if event is not None:
            out.append(event)
        if t.event.is_final:
            if t.seed is not None:
                self.seed = t.seed
                self.buffer.on_seed(t.seed)
            self._segment_final(t.event.segment_id, t.event.end_s)
            out.append(StreamProgress(self.bound_s()))
        return out

    def _on_word_timings(self, w: WordTimings) -> list[SessionOutput]:
        """A final segment's word times: once (event_seq), on the user's timeline (as `_visible`)."""
        if w.event_seq and w.event_seq <= self.last_event_seq:
            self.stats.duplicate_events += 1
            return []
        self.last_event_seq = max(self.last_event_seq, w.event_seq)
        self.stats.word_timings_received += 1
        offset = self.buffer.time_offset_s
        t = w.timings
        if not offset:
            return [t]
        return [SegmentTimings(t.segment_id, tuple(TimedWord(x.text, x.start_s + offset, x.end_s + offset)
                                                    for x in t.words))]

    def _on_speaker_label(self, label: SpeakerLabel) -> list[SessionOutput]:
        """A better speaker for a final segment: once (event_seq)."""
        if label.event_seq and label.event_seq <= self.last_event_seq:
            self.stats.duplicate_events += 1
            return []
        self.last_event_seq = max(self.last_event_seq, label.event_seq)
        return [label.change]

    def _on_turn(self, t: Turn) -> list[SessionOutput]:
        """A turn event: once (event_seq, and per segment and kind across sessions), on the user's
        timeline (as `_visible`)."""
        if t.event_seq and t.event_seq <= self.last_event_seq:
            self.stats.duplicate_events += 1
            return []
        self.last_event_seq = max(self.last_event_seq, t.event_seq)
        e = t.turn
        key = (e.segment_id, e.kind)
        if e.segment_id <= self.last_final_segment or key in self._turns_seen:
            self.stats.duplicate_events += 1
            return []
        self._turns_seen.add(key)
        return [replace(e, audio_s=e.audio_s + self.buffer.time_offset_s)]

    def _on_ack(self, ack: Ack) -> list[SessionOutput]:
        self.acked_seq = max(self.acked_seq, ack.seq)
        final_through = self.buffer.on_ack(self.acked_seq, ack.last_final_segment)
        if final_through is not None and final_through > self.last_final_segment:
            self._segment_final(final_through, None)
            return [StreamProgress(self.bound_s())]
        return []

    def _segment_final(self, segment_id: int, end_s: float | None) -> None:
        self.last_final_segment = max(self.last_final_segment, segment_id)
        self.texts.forget_through(self.last_final_segment)
        self._turns_seen = {k for k in self._turns_seen if k[0] > self.last_final_segment}
        self.buffer.on_final(segment_id, end_s, self.last_final_segment, self.acked_seq)

    def _visible(self, e: TranscriptEvent) -> TranscriptEvent | None:
        """The event as the user sees it (see `ReplayFilter`), or None when it shows nothing new."""
        if e.segment_id <= self.last_final_segment:  # a replayed event of a segment the user has whole
            self.stats.duplicate_events += 1
            return None
        visible = self.texts.filter(e.segment_id, e.committed_delta, e.partial, e.is_final)
        self.stats.replayed_text_chars = self.texts.dropped_chars
        self.stats.replay_mismatches = self.texts.mismatches
        if visible is None:
            return None
        delta, partial = visible
        offset = self.buffer.time_offset_s
        return replace(e, committed_delta=delta, partial=partial, start_s=e.start_s + offset, end_s=e.end_s + offset)

    def _prepare_replacement(self) -> None:
        """The server lost the session: the next Start opens a new one, seeded with the last
        final's seed, and every unfinished message is replayed from seq 1."""
        self.session_id = ""
        if self.input in (InputState.END_SENT, InputState.END_HELD):
            self.input = InputState.FINISHED
        self.last_event_seq = 0
        self.acked_seq = 0
        self.texts.new_session()
        self.seed = self.buffer.on_session_lost(self.seed)

    def _check_buffer(self) -> None:
        if self.buffer.nbytes > self.options.max_buffer_bytes:
            raise self._fail(BufferOverflowError(
                f"{self.buffer.nbytes} bytes of audio not yet transcribed are buffered (limit "
                f"{self.options.max_buffer_bytes}): the server at {self.target} is too slow or away"))

    def _fail(self, error: Exception) -> Exception:
        self.lifecycle = ClientLifecycle.FAILED
        return error
