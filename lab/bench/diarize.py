"""`harken bench diarize`: live speaker labels (cloud/inference/diarization.py) on synthetic meetings.

Each meeting (lab/bench/meetings.py) goes through the edge's pipeline (VAD, log-mel, codec) in 100-ms
pieces; each VAD segment's frames, decoded as the server decodes them, are labelled when the segment
ends, in order, exactly as a server labels a session's finals (the recogniser's text plays no part in
who spoke). Two hypotheses per meeting: the labels as they came with each final (`live`) and after every
relabel (`final`). Scored against the turns by pyannote.metrics' DER (collar 0.25 s, overlapped speech
scored), the speaker count, the label's cost (embedding + decision) per segment (p95: how much the label
delays its final) and per speech second (share of one core).

Both decisions are tuned (`tune`) on 24 meetings that are not scored (other texts: lab/training/ood.jsonl;
other seeds): the online one (threshold x length term x minimum duration for a new speaker), which
ships, and re-clustering (threshold x minimum speech of a cluster); the figures of both picks on the
scored meetings are in the output (`decisions`). The tuning meetings
also give the background mean (`--write-background` writes both to cloud/model/speaker_background.json).
Real speech: Debian's pocketsphinx-testdata (one LibriVox reader's clips against a CMU speaker's), when
installed. `--cpwer N`: speaker-attributed WER (meeteval's cpWER, lab/bench/cpwer.py) on the first N
scored meetings through the recogniser (`--model`), with the final labels and with the true ones.
"""

from __future__ import annotations

import itertools
import json
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from harken.bench.meetings import SCORED, TUNING, Meeting, meetings
from harken.cloud.inference.diarization import (BACKGROUND_PATH, MAX_PARTIALS, MIN_FRAMES, Background,
                                                DiarizeSettings, SessionDiarizer)
from harken.edge.pipeline import FeatureStream
from harken.edge.vad import VadOptions
from harken.shared.codec import decode_frames

COLLAR = 0.25
THRESHOLDS = (0.5, 0.55, 0.6, 0.65, 0.7, 0.75, 0.8)
LENGTH_TERMS = (0.0, 0.2, 0.4, 0.8, 1.2)
# at most 3 s: a speaker who says two short things must get a label of their own (re-clustering's
# minimum counts a cluster's whole speech; the LibriVox check's other speaker says 2.0 s, then 3.1 s)
MIN_NEW_S = (1.0, 2.0, 3.0)


@dataclass
class Segment:
    segment_id: int
    start_s: float
    end_s: float
    frames: np.ndarray  # [128, T] floored log10-mel, as the server decodes it
    embedding: np.ndarray | None = None
    cost_s: float = 0.0  # CPU seconds of its embedding


def edge_segments(audio: np.ndarray) -> list[Segment]:
    """The VAD segments of `audio` with their decoded features, as a server receives them."""
    stream = FeatureStream(VadOptions())
    packets = []
    for i in range(0, len(audio), 1600):
        packets += stream.push(audio[i:i + 1600])
    packets += stream.flush()
    parts: dict[int, list[np.ndarray]] = {}
    first: dict[int, int] = {}
    for p in packets:
        first.setdefault(p.segment_id, p.first_frame)
        if p.frame_count:
            parts.setdefault(p.segment_id, []).append(decode_frames(p.payload))
    out = []
    for sid, pieces in sorted(parts.items()):
        frames = np.concatenate(pieces, axis=1)
        out.append(Segment(sid, first[sid] / 100, (first[sid] + frames.shape[1]) / 100, frames))
    return out


def embed(encoder, segments: list[Segment]) -> None:
    for s in segments:
        t0 = time.process_time()
        s.embedding = encoder.embed_features(s.frames, MAX_PARTIALS) if s.frames.shape[1] >= MIN_FRAMES else None
        s.cost_s = time.process_time() - t0


def label(segments: list[Segment], background: Background, settings: DiarizeSettings):
    """-> (live labels, final labels, decision seconds per segment), each {segment_id: name}."""
    d = SessionDiarizer(None, background, settings)
    live: dict[int, str] = {}
    final: dict[int, str] = {}
    costs = []
    for s in segments:
        t0 = time.process_time()
        name, changes = d.add(s.segment_id, s.embedding, s.end_s - s.start_s)
        costs.append(time.process_time() - t0)
        live[s.segment_id] = final[s.segment_id] = name
        for c in changes:
            final[c.segment_id] = c.speaker
    return live, final, costs


def annotation(spans):
    from pyannote.core import Annotation, Segment as Span

    a = Annotation()
    for i, (start, end, who) in enumerate(spans):
        a[Span(start, end), i] = who
    return a


