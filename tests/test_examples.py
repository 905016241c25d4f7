"""examples/: each script run as a user runs it, on the tiny model with English forced (so that it
writes text), against the real engine or a real server on loopback; what it prints or returns is
checked against an independent path to the same text (the offline pass, the in-process engine).
A microphone is the one thing replaced: by the same audio in the 100 ms pieces a microphone gives."""

from __future__ import annotations

import asyncio
import importlib.util
import io
from pathlib import Path

import numpy as np
import pytest
import soundfile
import webvtt

from harken.cloud.embedded import stream_audio
from harken.cloud.inference.decoder_stream import SessionOptions
from harken.cloud.inference.engine import Engine, EngineConfig
from harken.cloud.inference.offline import transcribe_audio
from harken.cloud.server import ServerOptions, start_server
from harken.edge.audio import load_audio, peak_normalize
from harken.shared.text import events_text
from signals import concat, silence, speech

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
LANGUAGE = "English"
MODEL = "tiny-untied"  # the tiny random checkpoint that writes words


@pytest.fixture(scope="module")
def asr():
    import torch

    from harken.cloud.model.asr import Qwen3ASR

    torch.set_num_threads(1)
    return Qwen3ASR.load(MODEL, dtype="fp32", device="cpu")


def example(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _pcm16(x: np.ndarray) -> np.ndarray:
    """On the PCM16 grid: a wav file holds exactly these samples."""
    return (np.clip(np.round(peak_normalize(x) * 32768), -32768, 32767) / 32768).astype(np.float32)


@pytest.fixture(scope="module")
def audio() -> np.ndarray:
    return _pcm16(concat(silence(0.3), speech("Hello there."), silence(0.8), speech("Good morning, how are you?"),
                         silence(0.6)))


@pytest.fixture(scope="module")
def wav(audio, tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("examples") / "talk.wav"
    soundfile.write(path, audio, 16000, subtype="PCM_16")
    return str(path)


def _events(asr, audio: np.ndarray) -> list:
    return list(stream_audio(audio, Engine(asr, EngineConfig(max_sessions=1, max_batch=1)),
                             SessionOptions(language=LANGUAGE)))


def _finals(asr, audio: np.ndarray) -> list[tuple[float, str]]:
    """The in-process engine's final segments: (start_s, all the segment's committed text)."""
    events = _events(asr, audio)
    return [(e.start_s, events_text([x for x in events if x.segment_id == e.segment_id]).strip())
            for e in events if e.is_final]


def test_file_to_text_prints_the_offline_pass_and_live_the_engines_finals(asr, audio, wav):
    script = example("file_to_text")
    out = io.StringIO()
    assert script.main([wav, "--model", MODEL, "--language", LANGUAGE], out=out) == 0
    text = transcribe_audio(asr, peak_normalize(load_audio(wav)), LANGUAGE).text
    assert text and out.getvalue() == text + "\n"
    out = io.StringIO()
    assert script.main([wav, "--model", MODEL, "--language", LANGUAGE, "--live"], out=out) == 0
    finals = _finals(asr, audio)
    assert len(finals) == 2 and all(t for _, t in finals)
    assert out.getvalue() == "".join(f"[{start:6.2f} s] {t}\n" for start, t in finals)


def test_microphone_streams_live_to_a_server_and_gets_the_engines_finals(asr, audio):
    script = example("microphone")

    async def microphone():  # what the microphone gives: 100 ms pieces as they come
        for i in range(0, audio.size, 1600):
            yield audio[i:i + 1600]
            await asyncio.sleep(0)

    async def main():
        server = await start_server(asr, ServerOptions(host="127.0.0.1", port=0))
        try:
            return await asyncio.wait_for(script.transcribe_live(f"127.0.0.1:{server.port}", microphone(),
                                                                 language=LANGUAGE, out=io.StringIO()), 120)
        finally:
            await server.stop(0)

    assert asyncio.run(main()) == [t for _, t in _finals(asr, audio)]


def test_meeting_tracks_labels_each_participants_lines_in_time_order(asr):
    script = example("meeting_tracks")
    alice = _pcm16(concat(silence(0.3), speech("Good morning everyone."), silence(3.0)))
    bob = _pcm16(concat(silence(2.2), speech("Morning. Shall we start?"), silence(0.8)))

    async def main():
        server = await start_server(asr, ServerOptions(host="127.0.0.1", port=0))
        try:
            return await asyncio.wait_for(script.transcribe_meeting(
                f"127.0.0.1:{server.port}", {"alice": alice, "bob": bob}, language=LANGUAGE, out=io.StringIO()), 120)
        finally:
            await server.stop(0)

    lines = asyncio.run(main())
    expected = sorted([(start, i, who, t) for i, (who, track) in enumerate([("alice", alice), ("bob", bob)])
                       for start, t in _finals(asr, track) if t])
    assert {who for _, _, who, _ in expected} == {"alice", "bob"}
    assert [(line.speaker, line.text) for line in lines] == [(who, t) for _, _, who, t in expected]


def test_openai_client_gets_the_offline_text_the_engines_subtitles_and_stream(asr, audio, wav):
    script = example("openai_client")

    async def main():
        server = await start_server(asr, ServerOptions(host="127.0.0.1", port=0, http_port=0))
        try:
            url = f"http://127.0.0.1:{server.http_port}/v1"
            return await asyncio.wait_for(asyncio.to_thread(script.transcribe, wav, url, "none", "en", io.StringIO()), 120)
        finally:
            await server.stop(0)

    got = asyncio.run(main())
    text = transcribe_audio(asr, peak_normalize(load_audio(wav)), LANGUAGE).text  # harken transcribe's
    assert text and got["text"] == text
    assert got["streamed"] == got["done"] == text
    cues = webvtt.read_buffer(io.StringIO(got["vtt"]))  # an independent WebVTT parser
    assert len(cues) >= 2 and " ".join(c.text for c in cues).split() == " ".join(t for _, t in _finals(asr, audio)).split()
