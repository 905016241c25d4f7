"""The GPU checks of `make test-gpu` / `make bench-device` (deploy/device/bench.sh), each with a CPU
variant that runs in `make test`, so the logic is exercised on every machine and a lent GPU's
minutes are never spent on debugging it:

- bf16 vs fp32: encoder outputs and decoder logits within BF16_REL_TOL (relative L2 error);
- the static padded decode step (CUDA graphs replayed, on a GPU) gives the plain step's events for
  several batched sessions through the engine (`EngineConfig.decode_step`), and the graphs replay
  exactly what the same step computes eagerly, token for token;
- batched sessions == the same sessions one at a time, on the device;
- the incremental encoder == a full re-encode, on the device;
- the engine's transcript on the device == on the CPU, for the tiny checkpoint.

Only the device's own packages are imported here (torch, numpy, the repo): the device image has no
transformers, soundfile or espeak-ng. On CUDA the float32 checks turn TF32 off (cuDNN uses it for
convolutions by default), so that float32 means float32.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from harken.cloud.inference.commit import CommitPolicy
from harken.cloud.inference.engine import Engine, EngineConfig
from harken.cloud.model.asr import Qwen3ASR
from harken.cloud.model.config import Qwen3ASRConfig
from harken.cloud.model.decoder import Qwen3Decoder, decode_step, prefill
from harken.cloud.model.encoder import AudioEncoder, IncrementalEncoder
from harken.cloud.model.kv_cache import KVCache
from harken.cloud.model.static_decode import StaticDecodeStep
from harken.cloud.inference.decoder_stream import SessionOptions
from streaming import make_segments, run_alone, run_batched, talkative_tiny
from streaming import workloads as _workloads

BF16_REL_TOL = 0.03  # ||bf16 - fp32|| / ||fp32|| of encoder outputs and logits (8-bit mantissa, a few layers)
FP32_REL_TOL = 1e-4  # float32 on another device (other kernels, other summation orders)

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
POLICY = CommitPolicy(max_item_tokens=10, max_new_tokens_per_update=4, rollback_tokens=2)


@pytest.fixture(autouse=True)
def strict_float32():
    """float32 without TF32 on CUDA (cuDNN's convolutions use TF32 by default)."""
    if not torch.cuda.is_available():
        yield
        return
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def need(device: str) -> None:
    if device == "cuda" and not torch.cuda.is_available():
        pytest.fail("a gpu test selected on a machine without CUDA")


def moved(asr: Qwen3ASR, device: str, dtype: torch.dtype = torch.float32) -> Qwen3ASR:
    """A copy of `asr` on `device` in `dtype` (the same weights, rounded)."""
    enc = copy.deepcopy(asr.encoder).to(device=device, dtype=dtype)
    dec = copy.deepcopy(asr.decoder).to(device=device, dtype=dtype)
    return Qwen3ASR(asr.config, enc, dec, asr.tokenizer, asr.max_new_tokens)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).norm() / b.norm())


def workloads(n: int):
    return _workloads(n, seed=300, english=lambda i: i % 2 == 0)


@pytest.fixture(scope="module")
def talkative():
    return talkative_tiny()


# --- precision ------------------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
def test_bf16_within_tolerance_of_fp32(device, asr):
    """The tiny checkpoint in bf16 (the GPU dtype) on the device: encoder outputs and the decoder's
    prompt logits within BF16_REL_TOL of fp32; fp32 on the device within FP32_REL_TOL of the CPU's."""
    need(device)
    feats = torch.from_numpy(make_segments([6.0], [0.0], seed=7)[0].frames.copy()) / 4.0 + 1.0
    with torch.no_grad():
        ref_audio = asr.encoder(feats)
        _, ref_embeds = asr.prompt_embeddings(feats, "English")
        ref = asr.decoder(ref_embeds[None])[0]
        for dtype, tol in ((torch.float32, FP32_REL_TOL), (torch.bfloat16, BF16_REL_TOL)):
            m = moved(asr, device, dtype)
            audio = m.encoder(feats.to(device, dtype))
            logits = m.decoder(ref_embeds[None].to(device, dtype))[0]
            assert torch.isfinite(audio).all() and torch.isfinite(logits).all()
            assert rel(audio, ref_audio) <= tol, (dtype, "encoder", rel(audio, ref_audio))
            assert rel(logits, ref) <= tol, (dtype, "logits", rel(logits, ref))


# --- the decode step ------------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
def test_engine_static_decode_step_gives_the_plain_steps_events(device, talkative):
    """Several sessions batched through the engine (joins, partial batches, budgets): the static
    padded step (on CUDA: its captured graphs replayed) gives exactly the plain step's events."""
    need(device)
    asr = moved(talkative, device)
    work = workloads(5)
    plain = run_batched(Engine(asr, EngineConfig(max_sessions=5, max_batch=4, slot_policy=POLICY)), work)
    kind = "graphs" if device == "cuda" else "static"
    engine = Engine(asr, EngineConfig(max_sessions=5, max_batch=4, slot_policy=POLICY, decode_step=kind))
    assert engine.cache.max_slots == 6  # one for the padding rows
    static = run_batched(engine, work)
    assert static == plain
    assert any(any(e.committed_delta for e in evs) for evs in plain)
    if kind == "graphs":
        assert engine._static is not None and engine._static._graphs  # graphs were captured and replayed


def test_engine_decode_step_options_are_checked(talkative):
    with pytest.raises(ValueError, match="decode_step"):
        EngineConfig(decode_step="fast")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA"):
            Engine(talkative, EngineConfig(max_sessions=1, decode_step="graphs"))


