"""`harken bench overload`: twice the admitted sessions, and clients that try to push others out.

Three runs, each on a fresh in-process server (cloud/server.py, `model`, tiny by default) with an
API key per client, each `seconds` of audio per user; users are SDK clients (`TranscriptionClient`)
streaming the bundled sample like a microphone, as in `harken bench load` (lab/bench/load.py):

  alone      the server admits M sessions (`--max-sessions M`); M users stream.
  overload   the same server; while M users stream, M more users each try to open a stream again
             and again (a fresh connection per try, every `knock_interval_s`): 2M in all. Knocking
             starts once the M hold their sessions and stops when the first of them ends.
  attacked   the server admits M + P (`--max-sessions-per-key P`: the attacker key's share). Before
             the users come, an attacker key sends a Features payload claiming more frames than its
             bytes may carry; then opens a flooding stream (Features of 72 frames in 9 bytes, the
             most audio per byte the wire accepts, as fast as the server reads: at most
             `FLOOD_AHEAD` messages past its last Ack) and an idle stream (Start, then nothing),
             and tries more sessions than its share. Then M users stream and M more knock, as in
             `overload`.

The knocking users and the attacker run in a process of their own at a lower priority
(lab/bench/overload_clients.py): their own CPU would be spent on their own machines; what the users
here feel is the server's work for them.

Figures (times in ms):
  <run>.p50_update_ms / p95_update_ms   the admitted users' update latency (bench load's definition:
                      arrival minus when the audio the event covers had been handed to the client)
  <run>.errors        admitted users whose stream failed, by code; `pushed_out` sums them over the
                      overload and attacked runs (users refused or failed while others knocked or attacked)
  p95_ratio_overload / p95_ratio_attacked   the run's p95 over alone's
  rejections          the knocking users' tries: codes, and the time from opening a connection to
                      the refusal arriving (p50/p95/max), both runs; `rejection_goal_ms` 100
  attacker            the over-claiming payload's code and time; the flood: messages written (into
                      gRPC's buffers), frames the server applied, the most frames its session ever had
                      queued (the server stops reading a session past `max_queued_frames_per_session`);
                      whether the flood and idle streams were admitted and still held when the users
                      were done; the attacker's tries past its share, by code
  passes_deferred     ticks in which the flood's ready pass waited for live sessions (priority.py)
  held_steps          decode steps in which its pass in flight held still while live passes decoded
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import tempfile
import time
from contextlib import aclosing
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from harken.bench import overload_clients
from harken.bench.load import PIECE_MS, StreamRecord, paced, percentiles, sample_audio, tiled
from harken.bench.overload_clients import FLOOD_FRAMES, Knocks
from harken.shared.errors import HarkenError
from harken.shared.features_spec import SAMPLE_RATE

REJECTION_GOAL_MS = 100.0
ANSWER_S = 120.0  # the clients' process answers a request within this (its attacker's moves take ~1 s)


@dataclass(frozen=True)
class OverloadBenchOptions:
    sessions: int = 4  # M: users admitted
    seconds: float = 20.0  # audio per user
    attacker_share: int = 2  # P: the per-key limit, which the attacker key fills (flood + idle)
    knock_interval_s: float = 0.25  # between one knocking user's tries
    model: str = "tiny"
    language: str = "English"  # the tiny checkpoint's random weights write text only when forced
    max_audio_speed: float = 4.0  # the servers' pace of a live stream (harken serve's flags)
    audio_burst_s: float = 30.0
    rounds: int = 1  # alone, overload, attacked, then again: p95s pooled over the rounds

    def __post_init__(self):
        if (self.sessions < 1 or self.seconds <= 0 or self.attacker_share < 2 or self.knock_interval_s < 0
                or self.rounds < 1):
            raise HarkenError("--sessions >= 1, --seconds > 0, --attacker-share >= 2 (flood and idle), "
                              "--knock-interval-s >= 0, --rounds >= 1")


@dataclass
class Keys:
    """One key per user (M admitted + M knocking) and the attacker's, in a keys file."""

    path: str
    users: list[str]
    attacker: str

    @classmethod
    def write(cls, folder: Path, users: int) -> "Keys":
        keys = [f"user-key-{i:04d}-0123456789" for i in range(users)]
        attacker = "attacker-key-0123456789"
        path = folder / "keys"
        path.write_text("".join(f"{k} user{i}\n" for i, k in enumerate(keys)) + f"{attacker} attacker\n")
        return cls(str(path), keys, attacker)


