"""`harken bench ...`: one parser and one run function per benchmark, in the order `harken bench --help`
lists them (registered by `harken.cli` where the lab is, i.e. in a checkout)."""

from __future__ import annotations

import argparse

from harken.commands.options import Subparsers, sample_path


def register(sub: Subparsers) -> None:
    s = sub.add_parser("bench", help="benchmarks; print JSON",
                       description="Benchmarks. Each prints one JSON object; ratios are measured side "
                                   "by side in one run.")
    bsub = s.add_subparsers(dest="bench", required=True, metavar="WHAT")
    for add in _BENCH_PARSERS:
        add(bsub)


def _register_edge(bsub: Subparsers) -> None:
    b = bsub.add_parser("edge", help="edge CPU cost and wire bitrate vs PCM16 and Opus",
                        description="One thread: real-time factors of VAD, log-mel and codec; for each "
                                    "codec mode kbps during speech and log-mel error; PCM16 and Opus "
                                    "16/24/32 kbps on the same audio, side by side.")
    b.add_argument("input", nargs="?", help="audio file (default: the bundled sample)")
    b.add_argument("--json", action="store_true", help="print JSON (the only output format)")
    b.add_argument("--repeats", type=int, default=3, help="timing repeats; the fastest counts (default 3)")
    b.set_defaults(run=run_edge)


def run_edge(args: argparse.Namespace) -> int | None:
    from harken.bench.edge import bench_edge_command

    return bench_edge_command(args.input or sample_path(), repeats=args.repeats)


def _register_model(bsub: Subparsers) -> None:
    b = bsub.add_parser("model", help="Qwen3-ASR encoder/prefill/decode throughput (tiny and 0.6B dims)",
                        description="Random-weight models: encoder ms per audio second (full vs "
                                    "incremental), prefill tokens/s, decode tokens/s at batch 1/8/32.")
    b.add_argument("--json", action="store_true", help="print JSON (the only output format)")
    b.add_argument("--real-dims", action="store_true", help="only the real 0.6B dims (default: tiny and 0.6B)")
    b.add_argument("--tiny-only", action="store_true", help="only the tiny dims")
    b.add_argument("--quick", action="store_true", help="a smoke run: the tiny dims' figures from a few samples")
    b.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    b.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    b.add_argument("--dtype", help="bf16, fp16 or fp32 (default: bf16 on CUDA, fp32 on CPU)")
    b.add_argument("--out", metavar="FILE", help="also write the JSON to FILE, rewritten after each part (a "
                   "model's encoder, its decoder) with part_seconds, so a run cut short keeps what it measured")
    b.set_defaults(run=run_model)


def run_model(args: argparse.Namespace) -> int | None:
    from harken.bench.model import bench_model_command

    return bench_model_command(real_dims=args.real_dims, tiny_only=args.tiny_only,
                               device=args.device, dtype=args.dtype, threads=args.threads, quick=args.quick,
                               out=args.out)


