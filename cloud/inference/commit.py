"""Commit policy and transcript text of the streaming engine: pure functions, no torch.

Every update decodes a hypothesis after the tokens already committed for the current audio item.
`CommitPolicy` says which of those tokens to commit now; `ItemText` turns committed tokens (and the
hypothesis) into text that only ever grows:

    committed tokens  -> bytes -> longest complete UTF-8 prefix -> header split -> strip
                      -> committed text (a prefix of every later committed text)
    + hypothesis      -> the same -> partial text (may change at every update)

Rules (see `CommitPolicy.decide`):
- "local-agreement" (default): commit the longest common prefix of this hypothesis and the previous
  one, but never any of the last `rollback_tokens` of this hypothesis;
- "rollback-only" (what the official streaming does): commit all but the last `rollback_tokens`;
- "confidence": commit the longest prefix whose every token the model gave at least
  `confidence_prob`, never any of the last `rollback_tokens` (one update suffices: no agreement);
- "agreement-or-confidence": the longer of the two.
`min_token_prob` (any rule): never commit past a token the model gave less than this.
Committed tokens are forced into the prompt afterwards, so they are never retracted; hence an
intermediate commit never ends inside the language header, nor on one that says silence
(`ItemText.committable`): the final pass decides those.

Text: the language header the model writes when no language is forced (`language English<asr_text>`)
is part of the token stream but not of the text; `language None<asr_text>` means silence. The
header is recognised at the start of an item only (as `parse_transcript` reads a whole answer);
text is emitted only once it cannot belong to a header. Incomplete multi-byte characters and
trailing whitespace are held back until they are complete or followed by more text. The one
difference from `parse_transcript` of the whole answer: no repetition collapse (it would rewrite
text already committed), so a degenerate answer with runs of >20 repeats keeps them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Callable, Sequence

from ..model.decode_limits import DecodeLimits
from ...shared.text import join_texts  # noqa: F401  (the segment/item join rule, shared with the edge)
from ..model.prompt import parse_transcript

ASR_TEXT = "<asr_text>"
HEADER_WORD = "language"
AGREEMENT_RULES = ("local-agreement", "rollback-only", "confidence", "agreement-or-confidence")


@dataclass(frozen=True)
class CommitPolicy:
    """How often updates run and what they commit.

    update_interval_s: audio time between updates of an item (updates run at fixed audio-time
        boundaries counted from the item's start, so commits depend on the features alone, not on
        when they arrive).
    rollback_tokens: the last k tokens of a hypothesis are never committed by an update.
    agreement: "local-agreement" or "rollback-only" (see the module docstring).
    intermediate_commits: False = commit only at the final pass (updates give partials only).
    max_new_tokens_per_update: greedy tokens decoded by an intermediate update at most.
    max_item_tokens: tokens generated per audio item in all (committed + final pass); bounds the
        decoder prompt and the final pass (the offline default is 512).
    limits: the audio-proportional token budget and the loop guard (`model/decode_limits.py`): a pass
        over t seconds of an item generates at most `limits.budget(t)` tokens in all for the item
        (committed ones included), and a hallucination loop ends it.
    segment_limit_s: a segment longer than this is cut at the last encoder-window (8 s) boundary
        at or before it; the next audio item continues it with the committed text as context.
    context_tail_chars: committed text carried into the next item's context (after the user's).
    """

    update_interval_s: float = 1.0
    rollback_tokens: int = 5
    agreement: str = "local-agreement"
    intermediate_commits: bool = True
    max_new_tokens_per_update: int = 32
    max_item_tokens: int = 256
    segment_limit_s: float = 30.0
    context_tail_chars: int = 200
    limits: DecodeLimits = DecodeLimits()
    confidence_prob: float = 0.95  # "confidence": a token commits from one update at this probability
    min_token_prob: float = 0.0  # no rule commits past a token below this probability

    def __post_init__(self):
        if self.agreement not in AGREEMENT_RULES:
            raise ValueError(f"agreement must be one of {AGREEMENT_RULES}, got {self.agreement!r}")
        if self.update_interval_s <= 0 or self.rollback_tokens < 0 or self.max_new_tokens_per_update < 1:
            raise ValueError("update_interval_s > 0, rollback_tokens >= 0, max_new_tokens_per_update >= 1")
        if self.max_item_tokens < 1 or self.context_tail_chars < 0:
            raise ValueError("max_item_tokens >= 1 and context_tail_chars >= 0")

    @property
    def update_interval_frames(self) -> int:
        return max(1, round(self.update_interval_s * 100))

    def cut_frames(self, window_frames: int) -> int:
        """Where an item that outgrows the limit is cut: the last window boundary <= the limit."""
        limit = round(self.segment_limit_s * 100)
        cut = limit // window_frames * window_frames
        if cut < window_frames:
            raise ValueError(f"segment_limit_s {self.segment_limit_s} is shorter than one encoder "
                             f"window ({window_frames / 100:g} s)")
        return cut

    def limit_frames(self) -> int:
        return round(self.segment_limit_s * 100)

    def decide(self, hypothesis: Sequence[int], previous: Sequence[int] | None,
               probs: Sequence[float] | None = None) -> int:
        """How many leading tokens of `hypothesis` (the tokens decoded after the committed ones) to
        commit now. `previous` is the previous update's hypothesis, re-based after the tokens
        committed since (None for the first update of an item); `probs` the probability the model
        gave each token of `hypothesis` (None: unknown; the probability rules then commit nothing)."""
        if not self.intermediate_commits:
            return 0
        room = max(len(hypothesis) - self.rollback_tokens, 0)
        if self.agreement == "agreement-or-confidence":
            agreed = CommitPolicy.decide(replace(self, agreement="local-agreement"), hypothesis, previous, probs)
            sure = CommitPolicy.decide(replace(self, agreement="confidence", min_token_prob=0.0), hypothesis, previous,
                                       probs)
            return max(agreed, sure)
        if self.agreement == "confidence" or self.min_token_prob > 0:
            if probs is None or len(probs) < len(hypothesis):
                return 0
            floor = self.confidence_prob if self.agreement == "confidence" else self.min_token_prob
            sure = next((i for i, p in enumerate(probs[:len(hypothesis)]) if p < floor), len(hypothesis))
            room = min(room, sure)
            if self.agreement == "confidence":
                return room
        if self.agreement == "rollback-only":
            return room
        if previous is None:
            return 0
        return min(room, common_prefix(hypothesis, previous))


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def complete_utf8_length(data: bytes) -> int:
    """Length of the longest prefix of `data` that does not end inside a multi-byte character.

    Only a lead byte followed by too few continuation bytes at the very end is held back; any
    other invalid byte counts as complete (it decodes to U+FFFD and stays that way).
    """
    n = len(data)
    i = n - 1
    while i >= 0 and n - i <= 4 and data[i] & 0xC0 == 0x80:
        i -= 1
    if i < 0 or n - i > 4:
        return n
    lead = data[i]
    need = 2 if 0xC0 <= lead < 0xE0 else 3 if 0xE0 <= lead < 0xF0 else 4 if 0xF0 <= lead < 0xF8 else 1
    return i if n - i < need else n


def split_header(raw: str, forced_language: str | None, final: bool) -> tuple[str | None, str]:
    """(language, body) of an item's answer so far; language None while the header is unfinished.

    `raw` is the decoded answer (special tokens dropped, `<asr_text>` kept). With a forced language
    the whole answer is body. Otherwise an answer that starts like `language ...` is a header up
    to `<asr_text>` (body "" until it comes; at the final pass an unfinished header is body, as
    `parse_transcript` reads it); an answer that cannot start a header is all body.
    """
    if forced_language:
        return forced_language, raw
    s = raw.lstrip()
    if not (s.startswith(HEADER_WORD) or HEADER_WORD.startswith(s)):
        return "", s  # no header: everything is text (a stray marker too, so nothing is retracted)
    if ASR_TEXT in s:
        meta, body = s.split(ASR_TEXT, 1)
        return header_language(meta), body
    if final:
        return "", s
    return None, ""


def header_language(meta: str) -> str:
    """'language English' -> 'English'; 'language None' (silence) or anything unreadable -> '',
    exactly as the offline parser reads a header."""

    return parse_transcript(meta + ASR_TEXT).language


def compose_context(user_context: str, carried: str) -> str:
    """The system-turn context of an audio item: the user's context, then the carried text."""
    return f"{user_context}\n{carried}" if user_context and carried else user_context or carried


