"""Live speaker labels for one session (issue 61): who said each final segment, as `S1`, `S2`, ...

    diarizer = SessionDiarizer(shared_encoder(), Background.load())
    speaker, relabels = diarizer.label(segment_id, log10_mel, start_s, end_s)   # before the final goes out
    # -> "S2", [SpeakerChange(segment_id=17, speaker="S1"), ...]

Each final segment is embedded by the speaker encoder on the features the server has (the edge's
floored log10-mel: `SpeakerEncoder.embed_features`), centred on a background mean (the mean embedding
of many voices, cloud/model/speaker_background.json, written by `harken bench diarize
--write-background` from its tuning meetings: Resemblyzer's embeddings are non-negative, so raw
cosines between different voices run at ~0.7; centred, they spread out) and assigned online:

- the nearest speaker (cosine to the centroid, the duration-weighted mean of its segments' centred
  embeddings) if its cosine is at least `threshold - length_term / duration` (a short segment's
  embedding is noisier, so it must lie further away to count as someone else);
- else a new speaker, if the segment lasts at least `min_new_s` (shorter ones hold too little voice to
  found a speaker on: they join the nearest);
- then the last `lookback` segments are assigned again against the centroids as they now are (each
  segment's own share taken out of its speaker's): a segment whose best speaker changed moves, and a
  `SpeakerChange` says so. Labels already sent are never taken back in place: a relabel is an event of
  its own, additive, like word timings; committed text never moves.

Or, with `recluster` (tuned and reported by `harken bench diarize`, not shipped: it splits voices the
online decision keeps together on the tests' two-voice meeting),
after each segment the session's last 300 segments are clustered again as a whole: agglomerative,
centroid linkage on the centred embeddings (the two clusters whose centroids are nearest merge while
their cosine is at least `threshold`), then a cluster holding less than `min_new_s` seconds of speech
joins the nearest one that holds enough (too little voice to found a speaker on). Each cluster keeps the
name most of its segments' weight had; the new segment's label is its cluster's name, and every earlier
segment whose name changed gets a `SpeakerChange` (the centroids a later decision compares against are
the clusters'). A segment that founds no speaker yet is labelled with the nearest one until its voice
has enough speech; then the earlier ones move to it.

Labels are stable for the session: a speaker keeps its name while it holds segments; a name freed by
every one of its segments moving away is given to the next new speaker. The label is computed before
the segment's final is sent, so it comes with the final. Sessions that do not ask pay nothing: the
encoder loads at the first session that asks (`shared_encoder`).
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ...shared.transcript import SpeakerChange

MIN_FRAMES = 10  # a segment of fewer frames is not embedded (it takes the last speaker)
# A segment's embedding averages at most this many of its 1.6-s windows, evenly spread: the label is
# computed before the final goes out, and a 15-s turn's 18 windows would delay it most
MAX_PARTIALS = 8
BACKGROUND_PATH = Path(__file__).resolve().parent.parent / "model" / "speaker_background.json"


@dataclass(frozen=True)
class DiarizeSettings:
    """The decision's knobs, tuned by `harken bench diarize` on meetings it does not score."""

    threshold: float = 0.6  # centred cosine to a speaker's centroid that joins it (long segments)
    length_term: float = 0.2  # ... less this over the segment's duration in seconds
    min_new_s: float = 2.0  # a segment shorter than this never opens a new speaker
    lookback: int = 4  # segments assigned again after each new one
    max_weight_s: float = 10.0  # a segment weighs its duration in its centroid, at most this
    # After each segment the session's segments are clustered again (centroid linkage at `threshold`,
    # clusters under `min_new_s` absorbed); False: the online decision above alone (`length_term` and
    # `lookback` serve it only)
    recluster: bool = False
    recluster_segments: int = 300  # the most recent segments re-clustered (older ones keep their labels)


