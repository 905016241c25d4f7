"""Files in the serving engine (cloud/inference/file_passes.py, `Scheduler.transcribe` / `.pieces`): every
file's tokens are `transcribe_audio`'s for it alone, whatever else is in work; live sessions' events
are unchanged beside files; the engine serves live work between file units; a cancelled file frees
its slot; a unit the model fails on fails its own files only. Real tiny checkpoints, no mocked model."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
import torch

from harken.cloud.inference.file_passes import FileConfig, FileListener, FilePasses, FileRequest
from harken.cloud.inference.offline import transcribe_audio
from harken.edge.audio import load_audio, peak_normalize
from harken.shared.errors import Overloaded

SAMPLE = Path(__file__).resolve().parents[1] / "harken" / "data" / "sample.wav"


@pytest.fixture(scope="module")
def untied():
    """A model that writes words and never ends on its own: passes run to their budgets."""
    from harken.cloud.model.asr import Qwen3ASR

    torch.set_num_threads(1)
    return Qwen3ASR.load("tiny-untied", dtype="fp32", device="cpu")


@pytest.fixture(scope="module")
def audio():
    return peak_normalize(load_audio(str(SAMPLE)))


class Collect(FileListener):
    def __init__(self):
        self.pieces, self.out, self.error = [], None, None

    def piece(self, piece):
        self.pieces.append(piece)

    def done(self, transcript):
        self.out = transcript

    def failed(self, error):
        self.error = error


def run_all(files: FilePasses, limit: int = 100_000) -> int:
    n = 0
    while files.has_work() and n < limit:
        files.step()
        n += 1
    assert not files.has_work()
    return n


def offline(asr, r: FileRequest):
    return transcribe_audio(asr, r.audio, r.language, r.context, r.max_pass_s, r.decode_limits)


def assert_same(asr, r: FileRequest, got):
    ref = offline(asr, r)
    assert got is not None
    assert [p.token_ids for p in got.pieces] == [p.token_ids for p in ref.pieces]
    assert (got.text, got.language) == (ref.text, ref.language)
    assert [(p.start_s, p.end_s) for p in got.pieces] == [(p.start_s, p.end_s) for p in ref.pieces]


def requests(audio) -> list[FileRequest]:
    return [FileRequest(audio[:16000 * 3], "English"),
            FileRequest(audio[:16000 * 9]),  # the language detected: the header is decoded too
            FileRequest(audio, "English", context="harken"),
            FileRequest(audio, max_pass_s=6.0),  # cut at quiet points: several passes, a short last one padded
            FileRequest(audio[:16000 * 7], "English", decode_limits=False)]  # 512 tokens, no loop guard


@pytest.mark.parametrize("config", [FileConfig(max_files=8), FileConfig(max_files=2, unit_windows=2, unit_positions=64)],
                         ids=["together", "slot-waits-and-chunked-prefill"])
def test_every_files_tokens_are_transcribe_audios_alone(untied, audio, config):
    files = FilePasses(untied, config)
    reqs = requests(audio)
    got = [Collect() for _ in reqs]
    for r, c in zip(reqs, got):
        files.submit(r, c)
    run_all(files)
    for r, c in zip(reqs, got):
        assert c.error is None
        assert_same(untied, r, c.out)
        assert [p.token_ids for p in c.pieces] == [p.token_ids for p in c.out.pieces]  # each piece heard once
    assert files.units["decode"] > 0 and files.units["encode"] > 0
    assert files.units["features"] >= sum(-(-len(r.audio) // (8 * 16000)) for r in reqs)  # 8 s of log-mel a unit
    if config.unit_positions == 64:  # prompts of ~280 positions: several prefill units each
        assert files.units["prefill"] >= 2 * len(reqs)
    assert files.cache is not None and files.cache.num_free() == config.max_files
    assert files.pending() == 0


def test_a_file_that_joins_mid_decode_and_grows_the_cache(untied, audio):
    """A short file decoding when a long one arrives: the cache grows (by copy) under it, both are
    the offline pass's."""
    files = FilePasses(untied, FileConfig(max_files=2))
    short, long = FileRequest(audio[:16000 * 2], "English"), FileRequest(np.tile(audio, 2), "English")
    a, b = Collect(), Collect()
    files.submit(short, a)
    while files.units["decode"] < 3:
        files.step()
    before = files.cache.max_len
    files.submit(long, b)
    run_all(files)
    assert files.cache.max_len > before
    assert_same(untied, short, a.out)
    assert_same(untied, long, b.out)


def test_token_probabilities_are_the_models_cache_free_forward(untied, audio):
    """Each token's probability kept by the pass (what `include[]=logprobs` gives) is the softmax of
    a cache-free causal forward over the prompt and the tokens before it."""
    files = FilePasses(untied, FileConfig(unit_positions=100))
    c = Collect()
    r = FileRequest(audio[:16000 * 4], "English")
    files.submit(r, c)
    run_all(files)
    piece = c.out.pieces[0]
    assert len(piece.token_probs) == len(piece.token_ids) > 5
    from harken.edge.features import log_mel

    _, embeds = untied.prompt_embeddings(log_mel(r.audio), "English")
    ids = torch.tensor(piece.token_ids)
    x = torch.cat([embeds, untied.decoder.embed(ids)])[None]
    with torch.no_grad():
        probs = torch.softmax(untied.decoder(x)[0].double(), -1)
    want = [float(probs[len(embeds) - 1 + i, t]) for i, t in enumerate(piece.token_ids)]
    assert piece.token_probs == pytest.approx(want, rel=1e-4, abs=1e-6)


