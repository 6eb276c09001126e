"""ContiguousAllocator: one contiguous slab per sequence, the layout PagedAttention replaced (Orca).

A slab is reserved in a linear address space of `num_slots` token slots when the sequence is admitted,
sized by a reservation policy, and placed first fit:
- `max`: max_model_len slots, room for the longest sequence the model allows (Orca (Max));
- `pow2`: the next power of two of prompt + max_new_tokens, at most max_model_len (Orca (Pow2));
- `oracle`: exactly prompt + the true output length, known only to simulations (Orca (Oracle)).
Freed slabs merge with neighbouring free space; a request fails when no single gap is large enough,
even if the gaps together are (external fragmentation). To share the attention kernels with the paged
layout, the cache is viewed as blocks of one slot: block_size is 1 and a sequence's block table is
the list of its tokens' slots (start, start + 1, ...).
"""

from __future__ import annotations

import bisect
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from pagedllm.kv.interface import (
    KVUsage,
    NoFreeBlocks,
    SlotState,
    check_positive,
    check_request,
    duplicate,
    unknown,
)
from pagedllm.kv.tiers import TierMoves

RESERVE_POLICIES = ("max", "pow2", "oracle")


@dataclass
class Slab:
    start: int
    size: int
    num_tokens: int
    num_lookahead: int = 0  # slots past the tokens held for speculative decoding's draft tokens


@dataclass(frozen=True)
class SlotRun:
    """A stretch of the slot address space: one sequence's slab, or a free gap."""

    start: int
    size: int
    seq_id: Hashable | None  # None: a free gap
    num_tokens: int  # live tokens at the start of a slab; 0 in a gap
    external: bool  # a gap too small for the slab of the request can_allocate last refused


