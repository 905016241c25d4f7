"""The OpenAI-compatible file API (cloud/adapters/openai_api.py) on `harken serve --http-port`, driven by
OpenAI's own Python client: the text, segments and subtitles it returns are harken's streaming
engine's for the same audio (an in-process reference), streamed deltas add up to the text, and
errors come back as the client's typed exceptions (401, 400, 413)."""

from __future__ import annotations

import io
import re
import socket
import subprocess
import sys
import time
import wave
from pathlib import Path

import numpy as np
import openai
import pytest
import srt

from harken.shared.subtitles import cues_of
from harken.shared.text import events_text

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "harken" / "data" / "sample.wav"
KEY = "sk-harken-test-key-0123456789"
MODEL = "tiny-untied"  # a model that writes words: texts, segments and cues to compare


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text(KEY + "\n")
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "harken.cli", "serve", "--model", MODEL, "--port", "0",
                             "--http-port", str(port), "--api-keys", str(keys), "--max-upload-mb", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    deadline = time.time() + 120
    lines = []
    while time.time() < deadline:
        line = proc.stdout.readline()
        lines.append(line)
        if "browser page on" in line:
            break
        if proc.poll() is not None:
            pytest.fail("harken serve exited: " + "".join(lines)[-2000:])
    else:
        proc.kill()
        pytest.fail("harken serve did not start: " + "".join(lines)[-2000:])
    yield f"http://127.0.0.1:{port}/v1"
    proc.terminate()
    proc.wait(30)


@pytest.fixture(scope="module")
def reference():
    """The streaming engine's events for the sample, in-process, English forced (what harken stream gives)."""
    from harken.cloud.embedded import stream_audio
    from harken.cloud.inference.engine import Engine, EngineConfig
    from harken.cloud.model.asr import Qwen3ASR
    from harken.cloud.inference.decoder_stream import SessionOptions
    from harken.edge.audio import load_audio, peak_normalize

    asr = Qwen3ASR.load(MODEL)
    options = SessionOptions(language="English")
    engine = Engine(asr, EngineConfig(max_sessions=1, max_batch=1, slot_policy=options.policy))
    return list(stream_audio(peak_normalize(load_audio(str(SAMPLE))), engine, options))


def _client(server: str, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=server, api_key=key, max_retries=0, timeout=300)


def test_models_lists_the_served_model(server):
    assert [m.id for m in _client(server).models.list().data] == [MODEL]


def test_text_segments_and_subtitles_are_the_engines(server, reference):
    client = _client(server)
    text = events_text(reference)
    cues = cues_of(reference)
    assert text and len(cues) >= 2
    with SAMPLE.open("rb") as f:
        got = client.audio.transcriptions.create(model=MODEL, file=f, language="en")
    assert got.text == text
    with SAMPLE.open("rb") as f:
        verbose = client.audio.transcriptions.create(model=MODEL, file=f, language="en",
                                                     response_format="verbose_json")
    assert verbose.text == text and verbose.language == "english" and abs(verbose.duration - 20.1) < 0.2
    assert [(s.start, s.end, s.text) for s in verbose.segments] == [(c.start_s, c.end_s, c.text) for c in cues]
    with SAMPLE.open("rb") as f:
        subtitles = client.audio.transcriptions.create(model=MODEL, file=f, language="en", response_format="srt")
    parsed = list(srt.parse(subtitles))
    assert [(p.start.total_seconds(), p.end.total_seconds()) for p in parsed] == \
        [(round(c.start_s, 3), round(c.end_s, 3)) for c in cues]
    with SAMPLE.open("rb") as f:
        plain = client.audio.transcriptions.create(model=MODEL, file=f, language="en", response_format="text")
    assert plain.strip() == text
    with SAMPLE.open("rb") as f:  # include=["logprobs"]: a log probability per word (harken's word confidence)
        scored = client.audio.transcriptions.create(model=MODEL, file=f, language="en", include=["logprobs"])
    import math

    expected = [(w, math.log(c)) for e in reference if e.word_confidence
                for w, c in zip(events_text([x for x in reference if x.segment_id == e.segment_id]).split()
                                [-len(e.word_confidence):], e.word_confidence)]
    assert scored.text == text and len(scored.logprobs) == len(expected) > 0
    assert [(p.token, p.logprob) for p in scored.logprobs] == [(w, pytest.approx(lp, abs=1e-3)) for w, lp in expected]


