"""synth-en's corpus and training: determinism, no train/test overlap, the exact subset-vocabulary
loss against the full model, and a smoke run of `harken train` that resumes and writes a
checkpoint both harken and the official package load."""

from __future__ import annotations

import json
import math
from collections import Counter
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from harken.training import alignment, corpus, evaluation, speech, text


@pytest.fixture(scope="module")
def split():
    return corpus._split_sources(0)


def test_text_sources_are_large_and_distinct(split):
    train, held = split
    everything = [s for group in (*train.values(), *held.values()) for s in group]
    st = text.stats(everything)
    assert st["sentences"] >= 50_000 and st["distinct_words"] >= 20_000
    assert len({text.key(s) for s in everything}) == len(everything)
    # digits and spelled-out numbers both occur in the targets
    meeting = train["meeting"]
    assert any(any(c.isdigit() for c in s) for s in meeting)
    assert any(w in s.split() for s in meeting for w in ("twenty", "fifteen", "three"))


def test_no_sentence_of_the_held_out_set_is_trained_on(split):
    train, held = split
    train_keys = {text.key(s) for group in train.values() for s in group}
    held_keys = {text.key(s) for group in held.values() for s in group}
    assert held_keys and not train_keys & held_keys
    # every sentence of every held-out utterance is a held-out sentence
    for u in corpus.read_held_out():
        assert text.key(u.recipe.text) not in train_keys
        assert speech.held_out_combo(u.recipe.voice, u.recipe.variant, u.recipe.rate)
    # training utterances: training sentences only, in training voice x speed combinations
    for i in range(300):
        u = corpus.plan(0, i)
        assert not speech.held_out_combo(u.recipe.voice, u.recipe.variant, u.recipe.rate)
        assert text.key(u.recipe.text) not in held_keys
    # phrases: 1-6 consecutive words of training texts, in training voice x speed combinations
    everything_train = "\n".join(" ".join(group) for group in train.values())  # texts: consecutive sentences
    for i in range(200):
        u = corpus.plan_phrase(0, i)
        assert 1 <= len(u.recipe.text.split()) <= corpus.PHRASE_WORDS
        assert u.recipe.text in everything_train
        assert not speech.held_out_combo(u.recipe.voice, u.recipe.variant, u.recipe.rate)


def test_jumbles_are_training_words_in_an_order_no_text_has(split, tmp_path, monkeypatch):
    """Jumbles: 3-12 words, each drawn from a training text, espeak-ng voices only (even where every
    utterance could be Piper), training voice x speed combinations, deterministic; adjacent words
    are a bigram of the training text (what a language model would predict) about as often as two
    words drawn at random, not almost always as in a phrase; the texts without audio of kind
    "jumble" are the same kind of text with its phonemes."""
    train, held = split

    def norm(w: str) -> str:
        return w.strip(".,;:!?\"()[]").lower()

    vocab = {norm(w) for group in train.values() for t in group for w in t.split()}
    bigrams = {(norm(a), norm(b)) for group in train.values() for t in group for a, b in zip(t.split(), t.split()[1:])}

    def bigram_share(texts: list[str]) -> float:
        pairs = [(norm(a), norm(b)) for t in texts for a, b in zip(t.split(), t.split()[1:])]
        return sum(p in bigrams for p in pairs) / len(pairs)

    jumbles = [corpus.plan_jumble(0, i, piper_share=1.0) for i in range(200)]
    for i, u in enumerate(jumbles):
        assert u == corpus.plan_jumble(0, i, piper_share=1.0) and u.source == "jumble"
        assert u.recipe.voice != speech.PIPER
        assert not speech.held_out_combo(u.recipe.voice, u.recipe.variant, u.recipe.rate)
        words = u.recipe.text.split()
        assert 1 <= len(words) <= corpus.JUMBLE_WORDS[1] and u.recipe.text[0] == u.recipe.text[0].upper()
        assert all(norm(w) in vocab for w in words)
    phrases = [corpus.plan_phrase(0, i).recipe.text for i in range(200)]
    assert bigram_share([u.recipe.text for u in jumbles]) < 0.35 < 0.9 < bigram_share(phrases)  # measured 0.24, 0.97
    monkeypatch.setattr(corpus, "TEXT_LINES", 2)
    paths = corpus.build_text_phonemes(tmp_path, 3, kind="jumble")
    assert [p.name for p in paths] == ["text-jumble-00000.jsonl", "text-jumble-00001.jsonl"]
    for d in (json.loads(x) for p in paths for x in p.read_text().splitlines()):
        assert d["source"] == "jumble" and all(w.lower() in vocab for w in d["text"].split())
        assert d["phonemes"] == speech.phonemes(d["text"], d["accent"])


def test_prose_texts_are_training_fortunes_and_verses_in_their_proportion(split, tmp_path, monkeypatch):
    """Texts without audio of kind "prose": training sentences (consecutive, as utterances pick
    them) of the fortunes and the Bible only, in SOURCE_WEIGHTS' proportion between the two, with
    their phonemes; deterministic, and not the texts of kind "text"."""
    train, _ = split
    assert corpus.PROSE_WEIGHTS == {"fortunes": 0.35, "kjv": 0.10}
    everything = {k: " ".join(v) for k, v in train.items()}  # consecutive sentences: a substring
    monkeypatch.setattr(corpus, "TEXT_LINES", 50)
    paths = corpus.build_text_phonemes(tmp_path / "a", 60, kind="prose")
    assert [p.name for p in paths] == ["text-prose-00000.jsonl", "text-prose-00001.jsonl"]
    rows = [json.loads(x) for p in paths for x in p.read_text().splitlines()]
    assert len(rows) == 60 and all(d["source"] in ("fortunes", "kjv") and d["text"] in everything[d["source"]]
                                   for d in rows)
    n_kjv = sum(d["source"] == "kjv" for d in rows)
    assert 3 <= n_kjv <= 25  # expected 60 x 0.10 / 0.45 = 13
    assert all(d["phonemes"] == speech.phonemes(d["text"], d["accent"]) for d in rows[:5])
    again = corpus.build_text_phonemes(tmp_path / "b", 60, kind="prose")
    assert [p.read_text() for p in again] == [p.read_text() for p in paths]
    plain = corpus.build_text_phonemes(tmp_path / "c", 60)
    assert [json.loads(x)["text"] for p in plain for x in p.read_text().splitlines()] != [d["text"] for d in rows]