def _register_stream(bsub: Subparsers) -> None:
    b = bsub.add_parser("stream", help="streaming engine vs the re-encode-everything baseline (Phase 1)",
                        description="Tiled sample speech on audio time through harken's engine (N "
                                    "sessions batched, and one at a time) and through Phase 1 (every "
                                    "update re-encodes and re-prefills all audio so far), in one run: "
                                    "update_growth, phase1_speedup, throughput_rtf, p50/p95_update_ms, "
                                    "batching_gain.")
    b.add_argument("--model", default="tiny",
                   help="checkpoint dir, Hugging Face id, 'tiny', 'tiny-untied' (never stops) or 'synth-en' "
                        "(default tiny); a comma-separated list (e.g. tiny,tiny-untied,synth-en,real-dims) "
                        "runs each kind side by side and prints {\"runs\": [...]}")
    b.add_argument("--real-dims", action="store_true",
                   help="random weights with the real 0.6B dims instead of --model (short --seconds on CPU)")
    b.add_argument("--seconds", type=float, default=60.0, help="audio per stream (default 60)")
    b.add_argument("--streams", type=int, default=1, help="concurrent streams N (default 1)")
    b.add_argument("--update-interval", type=float, default=2.0,
                   help="audio seconds between updates, engine and Phase 1 alike (default 2.0)")
    b.add_argument("--phase1-max-seconds", type=float, default=600.0,
                   help="above this estimated Phase-1 compute, run every K-th Phase-1 update and "
                        "integrate (default 600; 0 = always full)")
    b.add_argument("--repeats", type=int, default=1,
                   help="repeat every measured run, the fastest counts (default 1)")
    b.add_argument("--language", help="force the language on every side (a name or code: English, en); default: detect")
    b.add_argument("--json", action="store_true", help="print JSON (the only output format)")
    b.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    b.add_argument("--dtype", help="bf16, fp16 or fp32 (default: bf16 on CUDA, fp32 on CPU)")
    b.add_argument("--compare-interval", type=float, metavar="S",
                   help="also run the batched engine with updates every S seconds and report both policies' "
                        "compute per second of speech side by side (policies, compare_compute_ratio)")
    b.set_defaults(run=run_stream)


def run_stream(args: argparse.Namespace) -> int | None:
    from harken.bench.stream import StreamBenchOptions, bench_stream_command

    return bench_stream_command(StreamBenchOptions(
        model=args.model, real_dims=args.real_dims, seconds=args.seconds, streams=args.streams,
        update_interval_s=args.update_interval, phase1_max_seconds=args.phase1_max_seconds,
        repeats=args.repeats, language=args.language, device=args.device, dtype=args.dtype,
        compare_interval_s=args.compare_interval))


def _register_ray(bsub: Subparsers) -> None:
    b = bsub.add_parser("ray", help="Ray Serve on this machine: throughput with 2 replicas vs 1, the proxy's latency",
                        description="Start a local Ray cluster; print ray_scaling (aggregate throughput with 2 "
                                    "replicas over 1) and proxy_p50_ms / proxy_p95_ms (update latency through "
                                    "Serve's proxy minus an in-process server's). Definitions: lab/bench/ray_scaling.py.")
    b.add_argument("--streams", type=int, default=4, help="concurrent streams N (default 4)")
    b.add_argument("--seconds", type=float, default=10.0, help="audio per stream (default 10)")
    b.add_argument("--model", default="tiny", help="model of every replica (default tiny)")
    b.add_argument("--cpus", type=int, default=2, help="CPUs of the local Ray cluster (default 2)")
    b.add_argument("--json", action="store_true", help="print JSON (the only output format)")
    b.set_defaults(run=run_ray)


def run_ray(args: argparse.Namespace) -> int | None:
    from harken.bench.ray_scaling import RayBenchOptions, bench_ray_command

    return bench_ray_command(RayBenchOptions(streams=args.streams, seconds=args.seconds, model=args.model,
                                             cpus=args.cpus))


