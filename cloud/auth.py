"""API keys as bearer metadata (`authorization: Bearer <key>`).

The keys file holds one key per line, optionally followed by whitespace and a name; blank lines and
`#` comments are skipped. A key is never logged or put into a metric: what identifies a caller
there is its `KeyId` — the name from the file, or a short hash of the key.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from harken.cloud.errors import Unauthenticated
from harken.shared.errors import HarkenError

OPEN_ACCESS = "open"  # the caller identity on a server without --api-keys


@dataclass(frozen=True)
class Caller:
    """Who is calling: `key_id` binds sessions to a key and labels logs; never the key itself."""

    key_id: str


@dataclass(frozen=True)
class ApiKeys:
    """The accepted keys: sha256(key) -> key id."""

    by_digest: dict[bytes, str]

    @classmethod
    def load(cls, path: str | Path) -> "ApiKeys":
        p = Path(path)
        try:
            text = p.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise HarkenError(f"{p}: cannot read the API keys file ({e.__class__.__name__})") from e
        return cls.parse(text, source=str(p))

    @classmethod
    def parse(cls, text: str, source: str = "api keys") -> "ApiKeys":
        by_digest: dict[bytes, str] = {}
        for n, line in enumerate(text.splitlines(), 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            key, _, name = line.partition(" ")
            key, name = key.strip(), name.strip()
            if len(key) < 8:
                raise HarkenError(f"{source}: line {n}: a key needs at least 8 characters")
            digest = _digest(key)
            by_digest[digest] = name or f"key-{digest.hex()[:8]}"
        if not by_digest:
            raise HarkenError(f"{source}: holds no keys")
        return cls(by_digest)

    def authenticate(self, metadata) -> Caller:
        """metadata: (key, value) pairs of the call. Unauthenticated when the key is missing or unknown."""
        key = bearer_token(metadata)
        if key is None:
            raise Unauthenticated("missing API key: send 'authorization: Bearer <key>' metadata")
        # looked up by digest: the time a lookup takes says nothing about how much of a key matched
        key_id = self.by_digest.get(_digest(key))
        if key_id is None:
            raise Unauthenticated("unknown API key")
        return Caller(key_id)


def http_metadata(headers) -> tuple:
    """An HTTP request's `Authorization` header as the call metadata `ApiKeys.authenticate` reads
    (the HTTP port's entry points: WebRTC signaling, the file API, the realtime WebSocket)."""
    auth = headers.get("Authorization")
    return (("authorization", auth),) if auth else ()


def check_http(keys: ApiKeys | None, headers) -> tuple:
    """The request's metadata, once its API key is good (Unauthenticated if not; any, on an open server)."""
    metadata = http_metadata(headers)
    if keys is not None:
        keys.authenticate(metadata)
    return metadata


def bearer_token(metadata) -> str | None:
    for k, v in metadata or ():
        if k.lower() == "authorization":
            v = v.decode("latin-1") if isinstance(v, bytes) else v
            scheme, _, token = v.strip().partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
            return None
    return None


def _digest(key: str) -> bytes:
    # surrogatepass: an HTTP header's bytes that are not UTF-8 come as surrogates (aiohttp decodes
    # with surrogateescape); such a key is unknown, not an error
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()
