"""Helpers for the streaming-engine tests: a talkative tiny model, feature frames as the edge
sends them, and drivers that feed an Engine on audio time."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from harken.shared.features_spec import N_MELS, RunningMaxFloor

IM_END_ID = 151645
EOS_ROW_NORM = 2.0


@lru_cache(maxsize=1)
def talkative_tiny():
    """The cached tiny random checkpoint (fp32, CPU) with its <|im_end|> row set to a fixed norm.

    A random model either answers <|im_end|> at once or never; at this norm (the other rows are
    ~1) both happen, depending on the audio, so the tests see empty answers, answers cut by the
    token budgets, and everything the commit policy does in between. Setting the norm (rather than
    scaling whatever the checkpoint holds) keeps it independent of how the cache was built.
    """
    from harken.cloud.model.asr import Qwen3ASR

    asr = Qwen3ASR.load("tiny", dtype="fp32", device="cpu")
    with torch.no_grad():
        row = asr.decoder.model.embed_tokens.weight[IM_END_ID]
        row.mul_(EOS_ROW_NORM / row.norm())
    return asr


def floored_frames(seconds: float, seed: int, running_max: float = float("-inf")) -> tuple[np.ndarray, float]:
    """Raw log10-mel-like frames [128, T] floored against the running max, as the edge sends them;
    returns (frames, running max after them)."""
    rng = np.random.default_rng(seed)
    t = int(round(seconds * 100))
    level = rng.normal(-1.5, 0.8, size=(1, t)).cumsum(axis=1) * 0.02  # slow loudness drift
    x = rng.normal(-2.0, 1.2, size=(N_MELS, t)) + level
    floor = RunningMaxFloor(running_max)
    return floor(x.astype(np.float32)), floor.max_log10


@dataclass
class Segment:
    """A segment to stream: id, first frame on the stream timeline, floored frames, running max."""

    segment_id: int
    first_frame: int
    frames: np.ndarray
    running_max: float


def make_segments(lengths_s: list[float], gaps_s: list[float], seed: int) -> list[Segment]:
    out, at, running = [], 0, float("-inf")
    for i, (length, gap) in enumerate(zip(lengths_s, gaps_s)):
        at += int(round(gap * 100))
        frames, running = floored_frames(length, seed * 1000 + i, running)
        out.append(Segment(i, at, frames, running))
        at += frames.shape[1]
    return out


def packets(segments: list[Segment], piece_frames: list[int]):
    """(segment_id, first_frame, frames, start, end, running_max) in pieces of the given sizes
    (cycled); the last piece of a segment carries the end flag (possibly with no frames)."""
    i = 0
    for seg in segments:
        t = seg.frames.shape[1]
        pos = 0
        while True:
            k = piece_frames[i % len(piece_frames)]
            i += 1
            k = min(k, t - pos)
            end = pos + k >= t
            yield (seg.segment_id, seg.first_frame + pos, seg.frames[:, pos:pos + k], pos == 0, end,
                   seg.running_max)
            pos += k
            if end:
                break


def run_alone(engine, options, segments, piece_frames):
    """One session: feed each piece, then step until idle. Returns its events."""
    sid = engine.open_session(options)
    events = []
    for p in packets(segments, piece_frames):
        engine.ingest(sid, *p)
        events += [e for s, e in engine.run_until_idle() if s == sid]
    events += [e for s, e in engine.run_until_idle() if s == sid]
    engine.close_session(sid)
    return events


def segment_texts(events) -> dict[int, str]:
    from harken.shared.text import TranscriptText

    acc = TranscriptText()
    for e in events:
        acc.add(e)
    return acc.segments


def item_tokens(events) -> dict[int, list[tuple[int, ...]]]:
    """Per segment, the token ids of each audio item's final pass."""
    out: dict[int, list] = {}
    for e in events:
        if e.token_ids is not None:
            out.setdefault(e.segment_id, []).append(e.token_ids)
    return out


def workloads(n: int, seed: int, english=lambda i: i % 3 == 2):
    """n sessions with different segment layouts, packet sizes, languages (`english(i)`: forced
    English, else detected) and contexts: (options, segments, packet sizes) each."""
    from harken.cloud.inference.commit import CommitPolicy
    from harken.cloud.inference.decoder_stream import SessionOptions

    policy = CommitPolicy(max_item_tokens=10, max_new_tokens_per_update=4, rollback_tokens=2)
    out = []
    for i in range(n):
        lengths = [1.5 + 1.3 * i, 0.8 + 0.5 * (i % 3)][: 1 + i % 2]
        segments = make_segments(lengths, [0.1 * i, 0.5], seed=seed + i)
        options = SessionOptions(language="English" if english(i) else None, context=f"talk {i}" * (i % 2),
                                 policy=policy)
        out.append((options, segments, [23 + 17 * i, 60, 7 + i]))
    return out


def run_batched(engine, work) -> list[list]:
    """All sessions at once: each round every session gets its next packet, then the engine steps
    until idle — so each session sees the same input/step schedule as when it runs alone."""
    sids = [engine.open_session(options) for options, _, _ in work]
    streams = [list(packets(segments, pieces)) for _, segments, pieces in work]
    events: dict[str, list] = {sid: [] for sid in sids}
    for r in range(max(len(s) for s in streams)):
        for sid, s in zip(sids, streams):
            if r < len(s):
                engine.ingest(sid, *s[r])
        for sid, e in engine.run_until_idle():
            events[sid].append(e)
    return [events[sid] for sid in sids]
