"""The browser page (cloud/web/) in a real Chromium: Debian's chromium, headless, driven by
playwright, its fake microphone playing a generated speech WAV. The page asks for the microphone,
connects over WebRTC (Opus track + data channel) to `harken serve`'s HTTP port, and shows the live
transcript. Checked: the page says the server runs a test model (the tiny one); a wrong key is
refused in words; a stream without words (the tiny model with the language left to detect writes
none) ends with the message saying so; with the English hint text appears (committed solid, partial
grey), the connection state says live, Stop ends the stream cleanly, no empty-result message; a
screenshot is saved (`HARKEN_SCREENSHOT=path` copies it there as well, e.g. docs/webrtc.png).

`make test` installs chromium (apt); this test skips, loudly, only where it cannot be found.
"""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

import pytest

from harken.cloud.inference.commit import CommitPolicy
from harken.cloud.server import ServerOptions, start_server
from signals import concat, silence, speech, write_wav

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or "/usr/bin/chromium"
KEY = "browser-test-key-1"
# short budgets keep the tiny model's random text short and quick
POLICY = CommitPolicy(update_interval_s=0.5, rollback_tokens=2, max_new_tokens_per_update=6, max_item_tokens=24)
TIMEOUT_MS = 30_000


def _chromium_args(wav: Path) -> list[str]:
    # (playwright's launch() gives the browser a fresh profile directory of its own)
    return ["--no-sandbox", "--disable-gpu", "--use-fake-ui-for-media-stream",
            "--use-fake-device-for-media-stream", f"--use-file-for-fake-audio-capture={wav}",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            "--no-first-run",
            # host candidates as addresses, not mDNS names: the server resolves no .local names
            "--disable-features=WebRtcHideLocalIpsWithMdns"]


def test_browser_page_streams_the_microphone_and_shows_the_transcript(asr, tmp_path):
    if not Path(CHROMIUM).exists():
        # CI runs `make test`, which installs chromium: a missing browser there is a failure
        assert not os.environ.get("CI"), f"CI must run the browser test: no chromium at {CHROMIUM}"
        pytest.skip(f"!!! NO CHROMIUM at {CHROMIUM}: the browser test did NOT run (apt-get install chromium) !!!")
    playwright = pytest.importorskip("playwright.async_api", reason="!!! playwright missing: browser test NOT run !!!")
    import soxr

    audio = concat(silence(0.5), speech("Hello there, this is a test of the browser page."), silence(1.0))
    wav = write_wav(tmp_path / "speech.wav", soxr.resample(audio, 16_000, 48_000), rate=48_000)
    keys = tmp_path / "keys"
    keys.write_text(f"{KEY} browser\n")
    shot = tmp_path / "webrtc.png"

    async def main():
        server = await start_server(asr, ServerOptions(port=0, http_port=0, api_keys=str(keys), policy=POLICY))
        try:
            async with playwright.async_playwright() as p:
                browser = await p.chromium.launch(executable_path=CHROMIUM, headless=True,
                                                  args=_chromium_args(wav))
                try:
                    page = await browser.new_page(viewport={"width": 900, "height": 520})
                    await page.goto(f"http://127.0.0.1:{server.http_port}/")
                    await page.wait_for_selector("#model-banner", state="visible", timeout=TIMEOUT_MS)
                    banner = await page.inner_text("#model-banner")
                    # the Opus track path (features mode: tests/test_web_edge_browser.py)
                    await page.wait_for_function("document.body.dataset.edge", timeout=TIMEOUT_MS)
                    await page.check("#mode-opus")

                    await page.fill("#key", "wrong-key-123")
                    await page.click("#start")
                    await page.wait_for_function("document.querySelector('#error').textContent !== ''",
                                                 timeout=TIMEOUT_MS)
                    refused = await page.inner_text("#error")

                    await page.fill("#key", KEY)
                    await page.select_option("#language", "")  # detect: the tiny model writes nothing
                    await page.click("#start")
                    await page.wait_for_function("document.body.dataset.state === 'live'", timeout=TIMEOUT_MS)
                    await page.click("#stop")
                    await page.wait_for_function("document.body.dataset.state === 'idle'", timeout=TIMEOUT_MS)
                    empty = {"visible": await page.is_visible("#empty-result"),
                             "text": await page.inner_text("#empty-result"),
                             "committed": await page.eval_on_selector_all(
                                 "#transcript .committed", "es => es.map(e => e.textContent).join('')")}

                    await page.select_option("#language", "English")
                    await page.click("#start")
                    await page.wait_for_function(
                        "[...document.querySelectorAll('#transcript .committed')].some(e => e.textContent.trim())",
                        timeout=TIMEOUT_MS)
                    live = {"state": await page.inner_text("#state"), "error": await page.inner_text("#error"),
                            "committed": await page.eval_on_selector_all(
                                "#transcript .committed", "es => es.map(e => e.textContent).join('')"),
                            "colors": await page.evaluate(
                                "['committed', 'partial'].map(c => { const e = document.createElement('span');"
                                " e.className = c; document.querySelector('#transcript').append(e);"
                                " const v = getComputedStyle(e).color; e.remove(); return v; })")}
                    await page.screenshot(path=str(shot))
                    await page.click("#stop")
                    await page.wait_for_function("document.body.dataset.state === 'idle'", timeout=TIMEOUT_MS)
                    final = {"state": await page.inner_text("#state"), "error": await page.inner_text("#error"),
                             "partials": await page.eval_on_selector_all(
                                 "#transcript .partial", "es => es.map(e => e.textContent).join('')"),
                             "empty_shown": await page.is_visible("#empty-result")}
                finally:
                    await browser.close()
        finally:
            await server.stop()
        return banner, refused, empty, live, final

    banner, refused, empty, live, final = asyncio.run(main())
    assert "test model (tiny)" in banner and "meaningless" in banner
    assert "did not accept the API key" in refused and "UNAUTHENTICATED" in refused
    assert empty["committed"].strip() == "" and empty["visible"] and "Nothing was recognised" in empty["text"]
    assert live["state"].strip() == "live: listening" and live["error"] == ""
    assert live["committed"].strip()
    committed_color, partial_color = live["colors"]
    assert committed_color == "rgb(17, 17, 17)" and partial_color == "rgb(153, 153, 153)"
    assert final["state"].strip() == "finished" and final["error"] == ""
    assert final["partials"] == ""  # every segment final after Stop: nothing left grey
    assert not final["empty_shown"]
    assert shot.stat().st_size > 10_000
    if os.environ.get("HARKEN_SCREENSHOT"):
        shutil.copy(shot, os.environ["HARKEN_SCREENSHOT"])
