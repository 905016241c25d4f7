"""`harken bench model --json`: throughput of harken's Qwen3-ASR encoder and decoder, random weights.

For each size (the tiny test dims and the real 0.6B dims):
- encoder ms per audio second: one full pass over a clip; a stream in 1-s updates through the
  `IncrementalEncoder` (completed 8-s windows cached) and the same stream re-encoding everything
  on every update (what the official streaming loop does); and the cost of the stream's last
  update alone both ways (bounded by one window vs growing with the stream);
- prefill tokens/s for a prompt of the clip's length (audio tokens + chat template), batch 1;
- decode tokens/s at batch 1, 8 and 32 (one token per sequence per step, KV cache); on CUDA at
  batch 1 to 256 for the 0.6B dims, and the same steps through the static padded step with its CUDA
  graphs replayed (`decode_graphs_batch{B}_ms_per_step`, what `--decode-step graphs` serves with).

Prints one JSON object. Timings are the fastest of a few repeats; the CPU figures use the threads
torch is given (torch.get_num_threads()).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from harken.cloud.model.checkpoint import resolve_device, resolve_dtype
from harken.cloud.model.config import AudioEncoderConfig, Qwen3ASRConfig, TextDecoderConfig
from harken.cloud.model.decoder import Qwen3Decoder, decode_step, prefill
from harken.cloud.model.encoder import AudioEncoder, IncrementalEncoder, num_audio_tokens
from harken.cloud.model.kv_cache import KVCache
from harken.cloud.model.static_decode import StaticDecodeStep

PROMPT_TEXT_TOKENS = 15  # chat-template tokens around the audio, no context


@dataclass(frozen=True)
class BenchPlan:
    name: str
    config: Qwen3ASRConfig
    audio_s: float  # clip length for the full-encode and prefill figures
    stream_s: float  # stream length for the incremental vs re-encode figures (> 8 s: > 1 window)
    decode_steps: int  # timed decode steps per batch size
    context_tokens: int  # tokens already cached per sequence before the decode steps
    batches: tuple[int, ...] = (1, 8, 32)
    repeats: int = 3


def plans(device: torch.device, real_dims: bool, tiny_only: bool, quick: bool = False) -> list[BenchPlan]:
    gpu = device.type == "cuda"
    tiny = BenchPlan("tiny", Qwen3ASRConfig.tiny(), audio_s=30.0, stream_s=30.0, decode_steps=32,
                     context_tokens=128)
    if quick:  # a smoke run in seconds (deploy/device/bench.sh at toy size): every figure, few samples
        tiny = BenchPlan("tiny", Qwen3ASRConfig.tiny(), audio_s=3.0, stream_s=10.0, decode_steps=2,
                         context_tokens=16, batches=(1, 4), repeats=1)
    # released 0.6B dims (config.py defaults); on a CPU a few seconds of audio and a few tokens
    real = BenchPlan("qwen3-asr-0.6b", Qwen3ASRConfig(audio=AudioEncoderConfig(), text=TextDecoderConfig()),
                     audio_s=30.0 if gpu else 3.0, stream_s=30.0 if gpu else 10.0,
                     decode_steps=32 if gpu else 3, context_tokens=256 if gpu else 64,
                     batches=(1, 8, 32, 64, 128, 256) if gpu else (1, 8, 32), repeats=3 if gpu else 1)
    if tiny_only:
        return [tiny]
    if real_dims:
        return [real]
    return [tiny, real]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best_seconds(fn, device: torch.device, repeats: int) -> float:
    fn()  # warm-up: allocator, kernels, lazy init
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


@torch.no_grad()
def bench_encoder(plan: BenchPlan, device: torch.device, dtype: torch.dtype) -> dict:
    with torch.device(device):
        enc = AudioEncoder(plan.config.audio).to(dtype).eval()
    frames = int(plan.stream_s * 100)
    clip = int(plan.audio_s * 100)
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(plan.config.audio.num_mel_bins, max(frames, clip), generator=g).to(device=device,
                                                                                          dtype=dtype)
    step = 100  # 1-s updates

    def full():
        enc(feats[:, :clip])

    def incremental():
        state = IncrementalEncoder(enc)
        for s in range(0, frames, step):
            state.append(feats[:, s:s + step])
            state.outputs()

    def reencode():
        for s in range(step, frames + step, step):
            enc(feats[:, :min(s, frames)])

    def incremental_last_update() -> float:
        # the stream's final 1-s update alone (state prepared untimed): bounded by one window
        best = float("inf")
        for _ in range(plan.repeats + 1):  # the first round doubles as warm-up
            state = IncrementalEncoder(enc)
            state.append(feats[:, :frames - step])
            state.outputs()
            _sync(device)
            t0 = time.perf_counter()
            state.append(feats[:, frames - step:frames])
            state.outputs()
            _sync(device)
            best = min(best, time.perf_counter() - t0)
        return best

    per_s = 1000.0 / plan.stream_s
    return {
        "clip_s": plan.audio_s,
        "full_ms_per_audio_s": round(_best_seconds(full, device, plan.repeats) * 1000.0 / plan.audio_s, 3),
        "stream_s": plan.stream_s,
        "incremental_1s_updates_ms_per_audio_s": round(_best_seconds(incremental, device, plan.repeats) * per_s, 3),
        "reencode_1s_updates_ms_per_audio_s": round(_best_seconds(reencode, device, plan.repeats) * per_s, 3),
        "last_update_incremental_ms": round(incremental_last_update() * 1000, 3),
        "last_update_reencode_ms": round(_best_seconds(lambda: enc(feats[:, :frames]), device, plan.repeats)
                                         * 1000, 3),
    }


@torch.no_grad()
def bench_decoder(plan: BenchPlan, device: torch.device, dtype: torch.dtype) -> dict:
    cfg = plan.config.text
    with torch.device(device):
        dec = Qwen3Decoder(cfg).to(dtype).eval()
    g = torch.Generator().manual_seed(1)
    hidden = cfg.hidden_size

    # prefill: one prompt the length of the clip's prompt
    prompt_len = num_audio_tokens(int(plan.audio_s * 100)) + PROMPT_TEXT_TOKENS
    prompt = (torch.randn(prompt_len, hidden, generator=g) * 0.02).to(device=device, dtype=dtype)
    graphs = device.type == "cuda"
    cache = KVCache.for_config(cfg, max_slots=max(plan.batches) + graphs, max_len=max(prompt_len, plan.context_tokens
                                                                            + plan.decode_steps + 1),
                               dtype=dtype, device=device)

    def run_prefill():
        slot = cache.allocate()
        prefill(dec, cache, [slot], [prompt])
        cache.free(slot)

    prefill_s = _best_seconds(run_prefill, device, plan.repeats)
    out = {"prefill_tokens": prompt_len, "prefill_tokens_per_s": round(prompt_len / prefill_s, 1)}

    static = StaticDecodeStep(dec, cache, max_batch=max(plan.batches), cuda_graphs=True) if graphs else None
    context = (torch.randn(plan.context_tokens, hidden, generator=g) * 0.02).to(device=device, dtype=dtype)
    for batch in plan.batches:
        slots = [cache.allocate() for _ in range(batch)]
        # fill every slot's context in one batched prefill, then time the steps after it
        prefill(dec, cache, slots, [context] * batch)
        tokens = torch.randint(0, cfg.vocab_size, (batch,), generator=g).to(device)

        def steps():
            for s in slots:
                cache.truncate(s, plan.context_tokens)
            nxt = tokens
            for _ in range(plan.decode_steps):
                nxt = decode_step(dec, cache, slots, nxt).argmax(-1)

        t = _best_seconds(steps, device, plan.repeats)
        out[f"decode_batch{batch}_tokens_per_s"] = round(batch * plan.decode_steps / t, 1)
        out[f"decode_batch{batch}_ms_per_step"] = round(1000.0 * t / plan.decode_steps, 3)
        if static is not None:
            def graph_steps(step=static):
                for s in slots:
                    cache.truncate(s, plan.context_tokens)
                nxt = tokens
                for _ in range(plan.decode_steps):
                    nxt = step(slots, nxt).argmax(-1)

            t = _best_seconds(graph_steps, device, plan.repeats)  # the first call captures
            out[f"decode_graphs_batch{batch}_ms_per_step"] = round(1000.0 * t / plan.decode_steps, 3)
        for s in slots:
            cache.free(s)
    out["decode_context_tokens"] = plan.context_tokens
    out["decode_steps_timed"] = plan.decode_steps
    return out


def bench_model(real_dims: bool = False, tiny_only: bool = False, device: str | None = None,
                dtype: str | None = None, threads: int | None = None, quick: bool = False,
                out: str | None = None) -> dict:
    """The figures of every plan; with `out`, the JSON is rewritten there (whole, atomically) after
    each part (a model's encoder, then its decoder), with the seconds each part took, so a run
    killed at its caller's cap (deploy/device/bench.sh) keeps what it had measured."""
    if threads:
        # on a shared, oversubscribed CPU the OpenMP barriers of a multi-threaded small-M matmul
        # cost more than the matmul itself (2 threads: ~24 ms for [8,1024]x[1024,3072], 1: ~3 ms)
        torch.set_num_threads(threads)
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    models: dict[str, dict] = {}
    result = {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "dtype": str(dt).removeprefix("torch."),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "models": models,
    }
    seconds: dict[str, float] = {}
    result["part_seconds"] = seconds

    def save() -> None:
        if out:
            tmp = Path(out + ".tmp")
            tmp.write_text(json.dumps(result) + "\n")
            tmp.replace(out)

    save()
    for plan in plans(dev, real_dims, tiny_only, quick):
        torch.manual_seed(0)
        entry: dict = {}
        models[plan.name] = entry
        for part, bench in (("encoder", bench_encoder), ("decoder", bench_decoder)):
            t = time.perf_counter()
            entry[part] = bench(plan, dev, dt)
            seconds[f"{plan.name}.{part}"] = round(time.perf_counter() - t, 2)
            save()
    return result


def bench_model_command(real_dims: bool = False, tiny_only: bool = False, device: str | None = None,
                        dtype: str | None = None, threads: int | None = None, quick: bool = False,
                        out: str | None = None) -> int:
    print(json.dumps(bench_model(real_dims, tiny_only, device, dtype, threads, quick, out)))
    return 0

