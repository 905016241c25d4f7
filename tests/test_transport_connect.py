"""edge/transport: a stream on a sound connection, TLS and API keys, and what fails at once.

The SDK client's transcript through the server equals the in-process engine's, and leaving the
stream early stops every client task. TLS with a root certificate and a bearer key gets the
reference transcript, also through `harken stream --server` (JSON and text output as the embedded
command's). What fails fast rather than retrying: an unreachable server (and a full send buffer),
a wrong key, a TLS mismatch (wrong CA, TLS against plaintext and back), for the SDK with one
exception on the first attempt and for the CLI with one line on stderr; a server that only drops
connections is a network fault and is still retried.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import pytest

from harken.edge.client.grpc_client import (BufferOverflowError, ClientOptions, ServerRejectedError, ServerUnavailableError,
                                   TranscriptionClient, TransportSecurityError, audio_pieces)
from harken.shared.text import events_text
from signals import silence, write_wav
from tls_files import self_signed
from transport_helpers import LANGUAGE, REPO, _free_port, applied, collect, serving
from transport_helpers import audio  # module fixtures: pytest finds them here


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

    from harken.commands.terminal import LiveView as EmbeddedView

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
    keys = ["segment_id", "committed_delta", "partial", "stability", "start_s", "end_s", "language", "is_final",
            "from_finalize"]
    events = [line for line in lines[:-1] if "type" not in line]
    assert all(list(line) == keys for line in events)
    assert [line["committed_delta"] for line in events] == [e.committed_delta for e in reference]
    # the server's turn events, as the embedded path prints them: each segment's onset and end
    turns = [(line["type"], line["segment_id"]) for line in lines[:-1] if "type" in line]
    finals = sorted({e.segment_id for e in reference if e.is_final})
    assert turns == [(kind, s) for s in finals for kind in ("speech_started", "utterance_end")]


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
