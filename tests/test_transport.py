"""edge/transport: the SDK client against the real server (cloud/server.py) on loopback gRPC.

The model is the tiny random checkpoint with the language forced, so it writes text (random, but
a deterministic function of the features). Faults are real, only they are simulated: a TCP proxy
(tests/faults.py) resets connections at random byte offsets, takes the network down for longer
than the server's grace period, or silently drops everything; a `harken serve` process is killed
with SIGKILL and started again; an in-process server is stopped gracefully mid-segment and
started again; a server disappears for good. What is checked: the transcript through the server
equals the in-process engine's; after cuts, lost sessions and restarts it is identical to the
run without faults, every frame is applied (once, where the session survives), and committed
text is shown once; a server that stays away ends the stream with a clear error, not a hang.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
from contextlib import asynccontextmanager
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from faults import CuttingProxy
from harken.cloud.server import ServerOptions, start_server
from harken.edge.replay import ReplayFilter
from harken.edge.audio import peak_normalize
from harken.edge.transport import (BufferOverflowError, ClientOptions, ServerRejectedError,
                                   ServerUnavailableError, TranscriptEvent, TranscriptionClient,
                                   TransportSecurityError, audio_pieces)
from harken.shared.text import events_text
from signals import concat, noisy, silence, speech, write_wav
from streaming import segment_texts
from tls_files import self_signed

LANGUAGE = "English"  # forced: the random tiny model then writes text instead of a bare header
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def audio() -> np.ndarray:
    """Three utterances with pauses: three VAD segments, ~8 s."""
    # peak-normalised as the CLI and the embedded engine treat files, so all paths see one signal
    return peak_normalize(concat(silence(0.3), speech("Hello there, this is a test of the system."),
                                 silence(0.8), speech("A second sentence follows now."), silence(0.8),
                                 speech("And the third one ends it."), silence(0.5)))


def _finals(events) -> list[tuple[int, float, float, bool]]:
    return [(e.segment_id, e.start_s, e.end_s, e.is_final) for e in events if e.is_final]


def _frames_applied(events) -> int:
    """Feature frames the server applied, as its final events report them: each covers its
    segment from its first frame to its end."""
    return sum(round((e.end_s - e.start_s) * 100) for e in events if e.is_final)


@asynccontextmanager
async def serving(asr, **kw):
    server = await start_server(asr, ServerOptions(host="127.0.0.1", port=0, **kw))
    try:
        yield server
    finally:
        await server.stop(0)


async def collect(client: TranscriptionClient, source) -> list[TranscriptEvent]:
    return [e async for e in client.stream(source)]


def applied(server, kind: str = "features") -> tuple[float, float]:
    """(messages, payload bytes) the server applied, from its own metrics."""
    r = server.metrics.registry
    return (r.get_sample_value("harken_messages_in_total", {"kind": kind}) or 0.0,
            r.get_sample_value("harken_bytes_in_total", {"kind": kind}) or 0.0)


def test_end_to_end_equals_the_embedded_engine(asr, audio, reference):
    async def main():
        async with serving(asr) as server:
            client = TranscriptionClient(server.address, language=LANGUAGE)
            events = await collect(client, audio_pieces(audio))
            return events, client.stats, applied(server)

    events, stats, (messages, nbytes) = asyncio.run(main())
    assert events_text(reference).strip(), "the forced-language tiny model writes text"
    assert events == reference
    assert stats.sessions_opened == 1 and stats.resumes == 0 and stats.messages_resent == 0
    assert messages == stats.messages_sent


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


THIN = ClientOptions(send_audio=True, backoff_initial_s=0.01, backoff_max_s=0.1)


@pytest.fixture(scope="module")
def thin_reference(asr, audio) -> list[TranscriptEvent]:
    """A thin client's events for `audio` through the server, without faults."""

    async def main():
        async with serving(asr) as server:
            return await collect(TranscriptionClient(server.address, language=LANGUAGE, options=THIN),
                                 audio_pieces(audio))

    return asyncio.run(main())


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


