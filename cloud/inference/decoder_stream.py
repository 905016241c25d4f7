"""One streaming session: segments in, transcript events out.

API (driven by `harken.cloud.inference.engine.Engine`, which owns the model and the KV cache):

    session = DecoderStream(asr, SessionOptions(language=None, context="", policy=CommitPolicy()), slot)
    session.ingest(segment_id, first_frame, frames, segment_start, segment_end, running_max_log10)
        frames: [128, k] raw log10-mel floored against the running max (what `decode_frames` gives);
        duplicates of frames already applied are ignored (resume); a gap, frames after a segment's
        end or a segment id going backwards raise OutOfOrder; a bad shape or NaN raises
        StreamInputError.
    session.has_work() -> bool
    job = session.next_job()                  # what the head audio item needs now (or None)
    ... engine: encode job.requests, then session.prefill_embeds(job) -> [S, hidden] after
        cache.truncate(slot, job.keep), prefill + greedy decode <= job.budget tokens ...
    session.finish_job(job, new_tokens) -> list[EngineEvent]
    session.resume_state() -> SessionSeed     # what travels with a final segment (running max, context)

Audio items. Each VAD segment is decoded as its own audio item; a segment longer than
`policy.segment_limit_s` is cut at the last 8-s window boundary at or before the limit and continues
as a new item of the same segment, with the committed text so far as context. Items are decoded
strictly in order (the next item's context depends on the previous one's text); only the head item
holds an encoder and decoder state, and a finished item leaves nothing but its text in the context
tail, so memory stays flat however long the session runs.

Updates. An item is updated at fixed audio-time boundaries (every `update_interval_s` from its
start) using exactly the frames up to the boundary, so what gets committed depends on the features
alone, never on how they were chunked in transit or when the engine got round to it. Past the cut
point, while the item may still be cut, updates give partial text only. At the item's end a final
pass decodes to EOS and commits everything.

Decoder prompt of an item and what the KV slot keeps between updates:

    [system + context][<|audio_start|>][audio: completed 8-s windows | active window]
        [<|audio_end|><|im_end|>\\n<|im_start|>assistant\\n][language X<asr_text>]?[committed]
    |<------------- kept in the slot (never changes) -------->|<-- prefilled each update -->

so an update costs the active window, the template tail and the item's committed tokens, not the
session's length.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from .commit import (CommitPolicy, ItemText, compose_context, join_texts, stability,
                                           word_confidences)
from ..model.encoder import IncrementalEncoder, WindowRequest
from ..model.prompt import forced_language, prompt_text_parts
from ...shared.errors import HarkenError, StreamInputError, OutOfOrder
from ...shared.features_spec import FRAMES_PER_SECOND, N_MELS
from ...shared.protocol import SessionSeed
from ...shared.transcript import TranscriptEvent

MAX_CONTEXT_TOKENS = 256  # system turn incl. carried text; the KV slot is sized for it


def check_context(tokenizer, context: str) -> None:
    """A caller's context (prompt) may fill half the system turn; the rest is carried text."""
    if len(tokenizer.encode(prompt_text_parts(context, None)[0])) > MAX_CONTEXT_TOKENS // 2:
        raise StreamInputError(f"context is too long (more than {MAX_CONTEXT_TOKENS // 2} tokens)")


@dataclass(frozen=True)
class SessionOptions:
    """Per-stream options: forced language (None = detect), user context (at most 128 tokens: it
    shares the system turn with the carried text), commit policy, and the seed of a replacement
    session (the `SessionSeed` of the last final event of the session it replaces; a thin
    client's front-end fields are the service's, not the engine's)."""

    language: str | None = None
    context: str = ""
    policy: CommitPolicy = field(default_factory=CommitPolicy)
    resume: SessionSeed | None = None


