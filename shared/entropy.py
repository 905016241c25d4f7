"""Entropy coding of integer levels that come with a class: the codec's last stage.

Every level has a class c that says what to expect of it: a two-sided geometric distribution
with mean |level| = 2 ** ((c - CLASS_ZERO) / 2). Each class owns a static canonical Huffman code
over tuples of 1, 2, 3 or 4 levels (tuples make near-zero classes cost well under a bit per
level), built once from that model, with an escape after which the tuple's levels follow as signed
Exp-Golomb. Levels are coded class by class, each class run zero-padded to whole tuples; a run of
a sparse class opens with one bit that says "all zero".

Encoding is vectorised in numpy (no Python loop over levels: it runs on the edge, inside the
RTF budget). Decoding walks the bits one tuple at a time; it runs in the cloud, compiled with numba
where numba is installed (shared/entropy_jit.py, given this module's tables flattened into arrays:
`flat_tables`), in Python elsewhere (`decode_symbols`); `decode_levels` picks.
Tables are a function of the class alone, so they are part of the codec's format version.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from . import entropy_jit
from .errors import CodecError

N_CLASSES = 28
CLASS_ZERO = 16  # the class whose levels have mean |level| 1
MAX_LEVEL = 1 << 31


def class_mean_abs(c: int) -> float:
    """Expected |level| of class c: 2 ** ((c - CLASS_ZERO) / 2), from ldexp and sqrt alone, which
    IEEE rounds the same everywhere (the code tables must be bit-identical on edge and cloud)."""
    half_octaves = int(c) - CLASS_ZERO
    return math.ldexp(math.sqrt(2.0) if half_octaves % 2 else 1.0, half_octaves // 2)


@lru_cache(maxsize=1)
def class_bit_costs() -> tuple[np.ndarray, np.ndarray]:
    """Per class (a, b): a value v costs about a + b |v| bits under the class's geometric model."""
    m = np.array([class_mean_abs(c) for c in range(N_CLASSES)])
    theta = (np.sqrt(1.0 + m * m) - 1.0) / m
    return -np.log2((1.0 - theta) / (1.0 + theta)), -np.log2(theta)


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
    # fast decoding: the next LUT_BITS bits -> (symbol, length), length 0 for longer codes
    lut_symbol: tuple[int, ...]
    lut_length: tuple[int, ...]
    digits: tuple[tuple[int, ...], ...]  # the levels of each symbol's tuple (escape: ())


def _huffman_lengths(weights: list[int]) -> np.ndarray:
    """Code lengths of a Huffman code for integer weights (exact sums, ties broken by index)."""
    p = weights
    heap: list[tuple[int, int, tuple[int, ...]]] = [(q, i, (i,)) for i, q in enumerate(p)]
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


SPARSE_GROUP = 4  # runs of classes coded in 4-tuples open with an all-zero flag bit
LUT_BITS = 10  # decoding looks codes up to this length in a table


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


_WEIGHT_BITS = 40  # tuple probabilities become integers of this precision before Huffman
_MIN_WEIGHT = 1 << (_WEIGHT_BITS - 18)  # bounds code lengths and keeps the escape codable


