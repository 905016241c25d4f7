from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ClientMessage(_message.Message):
    __slots__ = ("start", "features", "audio", "finalize", "end", "keep_alive", "configure")
    START_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    AUDIO_FIELD_NUMBER: _ClassVar[int]
    FINALIZE_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    KEEP_ALIVE_FIELD_NUMBER: _ClassVar[int]
    CONFIGURE_FIELD_NUMBER: _ClassVar[int]
    start: Start
    features: Features
    audio: Audio
    finalize: Finalize
    end: End
    keep_alive: KeepAlive
    configure: Configure
    def __init__(self, start: _Optional[_Union[Start, _Mapping]] = ..., features: _Optional[_Union[Features, _Mapping]] = ..., audio: _Optional[_Union[Audio, _Mapping]] = ..., finalize: _Optional[_Union[Finalize, _Mapping]] = ..., end: _Optional[_Union[End, _Mapping]] = ..., keep_alive: _Optional[_Union[KeepAlive, _Mapping]] = ..., configure: _Optional[_Union[Configure, _Mapping]] = ...) -> None: ...

class Configure(_message.Message):
    __slots__ = ("keyterms", "context")
    KEYTERMS_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_FIELD_NUMBER: _ClassVar[int]
    keyterms: _containers.RepeatedScalarFieldContainer[str]
    context: str
    def __init__(self, keyterms: _Optional[_Iterable[str]] = ..., context: _Optional[str] = ...) -> None: ...

