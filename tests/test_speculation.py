"""cloud/inference/speculation.py against plain greedy decoding, recomputed step by step.

The "model" is any deterministic next-token function of the sequence so far (a hash of it), so
prefill and decode steps agree by construction and only the bookkeeping is under test: greedy
decoding with a draft verified in one pass, then decoded on, must give the tokens plain greedy
decoding gives, for drafts that are right, wrong at any place, or longer than the answer."""

from __future__ import annotations

import random

import pytest

from harken.cloud.inference.speculation import greedy_prefix

VOCAB = 5


def next_token(seq: tuple[int, ...], seed: int) -> int:
    return hash((seed, seq)) % VOCAB


def plain(prompt: tuple[int, ...], n: int, seed: int) -> list[int]:
    out: list[int] = []
    for _ in range(n):
        out.append(next_token(prompt + tuple(out), seed))
    return out


def speculative(prompt: tuple[int, ...], draft: list[int], n: int, seed: int) -> list[int]:
    # one "prefill" over prompt + draft: the argmax after the prompt and after each drafted token
    greedy = [next_token(prompt + tuple(draft[:i]), seed) for i in range(len(draft) + 1)]
    out = greedy_prefix(greedy, draft)[:n]
    while len(out) < n:  # decode on from the confirmed tokens
        out.append(next_token(prompt + tuple(out), seed))
    return out


@pytest.mark.parametrize("seed", range(40))
def test_verified_drafts_give_plain_greedy_tokens(seed):
    rng = random.Random(seed)
    prompt = tuple(rng.randrange(VOCAB) for _ in range(rng.randrange(1, 6)))
    n = rng.randrange(1, 12)
    reference = plain(prompt, n + 4, seed)
    drafts = [reference[:k] for k in range(n + 4)]  # right drafts of every length
    for k in range(n + 3):  # one wrong token at every place
        wrong = list(reference[:k + 1])
        wrong[k] = (wrong[k] + 1) % VOCAB
        drafts.append(wrong + reference[k + 1:])
    drafts.append([rng.randrange(VOCAB) for _ in range(8)])
    for draft in drafts:
        assert speculative(prompt, draft, n, seed) == reference[:n], draft


def test_the_prefix_stops_after_the_first_disagreement():
    assert greedy_prefix([3, 1, 4], [3, 1]) == [3, 1, 4]  # all confirmed, one more token
    assert greedy_prefix([3, 2, 4], [3, 1]) == [3, 2]  # token 2 disagrees: what follows is unknown
    assert greedy_prefix([7], []) == [7]
    with pytest.raises(ValueError):
        greedy_prefix([1, 2], [1, 2])
