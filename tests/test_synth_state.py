"""synth-en's warm-start state (lab/training/state.py): the packed tensors are the bf16 values exactly
(the fp16 of format 1 still reads),
a damaged or oversized state is refused, and a tiny run resumed from a packed state carries its step,
weights, audio seen and learning curve over; the average of a run's weights follows its recurrence."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from harken.training import commands
from harken.training import state as warm


def _state(tensors: dict[str, torch.Tensor], step: int = 7) -> dict:
    return {"model": tensors, "step": step, "frames_seen": 123456, "vocab": [5, 9, 151645],
            "phones": [("a", 1), ("b", 2)]}


@pytest.mark.parametrize("fmt,dtype", [(2, torch.bfloat16), (1, torch.float16)])
def test_pack_load_gives_the_16_bit_values_exactly(tmp_path, fmt, dtype):
    g = torch.Generator().manual_seed(0)
    tensors = {"w": torch.randn(64, 33, generator=g) * 3, "b": torch.randn(7, generator=g) * 1e-3,
               "s": torch.tensor(2.5), "big": torch.randn(300, 256, generator=g)}
    _, total = warm.pack(_state(tensors), {"note": "x"}, tmp_path, fmt=fmt)
    assert total == sum(p.stat().st_size for p in tmp_path.iterdir())
    got = warm.load(tmp_path)
    assert got is not None and got["meta"]["format"] == fmt
    assert got["step"] == 7 and got["frames_seen"] == 123456 and got["vocab"] == [5, 9, 151645]
    assert got["phones"] == [("a", 1), ("b", 2)] and got["meta"]["note"] == "x"
    for name, t in tensors.items():
        assert got["model"][name].dtype == torch.float32 and got["model"][name].shape == t.shape
        assert torch.equal(got["model"][name], t.to(dtype).float()), name
    # the byte planes compress better than the interleaved bytes do
    from harken.cloud.base import zstd

    half = tensors["big"].to(dtype)
    raw = half.view(torch.uint8).numpy().tobytes()
    planes = warm._planes(half)
    assert len(zstd.compress(planes, 19)) < len(zstd.compress(raw, 19))


def test_bf16_planes_pack_smaller_than_fp16_ones(tmp_path):
    """What made room for a deeper decoder: the same weights in fewer bytes (the committed state's
    8.8M weights: 11.9 MB in bf16 against 15.0 MB in fp16)."""
    g = torch.Generator().manual_seed(1)
    tensors = {"w": torch.randn(512, 256, generator=g) * 0.05}
    _, bf16 = warm.pack(_state(tensors), {}, tmp_path / "2", fmt=2)
    _, fp16 = warm.pack(_state(tensors), {}, tmp_path / "1", fmt=1)
    assert bf16 < 0.85 * fp16


def test_a_damaged_or_oversized_state_is_refused(tmp_path, monkeypatch):
    tensors = {"w": torch.randn(32, 32)}
    warm.pack(_state(tensors), {}, tmp_path)
    data = bytearray((tmp_path / warm.WEIGHTS_FILE).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (tmp_path / warm.WEIGHTS_FILE).write_bytes(bytes(data))
    with pytest.raises(warm.WarmStartError, match="corrupted"):
        warm.load(tmp_path)
    with pytest.raises(warm.WarmStartError, match="not finite"):
        warm.pack(_state({"w": torch.tensor([1.0, float("nan")])}), {}, tmp_path / "nan")
    monkeypatch.setattr(warm, "MAX_BYTES", 1000)
    with pytest.raises(warm.WarmStartError, match="over the"):
        warm.pack(_state({"w": torch.randn(64, 64)}), {}, tmp_path / "big")
    assert not (tmp_path / "big").exists()
    assert warm.load(tmp_path / "nothing") is None


def test_the_committed_state_fits_and_reads(tmp_path):
    """What the repo carries (if a session committed it): at most 16 MiB, and it loads."""
    meta = warm.read_meta()
    if meta is None:
        pytest.fail("no warm-start state committed in lab/training/warmstart/ (make pack-state, then commit it)")
    size = sum(p.stat().st_size for p in warm.WARMSTART_DIR.iterdir())
    assert size <= warm.MAX_BYTES
    got = warm.load()
    assert got is not None and got["step"] == meta["step"] > 0
    assert {"step", "audio_hours_seen", "heldout_wer", "recipe", "seed", "machine", "history"} <= set(meta)


def _train(out: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "harken.cli", "train", "synth-en", str(out), "--tiny", "--utterances", "6",
           "--phrases", "3", "--texts", "5", "--jumbles", "2", "--jumble-texts", "3", "--prose-texts", "2", "--prose-utterances", "2", "--wordnet-texts", "2", "--wordnet-utterances", "0", "--eval-every", "2", "--eval-n", "2", "--threads", "1", "--workers", "1",
           "--batch-frames", "3000", "--corpus", str(out.parent / "corpus"), *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600)


def test_a_run_resumes_from_a_packed_state_with_its_step_weights_and_curve(tmp_path):
    first = _train(tmp_path / "a", "--steps", "2")
    assert first.returncode == 0, first.stderr[-2000:]
    ws = tmp_path / "warmstart"
    packed = subprocess.run([sys.executable, "-m", "harken.cli", "train", "synth-en", str(tmp_path / "a"), "--pack",
                             "--warmstart", str(ws)], capture_output=True, text=True, timeout=300)
    assert packed.returncode == 0, packed.stderr[-2000:]
    summary = json.loads(packed.stdout)
    assert summary["step"] == 2 and summary["heldout_wer_step"] == 2 and summary["evaluations"] == 1
    assert summary["machine"].startswith("cpu") and summary["recipe"]["config"] == "tiny"
    a_state = torch.load(tmp_path / "a" / "state.pt", weights_only=False)
    # the run keeps an average of its weights (--average-decay 0.999): that is what was measured and packed
    assert summary["weights"] == "average (decay 0.999)" and a_state["average"]["updates"] == 2
    a_log = [json.loads(line) for line in (tmp_path / "a" / "log.jsonl").read_text().splitlines()]
    assert 0 <= a_log[0]["heldout_wer_raw"] and 0 <= a_log[0]["heldout_wer"]
    packed_weights = a_state["model"] | a_state["average"]["params"]
    assert not torch.equal(packed_weights["emb"], a_state["model"]["emb"])

    # a new machine: no state.pt, no corpus, the packed state; --steps 2 trains nothing, so what it
    # saves is what it loaded. --corpus-first: the whole corpus is built before training resumes
    b_corpus = tmp_path / "b-corpus"
    same = _train(tmp_path / "b", "--warmstart", str(ws), "--steps", "2", "--corpus", str(b_corpus), "--corpus-first")
    assert same.returncode == 0, same.stderr[-2000:]
    assert "resumed at step 2 from the warm-start state" in same.stderr
    built = same.stderr.index("building what is missing before training resumes")
    assert built < same.stderr.index("resumed at step 2") and "training starts on its first shards" not in same.stderr
    sizes = {"utterances": 6, "phrases": 3, "texts": 5, "jumbles": 2, "jumble_texts": 3, "prose_texts": 2,
             "prose_utterances": 2, "wordnet_texts": 2, "wordnet_utterances": 0}
    assert commands._corpus_complete(b_corpus, sizes)
    b_state = torch.load(tmp_path / "b" / "state.pt", weights_only=False)
    assert b_state["step"] == 2 and b_state["frames_seen"] == a_state["frames_seen"] > 0
    assert b_state["vocab"] == a_state["vocab"] and b_state["phones"] == a_state["phones"]
    assert b_state["model"].keys() == a_state["model"].keys()
    for name, t in packed_weights.items():
        assert torch.equal(b_state["model"][name], t.to(torch.bfloat16).float()), name

    # and it trains on: step 3, the learning curve of both machines in one log
    on = _train(tmp_path / "b", "--steps", "3", "--corpus", str(b_corpus))
    assert on.returncode == 0, on.stderr[-2000:]
    log = [json.loads(line) for line in (tmp_path / "b" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [2, 3]
    assert log[1]["audio_h"] >= log[0]["audio_h"] and all("machine" in r for r in log)
    c_state = torch.load(tmp_path / "b" / "state.pt", weights_only=False)
    assert c_state["step"] == 3 and c_state["frames_seen"] > a_state["frames_seen"]
    assert not torch.equal(c_state["model"]["emb"], b_state["model"]["emb"])

    # a deeper decoder (--decoder-layers 2 of the tiny 1): the saved run and its average are grown
    # (`growth.py`), a fresh optimiser warms up, and step, average and curve go on
    deeper = _train(tmp_path / "b", "--steps", "4", "--corpus", str(b_corpus), "--decoder-layers", "2")
    assert deeper.returncode == 0, deeper.stderr[-2000:]
    assert "decoder grown from 1 to 2 layers at step 3" in deeper.stderr
    d_state = torch.load(tmp_path / "b" / "state.pt", weights_only=False)
    assert d_state["step"] == 4 and d_state["recipe"]["decoder_layers"] == 2
    assert d_state["average"]["updates"] == c_state["average"]["updates"] + 1  # the average carried over
    assert {k for k in d_state["model"] if k.startswith("layers.1.")} == \
        {k.replace("layers.0.", "layers.1.") for k in c_state["model"] if k.startswith("layers.0.")}
    log = [json.loads(line) for line in (tmp_path / "b" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [2, 3, 4]
    # --no-build: what is built is trained on and nothing more is built, whatever the sizes ask; and
    # without --decoder-layers the grown run keeps its own depth (the plain `make train` goes on)
    files = sorted(p.name for p in b_corpus.iterdir())
    as_built = _train(tmp_path / "b", "--steps", "5", "--corpus", str(b_corpus),
                      "--no-build", "--utterances", "2000", "--texts", "900")
    assert as_built.returncode == 0, as_built.stderr[-2000:]
    assert sorted(p.name for p in b_corpus.iterdir()) == files
    e_state = torch.load(tmp_path / "b" / "state.pt", weights_only=False)
    assert e_state["step"] == 5 and e_state["recipe"]["decoder_layers"] == 2 and "decoder grown" not in as_built.stderr
    assert e_state["model"].keys() == d_state["model"].keys()
    nothing = _train(tmp_path / "c", "--steps", "1", "--corpus", str(tmp_path / "empty"), "--no-build")
    assert nothing.returncode != 0 and "has no utterance shard yet" in nothing.stderr
    assert "Traceback" not in nothing.stderr

    shallower = _train(tmp_path / "b", "--steps", "6", "--corpus", str(b_corpus), "--decoder-layers", "1")
    assert shallower.returncode != 0 and "Traceback" not in shallower.stderr
    assert "the saved run's decoder has 2 layers, more than the 1 of this run" in shallower.stderr


def test_a_tiny_run_refuses_a_synth_en_state(tmp_path):
    from harken.training.examples import Vocab
    from harken.training.train import Trainee, synth_en_config

    model = Trainee(synth_en_config(), Vocab(list(range(20)), 151936), 4, seed=0)
    warm.pack({"model": model.state_dict(), "step": 9, "vocab": list(range(20)), "phones": [("a", 1)]},
              {"config": "synth-en"}, tmp_path / "ws")
    run = _train(tmp_path / "a", "--warmstart", str(tmp_path / "ws"), "--steps", "9")
    assert run.returncode != 0
    assert "a synth-en state, this run trains tiny" in run.stderr and "Traceback" not in run.stderr


def test_the_weight_average_follows_its_recurrence_and_gives_the_weights_back():
    from torch import nn

    from harken.training.averaging import WeightAverage

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4))
    avg = WeightAverage(model, 0.9)
    ref = {k: p.detach().clone() for k, p in model.named_parameters()}
    snapshots = []
    for n in range(30):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        avg.update(model)
        snapshots.append({k: p.detach().clone() for k, p in model.named_parameters()})
        d = min(0.9, n / (n + 1))  # the mean of the steps so far, then exponential
        ref = {k: d * ref[k] + (1 - d) * p.detach() for k, p in model.named_parameters()}
        if n == 5:  # within the decay's time constant (10 steps at 0.9): the plain mean of the six steps
            for k in ref:
                torch.testing.assert_close(avg.params[k], torch.stack([w[k] for w in snapshots]).mean(0))
    own = {k: p.detach().clone() for k, p in model.named_parameters()}
    x = torch.randn(5, 3)
    with avg.applied(model):
        for k, p in model.named_parameters():
            torch.testing.assert_close(p.detach(), ref[k])
        y_avg = model(x)
    for k, p in model.named_parameters():
        assert torch.equal(p.detach(), own[k]), k  # its own weights again, exactly
    assert not torch.allclose(model(x), y_avg)
    again = WeightAverage(model, 0.9, avg.state_dict())  # a resumed run goes on with the same average
    assert again.updates == 30
    assert all(torch.equal(again.params[k], avg.params[k]) for k in ref)
    fresh = WeightAverage(nn.Linear(3, 4), 0.9, avg.state_dict())  # another model's: begun afresh
    assert fresh.updates == 0
