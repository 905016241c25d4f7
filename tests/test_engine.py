"""cloud/inference/engine.py: N sessions batched through one Engine give exactly the events of N separate
runs; fairness; admission control; the asyncio Scheduler; the embedded engine and `harken stream`."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest

from harken.cloud.inference.commit import CommitPolicy
from harken.cloud.embedded import stream_audio, transcript_text
from harken.cloud.inference.engine import Engine, EngineConfig, TickFailed
from harken.cloud.inference.scheduler import Scheduler
from harken.cloud.inference.decoder_stream import SessionOptions
from harken.shared.errors import Overloaded
from harken.shared.text import transcript_text as transcript_of
from signals import concat, silence, speech, write_wav
from streaming import item_tokens, make_segments, packets, run_alone, run_batched, segment_texts
from streaming import workloads as _workloads

POLICY = CommitPolicy(max_item_tokens=10, max_new_tokens_per_update=4, rollback_tokens=2)


def workloads(n: int):
    return _workloads(n, seed=100)


_ALONE: dict[int, list] = {}


def alone_runs(asr, n: int) -> list[list]:
    """Events of workloads(n)'s sessions, each run by itself on its own engine (cached: workload i
    is the same in every workloads(n), so the tests share these reference runs)."""
    work = workloads(n)
    for i in range(n):
        if i not in _ALONE:
            options, segments, pieces = work[i]
            _ALONE[i] = run_alone(Engine(asr, EngineConfig(max_sessions=1, slot_policy=POLICY)), options,
                                  segments, pieces)
    return [_ALONE[i] for i in range(n)]


@pytest.mark.parametrize("n, max_batch", [(6, 4)])
def test_batched_sessions_equal_separate_runs(talkative_asr, n, max_batch):
    work = workloads(n)
    alone = alone_runs(talkative_asr, n)
    engine = Engine(talkative_asr, EngineConfig(max_sessions=n, max_batch=max_batch, slot_policy=POLICY))
    batched = run_batched(engine, work)
    for a, b in zip(alone, batched):
        assert b == a  # every event: text, partials, stability, times, language, tokens
    assert any(any(e.committed_delta for e in a) for a in alone)


@pytest.mark.parametrize("decode_step", ["plain", "static"])
def test_self_speculation_gives_plain_greedy_s_events(talkative_asr, decode_step):
    # drafts that the model confirms, drafts it rejects midway (the slot forgets the rest), passes
    # cut by the budget and the loop guard: every event is plain greedy decoding's, batched as alone
    work = workloads(6)
    plain = Engine(talkative_asr, EngineConfig(max_sessions=6, max_batch=4, slot_policy=POLICY, speculate=False))
    spec = Engine(talkative_asr, EngineConfig(max_sessions=6, max_batch=4, slot_policy=POLICY, decode_step=decode_step))
    assert run_batched(spec, work) == run_batched(plain, work) == alone_runs(talkative_asr, 6)
    assert plain.drafted_tokens == plain.verified_tokens == 0
    assert 0 < spec.verified_tokens < spec.drafted_tokens  # confirmed and rejected drafts both happened
    assert spec.decoded_tokens == plain.decoded_tokens


def test_every_ready_session_is_served_each_tick(talkative_asr):
    """More ready sessions than the batch holds: one tick still serves each of them once (they join
    as places free up), and none twice."""
    engine = Engine(talkative_asr, EngineConfig(max_sessions=5, max_batch=2, slot_policy=POLICY))
    work = workloads(5)
    sids = [engine.open_session(o) for o, _, _ in work]
    for sid, (_, segments, _) in zip(sids, work):
        engine.ingest(sid, 0, segments[0].first_frame, segments[0].frames[:, :100], True)  # one update due
    events = engine.step()
    assert not engine.has_work()
    served = {sid for sid, _ in events}
    assert all(engine.session(s).state.items[0].boundary == 100 for s in sids)
    assert served <= set(sids)


def test_live_sessions_go_before_sessions_ahead_of_real_time(talkative_asr):
    """A session that sent 20 s of audio at once waits while a live one (1 s of audio per wall
    second) is ready, at most MAX_DEFER_TICKS ticks in a row, and is served whenever no live one is."""
    from harken.cloud.inference.priority import MAX_DEFER_TICKS

    now = [0.0]
    engine = Engine(talkative_asr, EngineConfig(max_sessions=2, max_batch=2, slot_policy=POLICY), clock=lambda: now[0])
    flood, live = engine.open_session(SessionOptions(policy=POLICY)), engine.open_session(SessionOptions(policy=POLICY))
    (fseg,), (lseg,) = make_segments([20.0], [0.0], seed=7), make_segments([12.0], [0.0], seed=8)
    engine.ingest(flood, 0, 0, fseg.frames, True)

    def passes(sid: str) -> int:  # the head item's boundary moves 1 s (100 frames) per pass here
        return engine.session(sid).state.items[0].boundary // 100

    def second(k: int) -> None:  # wall second k: the live session's k-th second of audio arrives
        now[0] = float(k)
        engine.ingest(live, 0, 100 * k, lseg.frames[:, 100 * k:100 * (k + 1)], k == 0)
        engine.step()

    for k in range(MAX_DEFER_TICKS):
        second(k)
        assert passes(live) == k + 1 and passes(flood) == 0  # the live one each tick, the flood waits
    second(MAX_DEFER_TICKS)  # deferred MAX_DEFER_TICKS ticks in a row: served beside the live one
    assert passes(live) == MAX_DEFER_TICKS + 1 and passes(flood) == 1
    assert engine.deferrals == MAX_DEFER_TICKS
    engine.step()  # nothing live is ready: the flood is served
    assert passes(flood) == 2
    # the flood stays behind the live one until its lead (20 s sent at t=0) is within the slack
    now[0] = 17.5
    engine.ingest(live, 0, 100 * (MAX_DEFER_TICKS + 1), lseg.frames[:, 100 * (MAX_DEFER_TICKS + 1):100 * (MAX_DEFER_TICKS + 2)])
    engine.step()
    assert passes(flood) == 3 and passes(live) == MAX_DEFER_TICKS + 2  # lead 2.5 s: live now


def test_a_pass_s_events_go_out_when_it_finishes_not_with_the_tick(asr):
    """`step(emit)`: a short pass's events are handed out while a longer pass of the same tick is
    still decoding (the tiny checkpoint never stops: each pass runs to its budget), and the events
    emitted plus those returned are exactly a plain `step()`'s."""
    slots = CommitPolicy(max_item_tokens=40, max_new_tokens_per_update=24, rollback_tokens=0)
    short = CommitPolicy(max_item_tokens=40, max_new_tokens_per_update=2, rollback_tokens=0)
    (seg,) = make_segments([1.0], [0.0], seed=3)

    def tick(emit):
        engine = Engine(asr, EngineConfig(max_sessions=2, slot_policy=slots))
        quick = engine.open_session(SessionOptions(language="English", policy=short), "quick")
        slow = engine.open_session(SessionOptions(language="English", policy=slots), "slow")
        for sid in (quick, slow):
            engine.ingest(sid, 0, 0, seg.frames[:, :100], True)  # one update due each
        return engine, engine.step(emit(engine) if emit else None)

    emitted: list[tuple[list, bool]] = []
    _, rest = tick(lambda engine: lambda events: emitted.append((events, engine.working_on("slow"))))
    _, plain = tick(None)
    assert emitted, "nothing was handed out before the tick ended"
    first, slow_in_flight = emitted[0]
    assert {sid for sid, _ in first} == {"quick"} and slow_in_flight
    assert [e for events, _ in emitted for e in events] + rest == plain
    assert not rest and {sid for sid, _ in emitted[-1][0]} == {"slow"}  # every pass's events emitted


