"""Pipecat's own DeepgramSTTService against harken serve's /v1/listen (examples/pipecat_bot.py, run as
it is in `.venv-pipecat`, made by `make setup-pipecat`, which `make test` runs first: Pipecat's
Deepgram extra needs protobuf 6.x, which harken's install excludes). Fed 20 ms audio frames and then
the VADUserStoppedSpeakingFrame its own VAD sends when the user stops, with no Pipecat transport: the
service sends Finalize and gets harken's final for those samples, marked from_finalize, which
Pipecat turns into a `TranscriptionFrame(finalized=True)`."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from harken.cloud.server import ServerOptions, start_server
from harken.edge.audio import peak_normalize
from signals import concat, silence, speech

ROOT = Path(__file__).resolve().parents[1]
PIPECAT_PY = ROOT / ".venv-pipecat" / "bin" / "python"


@pytest.fixture(scope="module")
def words_asr():
    import torch

    from harken.cloud.model.asr import Qwen3ASR

    torch.set_num_threads(1)
    return Qwen3ASR.load("tiny-untied", dtype="fp32", device="cpu")


def test_pipecats_deepgram_service_gets_a_finalized_transcript_from_harken(words_asr, tmp_path):
    import soundfile as sf

    from harken.cloud.embedded import stream_pieces
    from harken.cloud.inference.engine import Engine, EngineConfig
    from harken.cloud.inference.decoder_stream import SessionOptions
    from harken.edge.client.front_end import FINALIZE

    if not PIPECAT_PY.exists():
        pytest.fail("no .venv-pipecat: run `make setup-pipecat` (make test does)")
    # the user stops 0.3 s after the last word: Pipecat's VAD says so before harken's VAD would
    audio = peak_normalize(concat(silence(0.3), speech("Hello there, this is a test of the system."), silence(0.3)))
    pcm = (np.clip(audio, -1, 1) * 32767).astype("<i2")
    wav = tmp_path / "turn.wav"
    sf.write(str(wav), pcm, 16000, subtype="PCM_16")
    samples = pcm.astype(np.float32) / 32768.0
    pieces = [samples[i:i + 1600] for i in range(0, samples.size, 1600)] + [FINALIZE]
    events = list(stream_pieces(pieces, Engine(words_asr, EngineConfig(max_sessions=1, max_batch=1)),
                                SessionOptions(language="English")))
    finals = [e for e in events if e.is_final]
    assert len(finals) == 1
    expected = "".join(e.committed_delta for e in events).strip()

    async def main():
        server = await start_server(words_asr, ServerOptions(host="127.0.0.1", port=0, http_port=0))
        try:
            bot = await asyncio.create_subprocess_exec(
                str(PIPECAT_PY), str(ROOT / "examples" / "pipecat_bot.py"), str(wav), "--url",
                f"http://127.0.0.1:{server.http_port}", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
            out, err = await asyncio.wait_for(bot.communicate(), 120)
            return bot.returncode, out.decode(), err.decode()
        finally:
            await server.stop(0)

    rc, out, err = asyncio.run(main())
    assert rc == 0, err[-3000:]
    frames = [json.loads(line) for line in out.splitlines()]
    done = [f for f in frames if not f["interim"]]
    assert done == [{"text": expected, "finalized": True, "interim": False}]
    assert any(f["interim"] for f in frames)
