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
2. **Transform.** The basis bins go through an orthonormal DCT across mel and a DCT across time in blocks of at most 32
   frames (the prediction across time; a packet of 20 frames is one block).
3. **Quantisation.** One step per mode with a dead zone (rounding offset < 0.5), which is what
   trades rate for the RMS error the fidelity metric counts.
4. **Entropy coding.** Every coefficient falls in a class: an expected magnitude from a fixed
   prior over (mel-frequency band, time-frequency band), moved by a per-packet shift the encoder
   measures. Each class owns a static canonical Huffman code over tuples of 1, 2 or 4 values
   (tuples make near-zero classes cost well under a bit per value), built at import time from a
   two-sided geometric model, with an escape to Exp-Golomb for large values. Encoding is fully
   vectorised in numpy; decoding walks the bits in Python (it runs in the cloud).
5. **Floor.** The decoder clamps every frame at its floor (carried exactly in the header), so values
   at the floor decode to the floor and cost nothing beyond the clamp.

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

import heapq
import struct
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from harken.shared.errors import CodecError
from harken.shared.features_spec import DYNAMIC_RANGE_LOG10, N_FFT, N_MELS, SAMPLE_RATE

MODES = ("hifi", "balanced", "low")
DEFAULT_MODE = "balanced"
MAGIC = 0xA7
VERSION = 1
MAX_FRAMES = 6000  # 60 s per payload: far above any packet, small enough to bound allocations
MAX_TIME_BLOCK = 32  # frames per time-DCT block
VALUE_LIMIT = 100.0
FLOOR_MARGIN = 1.0  # steps by which the encoder sinks values at the floor (see encode_frames)  # |log10 mel| beyond this is not a log-mel (1e-100 .. 1e100)

_F32 = struct.Struct("<f")


@dataclass(frozen=True)
class ModeParams:
    """Quantiser of one mode: step in log10 units, and the rate-distortion trade-off
    `rd_lambda`: a value rounds up only if the squared error it saves (in step units) exceeds
    2 * rd_lambda times the bits it costs under its class model, so sparse classes get wide dead
    zones and busy ones near-plain rounding (0 = plain rounding)."""

    step: float
    rd_lambda: float


_MODE_PARAMS = {
    "hifi": ModeParams(step=0.10, rd_lambda=0.06),
    "balanced": ModeParams(step=0.33, rd_lambda=0.06),
    "low": ModeParams(step=0.75, rd_lambda=0.1),
}
_MODE_IDS = {name: i + 1 for i, name in enumerate(MODES)}
# RMS error (dB, fidelity.feature_error_db) each mode stays under on noisy speech, with headroom
# over what the bench measures (README): the tests hold the codec to these.
ERROR_BOUND_DB = {"hifi": 0.33, "balanced": 1.1, "low": 2.8}


# ---------------------------------------------------------------- mel layout (basis / dependents)


