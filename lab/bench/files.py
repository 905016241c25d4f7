"""`harken bench files`: file uploads through the serving engine, as a user of OpenAI's API sends them.

An in-process server (`--http-port`, `--max-files` = the uploads) and N uploads of S seconds each (the
bundled sample tiled, upload i starting i / N of the way in, so no two are the same audio), sent with
the `openai` package (`audio.transcriptions.create`, json), each client in a thread of its own:

- `sequential_s`: the N uploads one after another; `together_s`: all N at once.
  `batching_gain` = sequential_s / together_s (the files' passes batched in the engine).
- `texts_equal`: how many of the uploads' texts (both runs) equal `harken transcribe`'s for the same
  audio (`transcribe_audio`, in-process, before any timing), out of `texts_total`.
- a live stream (the SDK's gRPC client, real time, as `harken bench load` streams one) alone, then
  with the N uploads sent together 1 s into it, `live_repeats` times in turn (a shared machine's
  load drifts: the median of each side's p95s counts): `live_p95_update_ms_alone` / `_with_files`,
  `live_p95_ratio` (with / alone); `files_during_live_s`: how long the uploads ran beside it.
  `--nonstop`: the uploads sent again and again for the whole stream (`live_p95_update_ms_nonstop`,
  `live_p95_ratio_nonstop`, `files_nonstop`: how many went through beside it).
"""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
import wave
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from harken.bench.load import LoadBenchOptions, run_load, sample_audio, tiled
from harken.edge.audio import load_audio, peak_normalize
from harken.shared.errors import HarkenError
from harken.shared.features_spec import SAMPLE_RATE


@dataclass(frozen=True)
class FilesBenchOptions:
    model: str = "synth-en"
    uploads: int = 8
    seconds: float = 20.0  # each upload's audio
    live_seconds: float = 20.0  # the live stream's
    language: str = "English"
    live: bool = True  # measure the live stream alone and beside the uploads
    live_repeats: int = 2  # alone / beside runs, in turn
    nonstop: bool = False  # also: uploads sent back to back for the whole live stream

    def __post_init__(self):
        if self.uploads < 1 or not self.seconds > 0 or not self.live_seconds > 1 or self.live_repeats < 1:
            raise HarkenError("--uploads and --live-repeats must be >= 1, --seconds > 0 and --live-seconds > 1")


def write_uploads(sample: np.ndarray, options: FilesBenchOptions, directory: Path) -> list[Path]:
    """N WAV files (16-bit, 16 kHz) of `seconds` of the sample, upload i from i / N of the way in."""
    period_s = sample.size / SAMPLE_RATE
    paths = []
    for i in range(options.uploads):
        audio = tiled(sample, options.seconds, offset_s=round(i * period_s / options.uploads, 1))
        path = directory / f"upload{i}.wav"
        with wave.open(str(path), "wb") as w:
            w.setnchannels(1)
            w.setsampwidth(2)
            w.setframerate(SAMPLE_RATE)
            w.writeframes((np.clip(audio, -1, 1) * 32767).astype("<i2").tobytes())
        paths.append(path)
    return paths


def offline_texts(asr, paths: list[Path], language: str) -> list[str]:
    """`harken transcribe`'s text of each file (the file read as the server reads an upload)."""
    from harken.cloud.inference.offline import transcribe_audio

    return [transcribe_audio(asr, peak_normalize(load_audio(str(p))), language or None).text for p in paths]


def upload(base_url: str, model: str, path: Path, language: str) -> str:
    import openai

    client = openai.OpenAI(base_url=base_url, api_key="harken-bench", max_retries=0, timeout=600)
    with path.open("rb") as f:
        if not language:
            return client.audio.transcriptions.create(model=model, file=f).text
        return client.audio.transcriptions.create(model=model, file=f, language=language).text


async def send(base_url: str, model: str, paths: list[Path], language: str, together: bool) -> tuple[float, list[str]]:
    """The uploads one after another or all at once (a thread per client); (wall seconds, texts)."""
    loop = asyncio.get_running_loop()
    with ThreadPoolExecutor(len(paths)) as pool:
        t0 = time.perf_counter()
        if together:
            texts = await asyncio.gather(*(loop.run_in_executor(pool, upload, base_url, model, p, language)
                                           for p in paths))
        else:
            texts = [await loop.run_in_executor(pool, upload, base_url, model, p, language) for p in paths]
        return time.perf_counter() - t0, list(texts)


