"""KV cache memory management: paged blocks (PagedAttention) and the contiguous-slab baseline.

Pure Python: imports no torch and nothing else from pagedllm.
"""

from pagedllm.kv.contiguous import ContiguousAllocator
from pagedllm.kv.interface import KVAllocator, KVUsage, NoFreeBlocks, SlotState
from pagedllm.kv.paged import PagedAllocator

__all__ = ["ContiguousAllocator", "KVAllocator", "KVUsage", "NoFreeBlocks", "PagedAllocator", "SlotState"]
