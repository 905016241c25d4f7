"""lab/bench/fuzz_targets.py and `harken bench fuzz`: hypothesis over the wire decoders and the served session.

Hypothesis drives the random source of lab/bench/fuzz_targets.py's generators (so failures shrink and replay);
plain binary and text come straight from hypothesis too. Every target raises `Crash` when a
property breaks (see lab/bench/fuzz_targets.py): a decoder's rejection that is not a HarkenError mapped to
INVALID_ARGUMENT, a stream that ends INTERNAL or hangs, a reference session beside the fuzzed ones
whose transcript changes. The `slow` variants (run by `make bench`, beside `harken bench fuzz`)
try many more examples.
"""

from __future__ import annotations

import asyncio
import json
import threading

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from harken.bench import fuzz_targets as fuzz
from harken.bench import fuzz_inputs as inputs
from harken.bench.fuzz import split
from harken.cli import main
from harken.shared.codec import CODEC_NAME, MAX_FRAMES

FEW, MANY = 400, 5_000  # decoder examples: make test / make bench
FEW_STREAMS, MANY_STREAMS = 100, 1_500
RANDOMS = st.randoms(use_true_random=False)


def fuzzing(n: int):
    return settings(max_examples=n, deadline=None, suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def corpus() -> inputs.FuzzCorpus:
    return inputs.build_corpus()


# ---- the decoders --------------------------------------------------------------------------------

def decoders(corpus: inputs.FuzzCorpus, n: int) -> None:
    @fuzzing(n)
    @given(payload=st.binary(max_size=80) | RANDOMS.map(lambda rng: inputs.random_codec_input(rng, corpus)[0]),
           max_frames=st.sampled_from([MAX_FRAMES, 0, 1, 20]))
    def codec(payload, max_frames):
        event(fuzz.check_codec(payload, max_frames))

    @fuzzing(n)
    @given(st.binary(max_size=120) | RANDOMS.map(lambda rng: inputs.random_wire_input(rng, corpus)))
    def wire(data):
        event(fuzz.check_wire(data))

    @fuzzing(n)
    @given(st.binary(max_size=120) | st.text(max_size=120) | RANDOMS.map(inputs.random_json_text)
           | RANDOMS.map(lambda rng: inputs.random_datachannel_server_input(rng, corpus)))
    def datachannel_server(data):
        event(fuzz.check_datachannel_server(data))

    @fuzzing(n)
    @given(st.binary(max_size=120) | st.text(max_size=120) | RANDOMS.map(inputs.random_datachannel_client_input))
    def datachannel_client(data):
        event(asyncio.run(fuzz.check_datachannel_client(data)))

    for check in (codec, wire, datachannel_server, datachannel_client):
        check()


def test_decoders_accept_or_reject_as_invalid_argument(corpus):
    decoders(corpus, FEW)


@pytest.mark.slow
def test_decoders_many_examples(corpus):
    decoders(corpus, MANY)


def test_corpus_inputs_are_accepted(corpus):
    """The generators start from valid inputs: each is accepted as it is."""
    assert all(fuzz.check_codec(p) == "OK" for p in corpus.payloads)
    assert all(fuzz.check_wire(m) == "OK" for m in corpus.messages)
    assert len(corpus.packets) >= 10 and any(p.segment_end for p in corpus.packets)


# ---- what the fuzzer found -----------------------------------------------------------------------

@pytest.mark.parametrize("text", ["[" * 50_000, '{"a":' * 5_000])
def test_a_deeply_nested_text_frame_is_ignored_by_the_server_and_malformed_for_the_client(text):
    """json.loads raises RecursionError (not a ValueError) past Python's recursion limit: the
    server's data-channel handler raised it into aiortc, the client's too."""
    assert fuzz.check_datachannel_server(text) == "OK"
    assert asyncio.run(fuzz.check_datachannel_client(text)) == "OK"  # the call ends INTERNAL, see below

    from harken.edge.client.webrtc_client import DataChannelCall

    call = DataChannelCall(fuzz._FakeDataChannel())
    call._on_message(text)
    assert call._status is not None and call._status[0] == "INTERNAL"


def test_a_message_the_client_cannot_parse_fails_the_call_with_internal():
    """DataChannelCall.read raised protobuf's DecodeError at the SDK's user; grpc.aio handed over
    None (and the SDK raised AttributeError). Both now fail the call with INTERNAL."""
    from harken.edge.client.call import CallFailed, status_error
    from harken.edge.client.grpc_call import call_message
    from harken.shared.protocol import ServerError

    assert asyncio.run(fuzz.check_datachannel_client(b"\xff\xff")) == "INTERNAL"
    with pytest.raises(CallFailed) as e:
        call_message(None)
    assert e.value.code == "INTERNAL"
    # an Error message naming no status code (getattr found the enum's `name` property) is UNKNOWN
    assert status_error(ServerError(code="name", message="")).code == "UNKNOWN"
    assert status_error(ServerError(code="NOT_FOUND", message="")).code == "NOT_FOUND"


# ---- the served session --------------------------------------------------------------------------

class LoopThread:
    """An event loop in its own thread: the served session lives there while hypothesis, on the
    test's thread, hands it one stream per example."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def submit(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro, timeout: float = 300):
        return self.submit(coro).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)
        self.loop.close()


@pytest.fixture(scope="module")
def served(asr, corpus):
    lt = LoopThread()
    harness = lt.run(fuzz.ServedFuzz.start(asr, corpus))
    yield lt, harness
    lt.run(harness.close())
    lt.close()


def fuzz_sessions(served, n: int) -> None:
    lt, harness = served
    alone = lt.run(harness.run_reference())
    assert alone and alone[0][1], "the reference should hold committed text"
    stop = lt.run(_event())
    beside = lt.submit(harness.reference_runs(alone, stop, pace_s=0.05))

    @fuzzing(n)
    @given(RANDOMS)
    def check(rng):
        stream = inputs.random_stream(rng, harness.corpus, harness.resumable_ids())
        event(lt.run(harness.check(stream), timeout=fuzz.STREAM_DEADLINE_S + 10))

    try:
        check()
    finally:
        lt.loop.call_soon_threadsafe(stop.set)
        runs, affected = beside.result(300)
    assert runs >= 1 and affected == 0, f"{affected} of {runs} reference runs beside the fuzzing differed from alone"
    assert lt.run(harness.leaked_sessions()) == 0
    assert not harness.core.scheduler.engine.sessions


async def _event() -> asyncio.Event:
    return asyncio.Event()


def test_fuzzed_streams_end_with_client_errors_and_leave_another_session_alone(served):
    fuzz_sessions(served, FEW_STREAMS)


@pytest.mark.slow
def test_fuzzed_streams_many_examples(served):
    fuzz_sessions(served, MANY_STREAMS)


def test_stream_outcomes_are_classified(served):
    """The harness itself: a garbage first message is INVALID_ARGUMENT, a non-start one
    FAILED_PRECONDITION, a stream resuming the reference session (another key's)
    PERMISSION_DENIED, a dropped one CANCELLED, a whole valid one OK."""
    from harken.proto import harken_pb2 as pb

    lt, harness = served
    start = pb.ClientMessage(start=pb.Start(language=inputs.FUZZ_LANGUAGE, codec=CODEC_NAME)).SerializeToString()
    end = pb.ClientMessage(end=pb.End()).SerializeToString()
    assert lt.run(harness.check(inputs.FuzzStream((b"\xff",)))) == "INVALID_ARGUMENT"
    assert lt.run(harness.check(inputs.FuzzStream((end,)))) == "FAILED_PRECONDITION"
    assert lt.run(harness.check(inputs.FuzzStream((start, end)))) == "OK"
    assert lt.run(harness.check(inputs.FuzzStream((start,), drop=True))) == fuzz.CANCELLED
    reference = lt.submit(harness.run_reference(pace_s=0.05))
    while harness.reference_id is None and not reference.done():
        threading.Event().wait(0.01)
    assert harness.reference_id in harness.resumable_ids()
    resume = pb.ClientMessage(start=pb.Start(session_id=harness.reference_id)).SerializeToString()
    assert lt.run(harness.check(inputs.FuzzStream((resume,)))) == "PERMISSION_DENIED"
    assert reference.result(120) == lt.run(harness.run_reference())
    assert lt.run(harness.leaked_sessions()) == 0


# ---- harken bench fuzz ---------------------------------------------------------------------------

def test_split_gives_every_target_its_share():
    counts = split(1003, 0.1)
    assert counts["session"] == 100 and sum(counts.values()) == 1003
    assert sorted(counts[t] for t in fuzz.TARGETS if t != "session") == [225, 226, 226, 226]


def test_bench_fuzz_prints_its_counts(capsys):
    assert main(["bench", "fuzz", "--examples", "300", "--seed", "3", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    for key in ("tried", "crashes", "rejections_by_code", "accepted", "by_target", "session_messages",
                "reference_runs", "others_affected", "leaked_sessions", "ok", "wall_s", "examples_per_s"):
        assert key in result, key
    assert result["tried"] == 300 and result["crashes"] == 0 and result["ok"] is True
    assert set(result["by_target"]) == set(fuzz.TARGETS)
    assert result["by_target"]["session"]["tried"] == 30
    assert result["reference_runs"] >= 1 and result["others_affected"] == 0 and result["leaked_sessions"] == 0
    assert "INVALID_ARGUMENT" in result["rejections_by_code"]
    assert set(result["rejections_by_code"]) <= fuzz.CLIENT_ERRORS


def test_the_last_uint32_segment_id_is_invalid_argument_not_internal(served):
    """A segment numbered 2^32 - 1 made its final's seed (next_segment_id 2^32) unsendable: the
    stream failed INTERNAL. Segment ids stop one short, on both input paths."""
    from harken.proto import harken_pb2 as pb

    lt, harness = served
    p = harness.corpus.packets[0]
    whole = pb.ClientMessage(features=pb.Features(
        seq=1, segment_id=2**32 - 1, first_frame=p.first_frame, frame_count=p.frame_count, segment_start=True,
        segment_end=True, payload=p.payload))
    start = pb.ClientMessage(start=pb.Start(language=inputs.FUZZ_LANGUAGE, codec=CODEC_NAME))
    end = pb.ClientMessage(end=pb.End())
    out = lt.run(harness.run(inputs.FuzzStream(tuple(m.SerializeToString() for m in (start, whole, end)))))
    assert (out.code, out.details) == ("INVALID_ARGUMENT", f"features.segment_id is at most {2**32 - 2}")
    seeded = pb.ClientMessage(start=pb.Start(language=inputs.FUZZ_LANGUAGE, seed=pb.SessionSeed(
        present=True, running_max_log10=-2.0, next_segment_id=2**32 - 1)))
    audio = [pb.ClientMessage(audio=pb.Audio(seq=i + 1, pcm16=pcm, sample_rate=16_000))
             for i, pcm in enumerate(harness.corpus.pcm_pieces)]
    out = lt.run(harness.run(inputs.FuzzStream(tuple(m.SerializeToString() for m in (seeded, *audio, end)))))
    assert out.code == "INVALID_ARGUMENT" and out.details.startswith("no segment ids left"), out.details
    assert lt.run(harness.leaked_sessions()) == 0


# ---- the HTTP port's OpenAI endpoints (lab/bench/fuzz_http.py) ---------------------------------------

FEW_HTTP, MANY_HTTP = 40, 600


@pytest.fixture(scope="module")
def served_http(asr, corpus):
    from harken.bench import fuzz_http

    lt = LoopThread()
    harness = lt.run(fuzz_http.ServedHTTP.start(asr, corpus))
    yield lt, harness
    lt.run(harness.close())
    lt.close()


def fuzz_http_examples(served_http, n: int) -> None:
    from harken.bench import fuzz_http

    lt, harness = served_http
    alone = lt.run(harness.run_reference())
    stop = lt.run(_event())
    beside = lt.submit(harness.reference_runs(alone, stop))

    @fuzzing(n)
    @given(RANDOMS)
    def check(rng):
        target, example = fuzz_http.random_example(rng, harness.corpus)
        event(f"{target} {lt.run(fuzz_http.check_example(harness, target, example), timeout=200)}")

    try:
        check()
    finally:
        lt.loop.call_soon_threadsafe(stop.set)
        runs, affected = beside.result(300)
    assert runs >= 1 and affected == 0, f"{affected} of {runs} reference sessions beside the fuzzing differed"
    assert lt.run(harness.leaked_sessions()) == 0


def test_fuzzed_http_requests_and_realtime_sessions_get_openai_errors(served_http):
    fuzz_http_examples(served_http, FEW_HTTP)


@pytest.mark.slow
def test_fuzzed_http_many_examples(served_http):
    fuzz_http_examples(served_http, MANY_HTTP)


def _post(boundary: bytes, body: bytes, content_type: bytes | None = None, auth: bytes | None = None):
    from harken.bench import fuzz_http

    headers = b"Host: x\r\nAuthorization: " + (auth or b"Bearer " + fuzz_http.HTTP_KEY.encode()) + b"\r\n"
    headers += b"Content-Type: " + (content_type or b"multipart/form-data; boundary=" + boundary) + b"\r\n"
    raw = (b"POST /v1/audio/transcriptions HTTP/1.1\r\n" + headers + b"Content-Length: " + str(len(body)).encode()
           + b"\r\nConnection: close\r\n\r\n" + body)
    return fuzz_http.HttpRequest(raw, good_key=auth is None)


def _part(name: bytes, value: bytes, *headers: bytes) -> bytes:
    return (b"--B\r\nContent-Disposition: form-data; name=\"" + name + b"\"\r\n" + b"".join(h + b"\r\n" for h in headers)
            + b"\r\n" + value + b"\r\n")


def _wav(corpus, rate: int = 16_000) -> bytes:
    from harken.bench.fuzz_http_inputs import wav_bytes

    return wav_bytes(b"".join(corpus.pcm_pieces[:10]), rate=rate)


def test_what_the_http_fuzzer_found_is_a_4xx_in_openais_shape(served_http, corpus):
    """Each raised out of the file API's handler (a 500, the traceback logged) before its fix;
    now a 400 (401 for the token) with OpenAI's error body, or taken: fields are read as their
    bytes came (UTF-8), whatever charset or transfer encoding their part headers name."""
    lt, harness = served_http
    wav = b'--B\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n\r\n' + _wav(corpus) + b"\r\n"
    end = b"--B--\r\n"
    found = {
        "no boundary": _post(b"B", wav + end, content_type=b"multipart/form-data"),
        "a boundary over 70 characters": _post(b"B" * 80, wav + end, content_type=b"multipart/form-data; boundary=" + b"B" * 80),
        "a part never closed": _post(b"B", _part(b"language", b"en") + b"--B\r\nContent-Disposition: attachment\r\n\r\n\r\n"),
        "a field that is not UTF-8": _post(b"B", wav + _part(b"prompt", b"\xba\xff") + end),
        "a NUL in a part's name": _post(b"B", wav + _part(b"\x00x", b"1") + end),
        "a nested multipart part": _post(b"B", wav + _part(b"x", b"--in\r\n\r\n1\r\n--in--",
                                                             b'Content-Type: multipart/mixed; boundary="in"') + end),
        "a WAV of 1 Hz (hours once resampled)": _post(b"B", b'--B\r\nContent-Disposition: form-data; name="file"\r\n\r\n'
                                                        + _wav(corpus, rate=1) + b"\r\n" + end),
    }
    for what, req in found.items():
        assert lt.run(harness.check_http(req)) == "400", what
        body = json.loads(lt.run(harness.send(req)).body)
        assert body["error"]["type"] == "invalid_request_error" and "Traceback" not in body["error"]["message"], what
    taken = {"an unknown charset": _post(b"B", wav + _part(b"language", b"en", b"Content-Type: text/plain; charset=nope") + end),
             "an unknown transfer encoding": _post(b"B", wav + _part(b"prompt", b"x", b"Content-Transfer-Encoding: x") + end)}
    for what, req in taken.items():
        assert lt.run(harness.check_http(req)) == "200", what
    bad_token = _post(b"B", wav + end, auth=b"Bearer \xff\xfe\x80")  # not UTF-8: raised UnicodeEncodeError
    assert lt.run(harness.check_http(bad_token)) == "401"
    import dataclasses

    text = dataclasses.replace(_post(b"B", wav + _part(b"response_format", b"text") + end), response_format="text")
    assert lt.run(harness.check_http(text)) == "200"
    from harken.bench import fuzz_http

    plain = fuzz_http.HttpRequest(b"GET /v1/realtime HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                                  + fuzz_http.HTTP_KEY.encode() + b"\r\nConnection: close\r\n\r\n")
    assert lt.run(harness.check_http(plain)) == "400"  # was aiohttp's plain-text 400
    assert json.loads(lt.run(harness.send(plain)).body)["error"]["code"] == "websocket_required"


def test_what_the_realtime_fuzzer_found_is_an_error_event(served_http, corpus):
    """Deeply nested JSON dropped the socket (RecursionError out of the handler), a session.update
    whose parts were no objects too (AttributeError); audio after the final commit was queued for
    nobody. Each is now an error event, and the session goes on."""
    import base64

    from harken.bench import fuzz_http

    lt, harness = served_http
    audio = json.dumps({"type": "input_audio_buffer.append",
                        "audio": base64.b64encode(b"".join(corpus.pcm_pieces[:10])).decode()})
    frames = [("text", "[" * 50_000), ("text", '{"a":' * 5_000),
              ("text", json.dumps({"type": "session.update", "session": {"audio": "x"}})),
              ("text", json.dumps({"type": "session.update", "session": {"audio": {"input": {"format": 1}}}})),
              ("text", json.dumps({"type": "session.update", "session": {"audio": {"input": {"transcription": []}}}})),
              ("text", json.dumps({"type": "session.update", "session": {"audio": {"input": {"format": {"rate": True}}}}})),
              ("text", json.dumps({"type": "session.update", "session": {"type": "transcription", "audio": {"input": {
                  "format": {"type": "audio/pcm", "rate": 16000}}}}})),
              ("text", audio), ("text", json.dumps({"type": "input_audio_buffer.commit", "final": True})),
              ("text", audio), ("text", json.dumps({"type": "input_audio_buffer.commit", "final": True})),
              ("wait", 1.0)]
    script = fuzz_http.RealtimeScript((("Authorization", f"Bearer {fuzz_http.HTTP_KEY}"),), tuple(frames))
    outcome, events = lt.run(harness.run_realtime(script))
    assert outcome == "closed 1000"
    codes = [e["error"]["code"] for e in events if e["type"] == "error"]
    assert codes == ["invalid_event"] * 2 + ["invalid_value"] * 4 + ["session_ended"] * 2, codes
    assert [e["type"] for e in events].count("session.updated") == 1
    assert lt.run(harness.check_realtime(script)) == "closed 1000, error events"
    assert lt.run(harness.leaked_sessions()) == 0


def test_bench_fuzz_http_examples(capsys):
    assert main(["bench", "fuzz", "--examples", "0", "--http-examples", "30", "--seed", "5", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    http = result["http"]
    assert http["tried"] == 30 and http["crashes"] == 0 and http["ok"] and result["ok"]
    assert set(http["by_target"]) == {"transcriptions", "models", "realtime", "listen"}
    assert http["reference_runs"] >= 1 and http["others_affected"] == 0 and http["leaked_sessions"] == 0


def test_a_form_is_bounded_in_parts_and_in_field_bytes(served_http, corpus):
    """Seen while fixing the fuzzer's findings: a chunked body has no Content-Length to refuse up
    front, so a form of many fields (each under its 64,000-byte cap) or of many parts was read into
    memory without a bound. Now at most 64 parts (400) and 1 MiB of fields in all (413)."""
    from harken.bench import fuzz_http

    lt, harness = served_http
    wav = b'--B\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n\r\n' + _wav(corpus) + b"\r\n"
    many_parts = wav + b"".join(_part(f"f{i}".encode(), b"1") for i in range(70)) + b"--B--\r\n"
    assert lt.run(harness.check_http(_post(b"B", many_parts))) == "400"
    assert "more than 64 parts" in json.loads(lt.run(harness.send(_post(b"B", many_parts))).body)["error"]["message"]
    big = wav + b"".join(_part(f"f{i}".encode(), b"x" * 60_000) for i in range(20)) + b"--B--\r\n"
    chunks = b"".join(f"{len(big[i:i + 65536]):x}\r\n".encode() + big[i:i + 65536] + b"\r\n"
                      for i in range(0, len(big), 65536)) + b"0\r\n\r\n"
    raw = (b"POST /v1/audio/transcriptions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + fuzz_http.HTTP_KEY.encode()
           + b"\r\nContent-Type: multipart/form-data; boundary=B\r\nTransfer-Encoding: chunked\r\n"
           b"Connection: close\r\n\r\n" + chunks)
    out = lt.run(harness.send(fuzz_http.HttpRequest(raw)))
    assert out.status == 413 and json.loads(out.body)["error"]["code"] == "fields_too_large"
