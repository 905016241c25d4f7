"""Log-mel feature frames -> compact bytes -> frames: the payload of every `Features` message.

The edge sends raw log10-mel frames, already floored at (running max - 8). Each payload decodes on
its own (packets are resent after a reconnect and replayed into a restarted server), so all
prediction stays inside one packet.

How a packet [128, k] becomes bytes:

1. **Mel layout.** Below ~1 kHz the 128 slaney mel filters are narrower than the 40 Hz FFT bins:
   21 mel bins are a fixed mix of FFT bins that other mel bins already carry alone, so
   `x[m] = log10(r1 * 10**x[b1] + r2 * 10**x[b2])` exactly. Those are predicted, not coded; only
   the 107 "basis" bins are transformed (a nonzero residual is sent only when flooring broke the
   identity).
2. **Transform.** The basis bins go through an orthonormal block DCT across mel (blocks of 16,
   16, 32 and 43 bins, see `_MEL_BLOCKS`) and a DCT across time in blocks of at most 32 frames:
   the prediction across time (a packet of 20 frames is one block; its first frame needs nothing
   from earlier packets).
3. **Quantisation.** One step per mode, with dead zones that widen where a class is sparse
   (`ModeParams.rd_lambda`): that is what trades rate for the RMS error the fidelity metric counts.
4. **Entropy coding** (shared/entropy.py). Each coefficient's class, its expected magnitude, is a
   fixed integer prior per mode over (mel band, time-frequency band) plus one per-packet shift
   that the encoder picks to minimise the bits; each class has a static canonical Huffman code
   over tuples of levels. Encoding is vectorised in numpy; decoding walks the bits in Python (in the cloud).
5. **Floor.** The header carries every frame's floor exactly (the running max - 8 can rise inside
   a packet). The encoder sinks values at the floor a step below it; the decoder clamps at the
   floor, so they come back exactly at the floor. A packet entirely at the floor is a header.

Wire format, version 1 (a varint is 7 bits per byte, low first, at most 2 bytes here):

    magic            u8     0xA7
    version | mode   u8     high nibble version; low nibble 0 = keep-alive (no frames),
                            1 hifi, 2 balanced, 3 low
    frames k         varint 0 only with mode 0, else 1..MAX_FRAMES; a keep-alive ends here
    floor            f32 le clamp value of frame 0
    n_floor_changes  varint then n x (varint frames since the previous change, f32 le new clamp)
    shift | flags    u8     low 6 bits: class shift + 32; bit 7: dependent-bin residuals follow;
                            bit 6 (shift 0, no residuals): every value is at its floor, no body
    residual class   u8     only with bit 7: the class all residuals are coded in
    body             entropy-coded bits, MSB first, zero-padded to a byte
"""

from __future__ import annotations


import struct
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from .entropy import (N_CLASSES, class_bit_costs, decode_levels,
                                    encode_symbols, min_body_bits)
from .errors import CodecError
from .mel_layout import LN10, MelLayout, mel_layout, predict_dependent  # noqa: F401  (the codec's names for them)
from .features_spec import DYNAMIC_RANGE_LOG10, N_FFT, N_MELS, SAMPLE_RATE

MODES = ("hifi", "balanced", "low")
CODEC_NAME = "harken-mel/1"  # proto `Start.codec` for payloads of this module, wire format v1
DEFAULT_MODE = "balanced"
MAGIC = 0xA7
VERSION = 1
MAX_FRAMES = 6000  # 60 s per payload: far above any packet, small enough to bound allocations
# The smallest payload with frames is a 9-byte header (every value at its floor, no body), whatever
# its frame count, and the entropy coder's all-zero flags make a body of 1-2 bytes for thousands of
# frames: so the format alone lets 10 bytes claim MAX_FRAMES frames, a minute of audio for a server
# to queue and encode. The wire takes at most this many frames per payload byte: an edge packet
# (20 frames, 9 bytes at the least, about 30 bytes a frame in speech) is 3.6x inside it.
MAX_FRAMES_PER_PAYLOAD_BYTE = 8
MIN_FRAMES_PAYLOAD_BYTES = 9  # magic, version|mode, 1-byte frame count, floor f32, 0 changes, flags
MAX_PACKET_FRAMES = MIN_FRAMES_PAYLOAD_BYTES * MAX_FRAMES_PER_PAYLOAD_BYTE  # always within the bound
MAX_TIME_BLOCK = 32  # frames per time-DCT block
VALUE_LIMIT = 100.0  # |log10 mel| beyond this is not a log-mel (1e-100 .. 1e100)
FLOOR_MARGIN = 1.0  # steps by which the encoder sinks values at the floor (see encode_frames)

