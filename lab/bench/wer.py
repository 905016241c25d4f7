"""`harken bench wer`: word error rate, bitrate, per-word latency and partial churn of every path
from audio to text, on the same audio, in one run.

Each held-out recipe (`synth/heldout.jsonl`, or a JSONL of recipes) is rendered once
(`synth/speech.render`) and the same audio goes down every path:

    offline                   the exact log-mel (`edge/features.log_mel`), one pass (`harken eval`)
    stream                    the in-process streaming engine (`embedded.stream_pieces`), default
                              policy (or `--update-interval` / `--rollback-tokens`: `stream_policy`
                              in the output) and codec; paced in real time: the latency figures
                              come from here
    stream_finalize           the same, with a client's finalize request (`FINALIZE`) 0.2 s after
                              each utterance's last word (`FINALIZE_AFTER_S`; espeak-ng utterances,
                              which have word times): `finalize_latency_*` come from here
    served_features_<mode>    `harken serve` in this process + the SDK (`TranscriptionClient`), the
                              edge's features with codec mode hifi / balanced / low
    served_audio              the thin client: PCM16 `Audio`, VAD and features on the server
    opus_<kbps>               the audio through libopus at 16 / 24 / 32 kbps (`lab/bench/opus_reference`:
                              20 ms frames, VBR, voip, as WebRTC sends it), decoded, then as
                              served_audio (server-side features)
    webrtc                    the SDK over a WebRTC data channel (`WebRTCTranscriptionClient`),
                              balanced features

The served paths send `concurrency` utterances at once (one SDK client each, default 8), so the
server's engine batches their passes as it batches live streams: every session's text is what it
would be alone (the engine's batched passes equal one-at-a-time ones, tests/test_bench_wer.py checks
the transcripts here), only the wall time shrinks.

WER: `synth.evaluation.wer` (jiwer after the Whisper English normaliser) over all utterances.
kbps during speech: feature paths, codec payload bytes per second of feature frames sent (the VAD's
speech; nothing is sent in silence); served_audio and opus, payload bytes per second of audio (they
send all the time); offline sends nothing (None). Latency (per word, of finals and of finalize
requests) and churn: `word_latency.py`, on the
espeak-ng utterances (word ends from espeak-ng's events, `synth/word_timing.py`; Piper reports no
word events). The served paths run as fast as they can: the engine updates at fixed audio-time
boundaries, so their transcripts do not depend on the pace.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Protocol

import numpy as np

from harken.training.espeak_word_ends import WordTime
from harken.bench.word_latency import (Churn, TimedEvent, WordLatency, final_latencies, finalize_latency,
                                       partial_churn, word_latencies)
from harken.shared.codec import DEFAULT_MODE, MODES
from harken.shared.errors import HarkenError
from harken.shared.features_spec import FRAMES_PER_SECOND, SAMPLE_RATE

OPUS_KBPS = (16, 24, 32)
PATHS = ("offline", "stream", "stream_finalize", *(f"served_features_{m}" for m in MODES), "served_audio",
         *(f"opus_{k}" for k in OPUS_KBPS), "webrtc")
PIECE_S = 0.1  # audio per piece handed to a stream, as a microphone callback delivers it
FINALIZE_AFTER_S = 0.2  # stream_finalize: the client asks to finalize this long after the last word


@dataclass(frozen=True)
class WerBenchOptions:
    """`harken bench wer` as a dataclass. `realtime` False: the stream path on a fake clock that
    jumps to each piece's capture time, so latencies are on audio time (compute counts as instant)."""

    model: str
    held_set: str = "held-out"
    n: int | None = None
    paths: tuple[str, ...] = PATHS
    language: str | None = None
    realtime: bool = True
    device: str | None = None
    dtype: str | None = None
    concurrency: int = 8  # utterances in flight at once on each served path
    update_interval_s: float | None = None  # the stream path's policy (None: CommitPolicy's default)
    rollback_tokens: int | None = None
    intermediate_commits: bool = True
    vad_min_silence_ms: int | None = None  # the stream paths' edge VAD (None: the edge's default)
    agreement: str | None = None  # the stream paths' commit rule and its probabilities (None: the engine's)
    confidence_prob: float | None = None
    min_token_prob: float | None = None

    def vad_options(self):
        from harken.edge.vad import VadOptions

        if self.vad_min_silence_ms is None:
            return VadOptions()
        return VadOptions(min_silence_duration_ms=self.vad_min_silence_ms)

    def stream_policy(self):
        """The stream path's commit policy: the engine's default, with the knobs given here."""
        from dataclasses import replace

        from harken.cloud.inference.commit import CommitPolicy

        policy = CommitPolicy()
        try:
            if self.update_interval_s is not None:
                policy = replace(policy, update_interval_s=self.update_interval_s)
            if self.rollback_tokens is not None:
                policy = replace(policy, rollback_tokens=self.rollback_tokens)
            for name in ("agreement", "confidence_prob", "min_token_prob"):
                if getattr(self, name) is not None:
                    policy = replace(policy, **{name: getattr(self, name)})
            return replace(policy, intermediate_commits=self.intermediate_commits)
        except ValueError as e:
            raise HarkenError(f"--update-interval / --rollback-tokens: {e}") from None

    def __post_init__(self):
        unknown = [p for p in self.paths if p not in PATHS]
        if unknown or not self.paths:
            raise HarkenError(f"unknown path(s) {', '.join(unknown) or '(none)'}; choose from {', '.join(PATHS)}")
        if self.n is not None and self.n < 1:
            raise HarkenError("--n must be >= 1")
        if not 1 <= self.concurrency <= 16:  # the in-process server's default session limit
            raise HarkenError("--concurrency must be 1..16")
        self.stream_policy()


