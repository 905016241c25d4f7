"""The edge's gRPC call (`GrpcCall`: a grpc.aio Stream call as an edge/client/call.py `Call`) and how
its failures are classified (edge/client/grpc_client.py).

A failed call is either a network fault (retried, resumed: the `ClientSession` decides) or one no
retry can change, above all a TLS mismatch: a certificate the CA does not sign (or issued for
another name), a TLS client at a plaintext server, or a plaintext client at a TLS server (found by
asking the port once whether it speaks TLS, `speaks_tls`). The WebRTC driver's calls fail the
same way (edge/client/webrtc_client.py), as `CallFailed`.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from .call import EOF, CallEnd, CallFailed
from ...shared import wire
from ...shared.protocol import ClientMessage, ServerMessage

if TYPE_CHECKING:
    import grpc


class GrpcCall:
    """A grpc.aio stream-stream call of `harken.v1.Transcription/Stream` as a `Call`: messages
    through shared/wire.py, grpc's errors and final status as `CallFailed`."""

    def __init__(self, call):
        import grpc  # here: the WebRTC client imports this module's neighbours, and no grpc

        self._call = call
        self._rpc_error, self._eof, self._ok = grpc.aio.AioRpcError, grpc.aio.EOF, grpc.StatusCode.OK

    async def write(self, message: ClientMessage) -> None:
        try:
            await self._call.write(wire.client_message_to_proto(message))
        except self._rpc_error as e:
            raise _failed(e) from None

    async def read(self) -> ServerMessage | None | CallEnd:
        try:
            msg = await self._call.read()
            if msg is self._eof:
                code = await self._call.code()
                if code != self._ok:
                    raise CallFailed(code.name, await self._call.details())
                return EOF
        except self._rpc_error as e:
            raise _failed(e) from None
        return call_message(msg)

    async def done_writing(self) -> None:
        try:
            await self._call.done_writing()
        except self._rpc_error as e:
            raise _failed(e) from None

    def cancel(self) -> None:
        self._call.cancel()


def _failed(e: grpc.aio.AioRpcError) -> CallFailed:
    return CallFailed(e.code().name, e.details() or "")


def call_message(msg) -> ServerMessage | None:
    """A message read from the call as shared/protocol data. grpc.aio hands over None for a
    message it could not parse (and logs it): the server broke the protocol, and the call fails
    with INTERNAL, as the WebRTC driver's call does."""
    if msg is None:
        raise CallFailed("INTERNAL", "malformed message from the server")
    return wire.server_message_from_proto(msg)


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


def tls_mismatch(e: CallFailed, target: str, tls: bool) -> str | None:
    """A one-line explanation when `e` is a TLS handshake that failed for good, else None."""
    if e.code != "UNAVAILABLE" or not tls:
        return None
    details = e.details
    if "SSL_ERROR_SSL" not in details and "Hostname Verification" not in details:
        return None  # no handshake verdict: a connection that broke, retried as ever
    for marker, meaning in _TLS_VERDICTS:
        if marker in details:
            reason = details[details.find(marker):].split(":", 2)
            said = ":".join(reason[:2]).strip() if marker.isupper() else marker
            return f"TLS handshake with {target} failed: {meaning} ({said})"
    return None


def closed_at_once(e: CallFailed) -> bool:
    """The connection was closed by the other end before gRPC could use it (what a TLS server does
    to a plaintext client's HTTP/2 preface), not refused or timed out."""
    details = e.details
    return "Socket closed" in details or "Connection reset" in details or "End of TCP stream" in details


async def speaks_tls(target: str, timeout_s: float) -> bool:
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
