"""The edge's gRPC client: audio in, transcript events out, nothing lost across network faults.

`TranscriptionClient.stream(source)` runs the edge pipeline (`FeatureStream`: VAD + log-mel +
codec) over the source, sends one `Features` message per packet on a `harken.v1.Transcription/
Stream` call and yields the server's transcript as `TranscriptEvent`s. The session semantics are
those of `proto/harken.proto`:

- Every packet of every segment not yet final stays in the client's buffer (`edge/replay.py`); a
  segment's packets are dropped once its final event has arrived (or an `Ack` says it is final).
- A dropped connection (UNAVAILABLE, a reset stream, EOF before `End`) is retried with jittered,
  capped exponential backoff. The retry resumes the same session (`Start{session_id,
  last_event_seq}`); the server answers `Ready{resume_after_seq}`, re-sends the transcript events
  lost in flight, and the client re-sends every message after `resume_after_seq`.
- NOT_FOUND on resume means the server lost the session (restart, expiry): the client opens a new
  session seeded with the `SessionSeed` of the last final event, and replays every unfinished
  segment from its first frame. The replacement session re-sends committed text the user already
  has; the client keeps, per segment, what it delivered and passes on only what extends it.
- A connection that carries nothing for `silence_timeout_s` while the server owes something
  (acks, finals) is taken for dead (a network dropping packets without a reset) and resumed.
- A final that comes before the segment's end (a server shutting down finalises open segments)
  does not lose the rest: it continues as a new segment, and later segment ids move up by one.
- A TLS mismatch is not a network fault: a certificate the CA does not sign (or issued for another
  name), a TLS client at a plaintext server, a plaintext client at a TLS server (asked of the port
  once, before the first session, when the connection closes at once) fail the stream at once with
  `TransportSecurityError`, never retried.
- The buffer is bounded (`max_buffer_bytes`) and so is the time without a server
  (`max_offline_s`): past either the stream fails with a `TransportError` saying so, instead of
  growing or hanging.

The thin-client mode (`ClientOptions(send_audio=True)`) sends PCM16 `Audio` messages and lets the
server run the edge pipeline; it resumes the same way after dropped connections. After the server
lost the session it replays the audio since the end of the last final segment (on the log-mel hop
and VAD window grid) into a seeded session, and shifts that session's times back by the replay
offset. The server's VAD then starts from a fresh state at that point, so the transcript is the
uninterrupted one in practice (the tests see it identical), not by construction as in feature
mode.

No torch here: grpcio, protobuf, numpy and the edge modules only.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from collections.abc import AsyncGenerator, AsyncIterable, AsyncIterator, Callable, Iterable
from contextlib import AbstractAsyncContextManager, aclosing
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, overload

import grpc
import numpy as np

from harken.edge.audio import load_audio, peak_normalize
from harken.edge.pipeline import FeaturePacket, FeatureStream
from harken.edge.replay import PendingMessage, ReplayFilter, ResendBuffer, align_down
from harken.proto import harken_pb2 as pb
from harken.proto import harken_pb2_grpc
from harken.shared.codec import CODEC_NAME, DEFAULT_MODE
from harken.shared.errors import HarkenError
from harken.shared.features_spec import FRAMES_PER_SECOND, SAMPLE_RATE
from harken.shared.integrity import payload_crc32c
from harken.shared.text import TranscriptText
from harken.shared.transcript import TranscriptEvent

log = logging.getLogger("harken.transport")

THIN_REPLAY_MAX_S = 60  # thin client: audio kept for a replay after a server restart, at most

# Status codes after which the same request may succeed later: the connection, not the request,
# was the problem. Everything else except NOT_FOUND (session lost -> replacement) is final.
RETRYABLE_CODES = frozenset({
    grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.ABORTED,
})


class TransportError(HarkenError):
    """The stream could not be completed; the message says why and what was not transcribed."""


class ServerUnavailableError(TransportError):
    """The server stayed unreachable for longer than `ClientOptions.max_offline_s`."""


class BufferOverflowError(TransportError):
    """More unacknowledged audio than `ClientOptions.max_buffer_bytes` piled up."""


class TransportSecurityError(TransportError):
    """A TLS mismatch between this client and the server: a certificate the given CA does not sign
    (or issued for another name), a TLS client talking to a plaintext server or a plaintext client
    talking to a TLS server. Retrying cannot fix it, so the stream fails at once."""


class ServerRejectedError(TransportError):
    """The server refused the stream with a status that retrying cannot fix (bad key, bad input,
    admission control). `code` is the gRPC status code name, e.g. "UNAUTHENTICATED"."""

    def __init__(self, code: str, message: str):
        super().__init__(f"server refused the stream: {code}: {message}")
        self.code = code


@dataclass
class ClientOptions:
    """How a `TranscriptionClient` streams, buffers and reconnects."""

    language: str = ""  # force a language ("English"); "" = detect
    context: str = ""  # context text for the model: hot words, names, topic
    send_audio: bool = False  # thin client: PCM16 `Audio` messages, the server runs VAD + features
    codec_mode: str = DEFAULT_MODE
    packet_frames: int = 20  # frames per `Features` message (20 = 200 ms)
    audio_piece_ms: int = 100  # thin client: audio per `Audio` message
    max_offline_s: float = 120.0  # give up when the server stays away this long
    max_buffer_bytes: int = 64 << 20  # bound on buffered, not yet final, payload bytes
    connect_timeout_s: float = 10.0  # one attempt's wait for `Ready`
    # a connection over which nothing arrives for this long while the server owes us something
    # (acks, transcripts of unfinished segments, the end) is taken for dead and resumed: a network
    # that drops packets without a reset would otherwise hang the stream
    silence_timeout_s: float = 30.0
    backoff_initial_s: float = 0.05
    backoff_max_s: float = 2.0
    backoff_multiplier: float = 2.0
    tls_server_name: str | None = None  # TLS: check the certificate for this name, not the host's

    def __post_init__(self):
        if self.max_offline_s <= 0 or self.max_buffer_bytes <= 0:
            raise ValueError("max_offline_s and max_buffer_bytes must be positive")
        if self.backoff_initial_s <= 0 or self.backoff_max_s < self.backoff_initial_s:
            raise ValueError("need 0 < backoff_initial_s <= backoff_max_s")


@dataclass
class TransportStats:
    """What the client did to get the transcript through: read it after (or during) a stream."""

    sessions_opened: int = 0  # 1 + replacement sessions after NOT_FOUND
    resumes: int = 0  # reconnects that resumed the same session
    failed_attempts: int = 0  # stream attempts that ended in a retryable error
    last_failure: str = ""  # why the latest of them failed
    messages_sent: int = 0  # Features/Audio messages written, resends included
    messages_resent: int = 0
    frames_sent: int = 0  # feature frames written, resends included
    frames_resent: int = 0
    frames_produced: int = 0  # feature frames the edge produced (each counted once)
    payload_bytes_produced: int = 0  # codec payload bytes of those frames (each counted once)
    duplicate_events: int = 0  # transcript events dropped as already seen (event_seq replay)
    replayed_text_chars: int = 0  # committed text re-sent by a replacement session and dropped
    replay_mismatches: int = 0  # a replacement session's committed text disagreed with ours


def features_message(p: FeaturePacket, seq: int = 0, segment_id: int | None = None,
                     segment_start: bool | None = None) -> pb.ClientMessage:
    """The `Features` message of one edge packet, its payload's CRC32C beside it (the server
    rejects a payload that does not match). `segment_id`/`segment_start` override the packet's."""
    return pb.ClientMessage(features=pb.Features(
        seq=seq, segment_id=p.segment_id if segment_id is None else segment_id, first_frame=p.first_frame,
        frame_count=p.frame_count, segment_start=p.segment_start if segment_start is None else segment_start,
        segment_end=p.segment_end, payload=p.payload, running_max_log10=p.running_max_log10,
        payload_crc32c=payload_crc32c(p.payload)))


