"""cloud/model/encoder.py against the official qwen-asr audio tower and against its own full re-encode.

The reference is the official tower with its attention confined to the 8-s windows it computes
(`official.use_windowed_attention`): its stock CPU (sdpa/eager) path drops that mask and attends
across the whole item, unlike its flash-attention and vLLM paths — `test_stock_reference_*` pins it.
"""

from __future__ import annotations

import pytest
import torch
from official import (TINY_AUDIO, audio_tower_state_dict, official_audio_tower, official_model,
                      randomize_parameters_, use_windowed_attention)

from harken.cloud.model.config import AudioEncoderConfig, Qwen3ASRConfig
from harken.cloud.model.encoder import (AudioEncoder, IncrementalEncoder, num_audio_tokens, sinusoid_positions,
                                        window_spans)

LENGTHS = [1, 37, 99, 100, 101, 799, 800, 801, 837, 1234, 1600, 2000]


def tiny_encoder(dtype=torch.float32, seed: int = 0, **overrides) -> AudioEncoder:
    enc = AudioEncoder(AudioEncoderConfig(**{**TINY_AUDIO, **overrides}))
    return randomize_parameters_(enc, seed).to(dtype).eval()


def features(frames: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    # log-mel-like scale: (log10 - 4) / 4 lands mostly in [-1.5, 1.5]
    return torch.randn(128, frames, generator=torch.Generator().manual_seed(seed), dtype=dtype)


@pytest.fixture(scope="module")
def official():
    """The official tiny model, float64, windowed attention; and harken's encoder with its weights."""
    model = use_windowed_attention(official_model(seed=0)).double()
    enc = AudioEncoder(Qwen3ASRConfig.tiny().audio)
    enc.load_state_dict(audio_tower_state_dict(model), strict=True)
    return model, enc.double().eval()


def official_encode(model, feats: torch.Tensor) -> torch.Tensor:
    # as the thinker's forward calls it: padded batch + feature_attention_mask
    t = feats.shape[1]
    batch = torch.zeros(1, 128, t + 57, dtype=feats.dtype)
    batch[0, :, :t] = feats
    mask = torch.zeros(1, t + 57, dtype=torch.long)
    mask[0, :t] = 1
    return model.thinker.get_audio_features(batch, feature_attention_mask=mask)


# --- pure functions ---------------------------------------------------------------------------------


def test_num_audio_tokens_matches_official():
    from qwen_asr.core.transformers_backend.modeling_qwen3_asr import _get_feat_extract_output_lengths

    frames = torch.arange(3001)
    expected = _get_feat_extract_output_lengths(frames).tolist()
    assert [num_audio_tokens(t) for t in range(3001)] == expected
    assert num_audio_tokens(0) == 0 and num_audio_tokens(100) == 13 and num_audio_tokens(800) == 104


def test_window_spans_cover_the_item():
    assert window_spans(0, 800) == []
    assert window_spans(800, 800) == [(0, 800)]
    assert window_spans(1234, 800) == [(0, 800), (800, 1234)]
    # windows hold whole chunks, so their token counts add up to the item's
    for t in (1, 799, 801, 2399, 2401, 3000):
        assert sum(num_audio_tokens(e - s) for s, e in window_spans(t, 800)) == num_audio_tokens(t)


def test_sinusoid_table_is_bit_identical_to_official():
    table = sinusoid_positions(1500, 64)
    ref = official_audio_tower(0, randomize=False).positional_embedding.positional_embedding
    assert table.dtype == torch.float32 and torch.equal(table, ref)


# --- weights ----------------------------------------------------------------------------------------


def test_loads_official_state_dict_strictly(official):
    model, enc = official
    stripped = audio_tower_state_dict(model)
    assert set(enc.state_dict()) == set(stripped)
    fresh = AudioEncoder(Qwen3ASRConfig.tiny().audio).double()
    fresh.load_state_dict(stripped, strict=True)  # raises on any missing/unexpected key or shape
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, stripped[k]), k


# --- full encoder vs the official tower -----------------------------------------------------------


