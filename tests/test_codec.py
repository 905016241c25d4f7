"""shared/codec: log-mel frames -> bytes -> frames within each mode's error bound, deterministic,
self-contained per payload, and a decoder that turns every malformed payload into CodecError."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harken.edge.features import log_mel_raw
from harken.shared import codec
from harken.shared.codec import (ERROR_BOUND_DB, MAX_FRAMES, MODES, CodecError, decode_frames, encode_frames,
                                 keepalive)
from harken.shared.features_spec import DYNAMIC_RANGE_LOG10, N_MELS, RunningMaxFloor, slaney_mel_filters
from harken.shared.fidelity import feature_error_db
from signals import concat, noisy, silence, speech, tone

PACKET = 20


@pytest.fixture(scope="module")
def features():
    """Floored raw log-mel of noisy speech with pauses: [128, T], plus the floor before each frame."""
    audio = noisy(concat(silence(0.3), speech("Seven bright kites drift over the harbour."), silence(0.4),
                         speech("Turn left at the second light.", voice="en-gb")), snr_db=25, seed=3)
    raw = log_mel_raw(audio)
    floor = RunningMaxFloor()
    frames = floor(raw)
    running = np.maximum.accumulate(raw.max(axis=0))
    return frames, running - DYNAMIC_RANGE_LOG10


def _round_trip(frames, floors, mode, packet=PACKET):
    out, sizes = np.empty_like(frames), []
    for a in range(0, frames.shape[1], packet):
        b = min(a + packet, frames.shape[1])
        payload = encode_frames(frames[:, a:b], mode, floor_log10=float(floors[a - 1]) if a else None)
        out[:, a:b] = decode_frames(payload)
        sizes.append(len(payload))
    return out, sizes


@pytest.mark.parametrize("mode", MODES)
def test_round_trip_within_mode_bound(features, mode):
    frames, floors = features
    decoded, _ = _round_trip(frames, floors, mode)
    assert decoded.dtype == np.float32 and decoded.shape == frames.shape
    err = feature_error_db(frames, decoded)
    assert err.rms_db <= ERROR_BOUND_DB[mode], err


def test_modes_trade_bits_for_error(features):
    frames, floors = features
    results = {m: _round_trip(frames, floors, m) for m in MODES}
    sizes = [sum(results[m][1]) for m in MODES]
    errors = [feature_error_db(frames, results[m][0]).rms_db for m in MODES]
    assert sizes[0] > sizes[1] > sizes[2]  # hifi, balanced, low
    assert errors[0] < errors[1] < errors[2]


@pytest.mark.parametrize("packet", [1, 7, 20, 50, 100])
def test_any_packet_length_round_trips(features, packet):
    frames, floors = features
    decoded, _ = _round_trip(frames[:, :150], floors, "balanced", packet)
    assert feature_error_db(frames[:, :150], decoded).rms_db <= ERROR_BOUND_DB["balanced"] * 1.5


def test_deterministic(features):
    frames, floors = features
    chunk = frames[:, 40:60]
    a = encode_frames(chunk, "balanced", float(floors[39]))
    b = encode_frames(np.array(chunk, order="F", copy=True), "balanced", float(floors[39]))
    assert a == b
    assert decode_frames(a).tobytes() == decode_frames(b).tobytes()


def test_deterministic_across_processes():
    # fresh interpreter: code tables and classes are rebuilt from scratch and must not differ
    import subprocess
    import sys

    script = ("import numpy as np; from harken.shared.codec import encode_frames; "
              "x = np.random.default_rng(7).normal(-4, 1, (128, 20)).astype(np.float32); "
              "print(encode_frames(x, 'hifi', -9.0).hex())")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    x = np.random.default_rng(7).normal(-4, 1, (128, 20)).astype(np.float32)
    assert out.strip() == encode_frames(x, "hifi", -9.0).hex()


def test_payloads_decode_alone_and_in_any_order(features):
    frames, floors = features
    payloads = [encode_frames(frames[:, a:a + PACKET], "balanced", float(floors[a - 1]) if a else None)
                for a in range(0, 100, PACKET)]
    forward = [decode_frames(p) for p in payloads]
    backward = [decode_frames(p) for p in reversed(payloads)][::-1]
    for f, b in zip(forward, backward):
        np.testing.assert_array_equal(f, b)


def test_values_at_the_floor_decode_to_the_floor():
    # a quiet tone after a loud one: most bins sit at the running-max floor
    audio = concat(tone(440, 0.3, 0.5), tone(3000, 0.3, 0.001), silence(0.2))
    frames = RunningMaxFloor()(log_mel_raw(audio))
    running = np.maximum.accumulate(frames.max(axis=0))
    floors = running - DYNAMIC_RANGE_LOG10
    at_floor = frames <= floors[None, :]
    assert at_floor.mean() > 0.3
    for mode in MODES:
        decoded, _ = _round_trip(frames, floors, mode)
        assert np.all(decoded >= floors[None, :] - 1e-6)  # never below the floor
        err = np.abs(decoded - frames)[at_floor]
        assert np.mean(err == 0) >= 0.99
        assert 10 * np.sqrt(np.mean(err**2)) <= 0.1 * ERROR_BOUND_DB[mode]


def test_floor_rising_inside_a_packet():
    rng = np.random.default_rng(1)
    frames = (rng.normal(-5, 0.3, (N_MELS, 20)) + np.linspace(0, 3, 20)[None, :]).astype(np.float32)
    frames = RunningMaxFloor(float(frames[:, 0].max()))(frames)
    decoded = decode_frames(encode_frames(frames, "hifi", float(frames[:, 0].max()) - DYNAMIC_RANGE_LOG10))
    assert feature_error_db(frames, decoded).rms_db <= ERROR_BOUND_DB["hifi"] * 1.5


def test_zero_frames_is_a_tiny_keepalive():
    empty = np.zeros((N_MELS, 0), dtype=np.float32)
    payload = encode_frames(empty)
    assert payload == keepalive() and len(payload) <= 4
    assert decode_frames(payload).shape == (N_MELS, 0)


@pytest.mark.parametrize("mode", MODES)
def test_single_frame(features, mode):
    frames, floors = features
    frame = frames[:, 50:51]
    decoded = decode_frames(encode_frames(frame, mode, float(floors[49])))
    assert decoded.shape == (N_MELS, 1)
    assert feature_error_db(frame, decoded).rms_db <= ERROR_BOUND_DB[mode] * 1.5


@pytest.mark.parametrize("value", [-10.0, -4.0, 0.0, 3.0])
def test_constant_frames_round_trip(value):
    frames = np.full((N_MELS, PACKET), value, dtype=np.float32)
    for mode in MODES:
        decoded = decode_frames(encode_frames(frames, mode, floor_log10=value - DYNAMIC_RANGE_LOG10))
        assert feature_error_db(frames, decoded).rms_db <= ERROR_BOUND_DB[mode]


@pytest.mark.parametrize("floor", [-10.0, -4.5])
def test_frames_all_at_the_floor_cost_only_a_header(floor):
    frames = np.full((N_MELS, PACKET), floor, dtype=np.float32)
    for mode in MODES:
        payload = encode_frames(frames, mode, floor_log10=floor)
        assert len(payload) <= 12
        np.testing.assert_array_equal(decode_frames(payload), frames)


def test_extreme_values_round_trip():
    rng = np.random.default_rng(2)
    frames = np.where(rng.random((N_MELS, PACKET)) < 0.5, -10.0, 3.0).astype(np.float32)
    for mode in MODES:
        decoded = decode_frames(encode_frames(frames, mode))
        assert np.all(np.isfinite(decoded)) and decoded.min() >= -10.0
        # a random +-6.5 pattern is the worst case for a transform codec; it must still be close
        assert feature_error_db(frames, decoded).rms_db <= 4 * ERROR_BOUND_DB[mode]


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf, 1e6])
def test_non_finite_or_absurd_input_is_rejected(bad):
    frames = np.zeros((N_MELS, 4), dtype=np.float32)
    frames[5, 2] = bad
    with pytest.raises(CodecError):
        encode_frames(frames)


def test_bad_arguments_are_rejected():
    with pytest.raises(CodecError):
        encode_frames(np.zeros((N_MELS, 4), dtype=np.float32), mode="ultra")
    with pytest.raises(CodecError):
        encode_frames(np.zeros((80, 4), dtype=np.float32))
    with pytest.raises(CodecError):
        encode_frames(np.zeros((N_MELS, MAX_FRAMES + 1), dtype=np.float32))
    with pytest.raises(CodecError):
        encode_frames(np.zeros((N_MELS, 4), dtype=np.float32), floor_log10=float("nan"))
    with pytest.raises(CodecError):
        decode_frames("not bytes")


def test_mel_filters_match_transformers():
    from transformers.audio_utils import mel_filter_bank

    ref = mel_filter_bank(201, 128, 0.0, 8000.0, 16000, norm="slaney", mel_scale="slaney")
    ours = slaney_mel_filters()
    np.testing.assert_allclose(ours, ref, rtol=1e-9, atol=1e-12)
    assert np.array_equal(ours > 0, ref > 0)


def test_mel_blocks_cover_the_basis():
    assert sum(codec._MEL_BLOCKS) == len(codec.mel_layout().basis) == N_MELS - len(codec.mel_layout().dependent)
    t = codec.mel_transform()
    np.testing.assert_allclose(t @ t.T, np.eye(t.shape[0]), atol=1e-12)


def test_dependent_bins_follow_from_the_basis(features):
    frames, _ = features
    raw = frames.astype(np.float64)
    layout = codec.mel_layout()
    above = raw > raw.min(axis=0)[None, :]
    unfloored = above[layout.dependent] & above[layout.source_a] & above[layout.source_b]
    pred = codec.predict_dependent(raw, layout)
    assert np.abs(pred - raw[layout.dependent])[unfloored].max() < 1e-3


# ------------------------------------------------------------------------------ decoder fuzzing


@pytest.fixture(scope="module")
def valid_payloads(features):
    frames, floors = features
    return [encode_frames(frames[:, 30:30 + n], mode, float(floors[29]))
            for mode, n in [("hifi", 20), ("balanced", 20), ("low", 35), ("balanced", 1)]]


def _decode_or_codec_error(payload: bytes):
    """The only acceptable outcomes: a CodecError, or frames of the claimed shape."""
    try:
        out = decode_frames(payload)
    except CodecError:
        return None
    assert out.dtype == np.float32 and out.ndim == 2 and out.shape[0] == N_MELS
    assert np.all(np.isfinite(out))
    return out


_fuzz = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@_fuzz
@given(data=st.data())
def test_truncated_payloads_raise(valid_payloads, data):
    payload = data.draw(st.sampled_from(valid_payloads))
    cut = data.draw(st.integers(0, len(payload) - 1))
    with pytest.raises(CodecError):
        decode_frames(payload[:cut])


@_fuzz
@given(data=st.data())
def test_bit_flipped_payloads(valid_payloads, data):
    payload = bytearray(data.draw(st.sampled_from(valid_payloads)))
    for _ in range(data.draw(st.integers(1, 8))):
        bit = data.draw(st.integers(0, 8 * len(payload) - 1))
        payload[bit // 8] ^= 1 << (bit % 8)
    _decode_or_codec_error(bytes(payload))


@_fuzz
@given(st.binary(max_size=3000))
def test_random_bytes(payload):
    _decode_or_codec_error(payload)


@_fuzz
@given(data=st.data())
def test_random_bodies_behind_a_valid_header(valid_payloads, data):
    payload = data.draw(st.sampled_from(valid_payloads))
    header_len = codec.PacketHeader.parse(payload)[1]
    body = data.draw(st.binary(min_size=0, max_size=2 * len(payload)))
    out = _decode_or_codec_error(payload[:header_len] + body)
    if out is not None:
        assert out.shape[1] == codec.PacketHeader.parse(payload)[0].n_frames


@_fuzz
@given(claimed=st.integers(MAX_FRAMES + 1, 16383) | st.integers(1, MAX_FRAMES), data=st.data())
def test_oversized_frame_counts(valid_payloads, claimed, data):
    payload = data.draw(st.sampled_from(valid_payloads))
    header = codec.PacketHeader.parse(payload)[0]
    # re-serialise with a different claimed count; the body stays the small original one
    forged = codec.PacketHeader(header.mode, claimed, np.full(claimed, header.floors[0]), header.shift,
                                header.residual_class).serialize()
    out = _decode_or_codec_error(forged + payload[codec.PacketHeader.parse(payload)[1]:])
    if out is not None:
        assert out.shape == (N_MELS, claimed)
    if claimed > MAX_FRAMES:
        assert out is None


@pytest.mark.parametrize("version", [0, 2, 15])
def test_wrong_version_raises(valid_payloads, version):
    payload = bytearray(valid_payloads[1])
    payload[1] = version << 4 | (payload[1] & 0x0F)
    with pytest.raises(CodecError, match="version"):
        decode_frames(bytes(payload))


def test_wrong_magic_and_mode_raise(valid_payloads):
    payload = bytearray(valid_payloads[1])
    with pytest.raises(CodecError):
        decode_frames(b"\x00" + bytes(payload[1:]))
    payload[1] = (payload[1] & 0xF0) | 9
    with pytest.raises(CodecError):
        decode_frames(bytes(payload))
    with pytest.raises(CodecError):
        decode_frames(keepalive() + b"\x00")


def test_trailing_bytes_raise(valid_payloads):
    with pytest.raises(CodecError):
        decode_frames(valid_payloads[1] + b"\x00")
    header_len = codec.PacketHeader.parse(valid_payloads[3])[1]
    with pytest.raises(CodecError):
        decode_frames(valid_payloads[3][:header_len] + bytes(400))