@dataclass(frozen=True)
class TextView:
    """Text of an item after one update."""

    language: str | None  # None while the header is still being written
    committed_delta: str  # committed text new since the previous view
    committed: str  # all committed text of the item
    partial: str  # text of the uncommitted hypothesis, after the committed text


class ItemText:
    """Committed bytes of one audio item -> monotone committed text and the current partial."""

    def __init__(self, token_bytes: Callable[[int], bytes], forced_language: str | None):
        self.token_bytes = token_bytes
        self.forced_language = forced_language
        self.committed_bytes = bytearray()
        self.committed = ""  # committed text emitted so far (stripped: see `view`)
        self.language: str | None = forced_language

    def bytes_of(self, tokens: Sequence[int]) -> bytes:
        return b"".join(self.token_bytes(t) for t in tokens)

    def _text(self, data: bytes, final: bool) -> tuple[str | None, str]:
        if final:
            raw = data.decode("utf-8", errors="replace")
        else:
            raw = data[:complete_utf8_length(data)].decode("utf-8", errors="replace")
        language, body = split_header(raw, self.forced_language, final)
        return language, body.lstrip()

    def committable(self, hypothesis: Sequence[int], n: int) -> int:
        """How many of the `n` tokens a rule would commit may be committed by an intermediate
        update: all of them, or none while they would end the committed tokens inside the language
        header or on a header that says silence (`language None`, or one nothing can read). Committed
        tokens are forced into every later pass, so a header committed early (speech may still
        start) would make the model go on from a wrong or half-written header."""
        if n == 0 or self.language is not None:  # forced, or the committed tokens settled it
            return n
        raw = (bytes(self.committed_bytes) + self.bytes_of(hypothesis[:n])).decode("utf-8", errors="replace")
        language, _ = split_header(raw, None, final=False)
        if language is None or (language == "" and ASR_TEXT in raw):
            return 0
        return n

    def update(self, new_committed: Sequence[int], hypothesis: Sequence[int], final: bool) -> TextView:
        """Add newly committed tokens; `hypothesis` is what stays uncommitted (for the partial).
        `final` = the item is complete: held-back bytes are flushed (U+FFFD for a broken tail)."""
        self.committed_bytes += self.bytes_of(new_committed)
        language, body = self._text(bytes(self.committed_bytes), final)
        # trailing whitespace waits for the next word, so a final strip never retracts it
        text = body.rstrip()
        if not text.startswith(self.committed):
            raise AssertionError(f"committed text would change: {self.committed!r} -> {text!r}")
        delta = text[len(self.committed):]
        self.committed = text
        if language is not None:
            self.language = language
        partial = ""
        if hypothesis and not final:
            lang_full, full = self._text(bytes(self.committed_bytes) + self.bytes_of(hypothesis), False)
            full = full.rstrip()
            if full.startswith(text):
                partial = full[len(text):]
            if self.language is None and lang_full is not None:
                language = lang_full
        return TextView(language if language is not None else self.language, delta, text, partial)