class KeepAlive(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Start(_message.Message):
    __slots__ = ("language", "context", "codec", "session_id", "seed", "last_event_seq", "word_timings", "turn_events", "keyterms", "diarize")
    LANGUAGE_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    LAST_EVENT_SEQ_FIELD_NUMBER: _ClassVar[int]
    WORD_TIMINGS_FIELD_NUMBER: _ClassVar[int]
    TURN_EVENTS_FIELD_NUMBER: _ClassVar[int]
    KEYTERMS_FIELD_NUMBER: _ClassVar[int]
    DIARIZE_FIELD_NUMBER: _ClassVar[int]
    language: str
    context: str
    codec: str
    session_id: str
    seed: SessionSeed
    last_event_seq: int
    word_timings: bool
    turn_events: bool
    keyterms: _containers.RepeatedScalarFieldContainer[str]
    diarize: bool
    def __init__(self, language: _Optional[str] = ..., context: _Optional[str] = ..., codec: _Optional[str] = ..., session_id: _Optional[str] = ..., seed: _Optional[_Union[SessionSeed, _Mapping]] = ..., last_event_seq: _Optional[int] = ..., word_timings: _Optional[bool] = ..., turn_events: _Optional[bool] = ..., keyterms: _Optional[_Iterable[str]] = ..., diarize: _Optional[bool] = ...) -> None: ...

class SessionSeed(_message.Message):
    __slots__ = ("present", "running_max_log10", "context_tail", "next_segment_id", "front_end_state", "audio_sample")
    PRESENT_FIELD_NUMBER: _ClassVar[int]
    RUNNING_MAX_LOG10_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_TAIL_FIELD_NUMBER: _ClassVar[int]
    NEXT_SEGMENT_ID_FIELD_NUMBER: _ClassVar[int]
    FRONT_END_STATE_FIELD_NUMBER: _ClassVar[int]
    AUDIO_SAMPLE_FIELD_NUMBER: _ClassVar[int]
    present: bool
    running_max_log10: float
    context_tail: str
    next_segment_id: int
    front_end_state: bytes
    audio_sample: int
    def __init__(self, present: _Optional[bool] = ..., running_max_log10: _Optional[float] = ..., context_tail: _Optional[str] = ..., next_segment_id: _Optional[int] = ..., front_end_state: _Optional[bytes] = ..., audio_sample: _Optional[int] = ...) -> None: ...

class Features(_message.Message):
    __slots__ = ("seq", "segment_id", "first_frame", "frame_count", "segment_start", "segment_end", "payload", "running_max_log10", "payload_crc32c", "finalized")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_FRAME_FIELD_NUMBER: _ClassVar[int]
    FRAME_COUNT_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_START_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_END_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    RUNNING_MAX_LOG10_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_CRC32C_FIELD_NUMBER: _ClassVar[int]
    FINALIZED_FIELD_NUMBER: _ClassVar[int]
    seq: int
    segment_id: int
    first_frame: int
    frame_count: int
    segment_start: bool
    segment_end: bool
    payload: bytes
    running_max_log10: float
    payload_crc32c: int
    finalized: bool
    def __init__(self, seq: _Optional[int] = ..., segment_id: _Optional[int] = ..., first_frame: _Optional[int] = ..., frame_count: _Optional[int] = ..., segment_start: _Optional[bool] = ..., segment_end: _Optional[bool] = ..., payload: _Optional[bytes] = ..., running_max_log10: _Optional[float] = ..., payload_crc32c: _Optional[int] = ..., finalized: _Optional[bool] = ...) -> None: ...

class Audio(_message.Message):
    __slots__ = ("seq", "pcm16", "sample_rate")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    PCM16_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_RATE_FIELD_NUMBER: _ClassVar[int]
    seq: int
    pcm16: bytes
    sample_rate: int
    def __init__(self, seq: _Optional[int] = ..., pcm16: _Optional[bytes] = ..., sample_rate: _Optional[int] = ...) -> None: ...

class Finalize(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class End(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServerMessage(_message.Message):
    __slots__ = ("ready", "transcript", "ack", "error", "word_timings", "turn", "speaker_label")
    READY_FIELD_NUMBER: _ClassVar[int]
    TRANSCRIPT_FIELD_NUMBER: _ClassVar[int]
    ACK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    WORD_TIMINGS_FIELD_NUMBER: _ClassVar[int]
    TURN_FIELD_NUMBER: _ClassVar[int]
    SPEAKER_LABEL_FIELD_NUMBER: _ClassVar[int]
    ready: Ready
    transcript: Transcript
    ack: Ack
    error: Error
    word_timings: WordTimings
    turn: Turn
    speaker_label: SpeakerLabel
    def __init__(self, ready: _Optional[_Union[Ready, _Mapping]] = ..., transcript: _Optional[_Union[Transcript, _Mapping]] = ..., ack: _Optional[_Union[Ack, _Mapping]] = ..., error: _Optional[_Union[Error, _Mapping]] = ..., word_timings: _Optional[_Union[WordTimings, _Mapping]] = ..., turn: _Optional[_Union[Turn, _Mapping]] = ..., speaker_label: _Optional[_Union[SpeakerLabel, _Mapping]] = ...) -> None: ...

class Ready(_message.Message):
    __slots__ = ("session_id", "resume_after_seq", "last_final_segment", "keep_alive", "word_timings", "turn_events", "diarize")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    RESUME_AFTER_SEQ_FIELD_NUMBER: _ClassVar[int]
    LAST_FINAL_SEGMENT_FIELD_NUMBER: _ClassVar[int]
    KEEP_ALIVE_FIELD_NUMBER: _ClassVar[int]
    WORD_TIMINGS_FIELD_NUMBER: _ClassVar[int]
    TURN_EVENTS_FIELD_NUMBER: _ClassVar[int]
    DIARIZE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    resume_after_seq: int
    last_final_segment: int
    keep_alive: bool
    word_timings: bool
    turn_events: bool
    diarize: bool
    def __init__(self, session_id: _Optional[str] = ..., resume_after_seq: _Optional[int] = ..., last_final_segment: _Optional[int] = ..., keep_alive: _Optional[bool] = ..., word_timings: _Optional[bool] = ..., turn_events: _Optional[bool] = ..., diarize: _Optional[bool] = ...) -> None: ...

class Transcript(_message.Message):
    __slots__ = ("segment_id", "committed_delta", "partial", "stability", "start_s", "end_s", "language", "is_final", "seed", "event_seq", "from_finalize", "word_confidence", "speaker")
    SEGMENT_ID_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_DELTA_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_FIELD_NUMBER: _ClassVar[int]
    STABILITY_FIELD_NUMBER: _ClassVar[int]
    START_S_FIELD_NUMBER: _ClassVar[int]
    END_S_FIELD_NUMBER: _ClassVar[int]
    LANGUAGE_FIELD_NUMBER: _ClassVar[int]
    IS_FINAL_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    EVENT_SEQ_FIELD_NUMBER: _ClassVar[int]
    FROM_FINALIZE_FIELD_NUMBER: _ClassVar[int]
    WORD_CONFIDENCE_FIELD_NUMBER: _ClassVar[int]
    SPEAKER_FIELD_NUMBER: _ClassVar[int]
    segment_id: int
    committed_delta: str
    partial: str
    stability: float
    start_s: float
    end_s: float
    language: str
    is_final: bool
    seed: SessionSeed
    event_seq: int
    from_finalize: bool
    word_confidence: _containers.RepeatedScalarFieldContainer[float]
    speaker: str
    def __init__(self, segment_id: _Optional[int] = ..., committed_delta: _Optional[str] = ..., partial: _Optional[str] = ..., stability: _Optional[float] = ..., start_s: _Optional[float] = ..., end_s: _Optional[float] = ..., language: _Optional[str] = ..., is_final: _Optional[bool] = ..., seed: _Optional[_Union[SessionSeed, _Mapping]] = ..., event_seq: _Optional[int] = ..., from_finalize: _Optional[bool] = ..., word_confidence: _Optional[_Iterable[float]] = ..., speaker: _Optional[str] = ...) -> None: ...

class SpeakerLabel(_message.Message):
    __slots__ = ("segment_id", "speaker", "event_seq")
    SEGMENT_ID_FIELD_NUMBER: _ClassVar[int]
    SPEAKER_FIELD_NUMBER: _ClassVar[int]
    EVENT_SEQ_FIELD_NUMBER: _ClassVar[int]
    segment_id: int
    speaker: str
    event_seq: int
    def __init__(self, segment_id: _Optional[int] = ..., speaker: _Optional[str] = ..., event_seq: _Optional[int] = ...) -> None: ...

class Turn(_message.Message):
    __slots__ = ("segment_id", "kind", "audio_s", "event_seq")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[Turn.Kind]
        SPEECH_STARTED: _ClassVar[Turn.Kind]
        UTTERANCE_END: _ClassVar[Turn.Kind]
    KIND_UNSPECIFIED: Turn.Kind
    SPEECH_STARTED: Turn.Kind
    UTTERANCE_END: Turn.Kind
    SEGMENT_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    AUDIO_S_FIELD_NUMBER: _ClassVar[int]
    EVENT_SEQ_FIELD_NUMBER: _ClassVar[int]
    segment_id: int
    kind: Turn.Kind
    audio_s: float
    event_seq: int
    def __init__(self, segment_id: _Optional[int] = ..., kind: _Optional[_Union[Turn.Kind, str]] = ..., audio_s: _Optional[float] = ..., event_seq: _Optional[int] = ...) -> None: ...

class WordTimings(_message.Message):
    __slots__ = ("segment_id", "words", "event_seq")
    SEGMENT_ID_FIELD_NUMBER: _ClassVar[int]
    WORDS_FIELD_NUMBER: _ClassVar[int]
    EVENT_SEQ_FIELD_NUMBER: _ClassVar[int]
    segment_id: int
    words: _containers.RepeatedCompositeFieldContainer[Word]
    event_seq: int
    def __init__(self, segment_id: _Optional[int] = ..., words: _Optional[_Iterable[_Union[Word, _Mapping]]] = ..., event_seq: _Optional[int] = ...) -> None: ...

class Word(_message.Message):
    __slots__ = ("text", "start_s", "end_s")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    START_S_FIELD_NUMBER: _ClassVar[int]
    END_S_FIELD_NUMBER: _ClassVar[int]
    text: str
    start_s: float
    end_s: float
    def __init__(self, text: _Optional[str] = ..., start_s: _Optional[float] = ..., end_s: _Optional[float] = ...) -> None: ...

class Ack(_message.Message):
    __slots__ = ("seq", "last_final_segment")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    LAST_FINAL_SEGMENT_FIELD_NUMBER: _ClassVar[int]
    seq: int
    last_final_segment: int
    def __init__(self, seq: _Optional[int] = ..., last_final_segment: _Optional[int] = ...) -> None: ...

class Error(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: str
    message: str
    def __init__(self, code: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...