def _register_engine_load(bsub: Subparsers) -> None:
    b = bsub.add_parser("engine-load", help="live streams one engine serves in real time (GPU serving figures)",
                        description="The engine driven directly (no gRPC, no clients) with the sample's "
                                    "precomputed packets paced in real time, at N = 1, 8, 16, 64, 128, 256, "
                                    "512 streams (more while the p95 holds): p50/p95 update and first-partial "
                                    "latency, memory per stream, batching gain, GPU-seconds per stream-hour, "
                                    "the largest N with p95 update <= 300 ms (definitions: lab/bench/engine_load.py).")
    b.add_argument("--streams", default="1,8,16,64,128,256,512", help="levels N, comma-separated")
    b.add_argument("--no-more", action="store_true", help="only the listed levels (default: grow past them while "
                                                          "the p95 holds and the KV cache has room)")
    b.add_argument("--keep-going", action="store_true",
                   help="run the listed levels after one that did not hold (default: cut them)")
    b.add_argument("--seconds", type=float, default=10.0, help="audio per stream per level (default 10)")
    b.add_argument("--model", default="real-dims",
                   help="real-dims (random weights, the 0.6B dims; default) or a checkpoint (tiny, a dir, a Hub id)")
    b.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    b.add_argument("--dtype", help="bf16, fp16 or fp32 (default: bf16 on CUDA, fp32 on CPU)")
    b.add_argument("--decode-step", choices=["plain", "static", "graphs"],
                   help="the engine's decode step (default: graphs on CUDA, plain on CPU)")
    b.add_argument("--max-batch", type=int, default=256, help="passes batched in one tick (default 256)")
    b.add_argument("--drain-s", type=float, default=3.0, help="wait after a level's last packet (default 3)")
    b.add_argument("--time-budget-s", type=float, default=150.0,
                   help="the whole run; levels that would not finish inside it are cut (default 150)")
    b.add_argument("--max-streams", type=int, default=2048, help="never more sessions than this (default 2048)")
    b.add_argument("--profile-s", type=float, default=3.0,
                   help="then this much audio at the largest level under torch.profiler: the engine's phases, "
                        "device kernel time vs busy time, top operators (default 3; 0: none)")
    b.add_argument("--threads", type=int, help="torch CPU threads (CPU only)")
    b.add_argument("--out", help="also write engine-load.json and engine-load.png into this folder")
    b.add_argument("--json", action="store_true", help="print JSON (the only output format)")
    b.set_defaults(run=run_engine_load)


def run_engine_load(args: argparse.Namespace) -> int | None:
    from harken.bench.engine_load import EngineLoadOptions, bench_engine_load_command

    return bench_engine_load_command(EngineLoadOptions(
        levels=tuple(int(n) for n in args.streams.split(",") if n.strip()), more=not args.no_more,
        keep_going=args.keep_going,
        seconds=args.seconds, model=args.model, device=args.device, dtype=args.dtype,
        decode_step=args.decode_step, max_batch=args.max_batch, drain_s=args.drain_s,
        time_budget_s=args.time_budget_s, max_streams=args.max_streams, profile_s=args.profile_s, threads=args.threads, out_dir=args.out))


def _register_load(bsub: Subparsers) -> None:
    b = bsub.add_parser("load", help="N live clients against a server: update, first-partial, final latency",
                        description="N concurrent SDK clients each stream S seconds of the bundled sample "
                                    "(tiled) in real time, 100 ms pieces; p50/p95 latency of updates, first "
                                    "partials and finals as the clients see them, errors by gRPC code, "
                                    "realtime_ok (definitions: lab/bench/load.py).")
    b.add_argument("--server", help="HOST:PORT of a harken server")
    b.add_argument("--self-serve", action="store_true",
                   help="start an in-process server (--model) on a free port (the default without --server)")
    b.add_argument("--model", default="tiny",
                   help="model for --self-serve: checkpoint dir, Hugging Face id, 'tiny' or 'synth-en' "
                        "(default tiny)")
    b.add_argument("--streams", default="4",
                   help="concurrent streams N (default 4), or levels (1,4,8) run one after the other: "
                        "{\"levels\": [...], \"max_streams_ok\": the most with p95 update <= 300 ms}")
    b.add_argument("--seconds", type=float, default=20.0, help="audio per stream (default 20)")
    b.add_argument("--api-key", help="API key for --server (default: $HARKEN_API_KEY)")
    b.add_argument("--tls-ca", help="PEM root certificate: connect to --server over TLS")
    b.add_argument("--language", help="force the language; default: detect, but English with --self-serve "
                                      "--model tiny (its random weights write text only then)")
    b.add_argument("--decoder", default="own",
                   help="--self-serve's text decoder: own (default), vllm, or a comma list (own,vllm) run one "
                        "after the other and printed side by side as {\"runs\": [...]}")
    b.add_argument("--finalize", action="store_true",
                   help="each client asks to finalize at the end of each of its VAD segments; adds finalize_ms "
                        "(request to its from_finalize final)")
    b.add_argument("--replay", action="store_true",
                   help="the clients in a process of their own replay feature packets computed before the run "
                        "(no edge work on the clock); adds the server's CPU per stream-second, split into the "
                        "model's calls and the host's work (host_cpu_ms_per_stream_s)")
    b.add_argument("--workers", type=int, default=0, metavar="N",
                   help="--self-serve as `harken serve --workers N`: the engine in this process, N front-end "
                        "processes (their CPU counts in the server's with --replay; default 0: one process)")
    b.add_argument("--json", action="store_true", help="print JSON (the only output format)")
    b.set_defaults(run=run_load)


