"""`harken bench engine-load`: how many live streams one engine serves, paced in real time.

The serving engine (cloud/inference/engine.py) driven directly — no gRPC, no client processes, whose own
edge work would bound the figure on a 16-core machine before the GPU does. One model (by default
random weights with the released Qwen3-ASR-0.6B dimensions, bf16 on CUDA), one engine whose KV
cache holds the largest level's sessions, and a ladder of levels N = 1, 8, 16, 64, 128, 256, 512
(then 1.5x more while the p95 holds and the cache has room). In each level:

- N streams are the bundled sample's features (harken/data/sample.wav: log-mel and its VAD
  segments, computed once; the edge's packets precomputed as decoded frames, so the codec's
  decoding is not in the figures), tiled to `seconds`; stream i starts i/N into the sample and
  i/N of an update interval after the level's start, so the streams are not in lock step.
- A feeder thread hands every stream its 200-ms packets (speech only, as the edge sends them) when
  their last frame would have been captured: real time. The main thread steps the engine whenever
  it has work, as the server's scheduler does.
- After the last packet the engine gets `drain_s` to finish; sessions still owed work then are
  `undrained` (the engine fell behind).

Figures of a level (ms, over the events of all streams; `sent(t)`: when the packet holding stream
time t was ingested):
  p50/p95_update_ms         arrival of a non-final event - sent(event.end_s)
  p50/p95_first_partial_ms  a segment's first event, when it is a partial: arrival -
                            sent(event.end_s) (the wait for its first update's audio, one update
                            interval, is not in it; segments shorter than that have no partial)
  p50_first_partial_from_onset_ms   the same from sent(segment onset): what a user waits
  p50/p95_final_ms          a final event: arrival - sent(event.end_s)
  busy_fraction             the engine's busy wall time in `step` / the level's wall time
  gpu_s_per_stream_hour     busy seconds per stream-hour of audio served at this N
  batching_gain             (busy s per stream-second at the smallest level, N = 1 by default:
                            `batching_gain_base_streams`) / (the same at N)
  sessions_per_tick         mean sessions served per engine tick (the batch the GPU sees)
  peak_mib, mib_per_stream  peak device memory during the level; (the KV slot + the level's peak
                            above the idle engine / N) per stream (CUDA only)
  feeder_max_lag_ms         the latest a packet was ingested after its due time (the driver kept up)
  ok                        p95 update <= target (300 ms), nothing undrained, feeder lag < 100 ms
Top level: max_streams_ok (the largest N that was ok), gpu_s_per_stream_hour_at_max (3600 / that
N: the GPU's cost per stream-hour when full), and `cut`: levels not run and why (time budget,
an earlier level failing, the KV cache's capacity).

A hard time budget (`time_budget_s`) bounds the ladder: a level that would not finish inside it
is not started (stated in `cut`). Writes `engine-load.json` and `engine-load.png` (streams vs p95
update latency) into `out_dir` when given, and prints the JSON. The JSON is rewritten after every
level and the plot drawn before the profile, so a run killed at its caller's cap (or a profile
that fails: `profile_error`) keeps the levels that ran.
"""

from __future__ import annotations

import bisect
import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from harken.bench.engine_load_plot import plot
from harken.shared.errors import HarkenError
from harken.shared.features_spec import FRAMES_PER_SECOND

DEFAULT_LEVELS = (1, 8, 16, 64, 128, 256, 512)
TARGET_P95_MS = 300.0
MAX_FEEDER_LAG_MS = 100.0
GROW = 1.5  # past the listed levels, N grows by this factor while it holds


@dataclass(frozen=True)
class EngineLoadOptions:
    levels: tuple[int, ...] = DEFAULT_LEVELS
    more: bool = True  # past the listed levels while the p95 holds and the cache has room
    keep_going: bool = False  # run the listed levels after one that did not hold (default: cut them)
    seconds: float = 10.0  # audio per stream per level
    model: str = "real-dims"  # "real-dims" (random weights, 0.6B dims) or a checkpoint (--model)
    device: str | None = None
    dtype: str | None = None
    decode_step: str | None = None  # plain / static / graphs (default: graphs on CUDA, plain on CPU)
    max_batch: int = 256
    update_interval_s: float = 1.0  # the server default
    drain_s: float = 3.0
    target_p95_ms: float = TARGET_P95_MS
    time_budget_s: float = 150.0  # the whole run, model and warm-up included
    memory_headroom_gib: float = 8.0  # device memory left free when sizing the KV cache (CUDA)
    max_streams: int = 2048  # never more sessions than this, whatever fits
    profile_s: float = 3.0  # then this much audio at the largest level under torch.profiler (0: none)
    threads: int | None = None  # torch CPU threads (CPU only)
    out_dir: str | None = None


