"""cloud/inference/decoder_stream.py through the Engine, one session at a time, on the tiny random model (fp32, CPU):
final passes against offline `Qwen3ASR.transcribe` of the same features, token for token; the
segment limit; never-retracted text and one final per segment under random layouts and timings;
input validation; flat state over a fast-forwarded 30-minute stream."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harken.cloud.inference.commit import CommitPolicy, ItemText, compose_context, join_texts
from harken.cloud.model.prompt import collapse_repeats
from harken.cloud.inference.engine import Engine, EngineConfig, slot_tokens
from harken.cloud.inference.decoder_stream import SessionOptions
from harken.shared.errors import StreamInputError, OutOfOrder
from streaming import floored_frames, item_tokens, make_segments, packets, run_alone, segment_texts


def offline(asr, frames, language, context, max_tokens):
    """The reference: one pass over the same features with the engine's normalisation."""
    return asr.transcribe((frames + 4.0) / 4.0, language=language, context=context, max_new_tokens=max_tokens)


def final_events(events):
    return [e for e in events if e.is_final]


@pytest.mark.parametrize("language", [None, "English"])
def test_final_text_equals_offline_transcription(talkative_asr, language):
    """Intermediate commits off: each segment's final pass is offline transcription of its
    features with the context the session carried (the previous segments' text)."""
    policy = CommitPolicy(intermediate_commits=False, max_item_tokens=20, max_new_tokens_per_update=3)
    options = SessionOptions(language=language, context="hot words: harken", policy=policy)
    lengths = [3.3, 9.1, 0.45] if language is None else [8.0, 2.2]
    segments = make_segments(lengths, [0.2, 1.0, 0.7], seed=11 if language is None else 12)
    engine = Engine(talkative_asr, EngineConfig(max_sessions=1, slot_policy=policy))
    events = run_alone(engine, options, segments, [37, 150, 11])
    finals = final_events(events)
    assert [e.segment_id for e in finals] == [s.segment_id for s in segments]
    texts = segment_texts(events)
    tail = ""
    for seg, fin in zip(segments, finals):
        ref = offline(talkative_asr, seg.frames, language, compose_context(options.context, tail), 20)
        assert list(fin.token_ids) == ref.token_ids, seg.segment_id
        whole = ItemText(talkative_asr.tokenizer.token_bytes, fin.language if language else None)
        uncollapsed = whole.update(ref.token_ids, [], True).committed
        assert texts[seg.segment_id] == uncollapsed
        if collapse_repeats(uncollapsed) == uncollapsed:  # no degenerate repetition to collapse
            assert texts[seg.segment_id] == ref.text
        assert fin.language == ref.language or (language and not ref.token_ids)
        # the context carried on: this segment's text after the earlier ones
        piece = texts[seg.segment_id]
        tail = (tail + (join_texts(tail, piece) + piece if piece else ""))[-policy.context_tail_chars:]
        assert fin.resume.context_tail == tail
        assert fin.resume.running_max_log10 == pytest.approx(seg.running_max)
        assert fin.resume.next_segment_id == seg.segment_id + 1
    assert any(len(t) for t in item_tokens(events).values())  # the model did say something


def test_long_segment_is_cut_at_window_boundaries(talkative_asr):
    """A 21-s segment with a 12-s limit: audio items [0, 8), [8, 16), [16, 21) s, each the offline
    transcription of its frames, the later ones with the text so far as context."""
    policy = CommitPolicy(intermediate_commits=False, max_item_tokens=12, max_new_tokens_per_update=2,
                          segment_limit_s=12.0, update_interval_s=2.0)
    options = SessionOptions(context="ctx", policy=policy)
    segments = make_segments([21.0], [0.3], seed=5)
    engine = Engine(talkative_asr, EngineConfig(max_sessions=1, slot_policy=policy))
    events = run_alone(engine, options, segments, [250, 90])
    passes = [e for e in events if e.token_ids is not None]
    assert [e.is_final for e in passes] == [False, False, True]
    assert [e.end_s for e in passes] == [0.3 + 8, 0.3 + 16, 0.3 + 21]
    frames = segments[0].frames
    text = ""
    for e, (a, b) in zip(passes, [(0, 800), (800, 1600), (1600, 2100)]):
        ref = offline(talkative_asr, frames[:, a:b], None, compose_context("ctx", text[-200:]), 12)
        assert list(e.token_ids) == ref.token_ids
        text += e.committed_delta
    assert text == segment_texts(events)[0]


