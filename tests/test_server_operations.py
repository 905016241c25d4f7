"""cloud/server: running it: metrics, health, reflection, logs, shutdown and engine failures.

The Prometheus metrics count what the server did (and show no keys), health and reflection answer,
the queue-depth gauge is the work waiting now; logs are JSON without keys or transcript text.
A graceful shutdown finalises open segments and sends their finals (a thin segment cut short gets a
seed without front-end state); `harken serve` prints its addresses and stops on SIGTERM. An engine
failure ends every stream UNAVAILABLE and health says NOT_SERVING; one session failing inside the
engine gets INTERNAL while the others carry on to their correct transcripts.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import subprocess
import sys
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from harken.shared.codec import CODEC_NAME
from harken.cloud.server import ServerOptions, start_server
from server_helpers import (END, KEY_A, OK, ORDER, Outcome, POLICY, TIMEOUT, _scrape, audio_msgs, bearer, features_msgs,
                            run_stream, serving, start_msg, transcript_of)
from server_helpers import audio, reference  # module fixtures: pytest finds them here


def test_metrics_health_and_reflection(asr, packets):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    async def main():
        async with serving(asr, metrics_port=0) as server:
            msgs = [start_msg(codec=CODEC_NAME)] + features_msgs(packets) + [END]
            out = await run_stream(server.address, msgs)
            bad = await run_stream(server.address, [END])
            async with grpc.aio.insecure_channel(server.address) as channel:
                health = await health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service="harken.v1.Transcription"))
                services = []
                async for r in reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
                        iter([reflection_pb2.ServerReflectionRequest(list_services="")])):
                    services += [s.name for s in r.list_services_response.service]
            url = f"http://127.0.0.1:{server.metrics_port}/metrics"
            text = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=10).read().decode())
            return out, bad, health, services, text

    out, bad, health, services, text = asyncio.run(main())
    assert out.code == OK and bad.code == ORDER
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    assert {"harken.v1.Transcription", "grpc.health.v1.Health"} <= set(services)
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    assert samples[("harken_bytes_in_total", (("kind", "features"),))] == sum(len(p.payload) for p in packets)
    assert samples[("harken_messages_in_total", (("kind", "features"),))] == len(packets)
    assert samples[("harken_transcript_events_total", ())] == len(out.transcripts)
    assert samples[("harken_errors_total", (("code", "FAILED_PRECONDITION"),))] == 1
    assert samples[("harken_time_to_first_partial_seconds_count", ())] == 2  # one per segment
    assert samples[("harken_final_latency_seconds_count", ())] == 2
    assert samples[("harken_update_latency_seconds_count", ())] == sum(not t.is_final for t in out.transcripts)
    assert samples[("harken_batch_size_count", ())] >= 1
    assert ("harken_queue_depth", ()) in samples
    assert samples[("harken_sessions_active", ())] == 0 and samples[("harken_streams_attached", ())] == 0
    assert "Bearer" not in text and KEY_A not in text


def test_queue_depth_is_the_work_waiting_now_not_at_the_last_step(asr, packets):
    """With the engine stalled (no step runs), a stream's frames make an update due: the scrape
    shows one session waiting for the model at once (before, the gauge was set only when a step
    began, and said 0 here). Once the engine has run and the stream ended, it is 0 again."""
    head = features_msgs(packets[:5])  # 100 frames of an open segment: an update (50 frames) is due

    async def main():
        async with serving(asr, metrics_port=0) as server:
            await server._scheduler.stop()
            before = (await asyncio.to_thread(_scrape, server.metrics_port))[("harken_queue_depth", ())]
            out = Outcome()
            hold = asyncio.Event()
            task = asyncio.create_task(run_stream(server.address, [start_msg(codec=CODEC_NAME)] + head,
                                                  hold_open=hold, then=[END], out=out))
            while not (out.acks and out.acks[-1].seq == 5):  # applied: the frames are in the engine
                out.progress.clear()
                await out.progress.wait()
            waiting = (await asyncio.to_thread(_scrape, server.metrics_port))[("harken_queue_depth", ())]
            await server._scheduler.start()
            hold.set()
            await asyncio.wait_for(task, TIMEOUT)
            after = (await asyncio.to_thread(_scrape, server.metrics_port))[("harken_queue_depth", ())]
            return before, waiting, after, out

    before, waiting, after, out = asyncio.run(main())
    assert out.code == OK, out.details
    assert (before, waiting, after) == (0, 1, 0)


def test_shutdown_finalises_open_segments_and_sends_their_finals(asr, packets):
    seg1 = [i for i, p in enumerate(packets) if p.segment_id == 1]
    cut = seg1[len(seg1) // 2] // 5 * 5

    async def main():
        server = await start_server(asr, ServerOptions(port=0, policy=POLICY))
        try:
            out, more = Outcome(), asyncio.Event()
            task = asyncio.create_task(run_stream(server.address, [start_msg(codec=CODEC_NAME)]
                                                  + features_msgs(packets[:cut]), hold_open=more,
                                                  then=features_msgs(packets[cut:], first_seq=cut + 1), out=out))
            while not (out.acks and out.acks[-1].seq == cut):
                out.progress.clear()
                await out.progress.wait()
            stopping = asyncio.create_task(server.stop())
            more.set()  # a live client goes on sending while the server stops
            await stopping
            refused = await run_stream(server.address, [start_msg()])
            return await task, refused
        finally:
            await server.stop()

    out, refused = asyncio.run(main())
    assert (out.code, out.details) == (grpc.StatusCode.UNAVAILABLE,
                                       "the server is shutting down: open segments were finalised")
    finals = [t for t in out.transcripts if t.is_final]
    assert [t.segment_id for t in finals] == [0, 1]
    assert finals[1].seed.present and finals[1].seed.next_segment_id == 2
    applied = out.acks[-1].seq
    assert applied >= cut and out.acks[-1].last_final_segment == 1
    assert finals[1].end_s == pytest.approx((packets[applied - 1].first_frame + packets[applied - 1].frame_count) / 100)
    assert refused.code == grpc.StatusCode.UNAVAILABLE


def test_a_thin_segment_the_shutdown_cuts_short_gets_a_seed_without_front_end_state(asr, audio):
    """A graceful stop in the middle of a thin client's second utterance ends its segment where the
    audio stops. That final's seed has no front-end state: a replacement resumed from a quiet point
    before the segment would treat all of it as final and lose the speech after the cut; without
    one the client replays from the cut into a fresh front end. The first final's seed has one."""
    msgs = audio_msgs(audio)
    cut = 30  # 3.0 s: inside the second utterance (2.1 s to 4.5 s)

    async def main():
        server = await start_server(asr, ServerOptions(port=0, policy=POLICY))
        try:
            out = Outcome()
            task = asyncio.create_task(run_stream(server.address, [start_msg()] + msgs[:cut],
                                                  hold_open=asyncio.Event(), out=out))
            while not (out.acks and out.acks[-1].seq == cut):
                out.progress.clear()
                await out.progress.wait()
            await server.stop()
            return await task
        finally:
            await server.stop()

    out = asyncio.run(main())
    assert out.code == grpc.StatusCode.UNAVAILABLE, out.details
    finals = [t for t in out.transcripts if t.is_final]
    assert [t.segment_id for t in finals] == [0, 1] and finals[1].end_s <= cut / 10
    assert finals[0].seed.front_end_state and finals[0].seed.next_segment_id == 1
    assert finals[1].seed.present and finals[1].seed.next_segment_id == 2
    assert finals[1].seed.front_end_state == b"" and finals[1].seed.audio_sample == 0


