"""`harken bench edge`: what the edge costs (CPU, one thread) and what it puts on the wire.

Side by side on the same audio, in one run: the real-time factors of VAD, log-mel and codec as the
streaming pipeline runs them; for each codec mode the bitrate during speech and overall and the
log-mel error of the decoded frames; and PCM16 and Opus at 16/24/32 kbps, each with its actual
size and the log-mel error of its decoded audio. Errors are in dB over bins within 80 dB of the
running max, on the frames the VAD sent (shared/fidelity.py). `webrtc_*`: the wire bytes of the
features over a WebRTC data channel vs an Opus track, packet overheads counted (lab/bench/wire.py).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from harken.edge.audio import load_audio
from harken.bench.wire import wire_comparison
from harken.edge.pipeline import FeaturePacket, FeatureStream
from harken.edge.features import log_mel_raw
from harken.bench.opus_reference import opus_round_trip
from harken.shared.codec import MODES, decode_frames
from harken.shared.features_spec import SAMPLE_RATE, RunningMaxFloor
from harken.shared.fidelity import feature_error_db

PIECE_MS = 100  # what a microphone callback typically delivers
OPUS_KBPS = (16, 24, 32)


def run_stream(audio: np.ndarray, mode: str, piece_ms: int = PIECE_MS) -> tuple[FeatureStream, list[FeaturePacket]]:
    stream = FeatureStream(mode=mode)
    step = SAMPLE_RATE * piece_ms // 1000
    packets = []
    for i in range(0, audio.size, step):
        packets += stream.push(audio[i:i + step])
    packets += stream.flush()
    return stream, packets


def decoded_frames(packets: list[FeaturePacket], total_frames: int, fill: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Place every packet's decoded frames at their index; -> (frames [128, T], sent mask [T])."""
    out = fill.copy()
    sent = np.zeros(total_frames, dtype=bool)
    for p in packets:
        frames = decode_frames(p.payload)
        out[:, p.first_frame:p.first_frame + frames.shape[1]] = frames
        sent[p.first_frame:p.first_frame + frames.shape[1]] = True
    return out, sent


def bench_edge(path: str, repeats: int = 3) -> dict:
    _single_thread()
    audio = load_audio(path)
    seconds = audio.size / SAMPLE_RATE
    result: dict = {"input": Path(path).name, "audio_s": round(seconds, 3), "piece_ms": PIECE_MS,
                    "threads": 1}

    runs = [run_stream(audio, "balanced")[0].seconds for _ in range(max(1, repeats))]
    best = min(runs, key=lambda s: s.vad + s.features + s.codec)  # the first of the fastest
    result.update(rtf_vad=best.vad / seconds, rtf_features=best.features / seconds,
                  rtf_codec=best.codec / seconds,
                  rtf_total=(best.vad + best.features + best.codec) / seconds)

    reference = RunningMaxFloor()(log_mel_raw(audio))  # what the edge encodes
    total = reference.shape[1]
    for mode in MODES:
        _, packets = run_stream(audio, mode)
        decoded, speech = decoded_frames(packets, total, reference)
        speech_s = speech.sum() / 100
        size = sum(len(p.payload) for p in packets)
        err = feature_error_db(reference, decoded, speech)
        result[f"{mode}_kbps_speech"] = size * 8 / speech_s / 1000 if speech_s else 0.0
        result[f"{mode}_kbps_total"] = size * 8 / seconds / 1000
        result[f"{mode}_rms_db_error"] = err.rms_db
        result[f"{mode}_max_db_error"] = err.max_db
        result[f"{mode}_bytes"] = size
        if mode == "balanced":
            result["speech_s"] = float(speech_s)
            result["packets"] = len(packets)
            balanced_packets = packets
    _, speech_mask = decoded_frames(run_stream(audio, "balanced")[1], total, reference)

    result["pcm16_kbps"] = SAMPLE_RATE * 16 / 1000
    for kbps in OPUS_KBPS:
        rt = opus_round_trip(audio, kbps)
        test = RunningMaxFloor()(log_mel_raw(rt.decoded))
        err = feature_error_db(reference, test, speech_mask)
        result[f"opus_{kbps}_kbps"] = rt.payload_bytes * 8 / seconds / 1000
        result[f"opus_{kbps}_bytes"] = rt.payload_bytes
        result[f"opus_{kbps}_rms_db_error"] = err.rms_db
        result[f"opus_{kbps}_max_db_error"] = err.max_db
    result.update(wire_comparison(audio, balanced_packets, result["speech_s"]))
    return {k: (round(v, 5) if isinstance(v, float) else v) for k, v in result.items()}


def bench_edge_command(path: str, repeats: int = 3) -> int:
    print(json.dumps(bench_edge(path, repeats), indent=1))
    return 0


def _single_thread() -> None:
    # onnxruntime sessions are built with one intra-op thread; keep numpy's BLAS to one as well.
    try:
        from threadpoolctl import threadpool_limits

        threadpool_limits(1)
    except ImportError:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
