"""Continuous batching: each step, decode every running sequence and admit waiting ones while they fit.

Each step has a budget of `max_num_batched_tokens` tokens, spent as vLLM v1 spends it: first one token
for every running sequence that decodes, then the rest on prefills, oldest first: running sequences
whose prompt is part way through, then waiting ones in arrival order. With chunked prefill a prompt
that does not fit the rest of the budget is cut there and continues in the next steps, so a long
prompt never stalls the running decodes for more than one step's budget; without it a prompt is
prefilled whole, in a step of its own if it exceeds the budget.

After the forward pass `update_from_output` is the one place a step's results land: each sequence's
new token is appended and its stops checked (a finished sequence gives its blocks back at once), and
every running sequence's new token gets its KV slot at once, so that the allocator always holds every
token of every sequence in the cache. Speculative decoding: a decoding sequence with draft tokens
computes 1 + k tokens (counted in the budget), their K/V written to lookahead slots reserved for the
step; after it the accepted drafts keep their slots, the rest are released and the sequence's count of
computed tokens rolled back to what was accepted, so between steps nothing else differs. The scheduler
asks the KV allocator for room and never reaches inside it. When a new token needs a block and none is
free, the most recently admitted sequence is preempted (on a hybrid model, where a prompt is admitted
by its first chunk, usually one part way through its prefill): by recompute (its blocks are freed; it
re-enters the waiting queue and is prefilled again later) or by swap (its blocks move to the host pool
and come back when room frees up). A beam whose next token waits on a sibling's (`Sequence.awaiting`)
has nothing to compute: running, it holds its blocks, and when nothing else can run it is freed to make
room; waiting, it is not admitted until its search has chosen its next token. A waiting prompt whose
prefix blocks are being read from the disk tier (`Sequence.loading_kv`) is passed over likewise: the
prompts behind it are admitted meanwhile.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from pagedllm.engine.sampler import Sample
from pagedllm.engine.sequence import Sequence, SequenceStatus
from pagedllm.engine.stop_checker import StopChecker
from pagedllm.kv import KVAllocator, NoFreeBlocks
from pagedllm.kv.tiers import TierMoves

logger = logging.getLogger(__name__)

PreemptionMode = Literal["recompute", "swap"]


@dataclass
class SchedulerOutput:
    """One step's work: what to compute and which KV block moves must happen first (those decided after
    the previous step's forward pass among them)."""

    decodes: list[Sequence] = field(default_factory=list)  # one new token each
    prefills: list[Sequence] = field(default_factory=list)  # a chunk of uncached tokens each
    num_new_tokens: dict[str, int] = field(default_factory=dict)  # seq_id -> tokens computed this step
    copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst): forks, copy on write
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, host block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host block, device block)
    preempted: list[Sequence] = field(default_factory=list)  # since the previous step's forward pass
    ignored: list[Sequence] = field(default_factory=list)  # can never fit the cache: finished ("length")
    block_tables: list[list[list[int]]] = field(default_factory=list)  # per scheduled sequence, per group
    # The prefix cache tiers' disk writes and deletes, made after the forward computed the blocks.
    tier_moves: TierMoves = field(default_factory=TierMoves)

    @property
    def scheduled(self) -> list[Sequence]:
        return self.decodes + self.prefills

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens.values())

    def add(self, queue: list[Sequence], seq: Sequence, num_new_tokens: int) -> None:
        queue.append(seq)
        self.num_new_tokens[seq.seq_id] = num_new_tokens

    def ready(self) -> list[tuple[int, Sequence]]:
        """(row, sequence) of each scheduled sequence whose every token is computed once this step ran:
        each needs its next token (a prompt still being prefilled in chunks does not). `row` is its first
        row of the step's logits: a sequence with k draft tokens has 1 + k rows, one per position."""
        ready, row = [], 0
        for seq in self.scheduled:
            if seq.num_cached_tokens == seq.num_tokens + len(seq.draft_token_ids):
                ready.append((row, seq))
            row += 1 + len(seq.draft_token_ids)
        return ready