async def bench_files(options: FilesBenchOptions) -> dict:
    import torch

    from harken.cloud.model.asr import Qwen3ASR
    from harken.cloud.server import ServerOptions, start_server

    if not torch.cuda.is_available():
        torch.set_num_threads(1)  # small batched matmuls on a shared CPU: one thread is fastest
    asr = await asyncio.to_thread(Qwen3ASR.load, options.model)
    sample = sample_audio()
    with tempfile.TemporaryDirectory(prefix="harken-bench-files-") as tmp:
        paths = write_uploads(sample, options, Path(tmp))
        expected = await asyncio.to_thread(offline_texts, asr, paths, options.language)
        server = await start_server(asr, ServerOptions(host="127.0.0.1", port=0, http_port=0,
                                                       max_files=options.uploads, file_queue=options.uploads))
        base_url = f"http://127.0.0.1:{server.http_port}/v1"
        model_id = asr.describe()["model"]
        try:
            await send(base_url, model_id, paths[:1], options.language, together=False)  # warm-up
            sequential_s, seq_texts = await send(base_url, model_id, paths, options.language, together=False)
            together_s, tog_texts = await send(base_url, model_id, paths, options.language, together=True)
            result = {
                "model": options.model, "uploads": options.uploads, "seconds": options.seconds,
                "sequential_s": round(sequential_s, 3), "together_s": round(together_s, 3),
                "batching_gain": round(sequential_s / together_s, 3),
                "texts_equal": sum(t == e for t, e in zip(seq_texts, expected)) + sum(
                    t == e for t, e in zip(tog_texts, expected)),
                "texts_total": 2 * len(paths),
                "file_units": server._scheduler.file_units,
            }
            if options.live:
                result.update(await _live(server, base_url, model_id, paths, options, sample))
        finally:
            await server.stop(grace_s=2.0)
    return result


async def _live(server, base_url: str, model_id: str, paths: list[Path], options: FilesBenchOptions,
                sample: np.ndarray) -> dict:
    """One live stream alone, then with the uploads sent together 1 s into it, `live_repeats` times."""
    live = LoadBenchOptions(server=server.address, streams=1, seconds=options.live_seconds,
                            language=options.language)
    alone: list[float] = []
    beside: list[float] = []
    files_s: list[float] = []
    realtime = True

    async def uploads_later() -> None:
        await asyncio.sleep(1.0)
        t, _ = await send(base_url, model_id, paths, options.language, together=True)
        files_s.append(t)

    for _ in range(options.live_repeats):
        a = await run_load(server.address, live, sample)
        b, _ = await asyncio.gather(run_load(server.address, live, sample), uploads_later())
        realtime = realtime and bool(a["realtime_ok"] and b["realtime_ok"])
        if a["p95_update_ms"] is not None and b["p95_update_ms"] is not None:
            alone.append(a["p95_update_ms"])
            beside.append(b["p95_update_ms"])
    p_alone = float(np.median(alone)) if alone else None
    p_beside = float(np.median(beside)) if beside else None
    out = {"live_seconds": options.live_seconds, "live_repeats": options.live_repeats,
           "live_p95_update_ms_alone": p_alone, "live_p95_update_ms_with_files": p_beside,
           "live_p95_runs_alone": alone, "live_p95_runs_with_files": beside,
           "live_p95_ratio": round(p_beside / p_alone, 3) if p_alone and p_beside else None,
           "files_during_live_s": round(float(np.median(files_s)), 3) if files_s else None,
           "live_realtime_ok": realtime}
    if options.nonstop:
        stop = asyncio.Event()
        sent = []

        async def uploads_nonstop() -> None:
            while not stop.is_set():
                _, texts = await send(base_url, model_id, paths, options.language, together=True)
                sent.extend(texts)

        feeder = asyncio.ensure_future(uploads_nonstop())
        try:
            c = await run_load(server.address, live, sample)
        finally:
            stop.set()
            await feeder
        out["live_p95_update_ms_nonstop"] = c["p95_update_ms"]
        out["live_p95_ratio_nonstop"] = (round(c["p95_update_ms"] / p_alone, 3)
                                         if p_alone and c["p95_update_ms"] else None)
        out["files_nonstop"] = len(sent)
    return out


def bench_files_command(options: FilesBenchOptions) -> int:
    print(json.dumps(asyncio.run(bench_files(options)), indent=1))
    return 0