class ContiguousAllocator:
    """First-fit slabs over `num_slots` slots; `gaps` is the sorted list of free (start, size) runs."""

    block_size = 1
    num_groups = 1  # every layer keeps every token (the baseline the hybrid KV groups are measured against)
    enable_prefix_caching = False  # slabs are never shared
    supports_swap = False  # slabs never move to a host pool: a preempted sequence is recomputed

    def __init__(self, num_slots: int, max_model_len: int, reserve: str = "max"):
        check_positive("num_slots", num_slots)
        check_positive("max_model_len", max_model_len)
        if reserve not in RESERVE_POLICIES:
            raise ValueError(f"reserve must be one of {RESERVE_POLICIES}, got {reserve!r}")
        self.num_slots = num_slots
        self.max_model_len = max_model_len
        self.reserve = reserve
        self.gaps: list[tuple[int, int]] = [(0, num_slots)]
        self.slabs: dict[Hashable, Slab] = {}
        self._reserved = 0  # slots inside slabs
        self._live = 0  # tokens in slabs
        self._refused = 0  # slab size of the last request can_allocate refused (0: none since)

    @property
    def num_total_blocks(self) -> int:
        return self.num_slots

    @property
    def num_free_blocks(self) -> int:
        """Free slots (a request may still not fit: it needs them in one gap)."""
        return self.num_slots - self._reserved

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self.slabs

    def all_free(self) -> bool:
        return not self.slabs and self.gaps == [(0, self.num_slots)]

    def slab_size(self, prompt_len: int, max_new_tokens: int, true_output_len: int | None = None) -> int:
        """Slots the reservation policy reserves for a request."""
        if prompt_len + max_new_tokens > self.max_model_len:
            raise ValueError(
                f"prompt of {prompt_len} tokens + max_new_tokens {max_new_tokens} exceeds "
                f"max_model_len {self.max_model_len}"
            )
        if self.reserve == "max":
            return self.max_model_len
        if self.reserve == "pow2":
            return min(1 << (prompt_len + max_new_tokens - 1).bit_length(), self.max_model_len)
        if true_output_len is None or not 0 <= true_output_len <= max_new_tokens:
            raise ValueError(
                f"reserve='oracle' needs true_output_len in [0, max_new_tokens={max_new_tokens}], "
                f"got {true_output_len!r}"
            )
        return prompt_len + true_output_len

    # -- allocate / append / fork / free ---------------------------------------------------------------

    def can_allocate(
        self,
        prompt_token_ids: Sequence[int],
        max_new_tokens: int,
        *,
        true_output_len: int | None = None,
        read_prefix_cache: bool = True,
        lora_int_id: int | None = None,
    ) -> bool:
        """Whether some single gap holds the request's slab (a refusal is remembered for usage()); there
        is no prefix cache to read."""
        check_request(prompt_token_ids, max_new_tokens)
        size = self.slab_size(len(prompt_token_ids), max_new_tokens, true_output_len)
        if self._first_fit(size) is None:
            self._refused = size
            return False
        return True

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
        """Reserve the request's slab first fit and place the prompt at its start; returns 0 (no cache).

        Raises NoFreeBlocks, changing nothing, when no single gap holds the slab.
        """
        if seq_id in self.slabs:
            raise duplicate(seq_id)
        check_request(prompt_token_ids, max_new_tokens)
        size = self.slab_size(len(prompt_token_ids), max_new_tokens, true_output_len)
        self.slabs[seq_id] = Slab(self._reserve(seq_id, size), size, len(prompt_token_ids))
        self._live += len(prompt_token_ids)
        self._refused = 0
        return 0

    def num_blocks_needed(self, prompt_token_ids: Sequence[int]) -> int:
        """Slots of the prompt (a slab may reserve more)."""
        return len(prompt_token_ids)

    def cache_blocks(self, seq_id: Hashable, num_tokens: int, *, start: int | None = None) -> None:
        """No prefix cache and every layer's slab: nothing to do."""
        self._slab(seq_id)

    def commit(self) -> None:
        """No prefix cache: a step's end changes nothing."""

    def rollback(self) -> None:
        """No prefix cache: nothing a failed step wrote is findable by another sequence."""

    def prefill_room(self, seq_id: Hashable, start: int, num_tokens: int, *, keep_free: int = 0) -> int:
        """The slab holds every prompt token from admission on: all of them."""
        self._slab(seq_id)
        return num_tokens

    def can_append(self, seq_id: Hashable) -> bool:
        slab = self._slab(seq_id)
        return slab.num_tokens < slab.size

    def append(self, seq_id: Hashable, token_id: int) -> list[tuple[int, int]]:
        """The next slot of the slab; raises NoFreeBlocks when the slab is full. Never copies."""
        slab = self._slab(seq_id)
        if slab.num_tokens == slab.size:
            raise NoFreeBlocks(
                f"sequence {seq_id!r} filled its slab of {slab.size} slots (reserve={self.reserve!r})"
            )
        slab.num_tokens += 1
        slab.num_lookahead = max(slab.num_lookahead - 1, 0)
        self._live += 1
        return []

    def can_reserve_lookahead(self, seq_id: Hashable, num_slots: int) -> bool:
        slab = self._slab(seq_id)
        return slab.num_tokens + slab.num_lookahead + num_slots <= slab.size

    def reserve_lookahead(self, seq_id: Hashable, num_slots: int) -> list[tuple[int, int]]:
        """The next `num_slots` slots of the slab join the sequence's table until release_lookahead
        (speculative decoding: the verify pass writes draft K/V there); raises NoFreeBlocks past the slab."""
        if not self.can_reserve_lookahead(seq_id, num_slots):
            raise NoFreeBlocks(f"sequence {seq_id!r}: {num_slots} lookahead slots overflow its slab")
        self.slabs[seq_id].num_lookahead += num_slots
        return []

    def release_lookahead(self, seq_id: Hashable) -> None:
        self._slab(seq_id).num_lookahead = 0

    def fork(self, parent_id: Hashable, child_id: Hashable) -> list[tuple[int, int]]:
        """The child gets its own slab of the parent's size; returns the (src, dst) slot copies to do."""
        parent = self._slab(parent_id)
        if parent.num_lookahead:
            raise ValueError(f"sequence {parent_id!r} holds lookahead slots: release_lookahead first")
        if child_id in self.slabs:
            raise duplicate(child_id)
        start = self._reserve(child_id, parent.size)
        self.slabs[child_id] = Slab(start, parent.size, parent.num_tokens)
        self._live += parent.num_tokens
        return [(parent.start + t, start + t) for t in range(parent.num_tokens)]

    def free(self, seq_id: Hashable) -> None:
        """Give the slab back, merged with the free space on either side."""
        slab = self.slabs.pop(seq_id, None)
        if slab is None:
            raise unknown(seq_id)
        self._reserved -= slab.size
        self._live -= slab.num_tokens
        start, end = slab.start, slab.start + slab.size
        i = bisect.bisect(self.gaps, (start,))
        if i < len(self.gaps) and self.gaps[i][0] == end:
            end += self.gaps.pop(i)[1]
        if i > 0 and sum(self.gaps[i - 1]) == start:
            i -= 1
            start = self.gaps.pop(i)[0]
        self.gaps.insert(i, (start, end - start))

    def take_tier_moves(self) -> TierMoves:
        """No prefix cache, so no tiers: nothing to move."""
        return TierMoves()

    def swap_out(self, seq_id: Hashable) -> list[tuple[int, int]]:
        raise _cannot_swap(seq_id)

    def can_swap_in(self, seq_id: Hashable) -> bool:
        raise _cannot_swap(seq_id)

    def swap_in(self, seq_id: Hashable) -> list[tuple[int, int]]:
        raise _cannot_swap(seq_id)

    def _first_fit(self, size: int) -> int | None:
        return next((i for i, (_, gap) in enumerate(self.gaps) if gap >= size), None)

    def _reserve(self, seq_id: Hashable, size: int) -> int:
        i = self._first_fit(size)
        if i is None:
            raise NoFreeBlocks(
                f"sequence {seq_id!r} needs a slab of {size} slots; the largest free gap has "
                f"{self._largest_gap()} ({self.num_free_blocks} free in all)"
            )
        start, gap = self.gaps[i]
        if gap == size:
            del self.gaps[i]
        else:
            self.gaps[i] = (start + size, gap - size)
        self._reserved += size
        return start

    def _largest_gap(self) -> int:
        return max((gap for _, gap in self.gaps), default=0)

    # -- views -----------------------------------------------------------------------------------------

    def num_tokens(self, seq_id: Hashable) -> int:
        return self._slab(seq_id).num_tokens

    def block_table(self, seq_id: Hashable) -> list[int]:
        """The slot of every token (and lookahead slot): each slot is a block of one token."""
        slab = self._slab(seq_id)
        return list(range(slab.start, slab.start + slab.num_tokens + slab.num_lookahead))

    def block_tables(self, seq_id: Hashable) -> list[list[int]]:
        """One group: every layer's slab holds every token."""
        return [self.block_table(seq_id)]

    def usage(self) -> KVUsage:
        free = self.num_slots - self._reserved
        return KVUsage(
            total_slots=self.num_slots,
            live_slots=self._live,
            reserved_slots=self._reserved - self._live,
            tail_slots=0,
            free_slots=free,
            largest_free_run=self._largest_gap(),
            external_frag_slots=sum(gap for _, gap in self.gaps if gap < self._refused),
            shared_saved_slots=0,
        )

    def slot_states(self) -> list[SlotState]:
        """Every slot in address order: a slab is live up to its length, then reserved."""
        states = [SlotState.FREE] * self.num_slots
        for slab in self.slabs.values():
            end = slab.start + slab.num_tokens
            states[slab.start : end] = [SlotState.LIVE] * slab.num_tokens
            states[end : slab.start + slab.size] = [SlotState.RESERVED] * (slab.size - slab.num_tokens)
        return states

    def runs(self) -> list[SlotRun]:
        """Slabs and gaps in address order: the whole address space, each run once."""
        slabs = [SlotRun(s.start, s.size, seq_id, s.num_tokens, False) for seq_id, s in self.slabs.items()]
        gaps = [SlotRun(start, size, None, 0, size < self._refused) for start, size in self.gaps]
        return sorted(slabs + gaps, key=lambda run: run.start)

    def _slab(self, seq_id: Hashable) -> Slab:
        slab = self.slabs.get(seq_id)
        if slab is None:
            raise unknown(seq_id)
        return slab


def _cannot_swap(seq_id: Hashable) -> ValueError:
    return ValueError(
        f"the contiguous layout cannot swap sequence {seq_id!r} to the host (supports_swap is False): "
        "use the paged layout, or preemption by recompute"
    )
