"""Exact self-speculative greedy decoding: which tokens one prefill over a draft settles.

A pass's prefill ends with its draft (the previous update's uncommitted tokens,
`DecoderStream.draft`), and the prefill returns the argmax after the prompt and after each drafted
token (`prefill(..., tails=...)`): greedy[0] follows the prompt, greedy[i + 1] follows the prompt
and draft[:i + 1]. So greedy[i + 1] is what plain greedy decoding would choose next only if it had
chosen draft[:i + 1] before, i.e. while greedy[i] == draft[i]. At the first disagreement the slot
forgets the drafted positions after it (`Engine._verify`), and the pass decodes on from exactly
where plain greedy decoding would be: the same tokens, the confirmed ones costing a share of one
prefill instead of a decode step each.
"""

from __future__ import annotations

from typing import Sequence


def greedy_prefix(greedy: Sequence[int], draft: Sequence[int]) -> list[int]:
    """The tokens plain greedy decoding gives that the prefill over `draft` settles:
    greedy[0], then greedy[i + 1] for as long as greedy[i] == draft[i] (len(greedy) == len(draft) + 1)."""
    if len(greedy) != len(draft) + 1:
        raise ValueError(f"{len(greedy)} greedy tokens for a draft of {len(draft)}")
    out = []
    for i, t in enumerate(greedy):
        out.append(t)
        if i == len(draft) or t != draft[i]:
            break
    return out