def test_harken_serve_prints_its_addresses_and_stops_on_sigterm(tmp_path):
    bad = subprocess.run([sys.executable, "-m", "harken", "serve", "--model", "tiny", "--idle-timeout-s", "0"],
                         capture_output=True, text=True, timeout=60)
    assert (bad.returncode, bad.stderr.strip()) == (
        2, "harken serve: error: --idle-timeout-s and --grace-s must be > 0")
    proc = subprocess.Popen([sys.executable, "-m", "harken", "serve", "--model", "tiny", "--port", "0",
                             "--metrics-port", "0", "--idle-timeout-s", "45"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        grpc_line = proc.stdout.readline().strip()
        metrics_line = proc.stdout.readline().strip()
        assert grpc_line.startswith("harken: listening on grpc://127.0.0.1:"), grpc_line
        port = int(grpc_line.rsplit(":", 1)[1])
        assert port > 0
        assert metrics_line.startswith("harken: metrics on http://127.0.0.1:") and metrics_line.endswith("/metrics")
        with urllib.request.urlopen(metrics_line.split(" on ", 1)[1], timeout=10) as r:
            assert b"harken_sessions_active" in r.read()
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10).status
        assert status == health_pb2.HealthCheckResponse.SERVING
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        logs = [json.loads(line) for line in proc.stderr.read().splitlines()]
        assert [r["msg"] for r in logs if r["msg"].startswith("server ")] == ["server started", "server stopped"]
        assert next(r for r in logs if r["msg"] == "server started")["idle_timeout_s"] == 45
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_logs_are_json_without_keys_or_transcript_text(asr, packets, tmp_path):
    from harken.cloud.adapters.logs import JsonLogFormatter

    keys = tmp_path / "keys"
    keys.write_text(f"{KEY_A} alice\n")
    lines: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record):
            lines.append(self.format(record))

    handler = Collect()
    handler.setFormatter(JsonLogFormatter())
    logger = logging.getLogger("harken")
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        async def main():
            async with serving(asr, api_keys=str(keys)) as server:
                msgs = [start_msg(codec=CODEC_NAME)] + features_msgs(packets) + [END]
                good = await run_stream(server.address, msgs, metadata=bearer(KEY_A))
                await run_stream(server.address, msgs, metadata=bearer("wrong-key-123456"))
                return good

        good = asyncio.run(main())
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    records = [json.loads(line) for line in lines]
    assert {"server started", "session opened", "stream attached", "session ended",
            "stream ended with an error", "server stopped"} <= {r["msg"] for r in records}
    assert any(r.get("key") == "alice" for r in records)
    text = "\n".join(lines)
    assert KEY_A not in text and "wrong-key-123456" not in text and good.ready.session_id not in text
    for t in good.transcripts:
        for piece in (t.committed_delta, t.partial):
            assert len(piece) < 4 or piece not in text


