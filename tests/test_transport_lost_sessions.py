"""edge/transport: sessions the server drops, replayed into seeded replacements without repeats.

The server closes a session when its stream is idle past the timeout or when the network stays
down past the grace period: the client's resume gets NOT_FOUND, it opens a session seeded with the
last final's seed, replays the unfinished segments (a thin client: the audio since the last final),
and the transcript is the one without the fault, with the committed text that the replacement
sends again dropped by the ReplayFilter so each character is shown once. Keepalives keep a feature
client's stream through a long silence. The ReplayFilter is also checked on its own, against any
split of a segment's text.
"""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from faults import CuttingProxy
from harken.edge.client.replay import ReplayFilter
from harken.edge.client.grpc_client import ClientOptions, TranscriptionClient, audio_pieces
from harken.shared.text import events_text
from streaming import segment_texts
from transport_helpers import LANGUAGE, _finals, collect, serving
from transport_helpers import audio, thin_reference  # module fixtures: pytest finds them here


def test_replayed_committed_text_is_not_shown_twice(asr, audio):
    """With a policy that commits mid-segment, the session is lost right after a commit inside an
    open segment: the replacement session commits that text again, the client drops it, and the
    user's transcript is the uninterrupted one, each character once."""
    from harken.cloud.inference.commit import CommitPolicy

    policy = CommitPolicy(agreement="rollback-only", rollback_tokens=2)
    options = ClientOptions(backoff_initial_s=0.02, backoff_max_s=0.1)

    async def main():
        async with serving(asr, grace_s=0.1, policy=policy) as server:
            clean = await collect(TranscriptionClient(server.address, language=LANGUAGE, options=options),
                                  audio_pieces(audio))
            proxy = await CuttingProxy("127.0.0.1", server.port, max_cuts=0).start()
            try:
                client = TranscriptionClient(proxy.target, language=LANGUAGE, options=options)
                events, cut_in = [], None
                async for e in client.stream(audio_pieces(audio)):
                    events.append(e)
                    if cut_in is None and e.committed_delta and not e.is_final:
                        proxy.outage(down_s=0.6)  # the session expires meanwhile
                        cut_in = e.segment_id
            finally:
                await proxy.close()
            return clean, events, client.stats, cut_in

    clean, events, stats, cut_in = asyncio.run(main())
    print(f"\nmid-segment loss in segment {cut_in}: sessions={stats.sessions_opened} "
          f"replayed committed text dropped={stats.replayed_text_chars} chars")
    assert cut_in is not None and stats.sessions_opened == 2
    assert stats.replayed_text_chars > 0 and stats.replay_mismatches == 0
    assert segment_texts(events) == segment_texts(clean)
    assert _finals(events) == _finals(clean)


def test_a_client_silent_past_the_idle_timeout_loses_nothing(asr, audio, reference):
    """The source stops mid-utterance for longer than the server's idle timeout (0.3 s here): the
    server ends the idle stream (DEADLINE_EXCEEDED) and closes its session, open segment and all;
    the client resumes, gets NOT_FOUND, replays its unfinished segment into a seeded session, and
    the transcript is the one without the pause, each committed character once."""
    pause_at = int(0.6 * len(audio_pieces(audio)))  # inside the second utterance

    async def main():
        async with serving(asr, idle_timeout_s=0.3) as server:
            def reaped() -> float:
                return server.metrics.registry.get_sample_value(
                    "harken_errors_total", {"code": "DEADLINE_EXCEEDED"}) or 0.0

            async def pausing(pieces):
                for i, piece in enumerate(pieces):
                    if i == pause_at:
                        for _ in range(600):  # until the server has reaped the stream (bounded)
                            if reaped():
                                break
                            await asyncio.sleep(0.05)
                    yield piece

            client = TranscriptionClient(server.address, language=LANGUAGE,
                                         options=ClientOptions(backoff_initial_s=0.01, backoff_max_s=0.1))
            events = await collect(client, pausing(audio_pieces(audio)))
            return events, client.stats, reaped()

    events, stats, reaped = asyncio.run(main())
    assert reaped >= 1 and stats.sessions_opened >= 2
    assert stats.frames_resent > 0  # the open segment's frames, replayed into the new session
    assert segment_texts(events) == segment_texts(reference)
    assert _finals(events) == _finals(reference)
    assert events_text(events) == events_text(reference)


@pytest.mark.parametrize("keepalive_s", [0.1, 0.0])
def test_a_feature_client_in_a_long_silence_keeps_its_stream_with_keepalives(asr, audio, reference, keepalive_s):
    """A feature client sends nothing while its edge VAD hears silence. The source pauses between
    the first two utterances for 4x the server's idle timeout (0.4 s here): with keepalives (every
    0.1 s) the stream is not idle — one session, no resume, nothing reaped; without them
    (keepalive_s=0, the control) the server reaps it and the client goes on in a new session.
    The transcript is the reference's either way."""
    seg0 = next(e for e in reference if e.is_final and e.segment_id == 0)
    seg1 = min(e.start_s for e in reference if e.segment_id == 1)
    pause_at = int(10 * (seg0.end_s + seg1) / 2)  # 100-ms pieces: in the silence between them

    async def main():
        async with serving(asr, idle_timeout_s=0.4) as server:
            async def pausing(pieces):
                for i, piece in enumerate(pieces):
                    if i == pause_at:
                        await asyncio.sleep(1.6)
                    yield piece

            client = TranscriptionClient(server.address, language=LANGUAGE, options=ClientOptions(
                backoff_initial_s=0.01, backoff_max_s=0.1, keepalive_s=keepalive_s))
            events = await collect(client, pausing(audio_pieces(audio)))
            reaped = server.metrics.registry.get_sample_value("harken_errors_total", {"code": "DEADLINE_EXCEEDED"})
            return events, client.stats, reaped or 0.0

    events, stats, reaped = asyncio.run(main())
    if keepalive_s:
        assert reaped == 0 and stats.keepalives_sent >= 1
        assert stats.sessions_opened == 1 and stats.resumes == 0 and stats.failed_attempts == 0, stats
    else:
        assert reaped >= 1 and stats.keepalives_sent == 0 and stats.sessions_opened + stats.resumes >= 2, stats
    assert segment_texts(events) == segment_texts(reference)
    assert _finals(events) == _finals(reference)