def test_streamed_deltas_add_up_to_the_text(server, reference):
    with SAMPLE.open("rb") as f:
        events = list(_client(server).audio.transcriptions.create(model=MODEL, file=f, language="en", stream=True))
    kinds = [e.type for e in events]
    assert kinds[-1] == "transcript.text.done" and set(kinds[:-1]) == {"transcript.text.delta"}
    assert len(kinds) > 3  # the text arrives as the file is decoded, not at once
    assert "".join(e.delta for e in events[:-1]) == events[-1].text == events_text(reference)


def test_errors_are_openais(server, tmp_path):
    with SAMPLE.open("rb") as f, pytest.raises(openai.AuthenticationError) as e:
        _client(server, key="sk-wrong").audio.transcriptions.create(model=MODEL, file=f)
    assert e.value.status_code == 401
    with SAMPLE.open("rb") as f, pytest.raises(openai.BadRequestError) as bad:
        _client(server).audio.transcriptions.create(model=MODEL, file=f, language="xx-nonsense")
    assert bad.value.body["param"] == "language" and "unsupported language" in bad.value.body["message"]
    for stream in (False, True):  # a streamed reply must refuse before its 200, not after
        with SAMPLE.open("rb") as f, pytest.raises(openai.BadRequestError) as long_prompt:
            _client(server).audio.transcriptions.create(model=MODEL, file=f, prompt="word " * 400, stream=stream)
        assert long_prompt.value.body["param"] == "prompt" and "too long" in long_prompt.value.body["message"]
    big = tmp_path / "long.wav"
    with wave.open(str(big), "wb") as w:  # 40 s of 16-bit noise: 1.3 MB, over the server's 1 MiB
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes((np.random.default_rng(0).normal(0, 0.1, 640_000) * 32767).astype("<i2").tobytes())
    with big.open("rb") as f, pytest.raises(openai.APIStatusError) as large:
        _client(server).audio.transcriptions.create(model=MODEL, file=f)
    assert large.value.status_code == 413 and large.value.body["code"] == "file_too_large"
    with pytest.raises(openai.BadRequestError) as junk:
        _client(server).audio.transcriptions.create(model=MODEL, file=("x.wav", io.BytesIO(b"not audio at all")))
    assert junk.value.body["param"] == "file" and not re.search(r"/tmp/|harken-upload", junk.value.body["message"])


def test_realtime_transcription_session_is_harkens_stream(server):
    """OpenAI's Realtime client, transcription session over WebSocket: the audio as base64 PCM16
    (16 kHz here, so the server's front end sees the samples the reference did), one item per
    harken segment whose deltas add up to its completed transcript, in the order and with the text
    of the in-process engine run on the same 16-bit samples."""
    import base64

    from harken.cloud.embedded import stream_audio
    from harken.cloud.inference.engine import Engine, EngineConfig
    from harken.cloud.model.asr import Qwen3ASR
    from harken.cloud.inference.decoder_stream import SessionOptions
    from harken.edge.audio import load_audio, peak_normalize

    pcm = (np.clip(peak_normalize(load_audio(str(SAMPLE))), -1, 1) * 32767).astype("<i2")
    asr = Qwen3ASR.load(MODEL)
    options = SessionOptions(language="English")
    engine = Engine(asr, EngineConfig(max_sessions=1, max_batch=1, slot_policy=options.policy))
    reference = list(stream_audio(pcm.astype(np.float32) / 32768.0, engine, options))
    expected = [t for t in (events_text([e for e in reference if e.segment_id == f.segment_id]).strip()
                            for f in reference if f.is_final)]

    client = _client(server)
    with client.realtime.connect(model=MODEL) as conn:
        conn.session.update(session={"type": "transcription", "audio": {"input": {
            "format": {"type": "audio/pcm", "rate": 16000}, "transcription": {"model": MODEL, "language": "en"}}}})
        piece = 1600 * 2  # 200 ms
        for i in range(0, len(pcm), piece):
            conn.input_audio_buffer.append(audio=base64.b64encode(pcm[i:i + piece].tobytes()).decode())
        conn.input_audio_buffer.commit()
        events, completed = [], []
        while len(completed) < len(expected):
            event = conn.recv()
            events.append(event)
            assert event.type != "error", event
            if event.type == "conversation.item.input_audio_transcription.completed":
                completed.append(event)
    kinds = [e.type for e in events]
    assert kinds[0] == "session.created" and "session.updated" in kinds
    assert [c.transcript for c in completed] == expected
    for c in completed:  # an item's deltas add up to its transcript
        deltas = [e.delta for e in events if e.type == "conversation.item.input_audio_transcription.delta"
                  and e.item_id == c.item_id]
        assert "".join(deltas).strip() == c.transcript
        started = kinds.index("input_audio_buffer.speech_started")
        assert started < kinds.index("conversation.item.input_audio_transcription.completed")
    assert len({c.item_id for c in completed}) == len(completed)
    # the VAD's turn events, not waiting for text: an item's speech_started before its first delta,
    # its speech_stopped and committed before its text is complete
    for c in completed:
        at = {e.type: i for i, e in reversed(list(enumerate(events))) if getattr(e, "item_id", None) == c.item_id}
        assert at["input_audio_buffer.speech_started"] < at.get("conversation.item.input_audio_transcription.delta",
                                                                  len(events))
        assert at["input_audio_buffer.speech_stopped"] < at["input_audio_buffer.committed"] \
            < at["conversation.item.input_audio_transcription.completed"]


