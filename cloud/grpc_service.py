"""The gRPC driver of the service: `harken.v1.Transcription/Stream` over the session table.

    client stream -> auth (bearer key) -> `start` -> SessionTable (new / resume) -> Ready, replay
                  -> reader task: every message -> wire (parse) -> HostedSession.apply -> Scheduler
    Scheduler (one task owns the model) -> session's events -> event log -> this stream -> client

It only moves bytes: it authenticates, attaches the stream to its session, then yields what the
session has for it while a reader task applies what the client sends; every rule of the session
protocol is the session's (cloud/server_session.py). Errors become gRPC status codes in one place
(`STATUS_OF`). A stream's error ends that stream only. The WebRTC data channel (cloud/webrtc.py)
runs this same handler over its own bytes.
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from harken.cloud.audio_front_end import check_seeded_front_end
from harken.cloud.auth import OPEN_ACCESS, ApiKeys, Caller
from harken.cloud.errors import IdleTimeout, MessageTooLarge, NotYourSession, ShuttingDown, Superseded, Unauthenticated
from harken.cloud.metrics import ServerMetrics
from harken.cloud.hosted_session import HostedSession, woken
from harken.cloud.server_session import CLOSED_OK, Attachment
from harken.cloud.session_table import SessionTable
from harken.proto import harken_pb2, harken_pb2_grpc
from harken.shared import wire
from harken.shared.errors import CodecError, MalformedMessage, OutOfOrder, Overloaded, SessionNotFound, StreamInputError
from harken.shared.protocol import Ack, Audio, ClientMessage, End, Features, KeepAlive, Ready, ServerError

MAX_MESSAGE_BYTES = 1 << 20  # a longer request: RESOURCE_EXHAUSTED (`harken serve --max-message-bytes`)

log = logging.getLogger("harken.server")

SERVICE_NAME = harken_pb2.DESCRIPTOR.services_by_name["Transcription"].full_name

# The one place where errors become status codes. Looked up along the exception's MRO, so the
# service's own errors and the engine's map alike; anything else is INTERNAL.
STATUS_OF: dict[type, grpc.StatusCode] = {
    CodecError: grpc.StatusCode.INVALID_ARGUMENT,
    StreamInputError: grpc.StatusCode.INVALID_ARGUMENT,  # incl. MalformedMessage
    OutOfOrder: grpc.StatusCode.FAILED_PRECONDITION,
    Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    NotYourSession: grpc.StatusCode.PERMISSION_DENIED,
    SessionNotFound: grpc.StatusCode.NOT_FOUND,
    Overloaded: grpc.StatusCode.RESOURCE_EXHAUSTED,
    MessageTooLarge: grpc.StatusCode.RESOURCE_EXHAUSTED,
    IdleTimeout: grpc.StatusCode.DEADLINE_EXCEEDED,
    ShuttingDown: grpc.StatusCode.UNAVAILABLE,
    Superseded: grpc.StatusCode.ABORTED,
}
# Errors of the input itself: the session they happened in is dropped (it cannot go on coherently).
_INPUT_ERRORS = (CodecError, StreamInputError, OutOfOrder, MessageTooLarge)

# gRPC's own receive limit, as a multiple of `max_message_bytes`. harken checks the limit itself,
# so that a message over it gets harken's status, Error message and error count; gRPC rejects a
# message only past this ceiling, which bounds what it buffers of one. Such a rejection only ends
# the request stream as a half-close or a dropped connection would, so it is not counted.
GRPC_RECEIVE_CEILING = 4


def status_of(e: BaseException) -> grpc.StatusCode:
    for cls in type(e).__mro__:
        code = STATUS_OF.get(cls)
        if code is not None:
            return code
    return grpc.StatusCode.INTERNAL


class TranscriptionService(harken_pb2_grpc.TranscriptionServicer):
    """`Stream`: one session attempt per call (see the semantics in proto/harken.proto)."""

    def __init__(self, table: SessionTable, keys: ApiKeys | None, metrics: ServerMetrics,
                 max_message_bytes: int = MAX_MESSAGE_BYTES):
        self.table = table
        self.keys = keys
        self.metrics = metrics
        self.max_message_bytes = max_message_bytes  # a longer request: RESOURCE_EXHAUSTED

    async def Stream(self, requests, context):
        session: HostedSession | None = None
        attachment: Attachment | None = None
        try:
            caller = self._authenticate(context)
            start = wire.require_start(await _first(requests, self.max_message_bytes), front_end=check_seeded_front_end)
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
                _read(requests, self.table, session, attachment, self.max_message_bytes),
                name=f"reader-{session.session_id[:6]}")
            yield wire.server_message_to_proto(Ready(session.session_id, session.applied_seq, session.last_final_segment,
                                             keep_alive=True))
            async for message in _outgoing(session, attachment):
                yield message
            # every event of the ended session went out on this stream: nothing left to resume
            await self.table.discard(session)
        except Exception as e:
            code = status_of(e)
            self.metrics.errors.labels(code.name).inc()
            message = str(e) if code is not grpc.StatusCode.INTERNAL else "internal error"
            fields = {"code": code.name, "error": type(e).__name__,
                      "session": session.session_id[:6] if session else None}
            if code is grpc.StatusCode.INTERNAL:
                log.error("stream failed", exc_info=e, extra={"fields": fields})
            else:
                log.info("stream ended with an error", extra={"fields": {**fields, "message": message}})
            if session is not None and isinstance(e, _INPUT_ERRORS):
                await self.table.discard(session)
            # the same code and message as a last message too: a grpc.aio client that is still
            # writing when the stream ends may be shown INTERNAL instead of the status (grpc#36066)
            yield wire.server_message_to_proto(ServerError(code.name, message))
            if attachment is None or attachment.reader is None or attachment.reader.done():
                await _drain(requests)  # nobody else reads them
            await context.abort(code, message)
        finally:
            if attachment is not None:
                assert session is not None  # the session it is attached to
                # first, with no await before it: a handler cancelled again while it waits (a
                # client that drops at once) must still give its attachment back
                session.detach(attachment)
                if attachment.reader is not None:
                    attachment.reader.cancel()
                    await asyncio.wait([attachment.reader])

    def _authenticate(self, context) -> Caller:
        if self.keys is None:
            return Caller(OPEN_ACCESS)
        return self.keys.authenticate(context.invocation_metadata())


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


# A dropped connection ends the request iterator, then cancels the call within milliseconds
# (on loopback it came before a reader polling every millisecond looked once); a half-close is
# followed by nothing. The margin is wide because a wrong guess costs a resuming client its open segment.
HALF_CLOSE_SETTLE_S = 0.5

# How long a stream that failed keeps reading (and dropping) what its client still sends.
ERROR_DRAIN_S = 2.0


async def _drain(requests) -> None:
    """Read the client's remaining messages (up to its half-close, for at most ERROR_DRAIN_S)
    before the status goes out. A client still writing when the server ends the call has its write
    fail, and grpc.aio then reports INTERNAL ("Internal error from Core") in place of the status
    the server sent (grpc#36066): 1 in 2 calls without an API key from a client that streams on at
    once. Reading until the client stops writing lets its status arrive as sent."""
    async def read_all():
        async for _ in requests:
            pass

    try:
        await asyncio.wait_for(read_all(), ERROR_DRAIN_S)
    except (TimeoutError, grpc.RpcError, asyncio.InvalidStateError):
        pass


async def _first(requests, max_bytes: int):
    async for data in requests:
        return wire.client_message_from_bytes(data, max_bytes)
    raise MalformedMessage("the stream ended before its first message (start)")


async def _read(requests, table: SessionTable, session: HostedSession, attachment: Attachment,
                max_bytes: int) -> None:
    """Owned by the stream: apply the client's messages in order, each once the session and its
    key are within their queued-audio limits. A message being applied is finished even when the
    stream is cancelled meanwhile (see `HostedSession.attach`)."""
    try:
        async for data in requests:
            session.heard(attachment)
            item = wire.client_message_from_proto(wire.client_message_from_bytes(data, max_bytes), front_end=check_seeded_front_end)
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


async def _outgoing(session: HostedSession, a: Attachment):
    """What the stream sends after Ready: events after `a.sent_event_seq` (replay first), Acks,
    and at the end the remaining events, a last Ack, then OK or the stream's error."""
    while True:
        await woken(a)
        end = a.end
        for event in session.events_after(a.sent_event_seq):
            yield wire.server_message_to_proto(event)
            session.sent(a, event.event_seq)
        if a.ack_due or end is not None:
            a.ack_due = False
            yield wire.server_message_to_proto(Ack(session.applied_seq, session.last_final_segment))
        if end is not None:
            if end == CLOSED_OK:
                return
            assert isinstance(end, BaseException)  # the only other end
            raise end


def service_handler(service: TranscriptionService) -> grpc.GenericRpcHandler:
    """The generated registration, except that requests arrive as bytes (see wire.client_message_from_bytes)."""
    return grpc.method_handlers_generic_handler(SERVICE_NAME, {
        "Stream": grpc.stream_stream_rpc_method_handler(
            service.Stream, request_deserializer=None,
            response_serializer=harken_pb2.ServerMessage.SerializeToString),
    })
