"""The engine that serves every session with one model (its asyncio owner: cloud/inference/scheduler.py).

API:

    engine = Engine(asr, EngineConfig(max_sessions=16, max_batch=32, max_queued_frames=...))
    sid = engine.open_session(SessionOptions(...))     # Overloaded past the limits
    engine.ingest(sid, segment_id, first_frame, frames, segment_start, segment_end, running_max_log10)
    engine.ingest_packet(sid, packet)                   # an edge FeaturePacket (payload decoded here)
    engine.finalize(sid)                                # end the open segment now
    engine.configure(sid, context)                      # the user context from the next audio item on
    engine.has_work() -> bool
    engine.ready_sessions() -> int / engine.working_on(sid) -> bool   # work waiting / owed to one
    engine.step(emit=None) -> list[(sid, EngineEvent)]   # one batched tick over all ready sessions
                                                    # (emit: each pass's events as it finishes)
    engine.run_until_idle() -> list[(sid, EngineEvent)]
    engine.failure(sid) -> Exception | None             # a session taken out by its own fault
    engine.close_session(sid)                           # frees the KV slot

One tick (`Engine.step`):
  (a) every ready session (up to `max_batch`, rotating the start so none starves) plans its next
      pass; all their encoder windows go through ONE `encode_windows` call. Sessions sending audio
      faster than real time wait while live ones are ready (cloud/inference/priority.py);
  (b) their prompt suffixes (active window, template tail, committed tokens; the slot keeps the
      rest), each followed by its draft (the previous update's uncommitted tokens), go through ONE
      batched `prefill`; the greedy tokens that confirm a draft are taken from it, no decode step
      each (`_verify`: exact self-speculation, the tokens plain greedy decoding gives);
  (c) greedy decode steps run batched across all those slots; a slot leaves the batch at EOS or
      its budget, and sessions that became ready meanwhile (or did not fit) JOIN between steps, each
      session served once per tick (twice if live while one of the tick's first passes runs on).
      While live passes decode, the passes of sessions ahead of real time hold still (their slots
      keep their place; the own decoder's `_advance`, on a CPU), so a flood's pass does not slow
      a live one's steps;
  (d) each session's commit policy turns its tokens into events, handed out as its pass finishes
      (`step(emit=...)`), not when the tick's longest pass does.
Sessions only meet in the batch: each has its own slot, prompt and positions, so batched results
are the one-at-a-time results (tests check it).

Threads: `step` runs in one worker thread (the Scheduler's, cloud/inference/scheduler.py); ingest/open/close come from the event
loop. One lock guards session bookkeeping; the model runs outside it, on state only the engine
thread touches (the head item's encoder and decoder state).
"""

from __future__ import annotations

import secrets
import threading
import time
from typing import Callable

import torch

from .engine_config import DECODE_STEPS as DECODE_STEPS
from .engine_config import TEMPLATE_TOKENS as TEMPLATE_TOKENS
from .engine_config import EngineConfig as EngineConfig
from .engine_config import EngineObserver as EngineObserver
from .engine_config import slot_tokens as slot_tokens
from ..model.decoder import decode_step, prefill
from ..model.kv_cache import KVCache
from ..model.static_decode import StaticDecodeStep
from .priority import MAX_DEFER_TICKS, MAX_HOLD_STEPS, RealTimeLead
from .decode_pass import Running as _Running
from .decode_pass import chosen_probabilities, pass_end
from .speculation import greedy_prefix
from .decoder_stream import Job, DecoderStream, SessionOptions, EngineEvent
from ...shared.errors import Overloaded, SessionNotFound, StreamInputError
from ...shared.features_spec import FRAMES_PER_SECOND
from ...shared.codec import decode_frames


class TickFailed(RuntimeError):
    """The model failed during a tick. `events` are those of passes that had finished before
    (deliver them); the sessions still in flight are as they were before the tick. The model's
    exception is the `__cause__`."""

    def __init__(self, events: list):
        super().__init__("engine tick failed")
        self.events = events


