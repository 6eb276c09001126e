"""PagedAllocator: KV memory as fixed-size blocks mapped per sequence by a block table (PagedAttention).

Token t of a sequence lives in slot `table[t // block_size] * block_size + t % block_size`, where
`table` is its block table. Blocks are taken on demand (only when the last one is full) and given
back the instant a sequence is freed. `fork` shares blocks (copy-on-write on the first divergent
append), prefix caching reuses full blocks keyed by a hash chain (a block becomes findable once its K/V is
computed: `cache_blocks`), and `swap_out` / `swap_in` move a sequence to a host pool and back (it may
be appended to while there: its new tokens get their blocks when it comes back).

KV groups (kv/groups.py): with `windows` of several groups, a sequence has one block table per group,
all mapping the same token positions and drawing on one pool. A sliding-window group of window w gives
a block back (to the pool, or to the prefix cache's least recently used end) once no query of the
sequence reads it: when every token in it is at least w before the first token a step computes. Its
table keeps the position (None; NO_BLOCK in the views), so the kernels, which clamp a sliding layer's
reads to its window, never see it. With window groups every group takes a long prompt's blocks chunk by
chunk as `cache_blocks` says each chunk is computed, and admission asks only for the first chunk (vLLM
v1's rule): a full group's blocks for `prefill_chunk` tokens, and the window groups' promise (the window
plus such a chunk: what they hold at once). Later chunks take free blocks, as many as `prefill_room` says
fit; when none is free the prompt waits, and the scheduler preempts it when a decode needs a block.

For speculative decoding, `reserve_lookahead` gives a sequence slots past its tokens, in every group's
table, for the verify pass to write draft K/V into; accepted tokens fill them by `append` (only then is a
block keyed, by accepted tokens) and `release_lookahead` gives back the rest, a block left holding no token
returning to the pool (a sequence holding lookahead slots is neither forked nor swapped out: both wait for
the release).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from pagedllm.kv.block_pool import Block, BlockPool, block_hash_chain, hash_block
from pagedllm.kv.events import KVEventLog
from pagedllm.kv.interface import (
    KVUsage,
    NoFreeBlocks,
    SlotState,
    check_positive,
    check_request,
    duplicate,
    unknown,
)
from pagedllm.kv.managers import GroupManager, held_alone, make_manager
from pagedllm.kv.sequence import SeqBlocks
from pagedllm.kv.tiers import HostPool, Prefetch, PrefixTiers

GROWTH_ROOM_TOKENS = 128  # free slots after a sequence's newest block set aside for it (BlockPool.room)
NO_BLOCK = -1  # a block_tables entry a window group has given back: no query reads that position again
# A block of the default size holds this many bytes of each K/V value position (one dim of one KV head over
# the block's tokens): 16 float32 tokens, vLLM's GPU default. A narrower cache dtype gets more tokens a block
# rather than fewer bytes, so decode attention reads runs of memory as long as float32's from each scattered
# block (docs/JOURNAL.md, "Int8 KV: blocks of equal bytes").
DEFAULT_BLOCK_VALUE_BYTES = 64


def default_block_size(value_bytes: int) -> int:
    """Tokens per KV block when block_size is not set, for a cache storing each K/V value in `value_bytes`
    bytes: 16 for float32, 32 for bfloat16 / float16, 64 for int8 / fp8 (whose scales ride beside)."""
    if value_bytes not in (1, 2, 4):
        raise ValueError(f"a KV cache value takes 1, 2 or 4 bytes, got {value_bytes!r}")
    return DEFAULT_BLOCK_VALUE_BYTES // value_bytes


@dataclass(frozen=True)
class BlockStates:
    """Every device block, indexed by block id (compact lists, for pictures of the cache)."""

    ref_counts: list[int]  # block tables holding the block (0: free; > 1: shared)
    num_tokens: list[int]  # tokens written in a held block (0 for a free one)
    cached: list[bool]  # findable in the prefix cache (a free cached block can be taken back)
    groups: list[int]  # KV group of a held or cached block (-1: a plain free block)


class PagedAllocator:
    """Block tables over a pool of `num_blocks` blocks, plus a host pool of `num_host_blocks` for swap.

    `windows` has one entry per KV group: None for full attention (the default: one group), or the
    group's sliding window in tokens. `prefill_chunk` is the prompt tokens a step of a prefill can always
    compute (the window groups' blocks for them are promised at admission); None: a whole prompt at once.
    `tiers` (kv/tiers.py, one full-attention group with prefix caching): the host and disk tiers under
    the prefix cache; their host pool is the swap pool too (`num_host_blocks` is then its size).
    """

    supports_swap = True

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        enable_prefix_caching: bool = False,
        num_host_blocks: int | None = None,
        windows: Sequence[int | None] = (None,),
        prefill_chunk: int | None = None,
        tiers: PrefixTiers | None = None,
    ):
        if tiers is not None:
            if len(windows) != 1 or windows[0] is not None or not enable_prefix_caching:
                raise ValueError(
                    "prefix cache tiers need prefix caching and one full-attention KV group, got "
                    f"enable_prefix_caching={enable_prefix_caching}, windows={tuple(windows)}"
                )
            num_host_blocks = tiers.host.num_blocks
        num_host_blocks = num_blocks if num_host_blocks is None else num_host_blocks
        check_positive("num_blocks", num_blocks)
        check_positive("block_size", block_size)
        if not isinstance(num_host_blocks, int) or num_host_blocks < 0:
            raise ValueError(f"num_host_blocks must be a non-negative integer, got {num_host_blocks!r}")
        if not windows:
            raise ValueError("windows needs one entry per KV group, got none")
        for window in windows:
            if window is not None:
                check_positive("a KV group's sliding window", window)
        if prefill_chunk is not None:
            check_positive("prefill_chunk", prefill_chunk)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.num_host_blocks = num_host_blocks
        self.windows = tuple(windows)
        self.prefill_chunk = prefill_chunk
        # With window groups every group takes a prompt's blocks chunk by chunk and admission asks for the
        # first chunk only (vLLM v1's rule): a prompt that outgrows the free blocks waits or is preempted.
        self.chunked = any(window is not None for window in self.windows)
        self.managers: list[GroupManager] = [
            make_manager(g, window, block_size, prefill_chunk, self.chunked)
            for g, window in enumerate(windows)
        ]
        self._windowed = [m for m in self.managers if m.promised]
        self.tiers = tiers
        self.pool = BlockPool(num_blocks, room=-(-GROWTH_ROOM_TOKENS // block_size), tiers=tiers)
        self.events: KVEventLog | None = None  # the prefix cache's changes, once enable_events is called
        self.host = tiers.host if tiers is not None else HostPool(num_host_blocks)
        self._seqs: dict[Hashable, SeqBlocks] = {}
        self._resident_slots = 0  # slots the tables of sequences on the device cover (shared: per table)
        self._promised = 0  # free blocks set aside for prefills in progress (the sum of their promises)
        self._hashed: tuple[tuple[int, ...], list[bytes]] = ((), [])  # the last prompt and its block hashes

    def enable_events(self) -> KVEventLog:
        """Log the prefix cache's changes from now on as vLLM's KV cache events (kv/events.py)."""
        if not self.enable_prefix_caching:
            raise ValueError("KV cache events need enable_prefix_caching=True")
        self.events = self.pool.events = KVEventLog(self.block_size)
        return self.events

    # -- capacity --------------------------------------------------------------------------------------

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def num_total_blocks(self) -> int:
        return len(self.pool.blocks)

    @property
    def num_free_blocks(self) -> int:
        """Blocks a new allocation may take: those no sequence holds (cached-but-unreferenced blocks count
        as free), less those promised to prefills in progress."""
        return self.pool.num_free - self._promised

    @property
    def num_free_host_blocks(self) -> int:
        """Host blocks a swap-out may take: free ones and (with tiers) cached prefix blocks."""
        return self.host.num_reclaimable

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self._seqs

    def all_free(self) -> bool:
        """No sequence left and every device and host block back in its free pool."""
        return (
            not self._seqs
            and self.pool.num_free == self.num_total_blocks
            and self.num_free_host_blocks == self.num_host_blocks
            and self._promised == 0
        )

    def num_blocks_needed(self, prompt_token_ids: Sequence[int]) -> int:
        """Blocks a prompt of this length takes from admission to the end of its prefill, prefix hits
        not counted (what a scheduler keeps a watermark above)."""
        return sum(m.admission_blocks(len(prompt_token_ids)) for m in self.managers)

    # -- allocate --------------------------------------------------------------------------------------

    def can_allocate(
        self,
        prompt_token_ids: Sequence[int],
        max_new_tokens: int,
        *,
        true_output_len: int | None = None,
        read_prefix_cache: bool = True,
    ) -> bool:
        """Whether the prompt's blocks fit now (decode blocks are taken later, on demand).
        `true_output_len` (what `pagedllm bench memory` passes every layout) changes nothing here."""
        check_request(prompt_token_ids, max_new_tokens)
        _, hits, num_new, _ = self._plan(prompt_token_ids, read_prefix_cache)
        n = len(prompt_token_ids)  # admitted by its first chunk, a prompt must still fit the whole pool
        lasting = sum(m.peak(n) for m in self.managers)
        return self._fits(hits, num_new) and lasting <= self.num_total_blocks

    def allocate(
        self,
        seq_id: Hashable,
        prompt_token_ids: Sequence[int],
        max_new_tokens: int,
        *,
        true_output_len: int | None = None,
        num_computed: int | None = None,
        read_prefix_cache: bool = True,
    ) -> int:
        """Give the prompt its blocks; returns how many leading prompt tokens were already cached.

        The hit is whole blocks only and never the whole prompt (its last token is always computed); each
        window group needs only the hit's last window cached. `max_new_tokens` is only checked and
        `true_output_len` ignored: paged memory grows on demand. The first `num_computed` prompt tokens
        (default: all) are computed this step: their full blocks become findable at once, and the window
        groups take blocks up to there (the rest as `cache_blocks` says later chunks are computed).
        `read_prefix_cache=False` takes no cached block (every token is computed) but still caches the
        prompt's own blocks.
        """
        if seq_id in self._seqs:
            raise duplicate(seq_id)
        check_request(prompt_token_ids, max_new_tokens)
        hashes, hits, num_new, loads = self._plan(prompt_token_ids, read_prefix_cache)
        if not self._fits(hits, num_new):
            raise NoFreeBlocks(
                f"sequence {seq_id!r} needs {num_new} new blocks for {len(prompt_token_ids)} prompt "
                f"tokens, {self.num_free_blocks} free"
            )
        n, bs = len(prompt_token_ids), self.block_size
        num_hit = len(hits[0]) + len(loads)
        first_step = (n if num_computed is None else num_computed) - num_hit * bs
        if self.chunked and self.prefill_chunk is not None and first_step > self.prefill_chunk:
            raise ValueError(
                f"sequence {seq_id!r} computes {first_step} prompt tokens in one step, more than "
                f"prefill_chunk={self.prefill_chunk}: pass num_computed"
            )
        seq = SeqBlocks(list(prompt_token_ids), [], hashes, released=[0] * self.num_groups)
        seq.num_cached_blocks = num_hit
        self._touch(hits)  # every group's hits first: taking a block must not evict another group's hit
        if loads:
            self.host.pinned.update(loads)  # an eviction the new blocks cause must not take them
        for g, group_hits in enumerate(hits):
            first = len(group_hits)
            num_new = 0 if self.chunked else -(-n // bs) - first  # hybrid: chunk by chunk
            seq.tables.append(self._take_blocks(g, group_hits + [None] * num_new, first=first))
            seq.released[g] = self.managers[g].first_needed(num_hit * bs)
            for i in range(first, len(seq.tables[g])):
                self._fill(seq, g, i)
        for i, slot in enumerate(loads, len(hits[0])):
            self.tiers.load(hashes[i], slot, seq.tables[0][i].block_id)
        seq.window_blocks = num_hit
        self._resident_slots += self._slots_held(seq)
        self._seqs[seq_id] = seq
        self._set_promise(seq)
        self._refresh_promises()
        self.cache_blocks(seq_id, max(n if num_computed is None else num_computed, num_hit * bs))
        return num_hit * bs

    def cache_blocks(self, seq_id: Hashable, num_tokens: int, *, start: int | None = None) -> None:
        """The sequence's tokens before `num_tokens` are computed (or are by the end of this step), the
        step's first at `start` (if given): full blocks become findable by other prompts (with prefix
        caching), the window groups take blocks up to `num_tokens` and give back those no query from
        `start` on reads. A step of a prompt beyond `prefill_room` raises NoFreeBlocks."""
        seq = self._resident(seq_id)
        if start is not None:
            self._release_behind(seq, start)
        self._extend_windows(seq_id, seq, -(-min(num_tokens, len(seq.token_ids)) // self.block_size))
        end = min(num_tokens // self.block_size, len(seq.block_hashes))
        for i in range(seq.num_cached_blocks, end):
            for g, table in enumerate(seq.tables):
                if i < len(table) and table[i] is not None:
                    self._cache(seq, g, i)
        seq.num_cached_blocks = max(seq.num_cached_blocks, end)

    def prefill_room(self, seq_id: Hashable, start: int, num_tokens: int, *, keep_free: int = 0) -> int:
        """How many of the `num_tokens` prompt tokens from `start` on one step can compute now: what the
        window groups' blocks fit, with the blocks no query from `start` on reads given back, leaving
        `keep_free` free blocks for others (the running sequences' next tokens) where it can. Never less
        than the sequence's promise covers (at least one token)."""
        seq = self._resident(seq_id)
        if not self.chunked:
            return num_tokens
        bs, given_back, owned = self.block_size, 0, []
        for m in self._windowed:
            table, released = seq.tables[m.group], seq.released[m.group]
            first = max(released, min(m.first_needed(start), len(table) - 1))
            given_back += held_alone(table[released:first])
            owned.append(held_alone(table[first:]))
        promise = self._promise(seq, owned)
        free = self.pool.num_free + given_back - (self._promised - seq.promise) - promise
        spare = min(free, max(0, free - keep_free))  # free blocks beyond the promise it may take now
        # b more logical blocks take b from each full group's free blocks and b from each window group's
        # promise, then free blocks: the most b with b * full + max(0, b * windows - promise) <= spare.
        num_full = self.num_groups - len(self._windowed)
        more = (spare + promise) // self.num_groups
        if num_full:
            more = min(more, spare // num_full)
        end = (seq.window_blocks + more) * bs
        return max(0, min(num_tokens, end - start))

    def _release_behind(self, seq: SeqBlocks, start: int) -> None:
        """Give back each window group's blocks that no query from position `start` on reads."""
        for m in self.managers:
            self._resident_slots -= m.release_behind(self.pool, seq, start)
        self._set_promise(seq)

    def _extend_windows(self, seq_id: Hashable, seq: SeqBlocks, num_blocks: int) -> None:
        """The window groups' tables cover the first `num_blocks` logical blocks (taken from the promise)."""
        if not self.chunked:  # one full group: every token has its slots from admission on
            seq.window_blocks = -(-len(seq.token_ids) // self.block_size)
            return
        if num_blocks <= seq.window_blocks:
            return
        full = sum(num_blocks - len(seq.tables[m.group]) for m in self.managers if not m.promised)
        windows = sum(num_blocks - len(seq.tables[m.group]) for m in self._windowed)
        needed = full + max(0, windows - seq.promise)  # the window groups draw on their promise first
        if needed > self.num_free_blocks:
            raise NoFreeBlocks(
                f"sequence {seq_id!r} needs {needed} free blocks beyond its promise for its chunk, "
                f"{self.num_free_blocks} free"
            )
        for g, table in enumerate(seq.tables):
            first = len(table)
            table[first:] = self._take_blocks(g, table + [None] * (num_blocks - first), first)[first:]
            for i in range(first, num_blocks):
                self._fill(seq, g, i)
                self._resident_slots += table[i].num_tokens
        seq.window_blocks = num_blocks
        self._set_promise(seq)

    def _set_promise(self, seq: SeqBlocks) -> None:
        """Set aside what the window groups of a prompt being prefilled may still take from the pool."""
        promise = 0
        if seq.host_blocks is None:
            owned = [held_alone(seq.tables[m.group][seq.released[m.group] :]) for m in self._windowed]
            promise = self._promise(seq, owned)
        self._promised += promise - seq.promise
        seq.promise = promise

    def _promise(self, seq: SeqBlocks, owned: list[int]) -> int:
        """The most a prompt's window groups may still draw from the pool while it is prefilled, given the
        blocks each holds alone (`owned`, in window-group order): each holds at most its peak at once, and
        a block it gives back returns to the pool only if no other table holds it."""
        if seq.window_blocks >= -(-len(seq.token_ids) // self.block_size):
            return 0
        n = len(seq.token_ids)
        return sum(m.promise(n, alone) for m, alone in zip(self._windowed, owned, strict=True))

    def _refresh_promises(self) -> None:
        """After blocks were shared: a prefill whose own block another table now holds may draw one more
        (the admission that shared it paid for that: `_plan`)."""
        for seq in self._seqs.values() if self.chunked else ():
            if seq.window_blocks < -(-len(seq.token_ids) // self.block_size):
                self._set_promise(seq)

    def _plan(
        self, prompt: Sequence[int], read_cache: bool = True
    ) -> tuple[list[bytes], list[list[Block | None]], int, list[int]]:
        """Hashes of the prompt's full blocks, per group the cached blocks to reuse (None before a window
        group's window), the count of blocks to take now and promise (window groups' prefill), and the
        host slots of the blocks after the hit to load from the host tier (new blocks, counted in it)."""
        bs, n = self.block_size, len(prompt)
        hashes: list[bytes] = []
        num_hit, loads = 0, []
        if self.enable_prefix_caching:
            hashes = self._prompt_hashes(prompt)
            readable = hashes[: (n - 1) // bs if read_cache else 0]
            num_hit = self._num_hit_blocks(readable)
            if self.tiers is not None:
                loads = self.tiers.host_run(readable[num_hit:])
        hits = [m.hits(self.pool, hashes, num_hit) for m in self.managers]
        num_new = sum(m.new_blocks(group, n, num_hit) for m, group in zip(self.managers, hits, strict=True))
        return hashes, hits, num_new, loads

    def plan_prefetch(self, prompt_token_ids: Sequence[int]) -> Prefetch:
        """With a disk tier: the prompt's blocks after its device and host hits that are on disk, each
        with a host slot to read it into before the prompt is admitted (then `tiers.prefetched`), and
        whether the prompt waits for reads in flight."""
        if self.tiers is None or self.tiers.disk is None:
            return Prefetch()
        hashes = self._prompt_hashes(prompt_token_ids)[: (len(prompt_token_ids) - 1) // self.block_size]
        i = self._num_hit_blocks(hashes)
        while i < len(hashes) and hashes[i] in self.host.cached:
            self.host.touch(hashes[i])  # most recently used: the prefetch must not evict it
            i += 1
        return self.tiers.plan_prefetch(hashes[i:])

    def _num_hit_blocks(self, hashes: list[bytes]) -> int:
        """The longest prefix of blocks every group can serve (a full group all of them, a window group the
        last window's), found as vLLM's hybrid coordinator finds it: each group shrinks the hit in turn
        until none does (the largest hit every group agrees to, whatever the order)."""
        num_hit = len(hashes)
        while True:
            agreed = num_hit
            for m in self.managers:
                agreed = m.longest_hit(self.pool, hashes, agreed)
            if agreed == num_hit:
                return num_hit
            num_hit = agreed

    def _prompt_hashes(self, prompt: Sequence[int]) -> list[bytes]:
        """The hash chain of the prompt's full blocks (a new list). The last prompt's is kept: a scheduler
        asks can_allocate and then allocate of the same prompt, and a waiting one again each step."""
        key = tuple(prompt)
        if self._hashed[0] != key:
            self._hashed = (key, block_hash_chain(prompt, self.block_size))
        return list(self._hashed[1])

    def _take_blocks(self, group: int, blocks: list[Block | None], first: int = 0) -> list[Block | None]:
        """`blocks` with each None from index `first` on replaced by a newly taken block of the group,
        placed right after the one before it where that one is free (one run of memory per table where the
        pool allows); the entries before `first` stay as they are (None: given back)."""
        taken, new = list(blocks[:first]), []
        for i in range(first, len(blocks)):
            block = blocks[i]
            if block is None:
                block = self.pool.allocate(after=taken[-1] if taken else None)
                block.group = group
                new.append(i)
            taken.append(block)
        for i, block in zip(new, sorted((taken[i] for i in new), key=lambda b: b.block_id), strict=True):
            taken[i] = block  # ascending: blocks evicted tail first come back as a forward run
        return taken

    def _touch(self, tables: list[list[Block | None]]) -> None:
        for table in tables:
            for block in table:
                if block is not None:
                    self.pool.touch(block)

    def _fits(self, reused: list[list[Block | None]], num_new: int) -> bool:
        """Reused cached blocks that no one holds leave the free queue too."""
        unheld = sum(block is not None and block.ref_cnt == 0 for group in reused for block in group)
        return num_new + unheld <= self.num_free_blocks

    def _fill(self, seq: SeqBlocks, group: int, i: int) -> None:
        """Count the tokens of a freshly taken block i of a group as written; cache it if its K/V was
        computed."""
        bs, block = self.block_size, seq.tables[group][i]
        self.pool.write(block, min(bs, len(seq.token_ids) - i * bs))
        if i < seq.num_cached_blocks:
            self._cache(seq, group, i)

    def _cache(self, seq: SeqBlocks, group: int, i: int) -> None:
        """Make block i of a group's table findable by its hash; a first-group block newly cached is an
        event of the log, if one is set, once the step commits."""
        if (
            self.pool.cache(seq.tables[group][i], (group, seq.block_hashes[i]))
            and group == 0
            and self.events is not None
        ):
            bs, parent = self.block_size, seq.block_hashes[i - 1] if i else None
            self.pool.journal.stored(seq.block_hashes[i], parent, seq.token_ids[i * bs : (i + 1) * bs])

    def _slots_held(self, seq: SeqBlocks) -> int:
        return sum(block.num_tokens for table in seq.tables for block in table if block is not None)

    # -- decode ----------------------------------------------------------------------------------------

    def can_append(self, seq_id: Hashable) -> bool:
        seq = self._known(seq_id)
        return seq.host_blocks is not None or self._blocks_to_grow(seq) <= self.num_free_blocks

    def append(self, seq_id: Hashable, token_id: int) -> list[tuple[int, int]]:
        """Give the sequence one more token; returns the (src, dst) block copies to do before writing.

        A swapped-out sequence takes no memory for it now: swap_in gives it its slot (its K/V is computed
        once the sequence is back). A block the token fills is keyed for the prefix cache, and findable
        once `cache_blocks` says its K/V is computed (a sampled token's K/V is computed in the next step).
        A prompt still being prefilled chunk by chunk cannot grow (ValueError).
        """
        seq = self._known(seq_id)
        if seq.window_blocks < -(-len(seq.token_ids) // self.block_size):
            raise ValueError(f"sequence {seq_id!r} is still being prefilled: its window groups lack blocks")
        bs, offset = self.block_size, len(seq.token_ids) % self.block_size
        copies = [] if seq.host_blocks is not None else self._grow(seq_id, seq)
        seq.token_ids.append(token_id)
        seq.window_blocks = -(-len(seq.token_ids) // bs)
        if self.enable_prefix_caching and offset == bs - 1:
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            seq.block_hashes.append(hash_block(parent, seq.token_ids[-bs:]))
        return copies

    def _grow(self, seq_id: Hashable, seq: SeqBlocks) -> list[tuple[int, int]]:
        """A device slot for the next token in every group: in the last block, or a new one (a copy of a
        shared last one)."""
        pool, offset = self.pool, len(seq.token_ids) % self.block_size
        needed = self._blocks_to_grow(seq)
        if needed > self.num_free_blocks:
            raise NoFreeBlocks(f"sequence {seq_id!r} needs {needed} blocks for token {len(seq.token_ids)}")
        copies = []
        if seq.num_lookahead:  # the token takes a slot reserved for it (its K/V may be written already)
            seq.num_lookahead -= 1
            for table in seq.tables:
                pool.write(table[len(seq.token_ids) // self.block_size], 1)
            self._resident_slots += len(seq.tables)
            return copies
        for g, table in enumerate(seq.tables):
            if self._needs_block(seq, table):
                block = pool.allocate(after=None if offset else table[-1])
                block.group = g
                if offset:  # copy on write: the shared last block is only partly filled
                    shared = table.pop()
                    copies.append((shared.block_id, block.block_id))
                    pool.write(block, offset)
                    pool.release([shared])
                table.append(block)
            pool.write(table[-1], 1)
        self._resident_slots += len(seq.tables)
        return copies

    def _blocks_to_grow(self, seq: SeqBlocks) -> int:
        return sum(self._needs_block(seq, table) for table in seq.tables)

    def _needs_block(self, seq: SeqBlocks, table: list[Block | None]) -> bool:
        """No slot reserved, and the group's last block is full or shared (then the append must copy it
        first)."""
        return not seq.num_lookahead and (len(seq.token_ids) % self.block_size == 0 or table[-1].ref_cnt > 1)

    # -- lookahead (speculative decoding) --------------------------------------------------------------

    def can_reserve_lookahead(self, seq_id: Hashable, num_slots: int) -> bool:
        return self._lookahead_blocks(self._resident(seq_id), num_slots) <= self.num_free_blocks

    def reserve_lookahead(self, seq_id: Hashable, num_slots: int) -> list[tuple[int, int]]:
        """Hold `num_slots` more slots past the sequence's tokens in every group (for draft tokens the verify
        pass writes); returns the (src, dst) block copies to do first. Nothing is keyed for the prefix
        cache: the tokens that fill these slots come by `append`, once accepted."""
        seq = self._resident(seq_id)
        needed = self._lookahead_blocks(seq, num_slots)
        if needed > self.num_free_blocks:
            raise NoFreeBlocks(f"sequence {seq_id!r} needs {needed} blocks for {num_slots} lookahead slots")
        copies = []
        end = -(-(self._held_slots(seq) + num_slots) // self.block_size)
        for g, table in enumerate(seq.tables):
            if num_slots and self._last_block_shared(seq, table):
                copies.append(self._copy_last_block(seq, g, table))
            while len(table) < end:
                block = self.pool.allocate(after=table[-1])
                block.group = g
                table.append(block)
        seq.num_lookahead += num_slots
        return copies

    def release_lookahead(self, seq_id: Hashable) -> None:
        """Give back the lookahead slots no token took (rejected drafts): a block left holding no token goes
        back to the pool."""
        seq = self._resident(seq_id)
        keep = -(-len(seq.token_ids) // self.block_size)
        for table in seq.tables:
            self.pool.release(reversed(table[keep:]))
            del table[keep:]
        seq.num_lookahead = 0

    def _copy_last_block(self, seq: SeqBlocks, group: int, table: list[Block | None]) -> tuple[int, int]:
        """Copy on write: replace the group's shared, partly filled last block by a copy of its own."""
        shared = table.pop()
        block = self.pool.allocate()
        block.group = group
        self.pool.write(block, len(seq.token_ids) - len(table) * self.block_size)
        self.pool.release([shared])
        table.append(block)
        return shared.block_id, block.block_id

    def _held_slots(self, seq: SeqBlocks) -> int:
        return len(seq.token_ids) + seq.num_lookahead

    def _last_block_shared(self, seq: SeqBlocks, table: list[Block | None]) -> bool:
        """The last block is partly filled and shared: a write to its free slots must copy it first."""
        return self._held_slots(seq) % self.block_size != 0 and table[-1].ref_cnt > 1

    def _lookahead_blocks(self, seq: SeqBlocks, num_slots: int) -> int:
        """Free blocks reserve_lookahead(num_slots) takes: new ones, and copies of shared last blocks."""
        if num_slots < 0:
            raise ValueError(f"num_slots must be a non-negative integer, got {num_slots!r}")
        if num_slots == 0:
            return 0
        end = -(-(self._held_slots(seq) + num_slots) // self.block_size)
        return sum(end - len(table) + self._last_block_shared(seq, table) for table in seq.tables)

    # -- fork / free -----------------------------------------------------------------------------------

    def fork(self, parent_id: Hashable, child_id: Hashable) -> list[tuple[int, int]]:
        """The child shares every block of the parent; nothing is allocated or copied (returns []). A
        prompt still being prefilled chunk by chunk cannot be forked (ValueError)."""
        parent = self._settled(parent_id)
        if child_id in self._seqs:
            raise duplicate(child_id)
        if parent.window_blocks < -(-len(parent.token_ids) // self.block_size):
            raise ValueError(f"sequence {parent_id!r} is still being prefilled: finish it before forking")
        self._touch(parent.tables)
        self._seqs[child_id] = SeqBlocks(
            list(parent.token_ids),
            [list(table) for table in parent.tables],
            list(parent.block_hashes),
            num_cached_blocks=parent.num_cached_blocks,
            window_blocks=parent.window_blocks,
            released=list(parent.released),
        )
        self._resident_slots += self._slots_held(parent)
        return []

    def free(self, seq_id: Hashable) -> None:
        """Give back every block of the sequence (device or host) at once."""
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            raise unknown(seq_id)
        if seq.host_blocks is not None:
            for host in seq.host_blocks:
                self.host.give_back(h for h in reversed(host) if h is not None)
        else:
            self._resident_slots -= self._slots_held(seq)
            self._release_tables(seq)
        self._promised -= seq.promise

    def _release_tables(self, seq: SeqBlocks) -> None:
        """Give back every held block of every group, each table tail first; the tables become empty."""
        for table in seq.tables:
            self.pool.release(block for block in reversed(table) if block is not None)
            table.clear()

    # -- swap ------------------------------------------------------------------------------------------

    def swap_out(self, seq_id: Hashable) -> list[tuple[int, int]]:
        """Move the sequence to host blocks; returns the (device block, host block) copies to do."""
        seq = self._settled(seq_id)
        held = sum(block is not None for table in seq.tables for block in table)
        if held > self.num_free_host_blocks:
            free = self.num_free_host_blocks
            raise NoFreeBlocks(f"sequence {seq_id!r} needs {held} host blocks, {free} free")
        host = seq.host_blocks = []
        copies = []
        for table in seq.tables:
            host.append([None if block is None else self.host.take()[0] for block in table])
            copies += [(b.block_id, h) for b, h in zip(table, host[-1], strict=True) if b is not None]
        self._resident_slots -= self._slots_held(seq)
        self._release_tables(seq)
        self._set_promise(seq)
        return copies

    def can_swap_in(self, seq_id: Hashable) -> bool:
        seq = self._swapped(seq_id)
        hits = self._swap_in_hits(seq)
        return self._fits(hits, self._swap_in_blocks(seq, hits))

    def _swap_in_blocks(self, seq: SeqBlocks, hits: list[list[Block | None]]) -> int:
        """Blocks swap_in takes (besides reused cached ones), a prefill's promise included."""
        total, owned = 0, []
        for g, group in enumerate(hits):
            new = sum(block is None for block in group[seq.released[g] :])
            total += new
            if self.managers[g].promised:
                total += held_alone(group)
                owned.append(new + sum(block is not None and block.ref_cnt == 0 for block in group))
        return total + self._promise(seq, owned)

    def swap_in(self, seq_id: Hashable) -> list[tuple[int, int]]:
        """Bring the sequence back to device blocks; returns the (host block, device block) copies to do.

        With prefix caching, computed full blocks still cached on the device are reused instead of copied;
        a block of tokens appended while swapped out is new (their K/V is still to be computed).
        """
        seq = self._swapped(seq_id)
        hits = self._swap_in_hits(seq)
        num_new = self._swap_in_blocks(seq, hits)
        if not self._fits(hits, num_new):
            raise NoFreeBlocks(f"sequence {seq_id!r} needs {num_new} blocks to swap in")
        host_blocks, seq.host_blocks = seq.host_blocks, None
        copies = []
        self._touch(hits)
        for g, group_hits in enumerate(hits):
            first = seq.released[g]
            seq.tables[g] = self._take_blocks(g, group_hits, first)
            for i in range(first, len(group_hits)):
                if group_hits[i] is None:
                    if i < len(host_blocks[g]):
                        copies.append((host_blocks[g][i], seq.tables[g][i].block_id))
                    self._fill(seq, g, i)
            self.host.give_back(h for h in reversed(host_blocks[g]) if h is not None)
        self._resident_slots += self._slots_held(seq)
        self._set_promise(seq)
        self._refresh_promises()
        return copies

    def _swap_in_hits(self, seq: SeqBlocks) -> list[list[Block | None]]:
        """Per group, for each block the swapped sequence's tokens need, the device block still caching its
        content, if any (None also before a window group's window). Only blocks it computed count: one whose
        K/V is still to come is never shared (it is written)."""
        hits, bs = [], self.block_size
        for g in range(self.num_groups):
            num_blocks = seq.window_blocks if self.chunked else -(-len(seq.token_ids) // bs)
            first = seq.released[g]
            computed = seq.block_hashes[first : seq.num_cached_blocks]
            group_hits = [None] * first + [self.pool.cached.get((g, h)) for h in computed]
            hits.append(group_hits + [None] * (num_blocks - len(group_hits)))
        return hits

    # -- the step's end (kv/journal.py) ----------------------------------------------------------------

    def commit(self) -> None:
        """The step's forward pass and postprocessing succeeded: everything cached since the last commit
        stays findable, and is reported to the event log now."""
        self.pool.commit()

    def rollback(self) -> None:
        """The step failed: nothing cached since the last commit is findable any more (device blocks keep
        their tables or free-queue places as plain blocks; host and disk tier entries are forgotten) and no
        event reports it. A sequence left holding such a block counts its cached blocks only up to it (the
        engine frees the failed sequences next, in either order)."""
        undone = self.pool.rollback()
        for seq in self._seqs.values() if undone else ():
            for table in seq.tables:
                for i, block in enumerate(table[: seq.num_cached_blocks]):
                    if block is not None and block.block_id in undone:
                        seq.num_cached_blocks = i
                        break

    # -- views -----------------------------------------------------------------------------------------

    def num_tokens(self, seq_id: Hashable) -> int:
        return len(self._known(seq_id).token_ids)

    def block_table(self, seq_id: Hashable) -> list[int]:
        """The first KV group's block table (NO_BLOCK where a window group gave a block back)."""
        return self.block_tables(seq_id)[0]

    def block_tables(self, seq_id: Hashable) -> list[list[int]]:
        """Every KV group's block table, in group order (NO_BLOCK where a window group gave a block back)."""
        return [
            [NO_BLOCK if block is None else block.block_id for block in table]
            for table in self._resident(seq_id).tables
        ]

    def usage(self) -> KVUsage:
        bs, free = self.block_size, self.pool.num_free * self.block_size
        used = (self.num_total_blocks - self.pool.num_free) * bs
        live = self.pool.live_slots
        return KVUsage(
            total_slots=self.num_total_blocks * bs,
            live_slots=live,
            reserved_slots=0,
            tail_slots=used - live,
            free_slots=free,
            largest_free_run=free,  # any free block serves any sequence: no contiguity needed
            external_frag_slots=0,
            shared_saved_slots=self._resident_slots - live,
        )

    def block_states(self) -> BlockStates:
        blocks = self.pool.blocks
        return BlockStates(
            [block.ref_cnt for block in blocks],
            [block.num_tokens if block.ref_cnt else 0 for block in blocks],
            [block.block_hash is not None for block in blocks],
            [block.group if block.ref_cnt or block.block_hash is not None else -1 for block in blocks],
        )

    def slot_states(self) -> list[SlotState]:
        """Every device slot in address order: a held block is live up to its tokens, then tail."""
        bs, states = self.block_size, []
        for block in self.pool.blocks:
            if block.ref_cnt == 0:
                states += [SlotState.FREE] * bs
            else:
                states += [SlotState.LIVE] * block.num_tokens + [SlotState.TAIL] * (bs - block.num_tokens)
        return states

    def _known(self, seq_id: Hashable) -> SeqBlocks:
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise unknown(seq_id)
        return seq

    def _settled(self, seq_id: Hashable) -> SeqBlocks:
        """Resident and holding no lookahead slots (a fork or swap-out happens between verify passes)."""
        seq = self._resident(seq_id)
        if seq.num_lookahead:
            raise ValueError(f"sequence {seq_id!r} holds lookahead slots: release_lookahead first")
        return seq

    def _resident(self, seq_id: Hashable) -> SeqBlocks:
        seq = self._known(seq_id)
        if seq.host_blocks is not None:
            raise ValueError(f"sequence {seq_id!r} is swapped out")
        return seq

    def _swapped(self, seq_id: Hashable) -> SeqBlocks:
        seq = self._known(seq_id)
        if seq.host_blocks is None:
            raise ValueError(f"sequence {seq_id!r} is not swapped out")
        return seq