def recompute(asr, frames, language, context, committed, budget):
    """One pass from scratch, no cache reuse: full prompt for `frames` (encoded whole), the committed
    tokens forced after it, then greedy decoding of `budget` tokens in a fresh cache."""
    from harken.cloud.model.decoder import greedy_decode, prefill
    from harken.cloud.model.kv_cache import KVCache

    _, embeds = asr.prompt_embeddings((frames + 4.0) / 4.0, language, context)
    if committed:
        embeds = torch.cat([embeds, asr.decoder.embed(torch.tensor(committed))])
    cache = KVCache.for_config(asr.config.text, max_slots=1, max_len=embeds.shape[0] + budget + 1)
    slot = cache.allocate()
    logits = prefill(asr.decoder, cache, [slot], [embeds])
    return greedy_decode(asr.decoder, cache, [slot], logits, budget, asr.eos_ids)[0]


@pytest.mark.parametrize("agreement", ["local-agreement", "rollback-only"])
def test_every_pass_equals_a_recompute_from_scratch(talkative_asr, agreement):
    """With commits on, each pass (update or final) reuses the slot's KV prefix and the encoder's
    completed windows; its tokens equal a from-scratch pass over the same audio with the same
    committed tokens forced — across a window boundary and a segment cut."""
    policy = CommitPolicy(max_item_tokens=14, max_new_tokens_per_update=4, rollback_tokens=1,
                          segment_limit_s=12.0, update_interval_s=1.5, agreement=agreement)
    options = SessionOptions(context="ctx", policy=policy)
    segments = make_segments([13.5, 2.0], [0.3, 0.4], seed=21 if agreement == "rollback-only" else 22)
    engine = Engine(talkative_asr, EngineConfig(max_sessions=1, slot_policy=policy))
    sid = engine.open_session(options)
    session = engine.session(sid)
    passes = []
    finish = session.finish_job

    def recording_finish(job, tokens, *probs):  # observe each pass as it completes (the model is untouched)
        item = job.item
        passes.append((item.segment_id, item.first_frame, job.frames, job.budget, item.context,
                       list(item.committed), list(tokens)))
        return finish(job, tokens, *probs)

    session.finish_job = recording_finish
    events = []
    for p in packets(segments, [70, 130]):
        engine.ingest(sid, *p)
        events += [e for _, e in engine.run_until_idle()]
    frames = {s.segment_id: s for s in segments}
    assert len(passes) > 10 and any(c for *_, c, _ in passes)  # something was committed on the way
    assert any(first == segments[0].first_frame + 800 for _, first, *_ in passes)  # the cut item
    for seg_id, first, n, budget, context, committed, tokens in passes:
        seg = frames[seg_id]
        a = first - seg.first_frame
        ref = recompute(talkative_asr, seg.frames[:, a:a + n], None, context, committed, budget)
        assert tokens == ref, (seg_id, first, n)
    assert sum(e.is_final for e in events) == 2


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lengths=st.lists(st.floats(0.0, 5.0), min_size=1, max_size=3),
       gaps=st.lists(st.floats(0.0, 2.0), min_size=3, max_size=3),
       pieces_a=st.lists(st.integers(1, 160), min_size=1, max_size=4),
       pieces_b=st.lists(st.integers(1, 400), min_size=1, max_size=4),
       lag=st.integers(1, 4), seed=st.integers(0, 1000), agreement=st.sampled_from(["local-agreement", "rollback-only"]))