def test_replayed_committed_text_is_not_shown_twice(asr, audio):
    """With a policy that commits mid-segment, the session is lost right after a commit inside an
    open segment: the replacement session commits that text again, the client drops it, and the
    user's transcript is the uninterrupted one, each character once."""
    from harken.cloud.commit import CommitPolicy

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


async def live(pieces):
    """Pieces at about 3x real time, like a live source that is a bit ahead: faults then fall
    mid-stream, before the source ends."""
    for piece in pieces:
        await asyncio.sleep(0.03)
        yield piece


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _spawn_server(port: int) -> asyncio.subprocess.Process:
    """`harken serve --model tiny --port P` as a real process; returns once it listens."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "harken", "serve", "--model", "tiny", "--host", "127.0.0.1", "--port", str(port),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL, cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"})  # as the in-process tests' torch.set_num_threads(1)
    line = await asyncio.wait_for(proc.stdout.readline(), 120)
    assert b"listening" in line, line
    return proc


def test_server_killed_and_restarted_mid_stream(audio, reference):
    """SIGKILL the server after the first final; start it again on the same port. The client's
    resume gets NOT_FOUND, it opens a seeded session, replays the unfinished segments, and drops
    the committed text it already had: the transcript is the one without the fault."""

    async def main():
        port = _free_port()
        server = await _spawn_server(port)
        restarted = None
        try:
            client = TranscriptionClient(f"127.0.0.1:{port}", language=LANGUAGE,
                                         options=ClientOptions(backoff_initial_s=0.05, backoff_max_s=0.5))
            events = []
            async for e in client.stream(audio_pieces(audio)):
                events.append(e)
                if e.is_final and restarted is None:
                    server.send_signal(signal.SIGKILL)
                    await server.wait()
                    restarted = await _spawn_server(port)
            return events, client.stats
        finally:
            for p in (server, restarted):
                if p is not None and p.returncode is None:
                    p.send_signal(signal.SIGTERM)
                    await p.wait()

    events, stats = asyncio.run(main())
    print(f"\nserver restart: sessions={stats.sessions_opened} failed attempts={stats.failed_attempts} "
          f"frames resent={stats.frames_resent} of {stats.frames_produced} "
          f"replayed text dropped={stats.replayed_text_chars} chars mismatches={stats.replay_mismatches}")
    assert stats.sessions_opened == 2 and stats.frames_resent > 0
    assert _frames_applied(events) == stats.frames_produced  # no frame lost
    assert segment_texts(events) == segment_texts(reference)
    assert _finals(events) == _finals(reference)
    assert stats.replay_mismatches == 0


@pytest.fixture(scope="module")
def noisy_audio() -> np.ndarray:
    """Three utterances in noise (20 dB SNR): silero-vad's state at a pause remembers the noise,
    so a VAD started afresh there ends the third segment elsewhere (0.09 s later)."""
    return peak_normalize(noisy(concat(silence(0.3), speech("Hello there, this is a test of the system."),
                                       silence(0.5), speech("A second sentence follows now."), silence(0.45),
                                       speech("And the third one ends it."), silence(0.5)), snr_db=20))


def test_thin_client_server_killed_and_restarted_mid_stream(asr, noisy_audio):
    """A thin client's server is SIGKILLed after the first final and started again on the same
    port: the client's resume gets NOT_FOUND, it opens a session seeded with the last final's seed,
    whose front-end state resumes the lost server's VAD and log-mel at a quiet point, and replays
    its audio from that point. Segments (ids, start and end times), committed text and finals are
    those of an uninterrupted run. Before, the replay went into a fresh front end from the last
    final's end, and the third segment ended 0.09 s late."""

    async def main():
        async with serving(asr) as server:
            clean = await collect(TranscriptionClient(server.address, language=LANGUAGE, options=THIN),
                                  audio_pieces(noisy_audio))
        port = _free_port()
        server = await _spawn_server(port)
        restarted = None
        try:
            client = TranscriptionClient(f"127.0.0.1:{port}", language=LANGUAGE,
                                         options=ClientOptions(send_audio=True, backoff_initial_s=0.05,
                                                               backoff_max_s=0.5))
            events = []
            async for e in client.stream(audio_pieces(noisy_audio)):
                events.append(e)
                if e.is_final and restarted is None:
                    server.send_signal(signal.SIGKILL)
                    await server.wait()
                    restarted = await _spawn_server(port)
            return clean, events, client.stats
        finally:
            for p in (server, restarted):
                if p is not None and p.returncode is None:
                    p.send_signal(signal.SIGTERM)
                    await p.wait()

    clean, events, stats = asyncio.run(main())
    print(f"\nthin server restart: sessions={stats.sessions_opened} messages resent={stats.messages_resent} "
          f"replayed text dropped={stats.replayed_text_chars} chars finals={_finals(events)}")
    assert len(_finals(clean)) == 3 and events_text(clean).strip()
    assert stats.sessions_opened == 2 and stats.messages_resent > 0
    assert _finals(events) == _finals(clean)
    assert segment_texts(events) == segment_texts(clean)
    assert stats.replay_mismatches == 0