def run_load(args: argparse.Namespace) -> int | None:
    from harken.bench.load import LoadBenchOptions, bench_load_command, parse_levels

    self_serve = args.self_serve or args.server is None
    language = args.language if args.language is not None else (
        "English" if self_serve and args.model == "tiny" else "")
    levels = parse_levels(args.streams)
    return bench_load_command(LoadBenchOptions(
        server=args.server, streams=levels[0], seconds=args.seconds, api_key=args.api_key,
        tls_ca=args.tls_ca, language=language, self_serve=self_serve, model=args.model,
        decoder=args.decoder, replay=args.replay, finalize=args.finalize, workers=args.workers), levels)


def _register_fuzz(bsub: Subparsers) -> None:
    b = bsub.add_parser("fuzz", help="fuzz the wire decoders and the served session: inputs tried, crashes",
                        description="A seeded fuzzing run (lab/bench/fuzz.py): codec payloads, wire "
                                    "messages, data-channel frames (both sides) and whole streams through "
                                    "the served session (tiny model), beside a reference session whose "
                                    "transcript must not change. Prints tried, crashes, rejections_by_code, "
                                    "by_target, others_affected, leaked_sessions; exits 1 on any failure.")
    b.add_argument("--examples", type=int, default=100_000, help="inputs to try (default 100000)")
    b.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    b.add_argument("--session-share", type=float, default=0.1,
                   help="share of the examples that are whole streams through the served session (default 0.1)")
    b.add_argument("--concurrency", type=int, default=16, help="fuzzed streams in flight at once (default 16)")
    b.add_argument("--http-examples", type=int, default=0,
                   help="also this many requests and Realtime sessions against a served HTTP port's OpenAI "
                        "endpoints (lab/bench/fuzz_http.py; default 0)")
    b.add_argument("--model", default="tiny", help="model of the served session (default tiny)")
    b.add_argument("--json", action="store_true", help="print JSON (the only output format)")
    b.set_defaults(run=run_fuzz)


def run_fuzz(args: argparse.Namespace) -> int | None:
    from harken.bench.fuzz import FuzzBenchOptions, bench_fuzz_command

    return bench_fuzz_command(FuzzBenchOptions(examples=args.examples, seed=args.seed,
                                               session_share=args.session_share,
                                               concurrency=args.concurrency, model=args.model,
                                               http_examples=args.http_examples))


def _register_soak(bsub: Subparsers) -> None:
    b = bsub.add_parser("soak", help="one long live stream: RSS and update latency sampled every minute",
                        description="An in-process server (--model) and one SDK client streaming the bundled "
                                    "sample tiled without end, paced like a microphone (--speed x real time), "
                                    "for --minutes; every --sample-s the process's RSS and the p50/p95 update "
                                    "latency of that minute. Prints samples, rss_growth_mb, "
                                    "rss_slope_mb_per_hour, p95_update_ms_first/last (definitions: "
                                    "lab/bench/soak.py).")
    b.add_argument("--minutes", type=float, default=30.0, help="wall minutes of streaming (default 30)")
    b.add_argument("--speed", type=float, default=1.0,
                   help="audio seconds handed over per wall second (default 1: real time)")
    b.add_argument("--sample-s", type=float, default=60.0, help="seconds between samples (default 60)")
    b.add_argument("--model", default="tiny-untied",
                   help="model of the in-process server (default tiny-untied: a tiny random checkpoint that "
                        "never ends its answer, so every update decodes however long the stream runs)")
    b.add_argument("--language", default="English",
                   help="forced language (default English: the tiny models' random weights write text only then)")
    b.add_argument("--json", action="store_true", help="print JSON (the only output format)")
    b.set_defaults(run=run_soak)


