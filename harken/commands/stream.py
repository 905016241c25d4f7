"""The edge's command-line actions: `harken vad`, `harken features`, `harken demo`.

Each takes plain arguments (the dispatcher parsed them), prints its result and returns an exit code.
No torch on these paths.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np

from ..edge.audio import load_audio
from ..shared.errors import HarkenError
from ..shared.features_spec import SAMPLE_RATE


def vad_command(input_path: str, options, as_json: bool) -> int:
    from ..edge.vad import get_speech_timestamps

    audio = load_audio(input_path)
    segments = get_speech_timestamps(audio, options)
    speech_s = sum(s.end_s - s.start_s for s in segments)
    if as_json:
        print(json.dumps({
            "segments": [{"start_s": round(s.start_s, 3), "end_s": round(s.end_s, 3)} for s in segments],
            "speech_s": round(speech_s, 3),
        }))
    else:
        for s in segments:
            print(f"{s.start_s:8.3f} - {s.end_s:8.3f} s")
        print(f"{len(segments)} segments, {speech_s:.2f} s of speech in {audio.size / SAMPLE_RATE:.2f} s")
    return 0


def features_command(input_path: str, output_path: str) -> int:
    from ..edge.features import log_mel

    out = Path(output_path)
    if out.is_dir():
        raise HarkenError(f"{out}: is a directory; give a file name such as {out / 'features.npy'}")
    if not out.parent.exists():
        raise HarkenError(f"{out.parent}: no such directory")
    features = log_mel(load_audio(input_path))
    with open(out, "wb") as f:  # np.save(path) would append .npy to a name without it
        np.save(f, features.astype(np.float32))
    print(f"wrote {out}: float32 {list(features.shape)} ({features.shape[1] / 100:.2f} s)", file=sys.stderr)
    return 0


def demo_edge(input_path: str, mode: str = "balanced", piece_ms: int = 100) -> int:
    """Stream a file through the edge pipeline in `piece_ms` pieces and report each segment as its
    last packet leaves: what a connected agent would send, without a server."""
    from ..edge.pipeline import FeatureStream

    audio = load_audio(input_path)
    stream = FeatureStream(mode=mode)
    step = SAMPLE_RATE * piece_ms // 1000
    seconds = audio.size / SAMPLE_RATE
    print(f"harken edge demo: {Path(input_path).name}, {seconds:.1f} s, codec mode {mode!r}, "
          f"{stream.packet_frames * 10} ms packets")
    per_segment: dict[int, list] = {}
    total_bytes = 0
    for i in range(0, audio.size + 1, step):
        packets = stream.push(audio[i:i + step]) if i < audio.size else stream.flush()
        for p in packets:
            per_segment.setdefault(p.segment_id, []).append(p)
            total_bytes += len(p.payload)
            if p.segment_end:
                _print_segment(p.segment_id, per_segment[p.segment_id])
    speech_frames = sum(p.frame_count for ps in per_segment.values() for p in ps)
    speech_s = speech_frames / 100
    kbps = total_bytes * 8 / speech_s / 1000 if speech_s else 0.0
    print(f"{len(per_segment)} segments, {speech_s:.2f} s of speech in {seconds:.2f} s; "
          f"{speech_frames} frames in {total_bytes} bytes: {kbps:.1f} kbps during speech, "
          f"{total_bytes * 8 / seconds / 1000:.1f} kbps overall (PCM16 would be 256 kbps)")
    return 0


def _print_segment(segment_id: int, packets: list) -> None:
    first = packets[0].first_frame
    frames = sum(p.frame_count for p in packets)
    size = sum(len(p.payload) for p in packets)
    kbps = size * 8 / (frames / 100) / 1000 if frames else 0.0
    print(f"  segment {segment_id}: {first / 100:6.2f} - {(first + frames) / 100:6.2f} s  "
          f"{frames:5d} frames  {len(packets):3d} packets  {size:6d} bytes  {kbps:5.1f} kbps")


def stream_server_command(input_path: str | None, server: str, mic: bool = False, output_format: str = "text",
                          api_key: str | None = None, tls_ca: str | None = None, language: str | None = None,
                          context: str = "", max_offline_s: float = 120.0, transport: str = "grpc",
                          codec: str = "balanced", word_timings: bool = False, word_cues: bool = False) -> int:
    """`harken stream IN.wav|--mic --server HOST:PORT`: the edge pipeline here, the transcript from
    a harken server, printed as the embedded path prints it (`TranscriptPrinter`: live text, JSON
    events, or SRT / WebVTT cues as segments finish). The API key comes from `api_key` or $HARKEN_API_KEY.
    `word_timings` / `word_cues`: the server's word timings (`harken serve --aligner`) as JSON lines / a
    subtitle cue per word; a server without an aligner says so (one line on stderr), the rest goes on."""
    import asyncio
    import os

    from ..edge.audio import peak_normalize
    from ..edge.client.grpc_client import ClientOptions, TranscriptionClient, audio_pieces

    printer = TranscriptPrinter(sys.stdout, output_format, word_timings, word_cues)  # bad options: before any work
    if mic:
        source = None  # opened on the event loop, so that Ctrl-C can end it cleanly
    elif input_path:
        source = audio_pieces(peak_normalize(load_audio(input_path)))  # bad input fails before connecting
    else:
        raise HarkenError("give an input audio file or --mic")
    if tls_ca and not Path(tls_ca).is_file():
        raise HarkenError(f"{tls_ca}: no such certificate file")
    client_class: Callable[..., TranscriptionClient] = TranscriptionClient
    if transport == "webrtc":
        from ..edge.client.webrtc_client import WebRTCTranscriptionClient

        client_class = WebRTCTranscriptionClient
    client = client_class(server, api_key=api_key or os.environ.get("HARKEN_API_KEY") or None,
                                 tls=tls_ca, options=ClientOptions(language=language or "", context=context,
                                                                   max_offline_s=max_offline_s,
                                                                   codec_mode=codec))
    return asyncio.run(_print_stream(client, source, printer))


async def _microphone_until_interrupted():
    """Microphone pieces until the first Ctrl-C; the stream then ends as a file does (End, the
    last finals). A second Ctrl-C aborts."""
    import asyncio
    import signal

    from ..edge.audio import microphone_chunks

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()

    def first_interrupt() -> None:
        print("harken stream: finishing the last segment (Ctrl-C again to abort)", file=sys.stderr)
        stop.set()
        loop.remove_signal_handler(signal.SIGINT)  # the next Ctrl-C interrupts as usual

    loop.add_signal_handler(signal.SIGINT, first_interrupt)
    try:
        blocks = microphone_chunks()
        while not stop.is_set():
            # the capture blocks until its next 32 ms block: off the event loop
            yield await asyncio.to_thread(next, blocks)
    finally:
        loop.remove_signal_handler(signal.SIGINT)


async def _print_stream(client, source, printer: TranscriptPrinter) -> int:
    if source is None:
        source = _microphone_until_interrupted()
    done = False
    told = False  # said that no timings come
    try:
        async for event in client.stream(source, word_timings=printer.asks_timings, turn_events=printer.asks_turns):
            if printer.asks_timings and client.stats.word_timings is False and not told:
                told = True
                print("harken stream: the server sends no word timings (it has no aligner: harken serve "
                      "--aligner MODEL); the transcript goes on without them", file=sys.stderr, flush=True)
                printer.no_timings()
            printer.show(event)
        done = True
    finally:
        printer.close(done)
    return 0


FORMATS = ("text", "json", "srt", "vtt")


class TranscriptPrinter:
    """What `harken stream` prints as events arrive, in one of `FORMATS`:

    text  committed text solid, partial text dimmed (`LiveView`)
    json  one object per event (`TranscriptEvent.as_dict`), then `{"final": true, "text": ...}`;
          with word timings, after each final segment `{"word_timings": SegmentTimings.as_dict()}`;
          the VAD's turn events as they come, `{"type": "speech_started" | "utterance_end", ...}`
          (`TurnEvent.as_dict`)
    srt   one SubRip cue per segment, written when the segment is final (shared/subtitles.py);
          `word_cues`: one cue per word, once the segment's word timings are in (`WordCues`)
    vtt   the same as WebVTT (its header first)

    `word_timings`: the stream asks for them (`--word-timings`, JSON lines); `word_cues` implies it.
    """

    def __init__(self, out, output_format: str = "text", word_timings: bool = False, word_cues: bool = False):
        from ..shared.subtitles import SubtitleCues, WordCues, vtt_header
        from ..shared.text import TranscriptText

        if output_format not in FORMATS:
            raise HarkenError(f"--format: one of {', '.join(FORMATS)}, got {output_format!r}")
        if word_cues and output_format not in ("srt", "vtt"):
            raise HarkenError("--word-cues goes with --format srt or vtt (a cue per word)")
        if word_timings and not word_cues and output_format != "json":
            raise HarkenError("--word-timings goes with --json (a JSON line per final segment); for subtitles "
                              "with a cue per word: --format srt|vtt --word-cues")
        self.out, self.format = out, output_format
        self.view = LiveView(out) if output_format == "text" else None
        self.text = TranscriptText()
        self.cues = SubtitleCues()
        self.word_cues = WordCues() if word_cues else None
        self.asks_timings = word_timings or word_cues  # the stream should ask for word timings
        self.asks_turns = output_format == "json"  # ... and turn events
        if output_format == "vtt":
            out.write(vtt_header())
            out.flush()

    def show(self, event) -> None:
        """A `TranscriptEvent`, a final segment's `SegmentTimings`, or a `TurnEvent`."""
        from ..shared.transcript import SegmentTimings, TurnEvent

        if isinstance(event, TurnEvent):
            if self.format == "json":
                print(json.dumps(event.as_dict()), file=self.out, flush=True)
            return
        if self.view is not None:
            if not isinstance(event, SegmentTimings):
                self.view.show(event)
            return
        if self.format == "json":
            if isinstance(event, SegmentTimings):
                print(json.dumps({"word_timings": event.as_dict()}, ensure_ascii=False), file=self.out, flush=True)
                return
            self.text.add(event)
            print(json.dumps(event.as_dict(), ensure_ascii=False), file=self.out, flush=True)
            return
        if self.word_cues is not None:
            self._write(self.word_cues.add(event))
            return
        if isinstance(event, SegmentTimings):
            return
        cue = self.cues.add(event)
        if cue is not None:
            self._write([cue])

    def no_timings(self) -> None:
        """None will come (a server without an aligner): held segment cues go out, later ones at once."""
        if self.word_cues is not None:
            self._write(self.word_cues.flush())
            self.cues = self.word_cues.segments
            self.word_cues = None

    def _write(self, cues) -> None:
        from ..shared.subtitles import srt_cue, vtt_cue

        for cue in cues:
            self.out.write(srt_cue(cue) if self.format == "srt" else vtt_cue(cue))
        self.out.flush()

    def close(self, finished: bool = True) -> None:
        """After the last event (`finished`: the stream ended normally, not by an error)."""
        if self.view is not None:
            self.view.close()
        elif self.word_cues is not None:
            self._write(self.word_cues.flush())
        elif self.format == "json" and finished:
            print(json.dumps({"final": True, "text": self.text.text}, ensure_ascii=False), file=self.out, flush=True)


