"""The edge: audio in, silero VAD, streaming log-mel, codec, and the client SDK.

The SDK, importable from here:

    from harken.edge import TranscriptionClient, ClientOptions, TranscriptEvent, Meeting, MeetingLine

The names are re-exported for type checkers and editors (the `TYPE_CHECKING` block) and loaded on
first use at run time (`__getattr__`), so a process that only needs the edge's signal path
(`harken.edge.features`, `harken.edge.vad`: a training run's corpus build, a lent GPU without grpc)
does not import the SDK and grpc with it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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
    from harken.shared.transcript import SegmentTimings as SegmentTimings
    from harken.shared.transcript import TimedWord as TimedWord
    from harken.shared.transcript import TranscriptEvent as TranscriptEvent
    from harken.shared.transcript import TurnEvent as TurnEvent
    from harken.edge.front_end import FINALIZE as FINALIZE

_HOME = {"Meeting": "harken.edge.meeting", "MeetingLine": "harken.edge.meeting",
         "TranscriptEvent": "harken.shared.transcript", "SegmentTimings": "harken.shared.transcript",
         "TimedWord": "harken.shared.transcript", "TurnEvent": "harken.shared.transcript",
         "FINALIZE": "harken.edge.front_end"}

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


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'harken.edge' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOME.get(name, "harken.edge.transport")), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