@dataclass(frozen=True)
class Background:
    """The mean embedding of many voices (unit length), subtracted before any cosine."""

    mean: np.ndarray

    @classmethod
    def load(cls, path: str | Path | None = None) -> "Background":
        doc = json.loads(Path(path or BACKGROUND_PATH).read_text())
        return cls(np.asarray(doc["mean"], dtype=np.float32))

    @classmethod
    def none(cls) -> "Background":
        return cls(np.zeros(256, np.float32))

    def save(self, path: str | Path, **about) -> None:
        doc = {**about, "mean": [round(float(x), 6) for x in self.mean]}
        Path(path).write_text(json.dumps(doc, indent=1) + "\n")

    def centre(self, embedding: np.ndarray) -> np.ndarray:
        c = np.asarray(embedding, np.float32) - self.mean
        return c / max(float(np.linalg.norm(c)), 1e-9)


@dataclass
class _Segment:
    segment_id: int
    vector: np.ndarray  # centred, unit
    weight: float
    speaker: int  # index into SessionDiarizer._sums (re-clustering: the speaker's number)
    duration_s: float = 0.0


@dataclass
class SessionDiarizer:
    """One session's speakers (see the module docstring). Not thread-safe: one caller at a time."""

    encoder: object  # a SpeakerEncoder (anything with embed_features)
    background: Background = field(default_factory=Background.none)
    settings: DiarizeSettings = field(default_factory=DiarizeSettings)

    def __post_init__(self) -> None:
        self._sums: list[np.ndarray] = []  # per speaker: the weighted sum of its segments' vectors
        self._names: list[int] = []  # per speaker: its number (S<n>)
        self._counts: list[int] = []  # per speaker: segments held
        self._recent: list[_Segment] = []

    @property
    def speakers(self) -> int:
        """Speakers that hold segments now."""
        if self.settings.recluster:
            return len({x.speaker for x in self._recent})
        return sum(1 for c in self._counts if c)

    def label(self, segment_id: int, log10_mel: np.ndarray | None, start_s: float = 0.0,
              end_s: float = 0.0) -> tuple[str, list[SpeakerChange]]:
        """A final segment's features [128, frames] -> its speaker's name, and the relabels of recent
        segments this one decided."""
        frames = 0 if log10_mel is None else int(log10_mel.shape[-1])
        embedding = self.encoder.embed_features(log10_mel, MAX_PARTIALS) if frames >= MIN_FRAMES else None  # type: ignore[attr-defined]
        return self.add(segment_id, embedding, max(end_s - start_s, frames / 100))

    def add(self, segment_id: int, embedding: np.ndarray | None,
            duration_s: float) -> tuple[str, list[SpeakerChange]]:
        """`label` from the segment's embedding (the bench's path: the same decision). None (fewer than
        `MIN_FRAMES` frames: nothing to embed): the last segment's speaker (S1 for the first), and it
        counts nowhere."""
        s = self.settings
        if embedding is None:
            if s.recluster:
                return f"S{self._recent[-1].speaker if self._recent else 1}", []
            if self._recent:
                return self._name(self._recent[-1].speaker), []
            return self._name(self._open()), []
        vector = self.background.centre(embedding)
        weight = min(duration_s, s.max_weight_s)
        if s.recluster:
            return self._add_clustered(_Segment(segment_id, vector, weight, -1), duration_s)
        best, score = self._nearest(vector)
        joins = s.threshold - s.length_term / max(duration_s, 0.5)
        if best is None or (score < joins and duration_s >= s.min_new_s):
            best = self._open()
        seg = _Segment(segment_id, vector, weight, best)
        self._join(seg, best)
        self._recent.append(seg)
        del self._recent[:-s.lookback - 1]
        return self._name(seg.speaker), self._reassign(seg)

    def _add_clustered(self, seg: _Segment, duration_s: float) -> tuple[str, list[SpeakerChange]]:
        """The session's last `recluster_segments` segments clustered again with the new one; each
        cluster keeps the name most of its segments had (by weight), the new one's cluster included;
        segments whose name changed are relabelled."""
        s = self.settings
        seg.duration_s = duration_s
        self._recent.append(seg)
        del self._recent[:-s.recluster_segments]
        vectors = np.stack([x.vector for x in self._recent])
        durations = np.array([x.duration_s for x in self._recent], np.float32)
        clusters = centroid_linkage(vectors, s.threshold)
        clusters = absorb_short(vectors, clusters, durations, s.min_new_s)
        names = self._cluster_names(clusters)
        changes = []
        for x, c in zip(self._recent, clusters):
            name = names[int(c)]
            if x is not seg and name != x.speaker:
                changes.append(SpeakerChange(x.segment_id, f"S{name}"))
            x.speaker = name
        return f"S{seg.speaker}", changes

    def _cluster_names(self, clusters: np.ndarray) -> dict[int, int]:
        """Cluster -> speaker number: the pairs (cluster, old number) with the most weight in common
        first; a cluster left over takes the lowest free number."""
        overlap: dict[tuple[int, int], float] = {}
        for x, c in zip(self._recent, clusters):
            if x.speaker > 0:
                overlap[int(c), x.speaker] = overlap.get((int(c), x.speaker), 0.0) + x.weight
        names: dict[int, int] = {}
        for (c, n), _ in sorted(overlap.items(), key=lambda kv: -kv[1]):
            if c not in names and n not in names.values():
                names[c] = n
        for c in sorted(set(int(c) for c in clusters)):
            if c not in names:
                names[c] = next(n for n in range(1, len(names) + 2) if n not in names.values())
        return names

    def _reassign(self, newest: _Segment) -> list[SpeakerChange]:
        changes: dict[int, SpeakerChange] = {}
        for seg in self._recent:
            if seg is newest:
                continue
            own = seg.speaker
            self._leave(seg)
            best, score = self._nearest(seg.vector)
            if best is None or (score < self.settings.threshold and self._counts[own] == 0):
                best = own  # nothing else fits: it stays (its speaker is kept alive)
            self._join(seg, best)
            if best != own:
                changes[seg.segment_id] = SpeakerChange(seg.segment_id, self._name(best))
        return sorted(changes.values(), key=lambda c: c.segment_id)

    def _nearest(self, vector: np.ndarray) -> tuple[int | None, float]:
        best, score = None, -2.0
        for i, total in enumerate(self._sums):
            if not self._counts[i]:
                continue
            sim = float(vector @ total) / max(float(np.linalg.norm(total)), 1e-9)
            if sim > score:
                best, score = i, sim
        return best, score

    def _open(self) -> int:
        held = {self._names[i] for i, c in enumerate(self._counts) if c}
        number = next(n for n in range(1, len(self._names) + 2) if n not in held)
        for i, c in enumerate(self._counts):  # a freed speaker's slot and name
            if not c and self._names[i] == number:
                self._sums[i] = np.zeros_like(self._sums[i])
                return i
        self._sums.append(np.zeros(256, np.float32))
        self._names.append(number)
        self._counts.append(0)
        return len(self._sums) - 1

    def _join(self, seg: _Segment, speaker: int) -> None:
        seg.speaker = speaker
        self._sums[speaker] = self._sums[speaker] + seg.weight * seg.vector
        self._counts[speaker] += 1

    def _leave(self, seg: _Segment) -> None:
        self._sums[seg.speaker] = self._sums[seg.speaker] - seg.weight * seg.vector
        self._counts[seg.speaker] -= 1

    def _name(self, speaker: int) -> str:
        return f"S{self._names[speaker]}"