_F32 = struct.Struct("<f")


@dataclass(frozen=True)
class ModeParams:
    """Quantiser of one mode.

    step: in log10 units. rd_lambda: the rate-distortion trade-off; a value rounds up only if the
    squared error it saves (in steps) exceeds 2 * rd_lambda times the bits it costs under its class
    model, so sparse classes get wide dead zones and busy ones near-plain rounding."""

    step: float
    rd_lambda: float


# balanced: step 0.38 since 2026-12-01 (0.327 before: 25.6 kbps during speech on the sample, 26.0 on
# 100 held-out utterances, 0.99 dB), for 23.1 / 23.5 kbps at 1.16 dB, under issue 26's 24 kbps.
# Raising the step buys rate more cheaply than widening the dead zones (rd_lambda 0.15 at step
# 0.327: 23.1 kbps at 1.20 dB). synth-en on those 100 utterances, offline on the decoded frames:
# 15.1% WER without the codec, 14.6% at 0.327, 16.0% at 0.38, 16.4% at 0.45 (docs/benchmarks.md).
_MODE_PARAMS = {
    "hifi": ModeParams(step=0.10, rd_lambda=0.06),
    "balanced": ModeParams(step=0.38, rd_lambda=0.06),
    "low": ModeParams(step=0.68, rd_lambda=0.1),
}
_MODE_IDS = {name: i + 1 for i, name in enumerate(MODES)}
# RMS error (dB, fidelity.feature_error_db) each mode stays under on noisy speech, with headroom
# over what the bench measures (README): the tests hold the codec to these.
ERROR_BOUND_DB = {"hifi": 0.33, "balanced": 1.28, "low": 2.6}


# ------------------------------------------------------------------------------------ transforms


@lru_cache(maxsize=64)
def _dct_matrix(n: int) -> np.ndarray:
    """[n, n] orthonormal DCT-II: coefficients = D @ x."""
    k = np.arange(n)[:, None]
    i = np.arange(n)[None, :]
    d = np.cos(np.pi * (i + 0.5) * k / n) * np.sqrt(2.0 / n)
    d[0] /= np.sqrt(2.0)
    return d


