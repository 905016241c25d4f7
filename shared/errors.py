"""The small set of exceptions harken raises at its boundaries.

Every error a user can cause (bad input file, malformed payload, unknown model) derives from
`HarkenError`, so the command line prints one line for it instead of a traceback, and the service
maps it to a status code in one place.
"""


class HarkenError(Exception):
    """Base class: an error with a message fit to show a user as it is."""


class AudioError(HarkenError):
    """Input audio that cannot be read, or holds no samples."""


class CodecError(HarkenError, ValueError):
    """A feature payload that is malformed, truncated, of an unknown version or out of bounds."""


class ModelError(HarkenError):
    """A model that cannot be found, loaded or run as asked."""


class StreamInputError(HarkenError, ValueError):
    """Malformed streaming input: wrong feature shape, non-finite values, bad options
    (the service maps it to INVALID_ARGUMENT)."""


class OutOfOrder(HarkenError):
    """Input that is valid alone but not now (FAILED_PRECONDITION): on the wire, no `start` first, a
    gap in `seq`, Audio after Features; in the engine, a gap in a segment's frames, frames after its
    end, a segment id going backwards."""


class Overloaded(HarkenError):
    """Admission control said no (RESOURCE_EXHAUSTED): the engine's sessions or queued work, the
    server's session limits, a key's limits."""


class SessionNotFound(HarkenError):
    """A session that is not there (NOT_FOUND): no open engine session with that id, or a session
    id the server does not hold (it restarted, or the grace period ran out)."""


# ---- the wire's failures (shared/wire.py raises them on the server's way in) ---------------------

class MalformedMessage(StreamInputError):
    """A message that is invalid on its own: bad sizes, counts, values (INVALID_ARGUMENT)."""


class MessageTooLarge(HarkenError):
    """A message over the server's size limit (RESOURCE_EXHAUSTED, as gRPC itself answers one)."""
