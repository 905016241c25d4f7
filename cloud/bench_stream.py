"""`harken bench stream`: harken's streaming engine against the Phase-1 baseline, side by side in one run.

Input: the bundled `harken/data/sample.wav` (20 s of speech with pauses) turned into features once
— log-mel (the edge's offline path), floored against the running max as the edge does, and its
silero-vad segments — then tiled in feature space to `seconds` per stream (no TTS or audio
decoding at run time). Stream i starts i/N of the way into the sample, so N streams are not in
lock step. A second input, `continuous`, is the same frames as one unbroken speech segment: there
only the engine's own segment limit (30 s) bounds the work.

Runs, all on the same model instance, driven on audio time: every update interval each stream's
packets of that interval (20 frames each, segment start/end flags as the edge sets them) are
ingested, then the engine steps until no session has work (see `run_engine`):
  batched     all N sessions in one engine: per tick the compute of `Engine.step()`;
  sequential  (N > 1) the same N sessions one at a time, each alone in an engine: its transcripts
              must equal the batched ones (asserted; `transcripts_identical`);
  continuous  one session over the continuous input;
  phase1      `cloud/phase1.py` on stream 0's speech frames (the frames the engine receives, in
              order; the official streaming has no VAD and would re-feed the pauses too, so this
              is the conservative choice), re-feeding everything every `update_interval_s`. Phase 1
              is O(S^2): when its estimated cost exceeds `phase1_max_seconds`, only every K-th
              update is run (each after the output of the last one run) and the total integrated
              with the trapezoid rule (`phase1_method`). With N streams Phase 1's
              total is stream 0's times N (Phase 1 serves one stream at a time, and the streams
              differ only in where the same audio starts).

Compute is thread CPU time with torch on one thread on CPU (robust on a shared machine), wall time
with device synchronisation on CUDA or with more threads (`clock` in the output); with `repeats`
every run is repeated and its fastest repetition counts, on every side alike. Figures:
  update_growth        mean per-update compute over the last 10 s of audio / over the first 10 s
                       (one session alone: stream 0 of the sequential run, or the batched run at N=1)
  continuous_update_growth   the same over the continuous input
  phase1_update_growth the same for Phase 1 (over stream 0's speech time)
  phase1_speedup       Phase-1 total / harken total (batched) for the same N streams
  throughput_rtf       audio seconds served per compute second (batched)
  p50/p95_update_ms    compute of the engine steps that did work (every session in a step waits for it)
  batching_gain        throughput batched / throughput one at a time
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from importlib.resources import files

import numpy as np
import torch

from harken.shared.errors import HarkenError
from harken.shared.features_spec import FRAMES_PER_SECOND, RunningMaxFloor

PACKET_FRAMES = 20  # what the edge sends per packet (200 ms)
GROWTH_WINDOW_S = 10.0  # update_growth compares the first and the last this many seconds


@dataclass(frozen=True)
class StreamBenchOptions:
    model: str = "tiny"
    real_dims: bool = False  # random weights with the 0.6B dimensions instead of `model`
    seconds: float = 60.0
    streams: int = 1
    update_interval_s: float = 2.0
    device: str | None = None
    dtype: str | None = None
    threads: int = 1  # torch intra-op threads on CPU
    repeats: int = 1  # each measured run this many times, the fastest counts (all sides alike)
    phase1_max_seconds: float = 600.0  # above this estimated Phase-1 compute, sample its updates
    continuous: bool = True  # also measure the continuous-speech session
    language: str | None = None  # forced on every side (the tiny checkpoint writes text only then)


# --- input ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class BenchStream:
    """One stream: floored raw log10-mel frames (silence included) and its speech segments."""

    log10_mel: np.ndarray  # [128, T] floored against the running max, not yet (x + 4) / 4
    segments: list[tuple[int, int]]  # [start, end) frames of each speech segment, in order

    @property
    def frames(self) -> int:
        return int(self.log10_mel.shape[1])

    def features(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Normalised features [128, k] as the model reads them."""
        return ((self.log10_mel[:, start:stop] + 4.0) / 4.0).astype(np.float32)

    def speech_features(self) -> np.ndarray:
        """All speech frames in order: what the engine receives over the whole stream."""
        return np.concatenate([self.features(s, e) for s, e in self.segments], axis=1)

    @property
    def speech_frames(self) -> int:
        return sum(e - s for s, e in self.segments)