def run_soak(args: argparse.Namespace) -> int | None:
    from harken.bench.soak import SoakBenchOptions, bench_soak_command

    return bench_soak_command(SoakBenchOptions(minutes=args.minutes, speed=args.speed, sample_s=args.sample_s,
                                               model=args.model, language=args.language))


def _register_overload(bsub: Subparsers) -> None:
    b = bsub.add_parser("overload", help="2x the admitted sessions, and clients trying to push others out",
                        description="Three runs on fresh in-process servers (lab/bench/overload.py): M users "
                                    "alone; M users while M more try to open streams again and again "
                                    "(RESOURCE_EXHAUSTED, and how fast); the same with an attacker key "
                                    "over-claiming frames, flooding 8 frames per byte and holding an idle "
                                    "stream. Prints each run's p50/p95 update latency and errors, the p95 "
                                    "ratios to alone, the refusals' p50/p95/max ms, pushed_out, the attacker's "
                                    "outcomes.")
    b.add_argument("--sessions", type=int, default=4, help="users admitted, M (default 4)")
    b.add_argument("--seconds", type=float, default=20.0, help="audio per user (default 20)")
    b.add_argument("--attacker-share", type=int, default=2,
                   help="the per-key session limit, which the attacker fills with its flood and idle streams "
                        "(default 2)")
    b.add_argument("--model", default="tiny", help="model of the in-process servers (default tiny)")
    b.add_argument("--max-audio-speed", type=float, default=4.0,
                   help="the servers' pace of a live stream, x real time (harken serve's flag; default %(default)s)")
    b.add_argument("--audio-burst-s", type=float, default=30.0,
                   help="... and the audio a stream may send ahead of it (default %(default)s)")
    b.add_argument("--rounds", type=int, default=1,
                   help="run alone, overload and attacked this many times, interleaved, and pool each kind's "
                        "latencies (a shared machine's load then falls on every kind alike; default 1)")
    b.add_argument("--json", action="store_true", help="print JSON (the only output format)")
    b.set_defaults(run=run_overload)


def run_overload(args: argparse.Namespace) -> int | None:
    from harken.bench.overload import OverloadBenchOptions, bench_overload_command

    return bench_overload_command(OverloadBenchOptions(sessions=args.sessions, seconds=args.seconds,
                                                       attacker_share=args.attacker_share, model=args.model,
                                                       max_audio_speed=args.max_audio_speed,
                                                       audio_burst_s=args.audio_burst_s, rounds=args.rounds))


