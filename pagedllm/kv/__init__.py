"""KV cache memory management: paged blocks (PagedAttention) and the contiguous-slab baseline.

Pure Python: imports no torch and nothing else from pagedllm.
"""

from pagedllm.kv.contiguous import ContiguousAllocator, SlotRun
from pagedllm.kv.interface import USAGE_PARTS, KVAllocator, KVUsage, NoFreeBlocks, SlotState
from pagedllm.kv.paged import BlockStates, PagedAllocator

__all__ = [
    "USAGE_PARTS",
    "BlockStates",
    "ContiguousAllocator",
    "KVAllocator",
    "KVUsage",
    "NoFreeBlocks",
    "PagedAllocator",
    "SlotRun",
    "SlotState",
]