@dataclass(frozen=True)
class BenchUtterance:
    text: str
    audio: np.ndarray  # 16 kHz mono float32, `speech.render` of the recipe
    words: list[WordTime] | None  # word ends, None where the voice gives no word events (Piper)


@dataclass
class PathResult:
    """One path over all utterances: its transcripts and what it put on the wire."""

    hyps: list[str] = field(default_factory=list)
    payload_bytes: int = 0
    speech_s: float = 0.0  # seconds the bytes cover (speech for feature paths, all audio otherwise)
    seconds: float = 0.0  # wall time of the path
    errors: list[str] = field(default_factory=list)  # utterances that failed (their hypothesis: "")

    def failed(self, i: int, error: Exception) -> None:
        self.hyps.append("")
        self.errors.append(f"utterance {i}: {error}")

    @property
    def kbps(self) -> float | None:
        return self.payload_bytes * 8 / self.speech_s / 1000 if self.speech_s > 0 else None


# ---- clocks: the stream path is paced on one ------------------------------------------------------

class Clock(Protocol):
    def now(self) -> float: ...

    def sleep_until(self, t: float) -> None: ...


class WallClock:
    def now(self) -> float:
        return time.monotonic()

    def sleep_until(self, t: float) -> None:
        time.sleep(max(0.0, t - time.monotonic()))


class AudioClock:
    """A fake clock: time moves only when someone waits, straight to the time waited for."""

    def __init__(self) -> None:
        self.t = 0.0

    def now(self) -> float:
        return self.t

    def sleep_until(self, t: float) -> None:
        self.t = max(self.t, t)


def paced_pieces(audio: np.ndarray, clock: Clock, start: float, piece_s: float = PIECE_S,
                 finalize_at_s: float | None = None, requested: list[float] | None = None) -> Iterator:
    """`audio` in pieces, each handed over once its last sample would have been captured. With
    `finalize_at_s` (audio time), a `FINALIZE` right after the audio up to there (the piece around
    it is cut in two), its clock time (from `start`) appended to `requested`."""
    from harken.edge.client.front_end import FINALIZE

    step = max(1, int(round(piece_s * SAMPLE_RATE)))
    cut = None if finalize_at_s is None else min(audio.size, int(round(finalize_at_s * SAMPLE_RATE)))
    bounds = sorted({*range(0, audio.size, step), *([] if cut is None else [cut])} - {audio.size})
    for i, j in zip(bounds, [*bounds[1:], audio.size]):
        clock.sleep_until(start + j / SAMPLE_RATE)
        yield audio[i:j]
        if j == cut:
            if requested is not None:
                requested.append(clock.now() - start)
            yield FINALIZE


