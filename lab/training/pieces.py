"""The pieces synth-en writes with: a small subset of the real Qwen vocabulary.

A model trained on ~25 h of speech cannot learn 26,000 output classes (one per word the text
uses, most seen a handful of times): the ASR rule of thumb is a few hundred to a few thousand
subword units for so little data. So synth-en's targets are the same text spelled with fewer Qwen
tokens: the most frequent tokens stay whole (" the", " will", "ing"), and a rarer token is written
as the fewest allowed pieces that make up its bytes (" Galliano" -> " G" "all" "iano"). Every piece
is a real Qwen token and the pieces decode to exactly the same text, so the shipped model is an
ordinary Qwen3-ASR checkpoint with the real tokenizer; it simply never emits the tokens it was not
trained on (their embedding rows are zero).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from functools import lru_cache

from harken.cloud.model.tokenizer import Tokenizer


class Pieces:
    """Spell text with `allowed` token ids (a set that contains every byte's single-byte token)."""

    def __init__(self, tok: Tokenizer, allowed: Iterable[int]):
        self.tok = tok
        self.allowed = frozenset(int(i) for i in allowed)
        self.by_bytes = {tok.token_bytes(i): i for i in self.allowed}
        self.longest = max(len(b) for b in self.by_bytes)
        self._split = lru_cache(maxsize=200_000)(self._split_uncached)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` (added tokens such as `<asr_text>` matched literally, as
        `Tokenizer.encode`), each token outside `allowed` replaced by its fewest allowed pieces."""
        out: list[int] = []
        for t in self.tok.encode(text):
            out += [t] if t in self.allowed or t in self.tok.added_ids else self._split(t)
        return out

    def _split_uncached(self, token_id: int) -> list[int]:
        data = self.tok.token_bytes(token_id)
        n = len(data)
        # fewest pieces over data[:i]; ties go to the split whose first pieces are longest
        best: list[tuple[int, int] | None] = [(0, 0)] + [None] * n
        for i in range(1, n + 1):
            for j in range(max(0, i - self.longest), i):
                prev = best[j]
                if prev is None or data[j:i] not in self.by_bytes:
                    continue
                cand = (prev[0] + 1, j)
                cur = best[i]
                if cur is None or cand[0] < cur[0]:
                    best[i] = cand
        if best[n] is None:
            raise ValueError(f"token {token_id} cannot be spelled with the allowed pieces")
        ids: list[int] = []
        i = n
        while i > 0:
            step = best[i]
            assert step is not None  # every start of a piece on the path from best[n] was reached
            j = step[1]
            ids.append(self.by_bytes[data[j:i]])
            i = j
        return ids[::-1]


def choose(tok: Tokenizer, sentences: Iterable[str], whole: int = 1000, parts: int = 600) -> list[int]:
    """The allowed token ids for `sentences`: the `whole` most frequent tokens of their ordinary
    tokenisation; the `parts` Qwen tokens (2+ bytes) that save most pieces inside the rarer tokens;
    and every single-byte token (so that anything can be spelled). Deterministic."""
    counts: Counter[int] = Counter()
    for s in sentences:
        counts.update(tok.encode(s))
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    keep = {t for t, _ in ranked[:whole]}
    singles = {b: tok.encode_byte(b) for b in range(256)}
    vocab_bytes = _vocab_bytes(tok)
    gain: Counter[int] = Counter()
    for t, n in ranked[whole:]:
        data = tok.token_bytes(t)
        for i in range(len(data)):
            for j in range(i + 2, min(len(data), i + 8) + 1):
                sub = vocab_bytes.get(data[i:j])
                if sub is not None:
                    gain[sub] += n * (j - i - 1)
    keep.update(t for t, _ in sorted(gain.items(), key=lambda kv: (-kv[1], kv[0]))[:parts])
    keep.update(i for i in singles.values() if i is not None)
    return sorted(keep)


def _vocab_bytes(tok: Tokenizer) -> dict[bytes, int]:
    out = {}
    for i in range(tok.vocab_size):
        if i in tok.added_ids:
            continue
        b = tok.token_bytes(i)
        if b and b not in out:
            out[b] = i
    return out
