"""Short-lived, browser-safe tokens (cloud/base/auth.py `ApiKeys.grant`, cloud/adapters/tokens.py): granted
for an API key in OpenAI's shape (`POST /v1/realtime/transcription_sessions`: a client secret the
`openai` package's realtime client connects with) and Deepgram's (`POST /v1/auth/grant`: an access
token Deepgram's SDK sends as `bearer`, or a browser as the `token` subprotocol). A token works
until it expires, then 401; it is its key's, says nothing about the key, and grants nothing."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest

from harken.cloud.base.auth import ApiKeys
from harken.cloud.base.errors import Unauthenticated

KEY = "tk-harken-test-key-0123"


def bearer(token: str):
    return (("authorization", f"Bearer {token}"),)


def test_a_token_stands_for_its_key_until_it_expires(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr("harken.cloud.base.auth.time.time", lambda: now[0])
    keys = ApiKeys.parse(f"{KEY} alice\nother-key-456 bob\n")
    caller = keys.authenticate_key(bearer(KEY))
    token, expires = keys.grant(caller, 30.0, "ek_")
    assert expires == 1030.0 and token.startswith("ek_") and KEY not in token and len(token) > 30
    assert keys.authenticate(bearer(token)).key_id == "alice"  # the key's id: its limits and sessions
    with pytest.raises(Unauthenticated, match="cannot grant"):
        keys.authenticate_key(bearer(token))
    now[0] = 1030.0
    with pytest.raises(Unauthenticated, match="expired"):
        keys.authenticate(bearer(token))
    with pytest.raises(Unauthenticated, match="unknown"):  # and forgotten
        keys.authenticate(bearer(token))
    assert keys.authenticate(bearer(KEY)).key_id == "alice"


def test_tokens_granted_over_http_connect_the_real_clients_and_expire(tmp_path):
    import openai
    from deepgram import AsyncDeepgramClient, DeepgramClientEnvironment

    from harken.cloud.model.asr import Qwen3ASR
    from harken.cloud.server import ServerOptions, start_server

    keys = tmp_path / "keys.txt"
    keys.write_text(KEY + "\n")
    wav = tmp_path / "a.wav"
    import numpy as np
    import soundfile as sf

    sf.write(str(wav), (np.sin(np.arange(16000) / 10) * 3000).astype("<i2"), 16000, subtype="PCM_16")

    async def main():
        asr = Qwen3ASR.load("tiny", dtype="fp32", device="cpu")
        server = await start_server(asr, ServerOptions(host="127.0.0.1", port=0, http_port=0, api_keys=str(keys)))
        base = f"127.0.0.1:{server.http_port}"
        out = {}
        try:
            async with aiohttp.ClientSession() as http:
                r = await http.post(f"http://{base}/v1/auth/grant", headers={"Authorization": f"Token {KEY}"},
                                    json={"ttl_seconds": 2})
                grant = await r.json()
                out["grant"] = (r.status, grant, KEY in await r.text())
                env = DeepgramClientEnvironment(base=f"http://{base}", production=f"ws://{base}",
                                                agent=f"ws://{base}", agent_rest=f"http://{base}")
                dg = AsyncDeepgramClient(access_token=grant["access_token"], environment=env)
                answer = await dg.listen.v1.media.transcribe_file(request=wav.read_bytes(), model="nova-3")
                out["sdk"] = answer.metadata.channels
                ws = await http.ws_connect(f"ws://{base}/v1/listen?encoding=linear16&sample_rate=16000",
                                           protocols=("token", grant["access_token"]))
                await ws.send_str(json.dumps({"type": "CloseStream"}))
                out["browser"] = [m.type.name async for m in ws] and ws.close_code
                r = await http.post(f"http://{base}/v1/auth/grant",
                                    headers={"Authorization": f"Bearer {grant['access_token']}"})
                out["regrant"] = r.status
                r = await http.post(f"http://{base}/v1/realtime/transcription_sessions",
                                    headers={"Authorization": f"Bearer {KEY}"},
                                    json={"input_audio_transcription": {"language": "en"}})
                session = await r.json()
                out["openai"] = (r.status, session["object"], session["client_secret"]["expires_at"] - time.time())
                client = openai.OpenAI(base_url=f"http://{base}/v1", api_key=session["client_secret"]["value"])

                def realtime():
                    with client.realtime.connect(model="tiny") as conn:
                        return conn.recv().type

                out["realtime"] = await asyncio.to_thread(realtime)
                await asyncio.sleep(2.2)  # the Deepgram token's ttl
                r = await http.post(f"http://{base}/v1/listen?model=nova-3", data=wav.read_bytes(),
                                    headers={"Authorization": f"bearer {grant['access_token']}"})
                out["expired"] = (r.status, r.headers.get("dg-error"))
                r = await http.post(f"http://{base}/v1/auth/grant", headers={"Authorization": "Token nope-nope-nope"})
                out["bad"] = r.status
                r = await http.post(f"http://{base}/v1/auth/grant", headers={"Authorization": f"Token {KEY}"},
                                    json={"ttl_seconds": 0})
                out["ttl0"] = r.status
        finally:
            await server.stop(0)
        return out

    out = asyncio.run(main())
    status, grant, leaked = out["grant"]
    assert status == 200 and grant["expires_in"] == 2 and not leaked
    assert out["sdk"] == 1  # Deepgram's SDK with access_token= sends `bearer <token>`
    assert out["browser"] == 1000  # the `token` subprotocol, as a browser connects
    assert out["regrant"] == 401  # a token grants nothing
    assert out["openai"][:2] == (200, "realtime.transcription_session") and 50 < out["openai"][2] <= 61
    assert out["realtime"] == "session.created"
    assert out["expired"][0] == 401 and "expired" in out["expired"][1]
    assert out["bad"] == 401 and out["ttl0"] == 400
