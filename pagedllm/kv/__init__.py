"""KV cache memory management: paged blocks (PagedAttention) and the contiguous-slab baseline.

Pure Python: imports no torch and nothing else from pagedllm.
"""

from pagedllm.kv.contiguous import ContiguousAllocator, SlotRun
from pagedllm.kv.groups import KVGroups, kv_groups
from pagedllm.kv.interface import USAGE_PARTS, KVAllocator, KVUsage, NoFreeBlocks, SlotState
from pagedllm.kv.paged import NO_BLOCK, BlockStates, PagedAllocator, default_block_size

__all__ = [
    "USAGE_PARTS",
    "BlockStates",
    "ContiguousAllocator",
    "KVAllocator",
    "KVGroups",
    "KVUsage",
    "NO_BLOCK",
    "NoFreeBlocks",
    "PagedAllocator",
    "SlotRun",
    "SlotState",
    "default_block_size",
    "kv_groups",
]
