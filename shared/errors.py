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