# ---- pieces -----------------------------------------------------------------------------------------

def load_utterances(held_set: str, n: int | None) -> list[BenchUtterance]:
    """Render the recipes (and time the espeak-ng ones' words)."""
    from harken.training import corpus, speech
    from harken.training.espeak_word_ends import word_ends

    path = corpus.HELD_OUT_FILE if held_set == "held-out" else Path(held_set)
    if not path.is_file():
        raise HarkenError(f"{path}: no such recipe file")
    items = corpus.read_held_out(path)[:n]
    if not items:
        raise HarkenError(f"{path}: no recipes")
    return [BenchUtterance(u.recipe.text, speech.render(u.recipe), word_ends(u.recipe)) for u in items]


def latency_summary(latencies: list[WordLatency], churn: Churn, finals: list[float] | None = None,
                    finalizes: list[float] | None = None) -> dict:
    """The latency and stability keys: p50/p95 over every matched word, every final segment and
    every finalize request (None without any)."""
    out: dict = {}
    series = {kind: [getattr(w, f"{kind}_s") for w in latencies if getattr(w, f"{kind}_s") is not None]
              for kind in ("partial", "commit")}
    series["final"], series["finalize"] = finals or [], finalizes or []
    for kind, values in series.items():
        p50, p95 = np.percentile(values, [50, 95]) if values else (None, None)
        out[f"{kind}_latency_p50_s"] = None if p50 is None else round(float(p50), 3)
        out[f"{kind}_latency_p95_s"] = None if p95 is None else round(float(p95), 3)
    out["n_final_latencies"], out["n_finalize_latencies"] = len(series["final"]), len(series["finalize"])
    out["partial_churn"] = None if churn.share is None else round(churn.share, 4)
    out["n_latency_words"] = sum(1 for w in latencies if w.commit_s is not None)
    out["n_partial_words"] = churn.shown
    return out


def stream_timed(audio: np.ndarray, engine, options, clock: Clock, finalize_at_s: float | None = None,
                 requested: list[float] | None = None, vad_options=None) -> list[TimedEvent]:
    """One utterance through the in-process engine, paced on `clock`; events with their arrival
    times (0 = capture of the first sample). `finalize_at_s`: see `paced_pieces`."""
    from harken.cloud.embedded import stream_pieces

    start = clock.now()
    pieces = paced_pieces(audio, clock, start, finalize_at_s=finalize_at_s, requested=requested)
    return [TimedEvent(clock.now() - start, e) for e in stream_pieces(pieces, engine, options, vad_options=vad_options)]


def _feature_kbps_inputs(audio: np.ndarray, mode: str) -> tuple[int, float]:
    """(payload bytes, seconds of frames) the edge pipeline sends for `audio` in `mode`."""
    from harken.bench.edge import run_stream

    _, packets = run_stream(audio, mode)
    return sum(len(p.payload) for p in packets), sum(p.frame_count for p in packets) / FRAMES_PER_SECOND


# ---- the run ------------------------------------------------------------------------------------------

def run_offline(asr, utterances: list[BenchUtterance], language: str | None) -> PathResult:
    from harken.cloud.model.decode_limits import DecodeLimits
    from harken.edge.features import log_mel

    result = PathResult()
    for u in utterances:
        result.hyps.append(asr.transcribe(log_mel(u.audio), language=language, limits=DecodeLimits()).text)
    return result


@dataclass
class StreamTimes:
    """What a stream path measured besides its text."""

    words: list[WordLatency] = field(default_factory=list)
    churn: Churn = field(default_factory=Churn)
    finals: list[float] = field(default_factory=list)  # final latencies (s)
    finalizes: list[float] = field(default_factory=list)  # finalize latencies (s)