@dataclass(frozen=True)
class EngineEvent(TranscriptEvent):
    """A transcript event as the engine emits it (fields and JSON form: shared/transcript.py).
    `resume` comes with final events only; `token_ids` with the final pass of an audio item (all
    the ids it generated, EOS excluded), for tests and diagnostics."""

    resume: SessionSeed | None = None
    token_ids: tuple[int, ...] | None = None


@dataclass
class AudioItem:
    """One audio item: a whole segment, or a piece of one cut at the segment limit."""

    segment_id: int
    index: int  # piece number within the segment
    first_frame: int  # on the stream's timeline
    pending: list[np.ndarray] = field(default_factory=list)  # normalised frames not yet encoded
    received: int = 0  # frames received for this item
    consumed: int = 0  # frames handed to the encoder
    overflow: list[np.ndarray] = field(default_factory=list)  # frames at/after the cut point
    closed: bool = False  # no more frames will come
    ends_segment: bool = False
    length: int | None = None  # frames of the item once closed (the cut point for a cut item)
    # decoding state, set up when the item reaches the head of the queue
    started: bool = False
    in_slot: bool = False  # the system turn has been prefilled into the session's KV slot
    encoder: IncrementalEncoder | None = None
    head_ids: list[int] = field(default_factory=list)
    tail_ids: list[int] = field(default_factory=list)
    context: str = ""
    stable_windows: int = 0  # completed windows whose KV the slot keeps
    boundary: int = 0  # frames covered by the last update
    committed: list[int] = field(default_factory=list)
    committed_probs: list[float] | None = field(default_factory=list)  # None: a pass gave none (vLLM)
    previous: list[int] | None = None  # the last update's uncommitted tokens
    text: ItemText | None = None
    partial: str = ""
    language: str = ""

    @property
    def stable_len(self) -> int:
        """Slot positions that stay valid across updates: system turn + completed windows."""
        if not self.in_slot:
            return 0
        assert self.encoder is not None  # set when the item starts, before it is in a slot
        return len(self.head_ids) + self.stable_windows * self.encoder.encoder.window_tokens


@dataclass
class SegmentRecord:
    """A segment that is not final yet."""

    segment_id: int
    first_frame: int
    next_frame: int  # next expected frame on the stream's timeline
    ended: bool = False
    items: int = 1  # audio items created so far
    text_end: str = ""  # last character of the segment's committed text ("" = none yet)
    running_max_log10: float = float("-inf")


@dataclass
class SessionState:
    """Everything one stream holds. Bounded: only segments not yet final, only the items of those,
    features only of the head item's active window and of frames not yet encoded."""

    options: SessionOptions
    forced_language: str | None
    slot: int
    segments: dict[int, SegmentRecord] = field(default_factory=dict)
    items: deque[AudioItem] = field(default_factory=deque)
    next_segment_id: int = 0  # lower ids are final (or were skipped)
    timeline_end: int = 0  # frame after the last frame of the last segment
    context_tail: str = ""  # the last `context_tail_chars` of all committed text
    running_max_log10: float = float("-inf")
    resume: SessionSeed = field(default_factory=lambda: SessionSeed(float("-inf"), "", 0))
    final_segments: int = 0
    events: int = 0


@dataclass
class Job:
    """One pass over the head item: an update at a boundary, or the final pass."""

    item: AudioItem
    final: bool
    frames: int  # item frames this pass covers
    commits: bool  # False: partial text only
    requests: list[WindowRequest]
    keep: int = 0  # slot positions to keep before the prefill
    budget: int = 0  # tokens to decode at most
    audio_bound: bool = False  # the budget is the audio-proportional one (reaching it truncates)
    model_free: bool = False  # an item without audio: nothing to run
    stable_windows: int = 0  # completed windows the slot keeps once this pass's prefill is done
    draft: list[int] = field(default_factory=list)  # tokens prefilled after the prompt, to verify


