"""A front end's checkpoint: the whole state of a `FeatureStream` at a quiet point, as bytes.

A thin client's server runs the edge pipeline (VAD + log-mel + codec) on the client's audio. When
the server is lost (restart, expiry), a replacement session must segment the rest of the audio as
the lost one would have. That needs the pipeline's state, not a fresh pipeline: silero-vad's LSTM
remembers seconds of audio (in noise, a fresh one ends the next segment elsewhere), and the
running max, the previous segment's end and the segment count all carry over. So the server
checkpoints its pipeline where that state is small (edge/pipeline.py `FeatureStream.checkpoint`):
on a grid of `CHECKPOINT_SAMPLES`, while no segment is open or undecided. The checkpoint travels
to the client inside the session seed (proto `SessionSeed.front_end_state`), opaque to it; the
client keeps its audio from `replay_from` on, and a replacement session resumes the pipeline from
the checkpoint (`FeatureStream.resume`) and is fed that audio: everything it sends is what the
lost session would have sent, by construction.

What is in it, and what is not: silero-vad's recurrent state and context (the model's memory),
the segmenter's position, the previous segment's end and the next segment id, the floor's running
max. Not the log-mel frames the pipeline keeps for a segment that may start up to `speech_pad_ms`
before the checkpoint: the client replays the audio from `replay_from` (a little before the
checkpoint), and the resumed pipeline computes those frames again, bit for bit (the streaming
log-mel does not depend on how its input is cut).

The format is versioned, fixed-size (1,341 bytes) and checked (CRC32C): anything else is a
`ValueError` saying what is wrong, never a wrong state.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import numpy as np

from .integrity import payload_crc32c

MAGIC = b"HKFE"
VERSION = 1
VAD_STATE_SHAPE = (2, 1, 128)  # silero-vad's LSTM (h, c), edge/vad.py STATE_SHAPE
VAD_CONTEXT_SAMPLES = 64  # edge/vad.py CONTEXT_SAMPLES
MAX_SAMPLE = 1 << 50  # ~2,000 years at 16 kHz: bounds the arithmetic, rejects garbage
# magic, version, sample, replay_from, last_end_sample, next_segment_id, last_end_frame, running max, settings
_HEADER = struct.Struct("<4sBqqqqqdI")
_FLOATS = math.prod(VAD_STATE_SHAPE) + VAD_CONTEXT_SAMPLES
SIZE = _HEADER.size + 4 * _FLOATS + 4  # + the CRC32C of everything before it


@dataclass(frozen=True, eq=False)
class FrontEndCheckpoint:
    """A `FeatureStream` at a quiet point (edge/pipeline.py makes and resumes it). Positions count
    samples (16 kHz) and frames (100 a second) from the start of the stream."""

    sample: int  # the state is the stream's after this many samples (on the checkpoint grid)
    replay_from: int  # a resumed stream is fed the stream's audio from this sample on
    vad_state: np.ndarray  # float32 [2, 1, 128]: silero-vad's LSTM state after `sample`
    vad_context: np.ndarray  # float32 [64]: the samples just before `sample` (the next window's context)
    last_end_sample: int  # the previous segment's padded end: the next one starts no earlier
    next_segment_id: int  # the id the next segment gets
    last_end_frame: int  # the previous segment's end on the frame grid
    running_max_log10: float  # the floor's running max before the first frame computed again
    settings: int  # digest of the settings of the stream that made it (VAD options, codec, packet size)

    def serialize(self) -> bytes:
        floats = np.concatenate([np.asarray(self.vad_state, np.float32).reshape(-1),
                                 np.asarray(self.vad_context, np.float32).reshape(-1)])
        body = _HEADER.pack(MAGIC, VERSION, self.sample, self.replay_from, self.last_end_sample,
                            self.next_segment_id, self.last_end_frame, self.running_max_log10,
                            self.settings) + floats.astype("<f4").tobytes()
        return body + struct.pack("<I", payload_crc32c(body))

    @classmethod
    def parse(cls, data: bytes) -> FrontEndCheckpoint:
        """The checkpoint `serialize` wrote; ValueError for anything else."""
        data = bytes(data)
        if len(data) != SIZE:
            raise ValueError(f"{len(data)} bytes, not the {SIZE} of a harken front-end state (truncated?)")
        if data[:4] != MAGIC:
            raise ValueError("not a harken front-end state")
        (crc,) = struct.unpack("<I", data[-4:])
        if payload_crc32c(data[:-4]) != crc:
            raise ValueError("corrupted (its CRC32C does not match)")
        magic, version, sample, replay_from, last_end_sample, next_segment_id, last_end_frame, running_max, \
            settings = _HEADER.unpack_from(data)
        if version != VERSION:
            raise ValueError(f"version {version} is not supported (this server reads version {VERSION})")
        floats = np.frombuffer(data, "<f4", count=_FLOATS, offset=_HEADER.size).astype(np.float32)
        if not (0 <= replay_from <= sample < MAX_SAMPLE and 0 <= last_end_sample <= sample
                and 0 <= next_segment_id < 1 << 32 and 0 <= last_end_frame <= MAX_SAMPLE):
            raise ValueError("positions out of range")
        if not (math.isfinite(running_max) and abs(running_max) <= 100 or running_max == -math.inf):
            raise ValueError("running_max_log10 is not a log10-mel value")
        if not np.all(np.isfinite(floats)):
            raise ValueError("the VAD state holds NaN or infinite values")
        n = math.prod(VAD_STATE_SHAPE)
        return cls(sample=sample, replay_from=replay_from, vad_state=floats[:n].reshape(VAD_STATE_SHAPE),
                   vad_context=floats[n:], last_end_sample=last_end_sample, next_segment_id=next_segment_id,
                   last_end_frame=last_end_frame, running_max_log10=running_max, settings=settings)
