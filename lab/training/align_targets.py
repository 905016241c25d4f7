"""Word start AND end times of a synthesised utterance, in the aligner's units, from espeak-ng's events.

word_timing.py gives each whitespace token's end (its last phoneme's following boundary, moved back
over exact digital silence). A token starts at its first sounding phoneme: the first non-pause PHONEME
event after one of its WORD events, moved forward over exact digital silence (never past its end). Both
are mapped onto the rendered recipe's timeline as `word_ends` does (leading silence, then / tempo).

The aligner times the units `split_words` cuts (punctuation removed): a token that leaves one unit
keeps its times, a token that leaves none (a lone dash) is dropped, and an utterance with a token that
splits into several units, or a unit espeak-ng said nothing for, gets None (not used).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from harken.cloud.model.aligner import split_words
from harken.training import speech
from harken.training.espeak_word_ends import SynthEvent, synthesize, token_end_samples, token_spans, trim_to_sound


@dataclass(frozen=True)
class WordSpan:
    word: str  # the aligner's unit (split_words of the token)
    start_s: float
    end_s: float


def token_start_samples(events: list[SynthEvent], spans: list[tuple[int, int]]) -> list[int | None]:
    """For each token span, the sample of its first sounding phoneme (None if it has none)."""
    def token_of(position: int) -> int | None:
        for k, (a, b) in enumerate(spans):
            if a <= position < b:
                return k
        return None

    starts: list[int | None] = [None] * len(spans)
    owner: int | None = None
    for e in events:
        if e.kind == "word":
            owner = token_of(e.text_position)
        elif e.kind == "phoneme" and not e.name.startswith("_") and owner is not None and starts[owner] is None:
            starts[owner] = e.sample
    return starts


def trim_starts(starts: list[int | None], ends: list[int | None], samples: np.ndarray) -> list[int | None]:
    """Each start moved forward over exact digital silence, up to its end."""
    out: list[int | None] = []
    for s, e in zip(starts, ends):
        if s is not None and e is not None and e > s:
            sounding = np.flatnonzero(samples[s:e])
            s = s + int(sounding[0]) if sounding.size else s
        out.append(s)
    return out


def word_spans_dry(text: str, voice: str, variant: str = "", rate: float = 160, pitch: int = 50
                   ) -> list[WordSpan] | None:
    """The aligner units of `text` with their start / end (s) in espeak-ng's dry output, or None."""
    pcm, rate_hz, events = synthesize(text, voice, variant, rate, pitch)
    spans = token_spans(text)
    samples = np.frombuffer(pcm, "<i2")
    ends = trim_to_sound(token_end_samples(events, spans, samples.size), samples)
    starts = trim_starts(token_start_samples(events, spans), ends, samples)
    out: list[WordSpan] = []
    for token, s, e in zip(text.split(), starts, ends):
        units = split_words(token)
        if not units:
            continue
        if len(units) > 1 or s is None or e is None:
            return None
        out.append(WordSpan(units[0], s / rate_hz, e / rate_hz))
    return out


def word_spans(recipe: speech.Recipe) -> list[WordSpan] | None:
    """The units of the recipe's text and their times in `speech.render(recipe)` (None for Piper,
    whose voice reports no events, or when a token does not map to one unit)."""
    if recipe.voice == speech.PIPER:
        return None
    dry = word_spans_dry(recipe.text, recipe.voice, recipe.variant, recipe.rate, recipe.pitch)
    if dry is None:
        return None
    lead_s = int(recipe.lead_s * speech.SAMPLE_RATE) / speech.SAMPLE_RATE  # as `augment` pads
    return [WordSpan(w.word, lead_s + w.start_s / recipe.tempo, lead_s + w.end_s / recipe.tempo) for w in dry]