def test_a_live_session_goes_again_while_a_long_pass_runs_on(asr):
    """A live session whose pass has finished while a longer first pass of the tick runs on is
    served again in the same tick when its next update is due (not at the tick's end), with the
    events it gets when its updates run in ticks of their own."""
    slots = CommitPolicy(max_item_tokens=40, max_new_tokens_per_update=24, rollback_tokens=0)
    short = CommitPolicy(max_item_tokens=40, max_new_tokens_per_update=2, rollback_tokens=0)
    (seg,) = make_segments([2.0], [0.0], seed=5)

    engine = Engine(asr, EngineConfig(max_sessions=2, slot_policy=slots))
    quick = engine.open_session(SessionOptions(language="English", policy=short), "quick")
    slow = engine.open_session(SessionOptions(language="English", policy=slots), "slow")
    for sid in (quick, slow):
        engine.ingest(sid, 0, 0, seg.frames[:, :100], True)
    got: list = []

    def emit(events):  # the engine's thread, between decode steps: quick's next second arrives
        got.extend(e for sid, e in events if sid == quick)
        if got and engine.session(quick).state.items[0].boundary == 100:
            engine.ingest(quick, 0, 100, seg.frames[:, 100:200])

    got += [e for sid, e in engine.step(emit) if sid == quick]
    assert engine.session(quick).state.items[0].boundary == 200  # two passes in one tick
    assert not engine.has_work()

    alone = Engine(asr, EngineConfig(max_sessions=1, slot_policy=slots))
    sid = alone.open_session(SessionOptions(language="English", policy=short))
    alone.ingest(sid, 0, 0, seg.frames[:, :100], True)
    reference = [e for _, e in alone.step()]
    alone.ingest(sid, 0, 100, seg.frames[:, 100:200])
    reference += [e for _, e in alone.step()]
    assert got == reference


