"""PagedAllocator: KV memory as fixed-size blocks mapped per sequence by a block table (PagedAttention).

Token t of a sequence lives in slot `table[t // block_size] * block_size + t % block_size`, where
`table` is its block table. Blocks are taken on demand (only when the last one is full) and given
back the instant a sequence is freed. `fork` shares blocks (copy-on-write on the first divergent
append), prefix caching reuses full blocks keyed by a hash chain (a block becomes findable once its K/V is
computed: `cache_blocks`, and stays so once its step commits: kv/journal.py), and `swap_out` / `swap_in`
move a sequence to a host pool and back (kv/swap.py).

KV groups (kv/groups.py): with `windows` of several groups, a sequence has one block table per group,
all mapping the same token positions and drawing on one pool. PagedAllocator is the coordinator (vLLM
v1's KVCacheCoordinator) over one manager per group, of the group's kind (kv/managers.py: full attention,
sliding window); what has rules of its own is a part of its own: a prompt prefilled chunk by chunk beside
window groups (kv/prefill.py), lookahead slots for speculative decoding (kv/lookahead.py), swap to the
host pool (kv/swap.py); the block-table operations they share are kv/tables.py's.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from pagedllm.kv.block_pool import BlockPool, hash_block
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
from pagedllm.kv.lookahead import LookaheadSlots
from pagedllm.kv.managers import make_manager
from pagedllm.kv.prefill import ChunkedPrefill
from pagedllm.kv.prefix import PrefixLookup
from pagedllm.kv.sequence import SeqBlocks
from pagedllm.kv.swap import HostSwap
from pagedllm.kv.tables import BlockStates, BlockTables
from pagedllm.kv.tiers import HostPool, Prefetch, PrefixTiers, TierMoves

GROWTH_ROOM_TOKENS = 128  # free slots after a sequence's newest block set aside for it (BlockPool.room)
NO_BLOCK = -1  # a block_tables entry a window group has given back: no query reads that position again
# A block of the default size holds this many bytes of each K/V value position (one dim of one KV head over
# the block's tokens): 16 float32 tokens, vLLM's GPU default. A narrower cache dtype gets more tokens a block
# rather than fewer bytes, so decode attention reads runs of memory as long as float32's from each scattered
# block (docs/JOURNAL.md, "Int8 KV: blocks of equal bytes").
DEFAULT_BLOCK_VALUE_BYTES = 64

__all__ = ["NO_BLOCK", "BlockStates", "PagedAllocator", "default_block_size"]


def default_block_size(value_bytes: int) -> int:
    """Tokens per KV block when block_size is not set, for a cache storing each K/V value in `value_bytes`
    bytes: 16 for float32, 32 for bfloat16 / float16, 64 for int8 / fp8 (whose scales ride beside)."""
    if value_bytes not in (1, 2, 4):
        raise ValueError(f"a KV cache value takes 1, 2 or 4 bytes, got {value_bytes!r}")
    return DEFAULT_BLOCK_VALUE_BYTES // value_bytes


def _check_config(
    num_blocks: int,
    block_size: int,
    num_host_blocks: int | None,
    windows: Sequence[int | None],
    prefill_chunk: int | None,
    tiers: PrefixTiers | None,
    caching: bool,
) -> int:
    """Reject a configuration no paged cache can serve; returns the host pool's size."""
    if tiers is not None:
        if len(windows) != 1 or windows[0] is not None or not caching:
            raise ValueError(
                "prefix cache tiers need prefix caching and one full-attention KV group, got "
                f"enable_prefix_caching={caching}, windows={tuple(windows)}"
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
    return num_host_blocks


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
        self.num_host_blocks = _check_config(
            num_blocks, block_size, num_host_blocks, windows, prefill_chunk, tiers, enable_prefix_caching
        )
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.windows = tuple(windows)
        self.prefill_chunk = prefill_chunk
        # With window groups every group takes a prompt's blocks chunk by chunk and admission asks for the
        # first chunk only (vLLM v1's rule): a prompt that outgrows the free blocks waits or is preempted.
        self.chunked = any(window is not None for window in self.windows)
        self.managers = [
            make_manager(g, window, block_size, prefill_chunk, self.chunked)
            for g, window in enumerate(self.windows)
        ]
        self.tiers = tiers
        self.pool = BlockPool(num_blocks, room=-(-GROWTH_ROOM_TOKENS // block_size), tiers=tiers)
        self.events: KVEventLog | None = None  # the prefix cache's changes, once enable_events is called
        self.host = tiers.host if tiers is not None else HostPool(self.num_host_blocks)
        self._seqs: dict[Hashable, SeqBlocks] = {}
        self.tables = BlockTables(self.pool, block_size)
        self.prefill = ChunkedPrefill(self.tables, self.managers)
        self.lookahead = LookaheadSlots(self.tables)
        self.swap = HostSwap(self.tables, self.prefill, self.host, self._seqs)
        self.prefix = PrefixLookup(self.pool, self.managers, enable_prefix_caching, tiers, self.host)

    def take_tier_moves(self) -> TierMoves:
        """The prefix cache tiers' copies planned since the last call (none without tiers)."""
        return self.tiers.take_moves() if self.tiers is not None else TierMoves()

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
        return self.tables.num_free

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
            and self.tables.promised == 0
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
        lora_int_id: int | None = None,
    ) -> bool:
        """Whether the prompt's blocks fit now (decode blocks are taken later, on demand).
        `true_output_len` (what `pagedllm bench memory` passes every layout) changes nothing here."""
        check_request(prompt_token_ids, max_new_tokens)
        plan = self.prefix.plan(prompt_token_ids, read_prefix_cache, lora_int_id)
        n = len(prompt_token_ids)  # admitted by its first chunk, a prompt must still fit the whole pool
        lasting = sum(m.peak(n) for m in self.managers)
        return self.tables.fits(plan.hits, plan.num_new) and lasting <= self.num_total_blocks

    def allocate(
        self,
        seq_id: Hashable,
        prompt_token_ids: Sequence[int],
        max_new_tokens: int,
        *,
        true_output_len: int | None = None,
        num_computed: int | None = None,
        read_prefix_cache: bool = True,
        lora_int_id: int | None = None,
    ) -> int:
        """Give the prompt its blocks; returns how many leading prompt tokens were already cached.

        The hit is whole blocks only and never the whole prompt (its last token is always computed); each
        window group needs only the hit's last window cached. `max_new_tokens` is only checked and
        `true_output_len` ignored: paged memory grows on demand. The first `num_computed` prompt tokens
        (default: all) are computed this step: their full blocks become findable at once, and the window
        groups take blocks up to there (the rest as `cache_blocks` says later chunks are computed).
        `read_prefix_cache=False` takes no cached block (every token is computed) but still caches the
        prompt's own blocks. `lora_int_id`: the LoRA adapter its K/V is computed under (None: the base):
        its blocks are cached under keys of that adapter alone.
        """
        if seq_id in self._seqs:
            raise duplicate(seq_id)
        check_request(prompt_token_ids, max_new_tokens)
        plan = self.prefix.plan(prompt_token_ids, read_prefix_cache, lora_int_id)
        hashes, hits, loads = plan.hashes, plan.hits, plan.loads
        if not self.tables.fits(hits, plan.num_new):
            raise NoFreeBlocks(
                f"sequence {seq_id!r} needs {plan.num_new} new blocks for {len(prompt_token_ids)} prompt "
                f"tokens, {self.num_free_blocks} free"
            )
        n, bs = len(prompt_token_ids), self.block_size
        num_hit = len(hits[0]) + len(loads)
        num_computed = n if num_computed is None else num_computed
        self._check_first_step(seq_id, num_computed - num_hit * bs)
        seq = SeqBlocks(
            list(prompt_token_ids), [], hashes, released=[0] * self.num_groups, lora_int_id=lora_int_id
        )
        seq.num_cached_blocks = num_hit
        self.tables.touch(hits)  # every group's hits first: taking a block must not evict another group's hit
        if loads:
            self.host.pinned.update(loads)  # an eviction the new blocks cause must not take them
        for g, group_hits in enumerate(hits):
            first = len(group_hits)
            num_new = 0 if self.chunked else -(-n // bs) - first  # hybrid: chunk by chunk
            seq.tables.append(self.tables.take(g, group_hits + [None] * num_new, first=first))
            seq.released[g] = self.managers[g].first_needed(num_hit * bs)
            for i in range(first, len(seq.tables[g])):
                self.tables.fill(seq, g, i)
        for i, slot in enumerate(loads, len(hits[0])):
            self.tiers.load(hashes[i], slot, seq.tables[0][i].block_id)
        seq.window_blocks = num_hit
        self.tables.resident_slots += seq.slots_held()
        self._seqs[seq_id] = seq
        self.prefill.set_promise(seq)
        self.prefill.refresh(self._seqs.values())
        self.cache_blocks(seq_id, max(num_computed, num_hit * bs))
        return num_hit * bs

    def _check_first_step(self, seq_id: Hashable, num_tokens: int) -> None:
        """Beside window groups a prompt's first step computes at most prefill_chunk tokens (what the
        window groups' promise covers)."""
        if self.chunked and self.prefill_chunk is not None and num_tokens > self.prefill_chunk:
            raise ValueError(
                f"sequence {seq_id!r} computes {num_tokens} prompt tokens in one step, more than "
                f"prefill_chunk={self.prefill_chunk}: pass num_computed"
            )

    def cache_blocks(self, seq_id: Hashable, num_tokens: int, *, start: int | None = None) -> None:
        """The sequence's tokens before `num_tokens` are computed (or are by the end of this step), the
        step's first at `start` (if given): full blocks become findable by other prompts (with prefix
        caching; for good once the step commits), the window groups take blocks up to `num_tokens` and
        give back those no query from `start` on reads. A step of a prompt beyond `prefill_room` raises
        NoFreeBlocks."""
        seq = self._resident(seq_id)
        if start is not None:
            self.prefill.release_behind(seq, start)
        self.prefill.extend(seq_id, seq, -(-min(num_tokens, len(seq.token_ids)) // self.block_size))
        end = min(num_tokens // self.block_size, len(seq.block_hashes))
        for i in range(seq.num_cached_blocks, end):
            for g, table in enumerate(seq.tables):
                if i < len(table) and table[i] is not None:
                    self.tables.cache(seq, g, i)
        seq.num_cached_blocks = max(seq.num_cached_blocks, end)

    def prefill_room(self, seq_id: Hashable, start: int, num_tokens: int, *, keep_free: int = 0) -> int:
        """How many of the `num_tokens` prompt tokens from `start` on one step can compute now (kv/prefill.py:
        ChunkedPrefill.room)."""
        return self.prefill.room(self._resident(seq_id), start, num_tokens, keep_free)

    def plan_prefetch(self, prompt_token_ids: Sequence[int], lora_int_id: int | None = None) -> Prefetch:
        """With a disk tier: the prompt's blocks on disk to read into host blocks before it is admitted, and
        whether it waits for reads in flight (kv/prefix.py)."""
        return self.prefix.prefetch(prompt_token_ids, lora_int_id)

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
        if seq.prefilling(self.block_size):
            raise ValueError(f"sequence {seq_id!r} is still being prefilled: its window groups lack blocks")
        bs, offset = self.block_size, len(seq.token_ids) % self.block_size
        copies = [] if seq.host_blocks is not None else self._grow(seq_id, seq)
        seq.token_ids.append(token_id)
        seq.window_blocks = seq.num_blocks(bs)
        if self.enable_prefix_caching and offset == bs - 1:
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            seq.block_hashes.append(hash_block(parent, seq.token_ids[-bs:], seq.lora_int_id))
        return copies

    def _grow(self, seq_id: Hashable, seq: SeqBlocks) -> list[tuple[int, int]]:
        """A device slot for the next token in every group: a reserved lookahead slot, in the last block,
        or a new one (a copy of a shared last one)."""
        needed = self._blocks_to_grow(seq)
        if needed > self.num_free_blocks:
            raise NoFreeBlocks(f"sequence {seq_id!r} needs {needed} blocks for token {len(seq.token_ids)}")
        if self.lookahead.take(seq):
            return []
        pool, offset, copies = self.pool, len(seq.token_ids) % self.block_size, []
        for g, table in enumerate(seq.tables):
            if offset and table[-1].ref_cnt > 1:  # copy on write: the shared last block is partly filled
                copies.append(self.tables.copy_last_block(seq, g, table))
            elif not offset:
                block = pool.allocate(after=table[-1])
                block.group = g
                table.append(block)
            pool.write(table[-1], 1)
        self.tables.resident_slots += len(seq.tables)
        return copies

    def _blocks_to_grow(self, seq: SeqBlocks) -> int:
        """No slot reserved, and per group the last block is full or shared (the append must copy it)."""
        if seq.num_lookahead:
            return 0
        full = len(seq.token_ids) % self.block_size == 0
        return sum(full or table[-1].ref_cnt > 1 for table in seq.tables)

    # -- lookahead (speculative decoding: kv/lookahead.py) ---------------------------------------------

    def can_reserve_lookahead(self, seq_id: Hashable, num_slots: int) -> bool:
        return self.lookahead.blocks_needed(self._resident(seq_id), num_slots) <= self.num_free_blocks

    def reserve_lookahead(self, seq_id: Hashable, num_slots: int) -> list[tuple[int, int]]:
        return self.lookahead.reserve(seq_id, self._resident(seq_id), num_slots)

    def release_lookahead(self, seq_id: Hashable) -> None:
        self.lookahead.release(self._resident(seq_id))

    # -- fork / free -----------------------------------------------------------------------------------

    def fork(self, parent_id: Hashable, child_id: Hashable) -> list[tuple[int, int]]:
        """The child shares every block of the parent; nothing is allocated or copied (returns []). A
        prompt still being prefilled chunk by chunk cannot be forked (ValueError)."""
        parent = self._settled(parent_id)
        if child_id in self._seqs:
            raise duplicate(child_id)
        if parent.prefilling(self.block_size):
            raise ValueError(f"sequence {parent_id!r} is still being prefilled: finish it before forking")
        self.tables.touch(parent.tables)
        self._seqs[child_id] = SeqBlocks(
            list(parent.token_ids),
            [list(table) for table in parent.tables],
            list(parent.block_hashes),
            num_cached_blocks=parent.num_cached_blocks,
            window_blocks=parent.window_blocks,
            released=list(parent.released),
            lora_int_id=parent.lora_int_id,
        )
        self.tables.resident_slots += parent.slots_held()
        return []

    def free(self, seq_id: Hashable) -> None:
        """Give back every block of the sequence (device or host) at once."""
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            raise unknown(seq_id)
        if seq.host_blocks is not None:
            self.swap.free(seq)
        else:
            self.tables.resident_slots -= seq.slots_held()
            self.tables.release(seq)
        self.tables.promised -= seq.promise

    # -- swap (kv/swap.py) -----------------------------------------------------------------------------

    def swap_out(self, seq_id: Hashable) -> list[tuple[int, int]]:
        """Move the sequence to host blocks; returns the (device block, host block) copies to do."""
        return self.swap.swap_out(seq_id, self._settled(seq_id))

    def can_swap_in(self, seq_id: Hashable) -> bool:
        return self.swap.can_swap_in(self._swapped(seq_id))

    def swap_in(self, seq_id: Hashable) -> list[tuple[int, int]]:
        """Bring the sequence back to device blocks; returns the (host block, device block) copies to do."""
        return self.swap.swap_in(seq_id, self._swapped(seq_id))

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
        return self.tables.usage()

    def block_states(self) -> BlockStates:
        return self.tables.block_states()

    def slot_states(self) -> list[SlotState]:
        """Every device slot in address order: a held block is live up to its tokens, then tail."""
        return self.tables.slot_states()

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
