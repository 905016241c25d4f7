"""The server's stream handler: one stream of one caller, whatever carries it (the semantics in
proto/harken.proto).

    caller's metadata, client messages (shared/protocol) in
        -> auth (bearer key) -> `start` -> SessionTable (new / resume) -> Ready, replay
        -> reader task: every message -> HostedSession.apply -> Scheduler
    Scheduler (one task owns the model) -> session's events -> event log -> this stream
        -> server messages (shared/protocol) out; the end is the status: OK (the generator
           returns) or `StreamFailed(code, message)`, after an Error message carrying the same

`StreamHandler.run` is the one implementation; every transport is an adapter around it: gRPC
(cloud/adapters/grpc_service.py: a StreamFailed becomes `context.abort`), the Ray replica (cloud/ray_app.py:
the status goes on Serve's context), the WebRTC data channel (cloud/adapters/webrtc.py: a status frame),
the Realtime WebSocket (cloud/adapters/realtime_api.py) and the fuzzer (lab/bench/fuzz_targets.py). Those that
carry serialized messages use `run_proto`: bytes in (parsed by `ClientMessages`), proto messages
out (shared/wire.py); the ones that are no gRPC call queue what they receive in a `RequestQueue`.

It only moves messages: it authenticates, attaches the stream to its session, then yields what
the session has for it while a reader task applies what the client sends; every rule of the
session itself is the session's (cloud/hosting/server_session.py). Errors become status codes in one
place (`STATUS_OF`). A stream's error ends that stream only.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterable, AsyncIterator
from contextlib import aclosing
from typing import Any

from .audio_front_end import check_seeded_front_end
from ..base.auth import OPEN_ACCESS, ApiKeys, Caller
from ..base.errors import IdleTimeout, MessageTooLarge, NotYourSession, ShuttingDown, Superseded, Unauthenticated
from .hosted_session import HostedSession, woken
from ..base.metrics import ServerMetrics
from .server_session import CLOSED_OK, Attachment
from .session_table import SessionTable
from ...proto import harken_pb2 as pb
from ...shared import wire
from ...shared.errors import (CodecError, HarkenError, MalformedMessage, OutOfOrder, Overloaded, SessionNotFound,
                                  StreamInputError)
from ...shared.protocol import (Ack, Audio, ClientMessage, End, Features, KeepAlive, Ready, ServerError,
                                    ServerMessage, Start)

MAX_MESSAGE_BYTES = 1 << 20  # a longer request: RESOURCE_EXHAUSTED (`harken serve --max-message-bytes`)

log = logging.getLogger("harken.server")

# The one place where errors become status codes (gRPC's names, on every transport). Looked up
# along the exception's MRO, so the service's own errors and the engine's map alike; anything
# else is INTERNAL.
STATUS_OF: dict[type, str] = {
    CodecError: "INVALID_ARGUMENT",
    StreamInputError: "INVALID_ARGUMENT",  # incl. MalformedMessage
    OutOfOrder: "FAILED_PRECONDITION",
    Unauthenticated: "UNAUTHENTICATED",
    NotYourSession: "PERMISSION_DENIED",
    SessionNotFound: "NOT_FOUND",
    Overloaded: "RESOURCE_EXHAUSTED",
    MessageTooLarge: "RESOURCE_EXHAUSTED",
    IdleTimeout: "DEADLINE_EXCEEDED",
    ShuttingDown: "UNAVAILABLE",
    Superseded: "ABORTED",
}
INTERNAL = "INTERNAL"
# Errors of the input itself: the session they happened in is dropped (it cannot go on coherently).
_INPUT_ERRORS = (CodecError, StreamInputError, OutOfOrder, MessageTooLarge)

# A dropped connection ends the request iterator, then cancels the call within milliseconds
# (on loopback it came before a reader polling every millisecond looked once); a half-close is
# followed by nothing. The margin is wide because a wrong guess costs a resuming client its open segment.
HALF_CLOSE_SETTLE_S = 0.5

# How long a stream that failed keeps reading (and dropping) what its client still sends.
ERROR_DRAIN_S = 2.0


def status_name(e: BaseException) -> str:
    """The status code (its name) a stream that failed with `e` ends with."""
    for cls in type(e).__mro__:
        code = STATUS_OF.get(cls)
        if code is not None:
            return code
    return INTERNAL


class StreamFailed(Exception):
    """The stream's final status when it is not OK: `code` a status code name (`STATUS_OF`)."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code, self.message = code, message


