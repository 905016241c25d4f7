"""The offline pass over a whole recording: what `harken transcribe` prints, and what the pre-recorded
APIs answer with (Deepgram's `POST /v1/listen`).

Audio up to `max_pass_s` (default 1200 s, the official package's longest pass) is one pass; longer
audio is cut at quiet points as the official package cuts it (`split_at_quiet_points`), a short
last piece padded to half a second as it pads one, and each piece is a pass of its own. The text is
the pieces' texts joined as the engine joins segments (`shared/text.transcript_text`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ...shared.features_spec import SAMPLE_RATE
from ..model.decode_limits import DecodeLimits
from ...edge.audio import MAX_PASS_SECONDS, split_at_quiet_points
from ...edge.features import log_mel
from ...shared.text import transcript_text

MIN_PIECE_SAMPLES = SAMPLE_RATE // 2  # the official package pads shorter pieces of a split file


@dataclass(frozen=True)
class OfflinePiece:
    start_s: float
    end_s: float
    text: str
    language: str
    token_ids: list[int]
    # each token's probability as the model gave it (the engine's file passes keep them; [] elsewhere)
    token_probs: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class OfflineTranscript:
    text: str
    language: str  # the first piece's that names one ("" when none does)
    pieces: list[OfflinePiece]


def transcribe_audio(asr, audio: np.ndarray, language: str | None = None, context: str = "",
                     max_pass_s: float | None = None, decode_limits: bool = True, transcribe=None,
                     progress: Callable[[int, int, float], None] | None = None) -> OfflineTranscript:
    """16 kHz mono float32 `audio` (peak-normalised as files are) -> the offline transcript.
    `transcribe`: the pass (default `asr.transcribe`; the vLLM decoder's for `--decoder vllm`);
    `progress(i, n, end_s)` after each of n > 1 passes."""

    spans = split_at_quiet_points(audio, MAX_PASS_SECONDS if max_pass_s is None else max_pass_s)
    transcribe = transcribe or asr.transcribe
    pieces = []
    for i, (a, b) in enumerate(spans):
        result = transcribe(log_mel(piece_audio(audio, spans, i)), language=language, context=context or "",
                            limits=DecodeLimits() if decode_limits else None)
        pieces.append(OfflinePiece(a / SAMPLE_RATE, b / SAMPLE_RATE, result.text, result.language,
                                   list(result.token_ids)))
        if progress is not None and len(spans) > 1:
            progress(i, len(spans), b / SAMPLE_RATE)
    text = transcript_text(dict(enumerate(p.text for p in pieces)))
    return OfflineTranscript(text, next((p.language for p in pieces if p.language), ""), pieces)


def piece_audio(audio: np.ndarray, spans: list[tuple[int, int]], i: int) -> np.ndarray:
    """The audio of piece i of a file cut at `spans`: a short last piece of a split file padded to
    half a second, as the official package pads one."""
    a, b = spans[i]
    piece = audio[a:b]
    if len(spans) > 1 and b - a < MIN_PIECE_SAMPLES:
        piece = np.pad(piece, (0, MIN_PIECE_SAMPLES - (b - a)))
    return piece
