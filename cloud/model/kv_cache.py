"""A pre-allocated, slotted KV cache for the Qwen3 decoder, shared by all sessions.

Storage is allocated once — k and v, each [layers, max_slots, kv_heads, max_len, head_dim] — and
reused for every request: a session takes a slot, fills it by prefill/decode, rolls it back with
`truncate`, and gives it back with `free`. Lengths live on the host (plain ints) so that building a
step's index tensors never reads from the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class KVCacheFull(RuntimeError):
    """No free slot, or a slot would grow past `max_len`."""


class KVCache:
    """Per-slot keys and values of every decoder layer, in storage allocated once.

    `k[layer, slot, :, :length(slot)]` holds the (RoPE'd) keys of that slot's tokens; positions at
    and beyond `length(slot)` hold stale values that attention masks out. Storage starts zeroed so
    stale values are always finite (a masked NaN would still poison `softmax @ v`).
    """

    def __init__(self, num_layers: int, max_slots: int, kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        shape = (num_layers, max_slots, kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_slots = max_slots
        self.max_len = max_len
        self._lengths = [0] * max_slots
        self._in_use = [False] * max_slots
        # pop() hands out the lowest free slot first, which keeps batches contiguous more often
        self._free = list(range(max_slots - 1, -1, -1))

    @classmethod
    def for_config(cls, config, max_slots: int, max_len: int, dtype: torch.dtype = torch.float32,
                   device: torch.device | str = "cpu") -> "KVCache":
        """A cache shaped for a `TextDecoderConfig`."""
        return cls(config.num_hidden_layers, max_slots, config.num_key_value_heads, max_len,
                   config.head_dim, dtype=dtype, device=device)

    @property
    def dtype(self) -> torch.dtype:
        return self.k.dtype

    @property
    def device(self) -> torch.device:
        return self.k.device

    def allocate(self) -> int:
        """Take a free slot (length 0). Raises `KVCacheFull` when none is left."""
        if not self._free:
            raise KVCacheFull(f"all {self.max_slots} KV cache slots are in use")
        slot = self._free.pop()
        self._in_use[slot] = True
        self._lengths[slot] = 0
        return slot

    def free(self, slot: int) -> None:
        """Give a slot back; its storage is reused as is (no clearing needed: length masks it)."""
        self._check(slot)
        self._in_use[slot] = False
        self._lengths[slot] = 0
        self._free.append(slot)

    def length(self, slot: int) -> int:
        """Number of cached positions of `slot`."""
        self._check(slot)
        return self._lengths[slot]

    def truncate(self, slot: int, n: int) -> None:
        """Roll back: keep the first `n` cached positions of `slot`, forget the rest."""
        self._check(slot)
        if not 0 <= n <= self._lengths[slot]:
            raise ValueError(f"truncate slot {slot} to {n}: it holds {self._lengths[slot]} positions")
        self._lengths[slot] = n

    def num_free(self) -> int:
        return len(self._free)

    def _check(self, slot: int) -> None:
        if not (0 <= slot < self.max_slots and self._in_use[slot]):
            raise ValueError(f"KV cache slot {slot} is not allocated")

    def reserve(self, slots: list[int], counts: list[int]) -> list[int]:
        """Grow each `slots[i]` by `counts[i]` positions (all or none); returns the old lengths,
        i.e. the position of each slot's first new token."""
        if len(set(slots)) != len(slots):
            raise ValueError(f"a slot appears twice in one batch: {slots}")
        if any(n < 1 for n in counts):
            raise ValueError(f"every sequence needs at least one new token: {counts}")
        for s, n in zip(slots, counts):  # check all before reserving any
            self._check(s)
            if self._lengths[s] + n > self.max_len:
                raise KVCacheFull(f"slot {s} would hold {self._lengths[s] + n} positions, "
                                  f"max_len is {self.max_len}")
        starts = [self._lengths[s] for s in slots]
        for s, n in zip(slots, counts):
            self._lengths[s] += n
        return starts


@dataclass(frozen=True)
class BatchLayout:
    """Where the N packed new tokens of a batch of B slots go.

    Projections and MLPs run on the packed tokens ([N, hidden], no padding); attention runs on R
    padded rows [R, max_new, ...] against cached keys [0, kv_len). Either R = B rows gathered from
    the cache by slot (a copy), or, when the batch's slots lie in a short range lo..hi-1, R = hi - lo
    rows read from a view of the cache (no copy): rows of slots outside the batch attend position 0
    only and are dropped. All tensors are small and built from host ints, so a step never syncs.
    """

    slots: torch.Tensor  # [R] cache slot of each attention row
    row: torch.Tensor  # [N] attention row of each packed token
    col: torch.Tensor  # [N] index of the token among its sequence's new tokens
    pos: torch.Tensor  # [N] absolute position = cached length before this call + col
    slot: torch.Tensor  # [N] cache slot of each token
    mask: torch.Tensor  # [R, 1, max_new, kv_len] bool, True where a query may attend
    rows: int  # R
    max_new: int
    kv_len: int
    dense: bool  # packed tokens are exactly the padded rows, row-major: reshape, don't scatter
    slot_range: tuple[int, int] | None  # rows are the cache slots lo..hi-1: slice, don't gather


def attention_mask(start: torch.Tensor, new: torch.Tensor, max_new: int, kv_len: int) -> torch.Tensor:
    """Which cached positions each new query sees: the whole prefix, its new tokens causally.

    start: [B] cached length before the new tokens; new: [B] number of new tokens (>= 1).
    Returns [B, 1, max_new, kv_len] bool. Padded query rows (j >= new) see the sequence's valid
    keys only, so they stay finite; their outputs are dropped.
    """
    j = torch.arange(max_new, device=start.device)  # [S]
    p = torch.arange(kv_len, device=start.device)  # [L]
    q_pos = start[:, None] + j[None, :]  # [B, S]
    end = (start + new)[:, None, None]  # [B, 1, 1]
    mask = (p[None, None, :] <= q_pos[:, :, None]) & (p[None, None, :] < end)  # [B, S, L]
    return mask[:, None]


def plan_batch(cache: KVCache, slots: list[int], new_counts: list[int],
               kv_len: int | None = None) -> BatchLayout:
    """Reserve `new_counts[i]` positions in each slot and describe the batch for attention.

    `kv_len` fixes the attended key length (e.g. `cache.max_len` for static shapes); by default it
    is the longest slot after the append.
    """
    needed = max(cache.length(s) + n for s, n in zip(slots, new_counts))
    kv_len = needed if kv_len is None else kv_len
    if kv_len < needed or kv_len > cache.max_len:
        raise (KVCacheFull if needed > cache.max_len else ValueError)(
            f"kv_len {kv_len} outside [{needed}, {cache.max_len}]")
    starts = cache.reserve(slots, new_counts)
    max_new = max(new_counts)

    B, N = len(slots), sum(new_counts)
    lo, hi = min(slots), max(slots) + 1
    # in a decode step reading a few idle rows costs less than copying every row; in a prefill an
    # idle row would cost a whole padded block of queries
    if hi - lo == B or (max_new == 1 and hi - lo <= 2 * B):
        row_of_seq, row_slots, slot_range = [s - lo for s in slots], list(range(lo, hi)), (lo, hi)
    else:
        row_of_seq, row_slots, slot_range = list(range(B)), list(slots), None
    R = len(row_slots)
    row_start, row_new = [0] * R, [1] * R  # idle rows: one query at position 0, finite, dropped
    for r, st, n in zip(row_of_seq, starts, new_counts):
        row_start[r], row_new[r] = st, n

    dev = cache.device
    as_t = lambda v: torch.tensor(v, dtype=torch.long, device=dev)  # noqa: E731
    new_t = as_t(new_counts)
    # output_size from the host: without it repeat_interleave reads the counts back (a sync on CUDA)
    seq = torch.repeat_interleave(torch.arange(B, device=dev), new_t, output_size=N)  # [N]
    first = torch.cumsum(new_t, 0) - new_t  # [B] packed index of each sequence's first token
    col = torch.arange(N, device=dev) - first[seq]
    return BatchLayout(
        slots=as_t(row_slots), row=as_t(row_of_seq)[seq], col=col, pos=as_t(starts)[seq] + col,
        slot=as_t(slots)[seq], mask=attention_mask(as_t(row_start), as_t(row_new), max_new, kv_len),
        rows=R, max_new=max_new, kv_len=kv_len,
        dense=row_of_seq == list(range(R)) and all(n == max_new for n in new_counts),
        slot_range=slot_range)


def decode_layout(slot: torch.Tensor, pos: torch.Tensor, kv_len: int) -> BatchLayout:
    """The layout of one token per row, from device tensors only (slot, pos: [M]): what a captured
    decode step builds inside the graph from its static input buffers."""
    M = slot.shape[0]
    return BatchLayout(
        slots=slot, row=torch.arange(M, device=slot.device), col=torch.zeros_like(pos), pos=pos, slot=slot,
        mask=attention_mask(pos, torch.ones_like(pos), 1, kv_len), rows=M, max_new=1, kv_len=kv_len,
        dense=True, slot_range=None)