class StreamHandler:
    """`run`: one session attempt per stream."""

    def __init__(self, table: SessionTable, keys: ApiKeys | None, metrics: ServerMetrics,
                 max_message_bytes: int = MAX_MESSAGE_BYTES):
        self.table = table
        self.keys = keys
        self.metrics = metrics
        self.max_message_bytes = max_message_bytes  # a longer request: RESOURCE_EXHAUSTED

    def parse(self, requests: AsyncIterable[bytes]) -> ClientMessages:
        """Serialized client messages -> messages for `run` (checked against `max_message_bytes`)."""
        return ClientMessages(requests, self.max_message_bytes)

    async def run_proto(self, metadata: Any, requests: AsyncIterable[bytes]) -> AsyncGenerator[pb.ServerMessage, None]:
        """`run` over the serialized messages of the wire: bytes in, proto messages out. A message
        that cannot be made proto fails the stream inside `run`, as any fault of the server does."""
        async with aclosing(self.run(metadata, self.parse(requests))) as messages:
            async for message in messages:
                while True:
                    try:
                        out = wire.server_message_to_proto(message)
                        break
                    except Exception as e:  # noqa: BLE001 - handled by `run`, where it is thrown in
                        try:
                            message = await messages.athrow(e)
                        except StopAsyncIteration:
                            return
                yield out

    async def run(self, metadata: Any, requests: AsyncIterator[ClientMessage]) -> AsyncGenerator[ServerMessage, None]:
        """One stream: `metadata` the caller's (key, value) pairs, `requests` what it sends, up to
        its half-close (an exception from it, e.g. `ClientMessages`' parse errors, is the input's
        error). Yields what to send; returns for OK, raises `StreamFailed` otherwise. Closing it
        (or cancelling its consumer) is the stream dropping: the session waits for a resume."""
        session: HostedSession | None = None
        attachment: Attachment | None = None
        try:
            caller = self._authenticate(metadata)
            start = await _first(requests)
            if start.session_id:
                session = self.table.find(caller.key_id, start.session_id)
                attachment = await session.attach(start.last_event_seq)
            else:
                session = await self.table.open(caller.key_id, start)
                attachment = await session.attach(0)
            log.info("stream attached", extra={"fields": {
                "session": session.session_id[:6], "key": caller.key_id, "resume": bool(start.session_id),
                "resume_after_seq": session.applied_seq}})
            attachment.reader = asyncio.get_running_loop().create_task(
                _read(requests, self.table, session, attachment), name=f"reader-{session.session_id[:6]}")
            yield Ready(session.session_id, session.applied_seq, session.last_final_segment, keep_alive=True,
                        word_timings=session.word_timings, turn_events=session.turn_events,
                        diarize=session.speaker_labels)
            async for message in _outgoing(session, attachment):
                yield message
            # every event of the ended session went out on this stream: nothing left to resume
            await self.table.discard(session)
        except Exception as e:
            code = status_name(e)
            self.metrics.errors.labels(code).inc()
            details = str(e) if code != INTERNAL else "internal error"
            fields = {"code": code, "error": type(e).__name__,
                      "session": session.session_id[:6] if session else None}
            if code == INTERNAL:
                log.error("stream failed", exc_info=e, extra={"fields": fields})
            else:
                log.info("stream ended with an error", extra={"fields": {**fields, "message": details}})
            if session is not None and isinstance(e, _INPUT_ERRORS):
                await self.table.discard(session)
            # the same code and message as a last message too: a grpc.aio client that is still
            # writing when the stream ends may be shown INTERNAL instead of the status (grpc#36066)
            yield ServerError(code, details)
            if attachment is None or attachment.reader is None or attachment.reader.done():
                await _drain(requests)  # nobody else reads them
            raise StreamFailed(code, details) from e
        finally:
            if attachment is not None:
                assert session is not None  # the session it is attached to
                # first, with no await before it: a handler cancelled again while it waits (a
                # client that drops at once) must still give its attachment back
                session.detach(attachment)
                if attachment.reader is not None:
                    attachment.reader.cancel()
                    await asyncio.wait([attachment.reader])

    def _authenticate(self, metadata: Any) -> Caller:
        if self.keys is None:
            return Caller(OPEN_ACCESS)
        return self.keys.authenticate(metadata)


class ClientMessages:
    """Serialized `harken.v1.ClientMessage`s -> shared/protocol messages, each parsed as it is
    read (so bytes that are no ClientMessage, or a message over `max_bytes`, are that stream's
    error when it gets to them, with a reason). The first must be `start`: its kind is checked
    before the rest of it is parsed. A message that does not parse does not end the iteration:
    the next read takes the next message (what the error drain reads on)."""

    def __init__(self, requests: AsyncIterable[bytes], max_bytes: int | None):
        self._requests = aiter(requests)
        self._max_bytes = max_bytes
        self._first = True

    def __aiter__(self) -> ClientMessages:
        return self

    async def __anext__(self) -> ClientMessage:
        msg = wire.client_message_from_bytes(await anext(self._requests), self._max_bytes)
        if self._first:
            self._first = False
            return wire.require_start(msg, front_end=check_seeded_front_end)
        return wire.client_message_from_proto(msg, front_end=check_seeded_front_end)