def der(meeting: Meeting, segments: list[Segment], labels: dict[int, str]) -> tuple[float, float]:
    """(DER, reference speech seconds): collar 0.25 s, overlaps scored."""
    from pyannote.metrics.diarization import DiarizationErrorRate

    ref = annotation([(t.start_s, t.end_s, t.speaker) for t in meeting.turns])
    hyp = annotation([(s.start_s, s.end_s, labels[s.segment_id]) for s in segments])
    metric = DiarizationErrorRate(collar=COLLAR, skip_overlap=False)
    detail = metric(ref, hyp, detailed=True)
    return float(detail["diarization error rate"]), float(detail["total"])


@dataclass
class Scored:
    meeting: Meeting
    segments: list[Segment]


def prepare(source: Path, count: int, seed: int, overlap: bool, encoder) -> list[Scored]:
    out = []
    for m in meetings(source, count, seed, overlap=overlap):
        segments = edge_segments(m.audio)
        embed(encoder, segments)
        out.append(Scored(m, segments))
    return out


def score(sets: list[Scored], background: Background, settings: DiarizeSettings) -> dict:
    """Pooled DER (errors / reference speech over all meetings), live and final; speaker count right."""
    err_live = err_final = total = 0.0
    right = 0
    decisions: list[float] = []
    rows = []
    for s in sets:
        live, final, costs = label(s.segments, background, settings)
        d_live, ref = der(s.meeting, s.segments, live)
        d_final, _ = der(s.meeting, s.segments, final)
        err_live += d_live * ref
        err_final += d_final * ref
        total += ref
        found = len(set(final.values()))
        right += found == s.meeting.speakers
        decisions += costs
        rows.append({"meeting": s.meeting.name, "minutes": round(s.meeting.duration_s / 60, 2),
                     "speakers": s.meeting.speakers, "found": found, "der_final": round(d_final, 4),
                     "der_live": round(d_live, 4)})
    return {"der_final": round(err_final / total, 4), "der_live": round(err_live / total, 4),
            "speaker_count_right": round(right / len(sets), 3), "meetings": rows, "decision_s": decisions}


def _smoothed_pick(table: dict[tuple[int, int, int], float], live: dict[tuple[int, int, int], float]):
    """The grid point whose objective averaged with its neighbours (in every knob) is lowest; ties go to
    the lower live DER. A point alone in a good region loses to a good region: on a few meetings single
    points tie and differ by chance."""
    def smoothed(key: tuple[int, int, int]) -> float:
        near = [table[n] for n in itertools.product(*((k - 1, k, k + 1) for k in key)) if n in table]
        return round(sum(near) / len(near), 6)

    return min(table, key=lambda k: (smoothed(k), live[k], table[k]))


def tune_decision(sets: list[Scored], background: Background, recluster: bool) -> tuple[DiarizeSettings, float, list[dict]]:
    """One decision's grid on the tuning meetings: the online one over THRESHOLDS x LENGTH_TERMS x
    MIN_NEW_S, re-clustering over THRESHOLDS x MIN_NEW_S (its length term plays no part). Each point's
    objective: DER after relabels less 0.02 x the share of meetings with the speaker count right.
    -> (the pick, its objective, the grid)."""
    table: dict[tuple[int, int, int], float] = {}
    live: dict[tuple[int, int, int], float] = {}
    grid = []
    terms = (0.0,) if recluster else LENGTH_TERMS
    minimums = MIN_NEW_S
    for (i, threshold), (j, term), (k, min_new) in itertools.product(enumerate(THRESHOLDS), enumerate(terms),
                                                                     enumerate(minimums)):
        settings = DiarizeSettings(threshold=threshold, length_term=term, min_new_s=min_new, recluster=recluster)
        r = score(sets, background, settings)
        table[i, j, k] = r["der_final"] - 0.02 * r["speaker_count_right"]
        live[i, j, k] = r["der_live"]
        grid.append({"recluster": recluster, "threshold": threshold, "length_term": term, "min_new_s": min_new,
                     "der_final": r["der_final"], "der_live": r["der_live"],
                     "speaker_count_right": r["speaker_count_right"]})
    i, j, k = _smoothed_pick(table, live)
    settings = DiarizeSettings(threshold=THRESHOLDS[i], length_term=terms[j], min_new_s=minimums[k], recluster=recluster)
    return settings, table[i, j, k], grid


def tune(sets: list[Scored], background: Background) -> tuple[DiarizeSettings, dict[str, tuple[DiarizeSettings, float]], list[dict]]:
    """Both decisions tuned on the tuning meetings. The online one ships: re-clustering's pick scores
    better there (DER 7.0% against 9.0% on 24 meetings) but splits the tests' two voices taking turns
    (tests/test_diarization.py: one en-us voice under three labels), so it is reported beside it only.
    -> (the shipped settings, {decision: (its pick, its objective)}, the grids)."""
    picks: dict[str, tuple[DiarizeSettings, float]] = {}
    grid: list[dict] = []
    for name, recluster in (("online", False), ("recluster", True)):
        settings, objective, g = tune_decision(sets, background, recluster)
        picks[name] = settings, objective
        grid += g
    return picks["online"][0], picks, grid


def background_of(sets: list[Scored]) -> Background:
    vectors = [s.embedding for m in sets for s in m.segments if s.embedding is not None]
    mean = np.mean(vectors, axis=0)
    return Background(mean.astype(np.float32))


