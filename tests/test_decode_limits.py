"""Decode cost bounded by the audio (cloud/model/decode_limits.py): the loop guard's rule, the
audio-proportional budget on the offline path and in the streaming engine, on checkpoints that
never stop (an untied head with silent end-of-text rows) and that repeat one token forever."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from harken.cloud.inference.commit import CommitPolicy
from harken.cloud.model.asr import Qwen3ASR
from harken.cloud.model.decode_limits import DecodeLimits, loop_cut
from harken.cloud.model.tiny import make_tiny_model
from harken.cloud.inference.engine import Engine, EngineConfig
from harken.cloud.inference.decoder_stream import SessionOptions
from streaming import item_tokens, make_segments, run_alone

LIMITS = DecodeLimits()


# --- the rule ------------------------------------------------------------------------------------

@pytest.mark.parametrize("period", [1, 2, 3, 7, 16, 32])
@pytest.mark.parametrize("prefix_len", [0, 5])
def test_loop_cut_keeps_the_text_before_a_run_and_one_copy(period, prefix_len):
    block = list(range(1000, 1000 + period))
    prefix = list(range(prefix_len))
    copies = max(LIMITS.loop_min_repeats, -(-LIMITS.loop_min_tokens // period))
    tokens = prefix + block * copies
    assert LIMITS.loop_cut(tokens) == prefix_len + period
    # one copy fewer (or one token short of the last copy) is not yet a loop at this length
    assert LIMITS.loop_cut(tokens[:-period]) is None
    assert LIMITS.loop_cut(tokens[:-1]) is None


def test_loop_cut_leaves_ordinary_repetition_alone():
    sorry = [40, 2776, 14589, 13]  # "I'm sorry." three times
    assert LIMITS.loop_cut(sorry * 3) is None
    assert LIMITS.loop_cut([7] * (LIMITS.loop_min_tokens - 1)) is None
    assert LIMITS.loop_cut(list(range(200))) is None
    # a block longer than the longest period is never taken for a loop
    long_block = list(range(LIMITS.loop_max_period + 1))
    assert LIMITS.loop_cut(long_block * 4) is None


def test_loop_cut_of_a_run_starting_mid_block():
    # the tail "b c a b c a ..." after a text ending in "a": one rotation of the block is kept
    tokens = [9, 9, 1] + [2, 3, 1] * 10
    keep = loop_cut(tokens, 24, 3, 32)
    assert keep is not None and tokens[:keep] == [9, 9] + [1, 2, 3]


def test_budget_grows_with_the_audio():
    assert LIMITS.budget(0) == LIMITS.base_tokens
    assert LIMITS.budget(10) == LIMITS.base_tokens + 100
    assert LIMITS.budget(60) - LIMITS.budget(30) == 300
    with pytest.raises(ValueError):
        DecodeLimits(tokens_per_second=0)


# --- checkpoints that do not stop ------------------------------------------------------------------

@pytest.fixture(scope="module")
def untied(tmp_path_factory):
    """Never emits end-of-text (`make-tiny-model --head untied`)."""
    d = make_tiny_model(tmp_path_factory.mktemp("untied"), seed=3, head="untied")
    return Qwen3ASR.load(str(d), dtype="fp32", device="cpu")


@pytest.fixture(scope="module")
def repeater(tmp_path_factory):
    """Repeats one token forever: the final norm is zero, so every logit is 0 and greedy picks row 0."""
    d = make_tiny_model(tmp_path_factory.mktemp("repeater"), seed=4, head="untied")
    asr = Qwen3ASR.load(str(d), dtype="fp32", device="cpu")
    with torch.no_grad():
        asr.decoder.model.norm.weight.zero_()
    return asr


def features(seconds: float, seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((128, int(seconds * 100))) * 0.3).astype(np.float32)


def test_untied_head_never_stops_without_limits(untied):
    out = untied.transcribe(features(3), max_new_tokens=300)
    assert len(out.token_ids) == 300  # no end-of-text: the cap is all that ends it


@pytest.mark.parametrize("seconds", [1, 3, 6])
def test_offline_decode_is_bounded_by_the_audio(untied, seconds):
    full = untied.transcribe(features(seconds, seconds), max_new_tokens=512)
    limited = untied.transcribe(features(seconds, seconds), max_new_tokens=512, limits=LIMITS)
    assert 0 < len(limited.token_ids) <= LIMITS.budget(seconds)
    assert limited.token_ids == full.token_ids[:len(limited.token_ids)]  # a cut, not another answer
    assert LIMITS.loop_cut(limited.token_ids) is None


def test_offline_loop_is_cut_to_one_copy(repeater):
    full = repeater.transcribe(features(10), max_new_tokens=60)
    assert len(set(full.token_ids)) == 1  # the rig works: one token over and over
    limited = repeater.transcribe(features(10), max_new_tokens=512, limits=LIMITS)
    assert limited.token_ids == full.token_ids[:1]


def stream(asr, seconds: list[float], policy: CommitPolicy, language: str | None = "English"):
    engine = Engine(asr, EngineConfig(max_sessions=1, slot_policy=policy))
    segments = make_segments(seconds, [0.2] * len(seconds), seed=11)
    events = run_alone(engine, SessionOptions(language=language, policy=policy), segments, [20])
    return engine, segments, events


def test_stream_of_a_model_that_never_stops_is_bounded_by_its_audio(untied):
    policy = CommitPolicy(update_interval_s=1.0)
    engine, segments, events = stream(untied, [4.0, 9.0], policy)
    total_s = sum(s.frames.shape[1] for s in segments) / 100
    updates = sum(s.frames.shape[1] // 100 for s in segments)
    # every update decodes at most its per-update cap, every item at most its audio budget
    assert engine.decoded_tokens <= updates * policy.max_new_tokens_per_update + LIMITS.budget(total_s) * len(segments)
    finals = item_tokens(events)
    for seg in segments:
        (tokens,) = finals[seg.segment_id]
        assert len(tokens) <= LIMITS.budget(seg.frames.shape[1] / 100)
    assert sum(engine.truncations.values()) >= len(segments)  # neither item ended by itself


def test_unlimited_budgets_would_cost_more(untied):
    """The same stream with the audio budget lifted: the work is set by the caps, not the audio."""
    loose = CommitPolicy(update_interval_s=1.0, limits=DecodeLimits(tokens_per_second=1000))
    tight = CommitPolicy(update_interval_s=1.0)
    e_loose, _, _ = stream(untied, [4.0], loose)
    e_tight, _, _ = stream(untied, [4.0], tight)
    assert e_tight.decoded_tokens < e_loose.decoded_tokens


def test_stream_loop_is_cut_and_never_committed(repeater):
    policy = CommitPolicy(update_interval_s=1.0, rollback_tokens=2)
    rows = []  # every generated token is one row of the output head (prefill's last + each step)
    hook = repeater.decoder.lm_head.register_forward_hook(lambda m, i, o: rows.append(o.shape[:-1].numel()))
    try:
        engine, segments, events = stream(repeater, [6.0, 3.0], policy)
    finally:
        hook.remove()
    # the decode work counts the repeats the guard dropped, not only the tokens it kept
    assert engine.decoded_tokens == sum(rows) > 0
    assert sum(engine.decoded_by_pass.values()) == engine.decoded_tokens and engine.decoded_by_pass["final"] > 0
    committed = [tok for toks in item_tokens(events).values() for t in toks for tok in t]
    assert engine.truncations.get("loop", 0) >= len(segments)
    for toks in item_tokens(events).values():
        for t in toks:
            assert LIMITS.loop_cut(list(t)) is None
            assert len(t) <= 2  # one copy of the looping token (and the session went on)
    assert len(committed) <= 2 * len(segments)
    assert {e.segment_id for e in events if e.is_final} == {s.segment_id for s in segments}
