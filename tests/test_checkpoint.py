"""shared/front_end_checkpoint: the front-end state's wire format. What a checkpoint restores is tested with the
pipeline that makes and resumes it (test_pipeline.py) and through the server (test_server_transcripts.py,
test_transport_restarts.py)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from harken.shared.front_end_checkpoint import SIZE, FrontEndCheckpoint


def checkpoint(**kw) -> FrontEndCheckpoint:
    rng = np.random.default_rng(0)
    fields = dict(sample=25_600, replay_from=23_040, vad_state=rng.standard_normal((2, 1, 128)).astype(np.float32),
                  vad_context=rng.uniform(-1, 1, 64).astype(np.float32), last_end_sample=20_000,
                  next_segment_id=3, last_end_frame=125, running_max_log10=1.25, settings=0xDEADBEEF)
    return FrontEndCheckpoint(**{**fields, **kw})


def test_round_trip_is_exact():
    for c in (checkpoint(), checkpoint(running_max_log10=float("-inf"), sample=0, replay_from=0,
                                       last_end_sample=0, next_segment_id=0, last_end_frame=0)):
        data = c.serialize()
        assert len(data) == SIZE
        back = FrontEndCheckpoint.parse(data)
        for f in dataclasses.fields(FrontEndCheckpoint):
            assert np.array_equal(getattr(back, f.name), getattr(c, f.name)), f.name
        assert back.serialize() == data


def test_every_corruption_is_refused():
    """Any one byte changed, any truncation or extension: a ValueError, never another state."""
    data = checkpoint().serialize()
    for i in range(len(data)):
        bad = bytearray(data)
        bad[i] ^= 0x41
        with pytest.raises(ValueError):
            FrontEndCheckpoint.parse(bytes(bad))
    for n in (0, 1, SIZE - 1, SIZE + 1):
        with pytest.raises(ValueError, match="truncated"):
            FrontEndCheckpoint.parse((data * 2)[:n])


@pytest.mark.parametrize("change, message", [
    (dict(replay_from=30_000), "positions out of range"),
    (dict(last_end_sample=-1), "positions out of range"),
    (dict(running_max_log10=float("nan")), "not a log10-mel value"),
    (dict(running_max_log10=1e9), "not a log10-mel value"),
    (dict(vad_context=np.full(64, np.inf, np.float32)), "NaN or infinite"),
])
def test_values_a_pipeline_cannot_have_are_refused(change, message):
    with pytest.raises(ValueError, match=message):
        FrontEndCheckpoint.parse(checkpoint(**change).serialize())