def run_stream(asr, utterances: list[BenchUtterance], language: str | None, clock: Clock, policy=None,
               finalize: bool = False, vad_options=None) -> tuple[PathResult, StreamTimes]:
    """The stream path (with `finalize`: a finalize request `FINALIZE_AFTER_S` after each timed
    utterance's last word: the stream_finalize path)."""
    from harken.cloud.inference.commit import CommitPolicy
    from harken.cloud.inference.engine import Engine, EngineConfig
    from harken.cloud.inference.decoder_stream import SessionOptions
    from harken.shared.text import events_text

    options = SessionOptions(language=language, policy=policy or CommitPolicy())
    engine = Engine(asr, EngineConfig(max_sessions=1, max_batch=1, slot_policy=options.policy))
    result, times = PathResult(), StreamTimes()
    for i, u in enumerate(utterances):
        requested: list[float] = []
        finalize_at = u.words[-1].end_s + FINALIZE_AFTER_S if finalize and u.words else None
        try:
            events = stream_timed(u.audio, engine, options, clock, finalize_at, requested, vad_options)
        except HarkenError as e:
            result.failed(i, e)
            continue
        result.hyps.append(events_text([t.event for t in events]))
        size, seconds = _feature_kbps_inputs(u.audio, DEFAULT_MODE)
        result.payload_bytes += size
        result.speech_s += seconds
        if u.words is not None:
            times.words += word_latencies(events, u.words)
            times.churn.add(partial_churn(events))
            times.finals += final_latencies(events, u.words)
        for t in requested:
            if (latency := finalize_latency(events, t)) is not None:
                times.finalizes.append(latency)
    return result, times


async def _served(make_client, sources: list[np.ndarray], concurrency: int) -> PathResult:
    """Every utterance through an SDK client of its own, `concurrency` of them at once, as fast as
    they go; the results in the utterances' order."""
    from harken.edge.client.front_end import audio_pieces

    gate = asyncio.Semaphore(concurrency)

    async def one(source: np.ndarray) -> tuple[str | HarkenError, int, int]:
        async with gate:
            client = make_client()
            try:
                text: str | HarkenError = await client.transcribe(audio_pieces(source, int(PIECE_S * 1000)))
            except HarkenError as e:
                text = e
            return text, client.stats.payload_bytes_produced, client.stats.frames_produced

    result = PathResult()
    for i, (text, size, frames) in enumerate(await asyncio.gather(*(one(s) for s in sources))):
        if isinstance(text, HarkenError):
            result.failed(i, text)
        else:
            result.hyps.append(text)
        result.payload_bytes += size
        result.speech_s += frames / FRAMES_PER_SECOND
    return result


async def run_served(asr, utterances: list[BenchUtterance], paths: list[str], language: str | None,
                     log, concurrency: int = 1) -> dict[str, PathResult]:
    """The served paths against one in-process server (gRPC and WebRTC signaling on free ports)."""
    from harken.cloud.server import ServerOptions, start_server
    from harken.bench.opus_reference import opus_round_trip
    from harken.edge.client.grpc_client import ClientOptions, TranscriptionClient

    server = await start_server(asr, ServerOptions(host="127.0.0.1", port=0,
                                                   http_port=0 if "webrtc" in paths else None))
    results: dict[str, PathResult] = {}
    try:
        for path in paths:
            t0 = time.monotonic()
            options = ClientOptions(language=language or "")
            audios = [u.audio for u in utterances]
            audio_s = sum(a.size for a in audios) / SAMPLE_RATE
            grpc_client = lambda: TranscriptionClient(server.address, options=options)  # noqa: E731
            if path.startswith("served_features_"):
                options.codec_mode = path.removeprefix("served_features_")
                result = await _served(grpc_client, audios, concurrency)
            elif path == "webrtc":
                from harken.edge.client.webrtc_client import WebRTCTranscriptionClient

                url = f"http://127.0.0.1:{server.http_port}"
                result = await _served(lambda: WebRTCTranscriptionClient(url, options=options), audios, concurrency)
            elif path == "served_audio":
                options.send_audio = True
                result = await _served(grpc_client, audios, concurrency)
                result.payload_bytes, result.speech_s = 2 * sum(a.size for a in audios), audio_s  # PCM16
            else:  # opus_<kbps>
                kbps = int(path.removeprefix("opus_"))
                trips = [opus_round_trip(a, kbps) for a in audios]
                options.send_audio = True
                result = await _served(grpc_client, [t.decoded for t in trips], concurrency)
                result.payload_bytes, result.speech_s = sum(t.payload_bytes for t in trips), audio_s
            result.seconds = time.monotonic() - t0
            results[path] = result
            log(f"{path}: {result.seconds:.1f} s")
    finally:
        await server.stop(grace_s=2.0)
    return results