class Scheduler:
    """First-come first-served continuous batching over a KV allocator (paged or contiguous)."""

    def __init__(
        self,
        allocator: KVAllocator,
        max_model_len: int,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 8192,
        preemption_mode: PreemptionMode = "recompute",
        watermark: float = 0.01,
        enable_chunked_prefill: bool = True,
        stop_checker: StopChecker | None = None,
        on_release: Callable[[str], None] | None = None,
        max_loras: int | None = None,
    ):
        if preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {preemption_mode!r}")
        if preemption_mode == "swap" and not allocator.supports_swap:
            raise ValueError("preemption_mode='swap' needs the paged KV layout")
        self.allocator = allocator
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.preemption_mode = preemption_mode
        self.watermark = watermark  # share of blocks a new admission must leave free (vLLM's 1%)
        self.enable_chunked_prefill = enable_chunked_prefill
        # LoRA adapters the running and swapped sequences may run under together (None: no adapters)
        self.max_loras = max_loras
        self.stop_checker = stop_checker or StopChecker(None, (), max_model_len)
        # Told each seq_id that leaves the cache (finished, aborted, preempted): a draft model's KV follows.
        self.on_release = on_release or (lambda seq_id: None)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.swapped: deque[Sequence] = deque()
        self.num_preemptions = 0
        # Prompt tokens looked up in the prefix cache at first admission, and how many of them it held.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.num_blocks_swapped_out = 0  # device -> host block copies, over the scheduler's life
        self.num_blocks_swapped_in = 0  # host -> device
        # The next step's output as far as it is decided between steps: block copies (forks, copy on
        # write) and swap-outs to perform before its forward, and the sequences preempted for them.
        self._next = SchedulerOutput()

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Start `child` as a copy of `parent` (parallel sampling, beam search). A running parent's
        paged blocks are shared copy-on-write (a contiguous slab is copied slot by slot at the start of
        the next step). The child of a preempted parent, or one whose slab does not fit now, waits at the
        head of the queue to be prefilled with the parent's tokens (as a recomputed sequence is)."""
        if parent.status is SequenceStatus.RUNNING:
            try:
                self._next.copies += self.allocator.fork(parent.seq_id, child.seq_id)
            except NoFreeBlocks:
                pass
            else:
                child.num_cached_tokens = parent.num_cached_tokens
                child.status = SequenceStatus.RUNNING
                self.running.append(child)
                return
        child.status = SequenceStatus.WAITING
        self.waiting.appendleft(child)

    def finish(self, seq: Sequence) -> None:
        """Drop a finished (or aborted) sequence and give its KV blocks back at once."""
        for queue in (self.running, self.waiting, self.swapped):
            if seq in queue:
                queue.remove(seq)
        if seq.status in (SequenceStatus.RUNNING, SequenceStatus.SWAPPED):
            self.allocator.free(seq.seq_id)
        self.on_release(seq.seq_id)
        seq.status = SequenceStatus.FINISHED

    # -- before the forward pass --------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """The step's work; its tokens count as computed from now on (the forward pass computes them)."""
        out, self._next = self._next, SchedulerOutput()
        prefilling = self._schedule_decodes(out)
        if not out.preempted:
            self._schedule_swap_ins(out)
        budget = self._schedule_prefill_chunks(prefilling, out, self.max_num_batched_tokens - out.num_tokens)
        # A prompt part way through whose next chunk found no free block: nothing is admitted past it.
        stalled = any(s.num_tokens > s.num_cached_tokens and s not in out.scheduled for s in self.running)
        if not out.preempted and not self.swapped and not stalled:
            self._schedule_prefills(out, budget)
        while not out.scheduled and self.running and (self._has_work_waiting() or stalled):
            # Every running sequence is a beam waiting for a sibling that is not in the cache, or a prompt
            # whose next chunk finds no free block: make room.
            self._preempt(self.running[-1], out, swap=False)
            stalled = False
            self._schedule_swap_ins(out)
            if not self.swapped:
                self._schedule_prefills(out, budget)
        for seq in out.scheduled:
            seq.num_cached_tokens += out.num_new_tokens[seq.seq_id]
        self._plan_memory(out)
        return out

    def _plan_memory(self, out: SchedulerOutput) -> None:
        """The step's block tables, and the prefix cache tiers' copies planned since the last step: blocks
        evicted to host memory go with the swap-outs, host-tier hits into device blocks with the swap-ins."""
        out.block_tables = [self.allocator.block_tables(seq.seq_id) for seq in out.scheduled]
        out.tier_moves = self.allocator.take_tier_moves()
        out.swap_out += out.tier_moves.offload
        out.swap_in += out.tier_moves.load

    def fail(self, seqs: list[Sequence]) -> None:
        """A step failed: end these sequences ("error"), their blocks back in the pool, and drop the block
        moves decided for the next step (they were for the sequences failed)."""
        for seq in seqs:
            if not seq.is_finished:
                seq.finish_reason = "error"
                self.finish(seq)
            if seq.seq_id in self.allocator:  # given blocks by a schedule that raised before admitting it
                self.allocator.free(seq.seq_id)
        self._next = SchedulerOutput()

    def _has_work_waiting(self) -> bool:
        return bool(self.swapped) or any(seq.admissible for seq in self.waiting)

    def _schedule_decodes(self, out: SchedulerOutput) -> list[Sequence]:
        """Each running sequence with one token to compute decodes it (the token got its slot when it
        came), with its draft tokens as far as the budget left by one token each allows. Returns the
        others: those with more to compute (a prompt part way through its prefill) and those with none (a
        beam waiting for its siblings)."""
        decoding = [seq for seq in self.running if seq.num_tokens - seq.num_cached_tokens == 1]
        budget = self.max_num_batched_tokens - len(decoding)
        for seq in decoding:
            budget -= self._decode(seq, out, budget)
        decoding_ids = {seq.seq_id for seq in decoding}
        return [seq for seq in self.running if seq.seq_id not in decoding_ids]

    def _decode(self, seq: Sequence, out: SchedulerOutput, max_drafts: int = 0) -> int:
        """Schedule the sequence's newest token and up to max_drafts of its draft tokens, those in
        lookahead slots taken now (never more than it may still generate after the newest); returns how
        many drafts it verifies."""
        # A block it fills is computed this step; its window groups keep what the step's query reads.
        self.allocator.cache_blocks(seq.seq_id, seq.num_tokens, start=seq.num_cached_tokens)
        room = min(max_drafts, seq.max_new_tokens(self.max_model_len) - 1)
        drafts = seq.draft_token_ids[: max(room, 0)]
        if drafts and self.allocator.can_reserve_lookahead(seq.seq_id, len(drafts)):
            out.copies += self.allocator.reserve_lookahead(seq.seq_id, len(drafts))
        else:
            drafts = []
        seq.draft_token_ids = drafts
        out.add(out.decodes, seq, 1 + len(drafts))
        return len(drafts)

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
            if seq.num_tokens - seq.num_cached_tokens == 1:
                self._decode(seq, out)  # else it continues from the next step on

    def _schedule_prefill_chunks(self, seqs: list[Sequence], out: SchedulerOutput, budget: int) -> int:
        """Continue the prefills in progress, oldest first, within the budget; returns what is left."""
        for seq in seqs:
            start = seq.num_cached_tokens
            num_new = self._chunk(seq, out, min(seq.num_tokens - start, budget))
            if num_new > 0:
                self.allocator.cache_blocks(seq.seq_id, start + num_new, start=start)
                out.add(out.prefills, seq, num_new)
                budget -= num_new
        return budget

    def _schedule_prefills(self, out: SchedulerOutput, budget: int) -> None:
        """Admit waiting sequences first come first served while they fit. A beam awaiting its search's
        choice of its next token, or a prompt whose blocks are being read from disk, is passed over, and so
        is one whose LoRA adapter would be one more than max_loras beside the running ones' (it waits for
        theirs to finish)."""
        adapters = self._adapters_in_cache()
        for seq in [seq for seq in self.waiting if seq.admissible]:
            if not self._adapter_fits(seq, adapters):
                continue
            if (
                len(self.running) >= self.max_num_seqs
                or budget <= 0
                or (not self.enable_chunked_prefill and seq.num_tokens > budget and out.scheduled)
            ):
                return
            cached = self._allocate(seq)
            if cached is None:
                if self.running or self.swapped:
                    return
                # Nothing will ever free up room: this request cannot fit the cache at all.
                logger.warning(
                    "request %s (%d tokens) cannot fit the KV cache", seq.request_id, seq.num_tokens
                )
                seq.finish_reason = "length"
                self.finish(seq)
                out.ignored.append(seq)
                continue
            seq.num_cached_tokens = cached
            num_new = seq.num_tokens - cached
            if self.enable_chunked_prefill:
                num_new = self._chunk(seq, out, min(num_new, budget))
                if num_new == 0:  # its first chunk finds no block beside the running decodes' next ones
                    self.allocator.free(seq.seq_id)
                    seq.num_cached_tokens = 0
                    return
            self.waiting.remove(seq)
            if not seq.output_token_ids:
                seq.num_prefix_hits = cached
                if self.allocator.enable_prefix_caching and not seq.needs_prompt_logprobs:
                    self.prefix_cache_queries += seq.num_tokens
                    self.prefix_cache_hits += cached
            self.allocator.cache_blocks(seq.seq_id, cached + num_new, start=cached)
            adapters.add(seq.lora_int_id)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.add(out.prefills, seq, num_new)
            budget -= num_new

    def _adapters_in_cache(self) -> set[int | None]:
        """The LoRA adapters (lora_int_id; None: the base) of the running and swapped sequences."""
        return {seq.lora_int_id for queue in (self.running, self.swapped) for seq in queue}

    def _adapter_fits(self, seq: Sequence, adapters: set[int | None]) -> bool:
        """Whether admitting seq keeps the adapters in the cache within max_loras (the base is no adapter)."""
        if seq.lora_int_id is None or seq.lora_int_id in adapters or self.max_loras is None:
            return True
        return len(adapters - {None}) < self.max_loras

    def _chunk(self, seq: Sequence, out: SchedulerOutput, num_tokens: int) -> int:
        """The prompt tokens of `seq` this step computes: up to `num_tokens`, as far as the KV blocks for them
        fit (sliding-window groups take a chunk's blocks as it is computed), leaving a block per KV group for
        each of the step's decodes: their next tokens get slots after the forward pass."""
        keep_free = len(out.decodes) * self.allocator.num_groups
        return self.allocator.prefill_room(seq.seq_id, seq.num_cached_tokens, num_tokens, keep_free=keep_free)

    def _allocate(self, seq: Sequence) -> int | None:
        """Give a waiting sequence its blocks if they fit and, beside running sequences, leave the watermark
        free; returns how many of its tokens the prefix cache held, or None. A sequence still missing
        prompt log-probabilities reads no cached block: the cache keeps no logits (engine.prompt_logprobs)."""
        max_new, token_ids = seq.max_new_tokens(self.max_model_len), seq.token_ids
        read = not seq.needs_prompt_logprobs
        lora = seq.lora_int_id
        if not self.allocator.can_allocate(token_ids, max_new, read_prefix_cache=read, lora_int_id=lora) or (
            self.running and not self._leaves_headroom(seq)
        ):
            return None
        return self.allocator.allocate(
            seq.seq_id, token_ids, max_new, num_computed=0, read_prefix_cache=read, lora_int_id=lora
        )

    def _leaves_headroom(self, seq: Sequence) -> bool:
        """Admitting seq keeps a watermark of blocks free for the running sequences to grow into."""
        needed = self.allocator.num_blocks_needed(seq.token_ids)
        return self.allocator.num_free_blocks - needed >= self.watermark * self.allocator.num_total_blocks

    # -- after the forward pass ---------------------------------------------------------------------

    def update_from_output(self, new_tokens: list[tuple[Sequence, Sample]]) -> list[Sequence]:
        """Append each sequence's new tokens in order (sampled, or chosen by its beam search; a verify
        pass's accepted drafts and the token after them), finish those a token stops (the rest of its run
        is dropped), settle each verify pass (`_settle_drafts`), and give every other one in the cache its
        slot for its newest token. Returns the sequences finished here, their blocks already back in the
        pool."""
        finished, growing = [], set()
        for seq, smp in new_tokens:
            if seq.is_finished:
                continue  # an earlier token of its verify pass's run stopped it
            seq.append_token(smp)
            self.stop_checker.check(seq)
            if seq.finish_reason is not None:
                self.finish(seq)
                finished.append(seq)
            elif seq.status is SequenceStatus.SWAPPED:  # a beam its search moved on while swapped out
                self._append_slot(seq)  # its slot comes with it when it is swapped back in
            elif seq.status is SequenceStatus.RUNNING:
                growing.add(seq.seq_id)  # a waiting sequence gets its slots when it is admitted
        for seq in self.running:
            if seq.draft_token_ids and self._settle_drafts(seq):
                growing.discard(seq.seq_id)
        return finished + self._give_slots(growing)

    def _settle_drafts(self, seq: Sequence) -> bool:
        """After its verify pass: the new tokens that have lookahead slots (accepted drafts, and the
        target's token after them when a draft was rejected) take them, the rest are released, and the
        computed count goes back to every token but the newest. Returns whether all have their slot."""
        held = self.allocator.num_tokens(seq.seq_id)
        for token in seq.token_ids[held : held + len(seq.draft_token_ids)]:
            self.allocator.append(seq.seq_id, token)  # its slot was reserved: never a copy
        self.allocator.release_lookahead(seq.seq_id)
        seq.num_cached_tokens = seq.num_tokens - 1
        seq.draft_token_ids = []
        return self.allocator.num_tokens(seq.seq_id) == seq.num_tokens

    def _give_slots(self, growing: set[str]) -> list[Sequence]:
        """Append each growing sequence's newest token to its KV, oldest sequence first: first every one
        the cache has room for, then each other one, preempting the most recently admitted sequences
        until it fits. Returns the sequences alone in a cache they have outgrown, finished ("length")."""
        lacking = []
        for seq in self.running:
            if seq.seq_id in growing:
                if self.allocator.can_append(seq.seq_id):
                    self._append_slot(seq)
                else:
                    lacking.append(seq)
        missing = {seq.seq_id for seq in lacking}
        outgrown = []
        for seq in lacking:
            while seq.status is SequenceStatus.RUNNING and not self.allocator.can_append(seq.seq_id):
                victim = self.running[-1]
                if victim is seq and len(self.running) == 1:
                    seq.finish_reason = "length"  # alone and still no room: it has outgrown the whole cache
                    self.finish(seq)
                    outgrown.append(seq)
                else:
                    self._preempt(victim, self._next)
                    if victim.seq_id in missing and victim.status is SequenceStatus.SWAPPED:
                        self._append_slot(victim)  # its newest token's slot comes with it on swap-in
            if seq.status is SequenceStatus.RUNNING:
                self._append_slot(seq)
            missing.discard(seq.seq_id)
        return outgrown

    def _append_slot(self, seq: Sequence) -> None:
        self._next.copies += self.allocator.append(seq.seq_id, seq.output_token_ids[-1])

    def _preempt(self, seq: Sequence, out: SchedulerOutput, swap: bool | None = None) -> None:
        """Swap the sequence out (by default in swap mode), or free it to be prefilled again first; the
        block moves go to `out`, the step they are performed before."""
        self.num_preemptions += 1
        out.preempted.append(seq)
        self.running.remove(seq)
        seq.draft_token_ids = []  # proposed for a step it will not run in
        self.on_release(seq.seq_id)
        if self.preemption_mode == "swap" if swap is None else swap:
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
