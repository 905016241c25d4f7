"""The edge: audio in, silero VAD, streaming log-mel, codec, and the client SDK.

The SDK, importable from here:

    from harken.edge import TranscriptionClient, ClientOptions, TranscriptEvent, Meeting, MeetingLine

Explicit re-exports, so that type checkers and editors see them. Importing any `harken.edge`
module therefore loads the SDK and grpc with it: about 0.1 s of CPU once per process, beside the
0.15 s the edge's other modules take (the 2-core dev machine, measured with the lazy `__getattr__`
this replaced) — small next to `harken vad` or `harken features` (0.3 s of CPU on the sample).
"""

from harken.edge.meeting import Meeting as Meeting
from harken.edge.meeting import MeetingLine as MeetingLine
from harken.edge.transport import BufferOverflowError as BufferOverflowError
from harken.edge.transport import ClientOptions as ClientOptions
from harken.edge.transport import ServerRejectedError as ServerRejectedError
from harken.edge.transport import ServerUnavailableError as ServerUnavailableError
from harken.edge.transport import TranscriptionClient as TranscriptionClient
from harken.edge.transport import TransportError as TransportError
from harken.edge.transport import TransportSecurityError as TransportSecurityError
from harken.edge.transport import TransportStats as TransportStats
from harken.edge.transport import audio_pieces as audio_pieces
from harken.edge.transport import file_pieces as file_pieces
from harken.shared.transcript import TranscriptEvent as TranscriptEvent

__all__ = [
    "TranscriptionClient",
    "ClientOptions",
    "TranscriptEvent",
    "TransportStats",
    "TransportError",
    "ServerUnavailableError",
    "BufferOverflowError",
    "ServerRejectedError",
    "TransportSecurityError",
    "file_pieces",
    "audio_pieces",
    "Meeting",
    "MeetingLine",
]