def test_prose_utterances_are_training_fortunes_and_verses_in_their_proportion(split):
    """Prose utterances: picked as utterances are (one to three consecutive training sentences) but
    from the fortunes and the Bible only, in SOURCE_WEIGHTS' proportion between the two; in training
    voice x speed combinations (Piper too), deterministic, and not the utterances of `plan`."""
    train, held = split
    everything = {k: " ".join(v) for k, v in train.items()}
    held_keys = {text.key(s) for group in held.values() for s in group}
    us = [corpus.plan_prose(0, i) for i in range(300)]
    assert us == [corpus.plan_prose(0, i) for i in range(300)]
    for u in us:
        assert u.source in ("fortunes", "kjv") and u.recipe.text in everything[u.source]
        assert text.key(u.recipe.text) not in held_keys
        assert not speech.held_out_combo(u.recipe.voice, u.recipe.variant, u.recipe.rate)
    assert 30 <= sum(u.source == "kjv" for u in us) <= 100  # expected 300 x 0.10 / 0.45 = 67
    assert 40 <= sum(u.recipe.voice == speech.PIPER for u in us) <= 110  # PIPER_SHARE 0.25: 75
    assert {u.recipe.text for u in us}.isdisjoint(corpus.plan(0, i).recipe.text for i in range(300))


def test_wordnet_adds_its_examples_and_moves_no_other_sentence(split, monkeypatch):
    """WordNet's usage examples (Debian wordnet-base) are the fourth source: tens of thousands of
    distinct sentences, 1% held out by the same hash, and every sentence of the other three sources
    is where it was before WordNet came (the corpus already built and the held-out set stand)."""
    train, held = split
    assert list(train) == ["fortunes", "kjv", "meeting", "wordnet"]
    assert len(train["wordnet"]) >= 40_000 and 0 < len(held["wordnet"]) < len(train["wordnet"]) // 50
    assert "Primary colors can add interest to a room." in train["wordnet"]  # an example as WordNet gives it
    monkeypatch.setattr(text, "wordnet_sentences", lambda: [])
    before = text.sources(0)
    for name in ("fortunes", "kjv", "meeting"):
        assert text.split(before[name]) == (train[name], held[name])


def test_wordnet_texts_and_utterances_are_training_examples(split, tmp_path, monkeypatch):
    """Kind "wordnet": texts without audio and utterances of one to three consecutive training
    examples of WordNet only, deterministic, in training voice x speed combinations."""
    train, held = split
    examples = " ".join(train["wordnet"])
    held_keys = {text.key(s) for group in held.values() for s in group}
    us = [corpus.plan_wordnet(0, i) for i in range(200)]
    assert us == [corpus.plan_wordnet(0, i) for i in range(200)]
    for u in us:
        assert u.source == "wordnet" and u.recipe.text in examples and text.key(u.recipe.text) not in held_keys
        assert not speech.held_out_combo(u.recipe.voice, u.recipe.variant, u.recipe.rate)
    assert len({u.recipe.text for u in us}) >= 190
    monkeypatch.setattr(corpus, "TEXT_LINES", 3)
    paths = corpus.build_text_phonemes(tmp_path, 4, kind="wordnet")
    assert [p.name for p in paths] == ["text-wordnet-00000.jsonl", "text-wordnet-00001.jsonl"]
    rows = [json.loads(x) for p in paths for x in p.read_text().splitlines()]
    assert len(rows) == 4 and all(d["source"] == "wordnet" and d["text"] in examples for d in rows)
    assert all(d["phonemes"] == speech.phonemes(d["text"], d["accent"]) for d in rows)


def test_corpus_only_builds_every_kind_and_then_counts_as_complete(tmp_path):
    """`harken train synth-en OUT --corpus-only`: utterance, phrase and jumble shards, texts, jumble
    and prose texts without audio, prose utterances; the trainer's check then finds nothing left to build."""
    from harken.training import commands
    from harken.training.examples import corpus_shards
    from harken.training.options import TrainOptions

    sizes = {"utterances": 2, "phrases": 2, "texts": 2, "jumbles": 3, "jumble_texts": 2, "prose_texts": 2,
             "prose_utterances": 2, "wordnet_texts": 2, "wordnet_utterances": 2}
    cmd = [sys.executable, "-m", "harken.cli", "train", "synth-en", str(tmp_path), "--corpus-only", "--workers", "2",
           "--piper-share", "0"] + [a for k, v in sizes.items() for a in (f"--{k.replace('_', '-')}", str(v))]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    cdir = tmp_path / "corpus"
    assert commands._corpus_complete(cdir, sizes)
    assert not commands._corpus_complete(cdir, {**sizes, "jumbles": 1001})
    assert not commands._corpus_complete(cdir, {**sizes, "prose_texts": 1001})
    shards = corpus_shards(TrainOptions(corpus=cdir, out=tmp_path))
    assert not commands._corpus_complete(cdir, {**sizes, "prose_utterances": 1001})
    assert not commands._corpus_complete(cdir, {**sizes, "wordnet_utterances": 1001})
    assert [p.name for p in shards] == ["train-00000.npz", "phrase-00000.npz", "jumble-00000.npz", "prose-00000.npz",
                                        "wordnet-00000.npz"]
    _, _, meta = corpus.load_shard(cdir / "wordnet-00000.npz")
    assert [m["text"] for m in meta] == [corpus.plan_wordnet(0, i, 0.0).recipe.text for i in range(2)]
    assert len((cdir / "text-wordnet-00000.jsonl").read_text().splitlines()) == 2
    _, lengths, meta = corpus.load_shard(cdir / "prose-00000.npz")
    assert len(lengths) == 2
    assert [m["text"] for m in meta] == [corpus.plan_prose(0, i, 0.0).recipe.text for i in range(2)]
    _, lengths, meta = corpus.load_shard(cdir / "jumble-00000.npz")
    assert len(lengths) == 3 and {m["source"] for m in meta} == {"jumble"}
    assert [m["text"] for m in meta] == [corpus.plan_jumble(0, i).recipe.text for i in range(3)]
    assert len((cdir / "text-jumble-00000.jsonl").read_text().splitlines()) == 2
    prose = [json.loads(x) for x in (cdir / "text-prose-00000.jsonl").read_text().splitlines()]
    assert len(prose) == 2 and {d["source"] for d in prose} <= {"fortunes", "kjv"}