def _build_table(mean_abs: float) -> CodeTable:
    """Huffman code for a two-sided geometric source with the given mean |value|. Only IEEE
    basic operations (+ - * / sqrt, no pow or log) feed the integer weights, so every platform
    builds the same table."""
    theta = (math.sqrt(1.0 + mean_abs * mean_abs) - 1.0) / mean_abs
    group, radius = _tuple_shape(mean_abs)
    powers = [1.0]
    for _ in range(radius):
        powers.append(powers[-1] * theta)
    p0 = (1.0 - theta) / (1.0 + theta)
    p1 = np.array([p0 * powers[abs(v)] for v in range(-radius, radius + 1)])
    p = p1
    for _ in range(group - 1):
        p = (p[:, None] * p1[None, :]).ravel()  # tuple index = digits in base 2r+1, first digit high
    weights = [max(int(w), _MIN_WEIGHT) for w in np.floor(p * float(1 << _WEIGHT_BITS))]
    weights.append(max((1 << _WEIGHT_BITS) - sum(weights), _MIN_WEIGHT))  # the escape
    lengths = _huffman_lengths(weights)
    p = np.asarray(weights)
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
    lut_symbol, lut_length = [0] * (1 << LUT_BITS), [0] * (1 << LUT_BITS)
    for s, (c, n) in enumerate(zip(codes.tolist(), lengths.tolist())):
        if n <= LUT_BITS:
            lo = c << (LUT_BITS - n)
            lut_symbol[lo:lo + (1 << (LUT_BITS - n))] = [s] * (1 << (LUT_BITS - n))
            lut_length[lo:lo + (1 << (LUT_BITS - n))] = [n] * (1 << (LUT_BITS - n))
    width = 2 * radius + 1
    digits = tuple(tuple((s // width ** (group - 1 - g)) % width - radius for g in range(group))
                   for s in range(len(p) - 1)) + ((),)
    return CodeTable(group, radius, len(p) - 1, codes, lengths, tuple(first_code), tuple(first_index),
                     tuple(count), tuple(int(s) for s in order), tuple(lut_symbol), tuple(lut_length), digits)


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
    tables = tuple(_build_table(class_mean_abs(c)) for c in range(N_CLASSES))
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
    run is zero-padded to whole tuples. Vectorised: no Python loop over symbols or classes.
    |q| < 2**31 (an escaped level's Exp-Golomb word must fit 64 bits)."""
    if len(q) == 0:
        return b""
    if np.abs(q).max() >= MAX_LEVEL:
        raise CodecError(f"level out of range: |q| must stay below {MAX_LEVEL}")
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
    sparse = g_run == SPARSE_GROUP
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
        bits = np.unpackbits(np.frombuffer(data, dtype=np.uint8))
        self.bits = bits.tolist()
        self.pos = 0
        # windows[p]: the LUT_BITS bits from p on (zeros past the end), one table look-up per code
        padded = np.concatenate([bits, np.zeros(LUT_BITS, dtype=np.uint8)]).astype(np.int64)
        windows = np.zeros(len(bits), dtype=np.int64)
        for i in range(LUT_BITS):
            windows = (windows << 1) | padded[i:i + len(bits)]
        self.windows = windows.tolist()

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
        n_tuples = -(-(b - a) // t.group)
        if t.group == SPARSE_GROUP and reader.read(1):
            continue  # an all-zero run
        vals: list[int] = []
        windows, end = reader.windows, len(reader.bits)
        lut_symbol, lut_length, digits, escape = t.lut_symbol, t.lut_length, t.digits, t.escape
        for _ in range(n_tuples):
            pos = reader.pos
            if pos >= end:
                raise CodecError("payload truncated: entropy-coded body ends early")
            w = windows[pos]
            n = lut_length[w]
            if n and pos + n <= end:
                sym = lut_symbol[w]
                reader.pos = pos + n
            else:
                sym = reader.read_symbol(t)
            if sym == escape:
                vals.extend(reader.read_exp_golomb() for _ in range(t.group))
            else:
                vals.extend(digits[sym])
        out_sorted[a:b] = vals[: b - a]
    out = np.empty_like(out_sorted)
    out[order] = out_sorted
    return out


@lru_cache(maxsize=1)
def _shortest_codes() -> np.ndarray:
    return np.array([int(t.lengths.min()) for t in code_book().tables])


def min_body_bits(classes: np.ndarray) -> int:
    """Fewest bits any valid body for these classes can have (one shortest code per tuple)."""
    book = code_book()
    counts = np.bincount(classes, minlength=N_CLASSES)
    tuples = -(-counts // book.group)
    shortest = _shortest_codes()
    bits = np.where(book.group == SPARSE_GROUP, counts > 0, tuples * shortest)  # all-zero flag
    return int(bits.sum())


@dataclass(frozen=True)
class FlatTables:
    """The code book's decoding tables as flat int64 arrays, per class at a fixed stride (LUT:
    2 ** LUT_BITS entries, canonical rows: 64) or at an offset (`order`, `digits`): what the
    compiled walk takes as arguments (shared/entropy_jit.py)."""

    group: np.ndarray
    escape: np.ndarray
    lut_symbol: np.ndarray
    lut_length: np.ndarray
    first_code: np.ndarray
    first_index: np.ndarray
    count: np.ndarray
    order: np.ndarray
    order_off: np.ndarray
    digits: np.ndarray  # per class [escape, group] levels, row-major
    digit_off: np.ndarray


@lru_cache(maxsize=1)
def flat_tables() -> FlatTables:
    tables = code_book().tables

    def flat(rows):
        return np.ascontiguousarray(np.concatenate([np.asarray(r, dtype=np.int64) for r in rows]))

    def offsets(sizes):
        sizes = np.asarray(sizes, dtype=np.int64)
        return np.cumsum(sizes) - sizes

    digits = [np.asarray(t.digits[:t.escape], dtype=np.int64).reshape(-1) for t in tables]
    return FlatTables(
        group=np.array([t.group for t in tables], dtype=np.int64),
        escape=np.array([t.escape for t in tables], dtype=np.int64),
        lut_symbol=flat(t.lut_symbol for t in tables), lut_length=flat(t.lut_length for t in tables),
        first_code=flat(t.first_code for t in tables), first_index=flat(t.first_index for t in tables),
        count=flat(t.count for t in tables),
        order=flat(t.order for t in tables), order_off=offsets([len(t.order) for t in tables]),
        digits=flat(digits), digit_off=offsets([len(d) for d in digits]))


@dataclass(frozen=True)
class ClassLayout:
    """The coding order of a packet's levels: its class runs, and where each level goes back."""

    order: np.ndarray
    run_cls: np.ndarray
    run_len: np.ndarray


# by the classes array itself (the codec's per packet shape, shared/codec.py `_packet_classes`: a
# handful of frame counts x modes x shifts); the array is held, so its id stays its own
_LAYOUTS: dict[int, tuple[np.ndarray, ClassLayout]] = {}


def class_layout(classes: np.ndarray) -> ClassLayout:
    hit = _LAYOUTS.get(id(classes))
    if hit is not None and hit[0] is classes and not classes.flags.writeable:
        return hit[1]
    order = _symbol_order(classes)
    sorted_cls = classes[order].astype(np.int64)
    starts = np.r_[0, np.flatnonzero(np.diff(sorted_cls)) + 1]
    lengths = np.diff(np.r_[starts, len(classes)]).astype(np.int64)
    layout = ClassLayout(order, sorted_cls[starts] if len(classes) else sorted_cls[:0], lengths)
    if not classes.flags.writeable:  # a read-only array cannot change under its cached layout
        if len(_LAYOUTS) >= 512:
            _LAYOUTS.clear()
        _LAYOUTS[id(classes)] = (classes, layout)
    return layout


def decode_levels(body: bytes, classes: np.ndarray, compiled: bool | None = None) -> tuple[np.ndarray, np.ndarray, int]:
    """The levels of an entropy-coded body for these classes (inverse of encode_symbols): ->
    (levels [n] int64, the body's bits, how many of them the levels took). CodecError for a body
    that is not valid. `compiled`: the numba walk (default where numba is installed) or the
    Python one; both give the same levels and the same errors."""
    bits = np.unpackbits(np.frombuffer(body, dtype=np.uint8))
    walk = entropy_jit.compiled() if compiled is None or compiled else None
    if walk is None:
        if compiled:
            raise RuntimeError("the compiled entropy walk needs numba")
        reader = BitReader(body)
        return decode_symbols(reader, classes), bits, reader.pos
    layout = class_layout(classes)
    t = flat_tables()
    out_sorted = np.zeros(len(classes), dtype=np.int64)
    pos = walk(bits, layout.run_cls, layout.run_len, SPARSE_GROUP, LUT_BITS, t.group, t.escape,
                           t.lut_symbol, t.lut_length, t.first_code, t.first_index, t.count, t.order, t.order_off,
                           t.digits, t.digit_off, out_sorted)
    if pos < 0:
        raise CodecError(entropy_jit.ERRORS[pos])
    out = np.empty_like(out_sorted)
    out[layout.order] = out_sorted
    return out, bits, int(pos)
