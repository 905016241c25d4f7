"""`harken train synth-align` (lab/training/align_train.py, align_targets.py): espeak-ng word spans as targets,
a toy-size run end to end (corpus, training, export in the official aligner layout, evaluation, resume)."""

from __future__ import annotations

import json

import pytest
import torch

from harken.cloud.model.aligner import Qwen3ForcedAligner, split_words
from harken.training import corpus
from harken.training.align_targets import word_spans
from harken.training.align_train import AlignTrainOptions, soft_targets, train_aligner
from harken.training.espeak_word_ends import word_ends


def test_word_spans_start_before_they_end_and_end_where_word_timing_says():
    u, spans = next((u, s) for i in range(20) if (s := word_spans((u := corpus.plan(0, i, piper_share=0.0)).recipe)))
    assert [w.word for w in spans] == split_words(u.recipe.text)
    ends = [w.end_s for w in word_ends(u.recipe) if split_words(w.word)]
    assert [w.end_s for w in spans] == pytest.approx(ends)
    for a, b in zip(spans, spans[1:]):
        assert a.start_s < a.end_s <= b.start_s + 1e-9
    assert spans[0].start_s >= u.recipe.lead_s - 0.001


def test_soft_targets_peak_at_the_time_bin():
    t = soft_targets([0.0, 0.8, 1.23], classify_num=50)
    assert t.shape == (3, 50)
    assert torch.allclose(t.sum(-1), torch.ones(3))
    assert t.argmax(-1).tolist() == [0, 10, 15]  # 1.23 s = 15.4 bins of 80 ms


def test_toy_training_run_exports_a_loadable_aligner_and_resumes(tmp_path):
    out = tmp_path / "run"
    opts = AlignTrainOptions(out=str(out), utterances=4, steps=2, eval_every=2, eval_n=1, tiny=True,
                             batch_frames=1500, init_from="none")
    row = train_aligner(opts, log=lambda m: None)
    assert row["step"] == 2 and row["utterances"] == 1 and row["boundaries"] >= 2
    assert row["mean_ms"] >= 0 and row["p95_ms"] >= row["p50_ms"]
    log = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert log[-1]["step"] == 2
    aligner = Qwen3ForcedAligner.load(str(out / "checkpoint"))
    assert aligner.config.classify_num == 5000 and aligner.config.timestamp_segment_time == 80.0
    raw = json.loads((out / "checkpoint" / "config.json").read_text())
    assert raw["thinker_config"]["model_type"] == "qwen3_forced_aligner" and raw["timestamp_token_id"] == 151705

    opts.steps = 3
    row = train_aligner(opts, log=lambda m: None)  # resumes from state.pt at step 2
    assert row["step"] == 3
    assert [json.loads(line)["step"] for line in (out / "log.jsonl").read_text().splitlines()] == [2, 3]
