"""cloud/inference/commit.py: the commit rules and the streaming text, against direct definitions and the
offline parser (`parse_transcript`) on the same answers."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harken.cloud.inference.commit import (CommitPolicy, ItemText, common_prefix, complete_utf8_length,
                                 compose_context, join_texts, split_header, stability)
from harken.cloud.model.prompt import collapse_repeats, parse_transcript

# A toy vocabulary: each token is a byte string; some split multi-byte characters, one is the
# `<asr_text>` marker, one is special (contributes no bytes, like <|im_end|>).
PIECES = [b"language", b" English", b" None", b"<asr_text>", b"hello", b" world", b" ", b"  ",
          "é".encode()[:1], "é".encode()[1:], "你".encode()[:2], "你".encode()[2:], "好".encode(),
          b"\xff", b"\x80", b"!", b"", b"lang", b"uage", b"\n", "€".encode()]


def token_bytes(t: int) -> bytes:
    return PIECES[t]


tokens = st.lists(st.integers(0, len(PIECES) - 1), max_size=30)


def test_policy_rules():
    p = CommitPolicy(rollback_tokens=2)
    assert p.decide([1, 2, 3, 4, 5], None) == 0  # nothing to agree with yet
    assert p.decide([1, 2, 3, 4, 5], [1, 2, 3, 4, 5]) == 3  # all but the last 2
    assert p.decide([1, 2, 3, 4, 5], [1, 2, 9]) == 2
    assert p.decide([1, 2], [1, 2]) == 0
    r = CommitPolicy(rollback_tokens=2, agreement="rollback-only")
    assert r.decide([1, 2, 3, 4, 5], None) == 3
    assert CommitPolicy(intermediate_commits=False).decide([1] * 9, [1] * 9) == 0


def test_probability_rules():
    sure = CommitPolicy(agreement="confidence", confidence_prob=0.9, rollback_tokens=1)
    probs = [0.99, 0.95, 0.5, 0.99, 0.99]
    assert sure.decide([1, 2, 3, 4, 5], None, probs) == 2  # one update suffices, up to the first doubt
    assert sure.decide([1, 2, 3, 4, 5], None, [0.99] * 5) == 4  # never the last rollback_tokens
    assert sure.decide([1, 2, 3], None, None) == 0  # unknown probabilities (vLLM): nothing
    floor = CommitPolicy(min_token_prob=0.9, rollback_tokens=1)  # agreement, and no doubtful token
    assert floor.decide([1, 2, 3, 4, 5], [1, 2, 3, 4, 5], probs) == 2
    assert floor.decide([1, 2, 3, 4, 5], [1, 2, 3, 4, 5], [0.99] * 5) == 4
    assert floor.decide([1, 2, 3, 4, 5], None, [0.99] * 5) == 0  # still needs the agreement
    with pytest.raises(ValueError):
        CommitPolicy(agreement="majority")
    with pytest.raises(ValueError):
        CommitPolicy(agreement="majority")
    assert CommitPolicy().cut_frames(800) == 2400  # 30 s -> the last 8-s boundary, 24 s
    assert CommitPolicy(segment_limit_s=32).cut_frames(800) == 3200
    with pytest.raises(ValueError):
        CommitPolicy(segment_limit_s=5).cut_frames(800)


@settings(max_examples=100, deadline=None)
@given(tokens, tokens, st.integers(0, 6))
def test_local_agreement_commits_only_agreed_tokens(hyp, prev, k):
    n = CommitPolicy(rollback_tokens=k).decide(hyp, prev)
    assert hyp[:n] == prev[:n]
    assert n <= max(len(hyp) - k, 0)
    # the longest such prefix
    assert n == min(common_prefix(hyp, prev), max(len(hyp) - k, 0))


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=40))
def test_complete_utf8_prefix(data):
    n = complete_utf8_length(data)
    head = data[:n].decode("utf-8", errors="replace")
    # whatever follows, the decoded prefix stays a prefix: nothing shown is ever rewritten
    for more in (b"", b"\x80", b"\x80\x80\x80", b"a", "你".encode()):
        assert (data + more).decode("utf-8", errors="replace").startswith(head)
    # only an unfinished character at the very end is held back
    assert len(data) - n <= 3
    if n < len(data):
        assert data[n] >= 0xC0


@settings(max_examples=100, deadline=None)
@given(st.lists(tokens, min_size=1, max_size=6), st.sampled_from([None, "English"]))
def test_item_text_is_monotone_and_ends_as_the_offline_parse(chunks, forced):
    """Committing in any chunks: committed text only grows, and at the final pass it is what
    `parse_transcript` reads from the whole answer (no repetition runs here to collapse)."""
    text = ItemText(token_bytes, forced)
    all_tokens, shown = [], ""
    for i, chunk in enumerate(chunks):
        final = i == len(chunks) - 1
        view = text.update(chunk, [] if final else [4, 5], final)
        all_tokens += chunk
        assert view.committed == shown + view.committed_delta
        shown = view.committed
    raw = b"".join(token_bytes(t) for t in all_tokens).decode("utf-8", errors="replace")
    offline = parse_transcript(raw, forced)
    s = raw.lstrip()
    if collapse_repeats(s.strip()) != s.strip():
        return  # the one documented difference: streamed text is never collapsed
    header_like = s.startswith("language") or "language".startswith(s)
    if forced or header_like or "<asr_text>" not in s:
        assert shown == offline.text
        assert (text.language or "") == offline.language or (forced and not s.strip())
    else:
        # no header at the start: the whole answer is text (a stray marker is kept, not split on)
        assert shown == s.strip()


def test_item_text_holds_back_split_characters_and_header():
    text = ItemText(token_bytes, None)
    v = text.update([0, 1], [], False)  # "language English"
    assert v.committed == "" and v.language is None
    v = text.update([3, 10], [11], False)  # "<asr_text>" + first half of 你
    assert v.committed == "" and v.language == "English" and v.partial == "你"
    v = text.update([11, 6], [], False)  # rest of 你, then a space (held back)
    assert v.committed_delta == "你" and v.committed == "你"
    v = text.update([4], [], True)
    assert v.committed_delta == " hello" and v.committed == "你 hello"


def test_silence_header():
    text = ItemText(token_bytes, None)
    v = text.update([0, 2, 3], [], True)
    assert v.committed == "" and v.language == ""
    assert parse_transcript("language None<asr_text>").text == ""
    assert split_header("language None<asr_text>", None, False) == ("", "")


def test_intermediate_commits_wait_for_a_spoken_header():
    """Never a commit that ends inside the header or on a silence header: the model would be forced
    to go on from it (`language` then not a language; `language None` then the speech)."""
    text = ItemText(token_bytes, None)
    assert text.committable([0, 1, 3, 4], 1) == 0  # "language"
    assert text.committable([0, 1, 3, 4], 2) == 0  # "language English"
    assert text.committable([0, 1, 3, 4], 3) == 3  # "language English<asr_text>": a spoken header
    assert text.committable([0, 2, 3, 4], 3) == 0  # "language None<asr_text>": silence so far
    assert text.committable([0, 2, 3, 4], 4) == 0
    assert text.committable([17, 18, 1], 1) == 0  # "lang" may still become "language"
    assert text.committable([4, 5, 6], 2) == 2  # no header at all: text
    text.update([0, 1, 3], [], False)  # once the header is committed, the rule's count stands
    assert text.committable([2, 3], 1) == 1
    assert ItemText(token_bytes, "English").committable([0, 2], 1) == 1  # a forced language: all text


@given(tokens, tokens, st.integers(0, 30))
@settings(max_examples=300, deadline=None)
def test_committable_is_all_or_nothing_and_never_ends_in_a_header(done, hyp, n):
    text = ItemText(token_bytes, None)
    text.update(done, [], False)
    n = min(n, len(hyp))
    got = text.committable(hyp, n)
    assert got in (0, n)
    if got and text.language is None:
        raw = b"".join(token_bytes(t) for t in done + hyp[:n]).decode("utf-8", errors="replace")
        language, _ = split_header(raw, None, False)
        assert language or (language == "" and "<asr_text>" not in raw)


def test_helpers():
    assert join_texts("a", "b") == " " and join_texts("你", "好") == "" and join_texts("", "x") == ""
    assert compose_context("hot words", "before") == "hot words\nbefore"
    assert compose_context("", "before") == "before" and compose_context("u", "") == "u"
    assert stability([], None) == 1.0 and stability([1, 2], [1, 3]) == 0.5