def test_realtime_commit_mid_speech_completes_the_item_at_once(server):
    """input_audio_buffer.commit while the speaker is still talking (push-to-talk released early):
    the item ends at the audio appended so far and completes without waiting for more audio; the
    rest of the speech is the next item."""
    import base64

    from harken.edge.audio import load_audio, peak_normalize

    pcm = (np.clip(peak_normalize(load_audio(str(SAMPLE))), -1, 1) * 32767).astype("<i2")
    client = _client(server)
    with client.realtime.connect(model=MODEL) as conn:
        conn.session.update(session={"type": "transcription", "audio": {"input": {
            "format": {"type": "audio/pcm", "rate": 16000}, "transcription": {"model": MODEL, "language": "en"}}}})
        half = 16000 * 2  # 2 s in: inside the sample's first sentence
        for i in range(0, half, 3200):
            conn.input_audio_buffer.append(audio=base64.b64encode(pcm[i:i + 3200].tobytes()).decode())
        conn.input_audio_buffer.commit()
        events = []
        while not events or events[-1].type != "conversation.item.input_audio_transcription.completed":
            events.append(conn.recv())  # no more audio is sent until the item is complete
            assert events[-1].type != "error", events[-1]
        first = events[-1]
        stopped = [e for e in events if e.type == "input_audio_buffer.speech_stopped"]
        assert [e.item_id for e in stopped] == [first.item_id] and stopped[0].audio_end_ms <= 2000
        for i in range(half, len(pcm), 3200):
            conn.input_audio_buffer.append(audio=base64.b64encode(pcm[i:i + 3200].tobytes()).decode())
        conn.input_audio_buffer.commit()
        while events[-1].type != "conversation.item.input_audio_transcription.completed" or events[-1] is first:
            events.append(conn.recv())
            assert events[-1].type != "error", events[-1]
        starts = [e for e in events if e.type == "input_audio_buffer.speech_started"]
        assert len(starts) >= 2 and starts[1].item_id != first.item_id
        # the next item starts where the cut ended it (speech going on) or at the next onset (a pause)
        assert stopped[0].audio_end_ms <= starts[1].audio_start_ms <= stopped[0].audio_end_ms + 300


