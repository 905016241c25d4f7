"""The synth-en corpus on disk: utterance recipes -> audio -> exact edge log-mel, in shards.

    plan(seed, i)          the i-th training utterance's recipe, a pure function of (seed, i)
    build(out, n, ...)     shards `train-00000.npz` + `.jsonl` (features fp16 [128, sum T],
                           frame counts; one JSON line per utterance: text, phonemes, recipe);
                           `phrase-`, `jumble-` and `prose-` shards of the other planners (PLANNERS)
    held_out_recipes()     the held-out set: its text + synthesis recipes (kept in the repo as
                           `heldout.jsonl` beside this file, never audio)

Utterances are 1-20 s: one sentence, or two or three consecutive sentences of one source. Shards
are written whole (temp file, then rename), so an interrupted build resumes where it stopped and
gives the same corpus as an uninterrupted one.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from harken.training import manpages, speech, text
from harken.shared.errors import HarkenError

# synth-en's users speak in meetings and everyday English: meeting talk first, then the fortunes'
# quotes and jokes, and a little archaic verse (the held-out set is drawn with the same weights)
SOURCE_WEIGHTS = {"meeting": 0.55, "fortunes": 0.35, "kjv": 0.10}
PIPER_SHARE = 0.25  # utterances in the Piper voice (0 where it is not installed, e.g. on a lent GPU)
MAX_WORDS = 45  # ~20 s at the slowest voices
SHARD = 1000
HELD_OUT_FILE = Path(__file__).with_name("heldout.jsonl")


@dataclass(frozen=True)
class Utterance:
    recipe: speech.Recipe
    source: str


@lru_cache(maxsize=4)
def _split_sources(seed: int) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    train: dict[str, list[str]] = {}
    held: dict[str, list[str]] = {}
    for name, sentences in text.sources(seed).items():
        train[name], held[name] = text.split(sentences)
    return train, held


def _pick_text(r: random.Random, pool: dict[str, list[str]], weights: dict[str, float] = SOURCE_WEIGHTS
               ) -> tuple[str, str]:
    names = list(weights)
    source = r.choices(names, weights=[weights[n] for n in names])[0]
    sentences = pool[source]
    i = r.randrange(len(sentences))
    k = 1 if r.random() < 0.7 else r.choice([2, 3])
    picked = [sentences[i]]
    for s in sentences[i + 1:i + k]:
        if len(" ".join([*picked, s]).split()) > MAX_WORDS:
            break
        picked.append(s)
    return source, " ".join(picked)


def plan(seed: int, i: int, piper_share: float = PIPER_SHARE) -> Utterance:
    """The i-th training utterance (deterministic in seed, i and the Piper voice's share)."""
    r = random.Random(f"synth-en:{seed}:train:{i}")
    source, sentence = _pick_text(r, _split_sources(seed)[0])
    return Utterance(speech.sample_recipe(r, sentence, held_out=False, piper_share=piper_share), source)


PHRASE_WORDS = 6  # phrases: 1..PHRASE_WORDS consecutive words of a training sentence


def plan_phrase(seed: int, i: int, piper_share: float = PIPER_SHARE) -> Utterance:
    """The i-th short phrase (1-6 consecutive words of a training text, 0.3-3 s of speech): the
    first stage of training, where an attention decoder learns to find words in the audio."""
    r = random.Random(f"synth-en:{seed}:phrase:{i}")
    source, sentence = _pick_text(r, _split_sources(seed)[0])
    words = sentence.split()
    n = r.randint(1, min(PHRASE_WORDS, len(words)))
    a = r.randrange(len(words) - n + 1)
    return Utterance(speech.sample_recipe(r, " ".join(words[a:a + n]), held_out=False, piper_share=piper_share),
                     source)


JUMBLE_WORDS = (3, 12)  # jumbles: this many words, each from a different training text


def _jumble(r: random.Random, seed: int) -> str:
    """Words drawn one by one from training texts (so as often as they are spoken), in no order a
    language model could predict: only reading the audio gets them right."""
    pool = _split_sources(seed)[0]
    words: list[str] = []
    for _ in range(r.randint(*JUMBLE_WORDS)):
        text = _pick_text(r, pool)[1].split()
        j = r.randrange(len(text))
        w = text[j].strip(".,;:!?\"()[]")
        if j == 0 and w[1:].islower() and w != "I":  # a capital only because it began a sentence
            w = w.lower()
        if any(c.isalnum() for c in w):
            words.append(w)
    s = " ".join(words) or "yes"
    return s[0].upper() + s[1:]


def plan_jumble(seed: int, i: int, piper_share: float = PIPER_SHARE) -> Utterance:
    """The i-th jumble (`_jumble`), in an espeak-ng voice whatever `piper_share` is (Piper costs ~30x
    the CPU). Decoders that had learnt meeting talk lost their place in other text after two or three
    words and went on with a meeting sentence; jumbles train the reading itself."""
    r = random.Random(f"synth-en:{seed}:jumble:{i}")
    return Utterance(speech.sample_recipe(r, _jumble(r, seed), held_out=False, piper_share=0.0), "jumble")


# prose: the fortunes and the Bible in their own proportion, without meeting talk. The decoder reads
# held-out meeting talk at ~10% WER and the rest at 80-90% (step 21,203): texts without audio go
# where it is weak, not to more of the templates it already knows
PROSE_WEIGHTS = {k: v for k, v in SOURCE_WEIGHTS.items() if k != "meeting"}


def plan_prose(seed: int, i: int, piper_share: float = PIPER_SHARE) -> Utterance:
    """The i-th prose utterance: picked as `plan` picks, from the fortunes and the Bible only
    (`PROSE_WEIGHTS`). At step 46,540 training utterances of the fortunes and the Bible read at 21-48%
    WER and held-out ones at 45-82% (held-out meeting talk: 4-6%): the model had begun to learn the prose it
    was given by heart, so new prose is what the corpus needs more of, not meeting talk."""
    r = random.Random(f"synth-en:{seed}:prose:{i}")
    source, sentence = _pick_text(r, _split_sources(seed)[0], PROSE_WEIGHTS)
    return Utterance(speech.sample_recipe(r, sentence, held_out=False, piper_share=piper_share), source)


# WordNet's usage examples (from step 71,074): held-out fortunes and verses read at 44% / 34% WER
# and trained ones at 13-34% / 10-23% (step 65,600), held-out meeting talk at 3% in the same held-out
# voices: the model reads the open text it was given, not open text, so it gets more distinct text
WORDNET_WEIGHTS = {"wordnet": 1.0}


def plan_wordnet(seed: int, i: int, piper_share: float = PIPER_SHARE) -> Utterance:
    """The i-th WordNet utterance: one to three consecutive usage examples (`WORDNET_WEIGHTS`)."""
    r = random.Random(f"synth-en:{seed}:wordnet:{i}")
    source, sentence = _pick_text(r, _split_sources(seed)[0], WORDNET_WEIGHTS)
    return Utterance(speech.sample_recipe(r, sentence, held_out=False, piper_share=piper_share), source)


PLANNERS = {"train": plan, "phrase": plan_phrase, "jumble": plan_jumble, "prose": plan_prose,
            "wordnet": plan_wordnet}
TEXT_WEIGHTS = {"prose": PROSE_WEIGHTS, "wordnet": WORDNET_WEIGHTS}  # by kind; the rest: SOURCE_WEIGHTS
TEXT_LINES = 1000  # lines per `text-NNNNN.jsonl` file


def text_file(out: Path, kind: str, k: int) -> Path:
    """The k-th file of texts without audio: `text-NNNNN.jsonl`, or `text-{kind}-NNNNN.jsonl` (jumble, prose)."""
    return Path(out) / (f"text-{k:05d}.jsonl" if kind == "text" else f"text-{kind}-{k:05d}.jsonl")


def build_text_phonemes(out: str | Path, n: int, seed: int = 0, progress=None, kind: str = "text",
                        workers: int = 1) -> list[Path]:
    """Text without audio: `n` training texts (picked as utterances are; `kind` "jumble": jumbles,
    "prose": fortunes and Bible verses only, `PROSE_WEIGHTS`; "wordnet": WordNet's examples;
    "manpage": the manual pages' sentences, `manpages`) with
    espeak-ng's phonemes in a random English accent, in files (`text_file`) of `TEXT_LINES` lines
    (resuming: finished files are kept). They teach the decoder words no utterance has spoken yet."""
    files = [("text", kind, k, n) for k in range(-(-n // TEXT_LINES))]
    return build_files(out, files, seed, workers, progress)


def _write_text_file(path: Path, kind: str, a: int, b: int, seed: int) -> None:
    lines = []
    for i in range(a, b):
        r = random.Random(f"synth-en:{seed}:{kind}:{i}")
        if kind == "jumble":
            source, sentence = "jumble", _jumble(r, seed)
        elif kind == "manpage":
            source, sentence = _pick_text(r, {"manpage": manpages.training_sentences()}, {"manpage": 1.0})
        else:
            weights = TEXT_WEIGHTS.get(kind, SOURCE_WEIGHTS)
            source, sentence = _pick_text(r, _split_sources(seed)[0], weights)
        accent = r.choice(speech.ESPEAK_ACCENTS)
        lines.append(json.dumps({"text": sentence, "source": source, "accent": accent,
                                 "phonemes": speech.phonemes(sentence, accent)}, ensure_ascii=False))
    tmp = path.with_suffix(".tmp")
    tmp.write_text("\n".join(lines) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def held_out_recipes(seed: int = 0, n: int = 300) -> list[Utterance]:
    """The held-out set: held-out sentences in held-out voice x speed combinations, no
    augmentation beyond what a recipe draws (the same distribution as training otherwise)."""
    r = random.Random(f"synth-en:{seed}:held-out")
    pool = _split_sources(seed)[1]
    return [Utterance(speech.sample_recipe(r, s, held_out=True), src)
            for src, s in (_pick_text(r, pool) for _ in range(n))]


def write_held_out(path: Path = HELD_OUT_FILE, seed: int = 0, n: int = 300) -> Path:
    lines = [json.dumps({"source": u.source, **u.recipe.to_json()}, ensure_ascii=False)
             for u in held_out_recipes(seed, n)]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


class RecipeFileError(HarkenError):
    """A recipe file (`harken eval --set`) has a line that is not a recipe."""


def read_held_out(path: Path = HELD_OUT_FILE) -> list[Utterance]:
    """The utterances of a recipe file: lines of `heldout.jsonl`'s form (a recipe's fields and its
    `source`), or a corpus shard's `.jsonl` lines (`recipe` nested: training utterances, to tell what
    the model learnt by heart from what it can read)."""
    out = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            try:
                d = json.loads(line)
                fields = d["recipe"] if "recipe" in d else {k: v for k, v in d.items() if k != "source"}
                out.append(Utterance(speech.Recipe(**fields), d.get("source", "")))
            except (ValueError, TypeError, AttributeError) as e:
                raise RecipeFileError(f"{path}:{n}: not a recipe ({e})") from None
    return out


def render_features(recipe: speech.Recipe) -> np.ndarray:
    """The edge's exact log-mel [128, T] of a recipe's audio (what `harken stream` would send)."""
    from harken.edge.features import log_mel

    return log_mel(speech.render(recipe))


def _render_item(u: Utterance) -> tuple[np.ndarray, dict]:
    feats = render_features(u.recipe)
    meta = {"text": u.recipe.text, "source": u.source, "frames": int(feats.shape[1]),
            "phonemes": speech.phonemes(u.recipe.text, u.recipe.voice), "recipe": u.recipe.to_json()}
    return feats.astype(np.float16), meta


def write_shard(path: Path, utterances: list[Utterance]) -> None:
    items = [_render_item(u) for u in utterances]
    feats = np.concatenate([f for f, _ in items], axis=1)
    lengths = np.array([f.shape[1] for f, _ in items], dtype=np.int32)
    tmp = path.with_suffix(".tmp.npz")
    np.savez(tmp, feats=feats, lengths=lengths)
    path.with_suffix(".jsonl").write_text("\n".join(json.dumps(m, ensure_ascii=False) for _, m in items) + "\n",
                                          encoding="utf-8")
    os.replace(tmp, path)


def shard_path(out: Path, name: str, k: int) -> Path:
    return Path(out) / f"{name}-{k:05d}.npz"


def build(out: str | Path, n: int, seed: int = 0, workers: int = 1, progress=None, kind: str = "train",
          piper_share: float = PIPER_SHARE) -> list[Path]:
    """Write `n` utterances of `kind` ("train": `plan`, "phrase": `plan_phrase`, "jumble":
    `plan_jumble`) in shards of `SHARD` named `{kind}-NNNNN` under `out` (resuming: finished shards
    are kept). Returns the shard paths."""
    if kind not in PLANNERS:
        raise ValueError(f"kind must be one of {sorted(PLANNERS)}")
    return build_files(out, [("shard", kind, k, n) for k in range(-(-n // SHARD))], seed, workers, progress,
                       piper_share)


def corpus_file(out: str | Path, family: str, kind: str, k: int) -> Path:
    """File k of a kind: an utterance shard (`family` "shard") or a file of texts without audio ("text")."""
    return shard_path(Path(out), kind, k) if family == "shard" else text_file(Path(out), kind, k)


def build_files(out: str | Path, files: list[tuple[str, str, int, int]], seed: int = 0, workers: int = 1,
                progress=None, piper_share: float = PIPER_SHARE) -> list[Path]:
    """Build the corpus files `files`, each (family, kind, k, n): file k of `corpus_file`'s family and
    kind, of a kind with n items in all; those that exist are kept. They are started in the order
    given, `workers` at a time, so a list that interleaves the kinds gets every kind growing at once
    on any number of cores. Returns their paths, in that order."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = [corpus_file(out, family, kind, k) for family, kind, k, _ in files]
    per = {"shard": SHARD, "text": TEXT_LINES}
    jobs = [(p, family, kind, seed, k * per[family], min(n, (k + 1) * per[family]), piper_share)
            for p, (family, kind, k, n) in zip(paths, files) if not p.exists()]
    _split_sources(seed)  # read the text once, before any fork
    if workers > 1 and len(jobs) > 1:
        import multiprocessing as mp

        with mp.get_context("fork").Pool(workers) as pool:
            for done in pool.imap_unordered(_build_job, jobs):
                progress and progress(done)
    else:
        for job in jobs:
            done = _build_job(job)
            progress and progress(done)
    return paths


def _build_job(job) -> Path:
    path, family, kind, seed, a, b, piper_share = job
    if family == "shard":
        write_shard(path, [PLANNERS[kind](seed, i, piper_share) for i in range(a, b)])
    else:
        _write_text_file(path, kind, a, b, seed)
    return path


def load_shard(path: Path) -> tuple[np.ndarray, np.ndarray, list[dict]]:
    """(features fp16 [128, sum T], frame counts, metadata) of one shard."""
    with np.load(path) as z:
        feats, lengths = z["feats"], z["lengths"]
    meta = [json.loads(line) for line in path.with_suffix(".jsonl").read_text(encoding="utf-8").splitlines()
            if line.strip()]
    return feats, lengths, meta
