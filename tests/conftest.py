import sys
from pathlib import Path

# tests import their helpers (signals.py) as top-level modules
sys.path.insert(0, str(Path(__file__).parent))

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def keep_subnormals():
    """Importing qwen_asr (the official reference, in several test files) loads a library built with
    -ffast-math, which turns on flush-to-zero for the process; hypothesis's float strategies in any
    later test then refuse to run. Turn it back off after every test."""
    yield
    import torch

    torch.set_flush_denormal(False)


@pytest.fixture(scope="session")
def asr():
    """The cached tiny random checkpoint (fp32, CPU), torch on one thread: the test machine is
    shared, and one thread is several times faster here. The talkative variant is
    `talkative_asr`; test_reencode_baseline.py defines its own `asr` (a fresh random model)."""
    import torch

    from harken.cloud.model.asr import Qwen3ASR

    torch.set_num_threads(1)
    # explicit: load's defaults are bf16 on CUDA where there is one (the first GPU run found the
    # CUDA tests comparing against a bf16 "CPU" reference)
    return Qwen3ASR.load("tiny", dtype="fp32", device="cpu")


@pytest.fixture(scope="module")
def talkative_asr():
    """The tiny checkpoint with its <|im_end|> row at a fixed norm (streaming.py's `talkative_tiny`):
    answers both empty and cut by the token budgets. One fresh copy per module."""
    from streaming import talkative_tiny

    return talkative_tiny()


@pytest.fixture(scope="module")
def reference(asr, audio):
    """The in-process engine's events (cloud/embedded.py) for the requesting module's own `audio`
    fixture, forced to English, as the client's `TranscriptEvent`s (stability rounded to float32 as on the wire)."""
    import numpy as np

    from harken.cloud.embedded import stream_audio
    from harken.cloud.inference.engine import Engine, EngineConfig
    from harken.cloud.inference.decoder_stream import SessionOptions
    from harken.shared.transcript import TranscriptEvent

    engine = Engine(asr, EngineConfig(max_sessions=1, max_batch=1))
    return [TranscriptEvent(e.segment_id, e.committed_delta, e.partial, float(np.float32(e.stability)),
                            e.start_s, e.end_s, e.language, e.is_final, word_confidence=e.word_confidence)
            for e in stream_audio(audio, engine, SessionOptions(language="English"))]


@pytest.fixture(scope="module")
def packets(audio):
    """The edge's feature packets for the requesting module's own `audio`, pushed in 100 ms pieces
    (as the embedded engine does)."""
    from harken.edge.pipeline import FeatureStream

    fs = FeatureStream()
    out = []
    for i in range(0, len(audio), 1600):
        out += fs.push(audio[i:i + 1600])
    return out + fs.flush()
