"""`harken bench web`: bytes on the wire from the real browser page, features mode vs Opus mode,
on the same audio, and the page's features against the Python edge's.

An in-process `harken serve` (the model `--model`, default the tiny test checkpoint) serves the
page; Debian's chromium (headless, playwright) opens it with its fake microphone playing a WAV once
(`--use-file-for-fake-audio-capture=...%noloop`, at 48 kHz), English forced. Two inputs:

    speech   the bundled sample (`harken/data/sample.wav`, about 20 s, pauses between sentences)
    silence  10 s of white noise at -60 dBFS (a quiet room: the VAD hears no speech)

Figures (kbps = 1000 bits per second):

    features_kbps_speech    bytes the page wrote on the data channel over the whole stream (Start,
                            Features, End), per second of speech (the Python VAD's segments of the
                            sample): features are sent in speech only
    features_kbps_silence   the same bytes over the silence input, per second of it
    features_kbps_over_sample   the speech input's bytes per second of the whole sample (as Opus is
                            counted: the same audio, the same seconds)
    features_payload_kbps_speech   codec payload bytes only (no protobuf fields, no CRC) per
                            second of speech
    opus_kbps_speech        the page's Opus track: RTCStats outbound-rtp bytesSent +
                            headerBytesSent over the first len(sample) seconds after the call is
                            live, per second (Opus sends all the time, speech or not)
    opus_kbps_silence       the same over the silence input
    features_max_abs_vs_python   the page's log-mel (onnxruntime-web, WASM) against the Python
                            edge's on the 16 kHz audio the page captured, as the model gets them:
                            floored at the running max - 8, then (x + 4) / 4
    raw_log10_max_abs_vs_python   the same before flooring: bins more than 80 dB below the loudest
                            (which the floor removes) carry most of it

Payload bytes on both sides (no SCTP/DTLS or SRTP/UDP/IP overhead; `harken bench edge` counts
those on a loopback aiortc connection). Wall-clock paced: the fake microphone plays in real time.
"""

from __future__ import annotations

import asyncio
import base64
import json
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from harken.shared.errors import HarkenError

SILENCE_S = 10.0
TIMEOUT_MS = 60_000
_B64 = """const b64 = (a) => { const b = new Uint8Array(a.buffer, a.byteOffset, a.byteLength); let s = '';
    for (let i = 0; i < b.length; i += 8192) s += String.fromCharCode(...b.subarray(i, i + 8192)); return btoa(s); };"""


@dataclass(frozen=True)
class WebBenchOptions:
    model: str = "tiny"
    speech_wav: str | None = None  # default: the bundled sample
    language: str = "English"


def _chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        raise HarkenError("harken bench web needs chromium (apt-get install chromium; `make sysdeps`)")
    return path


def _args(wav: Path) -> list[str]:
    return ["--no-sandbox", "--disable-gpu", "--use-fake-ui-for-media-stream", "--use-fake-device-for-media-stream",
            f"--use-file-for-fake-audio-capture={wav}%noloop", "--disable-background-networking",
            "--disable-component-update", "--disable-sync", "--no-first-run",
            "--disable-features=WebRtcHideLocalIpsWithMdns"]


async def _run_page(playwright, chromium: str, url: str, wav: Path, mode: str, seconds: float,
                    language: str) -> dict:
    """One stream from the page: {bytes, seconds} (and for features the captured audio and mel)."""
    browser = await playwright.chromium.launch(executable_path=chromium, headless=True, args=_args(wav))
    try:
        page = await browser.new_page()
        await page.goto(url + "?capture=1")
        await page.wait_for_function("document.body.dataset.edge", timeout=TIMEOUT_MS)
        if mode == "features" and await page.evaluate("document.body.dataset.edge") != "available":
            raise HarkenError("the page's browser edge is not served: build it (`make web`)")
        await page.check(f"#mode-{mode}")
        await page.select_option("#language", language)
        await page.click("#start")
        await page.wait_for_function("document.body.dataset.state === 'live'", timeout=TIMEOUT_MS)
        out: dict = {}
        if mode == "opus":
            stats = """async () => { let n = 0; (await pc.getStats()).forEach((r) => {
                if (r.type === 'outbound-rtp') n += (r.bytesSent || 0) + (r.headerBytesSent || 0); }); return n; }"""
            t0, b0 = asyncio.get_running_loop().time(), await page.evaluate(stats)
            await asyncio.sleep(seconds)
            t1, b1 = asyncio.get_running_loop().time(), await page.evaluate(stats)
            out = {"bytes": b1 - b0, "seconds": t1 - t0}
            await page.click("#stop")
            await page.wait_for_function("document.body.dataset.state !== 'live'", timeout=TIMEOUT_MS)
            return out
        # features: on audio time, until the edge has processed the file and every segment is final
        await page.wait_for_function(
            f"window.harkenTrack.session.newSegmentBoundS >= {seconds + 0.5} && "
            "!window.harkenTrack.session.buffer.entries.length", timeout=int(1000 * seconds) + TIMEOUT_MS)
        await page.click("#stop")
        await page.wait_for_function("document.body.dataset.state === 'idle' && window.harkenCaptured",
                                     timeout=TIMEOUT_MS)
        sent = await page.evaluate("window.harkenTrack.bytesSent")
        payload = await page.evaluate("window.harkenTrack.session.stats.payloadBytesProduced")
        audio_b64, mel_b64 = await page.evaluate(f"""() => {{ {_B64}
            const c = window.harkenCaptured; return [b64(c.samples), b64(c.mel.data)]; }}""")
        return {"bytes": sent, "payload_bytes": payload, "seconds": seconds,
                "captured": np.frombuffer(base64.b64decode(audio_b64), dtype="<f4"),
                "mel": np.frombuffer(base64.b64decode(mel_b64), dtype="<f4").reshape(128, -1)}
    finally:
        await browser.close()


