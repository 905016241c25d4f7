"""The OpenAI-compatible file API (cloud/adapters/openai_api.py) on `harken serve --http-port`, driven by
OpenAI's own Python client: json and text are `harken transcribe`'s offline passes (run in the serving
engine), their logprobs per token; segments and subtitles are the streaming engine's, as `harken
transcribe --format srt` makes them (in-process references); streamed deltas add up to the offline
text; files sent together are each the one-by-one text; errors come back as the client's typed
exceptions (401, 400, 413, 429)."""

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
                             "--http-port", str(port), "--api-keys", str(keys), "--max-upload-mb", "1",
                             "--max-files", "2", "--file-queue", "1"],
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


@pytest.fixture(scope="module")
def offline():
    """`harken transcribe`'s offline pass over the sample, English forced, in-process."""
    from harken.cloud.inference.offline import transcribe_audio
    from harken.cloud.model.asr import Qwen3ASR
    from harken.edge.audio import load_audio, peak_normalize

    asr = Qwen3ASR.load(MODEL)
    return asr, transcribe_audio(asr, peak_normalize(load_audio(str(SAMPLE))), "English")


def _client(server: str, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=server, api_key=key, max_retries=0, timeout=300)


def test_models_lists_the_served_model(server):
    assert [m.id for m in _client(server).models.list().data] == [MODEL]


def test_text_is_the_offline_pass_and_subtitles_the_engines_segments(server, reference, offline):
    client = _client(server)
    asr, out = offline
    text = events_text(reference)
    cues = cues_of(reference)
    assert text and len(cues) >= 2 and out.text
    with SAMPLE.open("rb") as f:
        got = client.audio.transcriptions.create(model=MODEL, file=f, language="en")
    assert got.text == out.text
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
    assert plain.strip() == out.text
    with SAMPLE.open("rb") as f:  # include=["logprobs"]: a log probability per token of the pass
        scored = client.audio.transcriptions.create(model=MODEL, file=f, language="en", include=["logprobs"])
    ids = out.pieces[0].token_ids  # English forced: no `language X<asr_text>` header among them
    assert scored.text == out.text and len(scored.logprobs) == len(ids) > 0
    assert [bytes(int(b) for b in p.bytes) for p in scored.logprobs] == [asr.tokenizer.token_bytes(t) for t in ids]
    assert all(p.logprob <= 0 for p in scored.logprobs)
    # (tests/test_file_passes.py checks the probabilities against a cache-free forward of the model)


def test_streamed_deltas_add_up_to_the_offline_text(server, offline):
    with SAMPLE.open("rb") as f:
        events = list(_client(server).audio.transcriptions.create(model=MODEL, file=f, language="en", stream=True))
    kinds = [e.type for e in events]
    assert kinds[-1] == "transcript.text.done" and set(kinds[:-1]) == {"transcript.text.delta"}
    assert len(kinds) >= 2  # a delta per pass (a 20-s file is one pass)
    assert "".join(e.delta for e in events[:-1]) == events[-1].text == offline[1].text


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


