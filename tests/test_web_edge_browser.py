"""The page's "features on this device" mode in a real Chromium (Debian's chromium, headless,
playwright), its fake microphone playing a generated speech WAV once: the AudioWorklet resamples
the device rate to 16 kHz, the edge worker runs silero VAD, the log-mel and the codec on
onnxruntime-web, and feature packets go over the data channel (edge/web/, served at /edge/).

Checked: features mode is the default; a wrong key is refused in words; the data channel cut
mid-stream is resumed (a new peer connection, the same session); the final transcript equals what
`harken stream --server` (the Python edge) gives on the same 16 kHz audio the page captured; the
page's log-mel (onnxruntime-web) is within 1e-4 of the Python edge's on that audio; the live kbps
shows. Also: the meeting-app API with two tracks (one session each, each text equal to `harken
stream` on that track's audio), the same API from a page on another origin (CORS), and a graceful server restart mid-stream (a seeded replacement
session finishes the stream). The tiny random checkpoint (tests/conftest.py) transcribes: its words mean
nothing, but the same features give the same words.

`make test` installs chromium and builds edge/web (npm); this test skips, loudly, only where
chromium cannot be found outside CI. A missing browser build is a failure.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from harken.cloud.server import ServerOptions, start_server
from signals import concat, silence, speech, write_wav
from test_webrtc_browser import CHROMIUM, POLICY, TIMEOUT_MS, _chromium_args

ROOT = Path(__file__).resolve().parents[1]
# a Float32Array as base64 (page -> test)
FLOAT32_B64 = """const b64 = (a) => { const b = new Uint8Array(a.buffer, a.byteOffset, a.byteLength); let s = '';
    for (let i = 0; i < b.length; i += 8192) s += String.fromCharCode(...b.subarray(i, i + 8192)); return btoa(s); };"""
KEY = "browser-edge-key-1"


def features_max_abs(a: np.ndarray, b: np.ndarray) -> float:
    """Max abs difference of two raw log10-mel streams [128, T] as the model sees them."""
    from harken.shared.features_spec import RunningMaxFloor

    return float(np.abs((RunningMaxFloor()(a) - RunningMaxFloor()(b)) / 4.0).max())


def _browser_build() -> Path:
    from harken.cloud.adapters.http_app import EDGE_WEB_DIR

    bundle = EDGE_WEB_DIR / "harken.js"
    assert bundle.exists(), f"no browser edge at {EDGE_WEB_DIR}: run `make web`"
    sources = (ROOT / "edge" / "web" / "src").rglob("*.ts")
    stale = [str(p.relative_to(ROOT)) for p in sources if p.stat().st_mtime > bundle.stat().st_mtime]
    assert not stale, f"the browser edge is older than {stale[:3]}: run `make web`"
    return EDGE_WEB_DIR


async def _harken_stream(wav: Path, grpc_port: int) -> str:
    """`harken stream WAV --server ... --language English --json`: its last line's final text."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "harken.cli", "stream", str(wav), "--server", f"127.0.0.1:{grpc_port}",
        "--api-key", KEY, "--language", "English", "--json", cwd=str(ROOT),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await proc.communicate()
    assert proc.returncode == 0, err.decode()[-3000:]
    last = json.loads(out.decode().strip().splitlines()[-1])
    assert last["final"] is True
    return last["text"]


def _page_setup(tmp_path: Path, audio: np.ndarray):
    """What every page test starts with: chromium and playwright present (in CI a missing one is a
    failure, elsewhere a loud skip), the browser build made, `audio` as a 48 kHz WAV for the fake
    microphone (played once), an API keys file. Returns (playwright module, wav, keys, chromium args)."""
    if not Path(CHROMIUM).exists():
        assert not os.environ.get("CI"), f"CI must run the browser test: no chromium at {CHROMIUM}"
        pytest.skip(f"!!! NO CHROMIUM at {CHROMIUM}: the browser test did NOT run (apt-get install chromium) !!!")
    playwright = pytest.importorskip("playwright.async_api", reason="!!! playwright missing: browser test NOT run !!!")
    import soxr

    _browser_build()
    wav = write_wav(tmp_path / "speech.wav", soxr.resample(audio, 16_000, 48_000), rate=48_000)
    keys = tmp_path / "keys"
    keys.write_text(f"{KEY} browser\n")
    args = [a + "%noloop" if a.startswith("--use-file-for-fake-audio-capture=") else a for a in _chromium_args(wav)]
    return playwright, wav, keys, args