def stability(hypothesis: Sequence[int], previous: Sequence[int] | None) -> float:
    """How settled the uncommitted tokens are: the share of them that the previous update's
    hypothesis already had (1.0 when nothing is pending)."""
    if not hypothesis:
        return 1.0
    if previous is None:
        return 0.0
    return common_prefix(hypothesis, previous) / len(hypothesis)


def word_confidences(token_bytes: Callable[[int], bytes], tokens: Sequence[int], probs: Sequence[float],
                     forced_language: str | None) -> tuple[float, ...]:
    """The confidence of each word of an item's text (its whitespace-separated words after the
    language header, as `ItemText` shows them): the mean probability of the tokens that make it up.
    A token spanning two words counts for both."""
    data, ends = b"", []
    for t in tokens:
        data += token_bytes(t)
        ends.append(len(data.decode("utf-8", errors="replace")))
    text = data.decode("utf-8", errors="replace")
    body = 0
    if not forced_language and ASR_TEXT in text and text.lstrip().startswith(HEADER_WORD):
        body = text.index(ASR_TEXT) + len(ASR_TEXT)
    out = []
    for word in re.finditer(r"\S+", text[body:]):
        a, b = word.start() + body, word.end() + body
        covering = [p for p, start, end in zip(probs, [0, *ends[:-1]], ends) if start < b and end > a]
        out.append(round(sum(covering) / len(covering), 4) if covering else 0.0)
    return tuple(out)
