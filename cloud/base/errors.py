"""What a stream can do wrong, as the service sees it: one exception per gRPC status code.

They extend the engine's errors in shared/errors.py where the meaning is the same, so the servicer
maps both to status codes with one table (`cloud/stream_handler.STATUS_OF`). Messages are shown to the client as
they are: they say what was wrong and never echo secrets.
"""

from __future__ import annotations

from ...shared.errors import HarkenError, MalformedMessage, MessageTooLarge, OutOfOrder, Overloaded, SessionNotFound

# the failures the engine or the wire raise too (MalformedMessage, OutOfOrder, MessageTooLarge,
# Overloaded, SessionNotFound) are shared/errors.py's, re-exported here beside the service's own

__all__ = ["MalformedMessage", "OutOfOrder", "Unauthenticated", "NotYourSession", "SessionNotFound",
           "Overloaded", "MessageTooLarge", "ShuttingDown", "Superseded", "EngineFailed", "IdleTimeout"]


class Unauthenticated(HarkenError):
    """No API key, or one the server does not know (UNAUTHENTICATED)."""


class NotYourSession(HarkenError):
    """A session id issued to another key (PERMISSION_DENIED)."""


class IdleTimeout(HarkenError):
    """The stream sent nothing for the idle timeout while the server had nothing of it to do: the
    stream is ended and its session closed, freeing the slot (DEADLINE_EXCEEDED)."""


class ShuttingDown(HarkenError):
    """The server is stopping; reconnect later and resume or replay (UNAVAILABLE)."""


class Superseded(HarkenError):
    """A newer stream attached to this stream's session (ABORTED)."""


class EngineFailed(ShuttingDown):
    """The engine stopped working: this server can serve no session (UNAVAILABLE)."""
