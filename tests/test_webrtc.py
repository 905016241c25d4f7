"""cloud/webrtc + edge/webrtc_transport: the same sessions over an aiortc data channel and an Opus
track, on loopback (real peer connections: ICE, DTLS, SCTP, SRTP), the tiny random model.

What is checked: the data-channel client gets exactly the events a gRPC client gets for the same
audio; keys are checked at signaling and per stream; a data channel dropped mid-stream is resumed
on a new peer connection with every frame applied once and the identical transcript; audio sent
as an Opus track is transcribed by the server's own VAD + features.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from harken.cloud.server import ServerOptions, start_server
from harken.shared.errors import HarkenError
from harken.edge.audio import peak_normalize
from harken.edge.client.grpc_client import ClientOptions, ServerRejectedError, TranscriptionClient
from harken.edge.client.webrtc_client import WebRTCTranscriptionClient
from signals import concat, silence, speech
from streaming import segment_texts

LANGUAGE = "English"  # forced: the random tiny model then writes text
KEY = "webrtc-test-key-1"
TIMEOUT = 60


@pytest.fixture(scope="module")
def audio() -> np.ndarray:
    """Two utterances with a pause: two VAD segments, ~5 s."""
    return peak_normalize(concat(silence(0.3), speech("Hello there, this is a test."), silence(0.8),
                                 speech("A second sentence follows."), silence(0.5)))


@pytest.fixture
def keys_file(tmp_path):
    p = tmp_path / "keys"
    p.write_text(f"{KEY} tester\n")
    return str(p)


async def _events(client, audio):
    return [e async for e in client.stream(audio)]


def test_data_channel_client_gets_the_grpc_transcript(asr, audio, keys_file):
    async def main():
        server = await start_server(asr, ServerOptions(port=0, http_port=0, api_keys=keys_file))
        try:
            grpc_events = await _events(TranscriptionClient(f"127.0.0.1:{server.port}", api_key=KEY,
                                                            language=LANGUAGE), audio)
            client = WebRTCTranscriptionClient(f"http://127.0.0.1:{server.http_port}", api_key=KEY,
                                               language=LANGUAGE)
            webrtc_events = await _events(client, audio)
            return grpc_events, webrtc_events, client.stats
        finally:
            await server.stop()

    grpc_events, webrtc_events, stats = asyncio.run(asyncio.wait_for(main(), TIMEOUT))
    assert any(e.committed_delta for e in grpc_events)
    # the same committed text per segment and the same finals; how many partial updates the engine
    # makes depends on how the frames arrive in time (a loaded machine can skip one)
    assert segment_texts(webrtc_events) == segment_texts(grpc_events)
    assert [e for e in webrtc_events if e.is_final] == [e for e in grpc_events if e.is_final]
    assert stats.sessions_opened == 1 and stats.resumes == 0 and stats.frames_resent == 0
    assert stats.frames_sent == stats.frames_produced > 0


def test_keys_are_checked_at_signaling(asr, audio, keys_file):
    async def main():
        server = await start_server(asr, ServerOptions(port=0, http_port=0, api_keys=keys_file))
        try:
            out = []
            for key in (None, "not-the-right-key"):
                client = WebRTCTranscriptionClient(f"http://127.0.0.1:{server.http_port}", api_key=key,
                                                   language=LANGUAGE)
                with pytest.raises(ServerRejectedError) as e:
                    await client.transcribe(audio[:16000])
                out.append(e.value)
            return out
        finally:
            await server.stop()

    errors = asyncio.run(asyncio.wait_for(main(), TIMEOUT))
    assert [e.code for e in errors] == ["UNAUTHENTICATED", "UNAUTHENTICATED"]
    assert "missing API key" in str(errors[0]) and "unknown API key" in str(errors[1])


def test_opus_track_is_transcribed_by_the_servers_vad_and_features(asr, audio, keys_file):
    """Audio as a browser sends it: an Opus track (48 kHz), control over the data channel. The
    server decodes, resamples to 16 kHz and runs the thin-client front end: the same segments as
    the gRPC thin client finds in the PCM, within the codec's blur, and text from the model."""
    from harken.edge.client.webrtc_client import stream_opus

    async def main():
        server = await start_server(asr, ServerOptions(port=0, http_port=0, api_keys=keys_file))
        try:
            pcm = [e async for e in TranscriptionClient(f"127.0.0.1:{server.port}", api_key=KEY, language=LANGUAGE,
                                                        options=ClientOptions(send_audio=True)).stream(audio)]
            # 3x real time: the receiver's jitter buffer copes on loopback, the test stays short
            opus = [e async for e in stream_opus(f"http://127.0.0.1:{server.http_port}", audio, api_key=KEY,
                                                 language=LANGUAGE, speed=3.0)]
            return pcm, opus
        finally:
            await server.stop()

    pcm, opus = asyncio.run(asyncio.wait_for(main(), TIMEOUT))
    pcm_finals = [e for e in pcm if e.is_final]
    opus_finals = [e for e in opus if e.is_final]
    assert len(pcm_finals) == 2
    assert [e.segment_id for e in opus_finals] == [e.segment_id for e in pcm_finals]
    for a, b in zip(opus_finals, pcm_finals):
        assert abs(a.start_s - b.start_s) <= 0.3 and abs(a.end_s - b.end_s) <= 0.3, (a, b)
    assert any(e.committed_delta for e in opus)


