"""Building an engine's parts from its EngineConfig, in start-up order: the model (loaded once, resolved
once), the KV cache's size, the allocator (paged or contiguous) with its prefix cache tiers, the model
runner holding the cache's memory, the speculative proposer and the scheduler over the allocator; with
enable_lora, the LoRA adapters' manager beside the model."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from pagedllm.engine.config import EngineConfig, parse_bytes
from pagedllm.engine.draft_model import DraftModelProposer
from pagedllm.engine.generation_config import sampling_defaults
from pagedllm.engine.guided import GrammarCompiler
from pagedllm.engine.kv_sizing import check_max_model_len, kv_block_bytes, model_kv_groups, num_kv_blocks
from pagedllm.engine.kv_transfer import TierTransfers, open_disk_store
from pagedllm.engine.lora_manager import LoRAManager
from pagedllm.engine.model_cache import load_shared_model
from pagedllm.engine.model_runner import ModelRunner, calibration_ids
from pagedllm.engine.parallel.executor import Executor
from pagedllm.engine.parallel.runner import ParallelModelRunner
from pagedllm.engine.scheduler import Scheduler
from pagedllm.engine.speculative import NgramProposer
from pagedllm.engine.stop_checker import StopChecker
from pagedllm.kv import ContiguousAllocator, KVAllocator, PagedAllocator
from pagedllm.kv.groups import KVGroups
from pagedllm.kv.tiers import HOST, DiskTier, HostPool, PrefixTiers
from pagedllm.models.loader import ResolvedModel
from pagedllm.models.parallel import SINGLE

logger = logging.getLogger(__name__)


@dataclass
class KVCachePlan:
    """How the KV cache is laid out: its groups, its blocks, their bytes, and the host blocks beside."""

    groups: KVGroups
    block_bytes: int
    num_blocks: int
    num_host_blocks: int

    @property
    def num_bytes(self) -> int:
        return self.num_blocks * self.block_bytes


def load_model(engine, config: EngineConfig, executor: Executor | None, model: ResolvedModel) -> None:
    """The model, its tokenizer and what they fix: EOS ids, the context length, sampling defaults,
    the guided-decoding grammar compiler."""
    loaded = load_shared_model(
        model,
        config.torch_dtype,
        config.device,
        config.quantization,
        executor.tp if executor else SINGLE,
        config.max_num_seqs,
        config.max_model_len,
    )
    engine.loaded_model, engine.model, engine.tokenizer = loaded, loaded.model, loaded.tokenizer
    engine.weight_bytes = loaded.weight_bytes
    engine.eos_token_ids = set(loaded.eos_token_ids)
    model_cfg = loaded.model.config
    engine.max_model_len = check_max_model_len(config.max_model_len, model_cfg.max_position_embeddings)
    engine.default_sampling = sampling_defaults(config.generation_config, loaded.path)
    engine.grammars = GrammarCompiler(loaded.path, model_cfg.vocab_size, sorted(engine.eos_token_ids))


def plan_kv_cache(engine, config: EngineConfig) -> KVCachePlan:
    """The KV cache's groups and size in blocks (rank 0 holds the most KV heads of any rank: its blocks
    are the largest)."""
    model_cfg = engine.model.config
    hybrid = config.kv_layout == "paged" and not config.disable_hybrid_kv_cache_manager
    groups = model_kv_groups(model_cfg, hybrid)
    block_bytes = kv_block_bytes(
        model_cfg,
        engine.model.num_kv_heads,
        config.kv_torch_dtype,
        config.block_size,
        groups.layers_per_group,
    )
    num_blocks = num_kv_blocks(config, block_bytes, engine.weight_bytes)
    num_host = 0
    if config.has_kv_tiers:  # the host tier's pool is the swap pool too
        num_host = _host_tier_blocks(config, block_bytes, num_blocks)
    elif config.preemption_mode == "swap":
        num_host = num_blocks if config.kv_layout == "paged" else num_blocks * config.block_size
    return KVCachePlan(groups, block_bytes, num_blocks, num_host)


def _host_tier_blocks(config: EngineConfig, block_bytes: int, num_blocks: int) -> int:
    """kv_offload_memory in blocks (a disk tier alone stages its reads in a pool the size of the cache)."""
    if config.kv_offload_memory is None:
        return num_blocks
    num_host = parse_bytes(config.kv_offload_memory, "kv_offload_memory") // block_bytes
    if num_host < 1:
        raise ValueError(
            f"kv_offload_memory={config.kv_offload_memory!r} holds no KV block ({block_bytes} bytes)"
        )
    return num_host


def make_tiers(config: EngineConfig, plan: KVCachePlan) -> PrefixTiers | None:
    """The host tier (kv_offload_memory) and the disk tier (kv_offload_dir, kv_offload_disk), in blocks."""
    if not config.has_kv_tiers:
        return None
    disk = None
    if config.kv_offload_dir is not None:
        num_disk = parse_bytes(config.kv_offload_disk, "kv_offload_disk") // plan.block_bytes
        if num_disk < 1:
            raise ValueError(
                f"kv_offload_disk={config.kv_offload_disk!r} holds no KV block ({plan.block_bytes} bytes)"
            )
        disk = DiskTier(num_disk)
    return PrefixTiers(HostPool(plan.num_host_blocks), disk, config.block_size)


def make_allocator(config: EngineConfig, plan: KVCachePlan, tiers: PrefixTiers | None, max_model_len: int):
    if config.kv_layout == "paged":
        return PagedAllocator(
            plan.num_blocks,
            config.block_size,
            enable_prefix_caching=config.enable_prefix_caching,
            windows=plan.groups.windows,
            # Admission asks a prompt's first chunk: one block of new tokens (a window group's promise adds
            # its window: what it holds once it decodes); a longer chunk takes the free blocks the scheduler
            # finds for it (prefill_room).
            prefill_chunk=config.block_size if config.enable_chunked_prefill else None,
            tiers=tiers,
        )
    num_slots = plan.num_blocks * config.block_size
    return ContiguousAllocator(num_slots, max_model_len, reserve=config.contiguous_reserve)


def make_runner(engine, config: EngineConfig, executor: Executor | None, plan: KVCachePlan, allocator):
    """The model runner over the allocator's geometry (the contiguous layout: blocks of one slot)."""
    cache = (allocator.num_total_blocks, allocator.block_size, config.kv_torch_dtype, config.device)
    rest = (plan.num_host_blocks, config.prefault_kv_cache, plan.groups)
    if executor is not None:
        runner = ParallelModelRunner(executor, engine.model, *cache, *rest, loras=engine.loras)
    else:
        runner = ModelRunner(engine.model, *cache, *rest, loras=engine.loras)
    runner.calibrate_key_smoothing(calibration_ids(engine.model.config.vocab_size, engine.max_model_len))
    return runner