def test_random_layouts_and_timings_never_retract_and_finish_every_segment(
        talkative_asr, lengths, gaps, pieces_a, pieces_b, lag, seed, agreement):
    """Whatever the segment layout, packet sizes and how far the engine lags behind the input:
    exactly one final event per segment, in order; the committed text at every event is a prefix of
    the text of the item's final tokens; commits are a function of the features alone."""
    policy = CommitPolicy(max_item_tokens=12, max_new_tokens_per_update=4, rollback_tokens=2,
                          agreement=agreement)
    options = SessionOptions(policy=policy)
    segments = make_segments(lengths, gaps, seed)
    engine = Engine(talkative_asr, EngineConfig(max_sessions=2, slot_policy=policy))

    a = run_alone(engine, options, segments, pieces_a)
    # the other run: other pieces, and the engine only steps every `lag` pieces
    sid = engine.open_session(options)
    b = []
    for i, p in enumerate(packets(segments, pieces_b)):
        engine.ingest(sid, *p)
        if i % lag == 0:
            b += [e for _, e in engine.step()]
    b += [e for _, e in engine.run_until_idle()]

    for events in (a, b):
        finals = final_events(events)
        assert [e.segment_id for e in finals] == [s.segment_id for s in segments]
        assert all(not e.is_final for e in events if e.segment_id in {f.segment_id for f in finals}
                   and events.index(e) > events.index(next(f for f in finals if f.segment_id == e.segment_id)))
        shown: dict[int, str] = {}
        for e in events:
            shown[e.segment_id] = shown.get(e.segment_id, "") + e.committed_delta
            if e.is_final:
                # the text of the final tokens, decoded in one go, is what was committed bit by bit
                whole = ItemText(talkative_asr.tokenizer.token_bytes, None)
                assert whole.update(list(e.token_ids), [], True).committed == shown[e.segment_id]
            assert e.start_s <= e.end_s
    assert segment_texts(a) == segment_texts(b)
    assert item_tokens(a) == item_tokens(b)


def test_ingest_validation_and_duplicates(talkative_asr):
    policy = CommitPolicy(max_item_tokens=8, max_new_tokens_per_update=2)
    engine = Engine(talkative_asr, EngineConfig(max_sessions=2, slot_policy=policy))
    sid = engine.open_session(SessionOptions(policy=policy))
    frames, _ = floored_frames(1.0, 1)
    with pytest.raises(StreamInputError):
        engine.ingest(sid, 0, 0, frames[:100])  # 100 bins
    with pytest.raises(StreamInputError):
        bad = frames.copy()
        bad[3, 4] = np.nan
        engine.ingest(sid, 0, 0, bad)
    assert engine.ingest(sid, 0, 10, frames[:, :50], True) == 50
    assert engine.ingest(sid, 0, 10, frames[:, :50], True) == 0  # a resend: ignored
    assert engine.ingest(sid, 0, 40, frames[:, 30:70]) == 20  # overlapping: only the new part
    with pytest.raises(OutOfOrder):
        engine.ingest(sid, 0, 90, frames[:, 80:90])  # frames 80..89 missing
    with pytest.raises(OutOfOrder):
        engine.ingest(sid, 1, 200, frames[:, :10])  # segment 0 is still open
    assert engine.ingest(sid, 0, 80, frames[:, 70:100], segment_end=True) == 30
    with pytest.raises(OutOfOrder):
        engine.ingest(sid, 0, 110, frames[:, :5])  # after its end
    assert engine.ingest(sid, 0, 80, frames[:, 70:100], segment_end=True) == 0  # resend of the last
    with pytest.raises(OutOfOrder):
        engine.ingest(sid, 2, 50, frames[:, :5])  # starts before segment 0 ended
    events = engine.run_until_idle()
    assert [e.is_final for _, e in events][-1] and events[-1][1].segment_id == 0
    assert engine.ingest(sid, 0, 10, frames[:, :50], True) == 0  # a final segment: ignored
    assert engine.ingest(sid, 3, 300, frames[:, :0], True, True) == 0  # an empty segment
    (s, e), = engine.run_until_idle()
    assert e.is_final and e.segment_id == 3 and e.committed_delta == "" and e.token_ids == ()
    with pytest.raises(StreamInputError):
        engine.open_session(SessionOptions(language="Klingon"))


