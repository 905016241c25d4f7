"""Browser-safe short-lived tokens on the HTTP port, in the two shapes clients ask for them:

    POST /v1/realtime/transcription_sessions   OpenAI's: {"client_secret": {"value", "expires_at"}, ...}
    POST /v1/auth/grant                        Deepgram's: {"access_token", "expires_in"}

A server (or the app's backend) asks with its API key and hands the token to a browser page, which
connects with it as with the key (`Authorization: Bearer TOKEN`, or Deepgram's `token` subprotocol)
until it expires; then 401. A token is the key's for limits and sessions, says nothing about the key,
and cannot grant tokens (cloud/base/auth.py `ApiKeys.grant`). On an open server (no `--api-keys`) a
token is granted too, and like any credential there, accepted.
"""

from __future__ import annotations

import json
import secrets
import time
import uuid

from ..base.auth import OPEN_ACCESS, ApiKeys, Caller, http_metadata
from ..base.errors import Unauthenticated
from .deepgram_request import deepgram_metadata

REALTIME_SESSIONS_PATH = "/v1/realtime/transcription_sessions"
GRANT_PATH = "/v1/auth/grant"
OPENAI_TTL_S = 60  # OpenAI's realtime client secrets last a minute
DEEPGRAM_TTL_S = 30  # Deepgram's grant default
MAX_TTL_S = 3600
MAX_BODY_BYTES = 64_000


class TokenGrants:
    def __init__(self, keys: ApiKeys | None, model_id: str):
        self.keys, self.model_id = keys, model_id

    def add_routes(self, app) -> None:
        app.router.add_post(REALTIME_SESSIONS_PATH, self.realtime_session)
        app.router.add_post(GRANT_PATH, self.deepgram_grant)

    def _grant(self, metadata, ttl_s: float, prefix: str) -> tuple[str, float]:
        if self.keys is None:
            return prefix + secrets.token_urlsafe(24), time.time() + ttl_s
        caller: Caller = self.keys.authenticate_key(metadata)
        return self.keys.grant(caller, ttl_s, prefix)

    async def _body(self, request) -> dict | None:
        """The JSON object of the request (absent or empty: {}); None when it is not one."""
        raw = await request.content.read(MAX_BODY_BYTES + 1)
        if len(raw) > MAX_BODY_BYTES:
            return None
        if not raw.strip():
            return {}
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError):
            return None
        return body if isinstance(body, dict) else None

    async def realtime_session(self, request):
        """OpenAI's `POST /v1/realtime/transcription_sessions`: a client secret for `/v1/realtime`."""
        from aiohttp import web

        def error(status: int, message: str, code: str):
            return web.json_response({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                                "code": code}}, status=status)

        body = await self._body(request)
        if body is None:
            return error(400, "the body must be a JSON object (the session's settings), or empty", "invalid_json")
        try:
            token, expires = self._grant(http_metadata(request.headers), OPENAI_TTL_S, "ek_")
        except Unauthenticated as e:
            return error(401, str(e), "invalid_api_key")
        asked = body.get("input_audio_transcription")
        transcription: dict = asked if isinstance(asked, dict) else {}
        return web.json_response({
            "id": "sess_" + uuid.uuid4().hex[:20], "object": "realtime.transcription_session",
            "client_secret": {"value": token, "expires_at": int(expires)},
            "input_audio_format": "pcm16",
            "input_audio_transcription": {"model": self.model_id, "language": str(transcription.get("language") or ""),
                                          "prompt": str(transcription.get("prompt") or "")},
            "turn_detection": {"type": "server_vad"}, "modalities": ["text"]})

    async def deepgram_grant(self, request):
        """Deepgram's `POST /v1/auth/grant` (`{"ttl_seconds": N}` optional): an access token."""
        from aiohttp import web


        request_id = str(uuid.uuid4())

        def error(status: int, message: str, code: str):
            return web.json_response({"err_code": code, "err_msg": message, "request_id": request_id}, status=status,
                                     headers={"dg-error": message[:500], "dg-request-id": request_id})

        body = await self._body(request)
        ttl = body.get("ttl_seconds", DEEPGRAM_TTL_S) if body is not None else None
        if not isinstance(ttl, (int, float)) or isinstance(ttl, bool) or not 1 <= ttl <= MAX_TTL_S:
            return error(400, f"ttl_seconds must be a number of seconds from 1 to {MAX_TTL_S}", "Bad Request")
        metadata, _ = deepgram_metadata(request.headers)
        try:
            token, _ = self._grant(metadata, float(ttl), "")
        except Unauthenticated as e:
            return error(401, str(e), "INVALID_AUTH")
        return web.json_response({"access_token": token, "expires_in": ttl}, headers={"dg-request-id": request_id})


__all__ = ["TokenGrants", "REALTIME_SESSIONS_PATH", "GRANT_PATH", "OPEN_ACCESS"]
