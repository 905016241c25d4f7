"""The edge: audio in, silero VAD, streaming log-mel, codec, and the client SDK.

The SDK, importable from here (loaded on first use, so the edge's other commands do not pull in
grpc):

    from harken.edge import TranscriptionClient, ClientOptions, TranscriptEvent, Meeting, MeetingLine
"""

from importlib import import_module

_SDK = {
    "TranscriptionClient": "harken.edge.transport",
    "ClientOptions": "harken.edge.transport",
    "TranscriptEvent": "harken.edge.transport",
    "TransportStats": "harken.edge.transport",
    "TransportError": "harken.edge.transport",
    "ServerUnavailableError": "harken.edge.transport",
    "BufferOverflowError": "harken.edge.transport",
    "ServerRejectedError": "harken.edge.transport",
    "TransportSecurityError": "harken.edge.transport",
    "file_pieces": "harken.edge.transport",
    "audio_pieces": "harken.edge.transport",
    "Meeting": "harken.edge.meeting",
    "MeetingLine": "harken.edge.meeting",
}

__all__ = list(_SDK)


def __getattr__(name: str):
    module = _SDK.get(name)
    if module is None:
        raise AttributeError(f"module 'harken.edge' has no attribute {name!r}")
    return getattr(import_module(module), name)
