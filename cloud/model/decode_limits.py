"""How much a decode may generate: a budget from the audio it covers, and a loop guard.

A model's own end-of-text cannot be trusted to bound the work: a real model runs on over noise,
music, long silences or a forced wrong language, and falls into the classic hallucination loop
(one phrase over and over). So every decode — an update's partial, a commit, a final pass, an
offline transcription — gets

- a token budget proportional to the audio it covers, `base_tokens + tokens_per_second * seconds`
  (the defaults leave ~2.5x headroom over fast English speech in Qwen's tokens, ~4 tokens/s, and
  digits, one token each), never a fixed cap; and
- a loop guard: when the hypothesis ends in a run of one block of `1..max_period` tokens repeated
  back to back, covering at least `loop_min_tokens` tokens and `loop_min_repeats` copies, the decode
  stops and the repeats after the block's first copy are dropped (so none is ever committed).

Pure functions, no torch: the engine, the offline path and the tests share them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

TRUNCATION_REASONS = ("budget", "loop")


@dataclass(frozen=True)
class DecodeLimits:
    tokens_per_second: float = 10.0
    base_tokens: int = 16  # the language header (`language English<asr_text>`: 5 tokens) and slack
    loop_min_tokens: int = 24
    loop_min_repeats: int = 3
    loop_max_period: int = 32

    def __post_init__(self):
        if self.tokens_per_second <= 0 or self.base_tokens < 1:
            raise ValueError("tokens_per_second > 0 and base_tokens >= 1")
        if self.loop_min_repeats < 2 or self.loop_max_period < 1 or self.loop_min_tokens < 2:
            raise ValueError("loop_min_repeats >= 2, loop_max_period >= 1, loop_min_tokens >= 2")

    def budget(self, seconds: float) -> int:
        """Tokens a decode over `seconds` of audio may generate in all (header and EOS included)."""
        return self.base_tokens + math.ceil(self.tokens_per_second * max(seconds, 0.0))

    def loop_cut(self, tokens: Sequence[int]) -> int | None:
        """If `tokens` ends in a repetition run (see the module docstring), the length to keep:
        everything before the run plus one copy of the block. Otherwise None."""
        return loop_cut(tokens, self.loop_min_tokens, self.loop_min_repeats, self.loop_max_period)


def loop_cut(tokens: Sequence[int], min_tokens: int, min_repeats: int, max_period: int) -> int | None:
    n = len(tokens)
    if n < min_tokens:
        return None
    for period in range(1, min(max_period, n // min_repeats) + 1):
        # how far back the tail keeps repeating with this period
        run = period
        while run < n and tokens[n - 1 - run] == tokens[n - 1 - run + period]:
            run += 1
        # `run` tokens at the end are periodic; whole copies of the block among them:
        copies = run // period
        if copies >= min_repeats and copies * period >= min_tokens:
            return n - run + period
    return None


def strip_eos(tokens: list[int], eos_ids) -> tuple[list[int], bool]:
    """(tokens without a final EOS, whether there was one)."""
    if tokens and tokens[-1] in eos_ids:
        return tokens[:-1], True
    return tokens, False