def bench_diarize(count: int = 24, overlap_count: int = 6, tuning_count: int = 24, seed: int = 0,
                  write_background: bool = False, real: bool = True, cpwer: int = 0,
                  model: str = "synth-en") -> dict:
    import torch

    from harken.cloud.model.speaker_encoder import SpeakerEncoder

    torch.set_num_threads(1)
    encoder = SpeakerEncoder.load()
    t0 = time.monotonic()
    tuning = prepare(TUNING, tuning_count, seed + 1000, False, encoder)
    background = background_of(tuning)
    settings, picks, grid = tune(tuning, background)
    if write_background:
        background.save(BACKGROUND_PATH, about=f"harken bench diarize --write-background: the mean speaker "
                        f"embedding of {sum(len(s.segments) for s in tuning)} segments of {len(tuning)} tuning "
                        f"meetings (lab/training/ood.jsonl texts, seed {seed + 1000})",
                        threshold=settings.threshold, length_term=settings.length_term, min_new_s=settings.min_new_s,
                        recluster=settings.recluster)
    scored = prepare(SCORED, count, seed, False, encoder)
    overlapped = prepare(SCORED, overlap_count, seed + 500, True, encoder) if overlap_count else []
    main = score(scored, background, settings)
    over = score(overlapped, background, settings) if overlapped else None
    segments = [s for m in scored for s in m.segments]
    decisions = main.pop("decision_s")
    costs = [s.cost_s + d for s, d in zip(segments, decisions)]
    speech_s = sum(s.end_s - s.start_s for s in segments)
    out = {
        "meetings": len(scored), "minutes": round(sum(m.meeting.duration_s for m in scored) / 60, 1),
        "settings": {"threshold": settings.threshold, "length_term": settings.length_term,
                     "min_new_s": settings.min_new_s, "recluster": settings.recluster},
        "tuning": {"meetings": len(tuning), "source": TUNING.name, "grid": grid},
        "decisions": {name: decision_figures(pick, objective, scored, overlapped, background)
                      for name, (pick, objective) in picks.items()},
        "der_final": main["der_final"], "der_live": main["der_live"],
        "speaker_count_right": main["speaker_count_right"],
        "label_ms_p95": round(1000 * float(np.percentile(costs, 95)), 1),
        "label_ms_mean": round(1000 * float(np.mean(costs)), 1),
        "core_share_per_speech_s": round(sum(costs) / speech_s, 5),
        "per_meeting": main["meetings"],
    }
    if over is not None:
        over.pop("decision_s")
        out["overlap"] = {"meetings": len(overlapped), "der_final": over["der_final"], "der_live": over["der_live"],
                          "speaker_count_right": over["speaker_count_right"], "per_meeting": over["meetings"]}
    if cpwer:
        from harken.bench.cpwer import bench_cpwer

        some = scored[:cpwer]
        out["cpwer"] = bench_cpwer(model, some, [label(s.segments, background, settings)[1] for s in some])
    if real:
        out["real_speech"] = real_speech(encoder, background, settings)
    out["seconds"] = round(time.monotonic() - t0, 1)
    return out


def decision_figures(settings: DiarizeSettings, objective: float, scored: list[Scored], overlapped: list[Scored],
                     background: Background) -> dict:
    """A decision's tuned pick, its objective on the tuning meetings, and its figures on the scored ones
    (the decision that did not ship, beside the one that did)."""
    main = score(scored, background, settings)
    out = {"threshold": settings.threshold, "length_term": settings.length_term, "min_new_s": settings.min_new_s,
           "tuning_objective": round(objective, 4), "der_final": main["der_final"], "der_live": main["der_live"],
           "speaker_count_right": main["speaker_count_right"]}
    if overlapped:
        over = score(overlapped, background, settings)
        out["overlap"] = {k: over[k] for k in ("der_final", "der_live", "speaker_count_right")}
    return out


def real_speech(encoder, background: Background, settings: DiarizeSettings) -> dict | None:
    """pocketsphinx-testdata's LibriVox reader (5 clips) interleaved with its CMU speaker: the labels."""
    from harken.bench.real_speakers import interleaved_readers

    talk = interleaved_readers()
    if talk is None:
        return None
    audio, truth = talk
    segments = edge_segments(audio)
    embed(encoder, segments)
    _, final, _ = label(segments, background, settings)
    return {"segments": len(segments), "labels": [final[s.segment_id] for s in segments],
            "truth": truth}


def bench_diarize_command(count: int = 24, overlap_count: int = 6, tuning_count: int = 24, seed: int = 0,
                          write_background: bool = False, cpwer: int = 0, model: str = "synth-en") -> int:
    out = bench_diarize(count, overlap_count, tuning_count, seed, write_background, cpwer=cpwer, model=model)
    print(json.dumps(out))
    return 0


__all__ = ["bench_diarize", "bench_diarize_command", "edge_segments", "replace"]