def centroid_linkage(vectors: np.ndarray, threshold: float) -> np.ndarray:
    """Agglomerative clustering of unit vectors [n, d] by their centroids: the two clusters whose
    centroids (sums of their vectors) have the highest cosine merge while it is at least `threshold`
    (the online decision's rule for a segment joining a speaker, applied to whole clusters).
    -> [n] cluster ids 0.. in order of first appearance."""
    n = len(vectors)
    sums = vectors.astype(np.float64)
    units = sums / np.maximum(np.linalg.norm(sums, axis=1, keepdims=True), 1e-9)
    sim = units @ units.T  # [n, n] cosines between clusters; -inf on the diagonal and for merged-away ones
    np.fill_diagonal(sim, -np.inf)
    gone = np.zeros(n, bool)
    owner = np.arange(n)
    for _ in range(n - 1):
        i, j = divmod(int(np.argmax(sim)), n)
        if sim[i, j] < threshold:
            break
        i, j = min(i, j), max(i, j)
        sums[i] += sums[j]
        units[i] = sums[i] / max(float(np.linalg.norm(sums[i])), 1e-9)
        gone[j] = True
        owner[owner == j] = i
        row = np.where(gone, -np.inf, units @ units[i])
        row[i] = -np.inf
        sim[i], sim[:, i] = row, row
        sim[j], sim[:, j] = -np.inf, -np.inf
    return _first_appearance(owner)


