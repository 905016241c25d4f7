"""API keys as bearer metadata (`authorization: Bearer <key>`).

The keys file holds one key per line, optionally followed by whitespace and a name; blank lines and
`#` comments are skipped. A key is never logged or put into a metric: what identifies a caller
there is its `KeyId` — the name from the file, or a short hash of the key.

Short-lived tokens (`ApiKeys.grant`: OpenAI's realtime client secrets, Deepgram's access tokens) let
a browser page connect without the key: a token stands for its key (the key's id, so the key's
limits) until it expires, then it is refused like an unknown key; it says nothing about the key
(random bytes, held by digest like the keys), and it cannot grant tokens itself.
"""

from __future__ import annotations

import hashlib
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path

from .errors import Unauthenticated
from ...shared.errors import HarkenError

OPEN_ACCESS = "open"  # the caller identity on a server without --api-keys


@dataclass(frozen=True)
class Caller:
    """Who is calling: `key_id` binds sessions to a key and labels logs; never the key itself."""

    key_id: str


@dataclass(frozen=True)
class ApiKeys:
    """The accepted keys: sha256(key) -> key id."""

    by_digest: dict[bytes, str]
    # granted tokens: sha256(token) -> (key id, expiry in `time.time()` seconds)
    tokens: dict[bytes, tuple[str, float]] = field(default_factory=dict, compare=False, repr=False)

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
        digest = _digest(key)
        key_id = self.by_digest.get(digest)
        if key_id is not None:
            return Caller(key_id)
        granted = self.tokens.get(digest)
        if granted is None:
            raise Unauthenticated("unknown API key")
        if granted[1] <= time.time():
            del self.tokens[digest]
            raise Unauthenticated("the token has expired: get a new one")
        return Caller(granted[0])

    def authenticate_key(self, metadata) -> Caller:
        """As `authenticate`, but only a key itself: a token does not grant tokens."""
        key = bearer_token(metadata)
        if key is not None and _digest(key) in self.tokens:
            raise Unauthenticated("a token cannot grant tokens: use an API key")
        return self.authenticate(metadata)

    def grant(self, caller: Caller, ttl_s: float, prefix: str = "") -> tuple[str, float]:
        """A new token for `caller`'s key, valid for `ttl_s` seconds: (token, expiry in unix seconds)."""
        now = time.time()
        for digest, (_, expires) in list(self.tokens.items()):  # expired ones go as new ones come
            if expires <= now:
                del self.tokens[digest]
        token = prefix + secrets.token_urlsafe(24)
        self.tokens[_digest(token)] = (caller.key_id, now + ttl_s)
        return token, now + ttl_s


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