def test_matches_official_float64(official):
    model, enc = official
    worst = 0.0
    with torch.no_grad():
        for i, t in enumerate(LENGTHS):
            feats = features(t, seed=100 + i, dtype=torch.float64)
            ref = official_encode(model, feats)
            out = enc(feats)
            assert out.shape == ref.shape == (num_audio_tokens(t), 64)
            worst = max(worst, (out - ref).abs().max().item())
    assert worst < 1e-6, worst  # measured: ~2e-15


def test_honours_config_fields_like_official():
    """Window size, conv batch splitting, activation and table length taken from the config."""
    overrides = dict(n_window_infer=400, conv_chunksize=3, activation_function="gelu_pytorch_tanh",
                     max_source_positions=20)
    tower = use_windowed_attention(official_audio_tower(seed=3, audio=overrides)).double()
    enc = AudioEncoder(AudioEncoderConfig(**{**TINY_AUDIO, **overrides}))
    enc.load_state_dict(tower.state_dict(), strict=True)
    enc.double().eval()
    assert enc.window_tokens == 52
    with torch.no_grad():
        for t in (37, 450, 1234):
            feats = features(t, seed=t, dtype=torch.float64)
            ref = tower(feats, feature_lens=torch.tensor([t])).last_hidden_state
            assert (enc(feats) - ref).abs().max().item() < 1e-6


def test_stock_reference_attends_across_the_whole_item(official):
    """The official CPU path (stock sdpa) ignores its windows: it equals harken's encoder with one
    window spanning the item, and differs from the windowed model once an item exceeds 8 s."""
    _, enc = official
    stock = official_audio_tower(randomize=False).double()
    stock.load_state_dict(enc.state_dict(), strict=True)  # same weights, stock attention
    whole = AudioEncoder(AudioEncoderConfig(**{**TINY_AUDIO, "n_window_infer": 100_000}))
    whole.load_state_dict(enc.state_dict(), strict=True)
    whole.double().eval()
    feats = features(1234, seed=7, dtype=torch.float64)
    with torch.no_grad():
        ref = stock(feats, feature_lens=torch.tensor([1234])).last_hidden_state
        assert (whole(feats) - ref).abs().max().item() < 1e-6
        assert (enc(feats) - ref).abs().max().item() > 1e-3


# --- batching ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-6), (torch.float32, 1e-5)])
def test_encode_windows_batched_equals_one_at_a_time(dtype, tol):
    enc = tiny_encoder(dtype)
    lengths = [800, 37, 37, 1, 450, 800, 99, 100, 101, 799]
    starts = [True, True, False, False, True, False, True, False, True, False]
    windows = [features(t, seed=i, dtype=dtype) for i, t in enumerate(lengths)]
    with torch.no_grad():
        batched = enc.encode_windows(windows, starts)
        alone = [enc.encode_windows([w], [s])[0] for w, s in zip(windows, starts)]
    for b, a, t in zip(batched, alone, lengths):
        assert b.shape == a.shape == (num_audio_tokens(t), 64)
        assert (b - a).abs().max().item() < tol
    # a window shorter than a chunk is encoded differently as a whole item (unpadded conv, as the
    # reference does) than as a later window of a longer item (tail padded to a full chunk)
    assert (batched[1] - batched[2]).abs().max().item() > 1e-3


def test_encode_items_equals_each_item_alone():
    enc = tiny_encoder(torch.float64)
    items = [features(t, seed=t, dtype=torch.float64) for t in (0, 37, 1234, 800, 2000)]
    with torch.no_grad():
        batched = enc.encode_items(items)
        for item, out in zip(items, batched):
            alone = enc(item)
            assert out.shape == alone.shape == (num_audio_tokens(item.shape[1]), 64)
            assert torch.allclose(out, alone, rtol=0, atol=1e-6)


# --- incremental ------------------------------------------------------------------------------------