def test_corpus_plan_starts_every_kind_then_interleaves_them_in_proportion():
    """The builder's order: every file of every kind once, the first file of each kind first (the
    trainer starts on them), then each kind in proportion to its size all along (so a pool of
    workers always has every kind in hand and a trainer sees every kind grow)."""
    from harken.training import commands

    sizes = {"utterances": 16000, "phrases": 8000, "jumbles": 8000, "texts": 20000, "jumble_texts": 20000,
             "prose_texts": 40500, "prose_utterances": 8000, "wordnet_texts": 40000, "wordnet_utterances": 4000,
             "manpage_texts": 20000}
    plan = commands.corpus_plan(sizes)
    want = {(f, kind, k) for size, (f, kind) in commands.CORPUS_FILES.items()
            for k in range(-(-sizes[size] // (corpus.SHARD if f == "shard" else corpus.TEXT_LINES)))}
    assert len(plan) == len(want) == 16 + 8 + 8 + 20 + 20 + 41 + 8 + 40 + 4 + 20 and {p[:3] for p in plan} == want
    # (family, kind, 0): "prose" and "wordnet" each name both a shard kind and a text kind
    assert {p[:3] for p in plan[:10]} == {(f, kind, 0) for f, kind in commands.CORPUS_FILES.values()}
    assert all(n == sizes[size] for (f, kind, _, n) in plan for size, fk in commands.CORPUS_FILES.items()
               if fk == (f, kind))
    for size, fk in commands.CORPUS_FILES.items():  # each kind in its own order: 0, 1, 2, ...
        assert [p[2] for p in plan if p[:2] == fk] == list(range(sum(p[:2] == fk for p in plan)))
    half = plan[:len(plan) // 2]
    for size, fk in commands.CORPUS_FILES.items():
        share = sum(p[:2] == fk for p in half) / sum(p[:2] == fk for p in plan)
        assert 0.4 <= share <= 0.6, (size, share)


def test_held_out_file_is_what_the_generator_makes():
    """The committed held-out set (text + recipes) is reproducible from the seed."""
    assert [u.recipe for u in corpus.held_out_recipes()] == [u.recipe for u in corpus.read_held_out()]
    voices = {u.recipe.voice for u in corpus.read_held_out()}
    assert speech.PIPER in voices and len(voices) >= 6


def test_recipe_files_take_corpus_lines_and_refuse_other_lines(tmp_path):
    """`read_held_out` (`harken eval --set`) reads a corpus shard's `.jsonl` lines (the recipe
    nested, beside text, frames and phonemes) as the same utterances as `heldout.jsonl`'s flat
    form; a line that is not a recipe is an error naming the file and line, from the CLI too."""
    utts = [corpus.plan(0, i) for i in range(3)]
    flat = tmp_path / "flat.jsonl"
    flat.write_text("".join(json.dumps({"source": u.source, **u.recipe.to_json()}) + "\n" for u in utts))
    nested = tmp_path / "train-00000.jsonl"
    nested.write_text("".join(json.dumps({"text": u.recipe.text, "source": u.source, "frames": 100,
                                          "phonemes": "x", "recipe": u.recipe.to_json()}) + "\n" for u in utts))
    assert corpus.read_held_out(flat) == corpus.read_held_out(nested) == utts
    bad = tmp_path / "bad.jsonl"
    bad.write_text(flat.read_text().splitlines()[0] + "\n" + json.dumps({"text": "hi", "speaker": "me"}) + "\n")
    with pytest.raises(corpus.RecipeFileError, match=r"bad.jsonl:2: not a recipe"):
        corpus.read_held_out(bad)
    run = subprocess.run([sys.executable, "-m", "harken", "eval", "--model", "tiny", "--set", str(bad)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and "bad.jsonl:2: not a recipe" in run.stderr and "Traceback" not in run.stderr


def test_corpus_is_deterministic(tmp_path):
    a = [corpus.plan(0, i) for i in range(20)]
    assert a == [corpus.plan(0, i) for i in range(20)]
    assert a != [corpus.plan(1, i) for i in range(20)]
    assert [corpus.plan_phrase(0, i) for i in range(20)] == [corpus.plan_phrase(0, i) for i in range(20)]
    espeak_one = next(u for u in a if u.recipe.voice != speech.PIPER and u.recipe.noise != "none")
    piper_one = next(u for u in a if u.recipe.voice == speech.PIPER)
    for u in (espeak_one, piper_one):
        x, y = speech.render(u.recipe), speech.render(u.recipe)
        assert np.array_equal(x, y) and 1.0 < x.size / 16000 < 25.0
    # shards: an interrupted build resumes to the same bytes
    corpus.write_shard(tmp_path / "x-00000.npz", a[:3])
    f1, l1, m1 = corpus.load_shard(tmp_path / "x-00000.npz")
    corpus.write_shard(tmp_path / "y-00000.npz", a[:3])
    f2, l2, m2 = corpus.load_shard(tmp_path / "y-00000.npz")
    assert np.array_equal(f1, f2) and np.array_equal(l1, l2) and m1 == m2
    assert f1.dtype == np.float16 and l1.sum() == f1.shape[1]
    assert all(m["phonemes"] and m["text"] == u.recipe.text for m, u in zip(m1, a))


def test_subset_vocabulary_loss_is_the_full_vocabulary_loss(tmp_path):
    """The training loss over the trained rows (+ the constant for the zero rows) equals the
    cross-entropy the exported checkpoint gives with its full 151,936-row head."""
    from harken.cloud.model.asr import Qwen3ASR
    from harken.cloud.model.prompt import build_prompt
    from harken.cloud.model.tiny import write_tokenizer_files
    from harken.cloud.model.tokenizer import Tokenizer
    from harken.training import train as T

    write_tokenizer_files(tmp_path / "ckpt", "real")
    tok = Tokenizer.from_dir(tmp_path / "ckpt")
    texts = ["Let's meet on March 3rd at 2:30 pm.", "The LORD is my shepherd; I shall not want."]
    end = tok.token_id("<|im_end|>")
    targets = [tok.encode(T.TARGET_PREFIX + t) + [end] for t in texts]
    prompt = build_prompt(tok, 1, "", None)
    prefix, suffix = prompt.ids[:prompt.audio_start], prompt.ids[prompt.audio_start + 1:]
    vocab = T.Vocab(sorted({i for t in targets for i in t} | set(prompt.ids) | set(range(5000))), 151936)
    model = T.Trainee(T.tiny_train_config(), vocab, 10, seed=3)
    with torch.no_grad():  # make every row matter
        model.emb.normal_(0, 0.5)
    g = torch.Generator().manual_seed(0)
    feats = [torch.randn(128, 250, generator=g), torch.randn(128, 930, generator=g)]
    batch = T.Batch(feats, targets, [[1, 2, 3], [4, 5, 6, 7]], len(tok.encode(T.TARGET_PREFIX)))
    model.eval()
    with torch.no_grad():
        ce = T.losses(model, batch, (prefix, suffix))["ce"].item()
    evaluation.export_checkpoint(model, tmp_path / "ckpt")
    asr = Qwen3ASR.load(str(tmp_path / "ckpt"), dtype="fp64", device="cpu")
    total, n = 0.0, 0
    with torch.no_grad():
        for f, t in zip(feats, targets):
            p, emb = asr.prompt_embeddings(f.double())
            x = torch.cat([emb, asr.decoder.embed(torch.tensor(t[:-1]))])[None]
            logits = asr.decoder(x)[0, len(p.ids) - 1:]  # full vocabulary
            total += torch.nn.functional.cross_entropy(logits, torch.tensor(t), reduction="sum").item()
            n += len(t)
    assert math.isclose(ce, total / n, rel_tol=1e-4)


def test_probed_attention_is_the_heads_real_attention():
    """The weights the guided-attention loss steers are the ones the head uses: weights @ values
    equals the layer's SDPA output for that head."""
    from harken.cloud.model.decoder import precompute_rope, rope_inv_freq
    from harken.training import train as T

    cfg = T.synth_en_config()
    model = T.Trainee(cfg, T.Vocab(list(range(100)), 151936), 10, seed=1).eval()
    x = torch.randn(2, 40, cfg.text.hidden_size)
    with torch.no_grad():
        _, (w,) = model.decode_hidden(x, {2: [3]})
        h = x
        pos = torch.arange(40).expand(2, 40)
        cos, sin = precompute_rope(pos, rope_inv_freq(cfg.text.head_dim, cfg.text.rope_theta, x.device))
        for layer in model.layers[:2]:
            h = layer(h, cos, sin)
        attn = model.layers[2].self_attn
        q, k, v = attn.project(model.layers[2].input_layernorm(h), cos, sin)
        group = cfg.text.num_attention_heads // cfg.text.num_key_value_heads
        want = torch.nn.functional.scaled_dot_product_attention(
            q[:, :, 3][:, None], k[:, :, 3 // group][:, None], v[:, :, 3 // group][:, None], is_causal=True)[:, 0]
    assert torch.allclose(w @ v[:, :, 3 // group], want, atol=1e-5)
    assert torch.allclose(w.sum(-1), torch.ones(2, 40)) and (w.triu(1) == 0).all()


def test_guided_attention_loss_prefers_the_diagonal():
    """On the speech rows, attention on the diagonal scores lower than uniform attention, which
    scores lower than attention on the wrong end."""
    from harken.cloud.model.encoder import AudioEncoder
    from harken.training import train as T

    enc = AudioEncoder(T.tiny_train_config().audio)
    feats = torch.full((128, 400), -1.0)
    feats[:, 100:300] = 0.5  # speech from 1 s to 3 s: audio rows 13..39 of 52
    a0, a1 = alignment.speech_rows(feats, enc)
    assert (a0, a1) == (enc.num_tokens(100), enc.num_tokens(300))
    n_prefix, K, start, rows = 2, 6, 3, enc.num_tokens(400)
    S = start + rows + 2 + n_prefix + K + 1
    s = start + rows + 1  # the query that predicts the first target token
    batch = T.Batch([feats], [[0] * (n_prefix + K + 1)], [[1]], n_prefix)

    def attention(cols):
        w = torch.zeros(1, S, S)
        for k, c in enumerate(cols):
            w[0, s + n_prefix + k, c] = 1.0
        return w

    centre = [start + round(a0 + (a1 - a0) * (k + 0.5) / K) for k in range(K)]
    uniform = torch.zeros(1, S, S)
    uniform[0, :, start:start + rows] = 1.0 / rows
    wrong = [start + rows - 1 - (c - start) for c in centre]
    losses = [alignment.guided_attention_loss([w], batch, [rows], start, [(0, s, n_prefix + K + 1)], enc).item()
              for w in (attention(centre), uniform, attention(wrong))]
    assert losses[0] < 0.1 and losses[0] < losses[1] < losses[2]


def test_texts_without_audio_are_training_texts_with_their_phonemes(tmp_path, monkeypatch, split):
    monkeypatch.setattr(corpus, "TEXT_LINES", 2)
    paths = corpus.build_text_phonemes(tmp_path, 3)
    assert [p.name for p in paths] == ["text-00000.jsonl", "text-00001.jsonl"]
    lines = [json.loads(x) for p in paths for x in p.read_text().splitlines()]
    assert len(lines) == 3
    train, held = split
    train_text = "\n".join(" ".join(group) for group in train.values())
    for d in lines:
        assert d["text"] in train_text and d["phonemes"] == speech.phonemes(d["text"], d["accent"])
    before = paths[0].stat().st_mtime_ns
    corpus.build_text_phonemes(tmp_path, 3)  # resumes: finished files are kept
    assert paths[0].stat().st_mtime_ns == before


def test_pseudo_rows_spell_the_phonemes_in_order():
    """Rows from text: two CTC slots a row, each phoneme one spike, blanks around; a row is the sum
    of its slots' embeddings, exactly as the match term builds the encoder's target."""

    from harken.training import train as T

    model = T.Trainee(T.tiny_train_config(), T.Vocab(list(range(50)), 151936), 12, seed=0)
    phones, words = [3, 5, 5, 7, 1, 12], [0, 3]
    (rows,) = T.pseudo_rows(model, [phones], [words], random.Random(4))
    E = model.ph_emb.weight.detach()
    # recover the slots: each row is E[a] + E[b]; find the pair
    pairs = torch.cdist(rows.detach(), (E[:, None] + E[None, :]).reshape(-1, E.shape[1]))
    best = pairs.argmin(-1)
    slots = torch.stack([best // E.shape[0], best % E.shape[0]], -1).tolist()  # [rows, 2], order within a row unknown
    i = 0
    for row in slots:
        heard = sorted(p for p in row if p)
        assert heard == sorted(phones[i:i + len(heard)])  # the phonemes in order, row by row
        i += len(heard)
    assert i == len(phones)
    assert slots[0] == [0, 0] and slots[-1] == [0, 0]  # silence before and after
    (again,) = T.pseudo_rows(model, [phones], [words], random.Random(4))
    assert torch.equal(rows, again)


def test_learning_rate_schedule_and_cooldown(tmp_path):
    """Warm-up, hold, 1/sqrt decay; a re-warm-up after a resume; `--cooldown N`: linear to 0 over
    the last N steps before --steps, the schedule untouched before them."""
    from harken.training.options import TrainOptions, learning_rate

    plain = TrainOptions(corpus=Path("."), out=Path("."), steps=80_000, lr=1e-3, hold_steps=5000)
    cool = TrainOptions(corpus=Path("."), out=Path("."), steps=80_000, lr=1e-3, hold_steps=5000, cooldown=1000)
    assert learning_rate(plain, 0) == pytest.approx(1e-5) and learning_rate(plain, 3000) == 1e-3
    assert learning_rate(plain, 20_000 - 1) == pytest.approx(5e-4)  # 1e-3 * sqrt(5000 / 20000)
    assert learning_rate(plain, 74_000, rewarm_from=73_950) == pytest.approx(learning_rate(plain, 74_000) * 51 / 100)
    assert all(learning_rate(cool, s) == learning_rate(plain, s) for s in (0, 50_000, 79_000))
    assert learning_rate(cool, 79_500) == pytest.approx(learning_rate(plain, 79_500) / 2)
    assert learning_rate(cool, 80_000) == 0.0
    lrs = [learning_rate(cool, s) for s in range(79_000, 80_001)]
    assert all(a > b for a, b in zip(lrs, lrs[1:]))
    bad = subprocess.run([sys.executable, "-m", "harken.cli", "train", "synth-en", str(tmp_path / "run"),
                          "--steps", "5", "--cooldown", "10"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--cooldown 10" in bad.stderr and "Traceback" not in bad.stderr
    bad = subprocess.run([sys.executable, "-m", "harken.cli", "train", "synth-en", str(tmp_path / "run"),
                          "--vtlp", "0.6"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--vtlp 0.6" in bad.stderr and "Traceback" not in bad.stderr
    assert not (tmp_path / "run").exists()


def test_text_batches_are_length_bucketed_uniform_draws():
    """Texts without audio come 16 a step, padded to the longest: bucketing within a draw of 8
    batches must fill the padded length far better than 16 texts at random, while each text is
    still drawn uniformly and texts added later are drawn too."""
    from harken.training.examples import TextExample, text_batches

    rng = random.Random(0)
    lengths = [int(rng.paretovariate(1.5) * 20) for _ in range(400)]  # a long tail, as fortunes give
    texts = [TextExample(list(range(n)), list(range(n)), [0]) for n in lengths]
    draws = text_batches(texts, random.Random(1), 16)
    batches = [next(draws) for _ in range(2000)]
    assert all(len(b) == 16 for b in batches)

    def fill(group):
        n = [len(t.target) + len(t.phones) for t in group]
        return sum(n) / (len(n) * max(n))

    bucketed = sum(fill(b) for b in batches) / len(batches)
    flat = [t for b in batches for t in b]
    random.Random(2).shuffle(flat)
    unbucketed = sum(fill(flat[i:i + 16]) for i in range(0, len(flat), 16)) / len(batches)
    assert bucketed > 0.75 and bucketed > 1.5 * unbucketed
    counts = Counter(id(t) for t in flat)  # 32,000 draws of 400 texts: 80 each expected
    assert len(counts) == 400 and min(counts.values()) > 40 and max(counts.values()) < 130
    texts.append(TextExample([1] * 7, [2] * 7, [0]))  # a text file taken in later
    assert any(t is texts[-1] for _ in range(300) for t in next(draws))


def test_train_smoke_resumes_and_writes_a_loadable_checkpoint(tmp_path):
    """`harken train synth-en --tiny`: a few steps on a tiny corpus, resumed, gives a checkpoint in
    the official layout (harken and qwen-asr both load it; untrained vocabulary rows are zero)."""
    from safetensors.numpy import load_file

    from harken.cloud.model.asr import Qwen3ASR

    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "harken.cli", "train", "synth-en", str(out), "--tiny", "--utterances", "6", "--phrases", "3", "--texts", "5", "--jumbles", "2", "--jumble-texts", "3", "--prose-texts", "2", "--prose-utterances", "2",
           "--wordnet-texts", "0", "--wordnet-utterances", "0", "--text-batch", "6", "--steps", "2", "--eval-every", "2", "--eval-n", "3", "--threads", "1", "--workers", "1", "--batch-frames", "3000",
           "--tempo", "0.05"]
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr[-2000:]
    cmd[cmd.index("--steps") + 1] = "3"
    second = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stderr[-2000:]
    assert "resumed at step 2" in second.stderr
    recipe = torch.load(out / "state.pt", weights_only=False)["recipe"]
    assert recipe["text_batch"] == 6 and recipe["tempo"] == 0.05  # --text-batch, --tempo: recorded
    log = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [2, 3] and all(0.0 <= r["heldout_wer"] for r in log)
    assert all(0.0 <= r["heldout_per"] for r in log)  # the encoder's phoneme error beside the WER
    # and by voice family (the held-out set's first three: Piper, Piper, espeak-ng) and text source
    assert all(0.0 <= r[f"heldout_{m}_{v}"] for r in log for m in ("wer", "per") for v in ("piper", "espeak"))
    assert all(0.0 <= r["heldout_wer_meeting"] for r in log)
    # the last evaluation's hypotheses, whole: the held-out set's first three, and the WER logged is theirs
    rows = [json.loads(line) for line in (out / "heldout-hyps.jsonl").read_text().splitlines()]
    held = corpus.read_held_out()[:3]
    assert [(d["step"], d["ref"], d["source"]) for d in rows] == [(3, u.recipe.text, u.source) for u in held]
    from harken.training.evaluation import wer

    assert round(wer([d["ref"] for d in rows], [d["hyp"] for d in rows]), 4) == log[-1]["heldout_wer"]
    assert (out / "curve.png").stat().st_size > 1000
    ckpt = Path(json.loads(second.stdout)["checkpoint"])
    # `harken eval` on that checkpoint: its WERs (all, by source, by voice) are the ones its own
    # hypotheses give, and the references are the held-out set's
    got = subprocess.run([sys.executable, "-m", "harken.cli", "eval", "--model", str(ckpt), "-n", "3", "--json",
                          "--device", "cpu", "--hyps", str(tmp_path / "hyps.jsonl")],
                         capture_output=True, text=True, timeout=600)
    assert got.returncode == 0, got.stderr[-2000:]
    result = json.loads(got.stdout)
    scored = [json.loads(line) for line in (tmp_path / "hyps.jsonl").read_text().splitlines()]
    assert [(d["ref"], d["source"]) for d in scored] == [(u.recipe.text, u.source) for u in held]
    assert [d["voice"] for d in scored] == ["piper", "piper", "espeak-ng"]
    assert result["n_utterances"] == 3 and result["n_words"] == sum(len(d["ref"].split()) for d in scored)
    assert result["wer"] == round(wer([d["ref"] for d in scored], [d["hyp"] for d in scored]), 4)
    for key, field in (("wer_by_source", "source"), ("wer_by_voice", "voice")):
        assert result[key] == {g: round(wer([d["ref"] for d in scored if d[field] == g],
                                            [d["hyp"] for d in scored if d[field] == g]), 4)
                               for g in {d[field] for d in scored}}
    w = load_file(str(ckpt / "model.safetensors"))
    emb = w["thinker.model.embed_tokens.weight"]
    zero_rows = (emb == 0).all(axis=1)
    assert 100_000 < zero_rows.sum() < emb.shape[0]
    asr = Qwen3ASR.load(str(ckpt), dtype="fp32", device="cpu", max_new_tokens=8)
    assert len(asr.transcribe(np.zeros((128, 300), np.float32)).token_ids) <= 8
    from qwen_asr import Qwen3ASRModel

    off = Qwen3ASRModel.from_pretrained(str(ckpt), dtype=torch.float32, max_new_tokens=8)
    official = dict(off.model.named_parameters())
    for name, value in w.items():
        assert torch.equal(official[name].detach(), torch.from_numpy(value)), name


def test_pieces_spell_every_training_text_exactly_with_few_tokens(tmp_path, split):
    """synth-en's output vocabulary: frequent tokens whole, rare ones as the fewest allowed pieces,
    every piece a real Qwen token, and the pieces decode to exactly the text (so the official
    tokenizer reads the model's output unchanged)."""
    from harken.cloud.model.tiny import write_tokenizer_files
    from harken.cloud.model.tokenizer import Tokenizer
    from harken.training.pieces import Pieces, choose

    write_tokenizer_files(tmp_path, "real")
    tok = Tokenizer.from_dir(tmp_path)
    train, held = split
    sentences = [s for group in train.values() for s in group][::20]
    allowed = choose(tok, sentences, whole=300, parts=200)
    assert allowed == choose(tok, sentences, whole=300, parts=200)  # deterministic
    assert len(allowed) < 800
    spell = Pieces(tok, allowed)
    natural = spelled = 0
    held_text = [s for group in held.values() for s in group][:300]
    for s in sentences[:2000] + held_text + ["Galliano Harvey Wallbangers paid $12,929.50 at 11:20 am. Ünïcödé ✓"]:
        ids = spell.encode(s)
        assert set(ids) <= set(allowed)
        assert tok.decode(ids) == s
        natural += len(tok.encode(s))
        spelled += len(ids)
    assert spelled < 2 * natural  # (1.27x with the 1,700 pieces synth-en trains with)
    assert spell.encode("the") == tok.encode("the")  # a frequent word stays one token
    rare = tok.encode(" Wallbangers")
    assert not set(rare) <= set(allowed) and len(spell.encode(" Wallbangers")) <= len(" Wallbangers")
    assert spell.encode("<asr_text> the") == [tok.token_id("<asr_text>")] + tok.encode(" the")


def test_ctc_forced_alignment_finds_the_path_and_words_own_their_tokens(tmp_path):
    """The guided-attention target: Viterbi CTC alignment recovers a planted path (a repeated label
    needs its blank), and each transcript token belongs to the word of its first non-space byte."""
    from harken.cloud.model.tiny import write_tokenizer_files
    from harken.cloud.model.tokenizer import Tokenizer

    path = [0, 3, 3, 0, 5, 0, 5, 5, 0]  # labels 3, 5, 5 first emitted at frames 1, 4, 6
    logp = np.full((len(path), 7), math.log(0.1 / 6))
    logp[np.arange(len(path)), path] = math.log(0.9)
    assert alignment.ctc_align(logp, [3, 5, 5]) == [1, 4, 6]
    assert alignment.ctc_align(logp[:2], [3, 5, 5]) is None  # too few frames for three labels
    write_tokenizer_files(tmp_path, "real")
    tok = Tokenizer.from_dir(tmp_path)
    table = {c: i + 1 for i, c in enumerate("abcdefghijklmnopqrstuvwxyzðəɪ")}
    ids = tok.encode("Thorn, by  name.")
    per_word, token_word = alignment.word_structure(tok, "Thorn, by  name.", "θɔːn baɪ neɪm", table, ids)
    assert per_word == [1, 3, 4]  # phonemes outside the table are not counted
    text_of = {}
    for t, w in zip(ids, token_word):
        text_of[w] = text_of.get(w, "") + tok.decode([t])
    assert [text_of[w].strip() for w in range(3)] == ["Thorn,", "by", "name."]
    assert alignment.word_structure(tok, "Room 428", "ɹuːm fɔː hʌndɹəd twɛnti eɪt", table, tok.encode("Room 428")) is None
    # spans: two words, the second with two tokens sharing its rows
    logp2 = np.full((12, 7), math.log(0.1 / 6))
    logp2[np.arange(12), [0, 1, 0, 0, 2, 0, 0, 0, 3, 0, 0, 0]] = math.log(0.9)
    centre, width = alignment.token_rows(logp2, [1, 2, 3], ([2, 1], [0, 1, 1]))
    assert centre[0] == pytest.approx((0.5 + 4) / 2) and centre[1] < centre[2] and (width >= 1).all()


def test_losses_under_bf16_autocast_are_fp32_and_match_an_fp32_recompute():
    """Under bf16 autocast (the default on a CPU with bf16 units, and on CUDA) the matrix products
    run in bf16 but every softmax / log-sum-exp of the losses runs in fp32: each loss comes out
    fp32 and within bf16 rounding of the same losses computed wholly in fp32."""
    from harken.training import train as T

    model = T.Trainee(T.tiny_train_config(), T.Vocab(list(range(300)), 151936), 10, seed=5).eval()
    g = torch.Generator().manual_seed(1)
    feats = [torch.randn(128, 300, generator=g), torch.randn(128, 520, generator=g)]
    targets = [[1, 2, 17, 40, 99, 250, 3], [1, 2, 60, 61, 62, 63, 64, 65, 3]]
    batch = T.Batch(feats, targets, [[1, 2, 3, 4], [5, 6, 7, 8, 9]], 2, guide=1.0)
    prompt = ([7, 8, 9], [10, 11])
    with torch.no_grad():
        full = T.losses(model, batch, prompt)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            low = T.losses(model, batch, prompt)
    assert set(low) == set(full) == {"ce", "guide", "ctc_tok", "ctc_ph", "match"}
    for k in full:
        assert low[k].dtype == torch.float32, k
        assert math.isclose(low[k].item(), full[k].item(), rel_tol=0.02, abs_tol=0.02), k


def test_batches_cover_each_utterance_once_in_shuffled_length_buckets():
    """`batches`: every utterance short enough once a pass (the Piper voice's `piper_repeat` times),
    each batch within its frame budget, and the batches of a chunk not in length order."""
    from harken.training.examples import Example, batches

    rng = random.Random(0)
    lens = [rng.randint(100, 1500) for _ in range(1024)]
    examples = [Example(np.zeros((128, n), np.float16), [1, 2], [1], "x") for n in lens]
    got = list(batches(examples, random.Random(1), 4000, 1200))
    seen = sorted(id(e) for b in got for e in b)
    assert seen == sorted(id(e) for e in examples if e.feats.shape[1] <= 1200)
    assert all(len(b) * max(e.feats.shape[1] for e in b) <= 4000 or len(b) == 1 for b in got)
    longest = [max(e.feats.shape[1] for e in b) for b in got]
    rises = sum(a < b for a, b in zip(longest, longest[1:]))
    assert rises < 0.75 * (len(longest) - 1)  # a length sweep would rise at almost every step
    # the Piper voice's utterances `piper_repeat` times a pass, prose `prose_repeat` times (the larger
    # where both apply), the others once
    for e in examples[::3]:
        e.piper = True
    for e, source in zip(examples, ["meeting", "fortunes", "kjv", "jumble", "meeting"] * 300):
        e.source = source
    counts = Counter(id(e) for b in batches(examples, random.Random(2), 4000, 1200, piper_repeat=3) for e in b)
    assert {id(e): 3 if e.piper else 1 for e in examples if e.feats.shape[1] <= 1200} == counts
    counts = Counter(id(e) for b in batches(examples, random.Random(2), 4000, 1200, 3, prose_repeat=2) for e in b)
    assert {id(e): 3 if e.piper else 2 if e.source in ("fortunes", "kjv") else 1
            for e in examples if e.feats.shape[1] <= 1200} == counts


def test_spec_augment_masks_bands_and_stretches_with_the_utterance_mean():
    """`spec_augment`: every changed entry lies in one of at most two mel bands of <= F bins or
    one time stretch of <= T frames per 200 frames, takes the utterance's mean, and the rest is
    untouched; the same RNG state gives the same masks; F = T = 0 changes nothing."""
    from harken.training.examples import spec_augment

    x = np.random.default_rng(0).normal(size=(128, 1000)).astype(np.float32)
    for seed in range(20):
        y = spec_augment(x.copy(), random.Random(seed), 16, 30)
        assert np.array_equal(y, spec_augment(x.copy(), random.Random(seed), 16, 30))
        changed = y != x
        assert np.all(y[changed] == np.float32(x.mean()))
        rows = changed.all(axis=1)  # bands: whole rows
        cols = changed.all(axis=0)  # stretches: whole columns
        assert np.array_equal(changed, rows[:, None] | cols[None, :])
        assert rows.sum() <= 2 * 16 and cols.sum() <= 5 * 30

        def runs(m):
            edges = np.flatnonzero(np.diff(np.concatenate([[0], m.astype(int), [0]])))
            return edges[1::2] - edges[::2]

        assert len(runs(rows)) <= 2 and len(runs(cols)) <= 5
        assert all(n <= 30 for n in runs(cols)) or len(runs(cols)) < 5  # touching stretches merge
    masked = np.mean([(spec_augment(x.copy(), random.Random(s), 16, 30) != x).mean() for s in range(50)])
    assert 0.05 < masked < 0.35
    assert np.array_equal(spec_augment(x.copy(), random.Random(0), 0, 0), x)


def test_time_warp_changes_the_pace_monotonically_within_its_bounds():
    """`time_warp` on a ramp (frame t holds t): the output is a monotone walk from the first
    source frame to the last, as long as the drawn rates allow; with no local change, the steps
    are even and equal the drawn tempo; every value interpolates two neighbouring source frames;
    the same RNG state gives the same output; 0, 0 returns the frames unchanged."""
    from harken.training.examples import time_warp

    T = 1000
    ramp = np.tile(np.arange(T, dtype=np.float32), (128, 1))
    for seed in range(20):
        y = time_warp(ramp, random.Random(seed), 0.1, 0.15)
        assert np.array_equal(y, time_warp(ramp, random.Random(seed), 0.1, 0.15))
        assert np.all(y == y[0])  # every mel bin moved alike
        steps = np.diff(y[0].astype(np.float64))
        assert y[0, 0] == 0 and abs(y[0, -1] - (T - 1)) < 1.1 * 1.15
        assert np.all(steps > 0) and steps.max() <= 1.1 * 1.15 + 1e-3 and steps.min() >= 0.9 * 0.85 - 1e-3
        assert T / (1.1 * 1.15) - 2 <= y.shape[1] <= T / (0.9 * 0.85) + 2
        r = random.Random(seed)
        rate = r.uniform(0.9, 1.1)
        even = time_warp(ramp, random.Random(seed), 0.1, 0.0)[0].astype(np.float64)
        assert np.allclose(np.diff(even), rate, atol=1e-3)
        assert even.shape[0] == int((T - 1) / rate) + 1
    x = np.random.default_rng(0).normal(size=(128, 300)).astype(np.float32)
    y = time_warp(x, random.Random(1), 0.1, 0.15)
    lo = np.minimum(x[:, :-1], x[:, 1:]).min(axis=1)
    hi = np.maximum(x[:, :-1], x[:, 1:]).max(axis=1)
    assert np.all(y >= lo[:, None] - 1e-6) and np.all(y <= hi[:, None] + 1e-6)
    assert time_warp(x, random.Random(0), 0.0, 0.0) is x


def test_vocal_tract_warp_moves_a_formant_by_its_factor():
    """`warp_vocal_tract`: a formant (a peak across the mel bins) at frequency f comes out at
    f x the factor drawn from 1 +- warp, to within the spacing of the bins around it; every frame
    alike; 0 returns the frames unchanged."""
    from harken.training.examples import warp_vocal_tract
    from harken.shared.features_spec import mel_centres_hz

    centres = mel_centres_hz()
    for seed in range(20):
        factor = random.Random(seed).uniform(0.9, 1.1)
        for peak_bin in (20, 60, 100):
            f = centres[peak_bin]
            x = np.exp(-0.5 * ((np.arange(128) - peak_bin) / 2.0) ** 2).astype(np.float32)[:, None].repeat(5, 1)
            y = warp_vocal_tract(x, random.Random(seed), 0.1)
            assert np.all(y == y[:, :1])
            b = int(np.argmax(y[:, 0]))
            assert centres[max(b - 1, 0)] <= f * factor <= centres[min(b + 1, 127)]
    x = np.random.default_rng(0).normal(size=(128, 50)).astype(np.float32)
    assert warp_vocal_tract(x, random.Random(0), 0.0) is x


def test_examples_know_the_piper_voice_from_their_shard(tmp_path):
    """`load_examples` marks an utterance spoken by the Piper voice (its shard's recipe), which
    `batches` takes `piper_repeat` times a pass; espeak-ng voices are not marked."""
    from harken.cloud.model.tiny import write_tokenizer_files
    from harken.cloud.model.tokenizer import Tokenizer
    from harken.training.examples import load_examples, phone_table
    from harken.training.pieces import Pieces

    write_tokenizer_files(tmp_path / "tok", "real")
    tok = Tokenizer.from_dir(tmp_path / "tok")
    recipes = [speech.sample_recipe(random.Random(i), "Yes, we can.", held_out=False, piper_share=share)
               for i, share in ((0, 1.0), (1, 0.0), (2, 1.0))]
    assert [r.voice == speech.PIPER for r in recipes] == [True, False, True]
    np.savez(tmp_path / "train-00000.npz", feats=np.zeros((128, 300), np.float16), lengths=np.array([100] * 3))
    meta = [{"text": r.text, "source": "meeting", "frames": 100, "phonemes": "jɛs wiː kæn", "recipe": r.to_json()}
            for r in recipes]
    (tmp_path / "train-00000.jsonl").write_text("\n".join(json.dumps(m) for m in meta) + "\n")
    spell = Pieces(tok, sorted(set(tok.encode("Yes, we can."))))
    got = load_examples([tmp_path / "train-00000.npz"], tok, phone_table(["jɛs wiː kæn"]), spell)
    assert [e.piper for e in got] == [True, False, True] and {e.source for e in got} == {"meeting"}


def test_rates_by_group_score_each_group_alone():
    """Held-out WER and phoneme error split by voice family (Piper, espeak-ng) or text source: each
    group's rate is its own errors over its own reference length, not a mean of per-utterance rates."""
    voices = [evaluation.voice_family(v) for v in ["piper-joe", "en-us", "piper-joe", "en-gb-scotland"]]
    assert voices == ["piper", "espeak", "piper", "espeak"]
    refs = ["red green blue", "cat dog", "sun", "tree leaf"]
    hyps = ["red green blue", "cat", "son", "tree"]
    assert evaluation.rates_by(voices, refs, hyps, evaluation.wer) == {"espeak": 2 / 4, "piper": 1 / 4}
    prefs, phyps = [[1, 2, 3], [4, 5], [6], [7, 8]], [[1, 2, 3], [4], [9], [7]]
    assert evaluation.rates_by(voices, prefs, phyps, evaluation.phoneme_rate) == {"espeak": 0.5, "piper": 0.25}
    assert evaluation.rates_by(voices[:1], prefs[:1], [[1]], evaluation.phoneme_rate) == {"piper": 2 / 3}
    sources = ["meeting", "meeting", "kjv", "meeting"]
    assert evaluation.rates_by(sources, refs, hyps, evaluation.wer) == {"kjv": 1.0, "meeting": 2 / 7}


def test_phoneme_error_decodes_the_phoneme_head_greedily():
    """`evaluation.phoneme_error`: a head that says blank everywhere deletes every phoneme (PER 1); one that
    says phoneme 4 in every slot writes a single 4 (repeats merge), so against [4, 4, 4] two of
    three are missing and against [4] nothing is."""
    from harken.training import train as T

    model = T.Trainee(T.tiny_train_config(), T.Vocab(list(range(50)), 151936), 10, seed=2).eval()
    feats = [np.random.default_rng(0).standard_normal((128, 300)).astype(np.float16)]
    with torch.no_grad():
        model.phone_head.weight.zero_()
        model.phone_head.bias.zero_()
        model.phone_head.bias[0] = model.phone_head.bias[11] = 10.0  # blank in both slots
    assert evaluation.phoneme_error(model, feats, [[1, 2, 3]]) == 1.0
    with torch.no_grad():
        model.phone_head.bias.zero_()
        model.phone_head.bias[4] = model.phone_head.bias[11 + 4] = 10.0  # phoneme 4 in both slots
    assert math.isclose(evaluation.phoneme_error(model, feats, [[4, 4, 4]]), 2 / 3)
    assert evaluation.phoneme_error(model, feats, [[4]]) == 0.0


def test_espeak_is_run_again_after_a_timeout(monkeypatch):
    """A starved corpus builder's espeak-ng that times out is run again, not the end of the run
    (the fault injected: the first call times out)."""
    from harken.training import speech as speech_module

    real = subprocess.run
    calls = []

    def once_too_slow(argv, **kwargs):
        calls.append(argv)
        if len(calls) == 1:
            raise subprocess.TimeoutExpired(argv, kwargs.get("timeout"))
        return real(argv, **kwargs)

    monkeypatch.setattr(speech_module.subprocess, "run", once_too_slow)
    got = speech_module.phonemes("The meeting starts at noon.", "en-us")
    monkeypatch.setattr(speech_module.subprocess, "run", real)
    assert len(calls) == 2 and got == speech_module.phonemes("The meeting starts at noon.", "en-us")