AudioSource = Iterable[np.ndarray] | AsyncIterable[np.ndarray] | np.ndarray | str | Path
"""What `TranscriptionClient.stream` takes: 16 kHz mono float32 pieces (sync or async), an array
or an audio file's path."""


def file_pieces(path: str | Path, piece_ms: int = 100) -> list[np.ndarray]:
    """An audio file as 16 kHz mono float32 pieces of `piece_ms`: a ready `stream()` source.
    Peak-normalised as the embedded engine and the official package treat files."""
    return audio_pieces(peak_normalize(load_audio(path)), piece_ms)


def audio_pieces(audio: np.ndarray, piece_ms: int = 100) -> list[np.ndarray]:
    """Cut 16 kHz mono float32 audio into pieces of `piece_ms` (the last may be shorter)."""
    step = SAMPLE_RATE * piece_ms // 1000
    audio = np.asarray(audio, dtype=np.float32)
    return [audio[i:i + step] for i in range(0, audio.size, step)]


@dataclass(frozen=True)
class StreamProgress:
    """In band with the events (`stream(..., progress=True)`): no final event with
    start_s < `bound_s` will come from this stream any more (feature mode; the meeting merger
    orders tracks with it)."""

    bound_s: float


@dataclass
class _StreamState:
    """Everything one `stream()` call knows; owned by that call, touched only on its event loop."""

    buffer: ResendBuffer = field(default_factory=ResendBuffer)
    session_id: str = ""
    replacement: bool = False  # the next Start opens a seeded replacement session
    last_event_seq: int = 0
    sent_through: int = 0  # highest seq written on the current call
    seed: pb.SessionSeed | None = None
    last_final_segment: int = -1
    final_end_sample: int = 0  # thin client: where the last final segment ended
    replay_offset_s: float = 0.0  # thin client: replacement-session times are relative to this
    texts: ReplayFilter = field(default_factory=ReplayFilter)  # what the user has, per segment
    source_done: bool = False
    wake_sender: asyncio.Event = field(default_factory=asyncio.Event)
    new_segment_bound_s: float = 0.0  # edge: where the next segment can start at the earliest
    audio_position: int = 0  # thin client: samples enqueued so far
    end_written: bool = False  # End went out on the current call
    end_sent_in_session: bool = False  # ... or on an earlier call of the same session
    server_has_end: bool = False  # the server refused a repeated End: it has ours
    acked_seq: int = 0  # highest seq the current session acknowledged
    last_heard: float = 0.0  # clock time of the server's latest message on the current call
    segment_shift: int = 0  # wire segment id - edge segment id (segments the server ended early)
    open_segment: int | None = None  # wire id of the segment the edge has not ended yet
    reopen_segment: bool = False  # the open segment's next packet starts its continuation
    connected_once_this_attempt: bool = False