def stream_pieces(total: int, seed: int, max_piece: int = 500) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    sizes, done = [], 0
    while done < total:
        k = min(int(torch.randint(1, max_piece + 1, (1,), generator=g)), total - done)
        sizes.append(k)
        done += k
    return sizes


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_incremental_equals_full_reencode_after_every_append(seed):
    """30-s streams in random pieces (1..500 frames); after every append the outputs equal a full
    re-encode of the features so far. Same shapes -> bit-identical while the item is one window;
    an active window recomputed with its cached conv-stem chunks (the stem then runs on fewer
    chunks, another conv batch shape) is within float32 rounding (5e-6) of that window encoded alone."""
    enc = tiny_encoder(torch.float32, seed=seed)
    feats = features(3000, seed=10 + seed)
    inc = IncrementalEncoder(enc)
    done = 0
    with torch.no_grad():
        for k in stream_pieces(3000, seed):
            inc.append(feats[:, done:done + k])
            done += k
            out = inc.outputs()
            full = enc(feats[:, :done])
            c = inc.completed_tokens
            assert out.shape == full.shape == (num_audio_tokens(done), 64)
            assert c == done // 800 * 104
            assert (out - full).abs().max().item() < 1e-5
            if done <= 800:
                assert torch.equal(out, full)
            start = done // 800 * 800
            if start < done and (done - k) // 800 == done // 800:  # no window completed: encoded alone
                active = enc.encode_windows([feats[:, start:done]], [start == 0])[0]
                assert (out[c:] - active).abs().max().item() <= 5e-6
            assert inc.buffered_frames == done - start  # completed windows' features are dropped


def test_incremental_every_append_short_pieces():
    """Many small appends (1..80 frames) across two window boundaries, incl. sub-chunk tails."""
    enc = tiny_encoder(torch.float64, seed=5)
    feats = features(1700, seed=5, dtype=torch.float64)
    inc = IncrementalEncoder(enc)
    done = 0
    with torch.no_grad():
        for k in stream_pieces(1700, seed=5, max_piece=80):
            inc.append(feats[:, done:done + k])
            done += k
            assert (inc.outputs() - enc(feats[:, :done])).abs().max().item() < 1e-6


