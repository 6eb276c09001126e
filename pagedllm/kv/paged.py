"""PagedAllocator: KV memory as fixed-size blocks mapped per sequence by a block table (PagedAttention).

Token t of a sequence lives in slot `table[t // block_size] * block_size + t % block_size`, where
`table` is its block table. Blocks are taken on demand (only when the last one is full) and given
back the instant a sequence is freed. `fork` shares blocks (copy-on-write on the first divergent
append), prefix caching reuses full blocks keyed by a hash chain (a block becomes findable once its K/V is
computed: `cache_blocks`), and `swap_out` / `swap_in` move a sequence to a host pool and back (it may
be appended to while there: its new tokens get their blocks when it comes back). For speculative
decoding, `reserve_lookahead` gives a sequence slots past its tokens for the verify pass to write draft
K/V into; accepted tokens fill them by `append` (only then is a block keyed, by accepted tokens) and
`release_lookahead` gives back the rest, a block left holding no token returning to the pool (a
sequence holding lookahead slots is neither forked nor swapped out: both wait for the release).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from pagedllm.kv.block_pool import Block, BlockPool, hash_block
from pagedllm.kv.interface import (
    KVUsage,
    NoFreeBlocks,
    SlotState,
    check_positive,
    check_request,
    duplicate,
    unknown,
)

GROWTH_ROOM_TOKENS = 128  # free slots after a sequence's newest block set aside for it (BlockPool.room)


@dataclass(frozen=True)
class BlockStates:
    """Every device block, indexed by block id (compact lists, for pictures of the cache)."""

    ref_counts: list[int]  # block tables holding the block (0: free; > 1: shared)
    num_tokens: list[int]  # tokens written in a held block (0 for a free one)
    cached: list[bool]  # findable in the prefix cache (a free cached block can be taken back)


@dataclass
class _Seq:
    """One sequence: its tokens, its block table, and the hash of each of its full blocks."""

    token_ids: list[int]
    blocks: list[Block]  # empty while swapped out
    block_hashes: list[bytes] = field(default_factory=list)  # only with prefix caching
    num_cached_blocks: int = 0  # leading blocks computed and findable in the prefix cache
    host_blocks: list[int] | None = None  # set while swapped out
    num_lookahead: int = 0  # slots held past the last token (speculative decoding's draft tokens)


class PagedAllocator:
    """Block tables over a pool of `num_blocks` blocks, plus a host pool of `num_host_blocks` for swap."""

    supports_swap = True

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        enable_prefix_caching: bool = False,
        num_host_blocks: int | None = None,
    ):
        num_host_blocks = num_blocks if num_host_blocks is None else num_host_blocks
        check_positive("num_blocks", num_blocks)
        check_positive("block_size", block_size)
        if not isinstance(num_host_blocks, int) or num_host_blocks < 0:
            raise ValueError(f"num_host_blocks must be a non-negative integer, got {num_host_blocks!r}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.num_host_blocks = num_host_blocks
        self.pool = BlockPool(num_blocks, room=-(-GROWTH_ROOM_TOKENS // block_size))
        self._free_host_blocks = list(range(num_host_blocks - 1, -1, -1))  # a stack, lowest id on top
        self._seqs: dict[Hashable, _Seq] = {}
        self._resident_tokens = 0  # tokens of sequences on the device
        self._hashed: tuple[tuple[int, ...], list[bytes]] = ((), [])  # the last prompt and its block hashes

    # -- capacity --------------------------------------------------------------------------------------

    @property
    def num_total_blocks(self) -> int:
        return len(self.pool.blocks)

    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence holds (cached-but-unreferenced blocks count as free)."""
        return self.pool.num_free

    @property
    def num_free_host_blocks(self) -> int:
        return len(self._free_host_blocks)

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self._seqs

    def all_free(self) -> bool:
        """No sequence left and every device and host block back in its free pool."""
        return (
            not self._seqs
            and self.pool.num_free == self.num_total_blocks
            and self.num_free_host_blocks == self.num_host_blocks
        )

    # -- allocate --------------------------------------------------------------------------------------

    def can_allocate(
        self, prompt_token_ids: Sequence[int], max_new_tokens: int, *, true_output_len: int | None = None
    ) -> bool:
        """Whether the prompt's blocks fit now (decode blocks are taken later, on demand).
        `true_output_len` (what `pagedllm bench memory` passes every layout) changes nothing here."""
        check_request(prompt_token_ids, max_new_tokens)
        _, hits, num_new = self._plan(prompt_token_ids)
        return self._fits(hits, num_new)

    def allocate(
        self,
        seq_id: Hashable,
        prompt_token_ids: Sequence[int],
        max_new_tokens: int,
        *,
        true_output_len: int | None = None,
        num_computed: int | None = None,
    ) -> int:
        """Give the prompt its blocks; returns how many leading prompt tokens were already cached.

        The hit is whole blocks only and never the whole prompt (its last token is always computed).
        `max_new_tokens` is only checked and `true_output_len` ignored: paged memory grows on demand.
        With prefix caching, the full blocks within the first `num_computed` prompt tokens (default:
        all) become findable at once: their K/V is written this step. A prompt prefilled in chunks
        passes its first chunk's end here and each later chunk's end to `cache_blocks`.
        """
        if seq_id in self._seqs:
            raise duplicate(seq_id)
        check_request(prompt_token_ids, max_new_tokens)
        hashes, hits, num_new = self._plan(prompt_token_ids)
        if not self._fits(hits, num_new):
            raise NoFreeBlocks(
                f"sequence {seq_id!r} needs {num_new} new blocks for {len(prompt_token_ids)} prompt "
                f"tokens, {self.pool.num_free} free"
            )
        for block in hits:
            self.pool.touch(block)
        seq = _Seq(list(prompt_token_ids), self._take_blocks(hits + [None] * num_new))
        seq.block_hashes = hashes
        seq.num_cached_blocks = len(hits)
        for i in range(len(hits), len(seq.blocks)):
            self._fill(seq, i)
        self._seqs[seq_id] = seq
        self._resident_tokens += len(seq.token_ids)
        self.cache_blocks(seq_id, len(seq.token_ids) if num_computed is None else num_computed)
        return len(hits) * self.block_size

    def cache_blocks(self, seq_id: Hashable, num_tokens: int) -> None:
        """The first `num_tokens` tokens of the sequence are computed (or are by the end of this step):
        make their full blocks findable by other prompts. Does nothing without prefix caching."""
        seq = self._resident(seq_id)
        end = min(num_tokens // self.block_size, len(seq.block_hashes))
        for i in range(seq.num_cached_blocks, end):
            self.pool.cache(seq.blocks[i], seq.block_hashes[i])
        seq.num_cached_blocks = max(seq.num_cached_blocks, end)

    def _plan(self, prompt: Sequence[int]) -> tuple[list[bytes], list[Block], int]:
        """Hashes of the prompt's full blocks, the cached blocks to reuse, and the count of new blocks."""
        bs = self.block_size
        hashes: list[bytes] = []
        hits: list[Block] = []
        if self.enable_prefix_caching:
            hashes = self._prompt_hashes(prompt)
            for block_hash in hashes[: (len(prompt) - 1) // bs]:
                block = self.pool.cached.get(block_hash)
                if block is None:
                    break
                hits.append(block)
        return hashes, hits, -(-len(prompt) // bs) - len(hits)

    def _prompt_hashes(self, prompt: Sequence[int]) -> list[bytes]:
        """The hash chain of the prompt's full blocks (a new list). The last prompt's is kept: a scheduler
        asks can_allocate and then allocate of the same prompt, and a waiting one again each step."""
        key = tuple(prompt)
        if self._hashed[0] != key:
            bs, hashes = self.block_size, []
            for i in range(len(prompt) // bs):
                hashes.append(hash_block(hashes[-1] if hashes else None, prompt[i * bs : (i + 1) * bs]))
            self._hashed = (key, hashes)
        return list(self._hashed[1])

    def _take_blocks(self, blocks: list[Block | None]) -> list[Block]:
        """`blocks` with each None replaced by a newly taken block, placed right after the one before it
        where that one is free (one run of memory per sequence where the pool allows)."""
        taken: list[Block] = []
        for block in blocks:
            taken.append(self.pool.allocate(after=taken[-1] if taken else None) if block is None else block)
        new = [i for i, block in enumerate(blocks) if block is None]
        for i, block in zip(new, sorted((taken[i] for i in new), key=lambda b: b.block_id), strict=True):
            taken[i] = block  # ascending: blocks evicted tail first come back as a forward run
        return taken

    def _fits(self, reused: list[Block], num_new: int) -> bool:
        """Reused cached blocks that no one holds leave the free queue too."""
        return num_new + sum(block.ref_cnt == 0 for block in reused) <= self.pool.num_free

    def _fill(self, seq: _Seq, i: int) -> None:
        """Count the tokens of a freshly taken block i as written; cache it if its K/V was computed."""
        bs = self.block_size
        self.pool.write(seq.blocks[i], min(bs, len(seq.token_ids) - i * bs))
        if i < seq.num_cached_blocks:
            self.pool.cache(seq.blocks[i], seq.block_hashes[i])

    # -- decode ----------------------------------------------------------------------------------------

    def can_append(self, seq_id: Hashable) -> bool:
        seq = self._known(seq_id)
        return seq.host_blocks is not None or not self._needs_block(seq) or self.pool.num_free > 0

    def append(self, seq_id: Hashable, token_id: int) -> list[tuple[int, int]]:
        """Give the sequence one more token; returns the (src, dst) block copies to do before writing.

        A swapped-out sequence takes no memory for it now: swap_in gives it its slot (its K/V is computed
        once the sequence is back). A block the token fills is keyed for the prefix cache, and findable
        once `cache_blocks` says its K/V is computed (a sampled token's K/V is computed in the next step).
        """
        seq = self._known(seq_id)
        bs, offset = self.block_size, len(seq.token_ids) % self.block_size
        copies = [] if seq.host_blocks is not None else self._grow(seq_id, seq)
        seq.token_ids.append(token_id)
        if self.enable_prefix_caching and offset == bs - 1:
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            seq.block_hashes.append(hash_block(parent, seq.token_ids[-bs:]))
        return copies

    def _grow(self, seq_id: Hashable, seq: _Seq) -> list[tuple[int, int]]:
        """A device slot for the next token: in the last block, or a new one (a copy of a shared last one)."""
        pool, offset = self.pool, len(seq.token_ids) % self.block_size
        copies = []
        if seq.num_lookahead:  # the token takes a slot reserved for it (its K/V may be written already)
            seq.num_lookahead -= 1
            pool.write(seq.blocks[len(seq.token_ids) // self.block_size], 1)
            self._resident_tokens += 1
            return copies
        if self._needs_block(seq):
            if pool.num_free == 0:
                raise NoFreeBlocks(f"sequence {seq_id!r} needs a block for token {len(seq.token_ids)}")
            if offset:  # copy on write: the shared last block is only partly filled
                copies.append(self._copy_last_block(seq))
            else:
                seq.blocks.append(pool.allocate(after=seq.blocks[-1]))
        pool.write(seq.blocks[-1], 1)
        self._resident_tokens += 1
        return copies

    def _copy_last_block(self, seq: _Seq) -> tuple[int, int]:
        """Copy on write: replace the shared, partly filled last block by a copy of its own."""
        shared = seq.blocks.pop()
        block = self.pool.allocate()
        self.pool.write(block, len(seq.token_ids) - len(seq.blocks) * self.block_size)
        self.pool.release([shared])
        seq.blocks.append(block)
        return shared.block_id, block.block_id

    def _needs_block(self, seq: _Seq) -> bool:
        """No slot reserved, and the last block is full or shared (then the append must copy it first)."""
        return not seq.num_lookahead and (
            len(seq.token_ids) % self.block_size == 0 or seq.blocks[-1].ref_cnt > 1
        )

    # -- lookahead (speculative decoding) --------------------------------------------------------------

    def can_reserve_lookahead(self, seq_id: Hashable, num_slots: int) -> bool:
        return self._lookahead_blocks(self._resident(seq_id), num_slots) <= self.pool.num_free

    def reserve_lookahead(self, seq_id: Hashable, num_slots: int) -> list[tuple[int, int]]:
        """Hold `num_slots` more slots past the sequence's tokens (for draft tokens the verify pass writes);
        returns the (src, dst) block copies to do first. Nothing is keyed for the prefix cache: the tokens
        that fill these slots come by `append`, once accepted."""
        seq = self._resident(seq_id)
        needed = self._lookahead_blocks(seq, num_slots)
        if needed > self.pool.num_free:
            raise NoFreeBlocks(f"sequence {seq_id!r} needs {needed} blocks for {num_slots} lookahead slots")
        copies = []
        if num_slots and self._last_block_shared(seq):
            copies.append(self._copy_last_block(seq))
        for _ in range(-(-(self._held_slots(seq) + num_slots) // self.block_size) - len(seq.blocks)):
            seq.blocks.append(self.pool.allocate(after=seq.blocks[-1]))
        seq.num_lookahead += num_slots
        return copies

    def release_lookahead(self, seq_id: Hashable) -> None:
        """Give back the lookahead slots no token took (rejected drafts): a block left holding no token goes
        back to the pool."""
        seq = self._resident(seq_id)
        keep = -(-len(seq.token_ids) // self.block_size)
        self.pool.release(reversed(seq.blocks[keep:]))
        del seq.blocks[keep:]
        seq.num_lookahead = 0

    def _held_slots(self, seq: _Seq) -> int:
        return len(seq.token_ids) + seq.num_lookahead

    def _last_block_shared(self, seq: _Seq) -> bool:
        """The last block is partly filled and shared: a write to its free slots must copy it first."""
        return self._held_slots(seq) % self.block_size != 0 and seq.blocks[-1].ref_cnt > 1

    def _lookahead_blocks(self, seq: _Seq, num_slots: int) -> int:
        """Free blocks reserve_lookahead(num_slots) takes: new ones, and a copy of a shared last block."""
        if num_slots < 0:
            raise ValueError(f"num_slots must be a non-negative integer, got {num_slots!r}")
        if num_slots == 0:
            return 0
        new = -(-(self._held_slots(seq) + num_slots) // self.block_size) - len(seq.blocks)
        return new + self._last_block_shared(seq)

    # -- fork / free -----------------------------------------------------------------------------------

    def fork(self, parent_id: Hashable, child_id: Hashable) -> list[tuple[int, int]]:
        """The child shares every block of the parent; nothing is allocated or copied (returns [])."""
        parent = self._settled(parent_id)
        if child_id in self._seqs:
            raise duplicate(child_id)
        for block in parent.blocks:
            self.pool.touch(block)
        self._seqs[child_id] = _Seq(
            list(parent.token_ids),
            list(parent.blocks),
            list(parent.block_hashes),
            num_cached_blocks=parent.num_cached_blocks,
        )
        self._resident_tokens += len(parent.token_ids)
        return []

    def free(self, seq_id: Hashable) -> None:
        """Give back every block of the sequence (device or host) at once."""
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            raise unknown(seq_id)
        if seq.host_blocks is not None:
            self._free_host_blocks.extend(reversed(seq.host_blocks))
        else:
            self.pool.release(reversed(seq.blocks))
            self._resident_tokens -= len(seq.token_ids)

    # -- swap ------------------------------------------------------------------------------------------

    def swap_out(self, seq_id: Hashable) -> list[tuple[int, int]]:
        """Move the sequence to host blocks; returns the (device block, host block) copies to do."""
        seq = self._settled(seq_id)
        if len(seq.blocks) > len(self._free_host_blocks):
            raise NoFreeBlocks(
                f"sequence {seq_id!r} needs {len(seq.blocks)} host blocks, {len(self._free_host_blocks)} free"
            )
        seq.host_blocks = [self._free_host_blocks.pop() for _ in seq.blocks]
        copies = [(block.block_id, host) for block, host in zip(seq.blocks, seq.host_blocks, strict=True)]
        self.pool.release(reversed(seq.blocks))
        seq.blocks = []
        self._resident_tokens -= len(seq.token_ids)
        return copies

    def can_swap_in(self, seq_id: Hashable) -> bool:
        hits = self._swap_in_hits(self._swapped(seq_id))
        return self._fits([b for b in hits if b is not None], hits.count(None))

    def swap_in(self, seq_id: Hashable) -> list[tuple[int, int]]:
        """Bring the sequence back to device blocks; returns the (host block, device block) copies to do.

        With prefix caching, computed full blocks still cached on the device are reused instead of copied;
        a block of tokens appended while swapped out is new (their K/V is still to be computed).
        """
        seq = self._swapped(seq_id)
        hits = self._swap_in_hits(seq)
        if not self._fits([b for b in hits if b is not None], hits.count(None)):
            raise NoFreeBlocks(f"sequence {seq_id!r} needs {hits.count(None)} blocks to swap in")
        for block in hits:
            if block is not None:
                self.pool.touch(block)
        seq.blocks = self._take_blocks(hits)
        copies = []
        for i, hit in enumerate(hits):
            if hit is None:
                if i < len(seq.host_blocks):
                    copies.append((seq.host_blocks[i], seq.blocks[i].block_id))
                self._fill(seq, i)
        self._free_host_blocks.extend(reversed(seq.host_blocks))
        seq.host_blocks = None
        self._resident_tokens += len(seq.token_ids)
        return copies

    def _swap_in_hits(self, seq: _Seq) -> list[Block | None]:
        """For each block the swapped sequence's tokens need, the device block still caching its content, if
        any. Only blocks it computed count: one whose K/V is still to come is never shared (it is written)."""
        computed = seq.block_hashes[: seq.num_cached_blocks]
        hits: list[Block | None] = [self.pool.cached.get(h) for h in computed]
        return hits + [None] * (-(-len(seq.token_ids) // self.block_size) - len(hits))

    # -- views -----------------------------------------------------------------------------------------

    def num_tokens(self, seq_id: Hashable) -> int:
        return len(self._known(seq_id).token_ids)

    def block_table(self, seq_id: Hashable) -> list[int]:
        return [block.block_id for block in self._resident(seq_id).blocks]

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
            shared_saved_slots=self._resident_tokens - live,
        )

    def block_states(self) -> BlockStates:
        blocks = self.pool.blocks
        return BlockStates(
            [block.ref_cnt for block in blocks],
            [block.num_tokens if block.ref_cnt else 0 for block in blocks],
            [block.block_hash is not None for block in blocks],
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

    def _known(self, seq_id: Hashable) -> _Seq:
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise unknown(seq_id)
        return seq

    def _resident(self, seq_id: Hashable) -> _Seq:
        seq = self._known(seq_id)
        if seq.host_blocks is not None:
            raise ValueError(f"sequence {seq_id!r} is swapped out")
        return seq

    def _settled(self, seq_id: Hashable) -> _Seq:
        """Resident and holding no lookahead slots (a fork or swap-out happens between verify passes)."""
        seq = self._resident(seq_id)
        if seq.num_lookahead:
            raise ValueError(f"sequence {seq_id!r} holds lookahead slots: release_lookahead first")
        return seq

    def _swapped(self, seq_id: Hashable) -> _Seq:
        seq = self._known(seq_id)
        if seq.host_blocks is None:
            raise ValueError(f"sequence {seq_id!r} is not swapped out")
        return seq
