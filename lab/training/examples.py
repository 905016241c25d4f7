"""synth-en's training data as the loop takes it: corpus shards -> `Example`s (features, target
tokens, phonemes, word structure), texts without audio, length-bucketed batches."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from harken.cloud.model.tokenizer import Tokenizer
from harken.training import corpus, speech
from harken.training.alignment import word_structure
from harken.training.pieces import Pieces
from harken.shared.features_spec import mel_centres_hz

if TYPE_CHECKING:
    from harken.training.options import TrainOptions

TARGET_PREFIX = "language English<asr_text>"


@dataclass
class Example:
    feats: np.ndarray  # fp16 [128, T] (a view into its shard)
    target: list[int]  # token ids: language English<asr_text>{text}<|im_end|>
    phones: list[int]  # phoneme ids (1-based; 0 is the CTC blank)
    text: str
    words: tuple[list[int], list[int]] | None = None  # (phonemes of each word, word of each transcript
    # token) when espeak-ng's words match the text's one to one (`word_structure`), else None
    piper: bool = False  # spoken by the Piper voice (`batches` may take it more than once a pass)
    source: str = ""  # the text's source: meeting, fortunes, kjv, jumble (`batches`: prose more than once)


class Vocab:
    """The vocabulary rows trained: every token of the training text and the prompt."""

    def __init__(self, ids: list[int], vocab_size: int):
        self.ids = torch.tensor(sorted(set(ids)), dtype=torch.long)
        self.vocab_size = vocab_size
        self.index = torch.full((vocab_size,), -1, dtype=torch.long)
        self.index[self.ids] = torch.arange(len(self.ids))

    def __len__(self) -> int:
        return len(self.ids)

    def sub(self, token_ids: list[int] | torch.Tensor) -> torch.Tensor:
        idx = self.index[torch.as_tensor(token_ids, dtype=torch.long)]
        if (idx < 0).any():
            raise ValueError("token outside the trained vocabulary")
        return idx


def phone_table(examples_phonemes: list[str]) -> dict[str, int]:
    chars = sorted({c for p in examples_phonemes for c in p if c != " "})
    return {c: i + 1 for i, c in enumerate(chars)}


def corpus_shards(opts: TrainOptions) -> list[Path]:
    """The finished shards: full utterances (`train-*`, at most `max_shards`), phrases (`phrase-*`),
    jumbles (`jumble-*`), prose utterances (`prose-*`) and WordNet's examples (`wordnet-*`)."""
    def done(pattern: str) -> list[Path]:
        return sorted(p for p in opts.corpus.glob(pattern) if not p.name.endswith(".tmp.npz"))

    return (done("train-*.npz")[:opts.max_shards] + done("phrase-*.npz") + done("jumble-*.npz")
            + done("prose-*.npz") + done("wordnet-*.npz"))


def target_ids(tok: Tokenizer, spell: Pieces, text: str) -> list[int]:
    """`language English<asr_text>{text}<|im_end|>`, the text spelled with synth-en's pieces."""
    return tok.encode(TARGET_PREFIX) + spell.encode(text) + [tok.token_id("<|im_end|>")]


def load_examples(shards: list[Path], tok: Tokenizer, table: dict[str, int], spell: Pieces,
                  vocab: Vocab | None = None) -> list[Example]:
    """The utterances of `shards`; phoneme symbols outside `table` are dropped, and (with `vocab`)
    utterances with a token outside it are skipped."""
    out = []
    n_prefix = len(tok.encode(TARGET_PREFIX))
    for s in shards:
        feats, lengths, meta = corpus.load_shard(s)
        offs = np.concatenate([[0], np.cumsum(lengths)])
        for i, m in enumerate(meta):
            target = target_ids(tok, spell, m["text"])
            if vocab is not None and (vocab.index[torch.tensor(target)] < 0).any():
                continue
            out.append(Example(feats[:, offs[i]:offs[i + 1]], target,
                               [table[c] for c in m["phonemes"] if c in table], m["text"],
                               word_structure(tok, m["text"], m["phonemes"], table, target[n_prefix:-1]),
                               m.get("recipe", {}).get("voice") == speech.PIPER, m.get("source", "")))
    return out