def test_graceful_server_restart_mid_segment_loses_nothing(asr, audio, reference):
    """The server is stopped gracefully (as for a deploy) while a segment is open, and started
    again on the same port. A graceful stop finalises open segments early; the client continues
    the rest of that segment as a new one in a replacement session. Every frame is applied once
    in all; the segments before the stop are the uninterrupted ones."""
    options = ClientOptions(backoff_initial_s=0.05, backoff_max_s=0.2)

    async def main():
        server = await start_server(asr, ServerOptions(host="127.0.0.1", port=0))
        port, restarted = server.port, None
        try:
            client = TranscriptionClient(server.address, language=LANGUAGE, options=options)
            events = []
            async for e in client.stream(live(audio_pieces(audio))):
                events.append(e)
                if restarted is None and e.segment_id == 1 and not e.is_final:
                    await server.stop()
                    restarted = await start_server(asr, ServerOptions(host="127.0.0.1", port=port))
            return events, client.stats
        finally:
            await server.stop(0)
            if restarted is not None:
                await restarted.stop(0)

    events, stats = asyncio.run(main())
    finals = _finals(events)
    print(f"\ngraceful restart: sessions={stats.sessions_opened} finals={[(f[0], f[1], f[2]) for f in finals]} "
          f"frames resent={stats.frames_resent}")
    assert stats.sessions_opened == 2
    assert _frames_applied(events) == stats.frames_produced  # nothing lost, nothing twice
    assert [f[0] for f in finals] == list(range(len(finals)))
    assert finals[0] == _finals(reference)[0] and segment_texts(events)[0] == segment_texts(reference)[0]
    # the segment open at the stop (which one depends on timing: the source runs at 3x real time)
    # was ended early and continued seamlessly as the next one; joined again, the segments are the
    # uninterrupted ones
    spans = [(f[1], f[2]) for f in finals]
    joined = [spans[0]]
    for start, end in spans[1:]:
        if start == joined[-1][1]:
            joined[-1] = (joined[-1][0], end)
        else:
            joined.append((start, end))
    assert joined == [(f[1], f[2]) for f in _finals(reference)]
    assert len(spans) - len(joined) <= 1


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


def test_unreachable_server_and_full_buffer_fail_fast(audio):
    dead = f"127.0.0.1:{_free_port()}"
    with pytest.raises(ServerUnavailableError):
        asyncio.run(collect(TranscriptionClient(dead, options=ClientOptions(max_offline_s=0.3)),
                            audio_pieces(audio)))
    with pytest.raises(BufferOverflowError, match="buffered"):
        asyncio.run(collect(TranscriptionClient(dead, options=ClientOptions(max_buffer_bytes=4_000)),
                            audio_pieces(audio)))


@pytest.fixture
def tls_server_files(tmp_path) -> tuple[str, str, str]:
    """(cert, key, keys file with "right-key alice") for a TLS server with API keys."""
    cert, key = self_signed(tmp_path)
    keys = tmp_path / "keys"
    keys.write_text("right-key alice\n")
    return cert, key, str(keys)