def test_admission_past_max_files_and_queue_is_overloaded(untied, audio):
    files = FilePasses(untied, FileConfig(max_files=2, queue=1))
    tickets = [files.admit() for _ in range(3)]
    with pytest.raises(Overloaded, match="2 file\\(s\\) at once and holds 1 more"):
        files.admit()
    tickets[0].release()
    tickets[0].release()  # once only
    files.admit()
    with pytest.raises(Overloaded):
        files.admit()


def test_a_unit_the_model_fails_on_fails_its_own_files_only(untied, audio):
    """A decode step that raises while only the short file decodes: that file fails, its slot is
    freed; the long one (encoding then) goes on to the offline pass's tokens."""
    files = FilePasses(untied, FileConfig(max_files=2, unit_windows=1))
    short, long = FileRequest(audio[:16000], "English"), FileRequest(audio, "English")
    a, b = Collect(), Collect()
    files.submit(short, a)
    files.submit(long, b)
    real = files.decode_step
    failed = []

    def faulty(slots, feed):
        if len(slots) == 1 and not failed:
            failed.append(slots)
            raise RuntimeError("device error")
        return real(slots, feed)

    files.decode_step = faulty
    run_all(files)
    assert failed and isinstance(a.error, RuntimeError) and a.out is None
    assert b.error is None
    assert_same(untied, long, b.out)
    assert files.cache.num_free() == 2


def test_one_file_unit_then_the_engine_when_live_work_is_due(untied, audio):
    """The scheduler's round (`Scheduler._tick`, what its worker thread runs): the engine's tick, then
    file units back to back only while no live work is due. Live audio arriving during a unit: the
    round ends after that unit, and the next starts with the engine's tick."""
    from harken.cloud.inference.decoder_stream import SessionOptions
    from harken.cloud.inference.engine import Engine, EngineConfig
    from harken.cloud.inference.scheduler import Scheduler
    from harken.edge.pipeline import FeatureStream

    options = SessionOptions(language="English")
    scheduler = Scheduler(Engine(untied, EngineConfig(max_sessions=1, slot_policy=options.policy)),
                          files=FileConfig(max_files=2))
    c = Collect()
    scheduler.files.submit(FileRequest(audio, "English"), c)
    edge = FeatureStream()
    packets = edge.push(audio[:16000 * 6]) + edge.flush()
    halves = [packets[:len(packets) // 2], packets[len(packets) // 2:]]
    assert halves[0] and halves[1]
    sid, _ = scheduler.open_session(options)
    log: list[str] = []
    engine_step, file_step = scheduler.engine.step, scheduler.files.step

    def logged_engine_step(emit=None):
        log.append("tick")
        return engine_step(emit)

    def logged_file_step():
        log.append("unit")
        if len(log) in (4, 9):  # live audio comes in during these units
            for p in halves.pop(0):
                scheduler.engine.ingest_packet(sid, p)
        return file_step()

    scheduler.engine.step = logged_engine_step  # type: ignore[method-assign]
    scheduler.files.step = logged_file_step  # type: ignore[method-assign]
    scheduler.FILE_ROUND_S = 60.0  # no time limit on a round here: only live work ends it
    scheduler._tick(lambda events: None)  # no live work: file units until live audio comes in (4th)
    assert log == ["unit"] * 4
    assert scheduler.engine.has_work()
    scheduler._tick(lambda events: None)
    assert log[4] == "tick" and log[5] == "unit"
    while scheduler.engine.has_work() or scheduler.files.has_work():
        scheduler._tick(lambda events: None)
    first_after_live = [i + 1 for i in (3, 8)]
    assert all(log[i] == "tick" for i in first_after_live), log[:12]
    assert_same(untied, FileRequest(audio, "English"), c.out)


def test_scheduler_files_cancel_and_sessions_unchanged(untied, audio):
    """Through the Scheduler, timing uncontrolled: (a) files sent together are each the offline pass;
    (b) a session fed beside them (a file as a session, cloud/hosting/file_stream.py) has the events
    `stream_audio` gives it alone; (c) a file whose caller is cancelled leaves: its slot and its
    place come back."""
    from harken.cloud.embedded import stream_audio
    from harken.cloud.hosting.file_stream import stream_file_events
    from harken.cloud.inference.decoder_stream import SessionOptions
    from harken.cloud.inference.engine import Engine, EngineConfig
    from harken.cloud.inference.scheduler import Scheduler

    options = SessionOptions(language="English")
    clip = audio[:16000 * 8]
    alone = list(stream_audio(clip, Engine(untied, EngineConfig(max_sessions=1, slot_policy=options.policy)), options))
    reqs = [FileRequest(audio[:16000 * k], "English") for k in (4, 12, 20)]

    async def main():
        scheduler = Scheduler(Engine(untied, EngineConfig(max_sessions=2, slot_policy=options.policy)),
                              files=FileConfig(max_files=2, queue=4))
        await scheduler.start()
        try:
            doomed = asyncio.ensure_future(scheduler.transcribe(audio, "English"))
            while scheduler.files.units["encode"] < 1:
                await asyncio.sleep(0.005)
            doomed.cancel()
            with pytest.raises(asyncio.CancelledError):
                await doomed
            outs = asyncio.gather(*(scheduler.transcribe(r.audio, r.language) for r in reqs))
            events = await stream_file_events(scheduler, clip, options)
            return await outs, events, scheduler
        finally:
            await scheduler.stop()

    outs, events, scheduler = asyncio.run(main())
    for r, out in zip(reqs, outs):
        assert_same(untied, r, out)
    assert [(e.segment_id, e.committed_delta, e.partial, e.is_final, e.start_s, e.end_s) for e in events] == \
        [(e.segment_id, e.committed_delta, e.partial, e.is_final, e.start_s, e.end_s) for e in alone]
    files = scheduler.files
    assert files.pending() == 0 and files.cache.num_free() == 2
    assert files._admitted == 0
