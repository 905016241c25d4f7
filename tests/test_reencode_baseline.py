"""The Phase-1 baseline (lab/bench/reencode_baseline.py): what it decodes is checked against the model's own
one-pass transcription and against a cache-free full recompute; its rollback against the rule.

The model is a tiny random one built in memory (seeded torch init, the tiny checkpoint's
tokenizer): its output head is plain random, so EOS is rare and every update generates tokens,
which exercises the forced prefix.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from harken.cloud.model.asr import Qwen3ASR
from harken.cloud.model.config import Qwen3ASRConfig
from harken.cloud.model.decoder import Qwen3Decoder
from harken.cloud.model.encoder import AudioEncoder
from harken.cloud.model.tiny import ensure_tiny_model
from harken.cloud.model.tokenizer import Tokenizer
from harken.bench.reencode_baseline import Phase1Options, Phase1Stream, forced_prefix, phase1_decode


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny shapes run faster on one thread, and much faster on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def asr() -> Qwen3ASR:
    # not conftest's `asr`: freshly initialised random weights (seed 0), not the cached checkpoint
    cfg = Qwen3ASRConfig.tiny()
    torch.manual_seed(0)
    encoder, decoder = AudioEncoder(cfg.audio), Qwen3Decoder(cfg.text, tie_word_embeddings=True)
    return Qwen3ASR(cfg, encoder, decoder, Tokenizer.from_dir(ensure_tiny_model()))


def features(frames: int, seed: int = 0) -> np.ndarray:
    """Log-mel-like values (the normalised range is about [-1, 1.5])."""
    return (np.random.default_rng(seed).standard_normal((128, frames)) * 0.5).astype(np.float32)


def greedy_reference(asr: Qwen3ASR, feats: np.ndarray, prefix: list[int], new: list[int]) -> list[int]:
    """The greedy tokens a cache-free causal pass predicts over prompt + prefix + new (teacher forced)."""
    _, embeds = asr.prompt_embeddings(feats)
    ids = torch.tensor(prefix + new, dtype=torch.long)
    x = torch.cat([embeds, asr.decoder.embed(ids)])[None]
    with torch.no_grad():
        logits = asr.decoder(x)[0]  # [L, vocab]
    first = embeds.shape[0] + len(prefix) - 1  # predicts new[0]
    return logits[first:first + len(new)].argmax(-1).tolist()


def test_first_update_equals_one_pass_transcription(asr):
    feats = features(450)
    stream = Phase1Stream(asr, Phase1Options(update_interval_s=2.0))
    updates = stream.push(feats)
    assert [u.frames for u in updates] == [200, 400]
    assert updates[0].new_ids, "the random head should generate tokens"
    # no prefix is forced in the first updates: each is a one-pass transcription of all frames so
    # far, cut at 32 tokens
    for u in updates:
        assert u.prefix_ids == []
        assert u.new_ids == asr.transcribe(feats[:, :u.frames], max_new_tokens=32).token_ids


def test_forced_prefix_is_previous_output_minus_k_tokens(asr):
    opts = Phase1Options(update_interval_s=1.0, unfixed_chunk_num=2, unfixed_token_num=5, max_new_tokens=12)
    feats = features(520, seed=1)
    stream = Phase1Stream(asr, opts)
    updates = stream.push(feats[:, :300]) + stream.push(feats[:, 300:])
    tail = stream.finish()
    assert tail is not None and tail.frames == 520
    updates.append(tail)
    assert [u.frames for u in updates] == [100, 200, 300, 400, 500, 520]
    assert updates[0].prefix_ids == [] and updates[1].prefix_ids == []
    for prev, u in zip(updates[1:], updates[2:]):
        assert u.prefix_ids == forced_prefix(prev.token_ids, 5, asr.tokenizer)
        if "\ufffd" not in asr.tokenizer.decode(prev.token_ids[:-5]):
            assert u.prefix_ids == prev.token_ids[:-5]
        assert u.token_ids[:len(u.prefix_ids)] == u.prefix_ids
    # what each update generated after its prefix is the greedy continuation of a full recompute
    for u in updates:
        assert len(u.new_ids) <= 12
        assert u.new_ids == greedy_reference(asr, feats[:, :u.frames], u.prefix_ids, u.new_ids)
    assert stream.finish() is None


def test_forced_prefix_backs_off_out_of_a_split_character(asr):
    tok = asr.tokenizer
    ids = tok.encode("ok \U0001F98A\U0001F98A")  # a fox emoji is several byte-level tokens
    broken = [k for k in range(len(ids)) if "\ufffd" in tok.decode(ids[:len(ids) - k])]
    assert broken, "some cut must fall inside the emoji"
    for k in range(len(ids) + 2):
        kept = forced_prefix(ids, k, tok)
        assert "\ufffd" not in tok.decode(kept)
        assert kept == ids[:len(kept)] and len(kept) <= max(0, len(ids) - k)
        if k not in broken:
            assert kept == ids[:max(0, len(ids) - k)]
        else:
            assert len(kept) < len(ids) - k
    assert forced_prefix([], 5, tok) == []


def test_long_prompts_prefilled_in_pieces_decode_the_same(asr):
    feats = features(450, seed=2)
    prefix = asr.tokenizer.encode("language English<asr_text>hello there")
    whole = phase1_decode(asr, feats, prefix, 8)
    pieces = phase1_decode(asr, feats, prefix, 8, prefill_chunk_tokens=20)
    assert pieces == whole