@dataclass
class TextExample:
    target: list[int]
    phones: list[int]
    words: list[int]  # index in `phones` of each word's first phoneme


def load_texts(paths: list[Path], tok: Tokenizer, table: dict[str, int], spell: Pieces, vocab: Vocab
               ) -> list[TextExample]:
    """Texts without audio (`corpus.build_text_phonemes`) whose tokens are all trained rows."""
    out = []
    for path in paths:
        for line in path.read_text(encoding="utf-8").splitlines():
            if not line.strip():
                continue
            d = json.loads(line)
            target = target_ids(tok, spell, d["text"])
            if (vocab.index[torch.tensor(target)] < 0).any():
                continue
            phones: list[int] = []
            words: list[int] = []
            for word in d["phonemes"].split():
                ids = [table[c] for c in word if c in table]
                if ids:
                    words.append(len(phones))
                    phones += ids
            if phones:
                out.append(TextExample(target, phones, words))
    return out


def text_files(opts: TrainOptions) -> list[Path]:
    return sorted(opts.corpus.glob("text-*.jsonl"))


def phone_table_of(shards: list[Path]) -> dict[str, int]:
    return phone_table([m["phonemes"] for s in shards for m in corpus.load_shard(s)[2]])


def batches(examples: list[Example], rng: random.Random, batch_frames: int, max_frames: int,
            piper_repeat: int = 1, prose_repeat: int = 1):
    """Length-bucketed batches of at most `batch_frames` frames (padding counted), in random order
    within each chunk of 512 utterances (in length order they would sweep from short to long
    utterances over dozens of steps, and the optimiser would follow the sweep). Each utterance once
    a pass; the Piper voice's `piper_repeat` times and the fortunes' and the Bible's (phrases of them
    too) `prose_repeat` times, the larger where both apply. At step 22,000 the encoder's greedy
    phoneme error on its own training audio was 31% in the Piper voice and 10% in espeak-ng's (held
    out: 34%, 10%): Piper is underfit, not overfit. At step 25,200 the decoder read held-out meeting
    talk at 10% WER and fortunes at 90%, often going on with a meeting sentence: 55% of utterances
    are meeting talk, and its language model wins."""
    pool = [e for e in examples if e.feats.shape[1] <= max_frames]
    pool += [e for e in pool for _ in range(max(piper_repeat if e.piper else 1,
                                                 prose_repeat if e.source in corpus.PROSE_WEIGHTS else 1) - 1)]
    rng.shuffle(pool)
    for i in range(0, len(pool), 512):
        chunk = sorted(pool[i:i + 512], key=lambda e: e.feats.shape[1])
        groups: list[list[Example]] = []
        group: list[Example] = []
        for e in chunk:
            if group and (len(group) + 1) * e.feats.shape[1] > batch_frames:
                groups.append(group)
                group = []
            group.append(e)
        if group:
            groups.append(group)
        rng.shuffle(groups)
        yield from groups


