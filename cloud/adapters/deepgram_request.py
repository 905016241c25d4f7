"""What a Deepgram /v1/listen request carries, read for cloud/adapters/deepgram_api.py: its query
parameters (`ListenParams`: what harken honours, the rest accepted and ignored), its credentials
(`deepgram_metadata`: Deepgram's `Token` scheme and the browser's `token` subprotocol, as harken's
Bearer metadata) and its audio (`AudioDecoder`: linear16, mu-law or A-law at any rate, interleaved
channels, or a WAV stream, from frames split anywhere; `decode_file` for a pre-recorded body).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from ...shared.errors import HarkenError
from ...shared.features_spec import SAMPLE_RATE
from ...shared.protocol import model_context
from ...edge.audio import load_audio, peak_normalize
from ..model.prompt import forced_language

ENCODINGS = ("linear16", "mulaw", "alaw")
MAX_CHANNELS = 8


class ParamError(Exception):
    """A query parameter harken cannot take: HTTP 400 with a `dg-error` header."""


def _flag(query: Mapping[str, str], name: str, default: bool) -> bool:
    value = query.get(name)
    if value is None or value == "":
        return default
    v = value.strip().lower()
    if v in ("true", "1"):
        return True
    if v in ("false", "0"):
        return False
    raise ParamError(f"{name} must be true or false, not {value[:40]!r}")


def _int(query: Mapping[str, str], name: str, lo: int, hi: int) -> int | None:
    value = query.get(name)
    if value is None or value == "":
        return None
    try:
        n = int(value)
    except ValueError:
        raise ParamError(f"{name} must be an integer, not {value[:40]!r}") from None
    if not lo <= n <= hi:
        raise ParamError(f"{name} must be {lo}..{hi}, got {n}")
    return n


@dataclass(frozen=True)
class ListenParams:
    """The query of one /v1/listen request, as far as harken honours it."""

    encoding: str | None = None  # None: a container (WAV on a live socket; any file harken reads for POST)
    sample_rate: int | None = None
    channels: int = 1
    multichannel: bool = False
    language: str | None = None  # harken's forced language; None: detect
    interim_results: bool = False
    endpointing: bool = True  # `endpointing=false`: no speech_final
    utterance_end: bool = False  # `utterance_end_ms` set
    vad_events: bool = False
    keyterms: tuple[str, ...] = ()
    diarize: bool = False  # words[].speaker (0, 1, ...: harken's S1, S2, ...)

    @classmethod
    def parse(cls, query) -> ListenParams:
        """`query`: the request's (multi)dict. Unknown parameters are accepted and ignored."""

        encoding = (query.get("encoding") or "").strip().lower() or None
        if encoding is not None and encoding not in ENCODINGS:
            raise ParamError(f"encoding {encoding[:40]!r} is not supported; use one of {', '.join(ENCODINGS)}, "
                             "or none for a container")
        rate = _int(query, "sample_rate", 8_000, 48_000)
        if encoding is not None and rate is None:
            raise ParamError("sample_rate is required with encoding")
        channels = _int(query, "channels", 1, MAX_CHANNELS) or 1
        language = (query.get("language") or "").strip()
        if language.lower() in ("", "multi"):
            forced = None
        else:
            try:
                forced = forced_language(language.split("-")[0])
            except HarkenError as e:
                raise ParamError(f"language {language[:40]!r}: {e}") from None
        endpointing = query.get("endpointing")
        getall = getattr(query, "getall", None)
        keyterms = tuple(getall("keyterm", ())) if getall is not None else tuple(
            [query["keyterm"]] if query.get("keyterm") else [])
        return cls(encoding=encoding, sample_rate=rate, channels=channels,
                   multichannel=_flag(query, "multichannel", False), language=forced,
                   interim_results=_flag(query, "interim_results", False),
                   endpointing=(endpointing or "").strip().lower() != "false",
                   utterance_end=bool(_int(query, "utterance_end_ms", 0, 60_000)),
                   vad_events=_flag(query, "vad_events", False), keyterms=keyterms,
                   diarize=_flag(query, "diarize", False))

    @property
    def context(self) -> str:
        """Keyterms as Qwen3-ASR's context (the system turn the model reads before the audio)."""
        return model_context("", self.keyterms)

    @property
    def streams(self) -> int:
        return self.channels if self.multichannel else 1


def deepgram_metadata(headers) -> tuple[tuple, bool]:
    """An HTTP request's credentials as harken's call metadata (`Authorization: Bearer KEY`), from
    `Authorization: Token KEY` or `Bearer KEY` (any case) or a browser's `Sec-WebSocket-Protocol:
    token, KEY`; and whether the key came as a subprotocol (the answer then selects `token`)."""
    auth = headers.get("Authorization")
    if auth:
        scheme, _, key = auth.strip().partition(" ")
        if scheme.lower() in ("token", "bearer") and key.strip():
            return (("authorization", f"Bearer {key.strip()}"),), False
        return (("authorization", auth),), False
    protocols = [p.strip() for p in (headers.get("Sec-WebSocket-Protocol") or "").split(",")]
    if len(protocols) >= 2 and protocols[0].lower() == "token" and protocols[1]:
        return (("authorization", f"Bearer {protocols[1]}"),), True
    return (), False