def time_blocks(k: int) -> list[tuple[int, int]]:
    """Split k frames into near-equal blocks of at most MAX_TIME_BLOCK: [(start, length)]."""
    k = int(k)
    n = -(-k // MAX_TIME_BLOCK)
    edges = [i * k // n for i in range(n + 1)]
    return [(edges[i], edges[i + 1] - edges[i]) for i in range(n)]


# The mel-axis DCT runs over blocks of basis bins, not all 107 at once: the noise in a log-mel bin
# is far stronger in the narrow low bins (one FFT bin each) than in the wide high ones, and a DCT
# across both would smear the loud noise over every coefficient (blocks measured ~9% fewer bits
# than one DCT at equal error, as good as a trained KLT). They cover the 107 basis bins.
_MEL_BLOCKS = (16, 16, 32, 43)


@lru_cache(maxsize=1)
def mel_transform() -> np.ndarray:
    """[nb, nb] orthonormal block-diagonal DCT over the basis bins."""
    nb = sum(_MEL_BLOCKS)
    t = np.zeros((nb, nb))
    s = 0
    for n in _MEL_BLOCKS:
        t[s:s + n, s:s + n] = _dct_matrix(n)
        s += n
    t.setflags(write=False)
    return t


def forward_transform(basis_rows: np.ndarray) -> list[np.ndarray]:
    """basis_rows: [nb, k] -> per time block [nb, L] coefficients (mel DCT x time DCT)."""
    dm = mel_transform()
    return [dm @ basis_rows[:, s:s + n] @ _dct_matrix(n).T for s, n in time_blocks(basis_rows.shape[1])]


def inverse_transform(blocks: list[np.ndarray]) -> np.ndarray:
    """Inverse of forward_transform: per block [nb, L] -> [nb, k]."""
    dm = mel_transform()
    return np.concatenate([dm.T @ c @ _dct_matrix(c.shape[1]) for c in blocks], axis=1)


# ------------------------------------------------------------------------ coefficient classes

# Prior bands: (mel block, log-spaced DCT index inside the block) x time-frequency band (DC, <1/8,
# <1/4, <1/2, <1 of Nyquist).
_IN_BLOCK_EDGES = (0, 1, 2, 4, 8, 16, 32)
# Prior class of each band for each mode, at a block of 20 frames: 2 log2(mean |level|) + CLASS_ZERO,
# rounded, [4 mel blocks x 7 index bands, 5 time bands]. Fitted per mode (the dead zone makes the
# level statistics of quiet bands fall much faster than step / RMS) on espeak-ng speech with 20-30
# dB SNR white noise and the bundled sample. Only efficiency depends on them: the per-packet shift
# absorbs louder, quieter or noisier input. Integers, so encoder and decoder derive the same classes
# on any platform. Rows of unused bands are 0.
_PRIOR_CLASSES = {
    "hifi": np.array([
        [33, 28, 26, 23, 21], [27, 26, 24, 22, 20], [27, 24, 22, 21, 19], [25, 22, 21, 20, 19],
        [24, 21, 20, 19, 18], [0, 0, 0, 0, 0], [0, 0, 0, 0, 0], [34, 29, 26, 23, 21],
        [28, 26, 25, 22, 21], [25, 24, 23, 22, 20], [23, 21, 21, 20, 20], [22, 20, 20, 20, 19],
        [0, 0, 0, 0, 0], [0, 0, 0, 0, 0], [36, 28, 27, 24, 22], [28, 27, 26, 23, 21],
        [27, 26, 25, 23, 21], [25, 24, 23, 21, 20], [21, 21, 20, 20, 19], [19, 18, 18, 18, 17],
        [0, 0, 0, 0, 0], [36, 27, 26, 23, 20], [30, 27, 25, 22, 19], [27, 25, 23, 21, 19],
        [26, 24, 22, 20, 19], [24, 22, 21, 20, 18], [19, 19, 19, 18, 17], [18, 17, 17, 17, 16],
    ]),
    "balanced": np.array([
        [29, 25, 23, 20, 18], [23, 22, 20, 18, 16], [24, 21, 19, 17, 15], [22, 19, 17, 16, 15],
        [20, 18, 16, 15, 13], [0, 0, 0, 0, 0], [0, 0, 0, 0, 0], [31, 25, 23, 20, 18],
        [24, 23, 21, 19, 17], [22, 21, 19, 18, 17], [19, 18, 17, 16, 16], [18, 17, 16, 16, 15],
        [0, 0, 0, 0, 0], [0, 0, 0, 0, 0], [32, 24, 23, 20, 18], [25, 24, 22, 20, 17],
        [24, 23, 22, 19, 17], [21, 20, 19, 18, 16], [18, 17, 17, 16, 15], [15, 14, 14, 14, 13],
        [0, 0, 0, 0, 0], [33, 24, 22, 20, 17], [26, 23, 21, 18, 16], [23, 22, 20, 17, 15],
        [22, 20, 19, 17, 15], [20, 19, 17, 16, 14], [16, 15, 15, 14, 13], [13, 13, 12, 12, 10],
    ]),
    "low": np.array([
        [27, 22, 20, 17, 14], [21, 20, 18, 15, 12], [21, 18, 16, 14, 9], [20, 16, 14, 11, 7],
        [18, 15, 12, 8, 4], [0, 0, 0, 0, 0], [0, 0, 0, 0, 0], [29, 23, 20, 17, 14],
        [22, 21, 19, 16, 14], [20, 18, 17, 15, 13], [16, 15, 14, 12, 11], [15, 13, 12, 10, 9],
        [0, 0, 0, 0, 0], [0, 0, 0, 0, 0], [30, 22, 21, 18, 15], [23, 21, 20, 17, 13],
        [22, 21, 19, 17, 13], [19, 18, 16, 15, 12], [15, 14, 13, 11, 8], [8, 7, 6, 4, 1],
        [0, 0, 0, 0, 0], [30, 22, 20, 17, 13], [24, 21, 19, 15, 9], [21, 19, 17, 13, 8],
        [20, 18, 16, 13, 7], [18, 16, 14, 10, 5], [10, 9, 8, 6, 0], [1, 2, 1, 0, 0],
    ]),
}
_SHIFT_LIMIT = 24


def _time_band(n: int) -> np.ndarray:
    """[n] band of each time-DCT index of a block of n frames: 0 (DC), then below 1/8, 1/4, 1/2
    and up to Nyquist (integer arithmetic: the classes must not depend on float rounding)."""
    j = np.arange(n)
    return np.where(j == 0, 0, np.where(8 * j < n, 1, np.where(4 * j < n, 2, np.where(2 * j < n, 3, 4))))


def _prior_band() -> np.ndarray:
    """[nb] prior row of each mel-axis coefficient: block * 7 + index band inside the block."""
    bands = len(_IN_BLOCK_EDGES)
    return np.concatenate([b * bands + np.searchsorted(_IN_BLOCK_EDGES, np.arange(n), side="right") - 1
                           for b, n in enumerate(_MEL_BLOCKS)])


@lru_cache(maxsize=256)
def _prior_class(n: int, mode: str) -> np.ndarray:
    """[nb, n] class (before the packet shift) of each coefficient of a block of n frames."""
    cls = _PRIOR_CLASSES[mode][_prior_band()][:, _time_band(n)]
    # the DC carries the block mean, whose level grows with n: about log2(n / 20) half-octaves
    cls[:, 0] += int(n).bit_length() - 5
    cls.setflags(write=False)
    return cls


# ---------------------------------------------------------------------------------- the packet


@dataclass(frozen=True)
class PacketHeader:
    """Everything before the entropy-coded body. `floors` holds the clamp value of every frame."""

    mode: str | None  # None: a keep-alive (no frames)
    n_frames: int
    floors: np.ndarray  # [n_frames] float32
    shift: int = 0
    residual_class: int | None = None  # class of the dependent-bin residuals, if any are sent
    at_floor: bool = False  # every value equals its frame's floor: no body follows

    def serialize(self) -> bytes:
        mode_id = 0 if self.mode is None else _MODE_IDS[self.mode]
        out = [bytes([MAGIC, VERSION << 4 | mode_id]), _varint(self.n_frames)]
        if self.n_frames == 0:
            return b"".join(out)
        changes = np.flatnonzero(self.floors[1:] != self.floors[:-1]) + 1
        out += [_F32.pack(float(self.floors[0])), _varint(len(changes))]
        prev = 0
        for i in changes:
            out += [_varint(int(i) - prev), _F32.pack(float(self.floors[i]))]
            prev = int(i)
        if self.at_floor:
            out.append(bytes([0x40 | 32]))
        elif self.residual_class is None:
            out.append(bytes([self.shift + 32]))
        else:
            out.append(bytes([(self.shift + 32) | 0x80, self.residual_class]))
        return b"".join(out)

    @classmethod
    def parse(cls, data: bytes) -> tuple[PacketHeader, int]:
        """-> (header, offset of the body). Validates every length and field."""
        if len(data) < 2:
            raise CodecError(f"payload truncated: {len(data)} bytes, the header needs at least 3")
        if data[0] != MAGIC:
            raise CodecError("not a harken feature payload (bad magic byte)")
        version, mode_id = data[1] >> 4, data[1] & 0x0F
        if version != VERSION:
            raise CodecError(f"unsupported feature payload version {version} (this build reads {VERSION})")
        if mode_id > len(MODES):
            raise CodecError(f"unknown codec mode id {mode_id}")
        n, pos = _read_varint(data, 2, "frame count")
        if n > MAX_FRAMES:
            raise CodecError(f"payload claims {n} frames, more than the limit {MAX_FRAMES}")
        if (mode_id == 0) != (n == 0):
            raise CodecError("keep-alive payloads carry no frames and frame payloads carry some")
        if n == 0:
            if len(data) != pos:
                raise CodecError("keep-alive payload has trailing bytes")
            return cls(None, 0, np.zeros(0, dtype=np.float32)), pos
        if len(data) < pos + _F32.size:
            raise CodecError("payload truncated in the floor field")
        floors = np.full(n, _F32.unpack_from(data, pos)[0], dtype=np.float32)
        n_changes, pos = _read_varint(data, pos + _F32.size, "floor change count")
        if n_changes >= n:
            raise CodecError(f"payload claims {n_changes} floor changes in {n} frames")
        at = 0
        for _ in range(n_changes):
            step, pos = _read_varint(data, pos, "floor change")
            at += step
            if step == 0 or at >= n:
                raise CodecError("corrupt payload: floor changes out of order")
            if len(data) < pos + _F32.size:
                raise CodecError("payload truncated in the floor changes")
            floors[at:] = _F32.unpack_from(data, pos)[0]
            pos += _F32.size
        if not np.all(np.abs(floors) <= VALUE_LIMIT):
            raise CodecError("corrupt payload: floor value out of range")
        if len(data) < pos + 1:
            raise CodecError("payload truncated before the class shift")
        shift = (data[pos] & 0x3F) - 32
        if abs(shift) > _SHIFT_LIMIT or (data[pos] & 0x40 and data[pos] != 0x40 | 32):
            raise CodecError("corrupt payload: bad class shift or flags")
        if data[pos] & 0x40:
            return cls(MODES[mode_id - 1], n, floors, at_floor=True), pos + 1
        residual_class = None
        if data[pos] & 0x80:
            if len(data) < pos + 2:
                raise CodecError("payload truncated before the residual class")
            residual_class = data[pos + 1]
            if residual_class >= N_CLASSES:
                raise CodecError(f"corrupt payload: residual class {residual_class}")
            pos += 1
        return cls(MODES[mode_id - 1], n, floors, shift, residual_class), pos + 1


def _varint(value: int) -> bytes:
    """Unsigned LEB128."""
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _read_varint(data: bytes, pos: int, what: str) -> tuple[int, int]:
    """-> (value, next position); at most 2 bytes, since no field here exceeds MAX_FRAMES."""
    value = 0
    for i in range(2):
        if pos + i >= len(data):
            raise CodecError(f"payload truncated in the {what}")
        value |= (data[pos + i] & 0x7F) << (7 * i)
        if not data[pos + i] & 0x80:
            return value, pos + i + 1
    raise CodecError(f"corrupt payload: {what} is too long")


def frame_floors(frames: np.ndarray, floor_log10: float | None) -> np.ndarray:
    """frames: [128, k] -> [k] float32 clamp value per frame: the decoder outputs at least this.

    RunningMaxFloor floors frame t at (running max at t) - 8, which is at least `floor_log10` (the
    floor before the packet, if the caller knows it; else the packet minimum) and at least
    (max of this packet's frames up to t) - 8; so the clamp follows the floor as it rises inside
    the packet. It is never above a frame's own minimum (frames floored some other way stay
    correct), so clamping only ever moves decoded values towards the truth."""
    base = np.float32(frames.min() if floor_log10 is None else floor_log10)
    running = np.maximum.accumulate(frames.max(axis=0)) - np.float32(DYNAMIC_RANGE_LOG10)
    return np.minimum(np.maximum(base, running), frames.min(axis=0)).astype(np.float32)


def _block_prior(lengths: list[int], mode: str) -> np.ndarray:
    """Prior class (unclipped, before the packet shift) of every basis coefficient of a packet,
    time blocks concatenated: [nb * k]."""
    return np.concatenate([_prior_class(n, mode).ravel() for n in lengths])


def _shifted(prior: np.ndarray, shift: int) -> np.ndarray:
    return np.clip(prior + shift, 0, N_CLASSES - 1)


def quantize(scaled: np.ndarray, classes: np.ndarray, rd_lambda: float) -> np.ndarray:
    """scaled: [n] coefficients / step, classes: [n] -> [n] int64 levels. Rounding up from
    floor(|x|) to floor(|x|) + 1 saves (2f - 1) squared steps of error and costs b bits, so the
    rounding offset is 0.5 - rd_lambda * b (never below 0.1)."""
    _, b = class_bit_costs()
    offset = np.maximum(0.5 - rd_lambda * b[classes], 0.1)
    return (np.sign(scaled) * np.floor(np.abs(scaled) + offset)).astype(np.int64)


def _measure_shift(q: np.ndarray, prior: np.ndarray) -> int:
    """The class shift (in half-octaves of expected |q|) under which this packet's values cost
    the fewest bits: the prior adapts to louder, quieter or noisier input."""
    return _best_shift(np.abs(q), prior, np.arange(-_SHIFT_LIMIT, _SHIFT_LIMIT + 1))


_ESCAPE_BITS = 12.0  # rough length of an escape code word
_MAG_CAP = 63  # larger magnitudes are counted as this one: they escape in any likely class


@lru_cache(maxsize=1)
def _value_bits() -> np.ndarray:
    """[N_CLASSES, _MAG_CAP + 1] approximate bits of a value of magnitude m in class c; far
    beyond its class a value escapes to Exp-Golomb, costing ~log |v| rather than ~|v|."""
    a, b = class_bit_costs()
    m = np.arange(_MAG_CAP + 1)
    return np.minimum(a[:, None] + b[:, None] * m[None, :], (_ESCAPE_BITS + 2.0 * np.log2(1.0 + m))[None, :])


def _best_shift(mag: np.ndarray, prior: np.ndarray, shifts: np.ndarray) -> int:
    """mag, prior: [n] -> the shift s minimising the bits of all values in classes prior + s.
    Works on a (prior, magnitude) histogram, so its cost does not grow with n."""
    lo = int(prior.min())
    width = _MAG_CAP + 1
    hist = np.bincount((prior - lo) * width + np.minimum(mag, _MAG_CAP),
                       minlength=(int(prior.max()) - lo + 1) * width).reshape(-1, width)  # [P, M]
    rows = np.flatnonzero(hist.any(axis=1))
    cls = np.clip(lo + rows[:, None] + shifts[None, :], 0, N_CLASSES - 1)  # [R, S]
    cost = np.einsum("rm,rsm->s", hist[rows].astype(np.float64), _value_bits()[cls])
    return int(shifts[np.argmin(cost)])


def encode_frames(frames: np.ndarray, mode: str = DEFAULT_MODE, floor_log10: float | None = None) -> bytes:
    """Encode raw log10-mel frames [128, k] (floored at running max - 8) into one self-contained
    payload. `floor_log10`: the floor (running max - 8) before this packet's first frame, if known;
    it lets values at the floor cost nothing. k = 0 gives a keep-alive. Deterministic."""
    if mode not in _MODE_PARAMS:
        raise CodecError(f"unknown codec mode {mode!r}; expected one of {MODES}")
    frames = np.asarray(frames)
    if frames.ndim != 2 or frames.shape[0] != N_MELS:
        raise CodecError(f"frames must be [{N_MELS}, k], got {list(frames.shape)}")
    k = frames.shape[1]
    if k > MAX_FRAMES:
        raise CodecError(f"{k} frames in one payload; the limit is {MAX_FRAMES}")
    if k == 0:
        return keepalive()
    frames = frames.astype(np.float32)
    if not np.all(np.isfinite(frames)) or np.abs(frames).max() > VALUE_LIMIT:
        raise CodecError(f"frames must be finite log10-mel values within +-{VALUE_LIMIT}")
    if floor_log10 is not None and not abs(float(floor_log10)) <= VALUE_LIMIT:
        raise CodecError(f"floor_log10 must be finite and within +-{VALUE_LIMIT}")
    params = _MODE_PARAMS[mode]
    layout = mel_layout()
    floors = frame_floors(frames, floor_log10)
    x = frames.astype(np.float64)
    at_floor = x <= floors[None, :]
    if np.all(at_floor):  # silence under the floor: the floors say it all
        return PacketHeader(mode, k, floors, at_floor=True).serialize()
    # values at the floor carry nothing but "at most this": sink them below it so quantisation
    # noise cannot lift them over the clamp (the decoder puts them back exactly at the floor)
    x_coded = np.where(at_floor, x - (FLOOR_MARGIN * params.step + layout.floor_sink[:, None]), x)
    # a floored bin whose one-source dependent is not floored has its true value right there
    single = layout.ratio_b == 0
    src, dep_rows = layout.source_a[single], layout.dependent[single]
    known = at_floor[src] & ~at_floor[dep_rows]  # [ns, k]
    implied = x[dep_rows] - layout.log10_ratio_a[single][:, None]
    x_coded[src] = np.where(known, implied, x_coded[src])

    # dependents: predicted from the basis as the decoder will see it; a residual only where
    # flooring broke the identity
    pred = predict_dependent(x_coded, layout)
    dep = x_coded[layout.dependent]
    # at the floor, any prediction under it is as good
    fine = at_floor[layout.dependent] & (pred <= floors)
    res = np.where(fine, 0, np.rint((dep - pred) / params.step)).astype(np.int64).ravel()

    # basis: mel DCT x time DCT, dead-zone quantiser
    coefs = forward_transform(x_coded[layout.basis])
    lengths = [c.shape[1] for c in coefs]
    flat = np.concatenate([c.ravel() for c in coefs]) / params.step
    prior = _block_prior(lengths, mode)
    shift = _measure_shift(quantize(flat, _shifted(prior, 0), params.rd_lambda), prior)
    classes = _shifted(prior, shift)
    q = quantize(flat, classes, params.rd_lambda)
    res_class = None
    if np.any(res):
        res_class = _best_shift(np.abs(res), np.zeros(res.size, dtype=np.int64), np.arange(N_CLASSES))
        q = np.concatenate([q, res])
        classes = np.concatenate([classes, np.full(res.size, res_class)])
    body = encode_symbols(q, classes)
    header = PacketHeader(mode, k, floors, shift, res_class)
    return header.serialize() + body


def max_frames_for_payload(n_bytes: int) -> int:
    """Most frames a payload of `n_bytes` may claim on the wire (see MAX_FRAMES_PER_PAYLOAD_BYTE)."""
    return min(MAX_FRAMES, MAX_FRAMES_PER_PAYLOAD_BYTE * n_bytes)


def keepalive() -> bytes:
    """A payload with no frames: what the edge may send during silence."""
    return PacketHeader(None, 0, np.zeros(0, dtype=np.float32)).serialize()


@lru_cache(maxsize=512)
def _packet_classes(k: int, mode: str, shift: int, residual_class: int | None) -> tuple[np.ndarray, int]:
    """The class of every level of a packet of this shape, and the fewest bits its body can have
    (a few hundred shapes: frame counts x modes x shifts; the same for every packet of one)."""
    classes = _shifted(_block_prior([n for _, n in time_blocks(k)], mode), shift)
    if residual_class is not None:
        classes = np.concatenate([classes, np.full(len(mel_layout().dependent) * k, residual_class)])
    classes.setflags(write=False)
    return classes, min_body_bits(classes)


def decode_frames(payload: bytes, max_frames: int = MAX_FRAMES) -> np.ndarray:
    """Decode one payload -> [128, k] float32 frames (k = 0 for a keep-alive). Any malformed
    payload raises CodecError, after work bounded by the payload's own size; so does one that
    claims more than `max_frames` (checked before any decoding work)."""
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise CodecError(f"payload must be bytes, got {type(payload).__name__}")
    payload = bytes(payload)
    header, pos = PacketHeader.parse(payload)
    k = header.n_frames
    if k > max_frames:
        raise CodecError(f"payload claims {k} frames, more than the {max_frames} expected")
    if k == 0:
        return np.zeros((N_MELS, 0), dtype=np.float32)
    if header.at_floor:
        if len(payload) != pos:
            raise CodecError("corrupt payload: bytes after an at-floor header")
        return np.repeat(header.floors[None, :], N_MELS, axis=0)
    mode = header.mode
    assert mode is not None  # PacketHeader.parse: a payload with frames names its mode
    params = _MODE_PARAMS[mode]
    layout = mel_layout()
    nb = len(layout.basis)
    lengths = [n for _, n in time_blocks(k)]
    classes, min_bits = _packet_classes(k, mode, header.shift, header.residual_class)
    body = payload[pos:]
    # every tuple costs at least one bit: a body too short for the claimed frames fails here,
    # before any per-symbol work
    if 8 * len(body) < min_bits:
        raise CodecError(f"payload truncated: {len(body)} body bytes for {k} frames")
    values, bits, used = decode_levels(body, classes)
    if len(body) - (used + 7) // 8 != 0 or bits[used:].any():
        raise CodecError("corrupt payload: trailing bits after the body")
    q = values[: nb * k].astype(np.float64) * params.step
    blocks, at = [], 0
    for n in lengths:
        blocks.append(q[at:at + nb * n].reshape(nb, n))
        at += nb * n
    x = np.zeros((N_MELS, k))
    x[layout.basis] = inverse_transform(blocks)
    x[layout.dependent] = predict_dependent(x, layout)
    if header.residual_class is not None:
        x[layout.dependent] += values[nb * k:].reshape(len(layout.dependent), k) * params.step
    x = np.maximum(x, header.floors[None, :].astype(np.float64))
    if not np.all(np.abs(x) <= VALUE_LIMIT):
        raise CodecError("corrupt payload: decoded values out of range")
    return x.astype(np.float32)