@pytest.mark.parametrize("hold", [None, False])
def test_an_ahead_pass_holds_still_while_live_ones_decode(asr, hold):
    """A pass of a session ahead of real time, in a tick beside a live one (deferred
    MAX_DEFER_TICKS ticks, then served), takes no decode step while the live pass decodes (on a
    CPU, by default): the live pass finishes first; with `hold_ahead=False` (a GPU's default) both
    step together. Either way the ahead pass's events are those it gets alone."""
    from harken.cloud.inference.priority import MAX_DEFER_TICKS

    slots = CommitPolicy(max_item_tokens=40, max_new_tokens_per_update=12, rollback_tokens=0)
    now = [0.0]
    (fseg,), (lseg,) = make_segments([20.0], [0.0], seed=7), make_segments([12.0], [0.0], seed=8)
    # without self-speculation: drafts confirmed in the prefill leave the live pass no decode steps to hold for
    engine = Engine(asr, EngineConfig(max_sessions=2, slot_policy=slots, hold_ahead=hold, speculate=False),
                    clock=lambda: now[0])
    flood = engine.open_session(SessionOptions(language="English", policy=slots), "flood")
    live = engine.open_session(SessionOptions(language="English", policy=slots), "live")
    engine.ingest(flood, 0, 0, fseg.frames, True)
    for k in range(MAX_DEFER_TICKS + 1):
        now[0] = float(k)
        engine.ingest(live, 0, 100 * k, lseg.frames[:, 100 * k:100 * (k + 1)], k == 0)
        last: list = []
        last += engine.step(last.extend)
    flood_events = [e for sid, e in last if sid == flood]
    assert flood_events and live in [sid for sid, _ in last]
    if hold is None:
        order = [sid for sid, _ in last]
        assert engine.held_steps > 0 and order[-len(flood_events):] == [flood] * len(flood_events)  # live out first
    else:
        assert engine.held_steps == 0

    alone = Engine(asr, EngineConfig(max_sessions=1, slot_policy=slots))
    sid = alone.open_session(SessionOptions(language="English", policy=slots))
    alone.ingest(sid, 0, 0, fseg.frames, True)
    assert flood_events == [e for _, e in alone.step()]


