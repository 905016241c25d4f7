"""Qwen3 decoder and KV cache: against transformers' Qwen3 and the official Qwen3-ASR thinker (float64),
and cached/batched decoding against a full recompute and against each sequence alone (float32)."""

from __future__ import annotations

import copy

import pytest
import torch

from official import official_model, randomize_parameters_
from harken.cloud.model.config import Qwen3ASRConfig
from harken.cloud.model.decoder import Qwen3Decoder, decode_step, greedy_decode, prefill
from harken.cloud.model.kv_cache import KVCache, KVCacheFull
from harken.cloud.model.static_decode import StaticDecodeStep

AUDIO_PAD, AUDIO_START, AUDIO_END = 151676, 151669, 151670
IM_START, IM_END = 151644, 151645


def thinker_decoder_state_dict(model) -> dict[str, torch.Tensor]:
    """The official `thinker.model.*` / `thinker.lm_head.*` weights, `thinker.` stripped."""
    return {k[len("thinker."):]: v for k, v in model.state_dict().items()
            if k.startswith(("thinker.model.", "thinker.lm_head."))}


@pytest.fixture(scope="module")
def official():
    return official_model(seed=3)


@pytest.fixture(scope="module")
def decoder(official):
    """fp32 harken decoder with the official tiny model's weights."""
    dec = Qwen3Decoder(Qwen3ASRConfig.from_dict(official.config.to_dict()).text).eval()
    dec.load_official_state_dict(thinker_decoder_state_dict(official))
    return dec


def new_cache(dec: Qwen3Decoder, slots: int = 8, max_len: int = 128, dtype=torch.float32) -> KVCache:
    return KVCache.for_config(dec.config, max_slots=slots, max_len=max_len, dtype=dtype)


def prompt_embeds(dec: Qwen3Decoder, n: int, seed: int) -> torch.Tensor:
    """[n, hidden]: token embeddings with an 'audio' stretch of arbitrary vectors in the middle, as the
    caller writes encoder outputs over <|audio_pad|> rows."""
    g = torch.Generator().manual_seed(seed)
    x = dec.embed(torch.randint(0, 151000, (n,), generator=g)).detach().clone()
    a, b = n // 4, n // 4 + n // 2
    x[a:b] = torch.randn(b - a, x.shape[1], generator=g, dtype=x.dtype)
    return x


def full_logits(dec: Qwen3Decoder, embeds: torch.Tensor) -> torch.Tensor:
    """Cache-free recompute: [S, hidden] -> [S, vocab]."""
    with torch.no_grad():
        return dec(embeds[None])[0]


def stepwise_decode(dec, cache, slot, first_logits, n):
    """Greedy one slot by hand: tokens and the logits each one was chosen from."""
    tokens, logits = [], [first_logits]
    for _ in range(n):
        tokens.append(int(logits[-1].argmax()))
        logits.append(decode_step(dec, cache, [slot], torch.tensor([tokens[-1]]))[0])
    return tokens, torch.stack(logits[:-1])


# --- against independent implementations, float64 ------------------------------------------------

