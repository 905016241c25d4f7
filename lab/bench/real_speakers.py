"""Real people for the speaker labels: Debian's pocketsphinx-testdata (`make sysdeps`), read from the
package where it is installed, never copied into the repository.

- one LibriVox reader: five clips (3-7 s) of Sense and Sensibility, chapter 1;
- another speaker (CMU's test recordings `goforward.raw` and `numbers.raw`, 2.8 and 4.0 s: one voice).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

DATA = Path("/usr/share/pocketsphinx/test/data")
READER = "librivox"
OTHER = "cmu"


def reader_clips() -> list[np.ndarray] | None:
    """The LibriVox reader's clips (16 kHz float32), in order; None without the package."""
    import soundfile as sf

    files = sorted((DATA / "librivox").glob("*.wav"))
    if not files:
        return None
    return [sf.read(str(f), dtype="float32")[0] for f in files]


def other_speaker() -> list[np.ndarray] | None:
    paths = [DATA / "goforward.raw", DATA / "numbers.raw"]
    if not all(p.is_file() for p in paths):
        return None
    return [np.frombuffer(p.read_bytes(), dtype="<i2").astype(np.float32) / 32768.0 for p in paths]


def interleaved_readers(gap_s: float = 1.5) -> tuple[np.ndarray, list[str]] | None:
    """The reader's clips with the other speaker's after the second and the fourth, 1.5 s of silence
    between: (audio, who said each clip in order). None without the package."""
    clips, other = reader_clips(), other_speaker()
    if clips is None or other is None:
        return None
    order = [(READER, clips[0]), (READER, clips[1]), (OTHER, other[0]), (READER, clips[2]), (READER, clips[3]),
             (OTHER, other[1]), (READER, clips[4])]
    gap = np.zeros(int(gap_s * 16000), np.float32)
    parts: list[np.ndarray] = [gap]
    for _, clip in order:
        parts += [(clip / max(float(np.abs(clip).max()), 1e-6) * 0.5).astype(np.float32), gap]
    return np.concatenate(parts), [who for who, _ in order]
