"""Per-word latency and partial churn of a stream's transcript events (`harken bench wer`).

Inputs: the events of one utterance's stream, each with the time it arrived on the stream's clock
(0 = when the audio's first sample was captured, so audio time t is captured at clock time t), and
the reference words with the time each ends in the audio (`synth/word_timing.py`).

- A segment's final text is all its committed text (committed text is never retracted, so every
  committed text seen is a prefix of it). The utterance's hypothesis is its segments' final texts
  in segment order; it is aligned to the reference words (jiwer's word alignment, on words
  lowercased and stripped of surrounding punctuation); only reference words aligned to an equal
  hypothesis word get a latency.
- Word k of a segment's final text is *shown* by the first event whose visible text (committed +
  partial) has that word at index k, and *committed* by the first event whose committed text
  reaches the word's last character. Latency = that event's arrival - the word's end in the audio
  (negative when a word is guessed before it is over).
- Partial churn: every (index, word) a segment ever showed beyond its fully committed words, counted
  once; the share of them that differ from the segment's final word at that index.
- Final latency: a segment's final event's arrival - the end of the last reference word said inside
  the segment (its start_s .. end_s). Finalize latency: the first final event's arrival after a
  client's finalize request - the request's time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from harken.training.espeak_word_ends import WordTime
from harken.shared.transcript import TranscriptEvent

_PUNCTUATION = "\"'.,;:!?()[]{}<>-–—…“”‘’«»"


@dataclass(frozen=True)
class TimedEvent:
    """A transcript event and when it arrived, on the stream's clock (seconds)."""

    t_s: float
    event: TranscriptEvent


@dataclass(frozen=True)
class WordLatency:
    """One reference word: its end in the audio and how long after it the word was first shown and
    first committed (None: the final transcript does not have it)."""

    word: str
    end_s: float
    partial_s: float | None
    commit_s: float | None


@dataclass
class Churn:
    """Partial words shown (each (segment, index, word) once) and how many of them changed later."""

    shown: int = 0
    changed: int = 0

    def add(self, other: "Churn") -> None:
        self.shown += other.shown
        self.changed += other.changed

    @property
    def share(self) -> float | None:
        return self.changed / self.shown if self.shown else None


def normalize_word(word: str) -> str:
    """Lowercase, surrounding punctuation off: how shown, final and reference words are compared."""
    return word.strip(_PUNCTUATION).lower()


@dataclass
class _Segment:
    final: str = ""  # all committed text: the final text once the stream is over
    views: list[tuple[float, str, str]] = field(default_factory=list)  # (t, committed so far, partial)


def _segments(events: list[TimedEvent]) -> dict[int, _Segment]:
    segments: dict[int, _Segment] = {}
    for timed in events:
        e = timed.event
        seg = segments.setdefault(e.segment_id, _Segment())
        seg.final += e.committed_delta
        seg.views.append((timed.t_s, seg.final, e.partial))
    return segments


def _word_ends(text: str) -> list[int]:
    """The character index just past each whitespace-separated word of `text`."""
    ends, inside = [], False
    for i, ch in enumerate(text):
        if ch.isspace() and inside:
            ends.append(i)
        inside = not ch.isspace()
    if inside:
        ends.append(len(text))
    return ends


def _first_times(seg: _Segment) -> tuple[list[float | None], list[float | None]]:
    """(first shown, first committed) arrival time of each word of the segment's final text."""
    final_words = [normalize_word(w) for w in seg.final.split()]
    ends = _word_ends(seg.final)
    shown: list[float | None] = [None] * len(final_words)
    committed: list[float | None] = [None] * len(final_words)
    for t, text, partial in seg.views:
        visible = [normalize_word(w) for w in (text + partial).split()]
        for k, word in enumerate(final_words):
            if shown[k] is None and k < len(visible) and visible[k] == word:
                shown[k] = t
            if committed[k] is None and len(text) >= ends[k]:
                committed[k] = t
                if shown[k] is None:
                    shown[k] = t
    return shown, committed


def _alignment(reference: list[str], hypothesis: list[str]) -> dict[int, int]:
    """Reference word index -> the equal hypothesis word it is aligned with (jiwer, Levenshtein)."""
    import jiwer

    if not reference or not hypothesis:
        return {}
    out = jiwer.process_words(" ".join(reference), " ".join(hypothesis))
    pairs = {}
    for chunk in out.alignments[0]:
        if chunk.type == "equal":
            for d in range(chunk.ref_end_idx - chunk.ref_start_idx):
                pairs[chunk.ref_start_idx + d] = chunk.hyp_start_idx + d
    return pairs


def word_latencies(events: list[TimedEvent], words: list[WordTime]) -> list[WordLatency]:
    """Latency of every reference word (see the module docstring)."""
    segments = _segments(events)
    hyp_times: list[tuple[float | None, float | None]] = []
    hypothesis: list[str] = []
    for sid in sorted(segments):
        shown, committed = _first_times(segments[sid])
        hyp_times += zip(shown, committed)
        hypothesis += [normalize_word(w) for w in segments[sid].final.split()]
    # a reference token that is only punctuation cannot be matched; keep indices aligned anyway
    reference = [normalize_word(w.word) or "\u2205" for w in words]
    pairs = _alignment(reference, hypothesis)
    out = []
    for i, w in enumerate(words):
        j = pairs.get(i)
        shown_t, commit_t = hyp_times[j] if j is not None else (None, None)
        out.append(WordLatency(w.word, w.end_s, None if shown_t is None else shown_t - w.end_s,
                               None if commit_t is None else commit_t - w.end_s))
    return out


def partial_churn(events: list[TimedEvent]) -> Churn:
    """Partial words shown and changed later (see the module docstring)."""
    churn = Churn()
    for seg in _segments(events).values():
        final_words = [normalize_word(w) for w in seg.final.split()]
        ends = _word_ends(seg.final)
        seen: set[tuple[int, str]] = set()
        for _, text, partial in seg.views:
            committed_words = sum(1 for end in ends if end <= len(text))
            visible = [normalize_word(w) for w in (text + partial).split()]
            seen.update((k, visible[k]) for k in range(committed_words, len(visible)))
        churn.shown += len(seen)
        churn.changed += sum(1 for k, w in seen if k >= len(final_words) or final_words[k] != w)
    return churn


def final_latencies(events: list[TimedEvent], words: list[WordTime]) -> list[float]:
    """Each final event's arrival after the end of the last reference word inside its segment
    (segments with no reference word inside give none)."""
    out = []
    for timed in events:
        e = timed.event
        if not e.is_final:
            continue
        # (the VAD pads a segment's end, and its times are on the frame grid: a word ends inside it)
        ends = [w.end_s for w in words if e.start_s <= w.end_s <= e.end_s + 0.02]
        if ends:
            out.append(timed.t_s - max(ends))
    return out


def finalize_latency(events: list[TimedEvent], requested_s: float) -> float | None:
    """The first final event's arrival after a finalize request at `requested_s` - that time; None
    when every final came before the request (the VAD had ended the speech already)."""
    after = [t.t_s for t in events if t.event.is_final and t.t_s >= requested_s]
    return min(after) - requested_s if after else None
