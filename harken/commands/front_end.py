"""`harken vad`, `harken features` and `harken demo --edge-only`: the edge's front end on a file, no
server and no torch (an edge install runs them)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from .options import Subparsers
from ..edge.audio import load_audio
from ..shared.errors import HarkenError
from ..shared.features_spec import SAMPLE_RATE


def register_vad(sub: Subparsers) -> None:
    s = sub.add_parser("vad", help="find speech segments with silero-vad (ONNX)",
                       description="Find speech segments in an audio file with silero-vad on onnxruntime.")
    s.add_argument("input", help="audio file (WAV/FLAC/OGG, any rate, width, channels)")
    s.add_argument("--json", action="store_true",
                   help='print {"segments": [{"start_s", "end_s"}], "speech_s"}')
    s.add_argument("--threshold", type=float, default=0.5, help="speech probability threshold (default 0.5)")
    s.add_argument("--min-speech-ms", type=int, default=250, help="shortest speech kept (default 250)")
    s.add_argument("--min-silence-ms", type=int, default=300,
                   help="silence that ends a segment (default 300)")
    s.add_argument("--pad-ms", type=int, default=100, help="padding around each segment (default 100)")
    s.set_defaults(run=run_vad)


def run_vad(args: argparse.Namespace) -> int | None:
    from ..edge.vad import VadOptions

    opts = VadOptions(threshold=args.threshold, min_speech_duration_ms=args.min_speech_ms,
                      min_silence_duration_ms=args.min_silence_ms, speech_pad_ms=args.pad_ms)
    return vad_command(args.input, opts, as_json=args.json)


def register_features(sub: Subparsers) -> None:
    s = sub.add_parser("features", help="write Qwen3-ASR log-mel features to .npy",
                       description="Compute the log-mel features Qwen3-ASR expects (float32 [128, T], "
                                   "reference normalisation against the global max) with the edge's "
                                   "streaming ONNX extractor, and save them as .npy.")
    s.add_argument("input", help="audio file")
    s.add_argument("-o", "--output", required=True, help="output .npy path")
    s.set_defaults(run=run_features)


def run_features(args: argparse.Namespace) -> int | None:
    return features_command(args.input, args.output)


def vad_command(input_path: str, options, as_json: bool) -> int:
    from ..edge.vad import get_speech_timestamps

    audio = load_audio(input_path)
    segments = get_speech_timestamps(audio, options)
    speech_s = sum(s.end_s - s.start_s for s in segments)
    if as_json:
        print(json.dumps({
            "segments": [{"start_s": round(s.start_s, 3), "end_s": round(s.end_s, 3)} for s in segments],
            "speech_s": round(speech_s, 3),
        }))
    else:
        for s in segments:
            print(f"{s.start_s:8.3f} - {s.end_s:8.3f} s")
        print(f"{len(segments)} segments, {speech_s:.2f} s of speech in {audio.size / SAMPLE_RATE:.2f} s")
    return 0


def features_command(input_path: str, output_path: str) -> int:
    from ..edge.features import log_mel

    out = Path(output_path)
    if out.is_dir():
        raise HarkenError(f"{out}: is a directory; give a file name such as {out / 'features.npy'}")
    if not out.parent.exists():
        raise HarkenError(f"{out.parent}: no such directory")
    features = log_mel(load_audio(input_path))
    with open(out, "wb") as f:  # np.save(path) would append .npy to a name without it
        np.save(f, features.astype(np.float32))
    print(f"wrote {out}: float32 {list(features.shape)} ({features.shape[1] / 100:.2f} s)", file=sys.stderr)
    return 0


def demo_edge(input_path: str, mode: str = "balanced", piece_ms: int = 100) -> int:
    """Stream a file through the edge pipeline in `piece_ms` pieces and report each segment as its
    last packet leaves: what a connected agent would send, without a server."""
    from ..edge.pipeline import FeatureStream

    audio = load_audio(input_path)
    stream = FeatureStream(mode=mode)
    step = SAMPLE_RATE * piece_ms // 1000
    seconds = audio.size / SAMPLE_RATE
    print(f"harken edge demo: {Path(input_path).name}, {seconds:.1f} s, codec mode {mode!r}, "
          f"{stream.packet_frames * 10} ms packets")
    per_segment: dict[int, list] = {}
    total_bytes = 0
    for i in range(0, audio.size + 1, step):
        packets = stream.push(audio[i:i + step]) if i < audio.size else stream.flush()
        for p in packets:
            per_segment.setdefault(p.segment_id, []).append(p)
            total_bytes += len(p.payload)
            if p.segment_end:
                _print_segment(p.segment_id, per_segment[p.segment_id])
    speech_frames = sum(p.frame_count for ps in per_segment.values() for p in ps)
    speech_s = speech_frames / 100
    kbps = total_bytes * 8 / speech_s / 1000 if speech_s else 0.0
    print(f"{len(per_segment)} segments, {speech_s:.2f} s of speech in {seconds:.2f} s; "
          f"{speech_frames} frames in {total_bytes} bytes: {kbps:.1f} kbps during speech, "
          f"{total_bytes * 8 / seconds / 1000:.1f} kbps overall (PCM16 would be 256 kbps)")
    return 0


def _print_segment(segment_id: int, packets: list) -> None:
    first = packets[0].first_frame
    frames = sum(p.frame_count for p in packets)
    size = sum(len(p.payload) for p in packets)
    kbps = size * 8 / (frames / 100) / 1000 if frames else 0.0
    print(f"  segment {segment_id}: {first / 100:6.2f} - {(first + frames) / 100:6.2f} s  "
          f"{frames:5d} frames  {len(packets):3d} packets  {size:6d} bytes  {kbps:5.1f} kbps")