def make_transfers(engine, config: EngineConfig, plan: KVCachePlan) -> TierTransfers | None:
    """The tiers' byte moves; the host tier's load rate is measured once here."""
    if engine.tiers is None:
        return None
    probe = min(8, plan.num_host_blocks, plan.num_blocks)
    engine.tiers.observe_load(HOST, engine.runner.time_host_load(probe), probe)
    store = open_disk_store(engine, plan.block_bytes) if config.kv_offload_dir is not None else None
    return TierTransfers(engine.tiers, engine.runner, store)


def make_proposer(engine, config: EngineConfig, num_blocks: int):
    spec = config.speculative_config
    if spec is None:
        return None
    if spec.method == "ngram":
        return NgramProposer(spec)
    # Its pool: as many blocks as the target's (its own, smaller ones): it holds what the target does.
    return DraftModelProposer(spec, config, engine.model.config.vocab_size, num_blocks)


def make_scheduler(engine, config: EngineConfig, allocator: KVAllocator) -> Scheduler:
    return Scheduler(
        allocator,
        engine.max_model_len,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        preemption_mode=config.preemption_mode,
        enable_chunked_prefill=config.enable_chunked_prefill,
        watermark=config.watermark,
        max_loras=config.max_loras if config.enable_lora else None,
        stop_checker=StopChecker(engine.tokenizer, engine.eos_token_ids, engine.max_model_len),
        # A sequence that leaves the cache leaves the draft model's too.
        on_release=engine.proposer.release if engine.proposer is not None else None,
    )


def build(engine, config: EngineConfig, model: ResolvedModel) -> None:
    """Give `engine` its parts, in start-up order (the parts read what was built before them)."""
    load_model(engine, config, engine.executor, model)
    engine.loras = (
        LoRAManager(engine.model, config.max_lora_rank, config.max_cpu_loras, config.torch_dtype)
        if config.enable_lora
        else None
    )
    plan = plan_kv_cache(engine, config)
    engine.kv_groups, engine.num_kv_blocks, engine.kv_cache_bytes = (
        plan.groups,
        plan.num_blocks,
        plan.num_bytes,
    )
    engine.tiers = make_tiers(config, plan)
    engine.allocator = make_allocator(config, plan, engine.tiers, engine.max_model_len)
    logger.info(
        "weights %.1f MiB (%s), KV cache %.1f MiB: %d blocks of %d tokens (%d tokens, %s layout)",
        engine.weight_bytes / 2**20,
        engine.loaded_model.linear_method,
        plan.num_bytes / 2**20,
        plan.num_blocks,
        config.block_size,
        plan.num_blocks * config.block_size,
        config.kv_layout,
    )
    engine.runner = make_runner(engine, config, engine.executor, plan, engine.allocator)
    engine.transfers = make_transfers(engine, config, plan)
    engine.proposer = make_proposer(engine, config, plan.num_blocks)
    engine.scheduler = make_scheduler(engine, config, engine.allocator)
