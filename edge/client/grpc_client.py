"""The edge's gRPC client: audio in, transcript events out, nothing lost across network faults.

`TranscriptionClient.stream(source)` runs a front end over the source (`edge/client/front_end.py`: the
edge pipeline's feature packets, or PCM16 for a thin client), one `harken.v1.Transcription/Stream`
call per attempt, and yields the server's transcript as `TranscriptEvent`s. What to send, what
to resend after a dropped call, what the user sees and whether to try again is decided by one
`ClientSession` (`edge/client/session.py`, sans-IO, where the session semantics are documented);
this module only moves its messages over a call (`edge/client/call.py`: a gRPC call here, `GrpcCall`; a
WebRTC data channel in edge/client/webrtc_client.py), times the calls and classifies their failures:

- A TLS mismatch is not a network fault: a certificate the CA does not sign (or issued for another
  name), a TLS client at a plaintext server, a plaintext client at a TLS server (asked of the port
  once, before the first session, when the connection closes at once) fail the stream at once with
  `TransportSecurityError`, never retried.

No torch here: grpcio, protobuf, numpy and the edge modules only.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager, aclosing, asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol, overload

from .call import EOF, Call, CallFailed, status_error
from .session import (ClientOptions, ClientSession, Disconnect, ClientLifecycle, SessionOutput,
                                        StreamProgress, TransportStats)
from .errors import (BufferOverflowError, ServerRejectedError, ServerUnavailableError, TransportError,
                                TransportSecurityError)
from .grpc_call import GrpcCall, closed_at_once, speaks_tls, tls_mismatch
from .front_end import (FINALIZE, AudioSource, Notify, as_async_pieces, audio_pieces, file_pieces,
                                   front_end)
from ...shared.protocol import ServerError
from ...shared.text import TranscriptText
from ...shared.transcript import SegmentTimings, TimedWord, TranscriptEvent, TurnEvent

if TYPE_CHECKING:
    import grpc

__all__ = ["TranscriptionClient", "ClientOptions", "TransportStats", "StreamProgress", "TranscriptEvent",
           "SegmentTimings", "TimedWord", "TurnEvent", "FINALIZE",
           "TransportError", "ServerUnavailableError", "BufferOverflowError", "TransportSecurityError",
           "ServerRejectedError", "AudioSource", "file_pieces", "audio_pieces"]


# The call metadata a session-affine router hashes (the key Ray Serve's gRPC proxy reads into its
# request's session id); `harken serve` itself ignores it.
ROUTE_METADATA = "session_id"


class TranscriptionClient:
    """An asyncio client of a harken server.

    ```
    client = TranscriptionClient("localhost:50051", api_key="...", options=ClientOptions(language="English"))
    async for event in client.stream(file_pieces("talk.wav")):
        print(event.committed_delta, end="", flush=True)
    ```

    `target` is "host:port"; `tls` is None (plaintext), True (system roots) or the path of a PEM
    root certificate; `api_key` is sent as `authorization: Bearer <key>`. One client may run
    several streams (one per audio track), concurrently or one after another; `stats` describes
    the latest.
    """

    def __init__(self, target: str, api_key: str | None = None, tls: bool | str | Path | None = None,
                 language: str | None = None, context: str | None = None,
                 options: ClientOptions | None = None, rng: random.Random | None = None,
                 clock: Callable[[], float] = time.monotonic, calls: CallOpener | None = None):
        self.target = target
        self.api_key = api_key
        self.options = replace(options or ClientOptions())  # a copy: the caller's stays as it was
        if language is not None:
            self.options.language = language
        if context is not None:
            self.options.context = context
        self._credentials = _channel_credentials(tls) if calls is None else None
        # what carries each call of a stream: gRPC unless given (the WebRTC client's data channels)
        self._calls: CallOpener = calls or GrpcCalls(target, self._credentials)
        self._rng = rng or random.Random()
        self._clock = clock
        self.stats = TransportStats()

    @overload
    def stream(self, source: AudioSource, progress: Literal[False] = False,
               word_timings: Literal[False] = False,
               turn_events: Literal[False] = False) -> AsyncGenerator[TranscriptEvent, None]: ...

    @overload
    def stream(self, source: AudioSource, progress: bool, word_timings: Literal[False] = False,
               turn_events: Literal[False] = False) -> AsyncGenerator[TranscriptEvent | StreamProgress, None]: ...

    @overload
    def stream(self, source: AudioSource, progress: bool = False, word_timings: bool = False,
               turn_events: bool = False) -> AsyncGenerator[SessionOutput, None]: ...

    async def stream(self, source: AudioSource, progress: bool = False,
                     word_timings: bool = False, turn_events: bool = False) -> AsyncGenerator[SessionOutput, None]:
        """Transcribe `source` (16 kHz mono float32 pieces, sync or async; an array; a file path):
        yield every transcript event, return once the server has sent the last final. With
        `progress`, `StreamProgress` items come in between, each after the events it accounts for.
        With `word_timings`, the stream asks the server for each final segment's word times: a
        `SegmentTimings` follows the segment's final event (a server without an aligner sends none
        and says so: `stats.word_timings` is then False, and a warning is logged). With
        `turn_events`, `TurnEvent`s (speech started, utterance end) come as soon as the server's
        VAD or this edge's knows them. With `ClientOptions(diarize=True)`, each final event says its
        `speaker` ("S1", ...) and a `SpeakerChange` comes when the server moves a recent segment to
        another speaker (`stats.diarize` False: this server gives no labels). A source may yield `FINALIZE` between its pieces: the open
        segment's final then comes at once, `from_finalize`.

        Leaving the loop early stops the stream once the generator is closed: use
        `contextlib.aclosing(client.stream(...))` to have that happen at once."""
        async with aclosing(self._run(source, word_timings, turn_events)) as items:
            async for item in items:
                if progress or not isinstance(item, StreamProgress):
                    yield item

    async def transcribe(self, source) -> str:
        """The whole transcript of `source`: the committed text of all segments, joined as the
        engine joins them (`shared/text.py`)."""
        text = TranscriptText()
        async for e in self.stream(source):
            text.add(e)
        return text.text

    # ---- the owner of one stream: a producer task, a connection task, items out via a queue ----

    async def _run(self, source: AudioSource, word_timings: bool = False,
                   turn_events: bool = False) -> AsyncGenerator[SessionOutput, None]:
        session = ClientSession(replace(self.options, word_timings=word_timings, turn_events=turn_events),
                                self.target, self._rng)
        self.stats = session.stats
        out: asyncio.Queue = asyncio.Queue()
        wake = asyncio.Event()  # the session may have something new to send

        def notify(items: Sequence[SessionOutput]) -> None:
            for item in items:
                out.put_nowait(item)
            wake.set()

        producer = asyncio.create_task(front_end(self.options).run(as_async_pieces(source), session, notify),
                                       name="harken-client-produce")
        connection = asyncio.create_task(self._connect_loop(session, notify, wake), name="harken-client-connection")
        done_marker = object()
        connection.add_done_callback(lambda _: out.put_nowait(done_marker))

        def producer_done(t: asyncio.Task) -> None:
            if not t.cancelled() and t.exception() is not None:
                out.put_nowait(done_marker)

        producer.add_done_callback(producer_done)
        try:
            while True:
                item = await out.get()
                if item is done_marker:
                    # a failed producer ends the stream with its error; a finished connection ends it
                    if producer.done() and not producer.cancelled():
                        error = producer.exception()
                        if error is not None:
                            raise error
                    if connection.done():
                        while not out.empty():  # items queued before the connection finished
                            item = out.get_nowait()
                            if item is not done_marker:
                                yield item
                        connection.result()  # re-raises its error
                        return
                    continue
                yield item
        finally:
            for task in (producer, connection):
                task.cancel()
            await asyncio.gather(producer, connection, return_exceptions=True)

    # ---- calls --------------------------------------------------------------------------------

    async def _connect_loop(self, session: ClientSession, notify: Notify, wake: asyncio.Event) -> None:
        probed = False  # the one TLS probe of a plaintext client (see below) is done
        while True:
            try:
                if await self._attempt(session, notify, wake):
                    return
                failure = Disconnect("the server closed the stream before the end")
            except CallFailed as e:
                mismatch = tls_mismatch(e, self.target, tls=self._credentials is not None)
                if mismatch is None and self._credentials is None and e.code == "UNAVAILABLE" \
                        and not probed and session.stats.sessions_opened == 0 and closed_at_once(e):
                    # a plaintext client's handshake with a TLS server fails as a bare "Socket
                    # closed": before the stream's first session, ask the port once whether it
                    # speaks TLS (a closed socket is a network fault, too, then retried as ever)
                    probed = True
                    if await speaks_tls(self.target, min(self.options.connect_timeout_s, 5.0)):
                        mismatch = (f"the server at {self.target} speaks TLS and this client connects in "
                                    f"plaintext: give the server's CA certificate (--tls-ca FILE; tls= in the SDK)")
                failure = Disconnect(e.details, code=e.code, tls_mismatch=mismatch)
            except (asyncio.TimeoutError, _NoReady, _Silent) as e:
                failure = Disconnect(str(e) or "no Ready in time")
            retry = session.on_disconnect(failure, self._clock())  # raises when there is no point
            if retry.delay_s > 0:
                await asyncio.sleep(retry.delay_s)

    async def _attempt(self, session: ClientSession, notify: Notify, wake: asyncio.Event) -> bool:
        """One call: Start/Ready, then send and receive until the server closes it. True when the
        whole stream is done (End sent, server closed with OK)."""
        metadata = [(ROUTE_METADATA, session.route_key)]
        if self.api_key:
            metadata.append(("authorization", f"Bearer {self.api_key}"))
        async with self._calls.open(metadata, self.options) as call:
            tasks: set[asyncio.Task] = set()
            try:
                await call.write(session.start_message())
                reply = await asyncio.wait_for(call.read(), self.options.connect_timeout_s)
                if reply is EOF:
                    raise _NoReady("the server closed the stream without Ready")
                if isinstance(reply, ServerError):
                    raise status_error(reply)
                session.on_server_message(reply, self._clock())  # the Ready, or a protocol error
                wake.set()
                receiver = asyncio.create_task(self._receive(call, session, notify), name="harken-client-receive")
                tasks = {receiver, asyncio.create_task(self._send(call, session, wake), name="harken-client-send"),
                         asyncio.create_task(self._watch(session), name="harken-client-watch")}
                while True:
                    done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
                    if receiver in done:
                        return receiver.result()
                    for t in done:
                        t.result()  # the sender's or the watchdog's error ends the attempt
                        tasks.discard(t)  # the sender is done after End: wait for the finals
            finally:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                call.cancel()

    async def _receive(self, call: Call, session: ClientSession, notify: Notify) -> bool:
        """The server's messages until it closes the call; True if the stream is done."""
        while (reply := await call.read()) is not EOF:
            if isinstance(reply, ServerError):
                raise status_error(reply)
            notify(session.on_server_message(reply, self._clock()))
        # OK after our End: all finals are in. OK without it (a server shutting down): resume, or
        # replay into a new session
        return session.on_call_closed()

    async def _send(self, call: Call, session: ClientSession, wake: asyncio.Event) -> None:
        """Write what the session has to send as it comes; half-close once it has sent it all."""
        while True:
            wake.clear()
            while (msg := session.next_message(self._clock())) is not None:
                await call.write(msg)
                session.sent(msg)
            if session.lifecycle is ClientLifecycle.DRAINING:  # End is out (or the server holds ours)
                await call.done_writing()
                return
            due = session.keepalive_in(self._clock())
            try:  # more input, or the time for a KeepAlive (nothing written for keepalive_s)
                await asyncio.wait_for(wake.wait(), None if due is None else max(due, 0.01))
            except asyncio.TimeoutError:
                pass

    async def _watch(self, session: ClientSession) -> None:
        """Raise `_Silent` when the server owes us something and the call has carried nothing
        for `silence_timeout_s`."""
        while True:
            await asyncio.sleep(min(1.0, self.options.silence_timeout_s / 4))
            if (reason := session.check_silence(self._clock())) is not None:
                raise _Silent(reason)