def test_tls_and_api_keys(asr, audio, reference, tls_server_files):
    """TLS with a root certificate file and a bearer key: the reference transcript. A wrong key
    is refused at once (no retries); plaintext to a TLS server fails at once (see below)."""
    cert, key, keys = tls_server_files

    async def main():
        async with serving(asr, tls_cert=cert, tls_key=key, api_keys=keys) as server:
            target = f"localhost:{server.port}"
            good = TranscriptionClient(target, api_key="right-key", tls=cert, language=LANGUAGE)
            events = await collect(good, audio_pieces(audio))
            wrong = TranscriptionClient(target, api_key="wrong-key", tls=cert, language=LANGUAGE)
            with pytest.raises(ServerRejectedError) as refused:
                await collect(wrong, audio_pieces(audio))
            plain = TranscriptionClient(target, api_key="right-key", language=LANGUAGE,
                                        options=ClientOptions(max_offline_s=0.3))
            with pytest.raises(TransportSecurityError):
                await collect(plain, audio_pieces(audio))
            return events, refused.value, wrong.stats

    events, refused, wrong_stats = asyncio.run(main())
    assert events == reference
    assert refused.code == "UNAUTHENTICATED" and wrong_stats.sessions_opened == 0, wrong_stats.last_failure


def test_cli_stream_through_a_server(asr, audio, reference, tls_server_files, tmp_path):
    """`harken stream IN.wav --server HOST:PORT --tls-ca FILE [--json]`, key from $HARKEN_API_KEY:
    the embedded path's output, as JSON and as text."""
    import io

    from harken.edge.commands import LiveView as EmbeddedView

    cert, key, keys = tls_server_files
    wav = write_wav(tmp_path / "in.wav", audio, subtype="FLOAT")

    async def main():
        async with serving(asr, tls_cert=cert, tls_key=key, api_keys=keys) as server:
            outputs = []
            for extra in (["--json"], []):
                proc = await asyncio.create_subprocess_exec(
                    sys.executable, "-m", "harken", "stream", str(wav), "--server", f"localhost:{server.port}",
                    "--tls-ca", cert, "--language", LANGUAGE, *extra,
                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                    cwd=REPO, env={**os.environ, "HARKEN_API_KEY": "right-key"})
                out, err = await proc.communicate()
                outputs.append((proc.returncode, out.decode(), err.decode()))
            return outputs

    (rc, out, err), (text_rc, text_out, text_err) = asyncio.run(main())
    assert rc == 0 and text_rc == 0, err + text_err
    embedded = io.StringIO()  # the embedded command's rendering of the same events (not a TTY)
    view = EmbeddedView(embedded)
    for e in reference:
        view.show(e)
    assert text_out == embedded.getvalue()
    lines = [json.loads(line) for line in out.splitlines()]
    assert lines[-1] == {"final": True, "text": events_text(reference)}
    keys = ["segment_id", "committed_delta", "partial", "stability", "start_s", "end_s", "language", "is_final"]
    assert all(list(line) == keys for line in lines[:-1])
    assert [line["committed_delta"] for line in lines[:-1]] == [e.committed_delta for e in reference]


def test_cli_stream_server_errors_are_one_line(tmp_path):
    """A server that is not there, or no input: one line on stderr and a non-zero exit."""
    wav = write_wav(tmp_path / "in.wav", silence(0.5))
    dead = f"127.0.0.1:{_free_port()}"
    for args in ([str(wav), "--server", dead, "--max-offline-s", "0.3"], ["--server", dead]):
        proc = subprocess.run([sys.executable, "-m", "harken", "stream", *args], capture_output=True, text=True,
                              cwd=REPO, timeout=300, env={**os.environ, "HARKEN_API_KEY": ""})
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "harken stream: error:" in proc.stderr


