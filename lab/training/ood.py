"""synth-en's out-of-distribution set: text no training source has, in the held-out set's voices.

The held-out set (`heldout.jsonl`) draws its text from the generators training uses (the fortunes,
the KJV, meeting talk), so its WER says how well the model reads held-out sentences of familiar
kinds. `ood.jsonl` (`harken eval --set ood`) pairs the first 100 held-out recipes' acoustics (voice,
variant, rate, pitch, noise, reverb, tempo, seed: the same conditions, utterance for utterance) with
sentences of four kinds of English that training never reads, all from files a Debian machine has:

    debian-descriptions   long descriptions of the installed packages (/var/lib/dpkg/status)
    debian-summaries      one-line descriptions of the archive's packages (apt's `main` index)
    vim-manual            Vim's user manual (vim-runtime, usr_*.txt)
    info-manuals          the GNU-style Info manuals (coreutils, grep, sed, gzip, wget, ...)

A sentence qualifies when it is plain speakable English (`plain`): 5-25 words, letters and common
punctuation only (no digits, URLs, code, quotes of commands), no capitalised word after the first
but "I", no single letters but "a" and "I", no licence talk, and every word (or both halves of a
hyphenated one) a WordNet lemma, a regular inflection of one or a function word; it is
neither a training sentence (`text.sources`) nor a held-out one. Each source's sentences are ranked
by a hash of their normalised form (so the pick does not depend on file order and survives most
package installs), no two picked sentences begin with the same three words, and the sources are
shuffled together with a fixed seed. `python -m harken.training.ood OUT.jsonl` writes the set.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
import sys
from pathlib import Path

from harken.training import corpus, text
from harken.training.ood_sources import MAX_WORDS, MIN_WORDS, OOD_FILE, READERS, plain
from harken.training.text import CorpusTextError

__all__ = ["OOD_FILE", "QUOTAS", "MIN_WORDS", "MAX_WORDS", "READERS", "plain", "ood_texts", "ood_recipes",
           "write_ood"]

QUOTAS = {"debian-descriptions": 30, "vim-manual": 30, "info-manuals": 25, "debian-summaries": 15}


# --- the set -------------------------------------------------------------------------------------

def _rank(seed: int, sentence: str) -> bytes:
    return hashlib.sha1(f"harken-ood:{seed}:{text.key(sentence)}".encode()).digest()


def ood_texts(seed: int = 0, quotas: dict[str, int] = QUOTAS) -> list[tuple[str, str]]:
    """(source, sentence) pairs, `sum(quotas)` of them, in a seeded order mixing the sources."""
    seen = {text.key(s) for group in text.sources(seed).values() for s in group}
    seen |= {text.key(u.recipe.text) for u in corpus.read_held_out()}
    openings: set[tuple[str, ...]] = set()
    picked: list[tuple[str, str]] = []
    for source, n in quotas.items():
        candidates: dict[str, str] = {}
        for raw in READERS[source]():
            s = plain(raw)
            if s and text.key(s) not in seen:
                candidates.setdefault(text.key(s), s)
        got = 0
        for s in sorted(candidates.values(), key=lambda s: _rank(seed, s)):
            opening = tuple(text.key(s).split()[:3])
            if got == n:
                break
            if opening not in openings:
                openings.add(opening)
                seen.add(text.key(s))
                picked.append((source, s))
                got += 1
        if got < n:
            raise CorpusTextError(f"{source}: only {got} plain sentences, {n} wanted")
    random.Random(f"harken-ood:{seed}:order").shuffle(picked)
    return picked


def ood_recipes(seed: int = 0, quotas: dict[str, int] = QUOTAS) -> list[corpus.Utterance]:
    """The OOD set: new texts in the acoustic conditions of the held-out set's first recipes, in order."""
    texts = ood_texts(seed, quotas)
    held = corpus.read_held_out()
    if len(held) < len(texts):
        raise CorpusTextError(f"{corpus.HELD_OUT_FILE}: {len(held)} recipes, {len(texts)} wanted")
    return [corpus.Utterance(dataclasses.replace(u.recipe, text=s), source)
            for u, (source, s) in zip(held, texts)]


def write_ood(path: Path = OOD_FILE, seed: int = 0) -> Path:
    lines = [json.dumps({"source": u.source, **u.recipe.to_json()}, ensure_ascii=False) for u in ood_recipes(seed)]
    Path(path).write_text("\n".join(lines) + "\n", encoding="utf-8")
    return Path(path)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) > 1 or args[:1] in (["-h"], ["--help"]):
        print("usage: python -m harken.training.ood [OUT.jsonl]  (default: lab/training/ood.jsonl)")
        return 0 if args[:1] in (["-h"], ["--help"]) else 2
    out = write_ood(Path(args[0]) if args else OOD_FILE)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