class DecoderStream:
    """Methods over one `SessionState`. Not thread-safe: the engine serialises calls."""

    def __init__(self, asr, options: SessionOptions, slot: int):
        try:
            forced = forced_language(options.language)
        except HarkenError as e:
            raise StreamInputError(str(e)) from e
        self.asr = asr
        self.window_frames = asr.encoder.window_frames
        self.policy = options.policy
        self.cut_frames = self.policy.cut_frames(self.window_frames)
        self.limit_frames = self.policy.limit_frames()
        self.state = SessionState(options=options, forced_language=forced, slot=slot)
        check_context(asr.tokenizer, options.context)
        if options.resume is not None:
            r = options.resume
            self.state.context_tail = r.context_tail[-self.policy.context_tail_chars:] \
                if self.policy.context_tail_chars else ""
            self.state.running_max_log10 = r.running_max_log10
            self.state.next_segment_id = r.next_segment_id
            self.state.resume = SessionSeed(r.running_max_log10, r.context_tail, r.next_segment_id)  # the engine's part

    def configure(self, context: str) -> None:
        """The user context from the next audio item on (StreamInputError when it is too long); the
        item in progress keeps its prompt."""
        check_context(self.asr.tokenizer, context)
        self.state.options = replace(self.state.options, context=context)

    # -- input -----------------------------------------------------------------------------------

    def ingest(self, segment_id: int, first_frame: int, frames: np.ndarray, segment_start: bool = False,
               segment_end: bool = False, running_max_log10: float | None = None) -> int:
        """Apply one packet's frames ([128, k] floored raw log10-mel). Returns the frames applied
        (0 for a duplicate). `segment_start` is informational: a segment starts with its first packet."""
        frames = _check_frames(frames)
        st = self.state
        if segment_id < st.next_segment_id:
            return 0  # a segment already final: a resend after a reconnect
        seg = st.segments.get(segment_id)
        if seg is None:
            open_ids = [s.segment_id for s in st.segments.values() if not s.ended]
            if open_ids:
                raise OutOfOrder(f"segment {segment_id} starts while segment {open_ids[0]} is open")
            if st.segments and segment_id < max(st.segments):
                raise OutOfOrder(f"segment id {segment_id} goes backwards")
            if first_frame < st.timeline_end:
                raise OutOfOrder(f"segment {segment_id} starts at frame {first_frame}, before the "
                                       f"previous segment's end ({st.timeline_end})")
            seg = SegmentRecord(segment_id, first_frame, first_frame)
            st.segments[segment_id] = seg
            st.items.append(AudioItem(segment_id, 0, first_frame))
        k = frames.shape[1]
        skip = seg.next_frame - first_frame
        if skip < 0:
            raise OutOfOrder(f"segment {segment_id}: frames {seg.next_frame}..{first_frame - 1} are missing")
        if skip < k and seg.ended:
            raise OutOfOrder(f"segment {segment_id}: frames after its end")
        if running_max_log10 is not None and skip < k:
            seg.running_max_log10 = st.running_max_log10 = float(running_max_log10)
        if skip >= k:
            if segment_end and not seg.ended and skip == k:
                self._end_segment(seg)
            return 0  # all of it applied before
        new = frames[:, skip:]
        self._append(seg, (new + 4.0) / 4.0)  # the model's normalisation; the floor is the edge's
        if segment_end:
            self._end_segment(seg)
        return new.shape[1]

    def _append(self, seg: SegmentRecord, frames: np.ndarray) -> None:
        item = self.state.items[-1]
        item.pending.append(frames)
        start = item.received
        item.received += frames.shape[1]
        seg.next_frame += frames.shape[1]
        self.state.timeline_end = seg.next_frame
        if item.received > self.cut_frames:
            # frames past the cut point go to the next item if this one outgrows the limit
            item.overflow.append(frames[:, max(self.cut_frames - start, 0):])
        while item.received > self.limit_frames:
            item = self._cut(seg, item)

    def _cut(self, seg: SegmentRecord, item: AudioItem) -> AudioItem:
        rest = np.concatenate(item.overflow, axis=1)
        item.closed, item.length, item.overflow = True, self.cut_frames, []
        # frames past the cut now belong to the next item only
        keep, kept = self.cut_frames - item.consumed, []
        for p in item.pending:
            if keep <= 0:
                break
            kept.append(p[:, :keep])
            keep -= p.shape[1]
        item.pending = kept
        nxt = AudioItem(seg.segment_id, item.index + 1, item.first_frame + self.cut_frames)
        seg.items += 1
        self.state.items.append(nxt)
        nxt.pending.append(rest)
        nxt.received = rest.shape[1]
        if nxt.received > self.cut_frames:
            nxt.overflow.append(rest[:, self.cut_frames:])
        return nxt

    def _end_segment(self, seg: SegmentRecord) -> None:
        seg.ended = True
        item = self.state.items[-1]
        item.closed, item.ends_segment, item.length, item.overflow = True, True, item.received, []

    def queued_frames(self) -> int:
        """Frames received but not yet given to the encoder (the engine's admission measure)."""
        # an item's length is set when it closes
        return sum(max((it.length if it.length is not None else it.received) - it.consumed, 0)
                   for it in self.state.items)

    # -- scheduling --------------------------------------------------------------------------------

    def _target(self, item: AudioItem) -> tuple[int, bool, bool] | None:
        """(frames, final, commits) of the next pass over `item`, or None if nothing is due."""
        step = self.policy.update_interval_frames
        commit_limit = self.cut_frames if self.policy.intermediate_commits else 0
        nxt = item.boundary + step
        if item.closed:
            assert item.length is not None  # set when the item closes
            if nxt < item.length and nxt <= commit_limit:
                return nxt, False, True
            return item.length, True, True
        if nxt <= min(item.received, commit_limit):
            return nxt, False, True
        latest = item.received // step * step
        if latest > item.boundary:  # partial text only: skip to the newest boundary
            return latest, False, False
        return None

    def has_work(self) -> bool:
        """Whether the head item has a pass due."""
        return bool(self.state.items) and self._target(self.state.items[0]) is not None

    def next_job(self) -> Job | None:
        """Plan the head item's next pass: hand its frames up to the pass's end to the encoder and
        list the windows to encode. None when nothing is due."""
        if not self.state.items:
            return None
        item = self.state.items[0]
        target = self._target(item)
        if target is None:
            return None
        frames, final, commits = target
        if not item.started:
            self._start(item)
        self._feed(item, frames)
        enc = item.encoder
        assert enc is not None  # set by _start
        if enc.frames == 0:  # an item without audio: the final pass has nothing to run
            return Job(item, True, 0, True, [], model_free=True)
        requests = enc.pending_windows()
        if final and item.length is not None and enc.frames > item.length:
            # a cut item: only its complete windows before the cut count
            requests = [r for r in requests if r.complete and r.end_frame <= item.length]
        # the item's tokens in all: bounded by the audio this pass covers, and by the slot
        audio_cap = self.policy.limits.budget(frames / FRAMES_PER_SECOND)
        cap = min(self.policy.max_item_tokens, audio_cap) - len(item.committed)
        budget = cap if final else min(self.policy.max_new_tokens_per_update, cap)
        return Job(item, final, frames, commits, requests, keep=item.stable_len, budget=max(budget, 0),
                   audio_bound=audio_cap < self.policy.max_item_tokens and budget == cap)

    def _start(self, item: AudioItem) -> None:
        st = self.state
        item.started = True
        item.encoder = IncrementalEncoder(self.asr.encoder)
        item.context = self._item_context()
        before, after = prompt_text_parts(item.context, st.forced_language)
        item.head_ids = self.asr.tokenizer.encode(before)
        item.tail_ids = self.asr.tokenizer.encode(after)
        item.text = ItemText(self.asr.tokenizer.token_bytes, st.forced_language)
        item.language = st.forced_language or ""

    def _item_context(self) -> str:
        """The user's context plus the carried committed text, the carried part shortened from its
        start until the system turn fits `MAX_CONTEXT_TOKENS`."""
        user, tail = self.state.options.context, self.state.context_tail
        if not self.asr.reads_context:  # synth-en: the caller's context only
            tail = ""
        while True:
            context = compose_context(user, tail)
            n = len(self.asr.tokenizer.encode(prompt_text_parts(context, None)[0]))
            if n <= MAX_CONTEXT_TOKENS or not tail:
                return context
            tail = tail[max(1, len(tail) // 8):]

    def _feed(self, item: AudioItem, frames: int) -> None:
        """Give the encoder the item's frames up to `frames` (from `pending`)."""
        need = frames - item.consumed
        enc = item.encoder
        assert enc is not None  # set by _start
        while need > 0 and item.pending:
            head = item.pending[0]
            take = min(need, head.shape[1])
            enc.append(torch.from_numpy(np.ascontiguousarray(head[:, :take])).to(
                device=self.asr.device, dtype=self.asr.dtype))
            if take == head.shape[1]:
                item.pending.pop(0)
            else:
                item.pending[0] = head[:, take:]
            item.consumed += take
            need -= take

    def draft(self, job: Job) -> list[int]:
        """Tokens this pass will likely decode first: the previous update's uncommitted ones (what
        the engine's self-speculative decode verifies in the prefill), at most `job.budget - 1` so
        that verifying them never runs past the budget."""
        previous = job.item.previous or []
        return list(previous[:max(job.budget - 1, 0)])

    def prefill_embeds(self, job: Job, draft: list[int] | tuple[int, ...] = ()) -> torch.Tensor:
        """The embeddings to prefill after the slot's kept `job.keep` positions: [S, hidden], the
        `draft` tokens (`draft(job)`) last when given.
        Call after the job's windows are encoded and committed to the item's encoder, and
        `prefilled(job)` once the prefill has run (a failed tick leaves the item as it was)."""
        item = job.item
        enc = item.encoder
        assert enc is not None  # the job's item has started
        embed = self.asr.decoder.embed
        dev = self.asr.device
        wt = enc.encoder.window_tokens
        parts = []
        kept_windows = item.stable_windows if job.keep else 0
        if job.keep == 0:
            parts.append(embed(torch.tensor(item.head_ids, device=dev)))
        if enc.frames > job.frames:
            # the final pass of a cut item: its complete windows before the cut point
            windows = enc.completed_outputs[kept_windows:job.frames // self.window_frames]
            audio = torch.cat(windows) if windows else torch.zeros(0, self.asr.config.audio.output_dim, device=dev)
        else:
            audio = enc.outputs()[kept_windows * wt:]  # nothing left to encode: no model call
        parts.append(audio.to(self.asr.dtype))
        parts.append(embed(torch.tensor(item.tail_ids + item.committed + list(draft), device=dev)))
        job.stable_windows = min(job.frames // self.window_frames, len(enc.completed_outputs))
        return torch.cat(parts)

    def prefilled(self, job: Job) -> None:
        """The pass's prefill is in the slot: from now on the slot keeps the system turn and the
        completed windows it covered."""
        job.item.in_slot = True
        job.item.stable_windows = job.stable_windows

    # -- results ---------------------------------------------------------------------------------

    def finish_job(self, job: Job, new_tokens: list[int], probs: list[float] | None = None) -> list[EngineEvent]:
        """Apply the tokens the pass decoded (an EOS at the end is dropped) and return its events.
        `probs`: each token's probability (the final pass's event gets its words' confidence)."""
        item, st = job.item, self.state
        if new_tokens and new_tokens[-1] in self.asr.eos_ids:
            hyp = list(new_tokens[:-1])
        else:
            hyp = list(new_tokens)
        seg = st.segments[item.segment_id]
        item.boundary = job.frames
        if job.final:
            n = len(hyp)
        elif job.commits:
            assert item.text is not None  # set when the item starts
            n = item.text.committable(hyp, self.policy.decide(hyp, item.previous,
                                                              probs[:len(hyp)] if probs is not None else None))
        else:
            n = 0
        stab = _stability(hyp, item.previous, n)
        item.committed += hyp[:n]
        if item.committed_probs is not None and probs is not None and len(probs) == len(new_tokens):
            item.committed_probs += probs[:n]
        elif n:
            item.committed_probs = None
        item.previous = hyp[n:]
        assert item.text is not None  # set when the item starts
        view = item.text.update(hyp[:n], [] if job.final else hyp[n:], final=job.final)
        if view.language is not None:
            item.language = view.language
        delta = view.committed_delta
        if delta:
            if view.committed == delta:  # the item's first text: after an earlier item's, a separator
                delta = join_texts(seg.text_end, delta) + delta
            # the carried text separates segments the way `join_texts` does for the whole transcript
            self._carry(delta if seg.text_end else join_texts(st.context_tail, delta) + delta)
            seg.text_end = delta[-1]
        start_s = seg.first_frame / FRAMES_PER_SECOND
        end_s = (item.first_frame + job.frames) / FRAMES_PER_SECOND
        events = []
        if job.final:
            st.items.popleft()
            is_final = item.ends_segment
            resume = None
            if is_final:
                del st.segments[item.segment_id]
                st.next_segment_id = item.segment_id + 1
                st.final_segments += 1
                resume = SessionSeed(seg.running_max_log10, st.context_tail, st.next_segment_id)
                st.resume = resume
            confidence = () if item.committed_probs is None else word_confidences(
                self.asr.tokenizer.token_bytes, item.committed, item.committed_probs, st.forced_language)
            events.append(EngineEvent(item.segment_id, delta, "", 1.0, start_s, end_s,
                                      item.language, is_final, word_confidence=confidence, resume=resume,
                                      token_ids=tuple(item.committed)))
        elif delta or view.partial != item.partial:
            events.append(EngineEvent(item.segment_id, delta, view.partial, stab, start_s, end_s,
                                          item.language, False))
        item.partial = view.partial
        st.events += len(events)
        return events

    def _carry(self, text: str) -> None:
        n = self.policy.context_tail_chars
        self.state.context_tail = (self.state.context_tail + text)[-n:] if n else ""

    def finalize_open(self) -> None:
        """End the open segment now (push-to-talk released, end of stream)."""
        for seg in self.state.segments.values():
            if not seg.ended:
                self._end_segment(seg)

    def resume_state(self) -> SessionSeed:
        """The state as of the last final segment (running max, carried context, next segment id)."""
        return self.state.resume


def _stability(hyp: list[int], previous: list[int] | None, committed: int) -> float:
    rest = hyp[committed:]
    if previous is None or not rest:
        return stability(rest, previous)
    agreed = 0
    for a, b in zip(hyp, previous):
        if a != b:
            break
        agreed += 1
    return max(agreed - committed, 0) / len(rest)


def _check_frames(frames) -> np.ndarray:
    if isinstance(frames, torch.Tensor):
        frames = frames.detach().cpu().numpy()
    frames = np.asarray(frames)
    if frames.ndim != 2 or frames.shape[0] != N_MELS:
        raise StreamInputError(f"frames must be [{N_MELS}, k], got {list(frames.shape)}")
    if not np.issubdtype(frames.dtype, np.floating):
        raise StreamInputError(f"frames must be floating point, got {frames.dtype}")
    frames = frames.astype(np.float32, copy=False)
    if not np.all(np.isfinite(frames)):
        raise StreamInputError("frames hold NaN or infinite values")
    return frames
