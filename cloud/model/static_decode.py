"""A decode step with static shapes, for CUDA-graph capture (optional; off by default).

`decode_step` launches a few hundred small kernels per token; at small batch on a GPU the launch
overhead dominates. Here the step reads its inputs from fixed buffers and pads the batch to a
bucket size and the key length to a bucket length, so each (batch bucket, key bucket) pair can be
captured once as a CUDA graph and replayed. Padding rows decode into a scratch slot the step keeps
for itself. Without `cuda_graphs` (and on CPU) the same padded computation runs eagerly, which is
what the CPU tests compare against `decode_step`.
"""

from __future__ import annotations

import torch

from .decoder import Qwen3Decoder
from .kv_cache import KVCache, decode_layout


def _bucket(n: int, limit: int, smallest: int) -> int:
    """The smallest power-of-two multiple of `smallest` that holds n, capped at `limit`."""
    b = smallest
    while b < n:
        b *= 2
    return min(b, limit)


class StaticDecodeStep:
    """`decode_step` over padded, bucketed shapes; replays CUDA graphs when `cuda_graphs` is set.

    Takes one cache slot for its padding rows. Batches up to `max_batch` slots; keys are attended
    up to a power-of-two bucket (at least `min_kv_len`) of the longest slot, so the per-step cost
    tracks the real context length rather than `cache.max_len`.
    """

    def __init__(self, decoder: Qwen3Decoder, cache: KVCache, max_batch: int, cuda_graphs: bool = False,
                 min_kv_len: int = 256):
        if cuda_graphs and cache.device.type != "cuda":
            raise ValueError("CUDA graphs need the cache on a CUDA device")
        decoder.check_cache(cache)
        self.decoder, self.cache, self.max_batch = decoder, cache, max_batch
        self.cuda_graphs = cuda_graphs
        self.min_kv_len = min(min_kv_len, cache.max_len)
        self.scratch = cache.allocate()
        dev = cache.device
        # static inputs: graphs read these addresses, the host refills them every step
        self.tokens = torch.zeros(max_batch, dtype=torch.long, device=dev)
        self.slot = torch.full((max_batch,), self.scratch, dtype=torch.long, device=dev)
        self.pos = torch.zeros(max_batch, dtype=torch.long, device=dev)
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        # one memory pool for every graph: they never run at once and each output is copied out
        # before the next replay, so their intermediates may share memory
        self._pool = torch.cuda.graph_pool_handle() if cuda_graphs else None

    def buckets(self) -> list[tuple[int, int]]:
        """Every (batch bucket, key-length bucket) a step can use."""
        batches = sorted({_bucket(b, self.max_batch, 1) for b in range(1, self.max_batch + 1)})
        kvs, k = [], self.min_kv_len
        while k < self.cache.max_len:
            kvs.append(k)
            k *= 2
        kvs.append(self.cache.max_len)
        return [(m, kv) for m in batches for kv in kvs]

    def capture_all(self) -> int:
        """Capture every bucket's graph now (a server's start, a benchmark's warm-up), so that no
        step pays for a capture later. Returns how many graphs were captured."""
        if not self.cuda_graphs:
            return 0
        todo = [b for b in self.buckets() if b not in self._graphs]
        for M, kv_len in todo:
            self._graphs[(M, kv_len)] = self._capture(M, kv_len)
        return len(todo)

    @torch.no_grad()
    def _run(self, M: int, kv_len: int) -> torch.Tensor:
        """The step over the first M buffer rows: logits [M, vocab]."""
        layout = decode_layout(self.slot[:M], self.pos[:M], kv_len)
        x = self.decoder.embed(self.tokens[:M])
        return self.decoder.lm_head(self.decoder.forward_packed(x, layout, self.cache))

    def _capture(self, M: int, kv_len: int):
        # capture with every row on the scratch slot: the warm-up runs really write the cache
        self.slot[:M].fill_(self.scratch)
        self.pos[:M].zero_()
        self.tokens[:M].zero_()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._run(M, kv_len)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # thread_local: another thread's CUDA work (a server's file lane, say) cannot spoil the capture
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            out = self._run(M, kv_len)
        return graph, out

    def __call__(self, slots: list[int], token_ids: torch.Tensor) -> torch.Tensor:
        """Feed one token per slot (token_ids: [B]) -> logits [B, vocab], as `decode_step`."""
        B = len(slots)
        if not 0 < B <= self.max_batch:
            raise ValueError(f"batch of {B} slots, max_batch is {self.max_batch}")
        if self.scratch in slots:
            raise ValueError(f"slot {self.scratch} is this step's scratch slot")
        if token_ids.shape != (B,):
            raise ValueError(f"token_ids shape {tuple(token_ids.shape)} for {B} slots")
        M = _bucket(B, self.max_batch, 1)
        needed = max(self.cache.length(s) for s in slots) + 1
        kv_len = _bucket(needed, self.cache.max_len, self.min_kv_len)
        starts = self.cache.reserve(slots, [1] * B)  # validates before anything runs
        if self.cuda_graphs and (M, kv_len) not in self._graphs:
            self._graphs[(M, kv_len)] = self._capture(M, kv_len)

        pad = M - B
        dev = self.cache.device
        self.slot[:M].copy_(torch.tensor(slots + [self.scratch] * pad, device=dev))
        self.pos[:M].copy_(torch.tensor(starts + [0] * pad, device=dev))
        self.tokens[:B].copy_(token_ids)
        self.tokens[B:M].zero_()
        if self.cuda_graphs:
            graph, out = self._graphs[(M, kv_len)]
            graph.replay()
        else:
            out = self._run(M, kv_len)
        # the graph's output buffer is overwritten by the next replay: hand out a copy
        return out[:B].clone()
