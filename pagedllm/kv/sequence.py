"""One sequence's KV state under the paged layout: its tokens, a block table per KV group, its hashes."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedllm.kv.block_pool import Block


@dataclass
class SeqBlocks:
    """One sequence: its tokens, a block table per KV group, and the hash of each of its full blocks."""

    token_ids: list[int]
    tables: list[list[Block | None]]  # per group; None: given back (out of the window); [] while swapped
    block_hashes: list[bytes] = field(default_factory=list)  # only with prefix caching
    num_cached_blocks: int = 0  # leading blocks computed and findable in the prefix cache
    host_blocks: list[list[int | None]] | None = None  # per group, set while swapped out
    window_blocks: int = 0  # logical blocks the window groups cover (fewer while a prompt is prefilled)
    released: list[int] = field(default_factory=list)  # per group: leading entries given back
    promise: int = 0  # free blocks set aside for the window groups' growth until the prefill ends
    num_lookahead: int = 0  # slots held past the last token (speculative decoding's draft tokens)
    lora_int_id: int | None = None  # the LoRA adapter its K/V is computed under: part of its blocks' hashes

    def num_blocks(self, block_size: int) -> int:
        """Logical blocks its tokens span."""
        return -(-len(self.token_ids) // block_size)

    def prefilling(self, block_size: int) -> bool:
        """A prompt still prefilled chunk by chunk: its window groups lack blocks for its last tokens."""
        return self.window_blocks < self.num_blocks(block_size)

    def slots_held(self) -> int:
        """Tokens written in the blocks its tables hold (a shared block counts once per table)."""
        return sum(block.num_tokens for table in self.tables for block in table if block is not None)