def test_a_client_written_for_vllms_realtime_endpoint_works_unchanged(server):
    """vLLM's /v1/realtime dialect, spoken as its example client does (raw websockets): session.update
    with a model, a commit to start, 16 kHz PCM16 appends, a final commit; transcription.delta events
    add up to transcription.done's text, which is the engine's text for those 16-bit samples."""
    import asyncio
    import base64
    import json

    import websockets

    from harken.edge.audio import load_audio, peak_normalize

    pcm = (np.clip(peak_normalize(load_audio(str(SAMPLE))), -1, 1) * 32767).astype("<i2")

    async def client() -> list[dict]:
        url = server.replace("http://", "ws://") + "/realtime"
        async with websockets.connect(url, additional_headers={"Authorization": f"Bearer {KEY}"},
                                      max_size=None) as ws:
            assert json.loads(await ws.recv())["type"] == "session.created"
            await ws.send(json.dumps({"type": "session.update", "model": MODEL}))
            await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
            for i in range(0, len(pcm), 4096):
                await ws.send(json.dumps({"type": "input_audio_buffer.append",
                                          "audio": base64.b64encode(pcm[i:i + 4096].tobytes()).decode()}))
            await ws.send(json.dumps({"type": "input_audio_buffer.commit", "final": True}))
            got = []
            while not got or got[-1]["type"] != "transcription.done":
                got.append(json.loads(await asyncio.wait_for(ws.recv(), 120)))
                assert got[-1]["type"] != "error", got[-1]
            return got

    events = asyncio.run(client())
    deltas = [e["delta"] for e in events if e["type"] == "transcription.delta"]
    assert deltas and "".join(deltas) == events[-1]["text"]
    # the language is the model's to find here (vLLM's session has none): compare with a thin client's text
    from harken.cloud.embedded import stream_audio
    from harken.cloud.inference.engine import Engine, EngineConfig
    from harken.cloud.model.asr import Qwen3ASR
    from harken.cloud.inference.decoder_stream import SessionOptions

    asr = Qwen3ASR.load(MODEL)
    engine = Engine(asr, EngineConfig(max_sessions=1, max_batch=1))
    assert events[-1]["text"] == events_text(list(stream_audio(pcm.astype(np.float32) / 32768.0, engine,
                                                                SessionOptions())))


def test_file_requests_past_the_lane_and_its_queue_get_429_with_retry_after(server, tmp_path):
    """The server transcribes 1 file at a time and holds 4 more waiting (`--file-lanes 1`, the
    queue's default): of 9 requests sent at once through OpenAI's client, 5 are admitted and get the
    engine's text for the file, 4 get the client's RateLimitError with a Retry-After hint."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from harken.cloud.embedded import stream_audio
    from harken.cloud.inference.engine import Engine, EngineConfig
    from harken.cloud.model.asr import Qwen3ASR
    from harken.cloud.adapters.openai_api import ApiLimits
    from harken.cloud.inference.decoder_stream import SessionOptions
    from harken.edge.audio import load_audio, peak_normalize

    clip = tmp_path / "clip.wav"
    pcm = (np.clip(peak_normalize(load_audio(str(SAMPLE))), -1, 1) * 32767).astype("<i2")[:16000 * 6]
    with wave.open(str(clip), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes(pcm.tobytes())
    options = SessionOptions(language="English")
    engine = Engine(Qwen3ASR.load(MODEL), EngineConfig(max_sessions=1, max_batch=1, slot_policy=options.policy))
    expected = events_text(list(stream_audio(peak_normalize(load_audio(str(clip))), engine, options)))
    assert expected

    limits = ApiLimits()
    n = limits.lanes + limits.queue + 4
    together = threading.Barrier(n)

    def request():
        client = _client(server)
        together.wait()
        try:
            with clip.open("rb") as f:
                return client.audio.transcriptions.create(model=MODEL, file=f, language="en").text
        except openai.RateLimitError as e:
            return e

    with ThreadPoolExecutor(n) as pool:
        results = list(pool.map(lambda _: request(), range(n)))
    refused = [r for r in results if isinstance(r, openai.RateLimitError)]
    admitted = [r for r in results if isinstance(r, str)]
    assert len(refused) == n - limits.lanes - limits.queue and len(admitted) == limits.lanes + limits.queue
    assert admitted == [expected] * len(admitted)
    for e in refused:
        assert e.status_code == 429 and int(e.response.headers["retry-after"]) > 0
        assert e.body["code"] == "rate_limit_exceeded" and e.body["type"] == "rate_limit_exceeded"
    with clip.open("rb") as f:  # the lane is free again
        assert _client(server).audio.transcriptions.create(model=MODEL, file=f, language="en").text == expected