def test_features_mode_gives_harken_streams_transcript_and_survives_a_cut_channel(asr, tmp_path):
    audio = concat(silence(0.5), speech("Hello there, this is a test of the browser page."), silence(1.5))
    playwright, wav, keys, args = _page_setup(tmp_path, audio)

    async def main():
        server = await start_server(asr, ServerOptions(port=0, http_port=0, api_keys=str(keys), policy=POLICY))
        try:
            async with playwright.async_playwright() as p:
                browser = await p.chromium.launch(executable_path=CHROMIUM, headless=True, args=args)
                try:
                    page = await browser.new_page()
                    errors: list[str] = []
                    page.on("pageerror", lambda e: errors.append(str(e)))
                    await page.goto(f"http://127.0.0.1:{server.http_port}/?capture=1")
                    await page.wait_for_function("document.body.dataset.edge", timeout=TIMEOUT_MS)
                    edge = await page.evaluate("document.body.dataset.edge")
                    default_mode = await page.evaluate("document.querySelector('input[name=mode]:checked').value")

                    await page.fill("#key", KEY)
                    await page.select_option("#language", "English")
                    await page.click("#start")
                    await page.wait_for_function("document.body.dataset.state === 'live'", timeout=TIMEOUT_MS)
                    # mid-speech: cut the data channel as a network fault would; the session resumes
                    await page.wait_for_function("window.harkenTrack.session.stats.messagesSent >= 4",
                                                 timeout=TIMEOUT_MS)
                    await page.evaluate("window.harkenTrack.dropChannel()")
                    await page.wait_for_function("window.harkenTrack.session.stats.resumes >= 1", timeout=TIMEOUT_MS)
                    # on audio time: the edge has processed the whole file (then silence) and every
                    # segment of it is final; then Stop
                    await page.wait_for_function(
                        f"window.harkenTrack.session.newSegmentBoundS >= {audio.size / 16_000 + 0.5} && "
                        "!window.harkenTrack.session.buffer.entries.length", timeout=3 * TIMEOUT_MS)
                    kbps = await page.inner_text("#kbps")
                    await page.click("#stop")
                    await page.wait_for_function("document.body.dataset.state === 'idle' && window.harkenCaptured",
                                                 timeout=TIMEOUT_MS)
                    final = {"text": await page.evaluate("document.body.dataset.finalText"),
                             "error": await page.inner_text("#error"),
                             "state": await page.inner_text("#state-text"),
                             "stats": await page.evaluate("({...window.harkenTrack.session.stats})"),
                             "last_final": await page.evaluate("window.harkenTrack.session.lastFinalSegment")}
                    captured_b64, mel_b64 = await page.evaluate(f"""() => {{ {FLOAT32_B64}
                        const c = window.harkenCaptured; return [b64(c.samples), b64(c.mel.data)]; }}""")

                    # (after the stream: the fake microphone plays its file from the first capture on)
                    await page.fill("#key", "wrong-key-123")
                    await page.click("#start")
                    await page.wait_for_function("document.querySelector('#error').textContent !== ''",
                                                 timeout=TIMEOUT_MS)
                    refused = await page.inner_text("#error")
                finally:
                    await browser.close()
            captured = np.frombuffer(base64.b64decode(captured_b64), dtype="<f4")
            browser_mel = np.frombuffer(base64.b64decode(mel_b64), dtype="<f4").reshape(128, -1)
            captured_wav = tmp_path / "captured.wav"
            sf.write(str(captured_wav), captured, 16_000, subtype="FLOAT")  # exact float32 samples
            reference = await _harken_stream(captured_wav, server.port)
        finally:
            await server.stop()
        return edge, default_mode, refused, kbps, final, captured, browser_mel, reference, errors

    edge, default_mode, refused, kbps, final, captured, browser_mel, reference, errors = asyncio.run(main())
    assert errors == []
    assert edge == "available" and default_mode == "features"
    assert "did not accept the API key" in refused and "UNAUTHENTICATED" in refused
    assert kbps.startswith("features: ") and kbps.endswith(" kbps")
    assert final["error"] == "" and final["state"] == "finished"
    assert final["stats"]["resumes"] >= 1 and final["stats"]["messagesResent"] >= 0
    # the page heard the whole file (played once from the capture's start, then silence)
    assert captured.size >= audio.size and float(np.abs(captured).max()) > 0.05
    # onnxruntime-web's log-mel in the page against the Python edge's on the same audio, as the model
    # gets them (floored at the running max - 8, then (x + 4) / 4); raw values far below that floor
    # (> 80 dB under the loudest bin) differ by more in float32 and never reach the model
    from harken.edge.features import log_mel_raw

    python_mel = log_mel_raw(captured)
    assert browser_mel.shape == python_mel.shape
    max_abs = features_max_abs(browser_mel, python_mel)
    assert max_abs <= 1e-4
    print(f"page: {final['text']!r}; harken stream: {reference!r}; {kbps}; log-mel max abs {max_abs:.2e}; "
          f"stats {final['stats']}")
    # the page got the server's finals (its segments were transcribed, not lost) and shows their
    # text exactly as `harken stream` does; the tiny random model may answer a segment with silence
    # (`language None`, as it does for some captures, whose start jitters), and then both are empty
    assert final["last_final"] >= 0 and final["stats"]["framesSent"] > 0
    assert final["text"] == reference