def bench_web(options: WebBenchOptions, log=lambda s: None) -> dict:
    try:
        from playwright.async_api import async_playwright
    except ImportError as e:
        raise HarkenError("harken bench web needs playwright (the dev extra: pip install 'harken[dev]')") from e
    import soxr
    import soundfile as sf

    from harken.cloud.model.asr import Qwen3ASR
    from harken.cloud.server import ServerOptions, start_server
    from harken.cloud.adapters.http_app import EDGE_WEB_DIR
    from harken.edge.audio import load_audio
    from harken.edge.features import log_mel_raw
    from harken.edge.vad import get_speech_timestamps
    from harken.shared.features_spec import RunningMaxFloor

    if not (EDGE_WEB_DIR / "harken.js").exists():
        raise HarkenError(f"no browser edge at {EDGE_WEB_DIR}: build it (`make web`)")
    chromium = _chromium()
    speech_path = options.speech_wav or str(Path(__file__).resolve().parents[2] / "harken" / "data" / "sample.wav")
    speech = load_audio(speech_path)
    speech_s = sum(s.end_s - s.start_s for s in get_speech_timestamps(speech))
    rng = np.random.default_rng(0)
    silence = (10 ** (-60 / 20) * rng.standard_normal(int(SILENCE_S * 16_000))).astype(np.float32)
    asr = Qwen3ASR.load(options.model)

    async def main() -> dict:
        with tempfile.TemporaryDirectory() as d:
            wavs = {}
            for name, x in (("speech", speech), ("silence", silence)):
                wavs[name] = Path(d) / f"{name}.wav"
                sf.write(str(wavs[name]), soxr.resample(x, 16_000, 48_000), 48_000, subtype="PCM_16")
            server = await start_server(asr, ServerOptions(port=0, http_port=0))
            try:
                url = f"http://127.0.0.1:{server.http_port}/"
                runs = {}
                async with async_playwright() as p:
                    for mode in ("features", "opus"):
                        for name, x in (("speech", speech), ("silence", silence)):
                            log(f"{mode} mode, {name} ({x.size / 16_000:.1f} s)")
                            runs[mode, name] = await _run_page(p, chromium, url, wavs[name], mode,
                                                               x.size / 16_000, options.language)
            finally:
                await server.stop()
        return runs

    runs = asyncio.run(main())
    page = runs["features", "speech"]
    python_mel = log_mel_raw(page["captured"])
    if python_mel.shape != page["mel"].shape:
        raise HarkenError(f"the page computed {page['mel'].shape[1]} frames, Python {python_mel.shape[1]}")
    model_input = np.abs((RunningMaxFloor()(page["mel"]) - RunningMaxFloor()(python_mel)) / 4.0).max()

    def kbps(run: dict, seconds: float) -> float:
        return round(8 * run["bytes"] / seconds / 1000, 2)

    return {
        "features_kbps_speech": kbps(runs["features", "speech"], speech_s),
        "features_kbps_silence": kbps(runs["features", "silence"], SILENCE_S),
        "features_kbps_over_sample": kbps(runs["features", "speech"], speech.size / 16_000),
        "features_payload_kbps_speech": round(8 * runs["features", "speech"]["payload_bytes"] / speech_s / 1000, 2),
        "opus_kbps_speech": kbps(runs["opus", "speech"], runs["opus", "speech"]["seconds"]),
        "opus_kbps_silence": kbps(runs["opus", "silence"], runs["opus", "silence"]["seconds"]),
        "features_max_abs_vs_python": float(f"{model_input:.3g}"),
        "raw_log10_max_abs_vs_python": float(f"{np.abs(page['mel'] - python_mel).max():.3g}"),
        "speech_s": round(speech_s, 2), "sample_s": round(speech.size / 16_000, 2), "silence_s": SILENCE_S,
        "features_bytes_speech": runs["features", "speech"]["bytes"],
        "features_bytes_silence": runs["features", "silence"]["bytes"],
        "model": options.model,
    }


def bench_web_command(options: WebBenchOptions) -> int:
    result = bench_web(options, log=lambda s: print(f"bench web: {s}", file=sys.stderr, flush=True))
    print(json.dumps(result, indent=1))
    return 0
