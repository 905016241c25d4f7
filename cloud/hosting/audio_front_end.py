"""The thin clients' front end on the server: PCM at any rate -> the edge's VAD + log-mel + codec ->
the `FeaturePacket`s a Features client would have sent, with checkpoints for exact replay.

This is where the cloud runs edge code (edge/pipeline.py, loaded on first use: thin clients only),
and the one place it does so: `ThinClientFrontEnd` and `check_seeded_front_end`."""

from __future__ import annotations

import numpy as np

from ...shared.front_end_checkpoint import FrontEndCheckpoint
from ...shared.features_spec import SAMPLE_RATE
from ...shared.protocol import FeaturePacket
from ...edge.pipeline import check_resumable
from ...edge.pipeline import CHECKPOINT_SAMPLES, FeatureStream


class ThinClientFrontEnd:
    """Thin clients: PCM at any rate -> the edge's FeatureStream (VAD + features + codec) ->
    `FeaturePacket`s, exactly what a Features client would send. Runs in the executor.

    At 16 kHz it also checkpoints the stream (shared/front_end_checkpoint.py) at every point of the checkpoint
    grid where one can be taken (the audio is pushed in pieces that end there; what the stream sends
    does not depend on how its input is cut), for the seeds of final events; `resume` starts from
    one. Resampled audio gets none: the resampler's state is in no checkpoint, and a client would
    replay audio at its own rate."""

    def __init__(self, sample_rate: int, running_max_log10: float, first_segment_id: int,
                 resume: FrontEndCheckpoint | None = None):

        self.sample_rate = sample_rate
        self.grid = CHECKPOINT_SAMPLES
        self.checkpoints_at_start: list[FrontEndCheckpoint] = []
        if resume is not None:
            self.stream = FeatureStream.resume(resume)
            self.checkpoints_at_start.append(resume)
        else:
            self.stream = FeatureStream(running_max_log10=running_max_log10, first_segment_id=first_segment_id)
            if sample_rate == SAMPLE_RATE:
                self.checkpoints_at_start.append(self._checkpoint())
        self.resampler = None
        if sample_rate != SAMPLE_RATE:
            import soxr

            self.resampler = soxr.ResampleStream(sample_rate, SAMPLE_RATE, 1, dtype="float32", quality="VHQ")

    def push(self, samples: np.ndarray) -> tuple[list[FeaturePacket], list[FrontEndCheckpoint]]:
        """The packets `samples` complete, and the checkpoints taken on the way."""
        if self.resampler is not None:
            return self.stream.push(self.resampler.resample_chunk(samples)), []
        packets, checkpoints, i = [], [], 0
        while i < samples.size:
            j = min(samples.size, i + self.grid - self.stream.samples % self.grid)
            packets += self.stream.push(samples[i:j])
            i = j
            if (c := self.stream.checkpoint()) is not None:
                checkpoints.append(c)
        return packets, checkpoints

    def _checkpoint(self) -> FrontEndCheckpoint:
        c = self.stream.checkpoint()
        assert c is not None, "a new stream is idle at sample 0"
        return c

    def finalize(self) -> list[FeaturePacket]:
        """The client's Finalize: the open segment ends at the audio pushed so far
        (`FeatureStream.finalize`); speech that goes on is the next segment."""
        return self.stream.finalize()

    def flush(self) -> list[FeaturePacket]:
        packets = []
        if self.resampler is not None:
            packets += self.stream.push(self.resampler.resample_chunk(np.zeros(0, np.float32), last=True))
        return packets + self.stream.flush()

    @property
    def running_max_log10(self) -> float:
        return self.stream.floor.max_log10


def check_seeded_front_end(checkpoint: FrontEndCheckpoint) -> None:
    """ValueError unless this server's front end can resume `checkpoint` (a thin client's seeded
    `front_end_state`: made by a front end with the same VAD options, codec mode and packet size, at
    a point of the checkpoint grid). The server's wire parsing calls it (`shared/wire.py`)."""

    check_resumable(checkpoint)