class LiveView:
    """Terminal rendering of transcript events: the open segment's committed text, then its
    partial text (dimmed), rewritten in place (`\\r`) on a TTY; elsewhere one plain line per event
    (partial lines marked `~ `). A final segment's line stays. The embedded `harken stream` prints
    the same way."""

    def __init__(self, out):
        self.out = out
        self.tty = out.isatty()
        self.text: dict[int, str] = {}
        self.width = 0

    def show(self, event) -> None:
        text = self.text.get(event.segment_id, "") + event.committed_delta
        self.text[event.segment_id] = text
        partial = event.partial.strip()
        sep = " " if text and partial else ""
        if not self.tty:
            print(("" if event.is_final else "~ ") + text + sep + partial, file=self.out, flush=True)
            return
        import shutil

        # the tail of the line that fits; the partial part dimmed
        cols = max(shutil.get_terminal_size().columns - 1, 10)
        tail = (sep + partial)[-cols:]
        head = text[max(len(text) - (cols - len(tail)), 0):] if cols > len(tail) else ""
        dim = f"\x1b[2m{tail}\x1b[0m" if tail else ""
        self.out.write("\r\x1b[K" + head + dim + ("\n" if event.is_final else ""))
        self.out.flush()
        self.width = 0 if event.is_final else len(head) + len(tail)

    def close(self) -> None:
        if self.tty and self.width:
            self.out.write("\n")
            self.out.flush()
