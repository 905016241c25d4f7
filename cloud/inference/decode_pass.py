"""One decoding pass in flight (`Engine`, the vLLM engine): its tokens, the probability the model gave
each, and what ends it — EOS, a hallucination loop (cut back to its first copy, so the repeats are
never committed) or its token budget."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .decoder_stream import Job, DecoderStream

# tokens the loop guard looks back over: longer than any run it lets through with the default
# limits (it checks after every token, so a run is cut as soon as it qualifies)
LOOP_WINDOW = 192


@dataclass
class Running:
    sid: str
    session: DecoderStream
    job: Job
    slot: int
    tokens: list[int]
    held: int = 0  # decode steps it held still for live passes (`Engine._advance`)
    probs: list[float] = field(default_factory=list)  # each token's probability as the model gave it


@dataclass(frozen=True)
class PassEnd:
    over: bool
    limit: str | None = None  # "loop" or "budget" (`decode_limits.TRUNCATION_REASONS`): a limit ended it
    dropped: int = 0  # tokens generated and then dropped (a loop's repeats): decode work all the same


def chosen_probabilities(logits: torch.Tensor, picked: torch.Tensor, head=None) -> list[float]:
    """Each row's probability of its picked token (the softmax over the whole vocabulary): the
    words' confidence. With `head` an `OutputHead` that computes only its live rows (synth-en: 1,714
    of 151,936), the other logits are exactly 0, so the softmax's denominator is the live rows' sum
    plus one exp(0 - max) per zero row: the same probability from the live columns alone (in fp64:
    exact, where the fp32 softmax over all rows drifts by ~2e-4), 15x cheaper for synth-en. The full
    softmax was 13.6% of a served small-vocabulary model's CPU at 48 streams (py-spy)."""
    live = head.live_rows() if head is not None and hasattr(head, "live_rows") else None
    if live is None:
        return torch.softmax(logits.float(), dim=-1).gather(-1, picked.unsqueeze(-1)).squeeze(-1).tolist()
    rows = live[0]
    columns = logits.index_select(-1, rows).double()  # fp64 over the few live columns: exact to fp32
    chosen = logits.gather(-1, picked.unsqueeze(-1)).squeeze(-1).double()
    top = columns.amax(-1).clamp_min(0.0)  # the max over all logits: the zero rows' 0 included
    total = (columns - top.unsqueeze(-1)).exp().sum(-1) + (logits.shape[-1] - rows.numel()) * torch.exp(-top)
    return (torch.exp(chosen - top) / total).tolist()


def pass_end(r: Running, eos_ids) -> PassEnd:
    """Whether the pass `r` is over after its latest token; a loop's repeats are cut from it here."""
    if r.tokens and r.tokens[-1] in eos_ids:
        return PassEnd(True)
    committed = r.job.item.committed
    tail = committed[-LOOP_WINDOW:] + r.tokens if len(r.tokens) < LOOP_WINDOW else r.tokens[-LOOP_WINDOW:]
    cut = r.session.policy.limits.loop_cut(tail)
    if cut is not None:
        keep = max(len(r.tokens) - (len(tail) - cut), 0)
        dropped = len(r.tokens) - keep
        del r.tokens[keep:], r.probs[keep:]
        return PassEnd(True, "loop", dropped)
    if len(r.tokens) >= r.job.budget:
        return PassEnd(True, "budget" if r.job.audio_bound else None)
    return PassEnd(False)
