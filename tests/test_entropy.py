"""shared/entropy: class Huffman tuple codes are complete prefix codes close to their model's
entropy, and levels round-trip through them exactly."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harken.shared import entropy
from harken.shared.entropy import N_CLASSES, BitReader, CodecError, code_book, decode_symbols, encode_symbols


def test_class_means_are_half_octaves():
    for c in range(N_CLASSES):
        assert entropy.class_mean_abs(c) == pytest.approx(2.0 ** ((c - entropy.CLASS_ZERO) / 2), rel=1e-15)


@pytest.mark.parametrize("c", range(N_CLASSES))
def test_tables_are_complete_prefix_codes(c):
    t = code_book().tables[c]
    lengths = [int(n) for n in t.lengths]
    # Kraft equality: every bit string decodes (no invalid code words), none is a prefix of another
    assert sum(2.0 ** -n for n in lengths) == pytest.approx(1.0, abs=1e-12)
    for sym in range(len(lengths)):
        bits = format(int(t.codes[sym]), f"0{lengths[sym]}b")
        reader = BitReader(np.packbits(np.array([int(b) for b in bits], dtype=np.uint8)).tobytes())
        assert reader.read_symbol(t) == sym and reader.pos == lengths[sym]


@pytest.mark.parametrize("c", range(0, N_CLASSES, 3))
def test_code_length_is_within_huffman_bound_of_the_model(c):
    t = code_book().tables[c]
    rng = np.random.default_rng(c)
    # levels drawn from the class's own model: two-sided geometric with the class's mean |level|
    m = entropy.class_mean_abs(c)
    theta = (np.sqrt(1 + m * m) - 1) / m
    mags = rng.geometric(1 - theta, 20_000) - 1
    levels = np.where(rng.random(mags.size) < 0.5, -mags, mags)
    bits = 8 * len(encode_symbols(levels, np.full(levels.size, c)))
    p0 = (1 - theta) / (1 + theta)
    entropy_bits = -(np.log2(p0) + np.abs(levels) * np.log2(theta)).sum()
    # Huffman is under one bit per tuple above the entropy; escapes add a little at the tails
    assert bits <= entropy_bits + levels.size / t.group + 0.02 * entropy_bits + 64


def test_tables_are_rebuilt_identically():
    a = entropy._build_table(entropy.class_mean_abs(13))
    b = entropy._build_table(entropy.class_mean_abs(13))
    assert np.array_equal(a.codes, b.codes) and np.array_equal(a.lengths, b.lengths)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.integers(0, N_CLASSES - 1), st.integers(-3000, 3000)), max_size=300))
def test_levels_round_trip(pairs):
    classes = np.array([c for c, _ in pairs], dtype=np.int64)
    levels = np.array([v for _, v in pairs], dtype=np.int64)
    body = encode_symbols(levels, classes)
    reader = BitReader(body)
    np.testing.assert_array_equal(decode_symbols(reader, classes), levels)
    assert (reader.pos + 7) // 8 == len(body)


def test_extreme_levels_round_trip():
    levels = np.array([2**30, -(2**30), 0, 1, -1, 12345], dtype=np.int64)
    for c in (0, entropy.CLASS_ZERO, N_CLASSES - 1):
        classes = np.full(levels.size, c)
        np.testing.assert_array_equal(decode_symbols(BitReader(encode_symbols(levels, classes)), classes), levels)


def test_levels_beyond_the_limit_are_refused():
    with pytest.raises(CodecError):
        encode_symbols(np.array([entropy.MAX_LEVEL]), np.array([3]))


def test_all_zero_sparse_runs_cost_one_bit():
    classes = np.zeros(1000, dtype=np.int64)
    assert code_book().group[0] == entropy.SPARSE_GROUP
    assert len(encode_symbols(np.zeros(1000, dtype=np.int64), classes)) == 1


def test_running_out_of_bits_raises():
    levels = np.arange(-50, 50)
    classes = np.full(levels.size, entropy.CLASS_ZERO)
    body = encode_symbols(levels, classes)
    with pytest.raises(CodecError, match="truncated"):
        decode_symbols(BitReader(body[: len(body) // 2]), classes)


def test_min_body_bits_is_a_lower_bound():
    rng = np.random.default_rng(5)
    for _ in range(20):
        classes = rng.integers(0, N_CLASSES, 500)
        levels = np.zeros(500, dtype=np.int64)  # the cheapest levels there are
        assert 8 * len(encode_symbols(levels, classes)) >= entropy.min_body_bits(classes)


# ---- the compiled walk (shared/entropy_jit.py) against the Python one ------------------------------

def both_walks(body: bytes, classes: np.ndarray):
    """(levels, bits used) or the error's message, from each walk."""
    out = []
    for compiled in (False, True):
        try:
            levels, _, used = entropy.decode_levels(body, classes, compiled=compiled)
            out.append((levels.tolist(), used))
        except CodecError as e:
            out.append(str(e))
    return out


@st.composite
def coded(draw):
    """Classes and levels (mostly small, some escaped and huge), their body, and a way to break it."""
    n = draw(st.integers(1, 300))
    classes = np.array(draw(st.lists(st.integers(0, N_CLASSES - 1), min_size=n, max_size=n)), dtype=np.int64)
    small = st.integers(-3, 3)
    levels = np.array(draw(st.lists(st.one_of(small, small, small, st.integers(-(1 << 30), 1 << 30)),
                                    min_size=n, max_size=n)), dtype=np.int64)
    return classes, levels, encode_symbols(levels, classes)


@pytest.mark.skipif(not entropy.entropy_jit.available(), reason="numba is not installed")
@settings(max_examples=300, deadline=None)
@given(coded(), st.sampled_from(["valid", "cut", "flipped", "random"]), st.data())
def test_the_compiled_walk_gives_the_python_walks_levels_or_its_error(case, how, data):
    classes, levels, body = case
    if how == "cut":
        body = body[:data.draw(st.integers(0, max(0, len(body) - 1)))]
    elif how == "flipped" and body:
        b = bytearray(body)
        for _ in range(data.draw(st.integers(1, 4))):
            i = data.draw(st.integers(0, 8 * len(b) - 1))
            b[i // 8] ^= 0x80 >> (i % 8)
        body = bytes(b)
    elif how == "random":
        body = data.draw(st.binary(max_size=len(body) + 8))
    python, compiled = both_walks(body, classes)
    assert compiled == python
    if how == "valid":
        assert python[0] == levels.tolist()


@pytest.mark.skipif(not entropy.entropy_jit.available(), reason="numba is not installed")
def test_the_compiled_walk_on_every_error_and_an_empty_body():
    classes = np.full(8, entropy.CLASS_ZERO)  # pairs, radius 7: escapes are easy to write
    table = code_book().tables[entropy.CLASS_ZERO]
    esc = format(int(table.codes[table.escape]), f"0{int(table.lengths[table.escape])}b")
    too_long = esc + "0" * 45  # an escape's Exp-Golomb prefix past 40 zeros
    body = np.packbits(np.array([int(b) for b in too_long], dtype=np.uint8)).tobytes()
    python, compiled = both_walks(body, classes)
    assert python == compiled == "corrupt payload: escape value too long"
    assert both_walks(b"", classes) == ["payload truncated: entropy-coded body ends early"] * 2
    assert both_walks(b"", classes[:0]) == [([], 0)] * 2
