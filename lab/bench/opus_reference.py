"""Opus round trip through PyAV (libopus), the reference the feature codec competes with on the wire.

Only the benchmark uses it: audio -> Opus packets at a target bitrate -> decoded audio, aligned back
to the input so log-mel frames can be compared one to one.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from harken.shared.features_spec import SAMPLE_RATE

FRAME_MS = 20


@dataclass(frozen=True)
class OpusRoundTrip:
    payload_bytes: int  # sum of Opus packet sizes (no container, no RTP headers)
    packets: int
    decoded: np.ndarray  # float32, 16 kHz, aligned with the input, same length


def opus_round_trip(audio: np.ndarray, bitrate_kbps: int, application: str = "voip") -> OpusRoundTrip:
    """Encode 16 kHz mono float32 audio with libopus (20 ms frames, VBR) and decode it back."""
    import av
    import soxr

    enc = av.CodecContext.create("libopus", "w")
    enc.sample_rate = SAMPLE_RATE
    enc.layout = "mono"
    enc.format = "flt"
    enc.bit_rate = bitrate_kbps * 1000
    enc.time_base = Fraction(1, SAMPLE_RATE)
    enc.options = {"application": application, "frame_duration": str(FRAME_MS)}
    step = SAMPLE_RATE * FRAME_MS // 1000
    # Pad a little past the end so the codec's look-ahead delay does not cut the last frame off.
    padded = np.concatenate([audio.astype(np.float32), np.zeros(4 * step, np.float32)])
    padded = np.pad(padded, (0, (-padded.size) % step))
    packets = []
    for i in range(0, padded.size, step):
        frame = av.AudioFrame.from_ndarray(padded[None, i:i + step], format="flt", layout="mono")
        frame.sample_rate = SAMPLE_RATE
        frame.pts = i
        packets += enc.encode(frame)
    packets += enc.encode(None)

    dec = av.CodecContext.create("libopus", "r")
    dec.sample_rate = SAMPLE_RATE
    dec.layout = "mono"
    pieces, rate = [], SAMPLE_RATE
    for p in packets:
        for f in dec.decode(p):
            rate = f.sample_rate
            pcm = f.to_ndarray().reshape(-1)
            pieces.append(pcm.astype(np.float32) / 32768.0 if pcm.dtype == np.int16 else pcm.astype(np.float32))
    decoded = np.concatenate(pieces) if pieces else np.zeros(0, np.float32)
    if rate != SAMPLE_RATE:
        decoded = soxr.resample(decoded, rate, SAMPLE_RATE, quality="VHQ").astype(np.float32)
    delay = _delay_samples(audio, decoded)
    aligned = decoded[delay:delay + audio.size]
    aligned = np.pad(aligned, (0, audio.size - aligned.size))
    return OpusRoundTrip(sum(p.size for p in packets), len(packets), aligned)


def _delay_samples(reference: np.ndarray, decoded: np.ndarray, max_delay: int = 2000) -> int:
    """The codec's delay, found by cross-correlation (pre-skip handling differs between builds)."""
    n = min(reference.size, decoded.size - max_delay, 10 * SAMPLE_RATE)
    if n <= 0:
        return 0
    ref = reference[:n].astype(np.float64)
    scores = [float(np.dot(decoded[d:d + n], ref)) for d in range(max_delay)]
    return int(np.argmax(scores))