# --- input ----------------------------------------------------------------------------------------

def sample_features() -> tuple[np.ndarray, list[tuple[int, int]]]:
    """lab/bench/stream.py's input (the bundled sample: raw log10-mel and its VAD segments in frames),
    read with the standard library's wave module where soundfile is missing (the device image)."""
    try:
        import soundfile  # noqa: F401
    except ImportError:
        pass
    else:
        from harken.bench.stream import sample_features as with_soundfile

        return with_soundfile()
    import wave
    from importlib.resources import files

    from harken.edge.features import log_mel_raw
    from harken.edge.vad import get_speech_timestamps

    with wave.open(str(files("harken") / "data" / "sample.wav"), "rb") as w:
        if w.getsampwidth() != 2 or w.getframerate() != 16_000:
            raise HarkenError("sample.wav: expected 16-bit PCM at 16 kHz")
        pcm = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2").reshape(-1, w.getnchannels())
    audio = np.ascontiguousarray((pcm.astype(np.float32) / 32768.0).mean(axis=1, dtype=np.float32))
    raw = log_mel_raw(audio)
    hop = 16_000 // FRAMES_PER_SECOND
    segments = [(s.start_sample // hop, min(raw.shape[1], -(-s.end_sample // hop)))
                for s in get_speech_timestamps(audio)]
    return raw, segments


@dataclass
class Packet:
    due: float  # seconds after the level's start
    stream: int
    args: tuple  # Engine.ingest's (segment_id, first_frame, frames, segment_start, segment_end)
    stop_frame: int


def level_packets(raw: np.ndarray, segments: list[tuple[int, int]], n: int, seconds: float,
                  stagger_s: float) -> list[Packet]:
    """Every packet of n streams, in due order."""
    from harken.bench.stream import PACKET_FRAMES, packets_between, tiled_stream

    frames = int(round(seconds * FRAMES_PER_SECOND))
    period = raw.shape[1]
    out = []
    for i in range(n):
        stream = tiled_stream(raw, segments, frames, offset=i * period // n)
        delay = stagger_s * i / n
        for seg, a, b, start, end in packets_between(stream, 0, frames):
            # the edge sends a packet when its 20-frame slot is complete (the segment's end sooner)
            due = delay + min(-(-b // PACKET_FRAMES) * PACKET_FRAMES, frames) / FRAMES_PER_SECOND
            if end:
                due = delay + b / FRAMES_PER_SECOND
            out.append(Packet(due, i, (seg, a, stream.log10_mel[:, a:b], start, end), b))
    out.sort(key=lambda p: p.due)
    return out


# --- one level ------------------------------------------------------------------------------------

@dataclass
class LevelRun:
    streams: int
    wall_s: float = 0.0
    busy_s: float = 0.0
    ticks: int = 0
    update_ms: list[float] = field(default_factory=list)
    final_ms: list[float] = field(default_factory=list)
    first_ms: list[float] = field(default_factory=list)
    first_onset_ms: list[float] = field(default_factory=list)
    feeder_max_lag_ms: float = 0.0
    undrained: int = 0
    decoded_tokens: int = 0
    peak_mib: float | None = None
    above_idle_mib: float | None = None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_level(engine, packets: list[Packet], n: int, seconds: float, drain_s: float,
              language: str | None) -> LevelRun:
    """One level on `engine` (no sessions open): feed in real time, step, collect latencies."""
    from harken.cloud.inference.decoder_stream import SessionOptions

    device = engine.asr.device
    policy = engine.config.slot_policy
    sids = [engine.open_session(SessionOptions(language=language, policy=policy)) for _ in range(n)]
    index = {sid: i for i, sid in enumerate(sids)}
    sent_stop: list[list[int]] = [[] for _ in range(n)]  # per stream: stop frames ingested, in order
    sent_at: list[list[float]] = [[] for _ in range(n)]  # ... and when
    onsets: list[dict[int, float]] = [{} for _ in range(n)]  # segment id -> when its first packet went in
    run = LevelRun(n)
    lock = threading.Lock()
    done = threading.Event()
    feed_error: list[BaseException] = []
    busy0, tokens0 = engine.busy_s, engine.decoded_tokens
    if device.type == "cuda":
        _sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        idle = torch.cuda.memory_allocated(device)
    t0 = time.perf_counter() + 0.05

    def feed():
        try:
            for p in packets:
                wait = t0 + p.due - time.perf_counter()
                if wait > 0:
                    time.sleep(wait)
                engine.ingest(sids[p.stream], *p.args)
                now = time.perf_counter()
                with lock:
                    run.feeder_max_lag_ms = max(run.feeder_max_lag_ms, (now - t0 - p.due) * 1000)
                    sent_stop[p.stream].append(p.stop_frame)
                    sent_at[p.stream].append(now)
                    if p.args[3]:
                        onsets[p.stream][p.args[0]] = now
        except BaseException as e:  # noqa: BLE001 - raised again in the engine's thread
            feed_error.append(e)
        finally:
            done.set()

    def sent(i: int, t_s: float) -> float:
        frame = int(round(t_s * FRAMES_PER_SECOND))
        with lock:
            k = bisect.bisect_left(sent_stop[i], frame)
            return sent_at[i][min(k, len(sent_at[i]) - 1)]

    feeder = threading.Thread(target=feed, name="engine-load-feeder", daemon=True)
    seen: set[tuple[int, int]] = set()
    feeder.start()
    deadline = None
    while True:
        if done.is_set() and deadline is None:
            deadline = time.perf_counter() + drain_s
        if deadline is not None and (time.perf_counter() > deadline or not engine.has_work()):
            if not engine.has_work():
                break
            run.undrained = sum(1 for sid in sids if engine.working_on(sid))
            break
        if not engine.has_work():
            time.sleep(0.001)
            continue
        events = engine.step()
        now = time.perf_counter()
        run.ticks += 1
        for sid, e in events:
            i = index[sid]
            ms = (now - sent(i, e.end_s)) * 1000
            (run.final_ms if e.is_final else run.update_ms).append(ms)
            if (i, e.segment_id) not in seen:
                seen.add((i, e.segment_id))
                onset = onsets[i].get(e.segment_id)
                if not e.is_final:  # a segment shorter than an update interval has no partial
                    run.first_ms.append(ms)
                    if onset is not None:
                        run.first_onset_ms.append((now - onset) * 1000)
    feeder.join()
    if feed_error:
        raise feed_error[0]
    run.wall_s = time.perf_counter() - t0
    run.busy_s = engine.busy_s - busy0
    run.decoded_tokens = engine.decoded_tokens - tokens0
    if device.type == "cuda":
        run.peak_mib = torch.cuda.max_memory_allocated(device) / 2**20
        run.above_idle_mib = (torch.cuda.max_memory_allocated(device) - idle) / 2**20
    for sid in sids:
        engine.close_session(sid)
    while engine.has_work():  # sessions closed mid-pass finish it (their slots come back)
        engine.step()
    return run


PROFILE_MAX_STREAMS = 64


def profile_streams(levels: list[dict]) -> int | None:
    """The level to profile: the largest that ran with nothing undrained, capped at
    PROFILE_MAX_STREAMS; the smallest that ran when none kept up; None when none ran."""
    if not levels:
        return None
    kept = [lv["streams"] for lv in levels if lv["undrained"] == 0 and lv["streams"] <= PROFILE_MAX_STREAMS]
    return max(kept) if kept else min(lv["streams"] for lv in levels)


# the engine's phases, timed by the profiler as labelled ranges (inclusive CPU time of the engine's
# thread; on CUDA that includes waiting for the device where a phase reads results back)
_PHASES = {"plan": "_plan", "encode": "_encode", "prompts": "_prompts", "decode_step": "_decode_step",
           "finish": "_finish"}


def profile_level(engine, packets: list[Packet], n: int, seconds: float, language: str | None) -> dict:
    """A short paced run at N streams under torch.profiler: the engine's phases (labelled ranges),
    the device's kernel time against the engine's busy time (a low share means Python and kernel
    launches, not the GPU, bound the tick), and the top operators."""
    import functools

    import harken.cloud.inference.engine as engine_module
    from torch.profiler import ProfilerActivity, profile, record_function

    def labelled(name, fn):
        @functools.wraps(fn)
        def run(*args, **kwargs):
            with record_function(f"engine.{name}"):
                return fn(*args, **kwargs)
        return run

    cuda = engine.asr.device.type == "cuda"
    saved_prefill = engine_module.prefill
    for name, attr in _PHASES.items():
        setattr(engine, attr, labelled(name, getattr(engine, attr)))
    engine_module.prefill = labelled("prefill", saved_prefill)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    t = time.perf_counter()
    try:
        with profile(activities=activities) as prof:
            run = run_level(engine, packets, n, seconds, drain_s=1.0, language=language)
    finally:
        engine_module.prefill = saved_prefill
        for attr in _PHASES.values():
            engine.__dict__.pop(attr, None)  # the class's methods again
    traced_s = time.perf_counter() - t
    events = prof.key_averages()

    def device_us(e) -> float:
        return float(getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0)) or 0)

    phases = {e.key.removeprefix("engine."): {"calls": e.count, "cpu_ms": round(e.cpu_time_total / 1000, 1)}
              for e in events if e.key.startswith("engine.")}
    kernel_s = sum(device_us(e) for e in events) / 1e6 if cuda else None
    rank = device_us if cuda else (lambda e: e.self_cpu_time_total)
    top = sorted((e for e in events if not e.key.startswith("engine.")), key=rank, reverse=True)[:12]
    return {
        "streams": n, "seconds": seconds, "wall_s": round(run.wall_s, 2), "engine_busy_s": round(run.busy_s, 3),
        "p95_update_ms_under_profiler": _pct(run.update_ms, 95),
        "device_kernel_s": None if kernel_s is None else round(kernel_s, 3),
        "device_share_of_busy": None if kernel_s is None or not run.busy_s else round(kernel_s / run.busy_s, 3),
        "phases": phases,
        "top_ops": [{"op": e.key, "calls": e.count, "self_cpu_ms": round(e.self_cpu_time_total / 1000, 1),
                     "self_device_ms": round(device_us(e) / 1000, 1) if cuda else None} for e in top],
        "profiler_wall_s": round(traced_s, 1),
    }


class _TickCounter:
    """EngineObserver: sessions per tick."""

    def __init__(self):
        self.ticks = 0
        self.sessions = 0

    def tick(self, sessions: int) -> None:
        self.ticks += 1
        self.sessions += sessions

    def truncated(self, reason: str) -> None: ...  # the rest of EngineObserver: not counted here

    def deferred(self) -> None: ...

    def failed(self, error: BaseException) -> None: ...


def _pct(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)), 1) if values else None