async def run_users(target: str, keys: list[str], options: OverloadBenchOptions, sample: np.ndarray,
                    first_done: asyncio.Event) -> dict:
    """M users streaming at once (lab/bench/load.py's clients); their latency and errors.
    `first_done` is set when the first of them ends (its session then frees its slot)."""
    from harken.edge.client.grpc_client import ClientOptions, TranscriptionClient

    piece_samples = SAMPLE_RATE * PIECE_MS // 1000
    records = [StreamRecord(piece_samples) for _ in keys]
    period_s = sample.size / SAMPLE_RATE
    n = len(keys)
    t0 = time.monotonic()

    async def one(i: int) -> None:
        client = TranscriptionClient(target, api_key=keys[i], options=ClientOptions(language=options.language))
        audio = tiled(sample, options.seconds, offset_s=round(i * period_s / n, 1))
        record = records[i]
        try:
            async with aclosing(client.stream(paced(audio, t0, record))) as events:
                async for event in events:
                    record.observe(event, time.monotonic())
            record.done_at = time.monotonic()
        except Exception as e:  # the user's stream failed: its code (a ServerRejectedError's) or its type
            record.error = getattr(e, "code", None) or type(e).__name__
        finally:
            first_done.set()

    await asyncio.gather(*(one(i) for i in range(n)))
    errors: dict[str, int] = {}
    for r in records:
        if r.error is not None:
            errors[r.error] = errors.get(r.error, 0) + 1
    update = percentiles([ms for r in records for ms in r.update_ms])
    return {"p50_update_ms": update["p50"], "p95_update_ms": update["p95"], "errors": errors,
            "_update_ms": [ms for r in records for ms in r.update_ms],  # pooled over rounds, then dropped
            "events": sum(r.events for r in records), "segments": sum(r.finals for r in records),
            "max_send_lag_ms": round(1000 * max(r.max_lag_s for r in records), 1),
            "wall_s": round(time.monotonic() - t0, 2)}


class Outside:
    """The knocking users and the attacker key in their own process (lab/bench/overload_clients.py),
    driven one run at a time; the attacker's flood watched from here, on the server's table."""

    def __init__(self, keys: Keys, options: OverloadBenchOptions):
        ctx = multiprocessing.get_context("spawn")  # no fork of a process with grpc's and torch's threads
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=overload_clients.serve, daemon=True,
                                   args=(child, keys.attacker, keys.users[options.sessions:2 * options.sessions],
                                         options.language, options.knock_interval_s))
        self.process.start()
        child.close()

    async def _call(self, *request) -> dict | None:
        """A request and the process's answer (its payload); a process that does not answer in
        `ANSWER_S` or has died is an error, not a hang."""
        self.conn.send(request)
        loop = asyncio.get_running_loop()
        if not await loop.run_in_executor(None, self.conn.poll, ANSWER_S):
            raise HarkenError(f"the overload clients' process did not answer {request[0]!r} in {ANSWER_S:.0f} s")
        try:
            answer = await loop.run_in_executor(None, self.conn.recv)
        except EOFError:
            raise HarkenError(f"the overload clients' process ended (exit {self.process.exitcode})") from None
        return answer[1]

    async def begin(self, kind: str, target: str) -> None:
        await self._call("begin", kind, target)

    def send(self, *request) -> None:
        self.conn.send(request)

    async def end(self) -> dict:
        ended = await self._call("end")
        assert ended is not None  # ("done", {...})
        return ended

    def close(self) -> None:
        try:
            self.conn.send(("exit",))
        except (BrokenPipeError, OSError):
            pass
        self.process.join(timeout=10)
        if self.process.is_alive():
            self.process.kill()


async def watch_flood(server, stop: asyncio.Event, result: dict) -> None:
    """The attacker's sessions on the server: frames applied, the most frames ever queued."""
    result.update(flood_frames_applied=0, flood_max_queued_frames=0)
    while not stop.is_set():
        mine = [s for s in server._table.sessions.values() if s.key_id == "attacker"]
        result["flood_max_queued_frames"] = max([result["flood_max_queued_frames"], *(s.queued_frames() for s in mine)])
        result["flood_frames_applied"] = max([result["flood_frames_applied"],
                                              *(s.applied_seq * FLOOD_FRAMES for s in mine)])
        await asyncio.sleep(0.1)


async def run(options: OverloadBenchOptions, asr, kind: str, keys: Keys, sample: np.ndarray,
              outside: Outside) -> dict:
    """One run (`kind`: alone, overload or attacked) on a fresh server; the knockers and the
    attacker come from `outside`'s process."""
    from harken.cloud.server import ServerOptions, start_server

    m, p = options.sessions, options.attacker_share
    server = await start_server(asr, ServerOptions(
        host="127.0.0.1", port=0, api_keys=keys.path, max_sessions=m + (p if kind == "attacked" else 0),
        max_sessions_per_key=p, shutdown_grace_s=2.0, max_audio_speed=options.max_audio_speed,
        audio_burst_s=options.audio_burst_s))
    target = server.address
    out: dict = {}
    flood: dict = {}
    watching = asyncio.Event()
    watcher = asyncio.ensure_future(watch_flood(server, watching, flood)) if kind == "attacked" else None
    try:
        await outside.begin(kind, target)  # the attacker's moves come first
        stop = asyncio.Event()  # a user has ended: its slot is free, knocking stops
        users = asyncio.ensure_future(run_users(target, keys.users[:m], options, sample, stop))
        if kind != "alone":
            # the knockers come once every user holds its session
            while not users.done() and sum(1 for s in server._table.sessions.values()
                                           if s.key_id.startswith("user")) < m:
                await asyncio.sleep(0.01)
            outside.send("knock")
            await stop.wait()
            outside.send("stop_knocking")
        out = await users
        ended = await outside.end()
        if kind != "alone":
            knocks = Knocks(*ended["knocks"])
            out["rejections"] = knocks.summary()
            out["_knocks"] = knocks  # for the summary over both runs
        if ended["attacker"] is not None:
            out["attacker"] = {**ended["attacker"], **flood}
        # ticks in which a ready session ahead of real time (the flood) waited for live ones
        out["passes_deferred"] = server.engine.deferrals
        # decode steps in which its pass held still while live ones decoded
        out["held_steps"] = server.engine.held_steps
    finally:
        watching.set()
        if watcher is not None:
            await watcher
        await server.stop(grace_s=2.0)
    return out