def test_tls_mismatches_fail_at_once_and_dropped_connections_are_still_retried(asr, audio, tmp_path):
    """A wrong CA, a TLS client at a plaintext server and a plaintext client at a TLS server (real
    harken servers, certificates made now) end the stream with `TransportSecurityError` on the first
    attempt, though `max_offline_s` would allow retries; a server that closes every connection at
    once (a network fault, not a mismatch) is still retried, by a plaintext and by a TLS client,
    until `max_offline_s`."""
    cert, key = self_signed(tmp_path)
    (tmp_path / "other").mkdir()
    other_ca, _ = self_signed(tmp_path / "other")
    options = ClientOptions(max_offline_s=5.0)  # before the fix: ServerUnavailableError after 5 s

    async def refused(client: TranscriptionClient) -> tuple[TransportSecurityError, int]:
        with pytest.raises(TransportSecurityError) as e:
            await collect(client, audio_pieces(audio))
        return e.value, client.stats.failed_attempts

    async def closing_server() -> asyncio.Server:
        async def close_at_once(reader, writer):
            writer.close()
        return await asyncio.start_server(close_at_once, "127.0.0.1", 0)

    async def main():
        async with serving(asr, tls_cert=cert, tls_key=key) as tls_server, serving(asr) as plain_server:
            results = {
                "wrong CA": await refused(TranscriptionClient(f"localhost:{tls_server.port}", tls=other_ca,
                                                              language=LANGUAGE, options=options)),
                "TLS client": await refused(TranscriptionClient(f"localhost:{plain_server.port}", tls=cert,
                                                                language=LANGUAGE, options=options)),
                "plaintext client": await refused(TranscriptionClient(f"localhost:{tls_server.port}",
                                                                      language=LANGUAGE, options=options)),
            }
        closer = await closing_server()
        port = closer.sockets[0].getsockname()[1]
        retried = []
        try:
            for tls in (None, cert):
                client = TranscriptionClient(f"localhost:{port}", tls=tls, language=LANGUAGE,
                                             options=ClientOptions(max_offline_s=0.5))
                with pytest.raises(ServerUnavailableError):
                    await collect(client, audio_pieces(audio))
                retried.append(client.stats)
        finally:
            closer.close()
        return results, retried

    results, retried = asyncio.run(main())
    for case, (error, attempts) in results.items():
        assert attempts == 0, (case, error)  # failed on the first attempt, never retried
        assert "\n" not in str(error)
    assert "CERTIFICATE_VERIFY_FAILED" in str(results["wrong CA"][0])
    assert "does not speak TLS" in str(results["TLS client"][0])
    assert "speaks TLS" in str(results["plaintext client"][0]) and "--tls-ca" in str(results["plaintext client"][0])
    for stats in retried:
        assert stats.failed_attempts >= 2 and stats.sessions_opened == 0, stats


def test_cli_stream_tls_mismatch_is_one_line_and_exit_2(asr, audio, tmp_path):
    """`harken stream --server` with a wrong CA, or with --tls-ca at a plaintext server: exit 2 and
    exactly one line on stderr that names the TLS problem (before: ~90 handshake lines over
    --max-offline-s of retries)."""
    cert, key = self_signed(tmp_path)
    (tmp_path / "other").mkdir()
    other_ca, _ = self_signed(tmp_path / "other")
    wav = write_wav(tmp_path / "in.wav", audio, subtype="FLOAT")

    async def run(port: int, ca: str) -> tuple[int, str]:
        env = {k: v for k, v in os.environ.items() if k != "GRPC_VERBOSITY"}
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "harken", "stream", str(wav), "--server", f"localhost:{port}", "--tls-ca", ca,
            "--max-offline-s", "5", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            cwd=REPO, env={**env, "HARKEN_API_KEY": ""})
        _, err = await proc.communicate()
        return proc.returncode, err.decode()

    async def main():
        async with serving(asr, tls_cert=cert, tls_key=key) as tls_server, serving(asr) as plain_server:
            return await run(tls_server.port, other_ca), await run(plain_server.port, cert)

    for rc, err in asyncio.run(main()):
        assert rc == 2 and err.count("\n") == 1, err
        assert err.startswith("harken stream: error: TLS handshake with localhost:"), err


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


def test_leaving_the_stream_early_stops_every_task(asr, audio):
    """A consumer that stops after the first event: closing the stream cancels and awaits all
    the client's tasks (producer, connection, sender, receiver, watchdog)."""
    from contextlib import aclosing

    async def main():
        async with serving(asr) as server:
            client = TranscriptionClient(server.address, language=LANGUAGE)
            async with aclosing(client.stream(audio_pieces(audio))) as events:
                async for _ in events:
                    break
            return [t.get_name() for t in asyncio.all_tasks() if t.get_name().startswith("harken-client-")]

    assert asyncio.run(main()) == []