def _slaney_mel_filters() -> np.ndarray:
    """[201, 128] slaney-normalised slaney-scale mel filters, 0..8000 Hz: the bank of the feature
    contract (transformers' mel_filter_bank(201, 128, 0, 8000, 16000, "slaney", "slaney"))."""
    def hz_to_mel(f):
        f = np.asarray(f, dtype=np.float64)
        lin = 3.0 * f / 200.0
        log = 15.0 + 27.0 * np.log(np.maximum(f, 1e-10) / 1000.0) / np.log(6.4)
        return np.where(f >= 1000.0, log, lin)

    def mel_to_hz(m):
        m = np.asarray(m, dtype=np.float64)
        lin = 200.0 * m / 3.0
        log = 1000.0 * np.exp(np.log(6.4) * (m - 15.0) / 27.0)
        return np.where(m >= 15.0, log, lin)

    n_freq = N_FFT // 2 + 1
    fft_freqs = np.linspace(0, SAMPLE_RATE // 2, n_freq)
    filter_freqs = mel_to_hz(np.linspace(hz_to_mel(0.0), hz_to_mel(8000.0), N_MELS + 2))
    diff = np.diff(filter_freqs)
    slopes = filter_freqs[None, :] - fft_freqs[:, None]  # [201, 130]
    down = -slopes[:, :-2] / diff[:-1]
    up = slopes[:, 2:] / diff[1:]
    fb = np.maximum(0.0, np.minimum(down, up))  # [201, 128]
    return fb * (2.0 / (filter_freqs[2:] - filter_freqs[:-2]))[None, :]


@dataclass(frozen=True)
class MelLayout:
    """Which mel bins are coded (basis) and which follow from them (dependents).

    dependent m = log10(ratio_a[m] * 10**x[source_a[m]] + ratio_b[m] * 10**x[source_b[m]]);
    ratio_b = 0 when m sees one FFT bin only."""

    basis: np.ndarray  # [nb] int
    dependent: np.ndarray  # [nd] int
    source_a: np.ndarray  # [nd] int (mel index)
    source_b: np.ndarray  # [nd] int
    ratio_a: np.ndarray  # [nd] float64
    ratio_b: np.ndarray  # [nd] float64


@lru_cache(maxsize=1)
def mel_layout() -> MelLayout:
    """Derived from the filter bank alone, so encoder and decoder agree by construction."""
    fb = _slaney_mel_filters().T  # [128, 201]
    support = [np.flatnonzero(fb[m] > 0) for m in range(N_MELS)]
    owner: dict[int, int] = {}  # FFT bin -> first mel bin that sees only it
    for m, s in enumerate(support):
        if len(s) == 1 and int(s[0]) not in owner:
            owner[int(s[0])] = m
    dep, src_a, src_b, r_a, r_b = [], [], [], [], []
    for m, s in enumerate(support):
        if not 1 <= len(s) <= 2 or any(int(k) not in owner for k in s):
            continue
        if len(s) == 1 and owner[int(s[0])] == m:
            continue
        srcs = [(owner[int(k)], fb[m, k] / fb[owner[int(k)], k]) for k in s]
        if len(srcs) == 1:
            srcs.append((srcs[0][0], 0.0))
        dep.append(m)
        (a, ra), (b, rb) = srcs
        src_a.append(a), src_b.append(b), r_a.append(ra), r_b.append(rb)
    basis = np.array([m for m in range(N_MELS) if m not in set(dep)])
    return MelLayout(basis, np.array(dep, dtype=np.int64), np.array(src_a, dtype=np.int64),
                     np.array(src_b, dtype=np.int64), np.array(r_a), np.array(r_b))


def predict_dependent(frames: np.ndarray, layout: MelLayout) -> np.ndarray:
    """frames: [128, k] (basis rows filled) -> [nd, k] predicted dependent rows."""
    ln10 = np.log(10.0)
    with np.errstate(divide="ignore"):
        a = frames[layout.source_a] * ln10 + np.log(layout.ratio_a)[:, None]
        b = frames[layout.source_b] * ln10 + np.log(layout.ratio_b)[:, None]
    return np.logaddexp(a, b) / ln10


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
    n = -(-k // MAX_TIME_BLOCK)
    edges = [round(i * k / n) for i in range(n + 1)]
    return [(edges[i], edges[i + 1] - edges[i]) for i in range(n)]


# The mel-axis DCT runs over blocks of basis bins, not all 107 at once: the noise in a log-mel bin
# is far stronger in the narrow low bins (one FFT bin each) than in the wide high ones, and a DCT
# across both would smear the loud noise over every coefficient (blocks measured ~9% fewer bits
# than one DCT at equal error, as good as a trained KLT).
_MEL_BLOCKS = (16, 16, 32, 43)


@lru_cache(maxsize=4)
def mel_transform(nb: int) -> np.ndarray:
    """[nb, nb] orthonormal block-diagonal DCT over the basis bins."""
    sizes = list(_MEL_BLOCKS) if sum(_MEL_BLOCKS) == nb else [nb]
    t = np.zeros((nb, nb))
    s = 0
    for n in sizes:
        t[s:s + n, s:s + n] = _dct_matrix(n)
        s += n
    t.setflags(write=False)
    return t


def forward_transform(basis_rows: np.ndarray) -> list[np.ndarray]:
    """basis_rows: [nb, k] -> per time block [nb, L] coefficients (mel DCT x time DCT)."""
    dm = mel_transform(basis_rows.shape[0])
    return [dm @ basis_rows[:, s:s + n] @ _dct_matrix(n).T for s, n in time_blocks(basis_rows.shape[1])]


def inverse_transform(blocks: list[np.ndarray]) -> np.ndarray:
    """Inverse of forward_transform: per block [nb, L] -> [nb, k]."""
    dm = mel_transform(blocks[0].shape[0])
    return np.concatenate([dm.T @ c @ _dct_matrix(c.shape[1]) for c in blocks], axis=1)


# ------------------------------------------------------------------------ coefficient classes

# Prior bands: (mel block, log-spaced DCT index inside the block) x time-frequency band (DC, <1/8,
# <1/4, <1/2, <1 of Nyquist).
_IN_BLOCK_EDGES = (0, 1, 2, 4, 8, 16, 32)
# log2 RMS of each band's coefficients, [4 blocks x 7 index bands, 5 time bands], measured
# on espeak-ng speech with 20-30 dB SNR noise and on the bundled sample (blocks of 10-32 frames).
# Only efficiency depends on it; the per-packet shift absorbs louder or quieter input.
_PRIOR_LOG2_RMS = np.array([
    [5.42, 3.06, 1.97, 0.66, -0.29], [2.68, 1.74, 0.92, -0.17, -0.97],
    [2.58, 1.15, 0.15, -0.58, -1.30], [1.77, 0.21, -0.50, -1.13, -1.58],
    [0.86, -0.36, -1.01, -1.51, -1.91], [0.0, 0.0, 0.0, 0.0, 0.0],
    [0.0, 0.0, 0.0, 0.0, 0.0], [6.03, 3.17, 2.15, 0.78, -0.26],
    [2.90, 2.11, 1.31, 0.32, -0.63], [2.02, 1.11, 0.45, -0.20, -0.80],
    [0.79, -0.21, -0.59, -0.88, -1.07], [0.20, -0.81, -0.95, -1.18, -1.38],
    [0.0, 0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0],
    [6.53, 2.94, 2.14, 0.92, -0.15], [3.39, 2.54, 1.74, 0.68, -0.62],
    [3.02, 2.15, 1.45, 0.52, -0.62], [1.69, 0.94, 0.33, -0.31, -0.95],
    [0.17, -0.57, -0.78, -1.14, -1.45], [-1.03, -1.68, -1.79, -1.96, -2.17],
    [0.0, 0.0, 0.0, 0.0, 0.0], [6.83, 2.72, 1.83, 0.88, -0.57],
    [3.65, 2.26, 1.27, 0.01, -1.24], [2.59, 1.55, 0.53, -0.58, -1.51],
    [1.95, 0.81, 0.02, -0.86, -1.58], [0.97, 0.11, -0.56, -1.20, -1.80],
    [-0.51, -1.37, -1.55, -1.79, -2.19], [-1.57, -2.21, -2.26, -2.38, -2.69],
])  # rows of unused bands are 0
N_CLASSES = 28  # class c expects mean |q| = 2 ** ((c - _CLASS_ZERO) / 2)
_CLASS_ZERO = 16
_SHIFT_LIMIT = 24


def _time_band(j: np.ndarray, n: int) -> np.ndarray:
    """Time-DCT index j of a block of n frames -> band 0 (DC) .. 4."""
    f = j / n
    return np.where(j == 0, 0, np.where(f < 0.125, 1, np.where(f < 0.25, 2, np.where(f < 0.5, 3, 4))))


def _prior_band(nb: int) -> np.ndarray:
    """[nb] prior row of each mel-axis coefficient: block * 7 + index band inside the block."""
    sizes = list(_MEL_BLOCKS) if sum(_MEL_BLOCKS) == nb else [nb]
    rows = []
    for b, n in enumerate(sizes[:4]):
        rows.append(b * len(_IN_BLOCK_EDGES) + np.searchsorted(_IN_BLOCK_EDGES, np.arange(n), side="right") - 1)
    return np.concatenate(rows)


@lru_cache(maxsize=256)
def _prior_class(nb: int, n: int, step: float) -> np.ndarray:
    """[nb, n] class (before the packet shift) of each coefficient of a block of n frames, as
    2 x log2 of its expected mean |q| (Laplacian: mean |c| = rms / sqrt 2)."""
    band = _prior_band(nb)
    tb = _time_band(np.arange(n), n)
    log2_rms = _PRIOR_LOG2_RMS[band][:, tb]
    log2_rms[:, 0] += 0.5 * np.log2(n / 20.0)  # the DC carries the block mean, which grows with n
    cls = np.rint(2.0 * (log2_rms - 0.5 - np.log2(step))).astype(np.int64) + _CLASS_ZERO
    cls.setflags(write=False)
    return cls


# ---------------------------------------------------------------------------- entropy coding


@dataclass(frozen=True)
class CodeTable:
    """A canonical Huffman code over tuples of `group` values in [-radius, radius], plus an escape
    symbol (index `escape`) after which each value of the tuple follows as signed Exp-Golomb."""

    group: int
    radius: int
    escape: int
    codes: np.ndarray  # [n_symbols] uint64 codeword, MSB first
    lengths: np.ndarray  # [n_symbols] int64
    # canonical decoding: per code length L, the first code, its index into `order`, the count
    first_code: tuple[int, ...]
    first_index: tuple[int, ...]
    count: tuple[int, ...]
    order: tuple[int, ...]  # symbols sorted by (length, symbol)


def _huffman_lengths(p: np.ndarray) -> np.ndarray:
    """Code lengths of a Huffman code for probabilities p (deterministic tie-breaking)."""
    heap = [(float(q), i, (i,)) for i, q in enumerate(p)]
    heapq.heapify(heap)
    lengths = np.zeros(len(p), dtype=np.int64)
    tie = len(p)
    while len(heap) > 1:
        pa, _, a = heapq.heappop(heap)
        pb, _, b = heapq.heappop(heap)
        lengths[list(a + b)] += 1
        heapq.heappush(heap, (pa + pb, tie, a + b))
        tie += 1
    return lengths


_SPARSE_GROUP = 4  # runs of classes coded in 4-tuples open with an all-zero flag bit


def _tuple_shape(mean_abs: float) -> tuple[int, int]:
    """(values per tuple, radius) of a class: chosen per expected |value| by the Huffman code's
    expected length per value under the class model (escapes included); grouping matters most
    where values are mostly zero, where one code per value would cost at least a bit."""
    if mean_abs < 0.03:
        return 4, 1
    if mean_abs < 0.16:
        return 4, 2
    if mean_abs < 0.3:
        return 3, 3
    if mean_abs < 0.42:
        return 2, 5
    if mean_abs < 1.7:
        return 2, 7
    return 1, max(24, int(np.ceil(5 * mean_abs)))


def _build_table(mean_abs: float) -> CodeTable:
    """Huffman code for a two-sided geometric source with the given mean |value|."""
    theta = (np.sqrt(1.0 + mean_abs**2) - 1.0) / mean_abs
    group, radius = _tuple_shape(mean_abs)
    values = np.arange(-radius, radius + 1)
    p1 = (1 - theta) / (1 + theta) * theta ** np.abs(values)
    grids = np.meshgrid(*[values] * group, indexing="ij")
    p = np.ones(grids[0].shape)
    for g in range(group):
        p = p * p1[grids[g] + radius]
    p = p.ravel()
    p = np.append(p, max(1.0 - p.sum(), 0.0))
    p = np.maximum(p, 2.0**-18)  # bounds code lengths (and keeps the escape codable)
    lengths = _huffman_lengths(p / p.sum())
    order = np.lexsort((np.arange(len(p)), lengths))
    codes = np.zeros(len(p), dtype=np.uint64)
    code, prev = 0, int(lengths[order[0]])
    first_code, first_index, count = [0] * 64, [0] * 64, [0] * 64
    for rank, s in enumerate(order):
        length = int(lengths[s])
        code <<= length - prev
        prev = length
        if count[length] == 0:
            first_code[length], first_index[length] = code, rank
        count[length] += 1
        codes[s] = code
        code += 1
    return CodeTable(group, radius, len(p) - 1, codes, lengths, tuple(first_code), tuple(first_index),
                     tuple(count), tuple(int(s) for s in order))


@dataclass(frozen=True)
class CodeBook:
    """All class tables, plus their codes flattened into one array so encoding needs no loop."""

    tables: tuple[CodeTable, ...]
    group: np.ndarray  # [N_CLASSES]
    radius: np.ndarray  # [N_CLASSES]
    offset: np.ndarray  # [N_CLASSES] start of each table in flat_codes
    flat_codes: np.ndarray
    flat_lengths: np.ndarray


@lru_cache(maxsize=1)
def code_book() -> CodeBook:
    """One table per class; built once, deterministic, part of the format version."""
    tables = tuple(_build_table(2.0 ** ((c - _CLASS_ZERO) / 2.0)) for c in range(N_CLASSES))
    sizes = np.array([len(t.codes) for t in tables])
    return CodeBook(tables, np.array([t.group for t in tables]), np.array([t.radius for t in tables]),
                    np.cumsum(sizes) - sizes, np.concatenate([t.codes for t in tables]),
                    np.concatenate([t.lengths for t in tables]))


def _exp_golomb(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Signed ints -> (codeword, length) of order-0 Exp-Golomb over the zigzag mapping."""
    v = values.astype(np.int64)
    u = np.where(v >= 0, 2 * v, -2 * v - 1).astype(np.uint64) + np.uint64(1)
    nbits = np.floor(np.log2(u.astype(np.float64))).astype(np.int64) + 1
    # float log2 can be off by one near powers of two for large u: fix exactly
    nbits += (u >> nbits.astype(np.uint64)) > 0
    nbits -= (u >> (nbits - 1).astype(np.uint64)) == 0
    return u, 2 * nbits - 1


def _pack_bits(codes: np.ndarray, lengths: np.ndarray) -> bytes:
    """Concatenate codewords (MSB first) into bytes, zero-padded at the end."""
    lengths = lengths.astype(np.int64)
    total = int(lengths.sum())
    if total == 0:
        return b""
    entry = np.repeat(np.arange(len(lengths)), lengths)
    start = np.cumsum(lengths) - lengths
    shift = (lengths[entry] - 1 - (np.arange(total) - start[entry])).astype(np.uint64)
    bits = ((codes.astype(np.uint64)[entry] >> shift) & np.uint64(1)).astype(np.uint8)
    return np.packbits(bits).tobytes()


def _symbol_order(classes: np.ndarray) -> np.ndarray:
    """Coefficients are coded class by class (stable within a class) so tuples share a table."""
    return np.argsort(classes, kind="stable")


def encode_symbols(q: np.ndarray, classes: np.ndarray) -> bytes:
    """q, classes: [n] ints -> the entropy-coded bits of all of them, class by class; each class
    run is zero-padded to whole tuples. Vectorised: no Python loop over symbols or classes."""
    if len(q) == 0:
        return b""
    book = code_book()
    order = _symbol_order(classes)
    q, cls = q[order].astype(np.int64), classes[order]
    run_start = np.r_[0, np.flatnonzero(np.diff(cls)) + 1]
    run_len = np.diff(np.r_[run_start, len(q)])
    run_cls = cls[run_start]
    g_run = book.group[run_cls]
    padded_len = -(-run_len // g_run) * g_run
    padded_start = np.cumsum(padded_len) - padded_len
    # scatter into the padded layout: [m] values, m = total padded length
    run_of = np.repeat(np.arange(len(run_len)), run_len)
    dest = padded_start[run_of] + np.arange(len(q)) - run_start[run_of]
    m = int(padded_len.sum())
    v = np.zeros(m, dtype=np.int64)
    v[dest] = q
    prun = np.repeat(np.arange(len(run_len)), padded_len)  # [m] run of each padded slot
    g = g_run[prun]
    r = book.radius[run_cls][prun]
    within = np.arange(m) - padded_start[prun]
    n_tuples_run = padded_len // g_run
    tuple_of = (np.cumsum(n_tuples_run) - n_tuples_run)[prun] + within // g  # [m]
    digit = within % g
    width = 2 * r + 1
    place = width ** (g - 1 - digit)
    n_tuples = int(n_tuples_run.sum())
    index = np.bincount(tuple_of, weights=(np.clip(v, -r, r) + r) * place, minlength=n_tuples)
    outside = np.bincount(tuple_of, weights=np.abs(v) > r, minlength=n_tuples) > 0
    tuple_cls = np.repeat(run_cls, n_tuples_run)
    sym = np.where(outside, _escape_index(book, tuple_cls), index.astype(np.int64))
    flat = book.offset[tuple_cls] + sym
    # stream order: each tuple's code, then (escaped tuples only) its values as Exp-Golomb
    eg_codes, eg_lens = _exp_golomb(v)
    eg_lens = np.where(outside[tuple_of], eg_lens, 0)
    # a run of a sparse class starts with one bit: 1 = all zero, nothing else follows
    sparse = g_run == _SPARSE_GROUP
    all_zero = sparse & (np.bincount(prun, weights=v != 0, minlength=len(run_len)) == 0)
    tuple_run = np.repeat(np.arange(len(run_len)), n_tuples_run)
    main_lens = np.where(all_zero[tuple_run], 0, book.flat_lengths[flat])
    eg_lens = np.where(all_zero[prun], 0, eg_lens)
    # entry layout: per run [flag] then per tuple [code, its g Exp-Golomb slots]
    tuple_first = np.cumsum(n_tuples_run) - n_tuples_run
    flag_at = padded_start + tuple_first + np.arange(len(run_len))
    main_at = tuple_first[tuple_run] + padded_start[tuple_run] + (np.arange(n_tuples) - tuple_first[tuple_run]) * (
        1 + g_run[tuple_run]) + tuple_run + 1
    eg_at = main_at[tuple_of] + 1 + digit
    size = n_tuples + m + len(run_len)
    codes = np.zeros(size, dtype=np.uint64)
    lens = np.zeros(size, dtype=np.int64)
    codes[flag_at], lens[flag_at] = all_zero, sparse
    codes[main_at], lens[main_at] = book.flat_codes[flat], main_lens
    codes[eg_at], lens[eg_at] = eg_codes, eg_lens
    return _pack_bits(codes, lens)


def _escape_index(book: CodeBook, cls: np.ndarray) -> np.ndarray:
    """Escape symbol index of each class's table."""
    return (2 * book.radius[cls] + 1) ** book.group[cls]


class BitReader:
    """MSB-first bit reader over a payload body; running out of bits is a CodecError."""

    def __init__(self, data: bytes):
        self.bits = np.unpackbits(np.frombuffer(data, dtype=np.uint8)).tolist()
        self.pos = 0

    def read(self, n: int) -> int:
        if self.pos + n > len(self.bits):
            raise CodecError("payload truncated: entropy-coded body ends early")
        v = 0
        for b in self.bits[self.pos:self.pos + n]:
            v = (v << 1) | b
        self.pos += n
        return v

    def read_symbol(self, t: CodeTable) -> int:
        bits, pos, code = self.bits, self.pos, 0
        end = len(bits)
        first_code, count = t.first_code, t.count
        for length in range(1, 64):
            if pos >= end:
                raise CodecError("payload truncated: entropy-coded body ends early")
            code = (code << 1) | bits[pos]
            pos += 1
            off = code - first_code[length]
            if 0 <= off < count[length]:
                self.pos = pos
                return t.order[t.first_index[length] + off]
        raise CodecError("corrupt payload: invalid code word")

    def read_exp_golomb(self) -> int:
        zeros = 0
        while self.read(1) == 0:
            zeros += 1
            if zeros > 40:
                raise CodecError("corrupt payload: escape value too long")
        u = (1 << zeros) | self.read(zeros)
        u -= 1
        return u // 2 if u % 2 == 0 else -(u + 1) // 2


def decode_symbols(reader: BitReader, classes: np.ndarray) -> np.ndarray:
    """Inverse of encode_symbols for the same classes: -> [n] int64."""
    tables = code_book().tables
    order = _symbol_order(classes)
    sorted_cls = classes[order]
    out_sorted = np.zeros(len(classes), dtype=np.int64)
    cuts = np.r_[0, np.flatnonzero(np.diff(sorted_cls)) + 1, len(classes)]
    for a, b in zip(cuts[:-1], cuts[1:]):
        if a == b:
            continue
        t = tables[int(sorted_cls[a])]
        width = 2 * t.radius + 1
        n_tuples = -(-(b - a) // t.group)
        if t.group == _SPARSE_GROUP and reader.read(1):
            continue  # an all-zero run
        vals = []
        for _ in range(n_tuples):
            sym = reader.read_symbol(t)
            if sym == t.escape:
                vals.extend(reader.read_exp_golomb() for _ in range(t.group))
            else:
                digits = []
                for _ in range(t.group):
                    sym, d = divmod(sym, width)
                    digits.append(d - t.radius)
                vals.extend(reversed(digits))
        out_sorted[a:b] = vals[: b - a]
    out = np.empty_like(out_sorted)
    out[order] = out_sorted
    return out


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


def _block_prior(nb: int, lengths: list[int], step: float) -> np.ndarray:
    """Prior class (unclipped, before the packet shift) of every basis coefficient of a packet,
    time blocks concatenated: [nb * k]."""
    return np.concatenate([_prior_class(nb, n, step).ravel() for n in lengths])


def _shifted(prior: np.ndarray, shift: int) -> np.ndarray:
    return np.clip(prior + shift, 0, N_CLASSES - 1)


def quantize(scaled: np.ndarray, classes: np.ndarray, rd_lambda: float) -> np.ndarray:
    """scaled: [n] coefficients / step, classes: [n] -> [n] int64 levels. Rounding up from
    floor(|x|) to floor(|x|) + 1 saves (2f - 1) squared steps of error and costs b bits, so the
    rounding offset is 0.5 - rd_lambda * b (never below 0.1)."""
    _, b = _class_bit_costs()
    offset = np.maximum(0.5 - rd_lambda * b[classes], 0.1)
    return (np.sign(scaled) * np.floor(np.abs(scaled) + offset)).astype(np.int64)


@lru_cache(maxsize=1)
def _class_bit_costs() -> tuple[np.ndarray, np.ndarray]:
    """Per class (a, b): a value v costs about a + b |v| bits under the class's geometric model."""
    m = 2.0 ** ((np.arange(N_CLASSES) - _CLASS_ZERO) / 2.0)
    theta = (np.sqrt(1.0 + m * m) - 1.0) / m
    return -np.log2((1.0 - theta) / (1.0 + theta)), -np.log2(theta)


def _measure_shift(q: np.ndarray, prior: np.ndarray) -> int:
    """The class shift (in half-octaves of expected |q|) under which this packet's values cost
    the fewest bits: the prior adapts to louder, quieter or noisier input."""
    mag = np.abs(q).astype(np.float64)
    # a value far beyond its class escapes to Exp-Golomb: its cost grows with log |q|, not |q|
    escape = _ESCAPE_BITS + 2.0 * np.log2(1.0 + mag)
    best = _best_shift(mag, escape, prior, np.arange(-8, 9))
    if abs(best) == 8:  # far from the prior: widen the search once
        best = _best_shift(mag, escape, prior, np.arange(-_SHIFT_LIMIT, _SHIFT_LIMIT + 1))
    return best


_ESCAPE_BITS = 12.0  # rough length of an escape code word


def _best_shift(mag: np.ndarray, escape: np.ndarray, prior: np.ndarray, shifts: np.ndarray) -> int:
    a, b = _class_bit_costs()
    cls = np.clip(prior[:, None] + shifts[None, :], 0, N_CLASSES - 1)  # [n, s]
    cost = np.minimum(a[cls] + b[cls] * mag[:, None], escape[:, None]).sum(axis=0)
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
    # values at the floor carry nothing but "at most this": sink them below it so quantisation
    # noise cannot lift them over the clamp (the decoder puts them back exactly at the floor)
    x_coded = np.where(x <= floors[None, :], x - FLOOR_MARGIN * params.step, x)

    if np.all(x <= floors[None, :]):  # silence under the floor: the floors say it all
        return PacketHeader(mode, k, floors, at_floor=True).serialize()

    # dependents: predicted from the basis as the decoder will see it; a residual only where
    # flooring broke the identity
    pred = predict_dependent(x_coded, layout)
    dep = x_coded[layout.dependent]
    needed = ~((x[layout.dependent] <= floors) & (pred <= dep))  # at the floor, lower is as good
    res = np.where(needed, np.rint((dep - pred) / params.step), 0).astype(np.int64).ravel()

    # basis: mel DCT x time DCT, dead-zone quantiser
    coefs = forward_transform(x_coded[layout.basis])
    lengths = [c.shape[1] for c in coefs]
    flat = np.concatenate([c.ravel() for c in coefs]) / params.step
    prior = _block_prior(len(layout.basis), lengths, params.step)
    shift = _measure_shift(quantize(flat, _shifted(prior, 0), params.rd_lambda), prior)
    classes = _shifted(prior, shift)
    q = quantize(flat, classes, params.rd_lambda)
    res_class = None
    if np.any(res):
        res_class = _best_shift(np.abs(res).astype(np.float64), np.full(res.size, np.inf),
                                np.zeros(res.size, dtype=np.int64), np.arange(N_CLASSES))
        q = np.concatenate([q, res])
        classes = np.concatenate([classes, np.full(res.size, res_class)])
    body = encode_symbols(q, classes)
    header = PacketHeader(mode, k, floors, shift, res_class)
    return header.serialize() + body


def keepalive() -> bytes:
    """A payload with no frames: what the edge may send during silence."""
    return PacketHeader(None, 0, np.zeros(0, dtype=np.float32)).serialize()


def decode_frames(payload: bytes) -> np.ndarray:
    """Decode one payload -> [128, k] float32 frames (k = 0 for a keep-alive). Any malformed
    payload raises CodecError, after work bounded by the payload's own size."""
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise CodecError(f"payload must be bytes, got {type(payload).__name__}")
    payload = bytes(payload)
    header, pos = PacketHeader.parse(payload)
    k = header.n_frames
    if k == 0:
        return np.zeros((N_MELS, 0), dtype=np.float32)
    if header.at_floor:
        if len(payload) != pos:
            raise CodecError("corrupt payload: bytes after an at-floor header")
        return np.repeat(header.floors[None, :], N_MELS, axis=0)
    params = _MODE_PARAMS[header.mode]
    layout = mel_layout()
    nb = len(layout.basis)
    lengths = [n for _, n in time_blocks(k)]
    classes = _shifted(_block_prior(nb, lengths, params.step), header.shift)
    if header.residual_class is not None:
        classes = np.concatenate([classes, np.full(len(layout.dependent) * k, header.residual_class)])
    body = payload[pos:]
    # every tuple costs at least one bit: a body too short for the claimed frames fails here,
    # before any per-symbol work
    min_bits = _min_body_bits(classes)
    if 8 * len(body) < min_bits:
        raise CodecError(f"payload truncated: {len(body)} body bytes for {k} frames")
    reader = BitReader(body)
    values = decode_symbols(reader, classes)
    if len(body) - (reader.pos + 7) // 8 != 0:
        raise CodecError("corrupt payload: trailing bytes after the body")
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


def _min_body_bits(classes: np.ndarray) -> int:
    """Fewest bits any valid body for these classes can have (one shortest code per tuple)."""
    book = code_book()
    counts = np.bincount(classes, minlength=N_CLASSES)
    tuples = -(-counts // book.group)
    shortest = np.array([int(t.lengths.min()) for t in book.tables])
    bits = np.where(book.group == _SPARSE_GROUP, counts > 0, tuples * shortest)  # all-zero flag
    return int(bits.sum())
