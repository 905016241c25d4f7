"""synth-en's committed weights against the official qwen-asr package, on held-out speech.

The weights are the ones this checkout carries: the shipped model (lab/training/synth-en.*) where it
has it, else the training run's warm-start state (lab/training/warmstart/) exported as an
official-layout checkpoint, the way every evaluation of the run exports it. Unlike the tiny random
checkpoints of test_asr.py, this model stops on its own and says real words, so the comparison runs
over real transcripts of real length: harken's greedy decode gives the official package's tokens,
and on held-out meeting sentences it gives the words that were spoken.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from official import official_generate, use_windowed_attention

from harken.cloud.model.asr import Qwen3ASR
from harken.cloud.model.decode_limits import DecodeLimits
from harken.cloud.model.shipped import META_FILE, SHIPPED_DIR, ensure_synth_en
from harken.training import corpus, speech
from harken.training import state as warm
from harken.training.evaluation import export_state, wer
from harken.edge.features import log_mel

# held-out utterances (lab/training/heldout.jsonl rows): meeting talk in Piper's voice and in three
# espeak-ng voices, and a Bible verse in Piper's voice, harder (where the model gets words wrong,
# they must be the official package's wrong words too)
MEETING = [1, 2, 5, 6]
HARD = [24]
MAX_NEW = 200  # far past any of these transcripts: each generation ends on its own EOS


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("synth_committed")
    if (SHIPPED_DIR / META_FILE).exists():
        return ensure_synth_en(cache_root=root / "cache")
    saved = warm.load()
    if saved is None:
        pytest.fail("this checkout carries neither synth-en's shipped weights nor its warm-start state")
    return export_state(saved, root / "warmstart")


@pytest.fixture(scope="module")
def held_out():
    """{row: (reference text, 16 kHz audio)} rendered as the trainer renders them."""
    rows = corpus.read_held_out()
    return {i: (rows[i].recipe.text, speech.render(rows[i].recipe)) for i in MEETING + HARD}


def test_committed_weights_decode_like_the_official_package(checkpoint, held_out):
    from qwen_asr import Qwen3ASRModel

    cfg = json.loads((checkpoint / "config.json").read_text())
    cfg["transformers_version"] = "4.57.1"  # as test_asr.py: keep Qwen's own pre-tokenizer regex
    (checkpoint / "config.json").write_text(json.dumps(cfg))
    off = Qwen3ASRModel.from_pretrained(str(checkpoint), dtype=torch.float32, max_new_tokens=MAX_NEW)
    use_windowed_attention(off.model)
    asr = Qwen3ASR.load(str(checkpoint), dtype="fp32", device="cpu", max_new_tokens=MAX_NEW)
    for i, (ref, wav) in held_out.items():
        _, expected = official_generate(off, wav, None, "", MAX_NEW)
        assert 5 < len(expected) < MAX_NEW - 1, (i, len(expected))  # real text, ended by EOS
        got = asr.transcribe(log_mel(wav))
        assert got.token_ids == expected, (i, ref, got.text)
        assert got.text == off.transcribe((wav, 16000))[0].text, i


def test_committed_weights_recognise_held_out_meeting_talk(checkpoint, held_out):
    """The path `harken eval` measures (fp32, the decode limits a server applies) on meeting
    sentences the model never trained on: at most 15% WER (the shipping bar), so weights that stop
    recognising speech fail here."""
    asr = Qwen3ASR.load(str(checkpoint), dtype="fp32", device="cpu")
    refs = [held_out[i][0] for i in MEETING]
    hyps = [asr.transcribe(log_mel(held_out[i][1]).astype(np.float32), limits=DecodeLimits()).text
            for i in MEETING]
    assert wer(refs, hyps) <= 0.15, list(zip(refs, hyps))


def test_synth_en_streams_with_the_callers_context_only(tmp_path, monkeypatch):
    """synth-en was trained with an empty system turn: a stream carries no earlier text into it
    (with it, the sample's third sentence came out as `languageA the`); other models do."""
    monkeypatch.setenv("HARKEN_CACHE", str(tmp_path))
    assert Qwen3ASR.load("synth-en", dtype="fp32", device="cpu").reads_context is False
    assert Qwen3ASR.load("tiny", dtype="fp32", device="cpu").reads_context is True
