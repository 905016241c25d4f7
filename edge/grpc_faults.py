"""How the edge's gRPC driver reads a call and classifies its failures (edge/transport.py).

A failed call is either a network fault (retried, resumed: the `ClientSession` decides) or one no
retry can change, above all a TLS mismatch: a certificate the CA does not sign (or issued for
another name), a TLS client at a plaintext server, or a plaintext client at a TLS server (found by
asking the port once whether it speaks TLS, `speaks_tls`). The WebRTC driver's calls fail the
same way (edge/webrtc_transport.py).
"""

from __future__ import annotations

import asyncio

import grpc

from harken.shared import wire
from harken.shared.protocol import ServerError, ServerMessage


def call_message(msg) -> ServerMessage | None:
    """A message read from the call as shared/protocol data. grpc.aio hands over None for a
    message it could not parse (and logs it): the server broke the protocol, and the call fails
    with INTERNAL, as the WebRTC driver's call does."""
    if msg is None:
        raise grpc.aio.AioRpcError(grpc.StatusCode.INTERNAL, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                   details="malformed message from the server")
    return wire.server_message_from_proto(msg)


def status_error(error: ServerError) -> grpc.aio.AioRpcError:
    """The server's Error message, the stream's last: its status follows with the same code, but
    only once the server has read what this client still sends (cloud/grpc_service.py `_drain`)."""
    code = grpc.StatusCode.__members__.get(error.code, grpc.StatusCode.UNKNOWN)  # not getattr: "name" is no code
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=error.message)


async def raise_status(call) -> None:
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


def tls_mismatch(e: grpc.aio.AioRpcError, target: str, tls: bool) -> str | None:
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


def closed_at_once(e: grpc.aio.AioRpcError) -> bool:
    """The connection was closed by the other end before gRPC could use it (what a TLS server does
    to a plaintext client's HTTP/2 preface), not refused or timed out."""
    details = e.details() or ""
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