# --- the ladder -----------------------------------------------------------------------------------

def load_model(opts: EngineLoadOptions):
    from harken.bench.stream import StreamBenchOptions
    from harken.bench.stream import load_model as stream_model

    real = opts.model == "real-dims"
    return stream_model(StreamBenchOptions(model="tiny" if real else opts.model, real_dims=real,
                                           device=opts.device, dtype=opts.dtype))


def forced_language(opts: EngineLoadOptions, asr) -> str | None:
    """English for random weights (the tiny checkpoints and the 0.6B dims): unforced, a random model
    never writes `<asr_text>`, so its text stays in the language header and no partial is ever sent
    (the first GPU run measured 0 updates at every level that way). None (detect) for a trained model."""
    return "English" if opts.model == "real-dims" or asr.describe()["test_model"] else None


def kv_slot_bytes(asr, slot_len: int) -> int:
    t = asr.config.text
    return 2 * t.num_hidden_layers * t.num_key_value_heads * t.head_dim * slot_len * asr.dtype.itemsize


def run_info(device: torch.device) -> dict:
    info: dict = {"torch": torch.__version__, "cuda": torch.version.cuda, "device_kind": device.type}
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        info.update(gpu=p.name, gpu_memory_gib=round(p.total_memory / 2**30, 1), multiprocessors=p.multi_processor_count)
    else:
        info.update(gpu=None, cpu_threads=torch.get_num_threads())
    return info