def test_files_together_are_one_by_one_and_past_the_queue_get_429(server, tmp_path):
    """Files sent together are each the text `harken transcribe` gives alone. The server
    transcribes 2 files together and holds 1 more waiting (`--max-files 2 --file-queue 1`): with 3
    requests in (their uploads stalled: a request takes its place as it arrives), OpenAI's client
    gets a RateLimitError with a Retry-After hint; once they leave, files are taken again."""
    from concurrent.futures import ThreadPoolExecutor

    from harken.cloud.inference.offline import transcribe_audio
    from harken.cloud.model.asr import Qwen3ASR
    from harken.edge.audio import load_audio, peak_normalize

    audio = peak_normalize(load_audio(str(SAMPLE)))
    clips = []
    for i, seconds in enumerate((4, 9, 14)):
        clip = tmp_path / f"clip{i}.wav"
        with wave.open(str(clip), "wb") as w:
            w.setnchannels(1)
            w.setsampwidth(2)
            w.setframerate(16000)
            w.writeframes((np.clip(audio, -1, 1) * 32767).astype("<i2")[:16000 * seconds].tobytes())
        clips.append(clip)
    asr = Qwen3ASR.load(MODEL)
    expected = [transcribe_audio(asr, peak_normalize(load_audio(str(c))), "English").text for c in clips]
    assert all(expected)

    def request(clip):
        with clip.open("rb") as f:
            return _client(server).audio.transcriptions.create(model=MODEL, file=f, language="en").text

    with ThreadPoolExecutor(3) as pool:  # 2 together, 1 waiting: none refused
        assert list(pool.map(request, clips)) == expected

    host, port = server.split("//")[1].split("/")[0].split(":")
    stalled = []
    for _ in range(3):
        s = socket.create_connection((host, int(port)))
        s.sendall(f"POST /v1/audio/transcriptions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEY}\r\n"
                  "Content-Type: multipart/form-data; boundary=xyz\r\nContent-Length: 100000\r\n\r\n"
                  "--xyz\r\n".encode())
        stalled.append(s)
    try:
        deadline = time.time() + 30
        while True:  # until the stalled requests hold their places (they arrive asynchronously)
            try:
                request(clips[0])
            except openai.RateLimitError as e:
                refused = e
                break
            assert time.time() < deadline, "never refused"
            time.sleep(0.05)
        assert refused.status_code == 429 and int(refused.response.headers["retry-after"]) > 0
        assert refused.body["code"] == "rate_limit_exceeded" and refused.body["type"] == "rate_limit_exceeded"
        assert "2 file(s) at once and holds 1 more waiting" in refused.body["message"]
    finally:
        for s in stalled:
            s.close()
    deadline = time.time() + 30
    while True:  # the places come back as the stalled requests end
        try:
            assert request(clips[0]) == expected[0]
            break
        except openai.RateLimitError:
            assert time.time() < deadline
            time.sleep(0.05)


def test_a_file_whose_client_goes_away_gives_its_place_back(tmp_path):
    """In-process: the engine's thread held (the scheduler stopped), a request's file waits in the
    engine; its client closes the connection: the file leaves the queue and its place comes back."""
    import asyncio

    from harken.cloud.server import ServerOptions, start_server

    clip = tmp_path / "clip.wav"
    with wave.open(str(clip), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes((np.random.default_rng(1).normal(0, 0.1, 16000 * 3) * 32767).astype("<i2").tobytes())
    body = (b"--xyz\r\nContent-Disposition: form-data; name=\"file\"; filename=\"clip.wav\"\r\n"
            b"Content-Type: audio/wav\r\n\r\n" + clip.read_bytes() + b"\r\n--xyz\r\n"
            b"Content-Disposition: form-data; name=\"model\"\r\n\r\nx\r\n--xyz--\r\n")

    async def main():
        server = await start_server(MODEL, ServerOptions(host="127.0.0.1", port=0, http_port=0))
        files = server._scheduler.files
        try:
            await server._scheduler.stop()  # nothing moves: the file stays queued
            reader, writer = await asyncio.open_connection("127.0.0.1", server.http_port)
            writer.write(b"POST /v1/audio/transcriptions HTTP/1.1\r\nHost: x\r\n"
                         b"Content-Type: multipart/form-data; boundary=xyz\r\n"
                         + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            await writer.drain()
            for _ in range(600):
                if files.pending() == 1:
                    break
                await asyncio.sleep(0.05)
            assert files.pending() == 1 and files._admitted == 1
            writer.close()
            for _ in range(600):
                if files._admitted == 0:
                    break
                await asyncio.sleep(0.05)
            assert files.pending() == 0 and files._admitted == 0
        finally:
            await server.stop(0)

    asyncio.run(main())
