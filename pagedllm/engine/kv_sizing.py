"""How large the KV cache is: the bytes of a block, and how many blocks the engine's settings give it."""

from __future__ import annotations

import os

import torch

from pagedllm import ops
from pagedllm.engine.config import EngineConfig, parse_bytes
from pagedllm.kv import KVAllocator, KVGroups, kv_groups
from pagedllm.models import ModelConfig


def model_kv_groups(config: ModelConfig, hybrid: bool) -> KVGroups:
    """The model's layers in KV groups by sliding window (hybrid), or one group holding every token."""
    return kv_groups([config.layer_sliding_window(i) for i in range(config.num_layers)], hybrid)


def kv_block_bytes(
    config: ModelConfig, num_kv_heads: int, dtype: torch.dtype, block_size: int, num_layers: int | None = None
) -> int:
    """Bytes of a KV block of `block_size` tokens for `num_kv_heads` heads of `num_layers` layers (default
    every layer; a KV group's block holds its group's: KVGroups.layers_per_group), K and V, a quantized
    cache's scales included."""
    layers = config.num_layers if num_layers is None else num_layers
    return 2 * layers * ops.kv_block_bytes(block_size, num_kv_heads, config.head_dim, dtype)


def sizing_setting(config: EngineConfig) -> str:
    """The setting that sizes the KV cache: num_kv_blocks if set, else memory_budget if set, else
    kv_cache_memory."""
    if config.num_kv_blocks is not None:
        return "num_kv_blocks"
    return "kv_cache_memory" if config.memory_budget is None else "memory_budget"


def num_kv_blocks(config: EngineConfig, block_bytes: int, weight_bytes: int) -> int:
    """num_kv_blocks if set, else the blocks of `block_bytes` in the KV budget: kv_cache_memory, or what
    the weights (`weight_bytes`) leave of memory_budget."""
    setting = sizing_setting(config)
    if setting == "num_kv_blocks":
        return config.num_kv_blocks
    budget = parse_bytes(getattr(config, setting), setting)
    if setting == "memory_budget":
        if budget <= weight_bytes:
            raise ValueError(
                f"memory_budget={config.memory_budget!r} ({budget / 2**20:.1f} MiB) leaves nothing for the "
                f"KV cache: the weights take {weight_bytes / 2**20:.1f} MiB"
            )
        budget -= weight_bytes
    if budget < block_bytes:
        raise ValueError(f"{setting}={getattr(config, setting)!r} holds no KV block")
    return budget // block_bytes


def check_max_model_len(requested: int | None, context: int) -> int:
    """The model's context unless asked for less; more is refused, as vLLM does, unless allowed."""
    if requested is None:
        return context
    if requested > context and os.environ.get("PAGEDLLM_ALLOW_LONG_MAX_MODEL_LEN") != "1":
        raise ValueError(
            f"max_model_len={requested} is longer than the model's context of {context} tokens "
            "(max_position_embeddings): positions past it were never trained and give poor output. "
            "Set PAGEDLLM_ALLOW_LONG_MAX_MODEL_LEN=1 to allow it anyway"
        )
    return requested


def check_fits_cache(token_ids: list[int], allocator: KVAllocator, config: EngineConfig) -> None:
    """Refuse a prompt whose prefill alone needs more KV blocks than the whole cache holds: it could never
    run (llama-server's "exceeds the available context size"), so the caller hears it now rather than
    getting an empty "length" finish after it waited."""
    needed, total = allocator.num_blocks_needed(token_ids), allocator.num_total_blocks
    if needed > total:
        setting = sizing_setting(config)
        raise ValueError(
            f"prompt has {len(token_ids)} tokens, whose KV needs {needed} blocks; the KV cache holds {total} "
            f"blocks in all ({setting}={getattr(config, setting)!r}): give the cache more memory or shorten "
            "the prompt"
        )