def test_thirty_minute_stream_keeps_state_bounded(talkative_asr):
    """30 minutes of segments of 5-40 s (some past the 30-s limit, so cut into items), fast-forwarded:
    each segment arrives as one packet and the engine catches up (final passes only, to keep the
    test quick on 2 cores). What the session holds stays within bounds set by the policy and the
    largest packet, not by the stream's length; the second half peaks no higher than the first."""
    policy = CommitPolicy(intermediate_commits=False, max_item_tokens=4)
    engine = Engine(talkative_asr, EngineConfig(max_sessions=1, slot_policy=policy))
    sid = engine.open_session(SessionOptions(context="meeting", policy=policy))
    session = engine.session(sid)
    rng = np.random.default_rng(3)
    base, running = floored_frames(41.0, 99)
    at, seg_id, finals, cuts = 0, 0, 0, 0
    halves: list[dict[str, int]] = [{}, {}]
    total = 30 * 60 * 100

    def measure():
        st = session.state
        enc = [it.encoder for it in st.items if it.encoder is not None]
        sizes = {
            "items": len(st.items),
            "segments": len(st.segments),
            "encoder_outputs": sum(sum(o.numel() for o in e.completed_outputs) for e in enc),
            "encoder_frames": sum(e.buffered_frames for e in enc),
            "pending_frames": sum(sum(p.shape[1] for p in it.pending) + sum(p.shape[1] for p in it.overflow)
                                  for it in st.items),
            "committed": sum(len(it.committed) for it in st.items),
            "context": len(st.context_tail),
            "kv": engine.cache.length(st.slot),
        }
        peak = halves[at >= total // 2]
        for k, v in sizes.items():
            peak[k] = max(peak.get(k, 0), v)

    while at < total:
        length = int(rng.uniform(5, 40) * 100)
        offset = int(rng.integers(0, base.shape[1] - length))
        at += int(rng.uniform(0.3, 30) * 100)  # pauses: the stream is silent (sends nothing) between
        # speech-like frames, a different stretch every segment
        engine.ingest(sid, seg_id, at, base[:, offset:offset + length], True, True, running)
        measure()
        while engine.has_work():
            for _, e in engine.step():
                finals += e.is_final
                cuts += e.token_ids is not None and not e.is_final
            measure()
        at += length
        seg_id += 1
    assert finals == seg_id and cuts > 0
    for peak in halves:
        assert peak["items"] <= 2 and peak["segments"] <= 1
        # the head item's completed windows: at most the cut point's worth (24 s = 3 windows)
        encoder = talkative_asr.encoder
        assert peak["encoder_outputs"] <= 3 * encoder.window_tokens * talkative_asr.config.audio.output_dim
        assert peak["encoder_frames"] <= encoder.window_frames
        # frames not yet encoded: at most the largest packet (40 s)
        assert peak["pending_frames"] <= 4000
        assert peak["committed"] <= policy.max_item_tokens
        assert peak["context"] <= policy.context_tail_chars
        assert peak["kv"] <= slot_tokens(policy)
    # nothing grows with the stream: the second quarter of an hour peaks no higher than the first
    assert all(halves[1][k] <= halves[0][k] for k in ("items", "segments", "encoder_frames", "committed",
                                                      "context"))


def test_keyterms_set_mid_stream_take_effect_at_the_next_item_as_its_offline_context(talkative_asr):
    """A `Configure` between two segments: the first item is decoded with the session's keyterms as
    they were, the second with the new ones; each item's final pass (no intermediate commits) is the
    offline pass of its frames with that context (`model_context`, the official package's context)."""
    import numpy as np

    asr = talkative_asr

    from harken.cloud.embedded import stream_pieces
    from harken.cloud.inference.commit import CommitPolicy
    from harken.cloud.inference.engine import Engine, EngineConfig
    from harken.cloud.inference.decoder_stream import SessionOptions
    from harken.cloud.model.decode_limits import DecodeLimits
    from harken.shared.codec import decode_frames
    from harken.shared.protocol import Configure, model_context
    from signals import concat, silence, speech

    audio = concat(silence(0.3), speech("Hello there."), silence(0.8), speech("Second one."), silence(0.6))
    first_end = int((0.3 + speech("Hello there.").size / 16000 + 0.6) * 16000) // 1600 * 1600
    pieces = [audio[i:i + 1600] for i in range(0, first_end, 1600)]
    pieces += [Configure(("harken", "Qwen"), context="notes")]
    pieces += [audio[i:i + 1600] for i in range(first_end, audio.size, 1600)]
    policy = CommitPolicy(intermediate_commits=False)
    options = SessionOptions(context="meeting", policy=policy)
    packets: list = []
    engine = Engine(asr, EngineConfig(max_sessions=1, max_batch=1, slot_policy=policy))
    events = list(stream_pieces(pieces, engine, options, on_packet=packets.append))
    finals = [e for e in events if e.is_final]
    assert len(finals) == 2
    first_text = "".join(e.committed_delta for e in events if e.segment_id == finals[0].segment_id)
    # (the second item's context carries the first one's committed text, as every next item's does)
    contexts = ["meeting", compose_context(model_context("notes", ("harken", "Qwen")), first_text[-200:])]
    for final, context in zip(finals, contexts):
        frames = np.concatenate([decode_frames(p.payload) for p in packets if p.segment_id == final.segment_id], axis=1)
        offline = asr.transcribe((frames + 4.0) / 4.0, context=context, limits=DecodeLimits())
        assert list(final.token_ids) == offline.token_ids, (final.segment_id, context)
    other = asr.transcribe((frames + 4.0) / 4.0, context=compose_context("meeting", first_text[-200:]),
                           limits=DecodeLimits())
    assert other.token_ids != list(finals[1].token_ids)  # the context did change what the model wrote


@pytest.mark.parametrize("language", [None, "English"])
def test_word_confidence_is_the_models_probability_of_its_tokens(talkative_asr, language):
    """Each final's `word_confidence` is, per word of the item's text, the mean probability of the
    word's tokens, as a cache-free teacher-forced forward over [prompt + the item's tokens] gives it
    (independent of the engine's cache, batches and self-speculation). Tokens the final pass decides;
    a token an update committed keeps the probability it had in that pass (less audio heard)."""
    from harken.cloud.inference.commit import word_confidences
    from harken.cloud.model.prompt import forced_language

    for policy in (CommitPolicy(intermediate_commits=False, max_item_tokens=20, max_new_tokens_per_update=3),):
        options = SessionOptions(language=language, context="hot words: harken", policy=policy)
        segments = make_segments([3.3, 2.2], [0.2, 1.0], seed=31)
        engine = Engine(talkative_asr, EngineConfig(max_sessions=1, slot_policy=policy))
        events = run_alone(engine, options, segments, [37, 150])
        texts = segment_texts(events)
        tail = ""
        for seg, fin in zip(segments, final_events(events)):
            ids = list(fin.token_ids)
            assert ids and len(fin.word_confidence) == len(texts[seg.segment_id].split())
            context = compose_context(options.context, tail)
            _, embeds = talkative_asr.prompt_embeddings((seg.frames + 4.0) / 4.0, language, context)
            forced = torch.cat([embeds, talkative_asr.decoder.embed(torch.tensor(ids))])
            with torch.no_grad():
                logits = talkative_asr.decoder(forced[None])[0]  # every position, no cache
            probs = torch.softmax(logits[embeds.shape[0] - 1:-1].float(), -1)[torch.arange(len(ids)), ids].tolist()
            expected = word_confidences(talkative_asr.tokenizer.token_bytes, ids, probs, forced_language(language))
            assert fin.word_confidence == pytest.approx(expected, abs=2e-4)
            assert all(0.0 <= c <= 1.0 for c in fin.word_confidence)
            piece = texts[seg.segment_id]
            tail = (tail + (join_texts(tail, piece) + piece if piece else ""))[-policy.context_tail_chars:]