def _register_wer(bsub: Subparsers) -> None:
    b = bsub.add_parser("wer", help="WER, kbps, per-word latency and partial churn of every path, one run",
                        description="Render held-out recipes once and send the same audio down every path: "
                                    "offline, stream (in-process engine, paced in real time: per-word "
                                    "latency and partial churn), served_features_{hifi,balanced,low} (an "
                                    "in-process server + the SDK), served_audio (thin client), "
                                    "opus_{16,24,32} (Opus round trip, server-side features), webrtc (data "
                                    "channel). Prints wer_<path>, kbps_<path>, partial/commit_latency_p50/"
                                    "p95_s, partial_churn, n_words (definitions: lab/bench/wer.py).")
    b.add_argument("--model", required=True,
                   help="checkpoint dir, Hugging Face id, 'tiny' or 'synth-en'")
    b.add_argument("--set", dest="held_set", default="held-out",
                   help="held-out (default) or a JSONL file of recipes")
    b.add_argument("--n", type=int, help="only the first N utterances")
    b.add_argument("--paths", help="comma-separated subset of the paths (default: all)")
    b.add_argument("--language", help="force the language on every path (a name or code); default: detect")
    b.add_argument("--fast", action="store_true",
                   help="the stream path on a fake clock instead of in real time: latencies on audio time, "
                        "compute counted as instant")
    b.add_argument("--concurrency", type=int, default=8,
                   help="utterances sent at once on each served path, one client each (default 8): the "
                        "server batches them as it batches live streams; the texts are the same at any value")
    b.add_argument("--update-interval", type=float,
                   help="the stream path's commit policy: audio seconds between updates (default: the "
                        "engine's, 1.0); the served paths keep the server's")
    b.add_argument("--rollback-tokens", type=int,
                   help="the stream path's commit policy: last tokens of a hypothesis never committed by "
                        "an update (default: the engine's, 5)")
    b.add_argument("--agreement", choices=["local-agreement", "rollback-only", "confidence", "agreement-or-confidence"],
                   help="the stream paths' commit rule (default: the engine's, local-agreement; confidence: "
                        "tokens the model gave at least --confidence-prob commit from one update)")
    b.add_argument("--confidence-prob", type=float, help="the confidence rule's probability (default 0.95)")
    b.add_argument("--min-token-prob", type=float,
                   help="no rule commits past a token the model gave less than this (default 0: off)")
    b.add_argument("--no-intermediate-commits", action="store_true",
                   help="the stream paths' commit policy: updates give partials only, each item's final "
                        "pass commits its text")
    b.add_argument("--vad-min-silence-ms", type=int,
                   help="the stream paths' edge VAD: a pause this long ends a segment (default: the "
                        "edge's, 300)")
    b.add_argument("--json", action="store_true", help="print JSON (the only output format)")
    b.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    b.add_argument("--dtype", help="bf16, fp16 or fp32 (default: bf16 on CUDA, fp32 on CPU)")
    b.set_defaults(run=run_wer)


def run_wer(args: argparse.Namespace) -> int | None:
    from harken.bench.wer import PATHS, WerBenchOptions, bench_wer_command

    paths = tuple(p.strip() for p in args.paths.split(",") if p.strip()) if args.paths else PATHS
    return bench_wer_command(WerBenchOptions(
        model=args.model, held_set=args.held_set, n=args.n, paths=paths, language=args.language,
        realtime=not args.fast, device=args.device, dtype=args.dtype, concurrency=args.concurrency,
        update_interval_s=args.update_interval, rollback_tokens=args.rollback_tokens,
        intermediate_commits=not args.no_intermediate_commits, vad_min_silence_ms=args.vad_min_silence_ms,
        agreement=args.agreement, confidence_prob=args.confidence_prob, min_token_prob=args.min_token_prob))


def _register_web(bsub: Subparsers) -> None:
    b = bsub.add_parser("web", help="the browser page's bytes on the wire, features vs Opus, and its features vs Python",
                        description="An in-process server and the page in headless chromium (fake microphone "
                                    "playing the sample, then 10 s of quiet noise), features mode and Opus mode: "
                                    "features_kbps_speech/_silence, opus_kbps_speech/_silence, "
                                    "features_max_abs_vs_python (definitions: lab/bench/web.py).")
    b.add_argument("--model", default="tiny", help="the server's model (default tiny)")
    b.add_argument("--input", help="speech WAV (default: the bundled sample)")
    b.add_argument("--json", action="store_true", help="print JSON (the only output format)")
    b.set_defaults(run=run_web)


def run_web(args: argparse.Namespace) -> int | None:
    from harken.bench.web import WebBenchOptions, bench_web_command

    return bench_web_command(WebBenchOptions(model=args.model, speech_wav=args.input))