def sample_features() -> tuple[np.ndarray, list[tuple[int, int]]]:
    """The bundled sample: raw log10-mel [128, T] and its VAD segments in frames."""
    from harken.edge.audio import load_audio
    from harken.edge.features import log_mel_raw
    from harken.edge.vad import get_speech_timestamps

    audio = load_audio(str(files("harken") / "data" / "sample.wav"))
    raw = log_mel_raw(audio)
    hop = 16_000 // FRAMES_PER_SECOND
    segments = [(s.start_sample // hop, min(raw.shape[1], -(-s.end_sample // hop)))
                for s in get_speech_timestamps(audio)]
    return raw, segments


def tiled_stream(raw: np.ndarray, segments: list[tuple[int, int]], frames: int, offset: int = 0,
                 continuous: bool = False) -> BenchStream:
    """`frames` frames of the sample repeated, starting `offset` frames in, floored against the
    running max from the first frame on. Segments are the sample's, shifted and clipped; with
    `continuous` the whole stream is one segment."""
    period = raw.shape[1]
    idx = (np.arange(frames) + offset) % period
    floored = RunningMaxFloor()(raw[:, idx])
    if continuous:
        return BenchStream(floored, [(0, frames)])
    spans = []
    for k in range(-1, frames // period + 2):
        for s, e in segments:
            s, e = max(0, s + k * period - offset), min(frames, e + k * period - offset)
            if e - s >= PACKET_FRAMES:  # clipping can leave a sliver the VAD would never send
                spans.append((s, e))
    return BenchStream(floored, sorted(spans))


def bench_streams(seconds: float, n: int) -> tuple[list[BenchStream], BenchStream]:
    """N tiled streams (stream i starts i/N into the sample) and the continuous stream."""
    raw, segments = sample_features()
    frames = int(round(seconds * FRAMES_PER_SECOND))
    period = raw.shape[1]
    streams = [tiled_stream(raw, segments, frames, offset=i * period // n) for i in range(n)]
    return streams, tiled_stream(raw, segments, frames, continuous=True)


# --- clocks and statistics ------------------------------------------------------------------------

class ComputeClock:
    """Thread CPU time (CPU, one torch thread) or synchronised wall time (CUDA)."""

    def __init__(self, device: torch.device, threads: int):
        self.cuda = device.type == "cuda"
        self.name = "wall" if self.cuda or threads != 1 else "thread_cpu"

    def now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
            return time.perf_counter()
        return time.thread_time() if self.name == "thread_cpu" else time.perf_counter()


def update_growth(updates: list[tuple[float, float]], seconds: float,
                  window_s: float = GROWTH_WINDOW_S) -> float | None:
    """updates: (audio time in s, compute in s). Mean compute of the updates in the last
    `window_s` of audio / in the first `window_s`."""
    first = [c for t, c in updates if t <= window_s]
    last = [c for t, c in updates if t > seconds - window_s]
    if not first or not last or sum(first) == 0:
        return None
    return (sum(last) / len(last)) / (sum(first) / len(first))


def integrate_sampled(indices: list[int], costs: list[float]) -> float:
    """Estimated sum of c(i) over i = indices[0]..indices[-1] from samples at `indices` (sorted):
    the trapezoid integral plus half the end points (exact for a linear c)."""
    if len(indices) == 1:
        return costs[0]
    total = sum((costs[j] + costs[j + 1]) / 2 * (indices[j + 1] - indices[j]) for j in range(len(indices) - 1))
    return total + (costs[0] + costs[-1]) / 2


def percentile_ms(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)) * 1000, 3) if values else None


# --- Phase 1 --------------------------------------------------------------------------------------

@dataclass
class Phase1Run:
    total_s: float
    method: str
    updates: int  # updates a full run makes
    measured: list[tuple[int, float, float]] = field(default_factory=list)  # (update, audio s, compute s)
    new_tokens: list[int] = field(default_factory=list)  # tokens generated by each measured update


def run_phase1(asr, stream: BenchStream, opts: StreamBenchOptions, clock: ComputeClock) -> Phase1Run:
    """Stream 0's speech frames through Phase 1, fully or every K-th update (see module doc)."""
    from harken.cloud.model.prompt import forced_language
    from harken.cloud.phase1 import Phase1Options, Phase1Stream, phase1_decode

    p1 = Phase1Options(update_interval_s=opts.update_interval_s, language=opts.language)
    feats = stream.speech_features()
    step = p1.update_frames
    ends = list(range(step, feats.shape[1] + 1, step))
    if not ends or ends[-1] != feats.shape[1]:
        ends.append(feats.shape[1])  # finish(): the tail
    n = len(ends)

    # cost estimate from the most expensive update (the last), run once with no prefix
    t0 = clock.now()
    phase1_decode(asr, feats, [], p1.max_new_tokens, forced_language(p1.language))
    last_cost = clock.now() - t0
    every = max(1, math.ceil(n * last_cost / 2 / opts.phase1_max_seconds)) if opts.phase1_max_seconds > 0 else 1

    p = Phase1Stream(asr, p1)
    run = Phase1Run(0.0, "full" if every == 1 else f"sampled every {every} updates", n)
    for i in sorted(set(range(0, n, every)) | {n - 1}):
        p.append(feats[:, p.frames:ends[i]])
        t0 = clock.now()
        u = p.update(ends[i], index=i)  # after the last update run: its output is the prefix
        dt = clock.now() - t0
        run.measured.append((i, ends[i] / FRAMES_PER_SECOND, dt))
        run.new_tokens.append(len(u.new_ids))
    idx, costs = [i for i, _, _ in run.measured], [c for _, _, c in run.measured]
    run.total_s = sum(costs) if every == 1 else integrate_sampled(idx, costs)
    return run


# --- the model ------------------------------------------------------------------------------------

def load_model(opts: StreamBenchOptions):
    """`opts.model` loaded, or (`real_dims`) random weights with the released 0.6B dimensions and
    the tiny checkpoint's tokenizer (the same token ids)."""
    from harken.cloud.model.asr import Qwen3ASR
    from harken.cloud.model.checkpoint import resolve_device, resolve_dtype

    if not opts.real_dims:
        return Qwen3ASR.load(opts.model, dtype=opts.dtype, device=opts.device)
    from harken.cloud.model.config import AudioEncoderConfig, Qwen3ASRConfig, TextDecoderConfig
    from harken.cloud.model.decoder import Qwen3Decoder
    from harken.cloud.model.encoder import AudioEncoder
    from harken.cloud.model.tiny import ensure_tiny_model
    from harken.cloud.model.tokenizer import Tokenizer

    dev = resolve_device(opts.device)
    dt = resolve_dtype(opts.dtype, dev)
    cfg = Qwen3ASRConfig(audio=AudioEncoderConfig(), text=TextDecoderConfig())
    torch.manual_seed(0)
    with torch.device(dev):
        encoder = AudioEncoder(cfg.audio).to(dt)
        decoder = Qwen3Decoder(cfg.text, tie_word_embeddings=cfg.tie_word_embeddings).to(dt)
    return Qwen3ASR(cfg, encoder, decoder, Tokenizer.from_dir(ensure_tiny_model()))


# --- harken's engine ------------------------------------------------------------------------------

@dataclass
class EngineRun:
    total_s: float = 0.0  # compute of every ingest and step
    steps: list[tuple[float, float, int]] = field(default_factory=list)  # (audio s, compute s, sessions served)
    per_session: list[list[tuple[float, float]]] = field(default_factory=list)  # (audio s, attributed compute s)
    events: list[list[dict]] = field(default_factory=list)  # each session's events, in order

    def texts(self) -> list[str]:
        return ["".join(e["committed_delta"] for e in evs) for evs in self.events]


def packets_between(stream: BenchStream, lo: int, hi: int) -> list[tuple[int, int, int, bool, bool]]:
    """The edge's packets (20-frame grid) for frames [lo, hi): (segment id, first frame, stop
    frame, segment start, segment end)."""
    out = []
    for sid, (s, e) in enumerate(stream.segments):
        for p in range(max(s, lo) // PACKET_FRAMES * PACKET_FRAMES, min(e, hi), PACKET_FRAMES):
            a, b = max(s, lo, p), min(e, hi, p + PACKET_FRAMES)
            if a < b:
                out.append((sid, a, b, a == s, b == e))
    return out


def run_engine(asr, streams: list[BenchStream], opts: StreamBenchOptions, clock: ComputeClock) -> EngineRun:
    """All `streams` as sessions of one engine, fed on audio time in rounds of one update interval
    (each round: every stream's packets of that interval, then engine steps until no session has
    work). A round is what a busy server accumulates between ticks; with 200-ms rounds sessions
    whose items started at different times would rarely be due in the same tick."""
    from harken.cloud.commit import CommitPolicy
    from harken.cloud.scheduler import Engine, EngineConfig
    from harken.cloud.session import SessionOptions

    policy = CommitPolicy(update_interval_s=opts.update_interval_s)
    n = len(streams)
    engine = Engine(asr, EngineConfig(max_sessions=n, max_batch=max(32, n), slot_policy=policy))
    sids = [engine.open_session(SessionOptions(language=opts.language, policy=policy)) for _ in streams]
    index = {sid: i for i, sid in enumerate(sids)}
    run = EngineRun(per_session=[[] for _ in streams], events=[[] for _ in streams])
    total = max(s.frames for s in streams)
    step = max(PACKET_FRAMES, round(opts.update_interval_s * FRAMES_PER_SECOND))
    for lo in range(0, total, step):
        audio_s = min(lo + step, total) / FRAMES_PER_SECOND
        t0 = clock.now()
        for sid, stream in zip(sids, streams):
            for seg, a, b, start, end in packets_between(stream, lo, lo + step):
                engine.ingest(sid, seg, a, stream.log10_mel[:, a:b], start, end)
        run.total_s += clock.now() - t0
        while engine.has_work():
            served = [i for i, sid in enumerate(sids) if engine.session(sid).has_work()]
            t0 = clock.now()
            events = engine.step()
            dt = clock.now() - t0
            run.total_s += dt
            run.steps.append((audio_s, dt, len(served)))
            for i in served:
                run.per_session[i].append((audio_s, dt / len(served)))
            for sid, event in events:
                run.events[index[sid]].append(event.as_dict())
    for sid in sids:
        engine.close_session(sid)
    return run


# --- the benchmark --------------------------------------------------------------------------------

def bench_stream(opts: StreamBenchOptions) -> dict:
    """Run the benchmark (see the module docstring); returns the JSON object's dict."""
    if opts.seconds <= 0 or opts.streams < 1 or opts.update_interval_s <= 0:
        raise HarkenError("--seconds must be > 0, --streams >= 1 and --update-interval > 0")
    threads = torch.get_num_threads()
    try:
        return _bench_stream(opts)
    finally:
        torch.set_num_threads(threads)  # the caller's setting (a test process, say) is left as it was


def _bench_stream(opts: StreamBenchOptions) -> dict:
    wall0 = time.perf_counter()
    asr = load_model(opts)
    if asr.device.type == "cpu":
        torch.set_num_threads(opts.threads)
    clock = ComputeClock(asr.device, torch.get_num_threads() if asr.device.type == "cpu" else 0)
    streams, continuous = bench_streams(opts.seconds, opts.streams)
    n, seconds = opts.streams, streams[0].frames / FRAMES_PER_SECOND
    # first calls pay one-off costs (allocator, kernel selection): keep them out of either side
    warm = BenchStream(streams[0].log10_mel[:, :4 * FRAMES_PER_SECOND], [(0, 4 * FRAMES_PER_SECOND)])
    run_engine(asr, [warm], opts, clock)
    run_phase1(asr, warm, opts, clock)

    batched = fastest(lambda: run_engine(asr, streams, opts, clock), opts.repeats)
    result: dict = {
        "model": "random-0.6b-dims" if opts.real_dims else opts.model,
        "device": str(asr.device), "dtype": str(asr.dtype).replace("torch.", ""),
        "clock": clock.name, "threads": torch.get_num_threads() if asr.device.type == "cpu" else None,
        "input": "harken/data/sample.wav tiled in feature space; VAD segments of the sample",
        "seconds": round(seconds, 2), "streams": n, "update_interval_s": opts.update_interval_s,
        "repeats": max(1, opts.repeats), "language": opts.language,
        "speech_fraction": round(sum(s.speech_frames for s in streams) / sum(s.frames for s in streams), 3),
        "harken_total_s": round(batched.total_s, 4),
        "harken_updates": sum(len(p) for p in batched.per_session),
    }
    if n > 1:
        alone = [fastest(lambda s=s: run_engine(asr, [s], opts, clock), opts.repeats) for s in streams]
        sequential_s = sum(r.total_s for r in alone)
        identical = [r.events[0] for r in alone] == batched.events
        if not identical:
            raise AssertionError("batched sessions produced other events than the same sessions one at a time")
        growth_updates = alone[0].per_session[0]
    else:
        growth_updates = batched.per_session[0]
    result["update_growth"] = _round(update_growth(growth_updates, seconds))
    if opts.continuous:
        cont = fastest(lambda: run_engine(asr, [continuous], opts, clock), opts.repeats)
        result["continuous_update_growth"] = _round(update_growth(cont.per_session[0], seconds))
        result["continuous_total_s"] = round(cont.total_s, 4)

    p1 = fastest(lambda: run_phase1(asr, streams[0], opts, clock), opts.repeats)
    phase1_total = p1.total_s * n
    result.update({
        "phase1_total_s": round(phase1_total, 4),
        "phase1_method": p1.method,
        "phase1_updates": p1.updates,
        "phase1_streams_measured": 1,
        "phase1_new_tokens_mean": _round(float(np.mean(p1.new_tokens)), 2),
        "phase1_update_growth": _round(update_growth([(t, c) for _, t, c in p1.measured],
                                                     p1.measured[-1][1])),
        "phase1_speedup": _round(phase1_total / batched.total_s),
        "throughput_rtf": _round(n * seconds / batched.total_s),
        "p50_update_ms": percentile_ms([dt for _, dt, _ in batched.steps], 50),
        "p95_update_ms": percentile_ms([dt for _, dt, _ in batched.steps], 95),
    })
    if n > 1:
        result.update({
            "sequential_total_s": round(sequential_s, 4),
            "batching_gain": _round(sequential_s / batched.total_s),
            "transcripts_identical": identical,
            "phase1_speedup_unbatched": _round(phase1_total / sequential_s),
        })
    else:
        result.update({"batching_gain": None, "transcripts_identical": None})
    result["transcript_chars"] = [len(t) for t in batched.texts()]
    result["bench_wall_s"] = round(time.perf_counter() - wall0, 1)
    return result


def fastest(run, repeats: int):
    """The run with the least total compute of `repeats` (runs are deterministic: only the time differs)."""
    return min((run() for _ in range(max(1, repeats))), key=lambda r: r.total_s)


def _round(x: float | None, digits: int = 3) -> float | None:
    return None if x is None else round(x, digits)


def bench_stream_command(opts: StreamBenchOptions) -> int:
    print(json.dumps(bench_stream(opts)))
    return 0