def test_admission_control(talkative_asr):
    work = workloads(3)
    alone = alone_runs(talkative_asr, 2)
    engine = Engine(talkative_asr, EngineConfig(max_sessions=2, slot_policy=POLICY, max_queued_frames=150))
    sids = [engine.open_session(o) for o, _, _ in work[:2]]
    with pytest.raises(Overloaded):
        engine.open_session(work[2][0])
    streams = [list(packets(s, p)) for _, s, p in work[:2]]
    events = {sid: [] for sid in sids}
    for r in range(max(len(s) for s in streams)):
        for sid, s in zip(sids, streams):
            if r < len(s):
                engine.ingest(sid, *s[r])
        if r == 0:
            with pytest.raises(Overloaded):  # still full; the refusal changes nothing
                engine.open_session(work[2][0])
        for sid, e in engine.run_until_idle():
            events[sid].append(e)
    assert [events[s] for s in sids] == alone  # the admitted sessions carried on undisturbed
    engine.close_session(sids[0])
    third = engine.open_session(work[2][0])  # a freed slot admits again
    # queued work past the limit refuses new sessions until the engine catches up
    segments = work[2][1]
    engine.ingest(third, 0, segments[0].first_frame, segments[0].frames[:, :151], True)
    with pytest.raises(Overloaded):
        engine.open_session(work[0][0])
    engine.run_until_idle()
    engine.close_session(third)
    engine.open_session(work[0][0])


def test_asyncio_scheduler_commits_what_a_synchronous_run_commits(talkative_asr):
    """Sessions fed from the event loop while the engine steps in its worker thread, timing
    uncontrolled: the committed text and final tokens are those of synchronous runs (commits are a
    function of the features alone); every segment gets its final event."""
    work = workloads(3)
    alone = alone_runs(talkative_asr, 3)

    async def main():
        scheduler = Scheduler(Engine(talkative_asr, EngineConfig(max_sessions=3, slot_policy=POLICY)))
        await scheduler.start()
        try:
            async def one(options, segments, pieces):
                sid, queue = scheduler.open_session(options)
                for p in packets(segments, pieces):
                    scheduler.ingest(sid, *p)
                    await asyncio.sleep(0.001)
                events = []
                while sum(e.is_final for e in events) < len(segments):
                    events.append(await asyncio.wait_for(queue.get(), 120))
                scheduler.close_session(sid)
                return events
            return await asyncio.gather(*(one(*w) for w in work))
        finally:
            await scheduler.stop()

    results = asyncio.run(main())
    for a, b in zip(alone, results):
        assert segment_texts(b) == segment_texts(a)
        assert item_tokens(b) == item_tokens(a)


def test_embedded_stream_of_speech(talkative_asr):
    """The real wire path (VAD, log-mel, codec) into the engine: one final per VAD segment, in order,
    and the transcript is the committed text of all of them."""
    audio = concat(silence(0.4), speech("Streaming speech recognition."), silence(0.8),
                   speech("Second sentence here."), silence(0.5))
    engine = Engine(talkative_asr, EngineConfig(max_sessions=1, slot_policy=POLICY))
    events = list(stream_audio(audio, engine, SessionOptions(policy=POLICY)))
    finals = [e.segment_id for e in events if e.is_final]
    assert finals == sorted(set(e.segment_id for e in events)) and len(finals) >= 2
    texts = segment_texts(events)
    assert transcript_text(events) == transcript_of(texts)
    assert all(e.end_s <= len(audio) / 16000 + 0.01 for e in events)


