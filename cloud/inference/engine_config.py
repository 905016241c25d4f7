"""What an `Engine` (cloud/inference/engine.py) is built with and reports to: its capacity
(`EngineConfig`), the KV positions a session's slot needs (`slot_tokens`), and the observer of its
work (`EngineObserver`, the server's metrics)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from .commit import CommitPolicy
from .decoder_stream import MAX_CONTEXT_TOKENS
from ..model.encoder import num_audio_tokens

TEMPLATE_TOKENS = 32  # chat-template tokens around the context and audio, forced language included


@dataclass(frozen=True)
class EngineConfig:
    """Capacity of one engine.

    max_sessions: sessions at once (one KV slot each). max_batch: passes batched in one tick.
    max_queued_frames: feature frames received but not yet encoded, over all sessions, beyond which
    new sessions are refused (the server also bounds them per session and per key, see
    cloud/server_session.SessionLimits, so that one client cannot reach this alone). slot_policy: the largest policy a session may use (it sizes the slots).
    decode_step: how a tick's batched decode steps run (DECODE_STEPS): "plain" (`decode_step`,
    shapes as they come), "static" (`StaticDecodeStep`: the batch padded to a power-of-two bucket,
    keys to a length bucket; one more KV slot for its padding rows) or "graphs" (the same, each
    bucket captured once as a CUDA graph and replayed: CUDA only). All three give the same tokens.
    hold_ahead: a pass of a session ahead of real time takes no decode step while live passes
    decode (at most `MAX_HOLD_STEPS` steps; the own decoder). None: on a CPU, where a step's cost
    grows with its batch, not on a GPU, where holding would only add steps after the live ones.
    speculate: each pass prefills the previous update's uncommitted tokens after its prompt and
    keeps those that greedy decoding confirms (`Engine._verify`): the same tokens, fewer decode
    steps (the own decoder; vLLM runs every pass as one request of its own).
    """

    max_sessions: int = 16
    max_batch: int = 32
    max_queued_frames: int = 100 * 60 * 10
    slot_policy: CommitPolicy = CommitPolicy()
    decode_step: str = "plain"
    hold_ahead: bool | None = None
    speculate: bool = True

    def __post_init__(self):
        if self.decode_step not in DECODE_STEPS:
            raise ValueError(f"decode_step {self.decode_step!r}: one of {', '.join(DECODE_STEPS)}")


DECODE_STEPS = ("plain", "static", "graphs")


def slot_tokens(policy: CommitPolicy) -> int:
    """KV positions one session needs: system turn, template, the longest item's audio, its text."""
    return MAX_CONTEXT_TOKENS + TEMPLATE_TOKENS + num_audio_tokens(policy.limit_frames()) + policy.max_item_tokens


class EngineObserver(Protocol):
    """What the engine reports as it works (the server's metrics, cloud/server.py). Called from
    the engine's thread."""

    def tick(self, sessions: int) -> None:
        """A tick ran passes of `sessions` sessions (one batch, with joins)."""

    def truncated(self, reason: str) -> None:
        """A decode was ended by a limit, not by the model (decode_limits.TRUNCATION_REASONS)."""

    def deferred(self) -> None:
        """A ready session ahead of real time waited a tick for live ones (cloud/inference/priority.py)."""

    def failed(self, error: BaseException) -> None:
        """A tick raised: the model itself failed (`step` raises it on)."""
