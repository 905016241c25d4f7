"""The `harken` command: parses arguments and hands them to edge or cloud code, imported lazily so
edge commands run with only the `edge` extra installed (no torch on that path)."""

from __future__ import annotations

import argparse
import os
import sys

from .parser import DEFAULT_MODEL, _build_parser  # noqa: F401 (DEFAULT_MODEL: importers read it here)


def main(argv: list[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    if args.command in ("stream", "health") and "grpc" not in sys.modules:
        # gRPC's C core logs every failed TLS handshake on stderr; these commands say what failed in
        # one line of their own. Read once, when grpc is first imported; a user's setting wins.
        os.environ.setdefault("GRPC_VERBOSITY", "NONE")
    from .shared.errors import HarkenError

    try:
        return _dispatch(args) or 0
    except HarkenError as e:
        print(f"harken {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0


def _dispatch(args: argparse.Namespace) -> int | None:
    if args.command == "demo":
        if args.edge_only:
            from .commands.stream import demo_edge

            return demo_edge(args.input or _sample_path(), mode=args.codec)
        from .commands.demo import demo_command

        return demo_command(args.input or _sample_path(), args.model, realtime=not args.fast, codec=args.codec)
    if args.command == "vad":
        from .commands.stream import vad_command
        from .edge.vad import VadOptions

        opts = VadOptions(threshold=args.threshold, min_speech_duration_ms=args.min_speech_ms,
                          min_silence_duration_ms=args.min_silence_ms, speech_pad_ms=args.pad_ms)
        return vad_command(args.input, opts, as_json=args.json)
    if args.command == "features":
        from .commands.stream import features_command

        return features_command(args.input, args.output)
    if args.command == "transcribe":
        from .commands.transcribe import transcribe_command

        return transcribe_command(args.input, args.model, language=args.language, context=args.context,
                                  as_json=args.json, device=args.device, dtype=args.dtype,
                                  max_pass_s=args.max_pass_s, decode_limits=not args.no_decode_limits,
                                  decoder=args.decoder, output_format=_output_format(args))
    if args.command == "align":
        from .cloud.align import align_command

        return align_command(args.input, text=args.text, text_file=args.text_file, model=args.model,
                             language=args.language, as_json=args.json, device=args.device, dtype=args.dtype)
    if args.command == "stream" and args.server:
        from .commands.stream import stream_server_command

        if args.decoder != "own":
            from .shared.errors import HarkenError

            raise HarkenError("--decoder is the server's choice with --server (harken serve --decoder vllm)")

        return stream_server_command(args.input, args.server, mic=args.mic, output_format=_output_format(args),
                                     api_key=args.api_key, tls_ca=args.tls_ca, language=args.language,
                                     context=args.context, max_offline_s=args.max_offline_s,
                                     transport=args.transport, codec=args.codec, word_timings=args.word_timings,
                                     word_cues=args.word_cues)
    if args.command == "stream":
        from .commands.transcribe import stream_command

        return stream_command(args.input, args.model, language=args.language, context=args.context,
                              output_format=_output_format(args), mic=args.mic, server=args.server,
                              device=args.device,
                              dtype=args.dtype, codec=args.codec, decoder=args.decoder,
                              word_timings=args.word_timings, aligner=args.aligner, word_cues=args.word_cues)
    if args.command == "serve":
        from .cloud.server import ServerOptions, serve_command

        options = ServerOptions(host=args.host, port=args.port, tls_cert=args.tls_cert, tls_key=args.tls_key,
                                api_keys=args.api_keys, metrics_port=args.metrics_port,
                                http_port=args.http_port, cors_origins=tuple(args.cors_origin),
                                max_sessions=args.max_sessions, max_sessions_per_key=args.max_sessions_per_key,
                                grace_s=args.grace_s, idle_timeout_s=args.idle_timeout_s, decoder=args.decoder,
                                max_upload_bytes=int(args.max_upload_mb * (1 << 20)), max_file_s=args.max_file_s,
                                file_lanes=args.file_lanes, max_audio_speed=args.max_audio_speed,
                                audio_burst_s=args.audio_burst_s, decode_step=args.decode_step,
                                aligner=args.aligner)
        if args.ray:
            from .cloud.adapters.ray_app import Scaling, serve_ray_command

            if args.decoder != "own":
                from .shared.errors import HarkenError

                raise HarkenError("--decoder vllm does not go with --ray (each replica runs the own engine)")

            scaling = Scaling.parse(args.replicas, args.autoscale)
            return serve_ray_command(args.model, options, scaling, device=args.device, dtype=args.dtype)
        if args.replicas is not None or args.autoscale is not None:
            from .shared.errors import HarkenError

            raise HarkenError("--replicas and --autoscale go with --ray")
        return serve_command(args.model, options, device=args.device, dtype=args.dtype)
    if args.command == "health":
        from .cloud.adapters.health import health_command

        return health_command(args.server, service=args.service, tls_ca=args.tls_ca, timeout_s=args.timeout)
    if args.command == "train" and args.recipe == "synth-align":
        from .training.align_train import train_align_command

        return train_align_command(args.out, **_given(args, utterances="utterances", steps="steps", lr="lr",
                                                      batch_frames="batch_frames", eval_every="eval_every"),
                                   eval_n=args.eval_n, threads=args.threads, workers=args.workers, seed=args.seed,
                                   tiny=args.tiny, device=args.device, time_limit=args.time_limit,
                                   init_from=args.init_from or (None if args.warmstart == "repo" else args.warmstart))
    if args.command == "train":
        for name, default in (("utterances", 16000), ("steps", 20000), ("batch_frames", 4000), ("eval_every", 400),
                              ("lr", 2e-3)):  # synth-en's defaults (the parser leaves them to the recipe)
            if getattr(args, name) is None:
                setattr(args, name, default)
        from .training.commands import train_command

        return train_command(args.out, utterances=args.utterances, corpus_dir=args.corpus, steps=args.steps,
                             phrases=args.phrases, texts=args.texts, jumbles=args.jumbles,
                             jumble_texts=args.jumble_texts, prose_texts=args.prose_texts,
                             prose_utterances=args.prose_utterances, wordnet_texts=args.wordnet_texts,
                             wordnet_utterances=args.wordnet_utterances, text_batch=args.text_batch,
                             threads=args.threads, workers=args.workers, seed=args.seed, tiny=args.tiny,
                             eval_every=args.eval_every, eval_n=args.eval_n, batch_frames=args.batch_frames,
                             device=args.device, init_from=args.init_from, lr=args.lr,
                             lr_hold=args.lr_hold, warmstart=args.warmstart, pack=args.pack,
                             time_limit=args.time_limit, corpus_only=args.corpus_only,
                             save_every=args.save_every, piper_share=args.piper_share, bf16=args.bf16,
                             piper_repeat=args.piper_repeat, prose_repeat=args.prose_repeat,
                             freq_mask=args.freq_mask, time_mask=args.time_mask,
                             tempo=args.tempo, tempo_local=args.tempo_local, vtlp=args.vtlp,
                             corpus_first=args.corpus_first,
                             average_decay=args.average_decay, cooldown=args.cooldown,
                             decoder_layers=args.decoder_layers, no_build=args.no_build)
    if args.command == "eval":
        from .training.commands import eval_command

        return eval_command(args.model, held_set=args.held_set, n=args.n, as_json=args.json,
                            device=args.device, dtype=args.dtype, language=args.language, hyps_path=args.hyps_path)
    if args.command == "make-tiny-model":
        from .commands.transcribe import make_tiny_model_command

        return make_tiny_model_command(args.dir, seed=args.seed, vocab=args.vocab, head=args.head,
                                       head_dim=args.head_dim, layers=args.layers, hidden=args.hidden)
    if args.command == "bench" and args.bench == "model":
        from .bench.model import bench_model_command

        return bench_model_command(real_dims=args.real_dims, tiny_only=args.tiny_only,
                                   device=args.device, dtype=args.dtype, threads=args.threads, quick=args.quick,
                                   out=args.out)
    if args.command == "bench" and args.bench == "stream":
        from .bench.stream import StreamBenchOptions, bench_stream_command

        return bench_stream_command(StreamBenchOptions(
            model=args.model, real_dims=args.real_dims, seconds=args.seconds, streams=args.streams,
            update_interval_s=args.update_interval, phase1_max_seconds=args.phase1_max_seconds,
            repeats=args.repeats, language=args.language, device=args.device, dtype=args.dtype))
    if args.command == "bench" and args.bench == "load":
        from .bench.load import LoadBenchOptions, bench_load_command, parse_levels

        self_serve = args.self_serve or args.server is None
        language = args.language if args.language is not None else (
            "English" if self_serve and args.model == "tiny" else "")
        levels = parse_levels(args.streams)
        return bench_load_command(LoadBenchOptions(
            server=args.server, streams=levels[0], seconds=args.seconds, api_key=args.api_key,
            tls_ca=args.tls_ca, language=language, self_serve=self_serve, model=args.model,
            decoder=args.decoder), levels)
    if args.command == "bench" and args.bench == "engine-load":
        from .bench.engine_load import EngineLoadOptions, bench_engine_load_command

        return bench_engine_load_command(EngineLoadOptions(
            levels=tuple(int(n) for n in args.streams.split(",") if n.strip()), more=not args.no_more,
            keep_going=args.keep_going,
            seconds=args.seconds, model=args.model, device=args.device, dtype=args.dtype,
            decode_step=args.decode_step, max_batch=args.max_batch, drain_s=args.drain_s,
            time_budget_s=args.time_budget_s, max_streams=args.max_streams, profile_s=args.profile_s, threads=args.threads, out_dir=args.out))
    if args.command == "bench" and args.bench == "ray":
        from .bench.ray_scaling import RayBenchOptions, bench_ray_command

        return bench_ray_command(RayBenchOptions(streams=args.streams, seconds=args.seconds, model=args.model,
                                                 cpus=args.cpus))
    if args.command == "bench" and args.bench == "wer":
        from .bench.wer import PATHS, WerBenchOptions, bench_wer_command

        paths = tuple(p.strip() for p in args.paths.split(",") if p.strip()) if args.paths else PATHS
        return bench_wer_command(WerBenchOptions(
            model=args.model, held_set=args.held_set, n=args.n, paths=paths, language=args.language,
            realtime=not args.fast, device=args.device, dtype=args.dtype, concurrency=args.concurrency,
            update_interval_s=args.update_interval, rollback_tokens=args.rollback_tokens,
            intermediate_commits=not args.no_intermediate_commits, vad_min_silence_ms=args.vad_min_silence_ms,
            agreement=args.agreement, confidence_prob=args.confidence_prob, min_token_prob=args.min_token_prob))
    if args.command == "bench" and args.bench == "web":
        from .bench.web import WebBenchOptions, bench_web_command

        return bench_web_command(WebBenchOptions(model=args.model, speech_wav=args.input))
    if args.command == "bench" and args.bench == "fuzz":
        from .bench.fuzz import FuzzBenchOptions, bench_fuzz_command

        return bench_fuzz_command(FuzzBenchOptions(examples=args.examples, seed=args.seed,
                                                   session_share=args.session_share,
                                                   concurrency=args.concurrency, model=args.model,
                                                   http_examples=args.http_examples))
    if args.command == "bench" and args.bench == "soak":
        from .bench.soak import SoakBenchOptions, bench_soak_command

        return bench_soak_command(SoakBenchOptions(minutes=args.minutes, speed=args.speed, sample_s=args.sample_s,
                                                   model=args.model, language=args.language))
    if args.command == "bench" and args.bench == "overload":
        from .bench.overload import OverloadBenchOptions, bench_overload_command

        return bench_overload_command(OverloadBenchOptions(sessions=args.sessions, seconds=args.seconds,
                                                           attacker_share=args.attacker_share, model=args.model,
                                                           max_audio_speed=args.max_audio_speed,
                                                           audio_burst_s=args.audio_burst_s, rounds=args.rounds))
    if args.command == "bench" and args.bench == "edge":
        from .bench.edge import bench_edge_command

        return bench_edge_command(args.input or _sample_path(), repeats=args.repeats)
    raise AssertionError(f"unhandled command {args.command}")


def _given(args: argparse.Namespace, **names: str) -> dict:
    """{keyword: value} of the options the user gave (the others keep the callee's defaults)."""
    return {k: getattr(args, v) for k, v in names.items() if getattr(args, v) is not None}


def _output_format(args: argparse.Namespace) -> str:
    """--format, with --json its older spelling of `--format json`."""
    if args.json and args.format not in ("text", "json"):
        from .shared.errors import HarkenError

        raise HarkenError(f"--json and --format {args.format} disagree: give one")
    return "json" if args.json else args.format


def _sample_path() -> str:
    from importlib.resources import files

    return str(files("harken") / "data" / "sample.wav")


if __name__ == "__main__":
    sys.exit(main())
