"""`harken bench fuzz`: a long fuzzing run over the wire decoders and the served session, counted.

The inputs, targets and properties are lab/bench/fuzz_targets.py's (tests/test_fuzz.py runs them with
hypothesis, a few hundred examples). Here one seeded random source drives `examples` inputs:
`session_share` of them whole streams through the served session (`ServedFuzz`: the tiny model's
engine and session table, `StreamHandler.run_proto` called in-process, `concurrency` streams
in flight at once), the rest split evenly over the four decoder targets. Meanwhile a reference
session of another key streams the corpus's packets again and again beside the fuzzed streams;
each of its runs must give the transcript it gets alone.

Output (one JSON object):
  tried                 inputs tried, all targets (a session example is one whole stream)
  crashes               broken properties (lab/bench/fuzz_targets.py), all targets; `crash_examples` shows the first few
  rejections_by_code    rejections of what a client can send (codec, wire, datachannel_server,
                        session), by status code; `accepted` the inputs taken as valid
  by_target             per target: tried and outcomes by code ("OK" accepted; "CANCELLED": a stream
                        the fuzzer dropped itself, as a lost connection; datachannel_client's
                        INTERNAL is the client failing a call on a malformed message from the server)
  session_messages      messages sent by the fuzzed streams
  reference_runs / others_affected   reference runs beside the fuzzing / those whose transcript
                        differed from the run alone
  leaked_sessions       sessions (and engine sessions) still held once every stream had ended and
                        the grace period was over
  ok                    no crash, no other session affected, nothing leaked (the exit status is 1 otherwise)

The inputs follow from `seed`, except which session ids a resume names (those depend on timing
with `concurrency` > 1).

With `http_examples` > 0 (`--http-examples N`), the same random source then drives N raw HTTP
requests and Realtime WebSocket sessions against a served HTTP port's OpenAI endpoints
(lab/bench/fuzz_http.py, `http_concurrency` at a time, beside a reference Realtime session of another
key); their counts come under `http` (tried, crashes, by_target, reference_runs, others_affected,
leaked_sessions, realtime_error_codes, crash_examples), and `ok` holds for both parts.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field

from harken.bench import fuzz_targets as fuzz
from harken.bench import fuzz_inputs as inputs
from harken.shared.errors import HarkenError


@dataclass(frozen=True)
class FuzzBenchOptions:
    examples: int = 100_000
    seed: int = 0
    session_share: float = 0.1  # of the examples: whole streams through the served session
    concurrency: int = 16  # fuzzed streams in flight at once
    model: str = "tiny"
    reference_pace_s: float = 0.02  # between the reference stream's messages
    crash_examples: int = 5
    http_examples: int = 0  # examples against the HTTP port's OpenAI endpoints (lab/bench/fuzz_http.py)
    http_concurrency: int = 4

    def __post_init__(self):
        if (self.examples < 0 or self.http_examples < 0 or self.examples + self.http_examples < 1
                or self.concurrency < 1 or self.http_concurrency < 1 or not 0.0 <= self.session_share <= 1.0):
            raise HarkenError("--examples and --http-examples must be >= 0 (one of them >= 1), --concurrency >= 1, "
                              "--session-share within 0..1")


@dataclass
class Tally:
    by_target: dict[str, Counter] = field(default_factory=lambda: {t: Counter() for t in fuzz.TARGETS})
    crashes: int = 0
    crash_examples: list[dict] = field(default_factory=list)
    keep: int = 5

    def add(self, target: str, code: str) -> None:
        self.by_target[target][code] += 1

    def crash(self, e: fuzz.Crash) -> None:
        self.crashes += 1
        self.by_target[e.target]["CRASH"] += 1
        if len(self.crash_examples) < self.keep:
            self.crash_examples.append({"target": e.target, "reason": e.reason,
                                        "input": fuzz.describe(e.data, limit=4000)})

    def tried(self, target: str) -> int:
        return sum(self.by_target[target].values())


def split(examples: int, session_share: float) -> dict[str, int]:
    """How many examples each target gets."""
    sessions = round(examples * session_share)
    decoders = [t for t in fuzz.TARGETS if t != "session"]
    rest = examples - sessions
    counts = {t: rest // len(decoders) for t in decoders}
    for t in decoders[:rest % len(decoders)]:
        counts[t] += 1
    counts["session"] = sessions
    return counts


async def run_decoders(counts: dict[str, int], rng: random.Random, corpus: inputs.FuzzCorpus, tally: Tally) -> None:
    for _ in range(counts["codec"]):
        _record(tally, "codec", lambda: fuzz.check_codec(*inputs.random_codec_input(rng, corpus)))
    for _ in range(counts["wire"]):
        _record(tally, "wire", lambda: fuzz.check_wire(inputs.random_wire_input(rng, corpus)))
    for _ in range(counts["datachannel_server"]):
        _record(tally, "datachannel_server",
                lambda: fuzz.check_datachannel_server(inputs.random_datachannel_server_input(rng, corpus)))
    for _ in range(counts["datachannel_client"]):
        data = inputs.random_datachannel_client_input(rng)
        try:
            tally.add("datachannel_client", await fuzz.check_datachannel_client(data))
        except fuzz.Crash as e:
            tally.crash(e)


def _record(tally: Tally, target: str, check) -> None:
    try:
        tally.add(target, check())
    except fuzz.Crash as e:
        tally.crash(e)


async def run_sessions(n: int, options: FuzzBenchOptions, rng: random.Random, harness: fuzz.ServedFuzz,
                       tally: Tally) -> dict:
    """`n` fuzzed streams, `options.concurrency` at a time, beside back-to-back reference runs."""
    alone = await harness.run_reference()
    remaining = n
    messages = 0

    async def worker() -> None:
        nonlocal remaining, messages
        while remaining > 0:
            remaining -= 1
            stream = inputs.random_stream(rng, harness.corpus, harness.resumable_ids())
            messages += len(stream.messages)
            try:
                tally.add("session", await harness.check(stream))
            except fuzz.Crash as e:
                tally.crash(e)

    stop = asyncio.Event()
    beside = asyncio.ensure_future(harness.reference_runs(alone, stop, options.reference_pace_s))
    await asyncio.gather(*(worker() for _ in range(options.concurrency)))
    stop.set()
    runs, affected = await beside
    for difference in harness.differences[:max(0, tally.keep - len(tally.crash_examples))]:
        tally.crash_examples.append({"target": "reference", "reason": "transcript beside the fuzzing differs from alone",
                                     "input": fuzz.describe(difference, limit=4000)})
    leaked = await harness.leaked_sessions() + len(harness.core.scheduler.engine.sessions)
    return {"session_messages": messages, "reference_runs": runs, "others_affected": affected,
            "leaked_sessions": leaked}


async def run_fuzz(options: FuzzBenchOptions, asr) -> dict:
    t0 = time.monotonic()
    rng = random.Random(options.seed)
    corpus = inputs.build_corpus()
    counts = split(options.examples, options.session_share)
    tally = Tally(keep=options.crash_examples)
    await run_decoders(counts, rng, corpus, tally)
    session = {"session_messages": 0, "reference_runs": 0, "others_affected": 0, "leaked_sessions": 0}
    if counts["session"]:
        harness = await fuzz.ServedFuzz.start(asr, corpus)
        try:
            session = await run_sessions(counts["session"], options, rng, harness, tally)
        finally:
            await harness.close()
    http = None
    if options.http_examples:
        http = await run_http(options, rng, asr, corpus)
    wall_s = time.monotonic() - t0
    rejections: Counter = Counter()
    for target in fuzz.SERVER_TARGETS:
        rejections.update({code: n for code, n in tally.by_target[target].items()
                           if code not in ("OK", fuzz.CANCELLED, "CRASH")})
    tried = sum(tally.tried(t) for t in fuzz.TARGETS)
    result = {
        "tried": tried,
        "crashes": tally.crashes,
        "rejections_by_code": dict(sorted(rejections.items())),
        "accepted": sum(tally.by_target[t]["OK"] for t in fuzz.SERVER_TARGETS),
        "by_target": {t: {"tried": tally.tried(t), **dict(sorted(c.items()))} for t, c in tally.by_target.items()},
        **session,
        "ok": tally.crashes == 0 and session["others_affected"] == 0 and session["leaked_sessions"] == 0,
        "crash_examples": tally.crash_examples,
        "seed": options.seed,
        "concurrency": options.concurrency,
        "model": options.model,
        "wall_s": round(wall_s, 2),
        "examples_per_s": round(tried / wall_s, 1),
    }
    if http is not None:
        result["http"] = http
        result["ok"] = result["ok"] and http["ok"]
    return result


async def run_http(options: FuzzBenchOptions, rng: random.Random, asr, corpus: inputs.FuzzCorpus) -> dict:
    """`options.http_examples` requests and Realtime sessions against a served HTTP port (lab/bench/fuzz_http.py)."""
    from harken.bench import fuzz_http

    t0 = time.monotonic()
    harness = await fuzz_http.ServedHTTP.start(asr, corpus)
    try:
        out = await fuzz_http.run_http_fuzz(options.http_examples, rng, harness, options.http_concurrency,
                                            keep=options.crash_examples)
    finally:
        await harness.close()
    out["wall_s"] = round(time.monotonic() - t0, 2)
    return out


def bench_fuzz(options: FuzzBenchOptions) -> dict:
    import logging

    import torch

    from harken.cloud.model.asr import Qwen3ASR

    if not torch.cuda.is_available():
        torch.set_num_threads(1)
    # every rejected stream logs a line; a long run would write hundreds of thousands
    logging.getLogger("harken").setLevel(logging.WARNING)
    asr = Qwen3ASR.load(options.model)
    return asyncio.run(run_fuzz(options, asr))


def bench_fuzz_command(options: FuzzBenchOptions) -> int:
    result = bench_fuzz(options)
    print(json.dumps(result, indent=1))
    return 0 if result["ok"] else 1
