"""Continuous batching: each step, decode every running sequence and admit waiting ones while they fit.

The scheduler asks the KV allocator for room and never reaches inside it. When a running sequence
needs a block and none is free, the most recently admitted sequence is preempted: by recompute (its
blocks are freed; it re-enters the waiting queue and is prefilled again later) or by swap (its blocks
move to the host pool and come back when room frees up).
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Literal

from pagedllm.engine.sequence import Sequence, SequenceStatus
from pagedllm.kv import NoFreeBlocks

logger = logging.getLogger(__name__)

PreemptionMode = Literal["recompute", "swap"]


@dataclass
class SchedulerOutput:
    """One step's work: what to compute and which KV block copies must happen first."""

    decodes: list[Sequence] = field(default_factory=list)  # one new token each
    prefills: list[Sequence] = field(default_factory=list)  # every uncached token each
    copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst) blocks
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, host block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host block, device block)
    preempted: list[Sequence] = field(default_factory=list)
    ignored: list[Sequence] = field(default_factory=list)  # can never fit in the cache: finish them

    @property
    def scheduled(self) -> list[Sequence]:
        return self.decodes + self.prefills

    @property
    def num_tokens(self) -> int:
        return sum(seq.num_new_tokens for seq in self.scheduled)


class Scheduler:
    """First-come first-served continuous batching over a KV allocator (paged or contiguous)."""

    def __init__(
        self,
        allocator,
        max_model_len: int,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 8192,
        preemption_mode: PreemptionMode = "recompute",
        watermark: float = 0.01,
    ):
        if preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {preemption_mode!r}")
        if preemption_mode == "swap" and not hasattr(allocator, "swap_out"):
            raise ValueError("preemption_mode='swap' needs the paged KV layout")
        self.allocator = allocator
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.preemption_mode = preemption_mode
        self.watermark = watermark  # share of blocks a new admission must leave free (vLLM's 1%)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.swapped: deque[Sequence] = deque()
        self.num_preemptions = 0
        # Prompt tokens looked up in the prefix cache at first admission, and how many of them it held.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.num_blocks_swapped_out = 0  # device -> host block copies, over the scheduler's life
        self.num_blocks_swapped_in = 0  # host -> device
        self._fork_copies: list[tuple[int, int]] = []  # to perform before the next forward

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Start `child` as a copy of running `parent` (parallel sampling): paged blocks are shared
        copy-on-write; a contiguous slab is copied slot by slot at the start of the next step."""
        self._fork_copies += self.allocator.fork(parent.seq_id, child.seq_id)
        child.num_cached_tokens = parent.num_cached_tokens
        child.status = SequenceStatus.RUNNING
        self.running.append(child)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def finish(self, seq: Sequence) -> None:
        """Drop a finished (or aborted) sequence and give its KV blocks back at once."""
        for queue in (self.running, self.waiting, self.swapped):
            if seq in queue:
                queue.remove(seq)
        if seq.status in (SequenceStatus.RUNNING, SequenceStatus.SWAPPED):
            self.allocator.free(seq.seq_id)
        seq.status = SequenceStatus.FINISHED

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(copies=self._fork_copies)
        self._fork_copies = []
        self._schedule_decodes(out)
        if not out.preempted:
            self._schedule_swap_ins(out)
        if not out.preempted and not self.swapped:
            self._schedule_prefills(out)
        return out

    def _schedule_decodes(self, out: SchedulerOutput) -> None:
        """Give every running sequence a slot for its newest token, preempting from the back if needed."""
        queue = deque(self.running)
        self.running = []
        while queue:
            seq = queue.popleft()
            while not self.allocator.can_append(seq.seq_id):
                if queue:
                    self._preempt(queue.pop(), out)
                    continue
                if self.running:
                    self._preempt(seq, out)
                else:  # alone and still no room: it has outgrown the whole KV cache
                    out.ignored.append(seq)
                break
            else:
                out.copies += self.allocator.append(seq.seq_id, seq.token_ids[-1])
                self.running.append(seq)
                out.decodes.append(seq)

    def _schedule_swap_ins(self, out: SchedulerOutput) -> None:
        while self.swapped and len(self.running) < self.max_num_seqs:
            seq = self.swapped[0]
            if not self.allocator.can_swap_in(seq.seq_id):
                return
            copies = self.allocator.swap_in(seq.seq_id)
            self.num_blocks_swapped_in += len(copies)
            out.swap_in += copies
            self.swapped.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            if self.allocator.can_append(seq.seq_id):  # else it decodes from the next step on
                out.copies += self.allocator.append(seq.seq_id, seq.token_ids[-1])
                out.decodes.append(seq)

    def _schedule_prefills(self, out: SchedulerOutput) -> None:
        budget = self.max_num_batched_tokens - len(out.decodes)
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            max_new = seq.max_new_tokens(self.max_model_len)
            if seq.num_tokens > budget and (out.prefills or out.decodes):
                return
            if not self.allocator.can_allocate(seq.token_ids, max_new) or (
                self.running and not self._leaves_headroom(seq)
            ):
                if not self.running and not self.swapped:
                    # Nothing will ever free up room: this request cannot fit the cache at all.
                    logger.warning(
                        "request %s (%d tokens) cannot fit the KV cache", seq.request_id, seq.num_tokens
                    )
                    self.waiting.popleft()
                    out.ignored.append(seq)
                    continue
                return
            self.waiting.popleft()
            cached = self.allocator.allocate(seq.seq_id, seq.token_ids, max_new)
            seq.num_cached_tokens = cached
            if not seq.output_token_ids:
                seq.num_prefix_hits = cached
                if self.allocator.enable_prefix_caching:
                    self.prefix_cache_queries += seq.num_tokens
                    self.prefix_cache_hits += cached
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.prefills.append(seq)
            budget -= seq.num_new_tokens

    def _leaves_headroom(self, seq: Sequence) -> bool:
        """Admitting seq keeps a watermark of blocks free for the running sequences to grow into."""
        needed = -(-seq.num_tokens // self.allocator.block_size)
        return self.allocator.num_free_blocks - needed >= self.watermark * self.allocator.num_total_blocks

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.num_preemptions += 1
        out.preempted.append(seq)
        if seq in self.running:
            self.running.remove(seq)
        if self.preemption_mode == "swap":
            try:
                copies = self.allocator.swap_out(seq.seq_id)
            except NoFreeBlocks:  # the host pool is full too: fall back to recompute
                pass
            else:
                self.num_blocks_swapped_out += len(copies)
                out.swap_out += copies
                seq.status = SequenceStatus.SWAPPED
                self.swapped.append(seq)
                return
        self.allocator.free(seq.seq_id)
        seq.num_cached_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