def bench_wer(options: WerBenchOptions, log=lambda s: None) -> dict:
    """Every path of `options.paths` over the same utterances: the JSON result."""
    import torch

    from harken.cloud.model.asr import Qwen3ASR
    from harken.training.evaluation import wer

    utterances = load_utterances(options.held_set, options.n)
    log(f"{len(utterances)} utterances rendered")
    if not torch.cuda.is_available():
        torch.set_num_threads(1)  # small matmuls on a shared CPU: one thread is fastest
    asr = Qwen3ASR.load(options.model, dtype=options.dtype, device=options.device)
    results: dict[str, PathResult] = {}
    times, finalize_times = StreamTimes(), StreamTimes()
    if "offline" in options.paths:
        t0 = time.monotonic()
        results["offline"] = run_offline(asr, utterances, options.language)
        results["offline"].seconds = time.monotonic() - t0
        log(f"offline: {results['offline'].seconds:.1f} s")
    for path in ("stream", "stream_finalize"):
        if path in options.paths:
            t0 = time.monotonic()
            clock: Clock = WallClock() if options.realtime else AudioClock()
            results[path], measured = run_stream(asr, utterances, options.language, clock, options.stream_policy(),
                                                 finalize=path == "stream_finalize", vad_options=options.vad_options())
            if path == "stream":
                times = measured
            else:
                finalize_times = measured
            results[path].seconds = time.monotonic() - t0
            log(f"{path}: {results[path].seconds:.1f} s")
    served = [p for p in options.paths if p not in ("offline", "stream", "stream_finalize")]
    if served:
        results.update(asyncio.run(run_served(asr, utterances, served, options.language, log, options.concurrency)))

    refs = [u.text for u in utterances]
    out: dict = {"model": options.model, "set": options.held_set, "n_utterances": len(utterances),
                 "n_words": sum(len(r.split()) for r in refs),
                 "audio_s": round(sum(u.audio.size for u in utterances) / SAMPLE_RATE, 2)}
    for path in options.paths:
        r = results[path]
        out[f"wer_{path}"] = round(wer(refs, r.hyps), 4)
        out[f"kbps_{path}"] = None if r.kbps is None else round(r.kbps, 2)
    out.update(latency_summary(times.words, times.churn, times.finals, finalize_times.finalizes))
    out["latency_clock"] = "real-time" if options.realtime else "audio-time"
    policy = options.stream_policy()
    out["stream_policy"] = {"update_interval_s": policy.update_interval_s, "rollback_tokens": policy.rollback_tokens,
                            "agreement": policy.agreement}
    if not policy.intermediate_commits:
        out["stream_policy"]["intermediate_commits"] = False
    if policy.agreement == "confidence":
        out["stream_policy"]["confidence_prob"] = policy.confidence_prob
    if policy.min_token_prob:
        out["stream_policy"]["min_token_prob"] = policy.min_token_prob
    if options.vad_min_silence_ms is not None:
        out["stream_policy"]["vad_min_silence_ms"] = options.vad_min_silence_ms
    out["n_timed_utterances"] = sum(1 for u in utterances if u.words is not None)
    out["concurrency"] = options.concurrency
    out["seconds"] = {p: round(results[p].seconds, 1) for p in options.paths}
    out["errors"] = {p: results[p].errors for p in options.paths if results[p].errors}
    return out


def bench_wer_command(options: WerBenchOptions) -> int:
    result = bench_wer(options, log=lambda s: print(f"bench wer: {s}", file=sys.stderr, flush=True))
    print(json.dumps(result, indent=1))
    return 0