# ---- audio --------------------------------------------------------------------------------------

def _mulaw_table() -> np.ndarray:
    u = ~np.arange(256, dtype=np.uint8)
    sign, exponent, mantissa = u & 0x80, (u >> 4) & 0x07, u & 0x0F
    magnitude = ((mantissa.astype(np.int32) << 3) + 0x84) << exponent
    return np.where(sign, 0x84 - magnitude, magnitude - 0x84).astype(np.int16)


def _alaw_table() -> np.ndarray:
    a = np.arange(256, dtype=np.uint8) ^ 0x55
    sign, exponent, mantissa = a & 0x80, (a >> 4) & 0x07, (a & 0x0F).astype(np.int32)
    magnitude = np.where(exponent == 0, (mantissa << 4) + 8, ((mantissa << 4) + 0x108) << (exponent - 1))
    return np.where(sign, magnitude, -magnitude).astype(np.int16)


G711 = {"mulaw": _mulaw_table(), "alaw": _alaw_table()}


class AudioDecoder:
    """Binary frames of one connection -> int16 samples per harken stream. Frames may split a
    sample or a channel frame anywhere; a WAV header (no `encoding`) is read from the first bytes."""

    def __init__(self, params: ListenParams):
        self.params = params
        self.encoding, self.rate, self.channels = params.encoding, params.sample_rate, params.channels
        self.pending = b""
        self.header = params.encoding is None  # a container's header still to read
        self.bytes_in = 0
        self.samples = 0  # per channel

    def feed(self, data: bytes) -> list[np.ndarray]:
        """Raises HarkenError for audio that cannot be decoded."""
        self.bytes_in += len(data)
        self.pending += data
        if self.header:
            if not self._read_header():
                return []
        width = 2 if self.encoding == "linear16" else 1
        frame = width * self.channels
        n = len(self.pending) // frame * frame
        raw, self.pending = self.pending[:n], self.pending[n:]
        if self.encoding == "linear16":
            x = np.frombuffer(raw, dtype="<i2")
        else:
            x = G711[str(self.encoding)][np.frombuffer(raw, dtype=np.uint8)]
        x = x.reshape(-1, self.channels)
        self.samples += x.shape[0]
        if self.params.multichannel:
            return [np.ascontiguousarray(x[:, c]) for c in range(self.channels)]
        if self.channels == 1:
            return [x[:, 0]]
        return [np.round(x.astype(np.float32).mean(axis=1)).astype(np.int16)]

    def _read_header(self) -> bool:
        """A WAV stream's header: True once read (the samples follow), False while more bytes are due."""
        b = self.pending
        if len(b) < 12:
            return False
        if b[:4] != b"RIFF" or b[8:12] != b"WAVE":
            raise HarkenError("the audio has no encoding parameter and is not a WAV stream: send "
                              "encoding=linear16|mulaw|alaw with sample_rate, or a WAV stream")
        i = 12
        while i + 8 <= len(b):
            kind, size = b[i:i + 4], int.from_bytes(b[i + 4:i + 8], "little")
            if kind == b"data":
                self.pending, self.header = b[i + 8:], False
                if self.encoding is None:
                    raise HarkenError("a WAV stream's data came before its fmt chunk")
                return True
            if i + 8 + size > len(b):
                return False
            if kind == b"fmt ":
                fmt, channels, rate, _, _, bits = np.frombuffer(b[i + 8:i + 24], dtype="<u2,<u2,<u4,<u4,<u2,<u2")[0]
                kinds = {(1, 16): "linear16", (7, 8): "mulaw", (6, 8): "alaw"}
                if (int(fmt), int(bits)) not in kinds or not 1 <= channels <= MAX_CHANNELS or not 8000 <= rate <= 48000:
                    raise HarkenError("a WAV stream must be PCM16, mu-law or A-law, 1..8 channels, 8..48 kHz")
                self.encoding, self.channels, self.rate = kinds[(int(fmt), int(bits))], int(channels), int(rate)
            i += 8 + size + (size & 1)
        return False


def decode_file(body: bytes, params: ListenParams) -> list[np.ndarray]:
    """A pre-recorded request's audio -> 16 kHz mono float32 per harken stream (peak-normalised as
    files are)."""
    import tempfile


    if params.encoding is not None:
        decoder = AudioDecoder(params)
        parts = decoder.feed(body)
        return [peak_normalize(_resample(p.astype(np.float32) / 32768.0, decoder.rate or SAMPLE_RATE)) for p in parts]
    with tempfile.NamedTemporaryFile(prefix="harken-listen-") as f:
        f.write(body)
        f.flush()
        try:
            return [peak_normalize(load_audio(f.name))]
        except HarkenError as e:
            raise HarkenError(str(e).replace(f.name, "the audio")) from None


def _resample(x: np.ndarray, rate: int) -> np.ndarray:
    if rate == SAMPLE_RATE:
        return x
    import soxr

    return soxr.resample(x, rate, SAMPLE_RATE, quality="VHQ").astype(np.float32)
