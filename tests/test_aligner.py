"""Qwen3-ForcedAligner in harken's torch code (cloud/model/aligner.py, tiny_aligner.py, harken/commands/align.py)
against the official qwen-asr 0.0.6 `Qwen3ForcedAligner`.

One tiny random aligner checkpoint in the released layout (`make_tiny_aligner`: thinker_config.model_type
qwen3_forced_aligner, classify_num, top-level timestamp_token_id / timestamp_segment_time, an untied
[classify_num, hidden] head, `<timestamp>` at id 151705) is built per module and loaded by BOTH sides:
the official `Qwen3ForcedAligner.from_pretrained` (its real loading path) and harken's
`Qwen3ForcedAligner.load`. Both run in float64 (QWEN3_ASR.md: compare numerics in float64), the
official audio tower with its attention confined to the 8-s windows (official.use_windowed_attention),
and both get the official processor's features, so times must be identical, not close.

The word splitting and `fix_timestamp` are compared with the official processor's functions on many
generated inputs.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys

import numpy as np
import pytest
import torch
from official import use_windowed_attention
from signals import SR, concat, noise, silence, speech, write_wav

from harken.cloud.model.aligner import (AlignRequest, Qwen3ForcedAligner, build_aligner_prompt, fix_timestamp,
                                        split_words)
from harken.cloud.model.tiny_aligner import make_tiny_aligner
from harken.shared.errors import ModelError

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello, world! It's 3 o'clock -- time for tea?",
    "one",
    "Mixed 中文 text, with 汉字 inside words like abc中def and numbers 12,345.",
    "  spaces\tand\nnewlines   everywhere ... ",
    "Déjà vu: naïve café, Straße und Übermut!",
]


@pytest.fixture(scope="module")
def official_processor():
    from qwen_asr.inference.qwen3_forced_aligner import Qwen3ForceAlignProcessor

    return Qwen3ForceAlignProcessor()


# --- pure functions: word splitting and the monotonic repair --------------------------------------------

def _random_text(rng: random.Random) -> str:
    alphabet = ("abcdefghijklmnopqrstuvwxyzABCXYZ0123456789'''   \t\n.,;:!?-\"()[]{}@#$%&*/\\"
                "中文汉字語音識別éüßçñÅΩж的一是不了") + "\u00a0\u2019\u3000\u0301"
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 60)))


def test_word_splitting_equals_the_official_processor(official_processor):
    rng = random.Random(0)
    texts = TEXTS + [_random_text(rng) for _ in range(2000)]
    for text in texts:
        for language in ("English", "Chinese", "German"):
            words, prompt_text = official_processor.encode_timestamp(text, language)
            assert split_words(text, language) == words, text


def test_japanese_and_korean_are_refused_with_a_reason():
    for language in ("Japanese", "korean"):
        with pytest.raises(ModelError, match="Japanese and Korean"):
            split_words("テスト", language)


def _random_series(rng: random.Random) -> np.ndarray:
    n = rng.randint(1, 40)
    kind = rng.random()
    if kind < 0.3:  # mostly increasing with outliers, as a trained aligner gives
        x = np.cumsum([rng.randint(0, 5) for _ in range(n)])
        for _ in range(rng.randint(0, 4)):
            x[rng.randrange(n)] = rng.randint(0, 200)
    elif kind < 0.5:  # runs of zeros and of large values (the > 2 interpolation branch)
        x = np.array([rng.choice([0, 0, 0, 999, rng.randint(0, 100)]) for _ in range(n)])
    else:
        x = np.array([rng.randint(0, 30) for _ in range(n)])
    return (x * 80.0).astype(np.float32)  # bins * 80 ms, float32 like the official tensor


def test_fix_timestamp_equals_the_official_one(official_processor):
    rng = random.Random(1)
    series = [_random_series(rng) for _ in range(3000)]
    series += [np.array(v, dtype=np.float32) for v in (
        [0.0], [5.0, 1.0], [1.0, 5.0, 2.0, 3.0], [9.0, 8.0, 7.0, 6.0, 5.0], [0.0, 800.0, 80.0, 80.0, 160.0],
        [80.0, 4000.0, 160.0, 240.0], [500.0, 80.0, 160.0], [80.0, 160.0, 240.0, 320.0, 0.0, 0.0, 0.0, 800.0])]
    for x in series:
        assert fix_timestamp(x) == official_processor.fix_timestamp(x), x.tolist()
    assert fix_timestamp([]) == []


# --- the model against the official package ----------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_aligner(tmp_path_factory.mktemp("aligner") / "tiny", seed=1)


@pytest.fixture(scope="module")
def official(tiny_dir):
    from qwen_asr.inference.qwen3_forced_aligner import Qwen3ForcedAligner as Official

    off = Official.from_pretrained(str(tiny_dir), dtype=torch.float64)
    use_windowed_attention(off.model)
    return off


@pytest.fixture(scope="module")
def harken(tiny_dir):
    return Qwen3ForcedAligner.load(str(tiny_dir), dtype="fp64", device="cpu")


def _audio(seconds: float, seed: int) -> np.ndarray:
    """Speech-like audio of exactly `seconds`: espeak-ng speech over noise, cut or padded."""
    x = concat(silence(0.2), speech("testing the aligner one two three"), noise(10.0, 0.05, seed=seed))
    n = int(seconds * SR)
    return (x[:n] if len(x) >= n else np.pad(x, (0, n - len(x)))).astype(np.float32)


CASES = [(0.43, TEXTS[2]), (1.0, TEXTS[0]), (2.37, TEXTS[1]), (5.0, TEXTS[3]), (9.61, TEXTS[0] + " " + TEXTS[5]),
         (3.3, TEXTS[4])]


def _official_features(off, audio: np.ndarray, text: str) -> np.ndarray:
    prompt = off.aligner_processor.encode_timestamp(text, "English")[1]
    inputs = off.processor(text=[prompt], audio=[audio], return_tensors="np", padding=True)
    n = int(inputs["feature_attention_mask"].sum())
    return inputs["input_features"][0][:, :n]


def _times(result) -> list[tuple[str, float, float]]:
    return [(w.text, w.start, w.end) for w in result]


@pytest.mark.parametrize("seconds,text", CASES)
def test_times_equal_the_official_aligner(official, harken, seconds, text):
    audio = _audio(seconds, seed=int(seconds * 100))
    ref = official.align(audio=(audio, SR), text=text, language="English")[0]
    got = harken.align(_official_features(official, audio, text), text, "English")
    assert _times(got) == [(i.text, i.start_time, i.end_time) for i in ref]


def test_prompt_and_raw_bins_equal_the_official_model(official, harken):
    """Below the repair: the same input ids and the same head outputs at the <timestamp> positions."""
    audio, text = _audio(2.37, seed=7), TEXTS[1]
    words, prompt = official.aligner_processor.encode_timestamp(text, "English")
    inputs = official.processor(text=[prompt], audio=[audio], return_tensors="pt", padding=True)
    inputs = inputs.to(torch.float64)
    with torch.no_grad():
        logits = official.model.thinker(**inputs).logits[0]
    ids = inputs["input_ids"][0]
    ref = logits[ids == official.timestamp_token_id]

    feats = _official_features(official, audio, text)
    audio_emb = harken.encoder(harken._features(feats))
    p = build_aligner_prompt(harken.tokenizer, audio_emb.shape[0], split_words(text), harken.config.timestamp_token_id)
    assert p.ids == ids.tolist()
    got = harken.timestamp_logits([p], [audio_emb])[0]
    assert torch.allclose(got, ref, atol=1e-9, rtol=1e-9)
    assert got.argmax(-1).tolist() == ref.argmax(-1).tolist()


def test_batched_equals_one_at_a_time(official, harken):
    requests = [AlignRequest(_official_features(official, _audio(s, seed=i), t), t) for i, (s, t) in enumerate(CASES)]
    requests.insert(2, AlignRequest(requests[0].features, "?!"))  # no words: [] and no work
    batched = harken.align_batch(requests)
    assert batched[2] == []
    for r, b in zip(requests, batched):
        assert harken.align(r.features, r.text) == b


def test_batch_equals_the_official_batch(official, harken):
    """Same-length audio (the official processor pads audio of different lengths, which changes the last
    frames' features), different texts: the official left-padded batch and harken's packed pass agree."""
    audios = [_audio(2.0, seed=s) for s in (1, 2, 3)]
    texts = [TEXTS[0], TEXTS[2], TEXTS[3]]
    ref = official.align(audio=[(a, SR) for a in audios], text=texts, language="English")
    got = harken.align_batch([AlignRequest(_official_features(official, a, t), t) for a, t in zip(audios, texts)])
    for r, g in zip(ref, got):
        assert _times(g) == [(i.text, i.start_time, i.end_time) for i in r]


def test_float32_gives_the_same_times(tiny_dir, official, harken):
    """The default CPU dtype: the same bins as float64 on these cases (loose: a near-tie may flip)."""
    h32 = Qwen3ForcedAligner.load(str(tiny_dir), dtype="fp32", device="cpu")
    same = total = 0
    for i, (s, t) in enumerate(CASES):
        f = _official_features(official, _audio(s, seed=i), t)
        a, b = h32.align(f, t), harken.align(f, t)
        same += sum(x == y for x, y in zip(a, b))
        total += len(b)
    assert same >= 0.9 * total


def test_a_recogniser_checkpoint_is_refused(tmp_path):
    from harken.cloud.model.tiny import make_tiny_model

    d = make_tiny_model(tmp_path / "asr", vocab="small")
    with pytest.raises(ModelError, match="not a Qwen3-ForcedAligner"):
        Qwen3ForcedAligner.load(str(d))


# --- the command -------------------------------------------------------------------------------------------

def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "harken.cli", "align", *args], capture_output=True, text=True,
                          timeout=300)


def test_align_command_json_equals_the_library(tmp_path, tiny_dir, harken):
    from harken.edge.audio import load_audio, peak_normalize
    from harken.edge.features import log_mel

    wav = write_wav(tmp_path / "a.wav", _audio(2.37, seed=3))
    text = TEXTS[1]
    out = _run(str(wav), "--text", text, "--model", str(tiny_dir), "--json", "--dtype", "fp64")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    want = harken.align(log_mel(peak_normalize(load_audio(wav))), text)
    assert doc["words"] == [w.as_dict() for w in want]
    assert doc["duration"] == 2.37 and doc["language"] == "English"

    (tmp_path / "t.txt").write_text(text, encoding="utf-8")
    plain = _run(str(wav), "--text-file", str(tmp_path / "t.txt"), "--model", str(tiny_dir), "--dtype", "fp64")
    assert plain.returncode == 0, plain.stderr
    lines = plain.stdout.strip().splitlines()
    assert [line.split()[-1] for line in lines] == [w.text for w in want]
    assert [float(line.split()[0]) for line in lines] == [w.start for w in want]


@pytest.mark.parametrize("args,message", [
    (["missing.wav", "--text", "hi"], "no such file"),
    (["{wav}", "--text", "  "], "transcript is empty"),
    (["{wav}", "--text", "?!"], "no words to align"),
    (["{wav}"], "exactly one of --text or --text-file"),
    (["{wav}", "--text", "hi", "--language", "Japanese"], "Japanese and Korean"),
    (["{wav}", "--text", "hi", "--model", "{asr}"], "not a Qwen3-ForcedAligner"),
])
def test_align_command_bad_input_is_one_line(tmp_path, args, message):
    from harken.cloud.model.tiny import make_tiny_model

    wav = write_wav(tmp_path / "a.wav", _audio(0.5, seed=0))
    asr = tmp_path / "asr"
    if "{asr}" in args:
        make_tiny_model(asr, vocab="small")
    out = _run(*[a.format(wav=wav, asr=asr) for a in args])
    assert out.returncode == 2
    assert message in out.stderr and "Traceback" not in out.stderr
