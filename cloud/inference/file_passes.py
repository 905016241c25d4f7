"""Whole files inside the serving engine: `harken transcribe`'s offline passes (cloud/inference/offline.py),
batched across every file in flight, in units of bounded cost between which the engine serves live work.

    files = FilePasses(asr, FileConfig(max_files=8, queue=8))
    ticket = files.admit()                               # Overloaded past max_files + queue
    job = files.submit(FileRequest(audio, language), listener, ticket)
    files.has_work() -> bool
    files.step() -> str | None                           # ONE unit (in the engine's thread)
    files.cancel(job)                                    # the client went away: its slot is freed

A file is cut at quiet points as `transcribe_audio` cuts it; each piece is one pass, and a pass goes
through four phases, each but the first run for all the files in it at once:

  features its log-mel, streamed 8 s of audio per unit (the values `log_mel` gives);
  encode   the piece's 8-s encoder windows, `unit_windows` of them per unit across the files;
  prefill  its prompt (audio written over the pads, as `Qwen3ASR.prompt_embeddings` builds it) in
           chunks of at most `unit_positions` positions per unit across the files (a chunk after
           the cached ones is an append: the same attention as one prefill of the whole prompt);
  decode   one batched greedy step of every file decoding, its end as `greedy_decode` has it (EOS,
           the loop guard, the token budget `Qwen3ASR.transcribe` gives the piece).

So every file's tokens are those `transcribe_audio` gives it alone (tests check it), and a unit costs
about one window, one chunk or one step (on a CPU: tens of ms), all of it in the engine's thread,
the files' host work (log-mel) included: the Scheduler (cloud/inference/scheduler.py) runs live ticks
first and file units between them, so a live pass waits at most one unit.

Each file in work holds a slot of the files' own KV cache (not the live sessions'), as long as the
longest pass in work needs: the cache grows by copy between units. Files past `max_files` wait
(`queue` of them) for a slot; past that `admit` says Overloaded (HTTP 429). Threads: `admit`, `submit`, `cancel` from any
thread (the event loop); `step` from the engine's thread only; listeners are called there.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

import numpy as np
import torch

from ...edge.audio import MAX_PASS_SECONDS, split_at_quiet_points
from ...edge.features import LogMelOnnx, StreamingLogMel
from ...shared.errors import Overloaded, StreamInputError
from ...shared.features_spec import FRAMES_PER_SECOND, SAMPLE_RATE, normalize
from ...shared.text import transcript_text
from ..model.decode_limits import DecodeLimits
from ..model.decoder import decode_step, prefill
from ..model.encoder import window_spans
from ..model.kv_cache import KVCache
from ..model.prompt import Prompt, build_prompt, forced_language, parse_transcript
from .decode_pass import chosen_probabilities
from .offline import OfflinePiece, OfflineTranscript, piece_audio


KINDS = ("features", "encode", "prefill", "decode")  # the units, in a pass's order
FEATURE_PIECE_S = 8.0  # audio per log-mel unit: about an encoder window's cost on a CPU


@dataclass(frozen=True)
class FileConfig:
    max_files: int = 8  # files transcribed together (each a KV slot of the files' cache)
    queue: int = 8  # more waiting for a slot; past that: Overloaded
    unit_windows: int | None = None  # encoder windows per unit (None: 1 on a CPU, 16 on a GPU)
    unit_positions: int | None = None  # prompt positions prefilled per unit (None: 256 CPU, 4096 GPU)

    def __post_init__(self):
        if self.max_files < 1 or self.queue < 0:
            raise ValueError("max_files >= 1 and queue >= 0")
        if (self.unit_windows is not None and self.unit_windows < 1) or (
                self.unit_positions is not None and self.unit_positions < 1):
            raise ValueError("unit_windows and unit_positions must be >= 1")


@dataclass(frozen=True)
class FileRequest:
    audio: np.ndarray  # 16 kHz mono float32, peak-normalised as files are
    language: str | None = None
    context: str = ""
    decode_limits: bool = True  # False: as the official package decodes (512 tokens, no loop guard)
    max_pass_s: float | None = None  # None: MAX_PASS_SECONDS, as `transcribe_audio`


class FileListener:
    """What a file's owner hears, in the engine's thread: each piece as it is done, then the
    transcript, or the error that ended the file (a unit the model failed on)."""

    def piece(self, piece: OfflinePiece) -> None: ...
    def done(self, transcript: OfflineTranscript) -> None: ...
    def failed(self, error: BaseException) -> None: ...


class Phase(Enum):
    WAIT = "wait"  # for a slot
    FEATURES = "features"
    ENCODE = "encode"
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass
class FilePass:
    """One piece's pass in work: what `transcribe_audio` and `Qwen3ASR.transcribe` do for it, kept
    between units."""

    index: int
    span: tuple[int, int]  # samples of the file
    audio: np.ndarray  # the piece's samples (a short last piece padded, as `piece_audio` pads it)
    forced: str | None
    loop_guard: bool  # the decode limits' loop guard (`FileRequest.decode_limits`)
    mel: StreamingLogMel | None  # the streaming log-mel; None once the features are in
    pushed: int = 0  # samples through `mel` so far
    raw: list[np.ndarray] = field(default_factory=list)  # raw log-mel frames so far
    features: torch.Tensor | None = None  # [mel, T] in the model's dtype and device, once computed
    budget: int = 0
    windows: list[tuple[int, int]] = field(default_factory=list)  # the encoder's attention windows (frames)
    outputs: list[torch.Tensor] = field(default_factory=list)  # encoded windows so far
    prompt: Prompt | None = None
    embeds: torch.Tensor | None = None  # [L, hidden] once encoded
    prefilled: int = 0
    tokens: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)


@dataclass
class FileJob:
    id: int
    request: FileRequest
    listener: FileListener
    spans: list[tuple[int, int]]
    ticket: "FileTicket"
    slot: int | None = None
    pass_: FilePass | None = None
    pieces: list[OfflinePiece] = field(default_factory=list)
    cancelled: bool = False

    @property
    def phase(self) -> Phase:
        p = self.pass_
        if p is None:
            return Phase.WAIT
        if p.features is None:
            return Phase.FEATURES
        if p.prompt is None:
            return Phase.ENCODE
        return Phase.PREFILL if p.prefilled < len(p.prompt.ids) else Phase.DECODE


class FileTicket:
    """A place among `max_files + queue`, taken when a request arrives (before its upload is read,
    so that the refusals do not depend on how fast files finish); given back once with `release`."""

    def __init__(self, owner: "FilePasses"):
        self._owner = owner
        self.released = False

    def release(self) -> None:
        with self._owner._lock:
            if not self.released:
                self.released = True
                self._owner._admitted -= 1


class FilePasses:
    """The files' side of the serving engine (see the module docstring)."""

    def __init__(self, asr, config: FileConfig = FileConfig()):
        self.asr = asr
        self.config = config
        gpu = asr.device.type != "cpu"
        self.unit_windows = config.unit_windows or (16 if gpu else 1)
        self.unit_positions = config.unit_positions or (4096 if gpu else 256)
        self.cache: KVCache | None = None  # made (and grown) when a pass needs it
        self._log_mel: LogMelOnnx | None = None  # made when a pass needs it
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._admitted = 0  # tickets out: files in work, waiting, or on their way in
        self._waiting: deque[FileJob] = deque()
        self._work: list[FileJob] = []  # files holding a slot (engine thread), in arrival order
        self._rotor = 0
        self._unit: list[FileJob] = []  # the files of the unit under way (a model failure fails these)
        self.units = {kind: 0 for kind in KINDS}  # units run so far, by kind
        self.unit_s = {kind: 0.0 for kind in KINDS}  # their wall time
        self._kinds = itertools.cycle(KINDS)
        self.decode_step = self._decode_step  # a test may wrap it to fail a step

    # -- admission (any thread) ----------------------------------------------------------------

    def admit(self) -> FileTicket:
        with self._lock:
            if self._admitted >= self.config.max_files + self.config.queue:
                raise Overloaded(f"the server transcribes {self.config.max_files} file(s) at once and holds "
                                 f"{self.config.queue} more waiting; try again later")
            self._admitted += 1
            return FileTicket(self)

    def submit(self, request: FileRequest, listener: FileListener, ticket: FileTicket | None = None) -> FileJob:
        """Queue a file (under `ticket`, else one admitted here); its first piece's features start now."""
        forced_language(request.language)  # a bad language fails here, not in the engine
        if request.audio.ndim != 1 or request.audio.size == 0:
            raise StreamInputError("a file needs some 16 kHz mono audio")
        limit = MAX_PASS_SECONDS if request.max_pass_s is None else request.max_pass_s
        if not limit > 0:
            raise StreamInputError("max_pass_s must be > 0")
        ticket = ticket or self.admit()
        job = FileJob(next(self._ids), request, listener, split_at_quiet_points(request.audio, limit), ticket)
        with self._lock:
            self._waiting.append(job)
        return job

    def cancel(self, job: FileJob) -> None:
        """Stop a file (its client went away): it leaves at the next unit, its slot freed then."""
        with self._lock:
            job.cancelled = True
            waiting = job in self._waiting
            if waiting:
                self._waiting.remove(job)
        if waiting:  # (a job in work gives its place back as it leaves, at the next unit)
            job.ticket.release()

    def pending(self) -> int:
        """Files in work or waiting (not cancelled)."""
        with self._lock:
            return len(self._waiting) + sum(1 for j in self._work if not j.cancelled)

    def fail_all(self, error: BaseException) -> None:
        """Every file in work or waiting gets `error` (the engine is stopping, or the files' own code
        failed); their slots are freed."""
        with self._lock:
            jobs = self._work + list(self._waiting)
            self._waiting.clear()
        for job in jobs:
            self._fail(job, error)

    # -- the engine thread -------------------------------------------------------------------------

    def has_work(self) -> bool:
        with self._lock:
            return bool(self._waiting) or any(not j.cancelled for j in self._work)

    @torch.no_grad()
    def step(self) -> str | None:
        """Run one unit (a piece of one file's log-mel, an encoder batch, a prefill chunk or a decode
        step across the files in that phase), the kinds in turn; returns its kind, or None when no
        file is in work. A unit that fails (the model, a file's audio) fails its files only
        (`FileListener.failed`)."""
        self._drop_cancelled()
        self._take_waiting()
        for job in self._work:
            if job.pass_ is None:
                self._start_pass(job)
        by_phase: dict[str, list[FileJob]] = {kind: [] for kind in KINDS}
        for job in self._rotated():
            by_phase[job.phase.value].append(job)
        for _ in range(len(KINDS)):
            kind = next(self._kinds)
            jobs = by_phase[kind]
            if not jobs:
                continue
            run = {"features": self._features, "encode": self._encode, "prefill": self._prefill,
                   "decode": self._decode}[kind]
            self._unit = []
            t0 = time.perf_counter()
            try:
                unit = run(jobs)
            except Exception as e:  # noqa: BLE001 - the model failed on this unit: its files only
                for job in self._unit:
                    self._fail(job, e)
                return kind
            self.units[kind] += 1
            self.unit_s[kind] += time.perf_counter() - t0
            self._rotor += 1
            for job in unit:
                if job.phase is Phase.DECODE and job.pass_ is not None and self._decode_over(job.pass_):
                    self._finish_pass(job)
            return kind
        return None

    def _rotated(self) -> list[FileJob]:
        n = len(self._work)
        return [self._work[(self._rotor + i) % n] for i in range(n)] if n else []

    def _drop_cancelled(self) -> None:
        for job in [j for j in self._work if j.cancelled]:
            self._leave(job)

    def _take_waiting(self) -> None:
        while len(self._work) < self.config.max_files:
            with self._lock:
                if not self._waiting:
                    return
                job = self._waiting.popleft()
            job.slot = self._cache_for(1).allocate()
            with self._lock:
                self._work.append(job)

    def _leave(self, job: FileJob) -> None:
        with self._lock:
            if job in self._work:
                self._work.remove(job)
        if job.slot is not None and self.cache is not None:
            self.cache.free(job.slot)
            job.slot = None
        job.ticket.release()

    def _fail(self, job: FileJob, error: BaseException) -> None:
        self._leave(job)
        if not job.cancelled:
            job.listener.failed(error)

    # -- a pass: features -> encoder windows -> prompt -> prefill chunks -> decode steps -------------

    def _start_pass(self, job: FileJob) -> None:
        i = len(job.pieces)
        req = job.request
        if self._log_mel is None:
            self._log_mel = LogMelOnnx()  # one ONNX session for every pass (only this thread runs it)
        job.pass_ = FilePass(i, job.spans[i], piece_audio(req.audio, job.spans, i), forced_language(req.language),
                             req.decode_limits, StreamingLogMel(self._log_mel))

    def _features(self, jobs: list[FileJob]) -> list[FileJob]:
        """The next `FEATURE_PIECE_S` of one file's streaming log-mel (the values `log_mel` gives:
        streaming is bit-exact however the audio is cut); at its end, the features normalised as
        `log_mel` normalises them, its windows and its token budget as `Qwen3ASR.transcribe` sets it."""
        job = jobs[0]
        p = job.pass_
        assert p is not None and p.mel is not None
        self._unit = [job]
        step = int(FEATURE_PIECE_S * SAMPLE_RATE)
        p.raw.append(p.mel.push(p.audio[p.pushed:p.pushed + step]))
        p.pushed += step
        if p.pushed < len(p.audio):
            return [job]
        p.raw.append(p.mel.flush())
        raw = np.concatenate(p.raw, axis=1)
        p.mel, p.raw = None, []
        feats = self.asr.as_features(normalize(raw, float(raw.max())).astype(np.float32))
        p.budget = self.asr.max_new_tokens
        if job.request.decode_limits:
            p.budget = min(p.budget, DecodeLimits().budget(feats.shape[-1] / FRAMES_PER_SECOND))
        p.windows = window_spans(int(feats.shape[-1]), self.asr.encoder.window_frames)
        p.features = feats
        return [job]

    def _encode(self, jobs: list[FileJob]) -> list[FileJob]:
        """Up to `unit_windows` encoder windows of the files encoding, as one batch."""
        picked: list[tuple[FileJob, int, int]] = []  # (job, frame start, frame end)
        for job in itertools.cycle(jobs):
            if len(picked) >= self.unit_windows or all(not self._windows_left(j, picked) for j in jobs):
                break
            left = self._windows_left(job, picked)
            if left:
                picked.append((job, *left[0]))
        self._unit = [j for j, _, _ in picked]
        outs = self.asr.encoder.encode_windows([j.pass_.features[:, a:b] for j, a, b in picked],  # type: ignore[union-attr,index]
                                               [a == 0 for _, a, _ in picked])
        for (job, _, _), out in zip(picked, outs):
            p = job.pass_
            assert p is not None
            p.outputs.append(out)
            if len(p.outputs) == len(p.windows):
                self._build_prompt(job, p)
        return [j for j, _, _ in picked]

    @staticmethod
    def _windows_left(job: FileJob, picked: list[tuple[FileJob, int, int]]) -> list[tuple[int, int]]:
        p = job.pass_
        assert p is not None
        taken = len(p.outputs) + sum(1 for j, _, _ in picked if j is job)
        return p.windows[taken:]

    def _build_prompt(self, job: FileJob, p: FilePass) -> None:
        """The decoder's input, as `Qwen3ASR.prompt_embeddings` builds it; the slot made long enough."""
        audio = torch.cat(p.outputs)
        p.prompt = build_prompt(self.asr.tokenizer, audio.shape[0], job.request.context or "", p.forced)
        ids = torch.tensor(p.prompt.ids, device=self.asr.device)
        embeds = self.asr.decoder.embed(ids).clone()
        embeds[p.prompt.audio_start:p.prompt.audio_start + p.prompt.audio_len] = audio.to(embeds.dtype)
        p.embeds = embeds
        p.outputs = []  # in the embeddings now
        self._cache_for(len(p.prompt.ids) + p.budget)
        assert self.cache is not None and job.slot is not None
        self.cache.truncate(job.slot, 0)

    def _prefill(self, jobs: list[FileJob]) -> list[FileJob]:
        """The next prompt chunks of the files prefilling, `unit_positions` in all, as one batch; a
        file whose prompt is in takes its first token from the chunk's last logits."""
        left = self.unit_positions
        chunks: list[tuple[FileJob, int, int]] = []
        for job in jobs:
            p = job.pass_
            assert p is not None and p.prompt is not None
            n = min(len(p.prompt.ids) - p.prefilled, left)
            if n <= 0:
                break
            chunks.append((job, p.prefilled, p.prefilled + n))
            left -= n
        assert self.cache is not None
        self._unit = [j for j, _, _ in chunks]
        logits = prefill(self.asr.decoder, self.cache, [j.slot for j, _, _ in chunks],  # type: ignore[misc]
                         [j.pass_.embeds[a:b] for j, a, b in chunks])  # type: ignore[union-attr,index]
        done: list[tuple[FilePass, int]] = []  # passes whose prompt is in, with their logits row
        for i, (job, _, b) in enumerate(chunks):
            p = job.pass_
            assert p is not None and p.prompt is not None
            p.prefilled = b
            if b == len(p.prompt.ids):
                p.embeds = None  # in the cache now
                if p.budget > 0:
                    done.append((p, i))
        if done:
            self._take([p for p, _ in done], logits[torch.tensor([i for _, i in done], device=logits.device)])
        return [j for j, _, _ in chunks]

    def _decode(self, jobs: list[FileJob]) -> list[FileJob]:
        """One greedy step of every file decoding, as one batch."""
        assert self.cache is not None
        self._unit = jobs
        feed = torch.tensor([j.pass_.tokens[-1] for j in jobs], device=self.asr.device)  # type: ignore[union-attr]
        logits = self.decode_step([j.slot for j in jobs], feed)  # type: ignore[misc]
        self._take([j.pass_ for j in jobs], logits)  # type: ignore[misc]
        return jobs

    def _decode_step(self, slots: list[int], feed: torch.Tensor) -> torch.Tensor:
        assert self.cache is not None
        return decode_step(self.asr.decoder, self.cache, slots, feed)

    def _take(self, passes: list[FilePass], logits: torch.Tensor) -> None:
        """Each pass's greedy token from its row of `logits` [len(passes), vocab], with its
        probability (one batched softmax); the loop guard as `greedy_decode` applies it."""
        picked = logits.argmax(-1)
        probs = chosen_probabilities(logits, picked, self.asr.decoder.lm_head)
        for p, t, prob in zip(passes, picked.tolist(), probs):
            p.tokens.append(t)
            p.probs.append(prob)
            if p.loop_guard and t not in self.asr.eos_ids:
                cut = DecodeLimits().loop_cut(p.tokens)
                if cut is not None:
                    del p.tokens[cut:], p.probs[cut:]
                    p.budget = len(p.tokens)  # over: the loop's repeats dropped, as greedy_decode drops them

    def _decode_over(self, p: FilePass) -> bool:
        if p.budget <= 0:
            return True
        return bool(p.tokens) and (p.tokens[-1] in self.asr.eos_ids or len(p.tokens) >= p.budget)

    def _finish_pass(self, job: FileJob) -> None:
        """The pass's text as `Qwen3ASR.transcribe` reads it; the next piece, or the transcript."""
        p = job.pass_
        assert p is not None
        tokens, probs = list(p.tokens), list(p.probs)
        if tokens and tokens[-1] in self.asr.eos_ids:
            tokens, probs = tokens[:-1], probs[:-1]
        parsed = parse_transcript(self.asr.tokenizer.decode(tokens, skip_special_tokens=True), p.forced)
        a, b = p.span
        piece = OfflinePiece(a / SAMPLE_RATE, b / SAMPLE_RATE, parsed.text, parsed.language, tokens, probs)
        job.pieces.append(piece)
        job.pass_ = None
        if not job.cancelled:
            job.listener.piece(piece)
        if len(job.pieces) == len(job.spans):
            self._leave(job)
            if not job.cancelled:
                text = transcript_text(dict(enumerate(q.text for q in job.pieces)))
                job.listener.done(OfflineTranscript(text, next((q.language for q in job.pieces if q.language), ""),
                                                    job.pieces))

    # -- the files' KV cache -------------------------------------------------------------------------

    def _cache_for(self, length: int) -> KVCache:
        """The files' cache, its slots at least `length` long: made on first use, grown by copy
        (a power of two, so that a few longer passes do not regrow it each time). With no slot in
        use it is made anew at the size this pass needs, so one long upload's cache (GBs at a
        20-minute pass on the 0.6B) does not stay after it; still, it is not given back while idle."""
        size = max(256, 1 << (length - 1).bit_length())
        if self.cache is not None and not any(self.cache._in_use) and self.cache.max_len > size:
            self.cache = None  # nothing in it: made again at this pass's size below
        if self.cache is not None and self.cache.max_len >= length:
            return self.cache
        grown = KVCache.for_config(self.asr.config.text, max_slots=self.config.max_files, max_len=size,
                                   dtype=self.asr.dtype, device=self.asr.device)
        old = self.cache
        if old is not None:
            n = old.max_len
            grown.k[:, :, :, :n].copy_(old.k)
            grown.v[:, :, :, :n].copy_(old.v)
            grown._lengths = list(old._lengths)
            grown._in_use = list(old._in_use)
            grown._free = list(old._free)
        self.cache = grown
        return grown
