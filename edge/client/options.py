"""What a client session is told and what it tells: `ClientOptions` (how a `TranscriptionClient`
streams, buffers and reconnects, and what it asks the server for), `TransportStats` (what it did
to get the transcript through) and `StreamProgress` (in band with the events). Used by
edge/client/session.py's `ClientSession`, which re-exports them."""

from __future__ import annotations

from dataclasses import dataclass

from ...shared.codec import DEFAULT_MODE


@dataclass
class ClientOptions:
    """How a `TranscriptionClient` streams, buffers and reconnects."""

    language: str = ""  # force a language ("English"); "" = detect
    context: str = ""  # context text for the model: hot words, names, topic
    send_audio: bool = False  # thin client: PCM16 `Audio` messages, the server runs VAD + features
    codec_mode: str = DEFAULT_MODE
    packet_frames: int = 20  # frames per `Features` message (20 = 200 ms)
    audio_piece_ms: int = 100  # thin client: audio per `Audio` message
    max_offline_s: float = 120.0  # give up when the server stays away this long
    max_buffer_bytes: int = 64 << 20  # bound on buffered, not yet final, payload bytes
    connect_timeout_s: float = 10.0  # one attempt's wait for `Ready`
    # a connection over which nothing arrives for this long while the server owes us something
    # (acks, transcripts of unfinished segments, the end) is taken for dead and resumed: a network
    # that drops packets without a reset would otherwise hang the stream
    silence_timeout_s: float = 30.0
    # a call that has written nothing for this long writes a `KeepAlive` (a feature client in a
    # long silence sends no packets, and the server ends streams idle past its --idle-timeout-s,
    # 30 s by default); 0 = never
    keepalive_s: float = 10.0
    backoff_initial_s: float = 0.05
    backoff_max_s: float = 2.0
    backoff_multiplier: float = 2.0
    tls_server_name: str | None = None  # TLS: check the certificate for this name, not the host's
    # the stream's session-affinity key (`ClientSession.route_key`); "" = a random one per stream.
    # Streams given the same key share a server behind a session-affine router.
    route_key: str = ""
    # ask for each final segment's word timings (`SegmentTimings`, after its final event); a server
    # without an aligner says no in its Ready (`TransportStats.word_timings`). The SDK sets it per
    # stream: `TranscriptionClient.stream(source, word_timings=True)`
    word_timings: bool = False
    # ask for the VAD's turn events (`TurnEvent`: speech started, utterance end), sent as soon as
    # the server has applied the frames that decide them. The SDK sets it per stream:
    # `TranscriptionClient.stream(source, turn_events=True)`
    turn_events: bool = False
    # words and names to expect (Qwen3-ASR's context after `context`); `ClientSession.configure`
    # changes them (and the context) mid-stream, from the next segment on
    keyterms: tuple[str, ...] = ()
    # ask for speaker labels (one microphone, several people): each final `TranscriptEvent` says its
    # `speaker` ("S1", "S2", ...), and a `SpeakerChange` relabels a recent segment when the server
    # finds it better assigned; a server without the speaker encoder says no (`TransportStats.diarize`)
    diarize: bool = False

    def __post_init__(self):
        if self.max_offline_s <= 0 or self.max_buffer_bytes <= 0:
            raise ValueError("max_offline_s and max_buffer_bytes must be positive")
        if self.backoff_initial_s <= 0 or self.backoff_max_s < self.backoff_initial_s:
            raise ValueError("need 0 < backoff_initial_s <= backoff_max_s")


@dataclass
class TransportStats:
    """What the client did to get the transcript through: read it after (or during) a stream."""

    sessions_opened: int = 0  # 1 + replacement sessions after NOT_FOUND
    resumes: int = 0  # reconnects that resumed the same session
    failed_attempts: int = 0  # stream attempts that ended in a retryable error
    last_failure: str = ""  # why the latest of them failed
    messages_sent: int = 0  # Features/Audio messages written, resends included
    messages_resent: int = 0
    frames_sent: int = 0  # feature frames written, resends included
    frames_resent: int = 0
    keepalives_sent: int = 0  # `KeepAlive` messages written (nothing else to send for keepalive_s)
    frames_produced: int = 0  # feature frames the edge produced (each counted once)
    payload_bytes_produced: int = 0  # codec payload bytes of those frames (each counted once)
    duplicate_events: int = 0  # transcript events dropped as already seen (event_seq replay)
    replayed_text_chars: int = 0  # committed text re-sent by a replacement session and dropped
    replay_mismatches: int = 0  # a replacement session's committed text disagreed with ours
    route_key: str = ""  # the stream's session-affinity key (`ClientSession.route_key`)
    # the server's answer to `ClientOptions.word_timings` (its latest Ready): True: timings come;
    # False: this server has no aligner (none come); None: not asked, or no Ready yet
    word_timings: bool | None = None
    word_timings_received: int = 0  # SegmentTimings passed on (after de-duplication)
    turn_events: bool | None = None  # the server's answer to `ClientOptions.turn_events` (its latest Ready)
    finalizes_sent: int = 0  # thin client: `Finalize` messages written
    diarize: bool | None = None  # the server's answer to `ClientOptions.diarize` (its latest Ready)


@dataclass(frozen=True)
class StreamProgress:
    """In band with the events (`stream(..., progress=True)`): no final event with
    start_s < `bound_s` will come from this stream any more (feature mode; the meeting merger
    orders tracks with it)."""

    bound_s: float
