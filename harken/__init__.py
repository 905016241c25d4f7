"""harken: live speech-to-text. The edge runs VAD and log-mel features; the cloud runs Qwen3-ASR.

    import harken

    harken.transcribe("talk.wav").text                    # in this process, no server (needs torch)
    for event in harken.stream("talk.wav"): ...           # the live engine on audio time, in process

    client = harken.TranscriptionClient("localhost:50051")   # a client of `harken serve`
    async for event in client.stream(harken.file_pieces("talk.wav")): ...

    harken.Meeting(...)                                   # per-participant tracks -> one transcript
    harken.serve("synth-en", harken.ServerOptions(port=50051))           # the server (blocks)

Names load on first use (measured here: `import harken` 40 ms, the client 0.25 s more): the client
needs no torch, which an edge install does not have, while the in-process engine and the server import
it (1.3 s more).
"""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

try:
    __version__ = version("harken")
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0.0.0+unknown"

if TYPE_CHECKING:
    from .api import load_model as load_model
    from .api import stream as stream
    from .api import transcribe as transcribe
    from .cloud.server import ServerOptions as ServerOptions
    from .cloud.serve import serve_command as serve
    from .edge.client import ClientOptions as ClientOptions
    from .edge.client import FINALIZE as FINALIZE
    from .edge.client import Meeting as Meeting
    from .edge.client import MeetingLine as MeetingLine
    from .edge.client import TranscriptEvent as TranscriptEvent
    from .edge.client import TranscriptionClient as TranscriptionClient
    from .edge.client import TransportError as TransportError
    from .edge.client import TurnEvent as TurnEvent
    from .edge.client import audio_pieces as audio_pieces
    from .edge.client import file_pieces as file_pieces
    from .shared.errors import HarkenError as HarkenError

# name -> (module, attribute)
_PUBLIC = {
    "TranscriptionClient": (".edge.client", "TranscriptionClient"),
    "ClientOptions": (".edge.client", "ClientOptions"),
    "TranscriptEvent": (".edge.client", "TranscriptEvent"),
    "TurnEvent": (".edge.client", "TurnEvent"),
    "TransportError": (".edge.client", "TransportError"),
    "FINALIZE": (".edge.client", "FINALIZE"),
    "file_pieces": (".edge.client", "file_pieces"),
    "audio_pieces": (".edge.client", "audio_pieces"),
    "Meeting": (".edge.client", "Meeting"),
    "MeetingLine": (".edge.client", "MeetingLine"),
    "HarkenError": (".shared.errors", "HarkenError"),
    "transcribe": (".api", "transcribe"),
    "stream": (".api", "stream"),
    "load_model": (".api", "load_model"),
    "ServerOptions": (".cloud.server", "ServerOptions"),
    "serve": (".cloud.serve", "serve_command"),
}
__all__ = ["__version__", *_PUBLIC]


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'harken' has no attribute {name!r}")
    module, attribute = _PUBLIC[name]
    value = getattr(importlib.import_module(module, __name__), attribute)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