def _pooled(results: list[dict]) -> dict:
    """One kind's runs as one: latencies pooled, counts summed, the attacker's figures those of the
    last round (each round's flood is in `rounds`)."""
    if len(results) == 1:
        out = dict(results[0])
        out.pop("_update_ms")
        return out
    update = percentiles([ms for r in results for ms in r["_update_ms"]])
    errors: dict[str, int] = {}
    for r in results:
        for code, n in r["errors"].items():
            errors[code] = errors.get(code, 0) + n
    out = {"p50_update_ms": update["p50"], "p95_update_ms": update["p95"], "errors": errors,
           "events": sum(r["events"] for r in results), "segments": sum(r["segments"] for r in results),
           "max_send_lag_ms": max(r["max_send_lag_ms"] for r in results),
           "wall_s": round(sum(r["wall_s"] for r in results), 2),
           "passes_deferred": sum(r["passes_deferred"] for r in results),
           "held_steps": sum(r["held_steps"] for r in results)}
    if "_knocks" in results[0]:
        knocks = Knocks()
        for r in results:
            knocks.extend(r["_knocks"])
        out["rejections"], out["_knocks"] = knocks.summary(), knocks
    if "attacker" in results[0]:
        out["attacker"] = results[-1]["attacker"]
    return out


async def bench_overload(options: OverloadBenchOptions, asr) -> dict:
    t0 = time.monotonic()
    sample = sample_audio()
    with tempfile.TemporaryDirectory() as folder:
        keys = Keys.write(Path(folder), 2 * options.sessions)
        rounds: list[dict] = []
        outside = Outside(keys, options)  # one process for every run's knockers and attacker
        try:
            for _ in range(options.rounds):  # interleaved: a neighbour's load falls on every kind alike
                rounds.append({kind: await run(options, asr, kind, keys, sample, outside)
                               for kind in ("alone", "overload", "attacked")})
        finally:
            outside.close()
    runs = {kind: _pooled([r[kind] for r in rounds]) for kind in ("alone", "overload", "attacked")}
    alone_p95 = runs["alone"]["p95_update_ms"]

    def ratio(kind: str) -> float | None:
        p95 = runs[kind]["p95_update_ms"]
        return round(p95 / alone_p95, 2) if p95 is not None and alone_p95 else None

    rejections = Knocks()
    for kind in ("overload", "attacked"):
        rejections.extend(runs[kind].pop("_knocks"))
    return {
        "sessions": options.sessions,
        "seconds": options.seconds,
        "attacker_share": options.attacker_share,
        "alone": runs["alone"],
        "overload": runs["overload"],
        "attacked": {k: v for k, v in runs["attacked"].items() if k != "attacker"},
        "p95_ratio_overload": ratio("overload"),
        "p95_ratio_attacked": ratio("attacked"),
        "rounds": [{**{f"p95_{k}_ms": r[k]["p95_update_ms"] for k in r},
                    "flood_frames_applied": r["attacked"]["attacker"]["flood_frames_applied"],
                    "passes_deferred": r["attacked"]["passes_deferred"],
                    "held_steps": r["attacked"]["held_steps"]} for r in rounds],
        "pushed_out": sum(sum(runs[k]["errors"].values()) for k in ("overload", "attacked")),
        "rejections": rejections.summary(),
        "attacker": runs["attacked"]["attacker"],
        "rejection_goal_ms": REJECTION_GOAL_MS,
        "model": options.model,
        "max_audio_speed": options.max_audio_speed,
        "audio_burst_s": options.audio_burst_s,
        "outside_nice": overload_clients.OUTSIDE_NICE,
        "wall_s": round(time.monotonic() - t0, 1),
    }


def bench_overload_command(options: OverloadBenchOptions) -> int:
    import torch

    from harken.cloud.model.asr import Qwen3ASR

    if not torch.cuda.is_available():
        torch.set_num_threads(1)
    asr = Qwen3ASR.load(options.model)
    print(json.dumps(asyncio.run(bench_overload(options, asr)), indent=1))
    return 0
