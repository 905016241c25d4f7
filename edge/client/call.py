"""One stream call as the client drives it, in its own terms: what `TranscriptionClient` runs its
`ClientSession` over, whatever carries the stream.

    call.write(ClientMessage)      CallFailed once the call is over
    call.read() -> ServerMessage   the next message (None: an empty one); EOF: the call ended OK;
                                   CallFailed: it ended with another status
    call.done_writing()            the half-close: no more messages from the client
    call.cancel()                  drop the call (the session waits for a resume)

Implemented by a gRPC call (edge/client/grpc_call.py `GrpcCall`) and by a WebRTC data channel
(edge/client/webrtc_client.py `DataChannelCall`). Status codes are gRPC's names on every transport.
"""

from __future__ import annotations

import enum
from typing import Final, Protocol

from ...shared.protocol import ClientMessage, ServerError, ServerMessage

# gRPC's status codes, by name: what a call's status (and a server's Error message) may say
STATUS_NAMES = frozenset({
    "OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND", "ALREADY_EXISTS",
    "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION", "ABORTED", "OUT_OF_RANGE",
    "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS", "UNAUTHENTICATED"})


class CallFailed(Exception):
    """A call that ended with a status other than OK (or could not be made): `code` the status
    code's name, `details` what the server (or the transport) said."""

    def __init__(self, code: str, details: str = ""):
        super().__init__(f"{code}: {details}")
        self.code, self.details = code, details


class CallEnd(enum.Enum):
    EOF = "EOF"


EOF: Final = CallEnd.EOF  # what `Call.read` returns once the call has ended OK


class Call(Protocol):
    async def write(self, message: ClientMessage) -> None: ...

    async def read(self) -> ServerMessage | None | CallEnd: ...

    async def done_writing(self) -> None: ...

    def cancel(self) -> None: ...


def status_error(error: ServerError) -> CallFailed:
    """The server's Error message, the stream's last: its status follows with the same code, but
    only once the server has read what this client still sends (cloud/hosting/stream_handler.py `_drain`).
    A code that names no status is UNKNOWN."""
    return CallFailed(error.code if error.code in STATUS_NAMES else "UNKNOWN", error.message)


__all__ = ["Call", "CallEnd", "CallFailed", "EOF", "STATUS_NAMES", "status_error"]
