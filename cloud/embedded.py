"""The embedded engine: edge and cloud in one process, on audio time, no server.

    for event in stream_file("talk.wav", "tiny", SessionOptions()):
        ...

The audio takes the real wire path — the edge's `FeatureStream` (VAD, streaming log-mel, running-max
floor, codec encode) and the engine's `ingest_packet` (codec decode) — in 100 ms pieces. After each
piece the engine steps while it has work, so the events are those of a stream served in real time
by an engine that keeps up, only without waiting for the clock.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Iterable, Iterator, Literal, overload

import numpy as np

from .inference.engine import Engine, EngineConfig
from .inference.word_timings import SegmentAligner, SegmentTap, segment_language
from .inference.decoder_stream import SessionOptions, EngineEvent
from ..shared.codec import DEFAULT_MODE
from ..shared.features_spec import SAMPLE_RATE
from ..shared.protocol import Configure, Finalize, model_context
from ..shared.codec import decode_frames
from ..shared.transcript import SpeakerChange, TranscriptEvent, TurnEvent
from ..edge.pipeline import FeatureStream
from ..edge.vad import VadOptions
from ..edge.audio import load_audio, peak_normalize
from ..shared.text import events_text


PIECE_SECONDS = 0.1


def stream_audio(audio: np.ndarray, engine: Engine, options: SessionOptions = SessionOptions(),
                 piece_seconds: float = PIECE_SECONDS, codec_mode: str = DEFAULT_MODE) -> Iterator[EngineEvent]:
    """Stream 16 kHz mono float32 audio through the edge pipeline and `engine` (one session)."""
    step = max(1, int(round(piece_seconds * SAMPLE_RATE)))
    yield from stream_pieces((audio[i:i + step] for i in range(0, len(audio), step)), engine, options,
                             codec_mode)


@overload
def stream_pieces(pieces: Iterable[np.ndarray | Finalize | Configure], engine: Engine, options: SessionOptions = ...,
                  codec_mode: str = ..., on_packet=..., turns: Literal[False] = ...,
                  vad_options: VadOptions | None = ...) -> Iterator[EngineEvent]: ...


@overload
def stream_pieces(pieces: Iterable[np.ndarray | Finalize | Configure], engine: Engine, options: SessionOptions = ...,
                  codec_mode: str = ..., on_packet=..., turns: bool = ...,
                  vad_options: VadOptions | None = ...) -> Iterator[EngineEvent | TurnEvent]: ...


def stream_pieces(pieces: Iterable[np.ndarray | Finalize | Configure], engine: Engine, options: SessionOptions = SessionOptions(),
                  codec_mode: str = DEFAULT_MODE, on_packet=None, turns: bool = False,
                  vad_options: VadOptions | None = None) -> Iterator[EngineEvent | TurnEvent]:
    """Stream pieces of 16 kHz mono float32 audio as they come (a file cut up, a microphone)
    through the edge pipeline (codec mode `codec_mode`) and `engine`; after each piece the engine
    catches up. A `Finalize` among the pieces ends the open segment there (`FeatureStream.finalize`;
    its final is `from_finalize`); a `Configure` sets the keyterms (and context) from the next
    segment on. `on_packet(packet)` sees each edge packet before the engine does
    (word timings keep the segments' features with it). `turns`: the VAD's `TurnEvent`s too, each
    as soon as its packet is out (before the engine's events of that packet). `vad_options`: the edge
    VAD's (None: its defaults)."""

    seed = options.resume.running_max_log10 if options.resume is not None else float("-inf")
    edge = FeatureStream(vad_options or VadOptions(), mode=codec_mode, running_max_log10=seed)
    sid = engine.open_session(options)
    finalized: set[int] = set()

    def feed(packets) -> Iterator[TurnEvent]:
        for packet in packets:
            on_packet is not None and on_packet(packet)
            engine.ingest_packet(sid, packet)
            if packet.finalized:
                finalized.add(packet.segment_id)
            if turns:
                yield from packet.turns()

    def drain() -> Iterator[EngineEvent]:
        for event in _drain(engine, sid):
            if event.is_final and event.segment_id in finalized:
                finalized.discard(event.segment_id)
                event = replace(event, from_finalize=True)
            yield event

    context = options.context
    try:
        for piece in pieces:
            if isinstance(piece, Configure):
                context = context if piece.context is None else piece.context
                engine.configure(sid, model_context(context, piece.keyterms))
                continue
            yield from feed(edge.finalize() if isinstance(piece, Finalize) else edge.push(piece))
            yield from drain()
        yield from feed(edge.flush())
        engine.finalize(sid)
        yield from drain()
    finally:
        engine.close_session(sid)


def _drain(engine: Engine, sid: str) -> Iterator[EngineEvent]:
    while engine.has_work():
        for s, event in engine.step():
            if s == sid:
                yield event
    error = engine.failure(sid)
    if error is not None:
        raise error


def stream_file(path: str, model, options: SessionOptions = SessionOptions()) -> Iterator[EngineEvent]:
    """Stream an audio file (any format `load_audio` reads) through an in-process engine.
    `model` is a loaded `Qwen3ASR` or anything `Qwen3ASR.load` takes."""

    audio = peak_normalize(load_audio(path))
    if isinstance(model, str):
        from .model.asr import Qwen3ASR

        model = Qwen3ASR.load(model)
    engine = Engine(model, EngineConfig(max_sessions=1, max_batch=1, slot_policy=options.policy))
    yield from stream_audio(audio, engine, options)


def transcript_text(events: list[EngineEvent]) -> str:
    """All committed text of a stream, segments in order (joined as `shared.text` says)."""

    return events_text(events)


def stream_with_word_timings(pieces, engine, options, timings: SegmentAligner, codec_mode: str | None = None,
                             turns: bool = False, on_packet=None):
    """`stream_pieces` that also yields a `SegmentWords` after each final event: the words of
    that segment's committed text (never changed) with their times on the stream's timeline.
    `on_packet` sees each edge packet too (speaker labels keep the segments' features)."""
    tap = SegmentTap()
    key = "embedded"

    def seen(packet) -> None:
        tap.add(packet)
        on_packet is not None and on_packet(packet)

    for event in stream_pieces(pieces, engine, options, codec_mode or DEFAULT_MODE, on_packet=seen, turns=turns):
        if isinstance(event, TurnEvent):
            yield event
            continue
        final = tap.on_event(event)
        yield event
        if final is not None:
            feats, text = final
            timings.submit(key, event.segment_id, feats, text, event.start_s,
                           segment_language(event.language, options.language))
            while timings.pending():
                for _, words in timings.step():
                    yield words


class SpeakerTap:
    """Speaker labels in-process (`harken stream --diarize`, `harken transcribe --diarize`): `add` sees
    each edge packet (pass it as `on_packet`), `label` the events that come out: each final event with
    its `speaker`, then the `SpeakerChange`s it decided (cloud/inference/diarization.py, as a server
    labels a session's segments)."""

    def __init__(self, diarizer=None):
        from .inference.diarization import SegmentFrames, session_diarizer

        self.frames = SegmentFrames()
        self.diarizer = diarizer if diarizer is not None else session_diarizer()

    def add(self, packet) -> None:
        if packet.frame_count:
            self.frames.add(packet.segment_id, decode_frames(packet.payload))

    def label(self, events) -> Iterator:
        for event in events:
            if isinstance(event, TranscriptEvent) and event.is_final:
                speaker, changes = self.diarizer.label(event.segment_id, self.frames.take(event.segment_id),
                                                       event.start_s, event.end_s)
                yield replace(event, speaker=speaker)
                yield from changes
            else:
                yield event


def relabelled(items) -> list:
    """A finished stream's items with every `SpeakerChange` applied to its segment's final event (and
    dropped): the final labels, for output written after the stream (`harken transcribe`)."""
    items = list(items)
    latest = {c.segment_id: c.speaker for c in items if isinstance(c, SpeakerChange)}
    return [replace(e, speaker=latest.get(e.segment_id, e.speaker)) if isinstance(e, TranscriptEvent) and e.is_final
            else e for e in items if not isinstance(e, SpeakerChange)]


def speaker_turns(audio: np.ndarray, diarizer=None) -> list[tuple[float, float, str]]:
    """Who spoke when in a file, without its text: the edge's VAD segments of 16 kHz `audio`, each
    labelled as a live session's finals are (after every relabel): [(start_s, end_s, speaker)] in order.
    For APIs whose text comes from another pass (Deepgram's pre-recorded words: `speaker_at`)."""
    from .inference.diarization import SegmentFrames, session_diarizer

    d = diarizer if diarizer is not None else session_diarizer()
    edge = FeatureStream(VadOptions())
    frames = SegmentFrames()
    first: dict[int, int] = {}
    step = int(PIECE_SECONDS * SAMPLE_RATE)
    packets = [p for i in range(0, len(audio), step) for p in edge.push(audio[i:i + step])] + edge.flush()
    ends = []
    for p in packets:
        first.setdefault(p.segment_id, p.first_frame)
        if p.frame_count:
            frames.add(p.segment_id, decode_frames(p.payload))
        if p.segment_end:
            ends.append((p.segment_id, (p.first_frame + p.frame_count) / 100))
    labels: dict[int, str] = {}
    spans = {}
    for sid, end_s in ends:
        start_s = first[sid] / 100
        name, changes = d.label(sid, frames.take(sid), start_s, end_s)
        labels[sid] = name
        labels.update({c.segment_id: c.speaker for c in changes})
        spans[sid] = (start_s, end_s)
    return [(spans[k][0], spans[k][1], labels[k]) for k in sorted(spans)]


def speaker_at(turns: list[tuple[float, float, str]], t: float) -> str:
    """The speaker of the turn holding time `t`, else of the nearest one ("" without turns)."""
    best, gap = "", float("inf")
    for start, end, who in turns:
        d = 0.0 if start <= t <= end else min(abs(t - start), abs(t - end))
        if d < gap:
            best, gap = who, d
    return best
