"""Synthetic meetings for `harken bench diarize`: several voices taking turns, with the truth of who
spoke when.

    for m in meetings(SCORED, count=24, seed=0):       # Meeting: audio (16 kHz), turns, voices
        ...

A meeting has 2, 3 or 4 speakers, each an espeak-ng voice (accent, variant, pitch and speed fixed for
the meeting) or the Piper voice (`en_US-joe-medium`, lab/training/speech.py); `far` meetings draw
voices of different accents and sexes, `close` ones put two voices of one accent and sex side by side
(they differ only in espeak's variant, pitch and speed). Turns last 1-15 s (as many words of the texts
as that takes at the voice's speed), by a speaker other than the last; the gaps between turns are
0.4-1.5 s, or, in meetings with overlaps, a third of the turns start 0.3-1.0 s before the last one
ended. The texts are read in order from the held-out set (`SCORED`: lab/training/heldout.jsonl) or the
out-of-distribution set (`TUNING`: lab/training/ood.jsonl), so tuning and scoring never share text,
and the tuning meetings draw from other seeds. Each turn's truth is its speech: the synthesiser's
output trimmed of its leading and trailing silence.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np

from harken.training.speech import espeak, piper

SR = 16000
TRAINING_DIR = Path(__file__).resolve().parent.parent / "training"
SCORED = TRAINING_DIR / "heldout.jsonl"
TUNING = TRAINING_DIR / "ood.jsonl"
PIPER_VOICE = ("piper", "", 0, 1.0)
# (accent, variant, pitch, words a minute); the Piper voice: ("piper", "", 0, length scale)
FAR_VOICES = (("en-us", "m3", 40, 165), ("en-gb", "f3", 65, 170), ("en-029", "m5", 30, 150),
              ("en-gb-scotland", "f1", 75, 160), ("en-us-nyc", "m7", 50, 180), ("en-gb-x-rp", "f4", 55, 155),
              PIPER_VOICE)
CLOSE_PAIRS = ((("en-us", "m1", 45, 160), ("en-us", "m2", 50, 170)),
               (("en-gb", "f2", 60, 165), ("en-gb", "f4", 66, 155)),
               (("en-gb-x-rp", "m3", 40, 160), ("en-gb-x-rp", "m6", 45, 175)))
Voice = tuple[str, str, int, float]


@dataclass(frozen=True)
class Turn:
    speaker: str
    start_s: float
    end_s: float
    text: str


@dataclass
class Meeting:
    name: str
    audio: np.ndarray
    turns: list[Turn]
    voices: dict[str, Voice]
    kind: str  # far | close
    overlap: bool
    speakers: int = field(init=False)

    def __post_init__(self) -> None:
        self.speakers = len({t.speaker for t in self.turns})

    @property
    def duration_s(self) -> float:
        return len(self.audio) / SR


def words_of(path: Path) -> Iterator[str]:
    """The texts' words in order, again and again."""
    texts = [json.loads(line)["text"] for line in path.read_text().splitlines() if line.strip()]
    while True:
        for t in texts:
            yield from t.split()


def synthesize(voice: Voice, text: str, seed: int) -> np.ndarray:
    accent, variant, pitch, rate = voice
    if accent == "piper":
        audio = piper(text, length_scale=rate, seed=seed)
    else:
        audio = espeak(text, accent, variant, rate, pitch)
    audio = trim(audio)
    peak = float(np.abs(audio).max()) if audio.size else 0.0
    return (audio * (0.5 / peak)).astype(np.float32) if peak > 0 else audio


def trim(audio: np.ndarray, threshold: float = 0.01) -> np.ndarray:
    """Without leading and trailing silence (10-ms frames below `threshold` of the peak)."""
    frames = np.abs(audio[: len(audio) // 160 * 160]).reshape(-1, 160).max(axis=1)
    loud = np.flatnonzero(frames >= threshold * max(float(frames.max()), 1e-9))
    if loud.size == 0:
        return audio[:0]
    return audio[loud[0] * 160:(loud[-1] + 1) * 160]


def pick_voices(rng: random.Random, n: int, kind: str) -> list[Voice]:
    if kind == "close":
        pair = list(rng.choice(CLOSE_PAIRS))
        rest = [v for v in FAR_VOICES if v[0] not in {p[0] for p in pair}]
        return pair + rng.sample(rest, n - 2)
    return rng.sample(list(FAR_VOICES), n)


def make_meeting(name: str, rng: random.Random, words: Iterator[str], n: int, kind: str, overlap: bool,
                 target_s: float) -> Meeting:
    voices = {f"spk{i + 1}": v for i, v in enumerate(pick_voices(rng, n, kind))}
    names = list(voices)
    pieces: list[tuple[int, np.ndarray]] = []
    turns: list[Turn] = []
    t = 0.5
    last = None
    order = names[:]  # everyone speaks early on
    rng.shuffle(order)
    while t < target_s or len(turns) < n:
        speaker = order.pop(0) if order else rng.choice([s for s in names if s != last])
        voice = voices[speaker]
        seconds = rng.uniform(1.0, 15.0)
        wps = 2.2 if voice[0] == "piper" else voice[3] / 60
        count = max(2, round(seconds * wps))
        text = " ".join(next(words) for _ in range(count))
        audio = synthesize(voice, text, rng.getrandbits(31))
        if turns and overlap and rng.random() < 1 / 3:
            start = max(turns[-1].start_s + 0.5, turns[-1].end_s - rng.uniform(0.3, 1.0))
        else:
            start = (turns[-1].end_s if turns else t) + rng.uniform(0.4, 1.5)
        at = int(round(start * SR))
        pieces.append((at, audio))
        turns.append(Turn(speaker, round(at / SR, 3), round((at + len(audio)) / SR, 3), text))
        t = max(t, turns[-1].end_s)
        last = speaker
    total = int((t + 0.8) * SR)
    mix = np.zeros(total, np.float32)
    for at, audio in pieces:
        mix[at:at + len(audio)] += audio
    mix /= max(1.0, float(np.abs(mix).max()) / 0.9)
    return Meeting(name, mix, turns, voices, kind, overlap)


def meetings(source: Path, count: int, seed: int, overlap: bool = False,
             min_s: float = 60.0, max_s: float = 180.0) -> Iterator[Meeting]:
    """`count` meetings (with short overlaps, or none) drawn from `seed`: 2, 3 and 4 speakers in turn,
    three far meetings then three close ones, each 1-3 min."""
    rng = random.Random(seed)
    words = words_of(source)
    for i in range(count):
        n = 2 + i % 3
        kind = "far" if (i // 3) % 2 == 0 else "close"
        target = rng.uniform(min_s, max_s) - 3
        yield make_meeting(f"{'tune' if source == TUNING else 'm'}{seed}-{i:02d}-{n}{kind[0]}{'o' if overlap else ''}",
                           rng, words, n, kind, overlap, target)
