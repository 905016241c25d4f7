"""The client SDK: stream a file, a microphone or any audio to a harken server and read its transcript.

    from harken.edge.client import TranscriptionClient, ClientOptions, TranscriptEvent, Meeting, MeetingLine

`harken` re-exports the same names. The protocol rules live in `session` (ClientSession, sans-IO);
`grpc_client` and `webrtc_client` drive it over their transports; `meeting` mixes per-participant
tracks into one transcript.
"""

from __future__ import annotations

from ...shared.transcript import SegmentTimings, TimedWord, TranscriptEvent, TurnEvent
from .errors import (BufferOverflowError, ServerRejectedError, ServerUnavailableError, TransportError,
                     TransportSecurityError)
from .front_end import FINALIZE, audio_pieces, file_pieces
from .grpc_client import TranscriptionClient, TransportStats
from .meeting import Meeting, MeetingLine
from .session import ClientOptions

__all__ = [
    "TranscriptionClient",
    "ClientOptions",
    "TranscriptEvent",
    "SegmentTimings",
    "TimedWord",
    "TurnEvent",
    "FINALIZE",
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
