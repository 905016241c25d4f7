"""LiveKit Agents' own STT plugins against harken serve's HTTP port (examples/livekit_agent_stt.py, run
as it is): the Deepgram plugin (livekit-plugins-deepgram 1.8.9, live on /v1/listen and REST) and the
OpenAI plugin (livekit-plugins-openai 1.8.9, realtime transcription on /v1/realtime), fed 20 ms
frames of local audio, no LiveKit server: START_OF_SPEECH, INTERIM, FINAL (harken's text for the same
16-bit samples; the OpenAI plugin resamples to 24 kHz, so its text is checked for shape only) and
END_OF_SPEECH come as an agent expects them."""

from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path

import numpy as np
import pytest

from harken.cloud.server import ServerOptions, start_server
from harken.edge.audio import peak_normalize
from signals import concat, silence, speech

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "livekit_agent_stt.py"
KEY = "lk-harken-test-key-0123"


@pytest.fixture(scope="module")
def words_asr():
    import torch

    from harken.cloud.model.asr import Qwen3ASR

    torch.set_num_threads(1)
    return Qwen3ASR.load("tiny-untied", dtype="fp32", device="cpu")


def test_livekits_deepgram_and_openai_plugins_transcribe_with_harken(words_asr, tmp_path):
    from harken.cloud.embedded import stream_audio
    from harken.cloud.inference.engine import Engine, EngineConfig
    from harken.cloud.inference.offline import transcribe_audio
    from harken.cloud.inference.decoder_stream import SessionOptions

    spec = importlib.util.spec_from_file_location("livekit_agent_stt", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    audio = peak_normalize(concat(silence(0.3), speech("Hello there, this is a test of the system."), silence(1.0)))
    pcm = (np.clip(audio, -1, 1) * 32767).astype("<i2")
    samples = pcm.astype(np.float32) / 32768.0
    engine = Engine(words_asr, EngineConfig(max_sessions=1, max_batch=1))
    reference = list(stream_audio(samples, engine, SessionOptions(language="English")))  # the plugins ask for en
    live_text = "".join(e.committed_delta for e in reference).strip()
    assert sum(e.is_final for e in reference) == 1 and live_text
    keys = tmp_path / "keys.txt"
    keys.write_text(KEY + "\n")

    async def main():
        server = await start_server(words_asr, ServerOptions(host="127.0.0.1", port=0, http_port=0,
                                                             api_keys=str(keys)))
        try:
            return await asyncio.wait_for(example.transcribe(pcm, f"http://127.0.0.1:{server.http_port}", KEY), 120)
        finally:
            await server.stop(0)

    got = asyncio.run(main())
    kinds = [k for k, _ in got["deepgram"]]
    assert kinds[0] == "START_OF_SPEECH" and kinds[-1] == "END_OF_SPEECH" and "INTERIM_TRANSCRIPT" in kinds
    assert [t for k, t in got["deepgram"] if k == "FINAL_TRANSCRIPT"] == [live_text]
    assert got["deepgram_rest"] == [("FINAL_TRANSCRIPT", transcribe_audio(words_asr, peak_normalize(samples), "English").text)]
    # the OpenAI plugin resamples the frames to 24 kHz (its own resampler) and the server back to 16
    # kHz: other samples, so a random model's text of its own; one final, the turn around it
    kinds = [k for k, _ in got["openai_realtime"]]
    assert kinds[0] == "START_OF_SPEECH" and kinds[-1] == "FINAL_TRANSCRIPT" and got["openai_realtime"][-1][1]
    assert "END_OF_SPEECH" in kinds and kinds.count("FINAL_TRANSCRIPT") == 1
