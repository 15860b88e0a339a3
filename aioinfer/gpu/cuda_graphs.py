"""CUDA graphs for decode-only steps: captured once per batch-size bucket, replayed with padding.

A decode step launches hundreds of small kernels; replaying a captured graph removes their
launch cost. Buckets are 1, 2, 4, 8, then every 8 up to max_num_seqs (512 at most, vLLM's
largest by default: beyond it a step's launches weigh little beside its work); a step of n
requests replays the smallest bucket >= n. Padding rows write nowhere (slot -1) and attend to
nothing (seq_len 0), so their outputs are zeros that are sliced off. Steps with prefill
tokens, or more requests than the largest bucket, run eagerly.

Graphs are captured largest first into one shared memory pool: smaller graphs reuse the
larger ones' memory. They need an attention backend whose launches do not depend on host-side
lengths (the triton backend); the torch reference backend sizes its gathers on the host.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch
from torch import nn

from aioinfer.model.forward_context import forward_context
from aioinfer.model.layers.attention import AttentionBackend, AttentionMetadata
from aioinfer.sizing import capture_sizes

logger = logging.getLogger(__name__)


def padded_size(sizes: Sequence[int], n: int) -> int | None:
    """The smallest bucket that holds n requests, or None when n is beyond the largest."""
    for size in sizes:
        if size >= n:
            return size
    return None


class CudaGraphRunner:
    """Static input buffers, one graph per bucket, and `replay` for a decode-only step."""

    def __init__(
        self,
        model: nn.Module,
        kv_caches: list[torch.Tensor],
        attn_backend: AttentionBackend | None,
        max_num_seqs: int,
        max_blocks_per_seq: int,
        max_model_len: int,
        device: torch.device,
        long_rope: bool = False,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.attn_backend = attn_backend
        self.sizes = capture_sizes(max_num_seqs)
        self.max_model_len = max_model_len
        max_bs = self.sizes[-1]
        # Static buffers: every replay reads its inputs from these same addresses.
        self.input_ids = torch.zeros(max_bs, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_bs, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((max_bs,), -1, dtype=torch.long, device=device)
        self.seq_lens = torch.zeros(max_bs, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(
            (max_bs, max_blocks_per_seq), dtype=torch.int32, device=device
        )
        self.query_start_loc = torch.arange(max_bs + 1, dtype=torch.int32, device=device)
        # A LongRoPE model's graphs read which rows take the long factors (all False at capture).
        self.long_rope_rows = (
            torch.zeros(max_bs, dtype=torch.bool, device=device) if long_rope else None
        )
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.replays = 0  # proof that decode steps do run as graphs

    @property
    def max_batch_size(self) -> int:
        return self.sizes[-1]

    def _metadata(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            positions=self.positions[:bs],
            slot_mapping=self.slot_mapping[:bs],
            query_start_loc=self.query_start_loc[: bs + 1],
            seq_lens=self.seq_lens[:bs],
            block_tables=self.block_tables[:bs],
            query_start_loc_host=tuple(range(bs + 1)),
            seq_lens_host=(1,) * bs,  # not read by graph-safe backends
            num_decodes=bs,
            max_query_len=1,
            max_seq_len=self.max_model_len,
            long_rope_rows=None if self.long_rope_rows is None else self.long_rope_rows[:bs],
        )

    def _forward(self, bs: int) -> torch.Tensor:
        with forward_context(self._metadata(bs), self.kv_caches, self.attn_backend):
            return self.model(self.input_ids[:bs], self.positions[:bs])

    def capture(self) -> tuple[float, int]:
        """Capture every bucket, largest first. Returns (seconds, bytes of device memory)."""
        start = time.perf_counter()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # as each capture does: the difference is the graphs' alone
        free_before, _ = torch.cuda.mem_get_info()
        pool = None
        for bs in reversed(self.sizes):
            self._forward(bs)  # warm-up: lazy initialisation must not be captured
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            # thread_local: CUDA work of other threads (the tokenizer loads on one during
            # start-up) must not invalidate this thread's capture.
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                self.outputs[bs] = self._forward(bs)
            pool = graph.pool() if pool is None else pool
            self.graphs[bs] = graph
        torch.cuda.synchronize()
        free_after, _ = torch.cuda.mem_get_info()
        return time.perf_counter() - start, max(0, free_before - free_after)

    def can_run(self, num_requests: int) -> bool:
        return bool(self.graphs) and num_requests <= self.max_batch_size

    def replay(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        """Hidden states [n, hidden] of a decode-only step of n requests."""
        n = input_ids.shape[0]
        bs = padded_size(self.sizes, n)
        assert bs is not None, "can_run() must be checked first"
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(metadata.slot_mapping, non_blocking=True)
        self.seq_lens[:n].copy_(metadata.seq_lens, non_blocking=True)
        width = metadata.block_tables.shape[1]
        self.block_tables[:n, :width].copy_(metadata.block_tables, non_blocking=True)
        if self.long_rope_rows is not None:
            if metadata.long_rope_rows is None:
                self.long_rope_rows[:n].fill_(False)
            else:
                self.long_rope_rows[:n].copy_(metadata.long_rope_rows, non_blocking=True)
        # Padding rows: no KV write, empty context.
        self.slot_mapping[n:bs].fill_(-1)
        self.seq_lens[n:bs].zero_()
        self.graphs[bs].replay()
        self.replays += 1
        return self.outputs[bs][:n]