class CallOpener(Protocol):
    """Opens the calls of a stream, one per attempt, each open while its context is: what a
    `TranscriptionClient` runs its session over (`GrpcCalls`; the WebRTC client's `DataChannelCalls`)."""

    def open(self, metadata: list[tuple[str, str]], options: ClientOptions) -> AbstractAsyncContextManager[Call]:
        ...


class GrpcCalls:
    """Each call a `harken.v1.Transcription/Stream` on a gRPC channel of its own."""

    def __init__(self, target: str, credentials: grpc.ChannelCredentials | None):
        self.target, self.credentials = target, credentials

    @asynccontextmanager
    async def open(self, metadata: list[tuple[str, str]], options: ClientOptions) -> AsyncIterator[Call]:
        from ...proto import harken_pb2_grpc  # grpc is imported by the gRPC client only

        async with self._channel(options) as channel:
            yield GrpcCall(harken_pb2_grpc.TranscriptionStub(channel).Stream(metadata=metadata))

    def _channel(self, options: ClientOptions) -> AbstractAsyncContextManager[Any]:
        import grpc

        # a fresh channel, and connection, per attempt: grpc's own reconnect backoff (up to
        # minutes) stays out of the way of ours, a restarted server is found at once, and a dead
        # connection is not shared into the next attempt (channels share subchannels by default)
        channel_options: list[tuple[str, int | str]] = [("grpc.max_receive_message_length", 16 << 20),
                                                        ("grpc.use_local_subchannel_pool", 1)]
        if self.credentials is None:
            return grpc.aio.insecure_channel(self.target, options=channel_options)
        if options.tls_server_name:
            channel_options.append(("grpc.ssl_target_name_override", options.tls_server_name))
        return grpc.aio.secure_channel(self.target, self.credentials, options=channel_options)


class _NoReady(Exception):
    pass


class _Silent(Exception):
    """The connection carried nothing while the server owed us something: presumed dead."""


def _channel_credentials(tls: bool | str | Path | None) -> grpc.ChannelCredentials | None:
    if tls is None or tls is False:
        return None
    import grpc

    if tls is True:
        return grpc.ssl_channel_credentials()
    return grpc.ssl_channel_credentials(root_certificates=Path(tls).read_bytes())
