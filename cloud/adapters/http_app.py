"""The HTTP port (`harken serve --http-port`): one aiohttp application that mounts every HTTP entry
point onto the one stream handler and engine.

    GET  /                 the browser page (cloud/web/); /static/... its files
    GET  /edge/...         the TypeScript edge's browser build (edge/web/dist/browser/, `make web`):
                           the page's "features on this device" mode and meeting apps load
                           `harken.js` from here; absent from a tree without the build
    GET  /v1/config        what the page shows: the model served and the languages a stream may be
                           forced to (`page_config`)
    POST /v1/webrtc/offer  WebRTC signaling (webrtc.py)
    /v1/audio/..., /v1/models   OpenAI's file API (openai_api.py); /v1/realtime its Realtime
                           transcription (realtime_api.py); /v1/listen Deepgram's (deepgram_api.py);
                           /v1/auth/grant short-lived tokens (tokens.py): with `api_limits`

CORS: a meeting app on another origin that imports `/edge/harken.js` and posts offers needs the
server's leave. `harken serve --cors-origin ORIGIN` (repeatable; `*` for any) answers preflights
(POST with `Authorization` and `Content-Type`) and marks every response to a request from such an
origin; other origins get no CORS headers, so browsers keep them out (same-origin pages need none).
"""

from __future__ import annotations

from pathlib import Path

from aiohttp import web

from ..base.auth import ApiKeys
from ..hosting.stream_handler import StreamHandler
from .deepgram_api import DeepgramListen
from .openai_api import ApiLimits, TranscriptionAPI, api_for
from .realtime_api import RealtimeTranscription
from .tokens import TokenGrants
from .webrtc import CONFIG_PATH, MAX_OFFER_BYTES, WebRTCSignaling, page_config

WEB_DIR = Path(__file__).resolve().parents[1] / "web"
# the browser edge, built by `make web` (npm, esbuild) in a source tree; a wheel has no copy
EDGE_WEB_DIR = Path(__file__).resolve().parents[2] / "edge" / "web" / "dist" / "browser"


class HttpApp:
    """The HTTP port's application, its runner and what it mounts. Owned by `RunningServer`."""

    def __init__(self, handler: StreamHandler, keys: ApiKeys | None, cors_origins: tuple[str, ...] = (),
                 api: TranscriptionAPI | None = None):
        self.handler = handler
        self.keys = keys
        self.api = api
        self.cors_origins = frozenset(cors_origins)
        self.webrtc = WebRTCSignaling(handler, keys)
        self.port: int | None = None
        self._runner: web.AppRunner | None = None

    def application(self) -> web.Application:
        app = web.Application(client_max_size=MAX_OFFER_BYTES, middlewares=[self._preflight()])
        app.on_response_prepare.append(self._cors_headers)
        app.router.add_get("/", self._page)
        app.router.add_get(CONFIG_PATH, self._config)
        self.webrtc.add_routes(app)
        if self.api is not None:
            self.api.add_routes(app)
            RealtimeTranscription(self.handler, self.keys, self.api.model_id).add_routes(app)
            DeepgramListen(self.handler, self.keys, self.api.model_id, files=self.api).add_routes(app)
            TokenGrants(self.keys, self.api.model_id).add_routes(app)
        app.router.add_static("/static/", WEB_DIR)
        if EDGE_WEB_DIR.is_dir():
            app.router.add_static("/edge/", EDGE_WEB_DIR)
        return app

    async def start(self, host: str, port: int, reuse_port: bool = False) -> int:
        """`reuse_port`: several processes listen on the port (`harken serve --workers`)."""
        self._runner = web.AppRunner(self.application(), access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port, reuse_address=True, reuse_port=reuse_port or None)
        await site.start()
        self.port = self._runner.addresses[0][1]  # the site's socket (the real port for port 0)
        return self.port

    async def close(self) -> None:
        await self.webrtc.close()
        if self._runner is not None:
            await self._runner.cleanup()
        if self.api is not None:
            self.api.close()

    # ---- the page and CORS -----------------------------------------------------------------------

    def _preflight(self):
        """The CORS preflight middleware: a named origin's preflight is answered here, before any
        route; `_cors_headers` marks the responses."""

        @web.middleware
        async def preflight(request, handler):
            if (request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers
                    and self._allowed(request.headers.get("Origin"))):
                return web.Response(status=204, headers={
                    "Access-Control-Allow-Methods": "GET, POST, OPTIONS",
                    "Access-Control-Allow-Headers": "authorization, content-type",
                    "Access-Control-Max-Age": "600"})
            return await handler(request)

        return preflight

    async def _cors_headers(self, request, response) -> None:
        """Every response, errors and static files included (as it is prepared): the origin when
        it is named, and `Vary: Origin` so that no cache hands one origin's answer to another."""
        if not self.cors_origins:
            return
        vary = [v.strip() for v in response.headers.get("Vary", "").split(",") if v.strip()]
        if "Origin" not in vary:
            response.headers["Vary"] = ", ".join(vary + ["Origin"])
        origin = request.headers.get("Origin")
        if self._allowed(origin):
            response.headers["Access-Control-Allow-Origin"] = origin

    def _allowed(self, origin: str | None) -> bool:
        return origin is not None and ("*" in self.cors_origins or origin in self.cors_origins)

    async def _page(self, request):
        return web.FileResponse(WEB_DIR / "index.html")

    async def _config(self, request):
        return web.json_response(page_config(self.handler))


async def start_http(handler: StreamHandler, keys: ApiKeys | None, host: str, port: int,
                     cors_origins: tuple[str, ...] = (), api_limits: ApiLimits | None = None,
                     reuse_port: bool = False) -> HttpApp:
    """The HTTP port, listening: WebRTC signaling and the page, and with `api_limits` the OpenAI,
    Realtime and Deepgram APIs on the served model."""
    app = HttpApp(handler, keys, cors_origins=cors_origins,
                  api=api_for(handler, keys, api_limits) if api_limits is not None else None)
    await app.start(host, port, reuse_port)
    return app