class TranscriptionClient:
    """An asyncio client of a harken server.

    ```
    client = TranscriptionClient("localhost:50051", api_key="...", options=ClientOptions(language="English"))
    async for event in client.stream(file_pieces("talk.wav")):
        print(event.committed_delta, end="", flush=True)
    ```

    `target` is "host:port"; `tls` is None (plaintext), True (system roots) or the path of a PEM
    root certificate; `api_key` is sent as `authorization: Bearer <key>`. One client may run
    several streams (one per audio track), concurrently or one after another; `stats` describes
    the latest.
    """

    def __init__(self, target: str, api_key: str | None = None, tls: bool | str | Path | None = None,
                 language: str | None = None, context: str | None = None,
                 options: ClientOptions | None = None, rng: random.Random | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.target = target
        self.api_key = api_key
        self.options = replace(options or ClientOptions())  # a copy: the caller's stays as it was
        if language is not None:
            self.options.language = language
        if context is not None:
            self.options.context = context
        self._credentials = _channel_credentials(tls)
        self._rng = rng or random.Random()
        self._clock = clock
        self.stats = TransportStats()

    @overload
    def stream(self, source: AudioSource,
               progress: Literal[False] = False) -> AsyncGenerator[TranscriptEvent, None]: ...

    @overload
    def stream(self, source: AudioSource,
               progress: bool) -> AsyncGenerator[TranscriptEvent | StreamProgress, None]: ...

    async def stream(self, source: AudioSource,
                     progress: bool = False) -> AsyncGenerator[TranscriptEvent | StreamProgress, None]:
        """Transcribe `source` (16 kHz mono float32 pieces, sync or async; an array; a file path):
        yield every transcript event, return once the server has sent the last final. With
        `progress`, `StreamProgress` items come in between, each after the events it accounts for.

        Leaving the loop early stops the stream once the generator is closed: use
        `contextlib.aclosing(client.stream(...))` to have that happen at once."""
        async with aclosing(self._run(source)) as items:
            async for item in items:
                if progress or isinstance(item, TranscriptEvent):
                    yield item

    async def transcribe(self, source) -> str:
        """The whole transcript of `source`: the committed text of all segments, joined as the
        engine joins them (`shared/text.py`)."""
        text = TranscriptText()
        async for e in self.stream(source):
            text.add(e)
        return text.text

    # ---- the owner of one stream: a producer task, a connection task, events out via a queue ----

    async def _run(self, source) -> AsyncGenerator[TranscriptEvent | StreamProgress, None]:
        self.stats = TransportStats()
        state = _StreamState()
        out: asyncio.Queue = asyncio.Queue()
        producer = asyncio.create_task(self._produce(_as_async_pieces(source), state, out),
                                       name="harken-client-produce")
        connection = asyncio.create_task(self._connect_loop(state, out), name="harken-client-connection")
        done_marker = object()
        connection.add_done_callback(lambda _: out.put_nowait(done_marker))

        def producer_done(t: asyncio.Task) -> None:
            if not t.cancelled() and t.exception() is not None:
                out.put_nowait(done_marker)

        producer.add_done_callback(producer_done)
        try:
            while True:
                item = await out.get()
                if item is done_marker:
                    # a failed producer ends the stream with its error; a finished connection ends it
                    if producer.done() and not producer.cancelled():
                        error = producer.exception()
                        if error is not None:
                            raise error
                    if connection.done():
                        while not out.empty():  # events queued before the connection finished
                            item = out.get_nowait()
                            if item is not done_marker:
                                yield item
                        connection.result()  # re-raises its error
                        return
                    continue
                yield item
        finally:
            for task in (producer, connection):
                task.cancel()
            await asyncio.gather(producer, connection, return_exceptions=True)

    async def _produce(self, pieces: AsyncIterator[np.ndarray], state: _StreamState, out: asyncio.Queue) -> None:
        o = self.options
        if o.send_audio:
            await self._produce_audio(pieces, state)
            return
        fs = FeatureStream(mode=o.codec_mode, packet_frames=o.packet_frames)
        samples = 0
        async for pcm in pieces:
            pcm = np.asarray(pcm, dtype=np.float32).reshape(-1)
            # the edge's ONNX work leaves the event loop, so transcript events keep flowing
            packets = await asyncio.to_thread(fs.push, pcm)
            samples += pcm.size
            # a segment not yet opened starts at least the VAD's worst-case delay before the newest
            # frame: feature_stream keeps exactly that look-back for it
            newest_frame = max(0, (samples - 200) // 160)
            state.new_segment_bound_s = max(state.new_segment_bound_s,
                                            (newest_frame - fs.lookback_frames) / FRAMES_PER_SECOND)
            self._enqueue_packets(packets, state)
            out.put_nowait(StreamProgress(self._bound_s(state)))
        packets = await asyncio.to_thread(fs.flush)
        self._enqueue_packets(packets, state)
        state.source_done = True
        state.new_segment_bound_s = math.inf
        state.wake_sender.set()
        out.put_nowait(StreamProgress(self._bound_s(state)))

    async def _produce_audio(self, pieces: AsyncIterator[np.ndarray], state: _StreamState) -> None:
        step = SAMPLE_RATE * self.options.audio_piece_ms // 1000
        pending = np.zeros(0, np.float32)
        position = 0

        def emit(pcm: np.ndarray) -> None:
            nonlocal position
            pcm16 = np.clip(np.round(pcm * 32768.0), -32768, 32767).astype("<i2").tobytes()
            msg = pb.ClientMessage(audio=pb.Audio(pcm16=pcm16, sample_rate=SAMPLE_RATE))
            self._enqueue(state, PendingMessage(0, -1, msg, len(pcm16), 0, first_sample=position,
                                                end_sample=position + pcm.size))
            position += pcm.size
            state.audio_position = position

        async for pcm in pieces:
            pending = np.concatenate([pending, np.asarray(pcm, dtype=np.float32).reshape(-1)])
            while pending.size >= step:
                emit(pending[:step])
                pending = pending[step:]
            await asyncio.sleep(0)
        if pending.size:
            emit(pending)
        state.source_done = True
        state.wake_sender.set()

    def _enqueue_packets(self, packets: list[FeaturePacket], state: _StreamState) -> None:
        for p in packets:
            # segment ids on the wire run ahead of the edge's by one per segment the server ended
            # early (see `_split_open_segment`)
            segment_id = p.segment_id + state.segment_shift
            opens = p.segment_start or state.reopen_segment
            state.reopen_segment = False
            state.open_segment = None if p.segment_end else segment_id
            msg = features_message(p, segment_id=segment_id, segment_start=opens)
            entry = PendingMessage(0, segment_id, msg, len(p.payload), p.frame_count, first_frame=p.first_frame,
                                   segment_start_s=p.first_frame / FRAMES_PER_SECOND if opens else None)
            self.stats.frames_produced += p.frame_count
            self.stats.payload_bytes_produced += len(p.payload)
            self._enqueue(state, entry)

    def _enqueue(self, state: _StreamState, entry: PendingMessage) -> None:
        state.buffer.append(entry)
        if state.buffer.nbytes > self.options.max_buffer_bytes:
            raise BufferOverflowError(
                f"{state.buffer.nbytes} bytes of audio not yet transcribed are buffered (limit "
                f"{self.options.max_buffer_bytes}): the server at {self.target} is too slow or away")
        state.wake_sender.set()

    @staticmethod
    def _bound_s(state: _StreamState) -> float:
        """Lower bound on the start of any final event still to come (for the meeting merger)."""
        # the buffer holds whole unfinished segments, oldest first: its head opens the oldest one
        head = state.buffer.entries[0] if state.buffer.entries else None
        if head is None or head.segment_start_s is None:
            return state.new_segment_bound_s
        return min(state.new_segment_bound_s, head.segment_start_s)

    # ---- connection attempts ---------------------------------------------------------------

    async def _connect_loop(self, state: _StreamState, out: asyncio.Queue) -> None:
        o = self.options
        offline_since: float | None = None
        failures = 0
        probed = False  # the one TLS probe of a plaintext client (see below) is done
        while True:
            try:
                finished = await self._attempt(state, out)
                if finished:
                    return
                failure = "the server closed the stream before the end"
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.NOT_FOUND and state.session_id:
                    # a replacement session at once, not after a backoff: the server is evidently up
                    log.info("session %s… lost on the server (%s): replaying %d messages into a new one",
                             state.session_id[:6], e.details(), len(state.buffer.entries))
                    self._prepare_replacement(state)
                    continue
                if e.code() == grpc.StatusCode.FAILED_PRECONDITION and state.end_sent_in_session \
                        and not state.server_has_end:
                    # our End reached the server on an earlier stream, and this server refuses a
                    # second one: resume once more without it and wait for the finals
                    state.server_has_end = True
                    continue
                # admission control refuses a new stream at once; mid-stream (a replacement session
                # after a restart) the work already sent is worth waiting for, within max_offline_s
                busy = e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and self.stats.sessions_opened > 0
                if e.code() not in RETRYABLE_CODES and not busy:
                    raise ServerRejectedError(e.code().name, e.details() or "") from e
                mismatch = _tls_mismatch(e, self.target, tls=self._credentials is not None)
                if mismatch is None and self._credentials is None and e.code() == grpc.StatusCode.UNAVAILABLE \
                        and not probed and self.stats.sessions_opened == 0 and _closed_at_once(e):
                    # a plaintext client's handshake with a TLS server fails as a bare "Socket
                    # closed": before the stream's first session, ask the port once whether it
                    # speaks TLS (a closed socket is a network fault, too, then retried as ever)
                    probed = True
                    if await _speaks_tls(self.target, min(o.connect_timeout_s, 5.0)):
                        mismatch = (f"the server at {self.target} speaks TLS and this client connects in "
                                    f"plaintext: give the server's CA certificate (--tls-ca FILE; tls= in the SDK)")
                if mismatch is not None:
                    raise TransportSecurityError(
                        mismatch + (self._not_transcribed(state) if state.buffer.entries else "")) from e
                failure = f"{e.code().name}: {e.details()}"
            except (asyncio.TimeoutError, _NoReady, _Silent) as e:
                failure = str(e) or "no Ready in time"
            log.info("stream to %s broke (%s); session %s…", self.target, failure, state.session_id[:6])
            if state.connected_once_this_attempt:
                offline_since, failures = None, 0
            self.stats.failed_attempts += 1
            self.stats.last_failure = failure
            now = self._clock()
            offline_since = now if offline_since is None else offline_since
            offline_s = now - offline_since
            if offline_s >= o.max_offline_s:
                raise ServerUnavailableError(
                    f"server {self.target} unreachable for {offline_s:.1f} s (max_offline_s="
                    f"{o.max_offline_s:g}); last error: {failure}" + self._not_transcribed(state))
            delay = min(o.backoff_max_s, o.backoff_initial_s * o.backoff_multiplier ** failures)
            delay *= 0.5 + 0.5 * self._rng.random()  # jitter: clients cut off together retry apart
            failures += 1
            await asyncio.sleep(min(delay, o.max_offline_s - offline_s))

    @staticmethod
    def _not_transcribed(state: _StreamState) -> str:
        pending = sum(e.frames for e in state.buffer.entries)
        return f"; {pending} feature frames ({len(state.buffer.entries)} messages) were not transcribed"

    def _prepare_replacement(self, state: _StreamState) -> None:
        """The server lost the session: open a new one seeded with the last final's seed and
        replay every unfinished message from seq 1."""
        state.session_id = ""
        state.replacement = True
        state.end_sent_in_session = state.server_has_end = False
        state.last_event_seq = 0
        state.acked_seq = 0
        state.texts.new_session()
        if self.options.send_audio:
            self._realign_audio(state)
        state.buffer.renumber()

    def _realign_audio(self, state: _StreamState) -> None:
        """Thin client: replay from the end of the last final segment; the replacement session's
        times are then relative to that point."""
        piece_samples = SAMPLE_RATE * self.options.audio_piece_ms // 1000
        start = state.buffer.realign_audio(state.final_end_sample, state.audio_position, piece_samples)
        state.replay_offset_s = start / SAMPLE_RATE
        log.info("thin client: replaying the audio from %.2f s", state.replay_offset_s)

    async def _attempt(self, state: _StreamState, out: asyncio.Queue) -> bool:
        """One stream call: Start/Ready, then send and receive until the server closes it.
        True when the whole stream is done (End sent, server closed with OK)."""
        state.connected_once_this_attempt = False
        state.end_written = False
        o = self.options
        async with self._channel() as channel:
            stub = harken_pb2_grpc.TranscriptionStub(channel)
            metadata = (("authorization", f"Bearer {self.api_key}"),) if self.api_key else None
            call = stub.Stream(metadata=metadata)
            tasks: set[asyncio.Task] = set()
            try:
                start = pb.Start(language=o.language, context=o.context,
                                 codec="" if o.send_audio else CODEC_NAME, session_id=state.session_id,
                                 last_event_seq=state.last_event_seq if state.session_id else 0)
                if not state.session_id and state.replacement and state.seed is not None:
                    start.seed.CopyFrom(state.seed)
                await call.write(pb.ClientMessage(start=start))
                first = await asyncio.wait_for(call.read(), o.connect_timeout_s)
                if first is grpc.aio.EOF:
                    await _raise_status(call)
                    raise _NoReady("the server closed the stream without Ready")
                if first.WhichOneof("kind") == "error":
                    await _raise_status(call)
                if first.WhichOneof("kind") != "ready":
                    raise ServerRejectedError("PROTOCOL", f"expected Ready, got {first.WhichOneof('kind')}")
                self._on_ready(first.ready, state)
                state.connected_once_this_attempt = True
                receiver = asyncio.create_task(self._receive(call, state, out), name="harken-client-receive")
                tasks = {receiver, asyncio.create_task(self._send(call, state), name="harken-client-send"),
                         asyncio.create_task(self._watch(state), name="harken-client-watch")}
                while True:
                    done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
                    if receiver in done:
                        return receiver.result()
                    for t in done:
                        t.result()  # the sender's or the watchdog's error ends the attempt
                        tasks.discard(t)  # the sender is done after End: wait for the finals
            finally:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                call.cancel()

    def _channel(self) -> AbstractAsyncContextManager[Any]:
        """A channel for the stub, entered per attempt: a grpc.aio.Channel (the WebRTC client's
        stands in for one)."""
        # a fresh channel, and connection, per attempt: grpc's own reconnect backoff (up to
        # minutes) stays out of the way of ours, a restarted server is found at once, and a dead
        # connection is not shared into the next attempt (channels share subchannels by default)
        options: list[tuple[str, int | str]] = [("grpc.max_receive_message_length", 16 << 20),
                                                ("grpc.use_local_subchannel_pool", 1)]
        if self._credentials is None:
            return grpc.aio.insecure_channel(self.target, options=options)
        if self.options.tls_server_name:
            options.append(("grpc.ssl_target_name_override", self.options.tls_server_name))
        return grpc.aio.secure_channel(self.target, self._credentials, options=options)

    def _on_ready(self, ready: pb.Ready, state: _StreamState) -> None:
        if not state.session_id:
            self.stats.sessions_opened += 1
            state.replacement = False
        else:
            self.stats.resumes += 1
        state.session_id = ready.session_id
        if ready.resume_after_seq >= state.buffer.next_seq:
            raise ServerRejectedError("PROTOCOL", f"server applied seq {ready.resume_after_seq}, "
                                                  f"but only {state.buffer.next_seq - 1} were sent")
        state.sent_through = ready.resume_after_seq
        state.acked_seq = ready.resume_after_seq
        state.last_heard = self._clock()
        state.wake_sender.set()

    async def _receive(self, call, state: _StreamState, out: asyncio.Queue) -> bool:
        """Handle the server's messages until it closes the stream; True if the stream is done."""
        while True:
            msg = await call.read()
            state.last_heard = self._clock()
            if msg is grpc.aio.EOF:
                await _raise_status(call)
                # OK after our End: all finals are in. OK without it (a server shutting down):
                # resume, or replay into a new session
                return state.end_written or state.server_has_end
            self._on_message(msg, state, out)

    async def _watch(self, state: _StreamState) -> None:
        """Raise `_Silent` when the server owes us something (an ack, finals, the end) and the
        connection has carried nothing for `silence_timeout_s`."""
        limit = self.options.silence_timeout_s
        while True:
            await asyncio.sleep(min(1.0, limit / 4))
            owed = state.sent_through > state.acked_seq or state.end_written or state.buffer.entries
            quiet_s = self._clock() - state.last_heard
            if owed and quiet_s > limit:
                raise _Silent(f"nothing from the server for {quiet_s:.1f} s")

    async def _send(self, call, state: _StreamState) -> None:
        """Write every buffered message after `sent_through`, then End once the source is done."""
        while True:
            state.wake_sender.clear()
            while (entry := state.buffer.after(state.sent_through)) is not None:
                getattr(entry.message, entry.message.WhichOneof("kind")).seq = entry.seq
                await call.write(entry.message)
                state.sent_through = entry.seq
                self.stats.messages_sent += 1
                self.stats.frames_sent += entry.frames
                if entry.times_sent:
                    self.stats.messages_resent += 1
                    self.stats.frames_resent += entry.frames
                entry.times_sent += 1
            if state.source_done and state.buffer.after(state.sent_through) is None:
                if not state.server_has_end:
                    await call.write(pb.ClientMessage(end=pb.End()))
                    state.end_written = state.end_sent_in_session = True
                await call.done_writing()
                return
            await state.wake_sender.wait()

    # ---- server -> client ------------------------------------------------------------------

    def _on_message(self, msg: pb.ServerMessage, state: _StreamState, out: asyncio.Queue) -> None:
        kind = msg.WhichOneof("kind")
        if kind == "transcript":
            t = msg.transcript
            if t.event_seq and t.event_seq <= state.last_event_seq:
                self.stats.duplicate_events += 1
                return
            state.last_event_seq = max(state.last_event_seq, t.event_seq)
            event = self._deliver(t, state)
            if event is not None:
                out.put_nowait(event)
            if t.is_final:
                if t.seed.present:
                    state.seed = pb.SessionSeed()
                    state.seed.CopyFrom(t.seed)
                if not self.options.send_audio:
                    self._split_open_segment(t.segment_id, round(t.end_s * FRAMES_PER_SECOND), state)
                self._segment_final(t.segment_id, state, t.end_s)
                out.put_nowait(StreamProgress(self._bound_s(state)))
        elif kind == "ack":
            state.acked_seq = max(state.acked_seq, msg.ack.seq)
            if self.options.send_audio:
                self._trim_audio(state)
            elif msg.ack.last_final_segment > state.last_final_segment:
                # the server's finals come before its Ack on the stream, so they are with us
                self._segment_final(msg.ack.last_final_segment, state, None)
                out.put_nowait(StreamProgress(self._bound_s(state)))
        elif kind == "error":
            pass  # the stream's status follows with the same code; handled there

    def _split_open_segment(self, segment_id: int, end_frame: int, state: _StreamState) -> None:
        """A final before the segment's end (a server shutting down finalises open segments):
        the rest of the segment continues as a new one, so no frame is lost."""
        still_open = state.open_segment == segment_id
        split, continued = state.buffer.split_segment(segment_id, end_frame, still_open)
        if not split:
            return
        log.info("segment %d ended early on the server (frame %d): the rest continues as segment %d",
                 segment_id, end_frame, segment_id + 1)
        state.segment_shift += 1
        if state.open_segment is not None and state.open_segment >= segment_id:
            state.open_segment += 1
        if still_open and not continued:
            state.reopen_segment = True  # the edge's next packet of it opens the continuation
        state.wake_sender.set()

    def _segment_final(self, segment_id: int, state: _StreamState, end_s: float | None) -> None:
        state.last_final_segment = max(state.last_final_segment, segment_id)
        state.texts.forget_through(state.last_final_segment)
        if self.options.send_audio:
            if end_s is not None:
                state.final_end_sample = max(state.final_end_sample,
                                             int(round((end_s + state.replay_offset_s) * SAMPLE_RATE)))
                self._trim_audio(state)
        else:
            state.buffer.drop_segments_through(state.last_final_segment)

    @staticmethod
    def _trim_audio(state: _StreamState) -> None:
        """Thin client: keep for a replay what a lost session had not finished, the audio since
        the last final segment (at most the last minute), and what the server has not applied."""
        keep_from = align_down(max(state.final_end_sample,
                                    state.audio_position - THIN_REPLAY_MAX_S * SAMPLE_RATE))
        state.buffer.drop_audio_before(state.acked_seq, keep_from)

    def _deliver(self, t: pb.Transcript, state: _StreamState) -> TranscriptEvent | None:
        """The event as the user sees it (see `ReplayFilter`), or None when it shows nothing new."""
        seg = t.segment_id
        if seg <= state.last_final_segment:  # a replayed event of a segment the user has whole
            self.stats.duplicate_events += 1
            return None
        visible = state.texts.filter(seg, t.committed_delta, t.partial, t.is_final)
        self.stats.replayed_text_chars = state.texts.dropped_chars
        self.stats.replay_mismatches = state.texts.mismatches
        if visible is None:
            return None
        delta, partial = visible
        offset = state.replay_offset_s
        return TranscriptEvent(segment_id=seg, committed_delta=delta, partial=partial, stability=t.stability,
                               start_s=t.start_s + offset, end_s=t.end_s + offset, language=t.language,
                               is_final=t.is_final)


class _NoReady(Exception):
    pass


class _Silent(Exception):
    """The connection carried nothing while the server owed us something: presumed dead."""


async def _raise_status(call) -> None:
    """Raise the call's final status as an AioRpcError (the caller classifies it)."""
    code = await call.code()
    details = await call.details()
    if code == grpc.StatusCode.OK:
        return
    raise grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


# BoringSSL's verdicts in a failed handshake that no retry can change (gRPC puts them in the
# UNAVAILABLE status's details): what each means, in words. A connection that breaks during the
# handshake (a network fault) reads SSL_ERROR_SYSCALL, "Socket closed" or a reset, and is retried.
_TLS_VERDICTS = (
    ("CERTIFICATE_VERIFY_FAILED", "the server's certificate is not signed by the CA certificate given "
                                  "(--tls-ca), or has expired"),
    ("Hostname Verification Check failed", "the server's certificate is not issued for the name "
                                           "connected to"),
    ("WRONG_VERSION_NUMBER", "the server does not speak TLS (a plaintext server?): connect without "
                             "--tls-ca (tls=None in the SDK), or to the server's TLS port"),
    ("HTTP_REQUEST", "the server does not speak TLS"),
    ("CERTIFICATE_REQUIRED", "the server wants a client certificate"),
    ("TLSV1_ALERT", "the server refused the TLS handshake"),
    ("SSLV3_ALERT", "the server refused the TLS handshake"),
    ("NO_APPLICATION_PROTOCOL", "the server does not offer gRPC (HTTP/2) over TLS"),
)


def _tls_mismatch(e: grpc.aio.AioRpcError, target: str, tls: bool) -> str | None:
    """A one-line explanation when `e` is a TLS handshake that failed for good, else None."""
    if e.code() != grpc.StatusCode.UNAVAILABLE or not tls:
        return None
    details = e.details() or ""
    if "SSL_ERROR_SSL" not in details and "Hostname Verification" not in details:
        return None  # no handshake verdict: a connection that broke, retried as ever
    for marker, meaning in _TLS_VERDICTS:
        if marker in details:
            reason = details[details.find(marker):].split(":", 2)
            said = ":".join(reason[:2]).strip() if marker.isupper() else marker
            return f"TLS handshake with {target} failed: {meaning} ({said})"
    return None


def _closed_at_once(e: grpc.aio.AioRpcError) -> bool:
    """The connection was closed by the other end before gRPC could use it (what a TLS server does
    to a plaintext client's HTTP/2 preface), not refused or timed out."""
    details = e.details() or ""
    return "Socket closed" in details or "Connection reset" in details or "End of TCP stream" in details


async def _speaks_tls(target: str, timeout_s: float) -> bool:
    """Whether `target` ("host:port") completes a TLS handshake (certificate not checked: only the
    protocol is asked)."""
    import ssl

    host, sep, port = target.removeprefix("dns:///").removeprefix("ipv4:").removeprefix("ipv6:").rpartition(":")
    if not sep or not port.isdigit():
        return False
    host = host.strip("[]")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    ctx.set_alpn_protocols(["h2"])
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, int(port), ssl=ctx), timeout_s)
    except (OSError, ssl.SSLError, asyncio.TimeoutError, ValueError):
        return False
    writer.close()
    try:
        await asyncio.wait_for(writer.wait_closed(), 1.0)
    except (OSError, ssl.SSLError, asyncio.TimeoutError):
        pass
    return True


def _channel_credentials(tls: bool | str | Path | None) -> grpc.ChannelCredentials | None:
    if tls is None or tls is False:
        return None
    if tls is True:
        return grpc.ssl_channel_credentials()
    return grpc.ssl_channel_credentials(root_certificates=Path(tls).read_bytes())


async def _as_async_pieces(source) -> AsyncIterator[np.ndarray]:
    """Any supported source as an async iterator of float32 pieces. Sync iterables are pulled on
    a worker thread: a microphone iterator blocks until its next block arrives."""
    if isinstance(source, (str, Path)):
        source = await asyncio.to_thread(file_pieces, source)
    elif isinstance(source, np.ndarray):
        source = audio_pieces(source)
    if hasattr(source, "__aiter__"):
        async for piece in source:
            yield piece
        return
    it = iter(source)
    done = object()
    while (piece := await asyncio.to_thread(next, it, done)) is not done:
        yield piece