@pytest.mark.parametrize("tied", [True, False])
def test_forward_matches_transformers_qwen3_float64(tied):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3ASRConfig.tiny().text
    hf_cfg = Qwen3Config(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                         intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_hidden_layers,
                         num_attention_heads=cfg.num_attention_heads,
                         num_key_value_heads=cfg.num_key_value_heads,
                         head_dim=cfg.head_dim, rope_theta=cfg.rope_theta, rms_norm_eps=cfg.rms_norm_eps,
                         tie_word_embeddings=tied, attn_implementation="sdpa")
    torch.manual_seed(0)
    hf = randomize_parameters_(Qwen3ForCausalLM(hf_cfg).eval(), seed=1).double()
    dec = Qwen3Decoder(cfg, tie_word_embeddings=tied)
    dec.load_official_state_dict(hf.state_dict())
    dec = dec.double()
    assert (dec.lm_head.weight is dec.model.embed_tokens.weight) == tied

    ids = torch.randint(0, 151000, (2, 37), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = hf(input_ids=ids).logits
        ours = dec(dec.embed(ids))
    assert (ours - ref).abs().max().item() <= 1e-6

    # the cached path agrees too: prefill two sequences in one batch, then one decode step
    cache = new_cache(dec, slots=2, dtype=torch.float64)
    s0, s1 = cache.allocate(), cache.allocate()
    last = prefill(dec, cache, [s0, s1], [dec.embed(ids[0, :30]), dec.embed(ids[1, :17])])
    assert (last - torch.stack([ref[0, 29], ref[1, 16]])).abs().max().item() <= 1e-6
    step = decode_step(dec, cache, [s0, s1], torch.stack([ids[0, 30], ids[1, 17]]))
    assert (step - torch.stack([ref[0, 30], ref[1, 17]])).abs().max().item() <= 1e-6


def test_matches_official_thinker_with_audio_float64(official):
    """The official thinker, fed input_ids with <|audio_pad|> rows, audio features and an attention
    mask (its interleaved-MRoPE path, positions from the mask), equals harken's decoder run as a
    plain 1-D-RoPE causal LM with the official audio embeddings written into those rows."""
    off = copy.deepcopy(official).double()  # the module fixture stays fp32
    dec = Qwen3Decoder(Qwen3ASRConfig.from_dict(off.config.to_dict()).text)
    dec.load_official_state_dict(thinker_decoder_state_dict(off))
    dec = dec.double().eval()

    g = torch.Generator().manual_seed(4)
    frames = 130
    features = torch.randn(1, 128, frames, generator=g, dtype=torch.float64)
    feature_mask = torch.ones(1, frames, dtype=torch.long)
    with torch.no_grad():
        audio = off.thinker.get_audio_features(features, feature_attention_mask=feature_mask)  # [N, hidden]
    n_audio = audio.shape[0]
    text = lambda n: torch.randint(0, 151000, (n,), generator=g).tolist()  # noqa: E731
    ids = torch.tensor([[IM_START, *text(6), IM_END, IM_START, *text(2), AUDIO_START, *[AUDIO_PAD] * n_audio,
                         AUDIO_END, IM_END, IM_START, *text(3), *text(5)]])
    with torch.no_grad():
        ref = off.thinker(input_ids=ids, input_features=features, feature_attention_mask=feature_mask,
                          attention_mask=torch.ones_like(ids)).logits[0]  # [L, vocab]
        embeds = dec.embed(ids[0]).clone()
        embeds[ids[0] == AUDIO_PAD] = audio
        ours = dec(embeds[None])[0]
    assert (ours - ref).abs().max().item() <= 1e-6

    cache = new_cache(dec, slots=1, dtype=torch.float64)
    slot = cache.allocate()
    last = prefill(dec, cache, [slot], [embeds])[0]
    assert (last - ref[-1]).abs().max().item() <= 1e-6


def test_bf16_as_accurate_as_official_bf16(official):
    """In bf16 (the released weights' dtype) harken's cached decoding is as close to the float64
    truth as the official thinker's bf16 forward is: same rounding points (float32 RoPE angles and
    RMSNorm), no extra error from the cache or the packed layout."""
    ids = torch.randint(0, 151000, (1, 40), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        mask = torch.ones_like(ids)
        truth = copy.deepcopy(official).double().thinker(input_ids=ids, attention_mask=mask).logits[0]
        off16 = copy.deepcopy(official).to(torch.bfloat16)
        ref = off16.thinker(input_ids=ids, attention_mask=mask).logits[0].double()
    dec = Qwen3Decoder(Qwen3ASRConfig.from_dict(official.config.to_dict()).text)
    dec.load_official_state_dict(thinker_decoder_state_dict(official))
    dec = dec.to(torch.bfloat16).eval()
    cache = new_cache(dec, slots=1, max_len=64, dtype=torch.bfloat16)
    s = cache.allocate()
    logits = [prefill(dec, cache, [s], [dec.embed(ids[0, :20])])[0]]
    for i in range(20, 39):
        logits.append(decode_step(dec, cache, [s], ids[0, i:i + 1])[0])
    ours = torch.stack(logits).double()  # positions 19..38

    off_err, our_err = (ref[19:39] - truth[19:39]).abs(), (ours - truth[19:39]).abs()
    assert our_err.max() <= 1.25 * off_err.max()
    assert our_err.mean() <= 1.25 * off_err.mean()


# --- the KV cache, float32 -----------------------------------------------------------------------

def test_cached_decoding_equals_full_recompute(decoder):
    dec, cache = decoder, new_cache(decoder)
    prompt = prompt_embeds(dec, 21, seed=5)
    slot = cache.allocate()
    first = prefill(dec, cache, [slot], [prompt])
    tokens, step_logits = stepwise_decode(dec, cache, slot, first[0], 12)
    assert cache.length(slot) == 21 + 12

    seq = torch.cat([prompt, dec.embed(torch.tensor(tokens[:-1]))])
    ref = full_logits(dec, seq)[20:]  # the logits that chose each new token
    assert ref.argmax(-1).tolist() == tokens
    assert (step_logits - ref).abs().max().item() <= 1e-5

    # greedy_decode on a fresh slot chooses the same tokens
    slot2 = cache.allocate()
    got = greedy_decode(dec, cache, [slot2], prefill(dec, cache, [slot2], [prompt]), 12, eos_ids=())
    assert got == [tokens]
    assert cache.length(slot2) == 21 + 11  # the last token is returned, not fed


def test_prefill_in_pieces_equals_one_prefill(decoder):
    dec, cache = decoder, new_cache(decoder)
    x = prompt_embeds(dec, 30, seed=6)
    whole, pieces = cache.allocate(), cache.allocate()
    ref = prefill(dec, cache, [whole], [x])
    prefill(dec, cache, [pieces], [x[:10]])
    prefill(dec, cache, [pieces], [x[10:11]])
    got = prefill(dec, cache, [pieces], [x[11:]])
    assert (got - ref).abs().max().item() <= 1e-5
    assert cache.length(pieces) == cache.length(whole) == 30
    for store in (cache.k, cache.v):
        assert (store[:, pieces, :, :30] - store[:, whole, :, :30]).abs().max().item() <= 1e-5


def test_truncate_then_redecode_equals_fresh_decode(decoder):
    dec, cache = decoder, new_cache(decoder)
    prompt = prompt_embeds(dec, 16, seed=7)
    slot = cache.allocate()
    first = prefill(dec, cache, [slot], [prompt])
    hyp = greedy_decode(dec, cache, [slot], first, 8, eos_ids=())[0]

    # roll back to the prompt + 3 kept tokens, then append a different continuation and decode
    cache.truncate(slot, 16 + 3)
    suffix = prompt_embeds(dec, 5, seed=8)
    rolled = prefill(dec, cache, [slot], [suffix])
    rolled_tokens, rolled_logits = stepwise_decode(dec, cache, slot, rolled[0], 6)

    fresh = cache.allocate()
    seq = torch.cat([prompt, dec.embed(torch.tensor(hyp[:3])), suffix])
    fresh_first = prefill(dec, cache, [fresh], [seq])
    fresh_tokens, fresh_logits = stepwise_decode(dec, cache, fresh, fresh_first[0], 6)
    assert rolled_tokens == fresh_tokens
    assert (rolled_logits - fresh_logits).abs().max().item() <= 1e-5
    assert cache.length(slot) == cache.length(fresh) == 16 + 3 + 5 + 6


def test_prefill_tails_are_the_logits_of_stepwise_decoding(decoder):
    # what self-speculative decoding reads: the logits after each drafted token, from one prefill
    dec, cache = decoder, new_cache(decoder)
    prompts = [prompt_embeds(dec, 14, seed=20), prompt_embeds(dec, 9, seed=21)]
    slots = [cache.allocate(), cache.allocate()]
    refs = []
    for slot, p in zip(slots, prompts):
        tokens, logits = stepwise_decode(dec, cache, slot, prefill(dec, cache, [slot], [p])[0], 6)
        refs.append((tokens, logits))
    drafted = [cache.allocate(), cache.allocate()]
    seqs = [torch.cat([p, dec.embed(torch.tensor(t[:k]))]) for p, (t, _), k in zip(prompts, refs, (5, 2))]
    got = prefill(dec, cache, drafted, seqs, tails=[6, 3])
    assert got.shape == (9, dec.lm_head.out_features)
    assert (got[:6] - refs[0][1]).abs().max().item() <= 1e-5
    assert (got[6:] - refs[1][1][:3]).abs().max().item() <= 1e-5
    assert got[:6].argmax(-1).tolist() == refs[0][0]
    assert cache.length(drafted[0]) == 14 + 5 and cache.length(drafted[1]) == 9 + 2
    with pytest.raises(ValueError, match="tails"):
        prefill(dec, cache, [drafted[0]], [seqs[0]], tails=[0])
    with pytest.raises(ValueError, match="tails"):
        prefill(dec, cache, [drafted[0]], [seqs[0][:3]], tails=[4])


@pytest.mark.parametrize("n_slots, slots", [
    (6, [4, 1, 5, 0]),  # a short range with idle slots 2, 3: attention reads a view of the cache
    (12, [11, 0, 6, 3]),  # spread out: attention gathers the four slots
])
def test_batch_of_different_lengths_equals_each_alone(decoder, n_slots, slots):
    dec = decoder
    prefixes = [3, 0, 17, 9]  # already cached before the batched call
    news = [5, 23, 1, 40]
    seqs = [prompt_embeds(dec, p + n, seed=10 + i) for i, (p, n) in enumerate(zip(prefixes, news))]

    alone_tokens, alone_first = [], []
    for p, x in zip(prefixes, seqs):
        cache = new_cache(dec, slots=1)
        s = cache.allocate()
        if p:
            prefill(dec, cache, [s], [x[:p]])
        first = prefill(dec, cache, [s], [x[p:]])
        alone_first.append(first[0])
        alone_tokens.append(greedy_decode(dec, cache, [s], first, 10, eos_ids=())[0])

    cache = new_cache(dec, slots=n_slots)
    for _ in range(n_slots):
        cache.allocate()
    for s, p, x in zip(slots, prefixes, seqs):
        if p:
            prefill(dec, cache, [s], [x[:p]])
    first = prefill(dec, cache, slots, [x[p:] for p, x in zip(prefixes, seqs)])
    assert (first - torch.stack(alone_first)).abs().max().item() <= 1e-4
    assert greedy_decode(dec, cache, slots, first, 10, eos_ids=()) == alone_tokens


def test_slots_join_and_leave_between_steps(decoder):
    """A scheduler's ticks: B joins after A has decoded 3 tokens; A leaves early; results equal
    each sequence decoded alone."""
    dec = decoder
    xa, xb = prompt_embeds(dec, 12, seed=20), prompt_embeds(dec, 25, seed=21)
    ref = {}
    for name, x, n in (("a", xa, 6), ("b", xb, 8)):
        cache = new_cache(dec, slots=1)
        s = cache.allocate()
        ref[name] = stepwise_decode(dec, cache, s, prefill(dec, cache, [s], [x])[0], n)

    cache = new_cache(dec, slots=4)
    a, b = cache.allocate(), cache.allocate()
    out = {"a": ([], []), "b": ([], [])}
    pending = {"a": prefill(dec, cache, [a], [xa])[0]}
    slot_of = {"a": a, "b": b}
    for tick in range(20):
        if tick == 3:
            pending["b"] = prefill(dec, cache, [b], [xb])[0]
        names = [n for n in ("b", "a") if n in pending and len(out[n][0]) < len(ref[n][0])]
        if not names:
            break
        toks = []
        for n in names:
            out[n][0].append(int(pending[n].argmax()))
            out[n][1].append(pending[n])
            toks.append(out[n][0][-1])
        logits = decode_step(dec, cache, [slot_of[n] for n in names], torch.tensor(toks))
        pending.update(zip(names, logits))
    for n in ("a", "b"):
        assert out[n][0] == ref[n][0]
        assert (torch.stack(out[n][1]) - ref[n][1]).abs().max().item() <= 1e-4


def test_static_kv_len_equals_dynamic(decoder):
    """Attending over the whole max_len (shapes fixed by the batch size: graph-capture friendly)
    changes nothing: the mask hides every position beyond a slot's length."""
    dec = decoder
    x = [prompt_embeds(dec, 9, seed=30), prompt_embeds(dec, 14, seed=31)]
    results = []
    for kv_len in (None, 64):
        cache = new_cache(dec, slots=2, max_len=64)
        slots = [cache.allocate(), cache.allocate()]
        first = prefill(dec, cache, slots, x, kv_len=kv_len)
        logits = decode_step(dec, cache, slots, first.argmax(-1), kv_len=kv_len)
        results.append(torch.cat([first, logits]))
    assert (results[0] - results[1]).abs().max().item() <= 1e-5


def test_static_decode_step_equals_decode_step(decoder):
    """The capture-friendly step (batch padded to a bucket, keys to a length bucket, padding rows
    on a scratch slot; run eagerly here) gives decode_step's results while slots join and leave."""
    dec = decoder
    lengths = [7, 30, 12, 3, 21]
    xs = [prompt_embeds(dec, n, seed=70 + i) for i, n in enumerate(lengths)]
    caches = {}
    for name in ("dynamic", "static"):
        cache = new_cache(dec, slots=8, max_len=64)
        slots = [cache.allocate() for _ in xs]
        caches[name] = (cache, slots, prefill(dec, cache, slots, xs))
    static = StaticDecodeStep(dec, caches["static"][0], max_batch=8, min_kv_len=16)
    assert static.scratch not in caches["static"][1]

    tokens = {name: caches[name][2].argmax(-1) for name in caches}
    for tick, rows in enumerate([[0, 1, 2, 3, 4], [0, 2, 4], [1], [3, 4, 0], [0, 1, 2, 3, 4], [2, 3]]):
        out = {}
        for name, step in (("dynamic", lambda s, t: decode_step(dec, caches["dynamic"][0], s, t)),
                           ("static", static)):
            cache, slots, _ = caches[name]
            out[name] = step([slots[r] for r in rows], tokens[name][rows])
            tokens[name] = tokens[name].clone()
            tokens[name][rows] = out[name].argmax(-1)
        assert torch.equal(tokens["static"], tokens["dynamic"]), tick
        assert (out["static"] - out["dynamic"]).abs().max().item() <= 1e-5
    dyn_cache, dyn_slots, _ = caches["dynamic"]
    st_cache, st_slots, _ = caches["static"]
    assert [dyn_cache.length(s) for s in dyn_slots] == [st_cache.length(s) for s in st_slots]
    assert st_cache.length(static.scratch) == 0


def test_slots_reused_without_reallocation(decoder):
    """Many requests through a 2-slot cache: storage is never reallocated, and stale data left in a
    reused slot (a longer earlier request) never leaks into a later one."""
    dec = decoder
    cache = new_cache(dec, slots=2, max_len=96)
    ptrs = (cache.k.data_ptr(), cache.v.data_ptr())
    k_obj, v_obj = cache.k, cache.v
    lengths = [60, 7, 33, 5, 70, 2]
    for i, n in enumerate(lengths):
        x = prompt_embeds(dec, n, seed=40 + i)
        s = cache.allocate()
        other = cache.allocate() if i % 2 else None  # sometimes both slots busy
        first = prefill(dec, cache, [s], [x])
        got = greedy_decode(dec, cache, [s], first, 6, eos_ids=())[0]

        fresh = new_cache(dec, slots=1, max_len=96)
        fs = fresh.allocate()
        fresh_first = prefill(dec, fresh, [fs], [x])
        assert got == greedy_decode(dec, fresh, [fs], fresh_first, 6, eos_ids=())[0]
        assert (first - fresh_first).abs().max().item() <= 1e-5
        cache.free(s)
        if other is not None:
            cache.free(other)
    assert cache.k is k_obj and cache.v is v_obj
    assert (cache.k.data_ptr(), cache.v.data_ptr()) == ptrs
    assert cache.num_free() == 2


def test_greedy_decode_stops_at_eos_and_drops_finished(decoder):
    dec = decoder
    cache = new_cache(dec, slots=3)
    xs = [prompt_embeds(dec, 10 + 3 * i, seed=50 + i) for i in range(3)]
    slots = [cache.allocate() for _ in xs]
    first = prefill(dec, cache, slots, xs)
    free_run = greedy_decode(dec, cache, slots, first, 8, eos_ids=())
    # declare the 3rd token of sequence 0 an EOS: it stops there, the others run on unchanged
    eos = free_run[0][2]
    for s in slots:
        cache.truncate(s, cache.length(s) - 7)
    stopped = greedy_decode(dec, cache, slots, first, 8, eos_ids=[eos])
    for full, got in zip(free_run, stopped):
        cut = full.index(eos) + 1 if eos in full else len(full)
        assert got == full[:cut]
    assert cache.length(slots[0]) == 10 + free_run[0].index(eos)  # tokens before the EOS were fed


def test_errors(decoder):
    dec = decoder
    cache = new_cache(dec, slots=1, max_len=8)
    s = cache.allocate()
    with pytest.raises(KVCacheFull):
        cache.allocate()
    with pytest.raises(KVCacheFull):
        prefill(dec, cache, [s], [prompt_embeds(dec, 9, seed=60)])
    assert cache.length(s) == 0  # a refused call reserves nothing
    prefill(dec, cache, [s], [prompt_embeds(dec, 8, seed=60)])
    with pytest.raises(KVCacheFull):
        decode_step(dec, cache, [s], torch.tensor([1]))
    with pytest.raises(ValueError):
        cache.truncate(s, 9)
    cache.free(s)
    with pytest.raises(ValueError):
        cache.length(s)
    wrong = new_cache(dec, slots=1, max_len=8, dtype=torch.float64)
    ws = wrong.allocate()
    with pytest.raises(ValueError, match="KV cache"):
        prefill(dec, wrong, [ws], [prompt_embeds(dec, 3, seed=61)])
    assert wrong.length(ws) == 0
    sd = {k: v for k, v in dec.state_dict().items() if k != "model.norm.weight"}
    with pytest.raises(ValueError, match="model.norm.weight"):
        Qwen3Decoder(dec.config).load_official_state_dict(sd)
    with pytest.raises(ValueError, match="unexpected"):
        Qwen3Decoder(dec.config).load_official_state_dict({**dec.state_dict(), "model.extra": torch.zeros(1)})


# --- GPU (`make test-gpu`) -----------------------------------------------------------------------

@pytest.mark.gpu
def test_cuda_cached_decoding_and_graph_replay(decoder):
    """On CUDA: fp32 cached decoding equals the CPU's; in bf16, replaying captured CUDA graphs gives
    exactly what the same static step computes eagerly."""
    xs = [prompt_embeds(decoder, n, seed=80 + i) for i, n in enumerate([9, 33, 17])]
    cpu_cache = new_cache(decoder, slots=4)
    cpu_slots = [cpu_cache.allocate() for _ in xs]
    cpu_first = prefill(decoder, cpu_cache, cpu_slots, xs)
    cpu_tokens = greedy_decode(decoder, cpu_cache, cpu_slots, cpu_first, 8, eos_ids=())

    gpu = copy.deepcopy(decoder).cuda()
    cache = KVCache.for_config(gpu.config, max_slots=4, max_len=128, device="cuda")
    slots = [cache.allocate() for _ in xs]
    first = prefill(gpu, cache, slots, [x.cuda() for x in xs])
    assert (first.cpu() - cpu_first).abs().max().item() <= 1e-4
    assert greedy_decode(gpu, cache, slots, first, 8, eos_ids=()) == cpu_tokens

    bf16 = copy.deepcopy(decoder).to("cuda", torch.bfloat16)
    results = []
    for graphs in (False, True):
        cache = KVCache.for_config(bf16.config, max_slots=8, max_len=128, dtype=torch.bfloat16, device="cuda")
        slots = [cache.allocate() for _ in xs]
        logits = prefill(bf16, cache, slots, [x.to("cuda", torch.bfloat16) for x in xs])
        step = StaticDecodeStep(bf16, cache, max_batch=4, cuda_graphs=graphs, min_kv_len=64)
        out = []
        for rows in ([0, 1, 2], [1], [0, 2], [0, 1, 2]) * 3:
            tok = logits.argmax(-1)
            new = step([slots[r] for r in rows], tok[rows])
            logits = logits.clone()
            logits[rows] = new
            out.append(new.float().cpu())
        results.append(out)
    for eager, replayed in zip(*results):
        assert torch.equal(eager, replayed)


def test_output_head_skips_zero_rows_with_the_same_logits():
    """A head most of whose rows are zero (a model trained on a part of the vocabulary, as synth-en)
    computes the live rows only, on the CPU without gradients: the logits of the full product, the
    zero rows exactly 0; with gradients it is the plain product; an edit of the weights is seen."""
    from harken.cloud.model.decoder import OutputHead

    torch.manual_seed(0)
    head = OutputHead(32, 5000)
    with torch.no_grad():
        head.weight.zero_()
        live = torch.randperm(5000)[:300]
        head.weight[live] = torch.randn(300, 32)
    x = torch.randn(2, 7, 32) * 4  # any leading shape
    dense = torch.nn.functional.linear(x, head.weight).detach()
    with torch.no_grad():
        rows = head.live_rows()
        assert rows is not None and sorted(rows[0].tolist()) == sorted(live.tolist())
        sparse = head(x)
    assert sparse.shape == dense.shape and torch.allclose(sparse, dense, rtol=0, atol=1e-5)
    assert torch.equal(sparse.argmax(-1), dense.argmax(-1))
    dead = torch.ones(5000, dtype=torch.bool)
    dead[live] = False
    assert torch.equal(sparse[..., dead], torch.zeros_like(sparse[..., dead]))
    assert torch.equal(torch.softmax(sparse, -1).argmax(-1), torch.softmax(dense, -1).argmax(-1))

    assert head.live_rows() is None  # gradients enabled: the plain product, which autograd differentiates
    head(x).sum().backward()
    assert head.weight.grad is not None and head.weight.grad[dead].abs().sum() > 0

    with torch.no_grad():
        head.weight[dead.nonzero()[0, 0]] = 1.0  # one more live row: found again
        rows = head.live_rows()
        assert rows is not None and rows[0].numel() == 301
        assert torch.allclose(head(x), torch.nn.functional.linear(x, head.weight), rtol=0, atol=1e-5)
        head.weight.fill_(1.0)  # no zero rows at all: the full product
        assert head.live_rows() is None


def test_decoder_output_head_is_the_embedding_when_tied(decoder):
    """The tied head stays the embedding matrix (one parameter), and a decoder whose vocabulary is
    mostly zero rows decodes the tokens it decodes with the full product."""
    from harken.cloud.model.decoder import OutputHead

    dec = copy.deepcopy(decoder)
    assert isinstance(dec.lm_head, OutputHead)
    assert dec.lm_head.weight is dec.model.embed_tokens.weight or not dec.tied
    with torch.no_grad():
        w = dec.lm_head.weight
        keep = torch.zeros(w.shape[0], dtype=torch.bool)
        keep[torch.randperm(w.shape[0])[: w.shape[0] // 4]] = True
        w[~keep] = 0.0
    embeds = prompt_embeds(dec, 9, seed=3)
    cache = new_cache(dec)
    slot = cache.allocate()
    with torch.no_grad():
        first = prefill(dec, cache, [slot], [embeds])
        assert dec.lm_head.live_rows() is not None
        got = greedy_decode(dec, cache, [slot], first, 12, eos_ids=set())
    dense = copy.deepcopy(dec)
    dense.lm_head = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
    dense.lm_head.weight = dense.model.embed_tokens.weight if dense.tied else torch.nn.Parameter(w.detach().clone())
    cache2 = new_cache(dense)
    slot2 = cache2.allocate()
    with torch.no_grad():
        want = greedy_decode(dense, cache2, [slot2], prefill(dense, cache2, [slot2], [embeds]), 12, eos_ids=set())
    assert got == want


def test_a_picked_tokens_probability_from_the_live_rows_is_the_whole_softmaxs():
    """The words' confidence (cloud/inference/decode_pass.py `chosen_probabilities`): from a sparse
    head's live columns and the count of its zero rows, the probability of each row's picked token
    equals the float64 softmax over all the logits; a picked zero row (every live logit below 0) too."""
    from harken.cloud.inference.decode_pass import chosen_probabilities
    from harken.cloud.model.decoder import OutputHead

    torch.manual_seed(1)
    head = OutputHead(16, 20000)
    with torch.no_grad():
        head.weight.zero_()
        head.weight[torch.randperm(20000)[:400]] = torch.randn(400, 16)
        x = torch.randn(6, 16) * 3
        x[5] = 0.0  # a row whose logits are all 0 (its pick, 123, is most likely a zero row)
        logits = head(x)
        picked = torch.cat([logits[:5].argmax(-1), torch.tensor([123])])
        exact = torch.softmax(logits.double(), -1).gather(-1, picked.unsqueeze(-1)).squeeze(-1).tolist()
        assert chosen_probabilities(logits, picked, head) == pytest.approx(exact, rel=1e-9, abs=1e-12)
        assert chosen_probabilities(logits, picked) == pytest.approx(exact, abs=1e-5)  # the dense fp32 softmax