def test_static_step_buckets():
    """The buckets `capture_all` captures: powers of two up to max_batch, key lengths from
    min_kv_len doubling up to the cache's max_len."""
    cfg = Qwen3ASRConfig.tiny().text
    cache = KVCache.for_config(cfg, max_slots=8, max_len=934)
    step = StaticDecodeStep(Qwen3Decoder(cfg).eval(), cache, max_batch=6)
    assert step.buckets() == [(m, kv) for m in (1, 2, 4, 6) for kv in (256, 512, 934)]
    assert step.capture_all() == 0  # no graphs on a CPU


def test_engine_static_step_has_no_bucket_past_its_sessions(asr):
    """A tick batches each session at most once: with max_batch (the server's default 32) above
    max_sessions (16), the static step's batch buckets stop at max_sessions. Before, `serve
    --decode-step graphs` captured the 32-row graphs at start that no tick can replay, and their
    intermediates, the largest, sized the shared graph pool."""
    engine = Engine(asr, EngineConfig(max_sessions=3, max_batch=32, slot_policy=POLICY, decode_step="static"))
    assert engine._static is not None
    assert sorted({m for m, _ in engine._static.buckets()}) == [1, 2, 3]


@pytest.mark.parametrize("device", DEVICES)
def test_graph_replay_equals_eager_token_for_token(device):
    """At the decoder: bf16 greedy decoding through StaticDecodeStep with CUDA graphs replayed (on
    CPU: eagerly) gives the eager step's logits bit for bit, and the plain decode_step's tokens
    (fp32) while slots join and leave."""
    need(device)
    torch.manual_seed(0)
    cfg = Qwen3ASRConfig.tiny().text
    dec32 = Qwen3Decoder(cfg).eval().to(device)
    xs = [torch.randn(n, cfg.hidden_size, generator=torch.Generator().manual_seed(80 + i)) * 0.5
          for i, n in enumerate([9, 33, 17])]
    schedule = ([0, 1, 2], [1], [0, 2], [0, 1, 2]) * 3

    def run(dec, dtype, kind):
        cache = KVCache.for_config(cfg, max_slots=8, max_len=128, dtype=dtype, device=device)
        slots = [cache.allocate() for _ in xs]
        logits = prefill(dec, cache, slots, [x.to(device, dtype) for x in xs])
        step = None if kind == "plain" else StaticDecodeStep(dec, cache, max_batch=4, min_kv_len=64,
                                                             cuda_graphs=kind == "graphs")
        out, tokens = [], []
        for rows in schedule:
            tok = logits.argmax(-1)
            feed = tok[rows]
            new = (decode_step(dec, cache, [slots[r] for r in rows], feed) if step is None
                   else step([slots[r] for r in rows], feed))
            logits = logits.clone()
            logits[rows] = new
            out.append(new.float().cpu())
            tokens.append(feed.tolist())
        return out, tokens

    _, plain_tokens = run(dec32, torch.float32, "plain")
    _, static_tokens = run(dec32, torch.float32, "graphs" if device == "cuda" else "static")
    assert static_tokens == plain_tokens
    bf16 = copy.deepcopy(dec32).to(torch.bfloat16)
    eager, eager_tokens = run(bf16, torch.bfloat16, "static")
    if device == "cuda":
        replayed, replayed_tokens = run(bf16, torch.bfloat16, "graphs")
        assert replayed_tokens == eager_tokens
        for a, b in zip(eager, replayed):
            assert torch.equal(a, b)


# --- batching and the encoder ---------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
def test_batched_equals_one_at_a_time_on_the_device(device, talkative):
    need(device)
    asr = moved(talkative, device)
    work = workloads(4)
    alone = [run_alone(Engine(asr, EngineConfig(max_sessions=1, slot_policy=POLICY)), o, s, p) for o, s, p in work]
    batched = run_batched(Engine(asr, EngineConfig(max_sessions=4, max_batch=4, slot_policy=POLICY)), work)
    assert batched == alone


@pytest.mark.parametrize("device", DEVICES)
def test_incremental_encoder_equals_full_reencode_on_the_device(device):
    """A 20-s stream in uneven pieces: after every append the incremental outputs equal a full
    re-encode of the features so far (float32 on the device)."""
    need(device)
    torch.manual_seed(1)
    enc = AudioEncoder(Qwen3ASRConfig.tiny().audio).eval().to(device)
    feats = torch.randn(128, 2000, generator=torch.Generator().manual_seed(11)).to(device)
    inc = IncrementalEncoder(enc)
    done = 0
    with torch.no_grad():
        for k in [37, 250, 513, 1, 99, 300, 400, 400]:
            inc.append(feats[:, done:done + k])
            done += k
            out = inc.outputs()
            full = enc(feats[:, :done])
            assert out.shape == full.shape
            assert (out - full).abs().max().item() < 1e-4
    assert done == 2000


# --- the transcript --------------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
def test_engine_transcript_on_the_device_equals_the_cpus(device, asr):
    """The tiny checkpoint (English forced: it writes until its budgets) streamed through the
    engine on the device (float32) gives the CPU's events, text and times and stability alike."""
    need(device)
    work = [(SessionOptions(language="English", policy=POLICY), make_segments([3.2, 1.7], [0.2, 0.6], seed=5),
             [20])]
    cpu = run_alone(Engine(asr, EngineConfig(max_sessions=1, slot_policy=POLICY)), *work[0])
    dev = run_alone(Engine(moved(asr, device), EngineConfig(max_sessions=1, slot_policy=POLICY)), *work[0])
    assert dev == cpu
    assert "".join(e.committed_delta for e in cpu)  # it wrote text
    assert np.isfinite([e.stability for e in cpu]).all()