def bench_engine_load(opts: EngineLoadOptions) -> dict:
    if opts.seconds <= 0 or not opts.levels or min(opts.levels) < 1 or opts.max_batch < 1:
        raise HarkenError("--seconds must be > 0, --streams a list of N >= 1, --max-batch >= 1")
    threads = torch.get_num_threads()
    try:
        return _bench(opts)
    finally:
        torch.set_num_threads(threads)


def _bench(opts: EngineLoadOptions) -> dict:
    from harken.cloud.inference.commit import CommitPolicy
    from harken.cloud.inference.engine import Engine, EngineConfig, slot_tokens

    wall0 = time.perf_counter()
    asr = load_model(opts)
    dev = asr.device
    if dev.type == "cpu" and opts.threads:
        torch.set_num_threads(opts.threads)
    decode = opts.decode_step or ("graphs" if dev.type == "cuda" else "plain")
    policy = CommitPolicy(update_interval_s=opts.update_interval_s)
    slot_len = slot_tokens(policy)
    slot_bytes = kv_slot_bytes(asr, slot_len)
    wanted = sorted(set(opts.levels))
    capacity = min(opts.max_streams, max(wanted))  # on a CPU: the listed levels only
    if dev.type == "cuda":
        capacity = opts.max_streams
        _sync(dev)
        free, _ = torch.cuda.mem_get_info(dev)
        capacity = min(capacity, int((free - opts.memory_headroom_gib * 2**30) // slot_bytes) - 1)
    if capacity < 1:
        raise HarkenError(f"no room for one KV slot of {slot_bytes / 2**20:.0f} MiB")
    top = max(wanted)
    if opts.more:
        top = max(top, min(capacity, opts.max_streams))
    sessions = max(1, min(top, capacity))
    ticks = _TickCounter()
    engine = Engine(asr, EngineConfig(max_sessions=sessions, max_batch=min(opts.max_batch, sessions),
                                      max_queued_frames=10**9, slot_policy=policy, decode_step=decode),
                    observer=ticks)
    language = forced_language(opts, asr)
    raw, segments = sample_features()
    result: dict = {
        "bench": "engine-load", **run_info(dev),
        "model": "random-0.6b-dims" if opts.model == "real-dims" else opts.model,
        "dtype": str(asr.dtype).removeprefix("torch."), "decode_step": decode,
        "max_batch": engine.config.max_batch, "update_interval_s": opts.update_interval_s,
        "seconds_per_level": opts.seconds, "drain_s": opts.drain_s, "target_p95_update_ms": opts.target_p95_ms,
        "input": "harken/data/sample.wav's log-mel and VAD segments, tiled; packets as decoded frames",
        "kv_slot_tokens": slot_len, "kv_mib_per_stream": round(slot_bytes / 2**20, 2),
        "kv_capacity_streams": capacity, "engine_sessions": sessions,
    }

    # warm-up, untimed: kernels, the allocator, every CUDA graph bucket
    t = time.perf_counter()
    result["graphs_captured"] = engine.capture_decode_graphs()
    result["graph_capture_s"] = round(time.perf_counter() - t, 2)
    t = time.perf_counter()
    warm_n = min(sessions, engine.config.max_batch, 64)
    warm_s = min(3.0, opts.seconds / 2)
    warm_packets = level_packets(raw, segments, warm_n, warm_s, 0.0)
    for p in warm_packets:
        p.due = 0.0  # all at once: the warm-up is not paced
    run_level(engine, warm_packets, warm_n, warm_s, drain_s=60.0, language=language)
    result["warmup_s"] = round(time.perf_counter() - t, 2)

    levels: list[dict] = []
    cut: list[dict] = []

    def save(result: dict, levels: list[dict], cut: list[dict], with_plot: bool = False) -> None:
        """The top-level figures of the levels so far into `result`, and (with `out_dir`) the JSON
        (and the plot) written now: a run killed later keeps them."""
        ok_levels = [lv["streams"] for lv in levels if lv["ok"]]
        best = max(ok_levels) if ok_levels else None
        result.update({
            "levels": levels, "cut": cut, "batching_gain_base_streams": min(wanted),
            "max_streams_ok": best,
            "gpu_s_per_stream_hour_at_max": round(3600 / best, 2) if best else None,
            "bench_wall_s": round(time.perf_counter() - wall0, 1),
        })
        if opts.out_dir:
            out = Path(opts.out_dir)
            out.mkdir(parents=True, exist_ok=True)
            if with_plot:
                result["plot"] = plot(result, out / "engine-load.png")
            tmp = out / "engine-load.json.tmp"
            tmp.write_text(json.dumps(result, indent=1) + "\n")
            tmp.replace(out / "engine-load.json")  # whole or not at all, whenever the kill comes
    queue = [n for n in wanted if n <= sessions]
    cut += [{"streams": n, "why": f"over the KV cache's capacity ({capacity} streams)"} for n in wanted if n > sessions]
    base = None  # busy s per stream-second at the smallest level
    failed_at = None
    while queue:
        n = queue.pop(0)
        if failed_at is not None and not opts.keep_going:
            cut.append({"streams": n, "why": f"N = {failed_at} did not hold"})
            continue
        need = opts.seconds + 1.0 + opts.drain_s + 2.0
        if n not in wanted and opts.profile_s > 0:  # a level past the list does not take the profile's time
            need += opts.profile_s + 15.0
        if time.perf_counter() - wall0 + need > opts.time_budget_s:
            cut.append({"streams": n, "why": f"the time budget ({opts.time_budget_s:.0f} s)"})
            continue
        packets = level_packets(raw, segments, n, opts.seconds, stagger_s=opts.update_interval_s)
        ticks.ticks = ticks.sessions = 0
        run = run_level(engine, packets, n, opts.seconds, opts.drain_s, language)
        per_stream_s = run.busy_s / (n * opts.seconds)
        if base is None and n == min(wanted):
            base = per_stream_s
        p95 = _pct(run.update_ms, 95)
        ok = (p95 is not None and p95 <= opts.target_p95_ms and run.undrained == 0
              and run.feeder_max_lag_ms < MAX_FEEDER_LAG_MS)
        level = {
            "streams": n, "ok": ok,
            "p50_update_ms": _pct(run.update_ms, 50), "p95_update_ms": p95,
            "p50_first_partial_ms": _pct(run.first_ms, 50), "p95_first_partial_ms": _pct(run.first_ms, 95),
            "p50_first_partial_from_onset_ms": _pct(run.first_onset_ms, 50),
            "p50_final_ms": _pct(run.final_ms, 50), "p95_final_ms": _pct(run.final_ms, 95),
            "updates": len(run.update_ms), "finals": len(run.final_ms),
            "undrained": run.undrained, "feeder_max_lag_ms": round(run.feeder_max_lag_ms, 1),
            "busy_fraction": round(run.busy_s / run.wall_s, 3) if run.wall_s else None,
            "gpu_s_per_stream_hour": round(per_stream_s * 3600, 1),
            "batching_gain": round(base / per_stream_s, 2) if base and per_stream_s else None,
            "ticks": ticks.ticks, "sessions_per_tick": round(ticks.sessions / ticks.ticks, 1) if ticks.ticks else None,
            "decode_tokens_per_stream_s": round(run.decoded_tokens / (n * opts.seconds), 2),
            "peak_mib": None if run.peak_mib is None else round(run.peak_mib),
            "mib_per_stream": (None if run.above_idle_mib is None
                               else round(slot_bytes / 2**20 + run.above_idle_mib / n, 1)),
            "wall_s": round(run.wall_s, 1),
        }
        levels.append(level)
        print(f"engine-load: N = {n}: p95 update {p95} ms, busy {level['busy_fraction']}, "
              f"{'ok' if ok else 'NOT ok'}", flush=True)
        if not ok:
            failed_at = failed_at or n
        elif opts.more and failed_at is None and not queue and n < sessions:
            queue.append(min(sessions, max(n + 1, int(n * GROW))))
        save(result, levels, cut)  # what ran so far survives a kill at the step's cap
    save(result, levels, cut, with_plot=True)  # before the profile: neither its failure nor its overrun loses them
    # where the time goes: torch.profiler over a short paced run at the largest level that kept up
    # (nothing undrained), at most PROFILE_MAX_STREAMS (a fallen-behind 512 traced for minutes on the
    # first GPU run, past the step's cap)
    prof_n = profile_streams(levels)
    if opts.profile_s > 0 and prof_n is not None:
        if time.perf_counter() - wall0 + opts.profile_s + 15.0 > opts.time_budget_s:
            cut.append({"streams": prof_n, "why": f"the profile: the time budget ({opts.time_budget_s:.0f} s)"})
        else:
            packets = level_packets(raw, segments, prof_n, opts.profile_s, stagger_s=opts.update_interval_s)
            try:
                result["profile"] = profile_level(engine, packets, prof_n, opts.profile_s, language)
            except Exception as e:  # noqa: BLE001 - a diagnostic: the levels stand without it
                result["profile_error"] = f"{type(e).__name__}: {e}"
                print(f"engine-load: the profile failed: {result['profile_error']}", flush=True)
    save(result, levels, cut, with_plot=True)
    return result


def bench_engine_load_command(opts: EngineLoadOptions) -> int:
    print(json.dumps(bench_engine_load(opts)))
    return 0