def _first_appearance(owner: np.ndarray) -> np.ndarray:
    order: dict[int, int] = {}
    return np.array([order.setdefault(int(o), len(order)) for o in owner])


def absorb_short(vectors: np.ndarray, clusters: np.ndarray, durations: np.ndarray, min_s: float) -> np.ndarray:
    """Clusters holding less than `min_s` seconds of speech (too little voice to found a speaker on)
    join the nearest cluster that holds enough (cosine to its mean vector); one cluster if none does."""
    total = np.bincount(clusters, weights=durations)
    big = [c for c in range(len(total)) if total[c] >= min_s]
    if not big:
        return np.zeros_like(clusters)
    if len(big) == len(total):
        return clusters
    means = np.stack([vectors[clusters == c].sum(0) for c in big])
    means /= np.maximum(np.linalg.norm(means, axis=1, keepdims=True), 1e-9)
    out = clusters.copy()
    for c in range(len(total)):
        if total[c] < min_s:
            members = clusters == c
            out[members] = big[int(np.argmax(means @ vectors[members].sum(0)))]
    return _first_appearance(out)


class SegmentFrames:
    """Each open segment's features (floored raw log10-mel [128, k] pieces, as decoded) until its final."""

    def __init__(self) -> None:
        self._frames: dict[int, list[np.ndarray]] = {}

    def add(self, segment_id: int, frames: np.ndarray) -> None:
        if frames.shape[-1]:
            self._frames.setdefault(segment_id, []).append(frames)

    def take(self, segment_id: int) -> np.ndarray | None:
        parts = self._frames.pop(segment_id, None)
        return np.concatenate(parts, axis=1) if parts else None


_ENCODER = None
_ENCODER_LOCK = threading.Lock()


def encoder_available() -> bool:
    """The speaker encoder's weights are installed (the resemblyzer package)."""
    from ..model.speaker_encoder import weights_path
    from ...shared.errors import ModelError

    try:
        weights_path()
    except ModelError:
        return False
    return True


def shared_encoder():
    """The process's speaker encoder, loaded at the first call (the first session that asks)."""
    global _ENCODER
    with _ENCODER_LOCK:
        if _ENCODER is None:
            from ..model.speaker_encoder import SpeakerEncoder

            _ENCODER = SpeakerEncoder.load()
        return _ENCODER


_TUNED: tuple[Background, DiarizeSettings] | None = None


def tuned() -> tuple[Background, DiarizeSettings]:
    """The shipped background and the settings tuned with it (cloud/model/speaker_background.json:
    `mean`, `threshold`, `length_term`, `min_new_s`, `recluster`), read once; the defaults where the file is missing."""
    global _TUNED
    if _TUNED is None:
        if BACKGROUND_PATH.is_file():
            doc = json.loads(BACKGROUND_PATH.read_text())
            knobs: dict = {k: float(doc[k]) for k in ("threshold", "length_term", "min_new_s") if k in doc}
            knobs["recluster"] = bool(doc.get("recluster", False))
            _TUNED = Background(np.asarray(doc["mean"], np.float32)), DiarizeSettings(**knobs)
        else:
            _TUNED = Background.none(), DiarizeSettings()
    return _TUNED


def session_diarizer() -> SessionDiarizer:
    """A new session's diarizer with the shipped background and settings."""
    background, settings = tuned()
    return SessionDiarizer(shared_encoder(), background, settings)