class RequestQueue:
    """The request side of a stream that is no gRPC call (a WebRTC data channel, a Realtime
    WebSocket): serialized client messages as they arrive, ending at `end()` (a half-close, or the
    channel closing)."""

    _END = object()

    def __init__(self) -> None:
        self.queue: asyncio.Queue = asyncio.Queue()

    def put(self, data: bytes) -> None:
        self.queue.put_nowait(data)

    def end(self) -> None:
        self.queue.put_nowait(self._END)

    def __aiter__(self) -> RequestQueue:
        return self

    async def __anext__(self) -> bytes:
        item = await self.queue.get()
        if item is self._END:
            self.queue.put_nowait(self._END)
            raise StopAsyncIteration
        return item


async def _first(requests: AsyncIterator[ClientMessage]) -> Start:
    async for item in requests:
        if not isinstance(item, Start):
            raise OutOfOrder(f"the first message must be start, got {type(item).__name__.lower()}")
        return item
    raise MalformedMessage("the stream ended before its first message (start)")


async def _apply(session: HostedSession, item: ClientMessage) -> None:
    """Apply one message; if the stream is cancelled meanwhile, the message is still finished."""
    applying = asyncio.ensure_future(session.apply(item))
    try:
        await asyncio.shield(applying)
    except asyncio.CancelledError:
        await asyncio.wait([applying])
        if not applying.cancelled():
            applying.exception()  # retrieved: the stream is gone, nobody is told anyway
        raise


async def _drain(requests: AsyncIterator[ClientMessage]) -> None:
    """Read the client's remaining messages (up to its half-close, for at most ERROR_DRAIN_S)
    before the status goes out. A client still writing when the server ends the call has its write
    fail, and grpc.aio then reports INTERNAL ("Internal error from Core") in place of the status
    the server sent (grpc#36066): 1 in 2 calls without an API key from a client that streams on at
    once. Reading until the client stops writing lets its status arrive as sent. What is read is
    dropped, messages that do not parse too; any other error of the request side ends the drain."""
    async def read_all():
        while True:
            try:
                await anext(requests)
            except StopAsyncIteration:
                return
            except HarkenError:
                continue  # a message that does not parse: dropped like the rest

    try:
        await asyncio.wait_for(read_all(), ERROR_DRAIN_S)
    except Exception:  # noqa: BLE001 - time is up, or the transport's read failed (e.g. gRPC's)
        pass


async def _read(requests: AsyncIterator[ClientMessage], table: SessionTable, session: HostedSession,
                attachment: Attachment) -> None:
    """Owned by the stream: apply the client's messages in order, each once the session and its
    key are within their queued-audio limits. A message being applied is finished even when the
    stream is cancelled meanwhile (see `HostedSession.attach`)."""
    try:
        async for item in requests:
            session.heard(attachment)
            if isinstance(item, KeepAlive):
                continue  # heard: that was all it was for
            await table.wait_for_room(session, _audio_seconds(item))
            await _apply(session, item)
        # The request side ended. A client that half-closes without `end` has said all it will:
        # that is `end` (finalise, send the finals, close OK). But grpc.aio also ends the iterator
        # when the connection drops, a moment before it cancels the call (which cancels this
        # task); such a client will resume, and its session must not end. So wait for that
        # cancellation a little before taking the half-close for `end`.
        await asyncio.sleep(HALF_CLOSE_SETTLE_S)
        await _apply(session, End())
    except asyncio.CancelledError:
        raise
    except ShuttingDown:
        return  # input while the server stops: the session sends its finals, then ends the stream
    except Exception as e:
        attachment.notify(end=e)  # (the first reason to end the stream is the one it ends with)


def _audio_seconds(item: ClientMessage) -> float:
    """The audio a message carries, for the stream's pace."""
    if isinstance(item, Audio):
        return len(item.pcm16) / 2 / item.sample_rate
    if isinstance(item, Features):
        return item.packet.frame_count / 100
    return 0.0


async def _outgoing(session: HostedSession, a: Attachment) -> AsyncGenerator[ServerMessage, None]:
    """What the stream sends after Ready: events (Transcripts, WordTimings, Turns) after `a.sent_event_seq`
    (replay first), Acks, and at the end the remaining events, a last Ack, then OK or the stream's
    error."""
    while True:
        await woken(a)
        end = a.end
        for event in session.events_after(a.sent_event_seq):
            yield event
            session.sent(a, event.event_seq)
        if a.ack_due or end is not None:
            a.ack_due = False
            yield Ack(session.applied_seq, session.last_final_segment)
        if end is not None:
            if end == CLOSED_OK:
                return
            assert isinstance(end, BaseException)  # the only other end
            raise end


__all__ = ["StreamHandler", "StreamFailed", "ClientMessages", "RequestQueue", "STATUS_OF", "status_name",
           "MAX_MESSAGE_BYTES", "HALF_CLOSE_SETTLE_S", "ERROR_DRAIN_S"]
