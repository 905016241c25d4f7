"""The cloud's command-line actions: `harken transcribe` and `harken make-tiny-model`.

Each takes plain arguments (the dispatcher parsed them), prints its result and returns an exit code;
user errors surface as `HarkenError` (one line, exit 2, from the dispatcher).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from harken.shared.errors import HarkenError

TINY_BANNER = ("harken: --model tiny is a tiny RANDOM checkpoint for tests and plumbing checks; "
               "its output is meaningless")


def peak_normalize(audio: np.ndarray) -> np.ndarray:
    """As the official package does before its feature extractor: audio whose peak exceeds 1.0
    (int-scaled or hot float input) is divided by its peak, then everything is clipped to [-1, 1]."""
    peak = float(np.max(np.abs(audio))) if audio.size else 0.0
    if peak > 1.0:
        audio = audio / peak
    return np.clip(audio, -1.0, 1.0).astype(np.float32, copy=False)


def transcribe_command(input_path: str, model: str, language: str | None = None, context: str = "",
                       as_json: bool = False, device: str | None = None, dtype: str | None = None) -> int:
    """Offline, one pass: audio file -> log-mel (edge ONNX path) -> Qwen3-ASR -> text."""
    from harken.edge.audio import load_audio
    from harken.edge.features import log_mel

    audio = peak_normalize(load_audio(input_path))  # before loading the model: bad input fails fast
    features = log_mel(audio)

    from harken.cloud.model.asr import Qwen3ASR
    from harken.cloud.model.checkpoint import TINY
    from harken.cloud.model.prompt import forced_language

    forced_language(language)  # an unsupported language fails before the model loads
    if model == TINY:
        print(TINY_BANNER, file=sys.stderr)
    asr = Qwen3ASR.load(model, dtype=dtype, device=device)
    result = asr.transcribe(features, language=language, context=context or "")
    if as_json:
        print(json.dumps({"text": result.text, "language": result.language,
                          "token_ids": result.token_ids}, ensure_ascii=False))
    else:
        print(result.text)
    return 0


def make_tiny_model_command(out_dir: str, seed: int = 0, vocab: str = "real") -> int:
    """Write a tiny random checkpoint in the official format to `out_dir`."""
    from harken.cloud.model.tiny import make_tiny_model

    d = Path(out_dir)
    if d.exists() and not d.is_dir():
        raise HarkenError(f"{d}: exists and is not a directory")
    if d.is_dir() and (d / "model.safetensors").exists():
        raise HarkenError(f"{d}: already holds a checkpoint; choose an empty or new directory")
    make_tiny_model(d, seed=seed, vocab=vocab)
    print(f"wrote a tiny random Qwen3-ASR checkpoint (seed {seed}, {vocab} vocabulary) to {d}",
          file=sys.stderr)
    return 0


def stream_command(input_path: str | None, model: str, language: str | None = None, context: str = "",
                   as_json: bool = False, mic: bool = False, server: str | None = None,
                   device: str | None = None, dtype: str | None = None) -> int:
    """`harken stream IN.wav --model M`: the edge pipeline and the streaming engine in-process, on
    audio time. Prints committed text solid and partial text as it changes, or with `as_json` one
    event per line and `{"final": true, "text": ...}` last."""
    if server:
        raise HarkenError("--server is not available yet; without it the engine runs in-process (--model)")
    if bool(mic) == bool(input_path):
        raise HarkenError("give an input audio file or --mic (not both)")
    from harken.edge.audio import load_audio, microphone_chunks
    from harken.edge.commands import LiveView

    if mic:
        source = _until_interrupted(microphone_chunks(block_ms=100))
    else:
        audio = peak_normalize(load_audio(input_path))  # before loading the model: bad input fails fast
        source = (audio[i:i + 1600] for i in range(0, len(audio), 1600))  # 100 ms pieces

    from harken.cloud.embedded import stream_pieces, transcript_text
    from harken.cloud.model.asr import Qwen3ASR
    from harken.cloud.model.checkpoint import TINY
    from harken.cloud.model.prompt import forced_language
    from harken.cloud.scheduler import Engine, EngineConfig
    from harken.cloud.session import SessionOptions

    forced_language(language)
    if model == TINY:
        print(TINY_BANNER, file=sys.stderr)
    asr = Qwen3ASR.load(model, dtype=dtype, device=device)
    options = SessionOptions(language=language, context=context or "")
    engine = Engine(asr, EngineConfig(max_sessions=1, max_batch=1, slot_policy=options.policy))
    view = LiveView(sys.stdout)
    events = []
    for event in stream_pieces(source, engine, options):
        events.append(event)
        if as_json:
            print(json.dumps(event.as_dict(), ensure_ascii=False), flush=True)
        else:
            view.show(event)
    text = transcript_text(events)
    if as_json:
        print(json.dumps({"final": True, "text": text}, ensure_ascii=False))
    else:
        view.close()
    return 0


def _until_interrupted(pieces):
    """Microphone pieces until Ctrl-C; then the stream ends normally (open segment finalised)."""
    try:
        yield from pieces
    except KeyboardInterrupt:
        return
