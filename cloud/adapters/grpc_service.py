"""The gRPC adapter of the service: `harken.v1.Transcription/Stream` runs the stream handler.

    gRPC call (request bytes, metadata) -> StreamHandler.run_proto (cloud/hosting/stream_handler.py)
        -> ServerMessage protos -> the call; StreamFailed(code, message) -> context.abort

Every rule of a stream (auth, attach, replay, acks, the half-close settle, the error drain, which
error is which status) is the handler's; this module maps its final status onto the call and
registers the method with requests as bytes (the handler parses them itself, so that bytes that
are no ClientMessage get INVALID_ARGUMENT with a reason instead of a generic failure).
"""

from __future__ import annotations

from contextlib import aclosing

import grpc

from ..hosting.stream_handler import MAX_MESSAGE_BYTES, StreamFailed, StreamHandler, status_name
from ...proto import harken_pb2, harken_pb2_grpc

SERVICE_NAME = harken_pb2.DESCRIPTOR.services_by_name["Transcription"].full_name

# gRPC's own receive limit, as a multiple of `max_message_bytes`. harken checks the limit itself,
# so that a message over it gets harken's status, Error message and error count; gRPC rejects a
# message only past this ceiling, which bounds what it buffers of one. Such a rejection only ends
# the request stream as a half-close or a dropped connection would, so it is not counted.
GRPC_RECEIVE_CEILING = 4


def status_of(e: BaseException) -> grpc.StatusCode:
    """The status code a stream that failed with `e` ends with (stream_handler.STATUS_OF)."""
    return grpc.StatusCode[status_name(e)]


class TranscriptionService(harken_pb2_grpc.TranscriptionServicer):
    """`Stream`: one session attempt per call (see the semantics in proto/harken.proto)."""

    def __init__(self, handler: StreamHandler):
        self.handler = handler

    async def Stream(self, requests, context):
        try:
            async with aclosing(self.handler.run_proto(context.invocation_metadata(), requests)) as messages:
                async for message in messages:
                    yield message
        except StreamFailed as e:
            await context.abort(grpc.StatusCode[e.code], e.message)


def service_handler(service: TranscriptionService) -> grpc.GenericRpcHandler:
    """The generated registration, except that requests arrive as bytes (see wire.client_message_from_bytes)."""
    return grpc.method_handlers_generic_handler(SERVICE_NAME, {
        "Stream": grpc.stream_stream_rpc_method_handler(
            service.Stream, request_deserializer=None,
            response_serializer=harken_pb2.ServerMessage.SerializeToString),
    })


__all__ = ["TranscriptionService", "service_handler", "status_of", "SERVICE_NAME", "GRPC_RECEIVE_CEILING",
           "MAX_MESSAGE_BYTES"]