def test_the_meeting_app_api_runs_one_session_per_track(asr, tmp_path):
    """`harken.connect(url, {apiKey})`, `s.addTrack(track, {speaker})` twice (two participants),
    `s.on('transcript', ...)`, `s.close()`: as the README's meeting-app example, in the page's
    origin. Each track's transcript equals `harken stream` on the audio that track captured."""
    audio = concat(silence(0.3), speech("Good morning everyone."), silence(1.2))
    playwright, wav, keys, args = _page_setup(tmp_path, audio)
    seconds = audio.size / 16_000

    async def main():
        server = await start_server(asr, ServerOptions(port=0, http_port=0, api_keys=str(keys), policy=POLICY))
        try:
            async with playwright.async_playwright() as p:
                browser = await p.chromium.launch(executable_path=CHROMIUM, headless=True, args=args)
                try:
                    page = await browser.new_page()
                    await page.goto(f"http://127.0.0.1:{server.http_port}/")
                    result = await page.evaluate(f"""async () => {{ {FLOAT32_B64}
                        const harken = await import("/edge/harken.js");
                        const s = await harken.connect(location.origin, {{ apiKey: "{KEY}" }});
                        const mic = await navigator.mediaDevices.getUserMedia({{ audio: true }});
                        const track = mic.getAudioTracks()[0];
                        const events = [];
                        s.on("transcript", (e, {{ speaker }}) => events.push([speaker, e.committedDelta, e.isFinal]));
                        const tracks = [s.addTrack(track, {{ speaker: "alice", language: "English", capture: true }}),
                                        s.addTrack(track.clone(), {{ speaker: "bob", language: "English", capture: true }})];
                        // on audio time: both edges past the file, every segment final
                        await new Promise((resolve) => {{ const t = setInterval(() => {{
                            if (tracks.every((x) => x.session.newSegmentBoundS >= {seconds + 0.5}
                                                    && !x.session.buffer.entries.length)) {{ clearInterval(t); resolve(); }}
                        }}, 100); }});
                        for (const t of tracks) t.stop();
                        await Promise.all(tracks.map((t) => t.done));
                        const captured = await Promise.all(tracks.map((t) => t.captured()));
                        const texts = await s.close();
                        return {{ texts, events, captured: captured.map((c) => b64(c.samples)),
                                 sessions: tracks.map((t) => t.session.sessionId) }};
                    }}""")
                finally:
                    await browser.close()
            references = []
            for i, b in enumerate(result["captured"]):
                path = tmp_path / f"track{i}.wav"
                sf.write(str(path), np.frombuffer(base64.b64decode(b), dtype="<f4"), 16_000, subtype="FLOAT")
                references.append(await _harken_stream(path, server.port))
        finally:
            await server.stop()
        return result, references

    result, references = asyncio.run(main())
    assert len(set(result["sessions"])) == 2  # one session per track
    assert {e[0] for e in result["events"]} == {"alice", "bob"}
    assert all(t.strip() for t in result["texts"])
    assert result["texts"] == references