def spec_augment(feats: np.ndarray, rng: random.Random, freq_bins: int, time_frames: int,
                 freq_masks: int = 2, frames_per_time_mask: int = 200) -> np.ndarray:
    """SpecAugment's masks (Park et al. 2019) on a float32 log-mel [128, T], in place, filled with its
    mean: `freq_masks` bands of 0..`freq_bins` mel bins, and one stretch of 0..`time_frames` frames per
    `frames_per_time_mask` frames (at least one). At step 80,003, 40 training fortunes and verses in
    the Piper voice read at 17.6% WER from their training audio and at 37.6% from a new rendering of
    the same text at another training speed (espeak-ng voices: 13.5%, 18.8% in held-out voices):
    the model had learnt its training audio. 2,930 steps with both kinds (16, 30) did not close that
    gap and the decoder came to lean less on the audio (docs/synth-en.md), so synth-en's time masks
    are off. 0 turns a kind of mask off."""
    n_mel, T = feats.shape
    fill = float(feats.mean())
    for _ in range(freq_masks if freq_bins > 0 else 0):
        w = rng.randint(0, min(freq_bins, n_mel))
        f0 = rng.randint(0, n_mel - w)
        feats[f0:f0 + w] = fill
    for _ in range(max(1, T // frames_per_time_mask) if time_frames > 0 else 0):
        w = rng.randint(0, min(time_frames, T))
        t0 = rng.randint(0, T - w)
        feats[:, t0:t0 + w] = fill
    return feats


def time_warp(feats: np.ndarray, rng: random.Random, tempo: float, local: float,
              segment: int = 25) -> np.ndarray:
    """The utterance read at another pace, on its log-mel [128, T] frames: a tempo drawn from
    1 +- `tempo` for the whole of it, times one drawn from 1 +- `local` for each `segment` frames
    (a speaker who speeds up and slows down within a sentence), each output frame linearly
    interpolated between the two source frames around its place. Pitch and spectra stay: a change
    of pace, not of voice (the corpus's resampling moves both). At step 80,003 the same 40 training
    texts in the Piper voice read at 17.6% WER from their training audio and at 37.6% from a new
    rendering at another length scale: each pass showed the model the same frames. 0, 0: unchanged."""
    if tempo <= 0 and local <= 0:
        return feats
    T = feats.shape[1]
    overall = rng.uniform(1 - tempo, 1 + tempo) if tempo > 0 else 1.0
    src = np.append(np.arange(0, T - 1, segment, dtype=np.float64), T - 1)  # segment bounds in source frames
    rates = [overall * (rng.uniform(1 - local, 1 + local) if local > 0 else 1.0) for _ in range(len(src) - 1)]
    dst = np.concatenate([[0.0], np.cumsum(np.diff(src) / np.array(rates))])  # where they land
    pos = np.interp(np.arange(int(dst[-1]) + 1), dst, src)  # each output frame's place in the source
    lo = np.minimum(pos.astype(np.int64), T - 1)
    hi = np.minimum(lo + 1, T - 1)
    frac = (pos - lo).astype(np.float32)
    return feats[:, lo] * (1 - frac) + feats[:, hi] * frac


def warp_vocal_tract(feats: np.ndarray, rng: random.Random, warp: float) -> np.ndarray:
    """Vocal tract length perturbation (Jaitly & Hinton 2013) on log-mel [128, T] frames: every
    frequency scaled by a factor drawn from 1 +- `warp` (a longer or shorter vocal tract moves the
    formants together), each mel bin taking the value at its centre frequency / factor,
    interpolated between the bins around it; beyond the outer bins' centres, the outer bins. Held-out
    espeak-ng voices read 40 training texts at 18.8% WER, their training voices at 13.5%. 0: unchanged."""
    if warp <= 0:
        return feats
    factor = rng.uniform(1 - warp, 1 + warp)
    centres = mel_centres_hz(feats.shape[0])
    src = np.interp(centres / factor, centres, np.arange(len(centres)))
    lo = np.minimum(src.astype(np.int64), len(centres) - 1)
    hi = np.minimum(lo + 1, len(centres) - 1)
    frac = (src - lo).astype(np.float32)[:, None]
    return feats[lo] * (1 - frac) + feats[hi] * frac


def augment(feats: np.ndarray, rng: random.Random, opts: TrainOptions) -> np.ndarray:
    """A training utterance's fp16 frames as one step sees them (float32): its pace warped, its
    vocal tract warped, then SpecAugment's masks, each as `opts` sets it (0: off)."""
    x = feats.astype(np.float32)
    x = time_warp(x, rng, opts.tempo, opts.tempo_local)
    x = warp_vocal_tract(x, rng, opts.vtlp)
    return spec_augment(x, rng, opts.freq_mask, opts.time_mask)


def text_batches(texts: list[TextExample], rng: random.Random, size: int, per_draw: int = 8):
    """Endless batches of `size` texts without audio, each text drawn uniformly with replacement
    from `texts` (which may grow between draws), length-bucketed within each draw of `per_draw`
    batches and served in random order. A batch is padded to its longest row sequence: on the
    training corpus's 120,000 texts, 16 texts drawn at random fill 43% of their padded length (a
    long fortune beside WordNet phrases), 16 of a sorted draw of 128 fill 84%."""
    while True:
        drawn = sorted((texts[rng.randrange(len(texts))] for _ in range(size * per_draw)),
                       key=lambda t: len(t.phones) + len(t.target))
        groups = [drawn[i:i + size] for i in range(0, len(drawn), size)]
        rng.shuffle(groups)
        yield from groups
