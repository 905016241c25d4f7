"""edge/transport: dropped connections, resumed into the same session.

Faults are real, only simulated: a TCP proxy (tests/faults.py) resets connections at random byte
offsets, takes the network down briefly, or silently drops everything. The client reconnects and
resumes the same session: the transcript is the one without faults, every frame (or thin client's
sample) applied exactly once though many were sent twice; a silent connection is given up after
`silence_timeout_s`; a connection lost after End still gets every final; a server that stays away
ends the stream with a clear ServerUnavailableError after `max_offline_s`, not a hang.
"""

from __future__ import annotations

import asyncio

import pytest

from faults import CuttingProxy
from harken.edge.client.grpc_client import ClientOptions, ServerUnavailableError, TranscriptionClient, audio_pieces
from harken.shared.text import events_text
from streaming import segment_texts
from transport_helpers import LANGUAGE, THIN, _finals, _frames_applied, applied, collect, live, serving
from transport_helpers import audio, thin_reference  # module fixtures: pytest finds them here


def test_cut_connections_lose_nothing(asr, audio, reference):
    """At least 10 resets at random byte offsets in one stream: the same transcript, every message
    applied exactly once though many were sent twice."""

    async def main():
        async with serving(asr) as server:
            proxy = await CuttingProxy("127.0.0.1", server.port, min_bytes=600, max_bytes=2_500,
                                       max_cuts=14, seed=7).start()
            try:
                client = TranscriptionClient(proxy.target, language=LANGUAGE,
                                             options=ClientOptions(backoff_initial_s=0.01, backoff_max_s=0.1))
                events = await collect(client, audio_pieces(audio))
            finally:
                await proxy.close()
            return events, client.stats, proxy.cuts, applied(server)

    events, stats, cuts, (messages, nbytes) = asyncio.run(main())
    print(f"\ncuts={cuts} resumes={stats.resumes} sessions={stats.sessions_opened} "
          f"messages sent={stats.messages_sent} resent={stats.messages_resent} "
          f"frames produced={stats.frames_produced} sent={stats.frames_sent} resent={stats.frames_resent} "
          f"server applied messages={messages:.0f} frames={_frames_applied(events)} "
          f"duplicate events dropped={stats.duplicate_events}")
    assert cuts >= 10
    assert stats.resumes >= 1 and stats.frames_resent > 0
    assert segment_texts(events) == segment_texts(reference)
    assert _finals(events) == _finals(reference)
    # committed text came exactly once: the events' deltas concatenate to the reference text
    assert events_text(events) == events_text(reference)
    # a cut is a dropped connection, not an End: the same session resumes every time. (grpc.aio ends
    # a servicer's request iterator normally when the TCP connection is reset; a server that reads
    # that as End finalises and drops the session, and the client has to replay into new ones)
    assert stats.sessions_opened == 1, "the server dropped the session on a cut connection"
    produced = stats.messages_sent - stats.messages_resent
    assert messages == produced  # every message applied once: none lost, none twice
    assert stats.frames_sent - stats.frames_resent == stats.frames_produced
    assert _frames_applied(events) == stats.frames_produced  # no frame lost


def test_thin_client_resumes_through_cuts(asr, audio, thin_reference):
    """Audio messages (the server runs VAD + features): cuts -> the transcript of an uncut run."""
    thin, clean = THIN, thin_reference

    async def main():
        async with serving(asr) as server:
            before = applied(server, "audio")
            proxy = await CuttingProxy("127.0.0.1", server.port, min_bytes=20_000, max_bytes=60_000,
                                       max_cuts=5, seed=3).start()
            try:
                client = TranscriptionClient(proxy.target, language=LANGUAGE, options=thin)
                cut = await collect(client, audio_pieces(audio))
            finally:
                await proxy.close()
            after = applied(server, "audio")
            return cut, client.stats, proxy.cuts, after[1] - before[1]

    cut, stats, cuts, audio_bytes = asyncio.run(main())
    assert cuts >= 3 and stats.messages_resent > 0
    assert segment_texts(cut) == segment_texts(clean) and _finals(cut) == _finals(clean)
    assert events_text(clean).strip()
    assert audio_bytes == 2 * audio.size  # every sample applied exactly once


def test_silent_connection_is_abandoned_and_resumed(asr, audio, reference):
    """The network starts dropping everything without a reset while the server owes transcripts:
    after `silence_timeout_s` the client gives the connection up, resumes the same session on a
    new one, and the transcript is the uninterrupted one (no hang)."""

    async def main():
        async with serving(asr) as server:
            proxy = await CuttingProxy("127.0.0.1", server.port, max_cuts=0).start()
            try:
                # long enough for a final pass of the tiny model on a busy CPU, which sends nothing
                client = TranscriptionClient(proxy.target, language=LANGUAGE, options=ClientOptions(
                    silence_timeout_s=2.0, backoff_initial_s=0.02, backoff_max_s=0.1))
                events = []
                async for e in client.stream(live(audio_pieces(audio))):
                    events.append(e)
                    if len(events) == 1:
                        proxy.stall()
            finally:
                await proxy.close()
            return events, client.stats

    events, stats = asyncio.run(main())
    assert stats.resumes == 1 and stats.sessions_opened == 1
    assert "nothing from the server" in stats.last_failure
    assert events == reference


def test_connection_lost_after_end_still_gets_every_final(asr, audio, reference):
    """The whole source is sent, End included, and the connection drops before the last finals:
    the client resumes (re-sending End, which the server may already hold) and gets them all."""

    async def main():
        async with serving(asr) as server:
            proxy = await CuttingProxy("127.0.0.1", server.port, max_cuts=0).start()
            try:
                client = TranscriptionClient(proxy.target, language=LANGUAGE, options=ClientOptions(
                    backoff_initial_s=0.02, backoff_max_s=0.1))
                events = []
                async for e in client.stream(audio_pieces(audio)):  # all of it at once: End goes early
                    events.append(e)
                    if e.is_final and e.segment_id == 0:
                        proxy.outage(down_s=0.05)
            finally:
                await proxy.close()
            return events, client.stats

    events, stats = asyncio.run(main())
    assert stats.failed_attempts >= 1
    assert segment_texts(events) == segment_texts(reference)
    assert _finals(events) == _finals(reference)


def test_server_away_too_long_is_a_clear_error(asr, audio):
    """The server goes away mid-stream and does not come back: ServerUnavailableError after
    max_offline_s, naming what was not transcribed; no hang."""

    async def main():
        async with serving(asr) as server:
            proxy = await CuttingProxy("127.0.0.1", server.port, max_cuts=0).start()
            client = TranscriptionClient(proxy.target, language=LANGUAGE,
                                         options=ClientOptions(max_offline_s=0.5, backoff_max_s=0.1))
            seen = []
            with pytest.raises(ServerUnavailableError) as err:
                async for e in client.stream(audio_pieces(audio)):
                    seen.append(e)
                    if not proxy.closed:
                        await proxy.close()  # the network to the server is gone for good
            return err.value, client.stats

    err, stats = asyncio.run(main())
    assert "unreachable" in str(err) and "not transcribed" in str(err)
    assert stats.failed_attempts >= 2