def test_an_engine_failure_ends_every_stream_unavailable_and_health_says_so(asr, packets, monkeypatch):
    """The fault (mocked): the model raises. Streams must not wait forever for events."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    def broken(*args, **kwargs):
        raise RuntimeError("simulated device failure")

    monkeypatch.setattr(asr.encoder, "encode_windows", broken)

    async def main():
        async with serving(asr) as server:
            out = await run_stream(server.address, [start_msg(codec=CODEC_NAME)] + features_msgs(packets)
                                   + [END])
            async with grpc.aio.insecure_channel(server.address) as channel:
                health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
            refused = await run_stream(server.address, [start_msg()])
            return out, health, refused

    out, health, refused = asyncio.run(main())
    assert (out.code, out.details) == (grpc.StatusCode.UNAVAILABLE, "the engine failed: reconnect to another server")
    assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING
    assert refused.code == grpc.StatusCode.UNAVAILABLE


def test_a_session_failing_in_the_engine_gets_internal_while_the_others_carry_on(asr, packets, reference,
                                                                                 monkeypatch):
    """The fault (injected): one session's own processing raises inside the engine. Its stream
    ends INTERNAL (never hangs, whether attached then or later), its KV slot is freed, and a
    session beside it on the same server gets its full, correct transcript."""
    from harken.cloud.inference.decoder_stream import DecoderStream

    finish_job = DecoderStream.finish_job

    def fragile(self, job, tokens, *probs):
        if self.state.options.context == "fail here" and self.state.events >= 2:
            raise RuntimeError("simulated fault in one session's processing")
        return finish_job(self, job, tokens, *probs)

    monkeypatch.setattr(DecoderStream, "finish_job", fragile)

    async def main():
        async with serving(asr) as server:
            msgs = features_msgs(packets) + [END]
            bad, good = await asyncio.gather(
                run_stream(server.address, [start_msg(codec=CODEC_NAME, context="fail here")] + msgs),
                run_stream(server.address, [start_msg(codec=CODEC_NAME)] + msgs))
            engine = server.engine
            # a client that resumes the failed session is told the same, at once
            again = await run_stream(server.address, [start_msg(session_id=bad.ready.session_id,
                                                                last_event_seq=0)])
            return bad, good, again, len(engine.sessions), engine.cache.num_free(), engine.cache.max_slots

    bad, good, again, engine_sessions, free, slots = asyncio.run(main())
    assert (bad.code, bad.details) == (grpc.StatusCode.INTERNAL, "internal error")
    assert len(bad.transcripts) >= 2  # it ran, then failed before its last final:
    assert sum(t.is_final for t in bad.transcripts) < sum(e[-1] for e in reference)
    assert good.code == OK, good.details
    assert transcript_of(good.events) == transcript_of(reference)
    assert (again.code, again.details) == (grpc.StatusCode.INTERNAL, "internal error")
    assert engine_sessions == 0 and free == slots  # both sessions released, the failed one's slot too
