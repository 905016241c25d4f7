"""Long files: `harken transcribe` cuts audio past its one-pass limit at quiet points exactly where
the official package cuts it, and transcribes piece by piece with its decode limits."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import soundfile as sf

from harken.cloud.model.asr import Qwen3ASR
from harken.cloud.model.decode_limits import DecodeLimits
from harken.edge.audio import load_audio, split_at_quiet_points
from harken.edge.features import log_mel
from signals import SR, concat, noise, silence, speech


def talk(seconds: float, seed: int) -> np.ndarray:
    """Sentences with pauses of varied length, over faint noise, about `seconds` long."""
    rng = np.random.default_rng(seed)
    lines = ["The meeting starts at nine.", "Please send the report by Friday.", "We need more time.",
             "Thank you all for coming today."]
    parts = []
    while sum(len(p) for p in parts) < seconds * SR:
        parts.append(speech(lines[int(rng.integers(len(lines)))], speed=int(rng.integers(140, 200))))
        parts.append(silence(float(rng.uniform(0.2, 1.5))))
    x = concat(*parts)[:int(seconds * SR)]
    return x + noise(len(x) / SR, amplitude=0.002, seed=seed)[:len(x)]


@pytest.mark.parametrize("max_s,seed", [(7.0, 0), (11.5, 1), (20.0, 2)])
def test_split_matches_the_official_package(max_s, seed):
    from qwen_asr.inference.utils import split_audio_into_chunks

    x = talk(45, seed).astype(np.float32)
    ours = split_at_quiet_points(x, max_s)
    theirs = split_audio_into_chunks(x, SR, max_s)
    assert len(ours) == len(theirs) > 1
    for (a, b), (chunk, offset) in zip(ours, theirs):
        assert a == round(offset * SR)
        if b - a >= SR // 2:  # the official package pads a short last piece to 0.5 s
            assert np.array_equal(x[a:b], chunk)
    assert ours[0][0] == 0 and ours[-1][1] == len(x)
    assert all(b1 == a2 for (_, b1), (a2, _) in zip(ours, ours[1:]))
    # every cut lands in a pause or at least at a quieter spot than the plain cut would
    for _, b in ours[:-1]:
        assert abs(x[b]) <= 0.05


def test_short_audio_is_one_piece():
    x = talk(5, 3)
    assert split_at_quiet_points(x, 1200) == [(0, len(x))]


def test_cli_transcribes_a_long_file_piece_by_piece(tmp_path):
    wav = tmp_path / "long.wav"
    sf.write(str(wav), (talk(40, 4) * 32767).astype(np.int16), SR, subtype="PCM_16")
    out = subprocess.run([sys.executable, "-m", "harken.cli", "transcribe", str(wav), "--model", "tiny",
                          "--json", "--max-pass-s", "12", "--language", "English"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    pieces = result["pieces"]
    audio = load_audio(wav)
    spans = split_at_quiet_points(audio, 12)
    assert [(round(p["start_s"] * SR), round(p["end_s"] * SR)) for p in pieces] == spans
    asr = Qwen3ASR.load("tiny", dtype="fp32", device="cpu")
    for p, (a, b) in zip(pieces, spans):
        piece = audio[a:b]
        if b - a < SR // 2:
            piece = np.pad(piece, (0, SR // 2 - (b - a)))
        want = asr.transcribe(log_mel(piece), language="English", limits=DecodeLimits())
        assert p["text"] == want.text
    assert all(p["text"] in result["text"] for p in pieces)