class Engine:
    """Synchronous core: owns the model and one KV cache with a slot per session."""

    def __init__(self, asr, config: EngineConfig = EngineConfig(), observer: EngineObserver | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.asr = asr
        self.config = config
        self.observer = observer
        self.clock = clock  # wall seconds: how far each session's audio runs ahead of real time
        self._tick_sessions = 0  # sessions served in the tick under way
        self.cache = self._new_cache()
        self._static: StaticDecodeStep | None = None
        if config.decode_step != "plain":
            if not isinstance(self.cache, KVCache):
                raise ValueError(f"decode_step {config.decode_step!r} is the own decoder's (this engine has no KV cache)")
            if config.decode_step == "graphs" and self.asr.device.type != "cuda":
                raise ValueError("decode_step 'graphs' needs the model on a CUDA device")
            # its scratch slot is the cache's extra one (`_new_cache`); a session has at most one pass
            # in flight, so no batch is larger than max_sessions: no bucket (graph) past it
            self._static = StaticDecodeStep(self.asr.decoder, self.cache,
                                            max_batch=min(config.max_batch, config.max_sessions),
                                            cuda_graphs=config.decode_step == "graphs")
        self.sessions: dict[str, DecoderStream] = {}
        self._lock = threading.Lock()
        self._rotor = 0  # where the next tick starts looking for ready sessions
        self._busy: set[str] = set()  # sessions with a pass in flight
        self._closing: set[str] = set()  # closed while busy: freed when the pass ends
        self._failed: dict[str, BaseException] = {}  # sessions whose own processing raised
        self._lead: dict[str, RealTimeLead] = {}  # audio each session has sent ahead of real time
        self._deferred: dict[str, int] = {}  # ahead sessions waiting for live ones: since which tick
        self._ticks = 0
        self._tick_live = False  # the tick under way serves a live session
        self._tick_deferred: set[str] = set()  # ... and deferred these
        self.deferrals = 0  # (tick, session) pairs where a ready ahead session waited for live ones
        # own decoder: passes of sessions ahead of real time hold still while live ones decode (CPU:
        # a batch's step costs about its size there; on a GPU a step costs the same for one or eight)
        self.hold_ahead = config.hold_ahead if config.hold_ahead is not None else self.asr.device.type == "cpu"
        self.held_steps = 0  # decode steps such a pass held still while live ones decoded
        self.truncations: dict[str, int] = {}  # decodes ended by the budget / the loop guard
        self.decoded_tokens = 0  # tokens generated by every pass so far (the decode work)
        self.decoded_by_pass = {"update": 0, "final": 0}  # the same, by the kind of pass
        # of those, tokens that took no decode step of their own: confirmed drafts (`_verify`)
        self.verified_tokens = 0
        self.drafted_tokens = 0  # tokens prefilled as drafts (confirmed or not)
        self.speculates = config.speculate
        self.compute_s = 0.0  # compute spent in `step` so far (see `_clock`)
        self.busy_s = 0.0  # wall time spent in `step` so far (all threads' work, e.g. vLLM's)

    def _new_cache(self):
        """One KV slot per session, and one for the static decode step's padding rows (cloud/inference/vllm_decoder.py's
        engine keeps its KV in vLLM instead)."""
        extra = 0 if self.config.decode_step == "plain" else 1
        return KVCache.for_config(self.asr.config.text, max_slots=self.config.max_sessions + extra,
                                  max_len=slot_tokens(self.config.slot_policy), dtype=self.asr.dtype,
                                  device=self.asr.device)

    # -- sessions --------------------------------------------------------------------------------

    def open_session(self, options: SessionOptions = SessionOptions(), session_id: str | None = None) -> str:
        """Admit a new session; Overloaded when full or when queued work is past the limit."""
        limit = self.config.slot_policy
        p = options.policy
        if p.max_item_tokens > limit.max_item_tokens or p.limit_frames() > limit.limit_frames():
            raise StreamInputError("the session's policy needs longer KV slots than this engine has "
                                   f"(max_item_tokens <= {limit.max_item_tokens}, segment_limit_s <= "
                                   f"{limit.segment_limit_s})")
        with self._lock:
            if len(self.sessions) >= self.config.max_sessions or self.cache.num_free() == 0:
                raise Overloaded(f"the engine serves {self.config.max_sessions} sessions at most")
            queued = sum(s.queued_frames() for s in self.sessions.values())
            if queued > self.config.max_queued_frames:
                raise Overloaded(f"{queued / 100:.0f} s of audio are waiting to be processed")
            slot = self.cache.allocate()
            try:
                session = DecoderStream(self.asr, options, slot)
            except BaseException:
                self.cache.free(slot)
                raise
            sid = session_id or secrets.token_urlsafe(16)
            if sid in self.sessions:
                self.cache.free(slot)
                raise StreamInputError(f"session {sid} exists")
            self.sessions[sid] = session
            self._lead[sid] = RealTimeLead(self.clock())
            return sid

    def close_session(self, sid: str) -> None:
        """Forget a session and free its slot (after its pass in flight, if any)."""
        with self._lock:
            session = self._get(sid)
            del self.sessions[sid]
            self._failed.pop(sid, None)
            self._lead.pop(sid, None)
            self._deferred.pop(sid, None)
            if sid in self._busy:
                self._closing.add(sid)
            else:
                self.cache.free(session.state.slot)

    def session(self, sid: str) -> DecoderStream:
        with self._lock:
            return self._get(sid)

    def _get(self, sid: str) -> DecoderStream:
        try:
            return self.sessions[sid]
        except KeyError:
            raise SessionNotFound(f"no session {sid!r}") from None

    # -- input -----------------------------------------------------------------------------------

    def ingest(self, sid: str, segment_id: int, first_frame: int, frames, segment_start: bool = False,
               segment_end: bool = False, running_max_log10: float | None = None) -> int:
        """Apply frames to a session (see `DecoderStream.ingest`). Thread-safe."""
        with self._lock:
            n = self._get(sid).ingest(segment_id, first_frame, frames, segment_start, segment_end,
                                      running_max_log10)
            self._lead[sid].add(n / FRAMES_PER_SECOND, self.clock())
            return n

    def ingest_packet(self, sid: str, packet) -> int:
        """Apply an edge `FeaturePacket` (its payload decoded here, as the server does)."""

        frames = decode_frames(packet.payload)
        if frames.shape[1] != packet.frame_count:
            raise StreamInputError(f"payload holds {frames.shape[1]} frames, packet says {packet.frame_count}")
        return self.ingest(sid, packet.segment_id, packet.first_frame, frames, packet.segment_start,
                           packet.segment_end, packet.running_max_log10)

    def finalize(self, sid: str) -> None:
        """End the session's open segment now."""
        with self._lock:
            self._get(sid).finalize_open()

    def configure(self, sid: str, context: str) -> None:
        """The session's user context from its next audio item on (`DecoderStream.configure`)."""
        with self._lock:
            self._get(sid).configure(context)

    def queued_frames(self, sid: str) -> int:
        """Frames of this session received but not yet encoded (what its queue limits count)."""
        with self._lock:
            return self._get(sid).queued_frames()

    def has_work(self) -> bool:
        with self._lock:
            return any(sid not in self._busy and sid not in self._failed and s.has_work()
                       for sid, s in self.sessions.items())

    def ready_sessions(self) -> int:
        """Sessions with a pass due and none in flight: the work waiting for the model. Thread-safe
        (the metrics endpoint reads it at scrape time)."""
        with self._lock:
            return sum(1 for sid, s in self.sessions.items()
                       if sid not in self._busy and sid not in self._failed and s.has_work())

    def working_on(self, sid: str) -> bool:
        """Whether the engine owes this session work: a pass due or in flight. Frames of an open
        segment short of the next update are not: they wait for the client's next frames."""
        with self._lock:
            s = self.sessions.get(sid)
            return s is not None and sid not in self._failed and (sid in self._busy or s.has_work())

    def failure(self, sid: str) -> BaseException | None:
        """The exception that stopped this session, if its own processing failed. Such a session
        gets no more passes; the others carry on (a bad stream never affects another)."""
        with self._lock:
            return self._failed.get(sid)

    def _fail(self, sid: str, session: DecoderStream, error: BaseException) -> None:
        """Take a session whose own code raised out of service (its state may be half-updated)."""
        with self._lock:
            self._busy.discard(sid)
            if sid in self._closing:
                self._closing.discard(sid)
                self.cache.free(session.state.slot)
            elif sid in self.sessions:
                self._failed[sid] = error

    # -- one tick --------------------------------------------------------------------------------

    def _plan(self, exclude: set[str], room: int, again: set[str] = frozenset()  # type: ignore[assignment]
              ) -> list[tuple[str, DecoderStream, Job]]:
        """Next passes of up to `room` ready sessions not in `exclude`, rotating the start; sessions
        ahead of real time only in a tick without live ones (or once deferred `MAX_DEFER_TICKS`).
        Sessions in `again` may go even though `exclude` has them, live ones only."""
        with self._lock:
            ids = list(self.sessions)
            if not ids or room <= 0:
                return []
            start = self._rotor % len(ids)
            now = self.clock()
            order = [sid for sid in ids[start:] + ids[:start]
                     if (sid not in exclude or (sid in again and not self._lead[sid].ahead(now)))
                     and sid not in self._busy and sid not in self._failed]
            waiting = {sid for sid in order if self._lead[sid].ahead(now)
                       and self._ticks - self._deferred.get(sid, self._ticks) < MAX_DEFER_TICKS}
            if self._tick_live or any(self.sessions[sid].has_work() for sid in order if sid not in waiting):
                self._tick_live = True
                for sid in waiting - self._tick_deferred:
                    if self.sessions[sid].has_work():
                        self._deferred.setdefault(sid, self._ticks)
                        self._tick_deferred.add(sid)
                        self.deferrals += 1
                        if self.observer is not None:
                            self.observer.deferred()
                order = [sid for sid in order if sid not in waiting]
            planned: list[tuple[str, DecoderStream, Job]] = []
            failed: list[tuple[str, DecoderStream, Exception]] = []
            for sid in order:
                if len(planned) >= room:
                    break
                s = self.sessions[sid]
                try:
                    job = s.next_job()
                except Exception as e:  # noqa: BLE001 - one session's bug must not stop the others
                    failed.append((sid, s, e))
                    continue
                if job is not None:
                    planned.append((sid, s, job))
                    self._busy.add(sid)
                    self._deferred.pop(sid, None)
            if planned:
                # the next tick starts after the last session served: everyone gets a turn
                self._rotor = (ids.index(planned[-1][0]) + 1) % len(ids)
        for sid, s, err in failed:
            self._fail(sid, s, err)
        return planned

    def _encode(self, planned: list[tuple[str, DecoderStream, Job]]) -> set[str]:
        """Run the encoder windows of planned passes as one batch and commit them to their sessions'
        window caches; returns the sessions that failed doing so (failed here: `_fail`)."""
        requests = [(sid, s, j, r) for sid, s, j in planned for r in j.requests]
        # complete 1-s chunks whose conv stem an earlier pass ran reuse it (`WindowRequest.stem`)
        outs, stems = self.asr.encoder.encode_windows([r.features for *_, r in requests],
                                                      [r.item_start for *_, r in requests],
                                                      [r.stem for *_, r in requests], return_stems=True)
        broken: set[str] = set()
        for (sid, s, job, req), o, st in zip(requests, outs, stems):
            if sid in broken:
                continue
            try:
                enc = job.item.encoder
                assert enc is not None  # a planned item has started
                enc.commit(req, o, st)
            except Exception as e:  # noqa: BLE001
                broken.add(sid)
                self._fail(sid, s, e)
        return broken

    def _prompts(self, planned: list[tuple[str, DecoderStream, Job]]) -> tuple[list[tuple[str, DecoderStream, Job, torch.Tensor]], list]:
        """Encode planned passes (one batch) and build each one's prefill embeddings. Returns the
        passes to prefill with their embeddings, and the events of passes that needed no model."""
        events, ready = [], []
        broken = self._encode(planned)
        for sid, s, job in planned:
            if sid in broken:
                continue
            if job.model_free:
                events += self._finish(sid, s, job, [])
                continue
            try:
                job.draft = s.draft(job) if self.speculates else []
                ready.append((sid, s, job, s.prefill_embeds(job, job.draft)))
            except Exception as err:  # noqa: BLE001
                self._fail(sid, s, err)
        return ready, events

    def _start(self, planned: list[tuple[str, DecoderStream, Job]]) -> tuple[dict[str, _Running], list]:
        """Encode (one batch) and prefill (one batch) planned passes. Returns the passes that decode
        (by session id), and the events of passes that needed no model."""
        run: list[_Running] = []
        ready, events = self._prompts(planned)
        slots, embeds = [], []
        for sid, s, job, emb in ready:
            self.cache.truncate(s.state.slot, job.keep)
            slots.append(s.state.slot)
            embeds.append(emb)
            run.append(_Running(sid, s, job, s.state.slot, []))
        if not run:
            return {}, events
        logits = prefill(self.asr.decoder, self.cache, slots, embeds, tails=[len(r.job.draft) + 1 for r in run])
        for r in run:
            r.session.prefilled(r.job)
        picked = logits.argmax(-1)
        greedy, probs = picked.tolist(), chosen_probabilities(logits, picked, self.asr.decoder.lm_head)
        still: dict[str, _Running] = {}
        for r in run:
            k = len(r.job.draft)
            if not self._verify(r, greedy[:k + 1], probs[:k + 1]):
                still[r.sid] = r
            else:
                events += self._finish(r.sid, r.session, r.job, r.tokens, r.probs)
            del greedy[:k + 1], probs[:k + 1]
        return still, events

    def _verify(self, r: _Running, greedy: list[int], probs: list[float]) -> bool:
        """Take the greedy tokens the prefill over the pass's draft settles
        (cloud/inference/speculation.py), each through `_done`, and cut the slot back to the
        positions they confirmed. Returns whether the pass is over."""
        draft = r.job.draft
        if r.job.budget <= 0:
            return self._done(r)
        self.drafted_tokens += len(draft)
        taken, over = 0, False
        for t in greedy_prefix(greedy, draft):
            r.tokens.append(t)
            r.probs.append(probs[taken])
            taken += 1
            over = self._done(r)
            if over:
                break
        self.verified_tokens += taken - 1
        if not over:  # the slot holds every drafted token: keep those of the tokens taken but the last
            self.cache.truncate(r.slot, self.cache.length(r.slot) - len(draft) + taken - 1)
        return over

    def _done(self, r: _Running) -> bool:
        """Whether a pass is over (cloud/inference/decode_pass.py), counting the limits that end passes."""
        end = pass_end(r, self.asr.eos_ids)
        if end.dropped:
            self._decoded(r.job, end.dropped)
        if end.limit is not None:
            self._truncated(end.limit)
        return end.over

    def _truncated(self, reason: str) -> None:
        """A decode ended by a limit, not by the model (`reason` in decode_limits.TRUNCATION_REASONS)."""
        self.truncations[reason] = self.truncations.get(reason, 0) + 1
        if self.observer is not None:
            self.observer.truncated(reason)

    def _decoded(self, job: Job, n: int) -> None:
        self.decoded_tokens += n
        self.decoded_by_pass["final" if job.final else "update"] += n

    def _finish(self, sid: str, session: DecoderStream, job: Job, tokens: list[int],
                probs: list[float] | None = None) -> list:
        """`probs`: each token's probability (None: not known, e.g. from vLLM)."""
        self._decoded(job, len(tokens))
        with self._lock:
            try:
                evs = session.finish_job(job, tokens, probs)
            except Exception as e:  # noqa: BLE001
                failed = e
            else:
                self._busy.discard(sid)
                if sid in self._closing:
                    self._closing.discard(sid)
                    self.cache.free(session.state.slot)
                    return []  # nobody listens any more
                return [(sid, e) for e in evs]
        self._fail(sid, session, failed)
        return []

    @torch.no_grad()
    def step(self, emit: Callable[[list[tuple[str, EngineEvent]]], None] | None = None
             ) -> list[tuple[str, EngineEvent]]:
        """One batched tick over every ready session; returns the events it produced, in order.

        `emit`: called (in this thread) with the events of the passes that finished at each decode
        step, as they finish; those are not returned again. A tick lasts as long as its longest
        pass (a final over a long segment, a pass that runs to its budget): without `emit`, a short
        update that finished at its fifth token would wait for it.

        If the model itself fails (e.g. out of memory) the tick raises `TickFailed` with the events
        of the passes that had finished (and not been emitted); the sessions still in flight are
        released as they were before their pass, so a later tick retries them with the same result."""
        self._tick_sessions = 0
        try:  # the clock too: on CUDA its synchronize is where a device error shows
            t0, w0 = self._clock(), time.perf_counter()
            try:
                events = self._step(emit)
            finally:
                self.compute_s += self._clock() - t0
                self.busy_s += time.perf_counter() - w0
        except BaseException as e:
            if self.observer is not None:
                self.observer.failed(e)
            raise
        if self.observer is not None and self._tick_sessions:
            self.observer.tick(self._tick_sessions)
        return events

    def _clock(self) -> float:
        """Compute time: this thread's CPU time on CPU; wall time after a device sync on CUDA."""
        if self.asr.device.type == "cuda":
            torch.cuda.synchronize(self.asr.device)
            return time.perf_counter()
        return time.thread_time()

    def _step(self, emit: Callable[[list[tuple[str, EngineEvent]]], None] | None = None
              ) -> list[tuple[str, EngineEvent]]:
        """The tick's skeleton, one for both decoders: plan and launch the ready sessions' passes,
        advance the passes in flight one decode step at a time (handing finished passes' events to
        `emit` after each), let sessions that became ready (or did not fit) join in the freed
        places; on a failure, drop what is in flight (`_abandon`) and release the tick's sessions as
        they were before it. The decoder supplies `_start` (launch planned passes), `_advance` (one
        step) and `_abandon`.

        A session is served once a tick, or twice when it is live and one of the tick's first passes
        still runs on (a final over a long segment, a pass to its budget, a pass held back for live
        ones): its next update goes beside that pass rather than after the tick. The tick ends when
        its first passes and every joiner's have."""
        served: dict[str, int] = {}  # passes each session got this tick
        tick: dict[str, DecoderStream] = {}  # sessions planned this tick
        self._ticks += 1
        self._tick_live = False
        self._tick_deferred = set()
        events: list = []
        flight: dict[str, _Running] = {}  # the passes decoding, in batch order (keyed by the decoder)

        def launch(planned: list[tuple[str, DecoderStream, Job]]) -> None:
            for sid, _, _ in planned:
                served[sid] = served.get(sid, 0) + 1
            tick.update((sid, s) for sid, s, _ in planned)
            more, started = self._start(planned)
            flight.update(more)
            events.extend(started)

        def flush() -> None:
            if emit is not None and events:
                emit(events[:])
                events.clear()

        try:
            launch(self._plan(set(served), self.config.max_batch))
            first = list(flight.values())  # the tick's first passes (by identity: a key may come again)
            flush()
            while flight:
                self._advance(flight, events)
                flush()  # before the joiners' encoder and prefill
                # join: sessions that became ready (or did not fit) take the freed places
                first = [r for r in first if any(r is f for f in flight.values())]
                again = {sid for sid, n in served.items() if n == 1} if first else set()
                joined = self._plan(set(served), self.config.max_batch - len(flight), again)
                if joined:
                    launch(joined)
        except Exception as e:
            self._abandon(flight)
            self._release(tick)
            raise TickFailed(events) from e
        finally:
            self._tick_sessions = len(served)
        return events

    def capture_decode_graphs(self) -> int:
        """With `decode_step="graphs"`: capture every (batch, key length) bucket's CUDA graph now, so
        that no tick pays for a capture later (otherwise each is captured on first use). Returns
        how many were captured."""
        return self._static.capture_all() if self._static is not None else 0

    def _decode_step(self, slots: list[int], feed: torch.Tensor) -> torch.Tensor:
        """One batched decode step (`EngineConfig.decode_step`): logits [len(slots), vocab]."""
        if self._static is not None:
            return self._static(slots, feed)
        return decode_step(self.asr.decoder, self.cache, slots, feed)

    def _advance(self, flight: dict[str, _Running], events: list) -> None:
        """One batched decode step of every pass in flight: the finished ones leave `flight`, their
        events go to `events` as they finish (a step that fails midway keeps those)."""
        running = list(flight.items())
        if self.hold_ahead:
            # passes of sessions ahead of real time hold still while live ones decode (at most
            # MAX_HOLD_STEPS each): what they compute is the same whenever they step, and the live
            # passes' steps stay as small as without them
            with self._lock:
                now = self.clock()
                live = [r.sid in self._lead and not self._lead[r.sid].ahead(now) for _, r in running]
            if any(live):
                held = [r for (_, r), is_live in zip(running, live) if not is_live and r.held < MAX_HOLD_STEPS]
                for r in held:
                    r.held += 1
                self.held_steps += len(held)
                running = [(key, r) for key, r in running if all(r is not h for h in held)]
        feed = torch.tensor([r.tokens[-1] for _, r in running], device=self.asr.device)
        logits = self._decode_step([r.slot for _, r in running], feed)
        picked = logits.argmax(-1)
        for (key, r), t, p in zip(running, picked.tolist(), chosen_probabilities(logits, picked, self.asr.decoder.lm_head)):
            r.tokens.append(t)
            r.probs.append(p)
            if self._done(r):
                del flight[key]
                events += self._finish(r.sid, r.session, r.job, r.tokens, r.probs)

    def _abandon(self, flight: dict[str, _Running]) -> None:
        """A failed tick's passes in flight are dropped (the own decoder keeps nothing of them)."""

    def _release(self, tick: dict[str, DecoderStream]) -> None:
        """After a failed tick: its passes in flight never reached finish_job, so their sessions stay
        as they were before them (a closed one's slot is freed now)."""
        with self._lock:
            for sid, session in tick.items():
                if sid in self._busy:
                    self._busy.discard(sid)
                    if sid in self._closing:
                        self._closing.discard(sid)
                        self.cache.free(session.state.slot)

    def run_until_idle(self) -> list[tuple[str, EngineEvent]]:
        """Step while any session has work (what an in-process caller does after feeding audio)."""
        events = []
        while self.has_work():
            events += self.step()
        return events