def test_scheduler_path_batches_sessions():
    """Pending windows of several sessions in one encode_windows batch == each session alone,
    including a result that went stale because frames arrived while it was computing."""
    enc = tiny_encoder(torch.float32, seed=4)
    streams = [features(t, seed=20 + t) for t in (2100, 900, 60)]
    sessions = [IncrementalEncoder(enc) for _ in streams]
    done = [0, 0, 0]
    with torch.no_grad():
        for step in range(6):
            for i, (s, f) in enumerate(zip(sessions, streams)):
                k = [370, 160, 10][i]
                s.append(f[:, done[i]:done[i] + k])
                done[i] = min(done[i] + k, f.shape[1])
            requests = [(s, r) for s in sessions for r in s.pending_windows()]
            outs = enc.encode_windows([r.features for _, r in requests], [r.item_start for _, r in requests])
            if step == 3:  # session 0 gets frames before the batch result lands: its active result is stale
                sessions[0].append(streams[0][:, done[0]:done[0] + 50])
                done[0] += 50
            for (s, r), o in zip(requests, outs):
                s.commit(r, o)
            for s, f, d in zip(sessions, streams, done):
                assert s.frames == d
                active = s.active_window_features()
                if d % 800:
                    assert torch.equal(active, f[:, d // 800 * 800:d])
                else:
                    assert active is None
                assert (s.outputs() - enc(f[:, :d])).abs().max().item() < 1e-5


def test_commit_rejects_wrong_order_and_size():
    enc = tiny_encoder()
    inc = IncrementalEncoder(enc)
    inc.append(features(1700, seed=1))
    first, second, active = inc.pending_windows()
    assert (first.index, second.index, active.index) == (0, 1, 2)
    assert first.complete and second.complete and not active.complete
    with torch.no_grad():
        outs = enc.encode_windows([r.features for r in (first, second)], [True, False])
    with pytest.raises(ValueError, match="out of order"):
        inc.commit(second, outs[1])
    with pytest.raises(ValueError, match="tokens"):
        inc.commit(first, outs[0][:-1])
    with pytest.raises(ValueError):
        inc.append(features(10, seed=2)[:64])


def test_low_precision_runs_close_to_float32():
    """bf16/fp16 weights and activations (the GPU dtypes) give finite outputs near fp32's."""
    ref_enc = tiny_encoder(torch.float32)
    feats = features(1234, seed=9)
    with torch.no_grad():
        ref = ref_enc(feats)
        for dtype in (torch.bfloat16, torch.float16):
            out = tiny_encoder(dtype)(feats)
            assert out.dtype == dtype and torch.isfinite(out).all()
            assert (out.float() - ref).abs().max().item() < 0.1 * ref.abs().max().item()


def test_cached_conv_stems_equal_uncached_and_stem_runs_only_on_new_chunks():
    """The scheduler path with each window's cached conv-stem outputs (`WindowRequest.stem`) gives
    the outputs of the uncached path, batched across sessions and with a stale result; the conv
    stem (`AudioEncoder.stem_chunks`, a plain counter) sees each complete chunk of a window once,
    plus the window's partial tail chunk on each pass; a committed complete window drops its stems."""
    enc = tiny_encoder(torch.float32, seed=6)
    streams = [features(t, seed=30 + t) for t in (2500, 1000, 70)]
    sessions = [IncrementalEncoder(enc) for _ in streams]
    seen = [{} for _ in streams]  # window index -> complete chunks whose stem ran already
    done = [0, 0, 0]
    with torch.no_grad():
        for step in range(12):
            for i, (s, f) in enumerate(zip(sessions, streams)):
                k = [230, 95, 7][i]
                s.append(f[:, done[i]:done[i] + k])
                done[i] = min(done[i] + k, f.shape[1])
            requests = [(i, r) for i, s in enumerate(sessions) for r in s.pending_windows()]
            if not requests:
                continue
            expected = 0
            for i, r in requests:
                cached = seen[i].get(r.index, 0)
                assert (0 if r.stem is None else r.stem.shape[0]) == cached
                t = r.end_frame - r.start_frame
                expected += -(-t // 100) - cached
            feats = [r.features for _, r in requests]
            starts = [r.item_start for _, r in requests]
            before = enc.stem_chunks
            outs, stems = enc.encode_windows(feats, starts, [r.stem for _, r in requests], return_stems=True)
            assert enc.stem_chunks - before == expected
            plain = enc.encode_windows(feats, starts)  # every chunk through the stem again
            assert enc.stem_chunks - before == expected + sum(-(-f.shape[1] // 100) for f in feats)
            for (i, r), o, p, st in zip(requests, outs, plain, stems):
                assert o.shape == p.shape
                assert (o - p).abs().max().item() <= 1e-6
                assert st.shape == ((r.end_frame - r.start_frame) // 100, 13, 64)
            if step == 5:  # session 0 gets frames before the batch result lands: its active result is stale
                sessions[0].append(streams[0][:, done[0]:done[0] + 50])
                done[0] += 50
            for (i, r), o, st in zip(requests, outs, stems):
                sessions[i].commit(r, o, st)
                if not r.complete:
                    seen[i][r.index] = max(seen[i].get(r.index, 0), st.shape[0])
            for i, (s, f, d) in enumerate(zip(sessions, streams, done)):
                assert set(s._stems) <= {d // 800}  # committed complete windows keep no stems
                assert (s.outputs() - enc(f[:, :d])).abs().max().item() < 1e-5
                if d % 800:  # outputs() encoded what was pending (the stale window): all its chunks seen
                    seen[i][d // 800] = max(seen[i].get(d // 800, 0), d % 800 // 100)


def test_incremental_outputs_reuse_stems():
    """`IncrementalEncoder.outputs()` (the simple path) runs the stem on new chunks only: a 30-s
    stream in 250-frame pieces puts each complete chunk through it once, plus a tail per pass."""
    enc = tiny_encoder(torch.float32, seed=7)
    feats = features(3000, seed=7)
    inc, done, tails = IncrementalEncoder(enc), 0, 0
    with torch.no_grad():
        for _ in range(12):
            inc.append(feats[:, done:done + 250])
            done += 250
            inc.outputs()
            tails += done % 100 != 0
            assert torch.equal(inc.outputs(), inc.outputs())  # nothing pending: no stem work
        assert enc.stem_chunks == 3000 // 100 + tails
        assert (inc.outputs() - enc(feats)).abs().max().item() < 1e-5
