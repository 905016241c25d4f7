"""Why a client stream could not be completed: the exceptions `TranscriptionClient.stream` raises
(`harken.edge` exports them). Each message says why, and what was not transcribed."""

from __future__ import annotations

from ...shared.errors import HarkenError


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