def test_a_meeting_app_on_another_origin_uses_the_edge_by_cors(asr, tmp_path):
    """The README's meeting app as it is deployed: its page on its own origin imports harken.js
    from the harken server and connects there (`--cors-origin` names the app). The browser fetches
    the module, the edge worker (a same-origin blob importing it), the worklet, the models and
    onnxruntime-web's files across origins, and posts the offer after a preflight; the track's
    transcript equals `harken stream` on the audio it captured."""
    from aiohttp import web

    audio = concat(silence(0.3), speech("Good morning everyone."), silence(1.2))
    playwright, wav, keys, args = _page_setup(tmp_path, audio)
    seconds = audio.size / 16_000

    async def main():
        async def blank(_):
            return web.Response(text="<!doctype html><title>meeting</title>", content_type="text/html")

        app = web.Application()
        app.router.add_get("/", blank)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        app_origin = f"http://127.0.0.1:{runner.addresses[0][1]}"
        server = await start_server(asr, ServerOptions(port=0, http_port=0, api_keys=str(keys), policy=POLICY,
                                                       cors_origins=(app_origin,)))
        harken_url = f"http://127.0.0.1:{server.http_port}"
        try:
            async with playwright.async_playwright() as p:
                browser = await p.chromium.launch(executable_path=CHROMIUM, headless=True, args=args)
                try:
                    page = await browser.new_page()
                    await page.goto(app_origin + "/")
                    result = await page.evaluate(f"""async () => {{ {FLOAT32_B64}
                        const harken = await import("{harken_url}/edge/harken.js");
                        const s = await harken.connect("{harken_url}", {{ apiKey: "{KEY}" }});
                        const mic = await navigator.mediaDevices.getUserMedia({{ audio: true }});
                        const t = s.addTrack(mic.getAudioTracks()[0], {{ speaker: "alice", language: "English",
                                                                        capture: true }});
                        await new Promise((resolve) => {{ const i = setInterval(() => {{
                            if (t.session.newSegmentBoundS >= {seconds + 0.5} && !t.session.buffer.entries.length) {{
                                clearInterval(i); resolve(); }}
                        }}, 100); }});
                        t.stop();
                        await t.done;
                        const captured = await t.captured();
                        const texts = await s.close();
                        return {{ origin: location.origin, texts, captured: b64(captured.samples) }};
                    }}""")
                finally:
                    await browser.close()
            path = tmp_path / "track.wav"
            sf.write(str(path), np.frombuffer(base64.b64decode(result["captured"]), dtype="<f4"), 16_000,
                     subtype="FLOAT")
            reference = await _harken_stream(path, server.port)
        finally:
            await server.stop()
            await runner.cleanup()
        return result, reference, app_origin, harken_url

    result, reference, app_origin, harken_url = asyncio.run(main())
    assert result["origin"] == app_origin != harken_url  # really across origins
    assert result["texts"][0].strip() and result["texts"] == [reference]


def test_a_server_restart_mid_stream_is_replayed_into_a_seeded_session(asr, tmp_path):
    """The server is stopped gracefully mid-stream (it finalises the open segment early) and
    started again on the same ports: the page's next call finds its session gone (NOT_FOUND), opens
    a replacement session seeded from the last final, replays every unfinished packet, and the
    stream finishes with every frame final and no error."""
    audio = concat(silence(0.5), speech("Hello there, this is a test of the browser page."), silence(1.5))
    playwright, wav, keys, args = _page_setup(tmp_path, audio)

    async def main():
        options = ServerOptions(port=0, http_port=0, api_keys=str(keys), policy=POLICY)
        server = await start_server(asr, options)
        restarted = None
        try:
            async with playwright.async_playwright() as p:
                browser = await p.chromium.launch(executable_path=CHROMIUM, headless=True, args=args)
                try:
                    page = await browser.new_page()
                    await page.goto(f"http://127.0.0.1:{server.http_port}/")
                    await page.wait_for_function("document.body.dataset.edge", timeout=TIMEOUT_MS)
                    await page.fill("#key", KEY)
                    await page.select_option("#language", "English")
                    await page.click("#start")
                    await page.wait_for_function("window.harkenTrack && window.harkenTrack.session.stats.messagesSent >= 4",
                                                 timeout=TIMEOUT_MS)
                    await server.stop()
                    restarted = await start_server(asr, replace(options, port=server.port, http_port=server.http_port))
                    await page.wait_for_function(
                        f"window.harkenTrack.session.newSegmentBoundS >= {audio.size / 16_000 + 0.5} && "
                        "!window.harkenTrack.session.buffer.entries.length", timeout=3 * TIMEOUT_MS)
                    await page.click("#stop")
                    await page.wait_for_function("document.body.dataset.state === 'idle'", timeout=TIMEOUT_MS)
                    return {"text": await page.evaluate("document.body.dataset.finalText"),
                            "error": await page.inner_text("#error"),
                            "stats": await page.evaluate("({...window.harkenTrack.session.stats})"),
                            "mismatches": await page.evaluate("window.harkenTrack.session.texts.mismatches")}
                finally:
                    await browser.close()
        finally:
            await server.stop(0)
            if restarted is not None:
                await restarted.stop(0)

    out = asyncio.run(main())
    print(f"server restart: {out}")
    assert out["error"] == "" and out["text"].strip()
    assert out["stats"]["sessionsOpened"] == 2 and out["mismatches"] == 0
    assert out["stats"]["framesSent"] >= out["stats"]["framesProduced"]  # every frame went out (resends too)
