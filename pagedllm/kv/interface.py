"""What both KV layouts share: the usage snapshot, the out-of-memory error and the allocator protocol."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

from pagedllm.kv.tiers import TierMoves


class NoFreeBlocks(RuntimeError):
    """Not enough free KV memory for the operation; the allocator was left unchanged."""


@dataclass(frozen=True)
class KVUsage:
    """Where every KV slot of the device cache is: live + reserved + tail + free == total."""

    total_slots: int
    live_slots: int  # hold a token of a resident sequence (a shared slot counts once)
    reserved_slots: int  # contiguous: inside a slab, beyond its sequence's current length
    tail_slots: int  # paged: unused slots of blocks in use (the last block of each sequence)
    free_slots: int  # in no sequence (paged: includes cached blocks no sequence holds)
    largest_free_run: int  # most slots one new sequence can get (paged: every free slot)
    external_frag_slots: int  # free slots in gaps too small for the request can_allocate last refused
    shared_saved_slots: int  # tokens of resident sequences minus live slots (fork / prefix sharing)

    def fraction(self, slots: int) -> float:
        """`slots` as a fraction of the cache, e.g. `usage.fraction(usage.live_slots)`."""
        return slots / self.total_slots

    @property
    def live_fraction(self) -> float:
        return self.fraction(self.live_slots)

    def parts(self) -> dict[str, int]:
        """Disjoint slot counts in USAGE_PARTS order, summing to total_slots: `external` is the free
        space in gaps too small for the last refused request, `free` the rest of the free space."""
        return {
            "live": self.live_slots,
            "tail": self.tail_slots,
            "reserved": self.reserved_slots,
            "external": self.external_frag_slots,
            "free": self.free_slots - self.external_frag_slots,
        }


USAGE_PARTS = ("live", "tail", "reserved", "external", "free")  # where a KV slot can be, as KVUsage.parts()


class SlotState(StrEnum):
    """What one KV slot holds, as `slot_states()` reports it; the names match KVUsage's counts."""

    LIVE = "live"  # a token of a resident sequence
    RESERVED = "reserved"  # contiguous: inside a slab, beyond its sequence's length
    TAIL = "tail"  # paged: an unused slot of a block in use
    FREE = "free"  # in no sequence (paged: includes cached blocks no sequence holds)


class KVAllocator(Protocol):
    """The interface the engine and the benchmarks use, for either layout.

    The cache is viewed as [num_total_blocks, block_size, ...]; token t of a sequence lives in slot
    `block_table[t // block_size] * block_size + t % block_size` (the contiguous layout has
    block_size 1, so its block table is the list of its tokens' slots). With several KV groups a sequence
    has one table per group (`block_tables`), a sliding-window group's with NO_BLOCK where it gave a block
    back. Every method that needs
    memory raises NoFreeBlocks, changing nothing, when there is not enough. A swapped-out sequence may
    still be appended to: its new tokens get their slots when swap_in brings it back.
    """

    block_size: int
    num_groups: int  # KV groups (kv/groups.py): block tables per sequence, all mapping the same tokens
    enable_prefix_caching: bool
    supports_swap: bool  # swap_out / can_swap_in / swap_in work (False: they raise ValueError)

    @property
    def num_total_blocks(self) -> int: ...

    @property
    def num_free_blocks(self) -> int: ...

    def __contains__(self, seq_id: Hashable) -> bool: ...

    # true_output_len: what `pagedllm bench memory` knows of a request's real length, for the contiguous
    # layout's reserve='oracle'; the paged layout ignores it (its memory grows on demand). lora_int_id: the
    # LoRA adapter the prompt's K/V is computed under (None: the base), a part of its cached blocks' keys.
    def can_allocate(
        self,
        prompt_token_ids: Sequence[int],
        max_new_tokens: int,
        *,
        true_output_len: int | None = None,
        read_prefix_cache: bool = True,
        lora_int_id: int | None = None,
    ) -> bool: ...

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
    ) -> int: ...

    def num_blocks_needed(self, prompt_token_ids: Sequence[int]) -> int: ...

    def cache_blocks(self, seq_id: Hashable, num_tokens: int, *, start: int | None = None) -> None: ...

    # The prompt tokens from `start` one step can compute (sliding-window groups take a chunk's blocks as it
    # is computed), at most num_tokens, keeping keep_free blocks for others where it can; at least one.
    def prefill_room(self, seq_id: Hashable, start: int, num_tokens: int, *, keep_free: int = 0) -> int: ...

    # The step's end (kv/journal.py): commit when its forward pass and postprocessing succeeded (what it
    # cached stays findable, and is reported as KV events), rollback when it raised (nothing it cached is
    # findable any more, on any tier); then the engine frees the failed sequences.
    def commit(self) -> None: ...

    def rollback(self) -> None: ...

    def can_append(self, seq_id: Hashable) -> bool: ...

    def append(self, seq_id: Hashable, token_id: int) -> list[tuple[int, int]]: ...

    def fork(self, parent_id: Hashable, child_id: Hashable) -> list[tuple[int, int]]: ...

    # Speculative decoding: slots past the tokens for the verify pass's draft tokens, taken by `append`
    # as drafts are accepted; release_lookahead gives back the rest. Only accepted tokens are ever hashed.
    def can_reserve_lookahead(self, seq_id: Hashable, num_slots: int) -> bool: ...

    def reserve_lookahead(self, seq_id: Hashable, num_slots: int) -> list[tuple[int, int]]: ...

    def release_lookahead(self, seq_id: Hashable) -> None: ...

    def take_tier_moves(self) -> TierMoves:
        """The prefix cache tiers' block copies planned since the last call (kv/tiers.py)."""
        ...

    def free(self, seq_id: Hashable) -> None: ...

    def swap_out(self, seq_id: Hashable) -> list[tuple[int, int]]: ...

    def can_swap_in(self, seq_id: Hashable) -> bool: ...

    def swap_in(self, seq_id: Hashable) -> list[tuple[int, int]]: ...

    def num_tokens(self, seq_id: Hashable) -> int: ...

    def block_table(self, seq_id: Hashable) -> list[int]: ...

    def block_tables(self, seq_id: Hashable) -> list[list[int]]: ...

    def usage(self) -> KVUsage: ...

    def slot_states(self) -> list[SlotState]: ...

    def all_free(self) -> bool: ...


def check_request(prompt_token_ids: Sequence[int], max_new_tokens: int) -> None:
    """Reject a prompt or token budget no layout can serve."""
    if len(prompt_token_ids) == 0:
        raise ValueError("prompt_token_ids must hold at least one token, got an empty prompt")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be a non-negative integer, got {max_new_tokens!r}")


def unknown(seq_id: Hashable) -> KeyError:
    return KeyError(f"sequence {seq_id!r} is not allocated (never allocated, or already freed)")


def duplicate(seq_id: Hashable) -> ValueError:
    return ValueError(f"sequence {seq_id!r} is already allocated")


def check_positive(name: str, value: int) -> None:
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