def test_replay_filter_passes_only_what_extends_the_users_text():
    """A replacement session re-sends a segment's committed text from its start: the user sees
    each committed character once, and partial text only beyond what is committed."""
    f = ReplayFilter()
    # the first session: "hello wor" committed, "ld" guessed, then the server is lost
    assert f.filter(3, "hello", " wor", False) == ("hello", " wor")
    assert f.filter(3, " wor", "ld", False) == (" wor", "ld")
    f.new_session()
    assert f.filter(3, "", "he", False) is None  # behind the user's text: nothing new to show
    assert f.filter(3, "hel", "lo w", False) is None
    assert f.filter(3, "lo w", "orld", False) is None  # the user sees this guess already
    assert f.filter(3, "", "orld!", False) == ("", "ld!")  # a new guess past the user's text
    assert f.filter(3, "orld", "", True) == ("ld", "")
    assert f.delivered[3] == "hello world" and f.dropped_chars == len("hello wor") and f.mismatches == 0
    # a segment the lost session never reached passes unchanged
    assert f.filter(4, "", "x", False) == ("", "x")
    assert f.filter(4, "xy", "", True) == ("xy", "")
    # a replay that disagrees cannot take committed text back
    f = ReplayFilter()
    f.filter(0, "abc", "", False)
    f.new_session()
    assert f.filter(0, "abd", "e", False) == ("", "e")
    assert f.delivered[0] == "abc" and f.mismatches == 1


def test_replay_filter_is_transparent_without_faults(reference):
    f = ReplayFilter()
    shown = [f.filter(e.segment_id, e.committed_delta, e.partial, e.is_final) for e in reference]
    assert shown == [(e.committed_delta, e.partial) for e in reference]


@pytest.mark.parametrize("thin", [False, True], ids=["features", "thin-client"])
def test_session_expired_during_an_outage_is_replayed(asr, audio, thin, reference, thin_reference):
    """The network goes down for longer than the server's grace period, twice, each time just
    after a final: the server drops the session, the client's resume gets NOT_FOUND, and the
    seeded replacement session fed the unfinished segments (thin client: the audio since the last
    final) gives the same transcript."""
    options = ClientOptions(send_audio=thin, backoff_initial_s=0.02, backoff_max_s=0.1)
    clean = thin_reference if thin else reference

    async def main():
        async with serving(asr, grace_s=0.1) as server:
            proxy = await CuttingProxy("127.0.0.1", server.port, max_cuts=0).start()
            try:
                client = TranscriptionClient(proxy.target, language=LANGUAGE, options=options)
                events, outages = [], 0
                async for e in client.stream(audio_pieces(audio)):
                    events.append(e)
                    if e.is_final and outages < 2:
                        proxy.outage(down_s=0.6)  # > grace_s + the server's reaper period
                        outages += 1
            finally:
                await proxy.close()
            return events, client.stats, outages

    events, stats, outages = asyncio.run(main())
    print(f"\n{'thin' if thin else 'features'} outages={outages} sessions={stats.sessions_opened} "
          f"messages sent={stats.messages_sent} resent={stats.messages_resent} "
          f"frames resent={stats.frames_resent} replayed text dropped={stats.replayed_text_chars}")
    assert outages == 2 and stats.sessions_opened == 3
    assert stats.messages_resent > 0
    assert segment_texts(events) == segment_texts(clean)
    assert _finals(events) == _finals(clean)
    assert stats.replay_mismatches == 0


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet="ab cd", min_size=0, max_size=30), data=st.data())
def test_replay_filter_any_split_shows_each_committed_character_once(text, data):
    """However a segment's committed text is cut into deltas, whichever prefix the lost session
    delivered, and whatever partials come with them: the user's deltas concatenate to the text,
    and what the user sees (committed + partial) never repeats committed text."""

    def cuts(s: str) -> list[str]:
        points = sorted(data.draw(st.lists(st.integers(0, len(s)), max_size=5)))
        bounds = [0, *points, len(s)]
        return [s[a:b] for a, b in zip(bounds, bounds[1:])]

    delivered_upto = data.draw(st.integers(0, len(text)))
    f = ReplayFilter()
    user = ""
    for delta in cuts(text[:delivered_upto]):  # the lost session
        shown = f.filter(0, delta, data.draw(st.text(alphabet="xy", max_size=3)), False)
        assert shown is not None
        user += shown[0]
    f.new_session()
    server = ""
    pieces = cuts(text)
    for i, delta in enumerate(pieces):  # the replacement session, from the segment's start
        server += delta
        final = i == len(pieces) - 1
        partial = "" if final else text[len(server):len(server) + data.draw(st.integers(0, 3))]
        shown = f.filter(0, delta, partial, final)
        if shown is not None:
            user += shown[0]
            # the partial shown is the replacement's guess beyond what the user has, never a repeat
            assert shown[1] == ("" if final else (server + partial)[len(user):])
    assert user == text and f.mismatches == 0