def test_cli_stream_json(tmp_path):
    wav = write_wav(tmp_path / "a.wav", concat(silence(0.3), speech("Hello there."), silence(0.6)))
    out = subprocess.run([sys.executable, "-m", "harken.cli", "stream", str(wav), "--model", "tiny", "--json"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "meaningless" in out.stderr
    lines = [json.loads(x) for x in out.stdout.splitlines()]
    keys = {"segment_id", "committed_delta", "partial", "stability", "start_s", "end_s", "language", "is_final",
            "from_finalize"}
    turns = [x for x in lines[:-1] if "type" in x]
    events = [x for x in lines[:-1] if "type" not in x]
    assert all(set(x) == keys for x in events) and any(x["is_final"] for x in events)
    # the VAD's turn events, one object each with "type": the onset before the segment's text, the end before its final
    assert [(x["type"], x["segment_id"]) for x in turns] == [("speech_started", 0), ("utterance_end", 0)]
    assert all(set(x) == {"type", "segment_id", "audio_s"} for x in turns)
    order = [x.get("type") or ("final" if x["is_final"] else "event") for x in lines[:-1]]
    assert order[0] == "speech_started" and order.index("utterance_end") < order.index("final")
    assert turns[0]["audio_s"] == pytest.approx(0.2, abs=0.1) and turns[1]["audio_s"] == pytest.approx(events[-1]["end_s"])
    assert set(lines[-1]) == {"final", "text"} and lines[-1]["final"] is True
    both = subprocess.run([sys.executable, "-m", "harken.cli", "stream", str(wav), "--mic", "--model", "tiny"],
                          capture_output=True, text=True, timeout=120)
    assert both.returncode == 2 and "not both" in both.stderr and len(both.stderr.splitlines()) == 1


def test_a_failing_session_does_not_affect_the_others(talkative_asr):
    """A fault in one session's own processing takes only that session out; the others' events are
    those of their separate runs, and the Scheduler hands the error to that session's queue."""
    work = workloads(3)
    alone = alone_runs(talkative_asr, 3)
    engine = Engine(talkative_asr, EngineConfig(max_sessions=3, slot_policy=POLICY))
    sids = [engine.open_session(o) for o, _, _ in work]
    bad = engine.session(sids[1])
    fault = RuntimeError("injected fault")

    def broken(job, tokens, *probs):
        raise fault

    bad.finish_job = broken  # the fault: this session's text handling blows up
    streams = [list(packets(s, p)) for _, s, p in work]
    events = {sid: [] for sid in sids}
    for r in range(max(len(s) for s in streams)):
        for sid, s in zip(sids, streams):
            if r < len(s):
                engine.ingest(sid, *s[r])
        for sid, e in engine.run_until_idle():
            events[sid].append(e)
    assert events[sids[0]] == alone[0] and events[sids[2]] == alone[2]
    assert events[sids[1]] == [] and engine.failure(sids[1]) is fault
    engine.close_session(sids[1])
    engine.open_session(work[1][0])  # its slot came back

    async def main():
        scheduler = Scheduler(Engine(talkative_asr, EngineConfig(max_sessions=2, slot_policy=POLICY)))
        await scheduler.start()
        try:
            sid, queue = scheduler.open_session(work[0][0])
            scheduler.engine.session(sid).finish_job = broken
            for p in packets(work[0][1], work[0][2]):
                scheduler.ingest(sid, *p)
            return await asyncio.wait_for(queue.get(), 60)
        finally:
            await scheduler.stop()

    assert asyncio.run(main()) is fault


def test_a_failed_tick_is_retried_with_the_same_result(talkative_asr, monkeypatch):
    """The model failing mid-tick (a fault in one decode step) leaves every session as it was before
    that tick: the retry produces exactly the events of an undisturbed run."""
    import harken.cloud.inference.engine as scheduler_module

    work = workloads(3)
    alone = alone_runs(talkative_asr, 3)
    calls = {"n": 0}
    real = scheduler_module.decode_step

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] in (3, 10, 17):
            raise RuntimeError("injected device fault")
        return real(*args, **kwargs)

    monkeypatch.setattr(scheduler_module, "decode_step", flaky)
    engine = Engine(talkative_asr, EngineConfig(max_sessions=3, slot_policy=POLICY))
    sids = [engine.open_session(o) for o, _, _ in work]
    streams = [list(packets(s, p)) for _, s, p in work]
    events = {sid: [] for sid in sids}
    failures = early = 0
    for r in range(max(len(s) for s in streams)):
        for sid, s in zip(sids, streams):
            if r < len(s):
                engine.ingest(sid, *s[r])
        while engine.has_work():
            try:
                produced = engine.step()
            except TickFailed as failed:
                assert str(failed.__cause__) == "injected device fault"
                produced = failed.events  # passes that finished before the fault
                early += len(produced)
                failures += 1
            for sid, e in produced:
                events[sid].append(e)
    assert failures == 3 and early > 0  # some passes had finished before a fault, in its tick
    assert [events[s] for s in sids] == alone