def test_cli_serve_prints_the_page_url_and_stream_over_webrtc_matches_grpc(audio, tmp_path):
    """`harken serve --http-port 0` prints the page's URL once ready; `harken stream IN.wav
    --transport webrtc --server URL --json` prints what `--transport grpc` prints."""
    import os
    import re
    import subprocess
    import sys
    from pathlib import Path

    from signals import write_wav

    repo = Path(__file__).resolve().parents[1]
    wav = write_wav(tmp_path / "in.wav", audio, subtype="FLOAT")
    serve = subprocess.Popen([sys.executable, "-m", "harken", "serve", "--model", "tiny", "--port", "0",
                              "--http-port", "0"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                             cwd=repo)
    try:
        grpc_line, page_line = serve.stdout.readline(), serve.stdout.readline()
        grpc_target = re.fullmatch(r"harken: listening on grpc://(\S+)\n", grpc_line).group(1)
        url = re.fullmatch(r"harken: WebRTC and the browser page on (http://\S+/)\n", page_line).group(1)
        outputs = []
        for transport, server in (("grpc", grpc_target), ("webrtc", url)):
            proc = subprocess.run([sys.executable, "-m", "harken", "stream", str(wav), "--server", server,
                                   "--transport", transport, "--language", LANGUAGE, "--json"],
                                  capture_output=True, text=True, cwd=repo, timeout=TIMEOUT,
                                  env={**os.environ, "HARKEN_API_KEY": ""})
            assert proc.returncode == 0, proc.stderr
            outputs.append(proc.stdout)
    finally:
        serve.terminate()
        serve.wait(timeout=30)
    assert outputs[0] == outputs[1]
    assert '"final": true' in outputs[1].splitlines()[-1]


def test_dropped_data_channels_resume_without_losing_frames(asr, audio):
    """The data channel is closed under the client mid-stream, several times, right after a write
    (so messages are in flight): each time the client resumes the same session on a new peer
    connection and resends what the server had not applied. The transcript is the one without
    faults; every message is applied exactly once; no frame is lost."""
    from harken.edge.client.grpc_client import TranscriptionClient
    from harken.edge.client.webrtc_client import DataChannelCalls, PeerConnectionChannel
    from harken.shared.protocol import Start

    drops_at = [3, 5, 2, 4]  # the write after which each attempt's channel is dropped

    class DroppingChannel(PeerConnectionChannel):
        def call(self):
            c = super().call()
            if drops_at:
                limit, writes, write = drops_at.pop(0), [0], c.write

                async def dropping_write(message):
                    await write(message)
                    if not isinstance(message, Start):
                        writes[0] += 1
                        if writes[0] == limit:
                            self.channel.close()  # the fault: the channel goes, mid-stream
                c.write = dropping_write  # type: ignore[method-assign]
            return c

    class DroppingCalls(DataChannelCalls):
        def peer(self, options):
            return DroppingChannel(self.url, self.api_key, options.connect_timeout_s)

    def applied(server):
        r = server.metrics.registry
        return (r.get_sample_value("harken_messages_in_total", {"kind": "features"}) or 0.0,
                r.get_sample_value("harken_bytes_in_total", {"kind": "features"}) or 0.0)

    async def main():
        server = await start_server(asr, ServerOptions(port=0, http_port=0))
        try:
            url = f"http://127.0.0.1:{server.http_port}"
            clean = await _events(WebRTCTranscriptionClient(url, language=LANGUAGE), audio)
            before = applied(server)
            client = TranscriptionClient(url, language=LANGUAGE, calls=DroppingCalls(url, None),
                                         options=ClientOptions(backoff_initial_s=0.01, backoff_max_s=0.1))
            events = await _events(client, audio)
            after = applied(server)
            return clean, events, client.stats, (after[0] - before[0], after[1] - before[1])
        finally:
            await server.stop()

    clean, events, stats, (messages, nbytes) = asyncio.run(asyncio.wait_for(main(), TIMEOUT))
    assert not drops_at, "every planned drop happened"
    assert stats.resumes == 4 and stats.sessions_opened == 1
    assert stats.messages_resent > 0
    # as over gRPC under faults: the same committed text per segment and the same finals (how many
    # partial updates the engine makes depends on how the frames arrive in time)
    assert segment_texts(events) == segment_texts(clean) and any(segment_texts(clean).values())
    assert [e for e in events if e.is_final] == [e for e in clean if e.is_final]
    assert messages == stats.messages_sent - stats.messages_resent  # each applied once
    assert nbytes == stats.payload_bytes_produced  # no frame lost
    assert stats.frames_sent - stats.frames_resent == stats.frames_produced


def test_signaling_rejects_bad_offers_in_words_and_serves_the_page(asr, keys_file):
    import aiohttp

    async def main():
        server = await start_server(asr, ServerOptions(port=0, http_port=0, api_keys=keys_file))
        url = f"http://127.0.0.1:{server.http_port}"
        auth = {"Authorization": f"Bearer {KEY}"}
        out = {}
        try:
            async with aiohttp.ClientSession() as http:
                for name, body in (("not json", b"{"), ("no sdp", b'{"type": "offer"}'),
                                   ("an answer", b'{"type": "answer", "sdp": "v=0"}'),
                                   ("garbage sdp", b'{"type": "offer", "sdp": "hello"}'), ("a list", b"[1]")):
                    async with http.post(url + "/v1/webrtc/offer", data=body, headers=auth) as r:
                        out[name] = (r.status, await r.json())
                async with http.get(url + "/") as r:
                    out["page"] = (r.status, await r.text())
                async with http.get(url + "/static/app.js") as r:
                    out["js"] = (r.status, await r.text())
        finally:
            await server.stop()
        return out

    out = asyncio.run(asyncio.wait_for(main(), TIMEOUT))
    for name in ("not json", "no sdp", "an answer", "garbage sdp", "a list"):
        status, body = out[name]
        assert status == 400 and body["code"] == "INVALID_ARGUMENT" and body["message"].startswith("bad offer"), name
    # the message says what is wrong, not a bare key name
    assert "not JSON" in out["not json"][1]["message"]
    assert out["no sdp"][1]["message"].startswith("bad offer: missing field 'sdp'")
    assert "'type' must be 'offer', not 'answer'" in out["an answer"][1]["message"]
    assert "JSON object" in out["a list"][1]["message"]
    assert out["page"][0] == 200 and "<title>harken" in out["page"][1]
    assert out["js"][0] == 200 and "RTCPeerConnection" in out["js"][1]


def test_the_page_says_which_model_runs_offers_a_language_hint_and_names_an_empty_result(asr):
    """GET /v1/config reports the served model (the tiny random checkpoint: a test model, with a
    note) and the languages by name and code; the page has the test-model banner, the language
    hint selector filled from that list, and the message for a stream that ended without words
    (what it does with them runs in test_webrtc_browser)."""
    import aiohttp

    async def main():
        server = await start_server(asr, ServerOptions(port=0, http_port=0))
        url = f"http://127.0.0.1:{server.http_port}"
        try:
            async with aiohttp.ClientSession() as http:
                async with http.get(url + "/v1/config") as r:
                    config = (r.status, await r.json())
                async with http.get(url + "/") as r:
                    page = await r.text()
                async with http.get(url + "/static/app.js") as r:
                    js = await r.text()
        finally:
            await server.stop()
        return config, page, js

    (status, config), page, js = asyncio.run(asyncio.wait_for(main(), TIMEOUT))
    assert status == 200
    assert config["model"] == "tiny" and config["model_kind"] == "tiny" and config["test_model"] is True
    assert "meaningless" in config["model_note"]
    assert len(config["languages"]) == 30
    assert {"name": "English", "code": "en"} in config["languages"]
    assert {"name": "Cantonese", "code": "yue"} in config["languages"]
    assert '<div id="model-banner" role="status" hidden>' in page
    assert '<select id="language"' in page and '<option value="">detect</option>' in page
    assert '<div id="empty-result" role="status" hidden>Nothing was recognised' in page
    assert 'fetch("/v1/config")' in js and "config.test_model" in js and "fillLanguages(" in js
    assert 'setState("idle", "finished"); showEmptyResult();' in js


def test_describe_tells_a_test_model_from_a_real_one(asr, tmp_path):
    """The tiny checkpoint by name, or any checkpoint with the tiny preset's dims, is a test model;
    other dims are a real Qwen3-ASR checkpoint, named by the directory it came from."""
    from dataclasses import replace

    from harken.cloud.model.asr import Qwen3ASR
    from harken.cloud.model.config import Qwen3ASRConfig
    from harken.cloud.model.tiny import make_tiny_model

    assert asr.describe()["kind"] == "tiny" and asr.describe()["test_model"]
    same_dims = make_tiny_model(tmp_path / "same", vocab="small")
    other = Qwen3ASRConfig.tiny()
    other_dims = make_tiny_model(tmp_path / "other", vocab="small",
                                 cfg=replace(other, text=replace(other.text, num_hidden_layers=1)))
    assert Qwen3ASR.load(str(same_dims)).describe()["test_model"] is True
    real = Qwen3ASR.load(str(other_dims)).describe()
    assert real == {"model": str(other_dims), "kind": "qwen3-asr", "test_model": False, "note": ""}


def test_an_idle_data_channel_stream_is_reaped_like_a_grpc_one(asr):
    """A data channel that sends Start and then nothing, on a server of one session with a short
    idle timeout: the stream ends DEADLINE_EXCEEDED with its reason in the status message (the
    data channel runs the stream handler gRPC runs), and its slot is free for the next stream."""
    from harken.edge.client.call import EOF, CallFailed
    from harken.edge.client.webrtc_client import PeerConnectionChannel
    from harken.shared.codec import CODEC_NAME
    from harken.shared.protocol import Ack, Ready, ServerError, Start

    kinds = {Ready: "ready", Ack: "ack", ServerError: "error"}

    async def main():
        server = await start_server(asr, ServerOptions(port=0, http_port=0, max_sessions=1, idle_timeout_s=0.3))
        try:
            url = f"http://127.0.0.1:{server.http_port}"
            async with PeerConnectionChannel(url, None, connect_timeout_s=10) as channel:
                call = channel.call()
                await call.write(Start(codec=CODEC_NAME, language=LANGUAGE))
                received = []
                try:
                    while (m := await call.read()) is not EOF:
                        received.append(kinds.get(type(m), type(m).__name__))
                    status = ("OK", "")
                except CallFailed as e:
                    status = (e.code, e.details)
            held = len(server._table.sessions)
            after = await _events(WebRTCTranscriptionClient(url, language=LANGUAGE), np.zeros(16000, np.float32))
            return received, status, held, after
        finally:
            await server.stop()

    received, (code, details), held, after = asyncio.run(asyncio.wait_for(main(), TIMEOUT))
    assert received == ["ready", "ack", "error"]  # the last Ack, then the Error, then the status
    assert code == "DEADLINE_EXCEEDED"
    assert details.startswith("the stream was idle for ") and "(limit 0.3 s)" in details
    assert held == 0
    assert after == []  # a second of silence: admitted, no words, ended OK


def test_cors_lets_only_the_named_origins_in(asr):
    """`--cors-origin`: a preflight for an offer from a named origin is answered (POST with
    Authorization), and every response to it carries the origin, errors included; another origin
    gets no CORS header (the browser keeps it out), its preflight no answer."""
    import aiohttp

    async def main():
        server = await start_server(asr, ServerOptions(port=0, http_port=0, cors_origins=("http://app.test",)))
        base = f"http://127.0.0.1:{server.http_port}"
        out = {}
        try:
            async with aiohttp.ClientSession() as c:
                preflight = {"Access-Control-Request-Method": "POST",
                             "Access-Control-Request-Headers": "authorization,content-type"}
                for origin in ("http://app.test", "http://other.test"):
                    async with c.options(base + "/v1/webrtc/offer", headers={"Origin": origin, **preflight}) as r:
                        out[origin, "preflight"] = (r.status, dict(r.headers))
                    async with c.get(base + "/v1/config", headers={"Origin": origin}) as r:
                        out[origin, "config"] = (r.status, dict(r.headers))
                    async with c.post(base + "/v1/webrtc/offer", data=b"{}", headers={"Origin": origin}) as r:
                        out[origin, "offer"] = (r.status, dict(r.headers))
                async with c.get(base + "/v1/config") as r:  # the server's own page: no Origin header
                    out["same origin"] = (r.status, dict(r.headers))
        finally:
            await server.stop()
        return out

    out = asyncio.run(asyncio.wait_for(main(), TIMEOUT))
    status, headers = out["http://app.test", "preflight"]
    assert status == 204 and headers["Access-Control-Allow-Origin"] == "http://app.test"
    assert "authorization" in headers["Access-Control-Allow-Headers"] and "POST" in headers["Access-Control-Allow-Methods"]
    assert out["http://app.test", "config"][0] == 200
    assert out["http://app.test", "offer"][0] == 400  # a bad offer, answered in words the page can read
    assert all(h["Access-Control-Allow-Origin"] == "http://app.test" for k, (_, h) in out.items() if k[0] == "http://app.test")
    assert all("Access-Control-Allow-Origin" not in h for k, (_, h) in out.items() if k[0] == "http://other.test")
    assert out["http://other.test", "preflight"][0] == 405
    # every answer varies by Origin, so no cache hands one origin's copy to another
    assert all("Origin" in h["Vary"] for _, h in out.values())
    assert "Access-Control-Allow-Origin" not in out["same origin"][1]
    for bad in (dict(cors_origins=("https://meet.example.com/",), http_port=0), dict(cors_origins=("*",))):
        with pytest.raises(HarkenError, match="--cors-origin"):
            ServerOptions(**bad)