def _register_files(bsub: Subparsers) -> None:
    b = bsub.add_parser("files", help="file uploads (OpenAI API) batched in the serving engine, beside a live stream",
                        description="An in-process server; N uploads of S seconds through the openai package, "
                                    "one after another vs all at once (batching_gain), their texts against "
                                    "harken transcribe's, and a live stream's p95 update alone vs beside them.")
    b.add_argument("--model", default="synth-en", help="model (default synth-en)")
    b.add_argument("--uploads", type=int, default=8, help="uploads (default 8; the server's --max-files)")
    b.add_argument("--seconds", type=float, default=20.0, help="audio per upload (default 20)")
    b.add_argument("--live-seconds", type=float, default=20.0, help="the live stream's audio (default 20)")
    b.add_argument("--no-live", action="store_true", help="skip the live stream's part")
    b.add_argument("--live-repeats", type=int, default=2,
                   help="live stream alone / beside the uploads, this many times in turn; medians count (default 2)")
    b.add_argument("--nonstop", action="store_true",
                   help="also: the live stream beside uploads sent back to back for its whole length")
    b.add_argument("--language", default="English", help="forced language ('' to detect; default English)")
    b.add_argument("--json", action="store_true", help="print JSON (the only output format)")
    b.set_defaults(run=run_files)


def run_files(args: argparse.Namespace) -> int | None:
    from harken.bench.files import FilesBenchOptions, bench_files_command

    return bench_files_command(FilesBenchOptions(model=args.model, uploads=args.uploads, seconds=args.seconds,
                                                 live_seconds=args.live_seconds, language=args.language,
                                                 live=not args.no_live, live_repeats=args.live_repeats,
                                                 nonstop=args.nonstop))


def _register_diarize(bsub: Subparsers) -> None:
    b = bsub.add_parser("diarize", help="live speaker labels on synthetic meetings: DER, speaker count, cost",
                        description="Synthetic meetings (2-4 espeak-ng and Piper voices, held-out texts, turns of "
                                    "1-15 s, some with short overlaps) through the edge pipeline; each VAD "
                                    "segment labelled as a server labels finals. DER (pyannote.metrics, "
                                    "collar 0.25 s) live and after relabels, speaker count, label cost; the "
                                    "threshold and minimum new-speaker duration tuned on other meetings.")
    b.add_argument("--json", action="store_true", help="print JSON (the only output format)")
    b.add_argument("--meetings", type=int, default=24, help="scored meetings without overlap (default 24)")
    b.add_argument("--overlap-meetings", type=int, default=6, help="scored meetings with overlaps (default 6)")
    b.add_argument("--tuning-meetings", type=int, default=24, help="tuning meetings, not scored (default 24)")
    b.add_argument("--seed", type=int, default=0, help="the meetings' seed (tuning: seed + 1000)")
    b.add_argument("--write-background", action="store_true",
                   help="write the tuning meetings' mean embedding and the tuned settings to "
                        "cloud/model/speaker_background.json (what servers use)")
    b.add_argument("--cpwer", type=int, default=0, metavar="N",
                   help="speaker-attributed WER (meeteval's cpWER) on the first N scored meetings, each streamed "
                        "through --model (default 0: off; the recogniser is most of the bench's cost then)")
    b.add_argument("--model", default="synth-en", help="the recogniser for --cpwer (default synth-en)")
    b.set_defaults(run=run_diarize)


def run_diarize(args: argparse.Namespace) -> int | None:
    from harken.bench.diarize import bench_diarize_command

    return bench_diarize_command(args.meetings, args.overlap_meetings, args.tuning_meetings, args.seed,
                                 args.write_background, cpwer=args.cpwer, model=args.model)


_BENCH_PARSERS = (_register_edge, _register_model, _register_stream, _register_ray,
                  _register_load, _register_files, _register_engine_load, _register_fuzz, _register_soak, _register_overload,
                  _register_wer, _register_web, _register_diarize)
