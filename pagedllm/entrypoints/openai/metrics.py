"""Prometheus metrics of one engine (vLLM's metric names, `pagedllm:` prefix), in a registry of its own."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.kv.tiers import TierUsage
from pagedllm.outputs import RequestOutput

# Seconds; wider at the top than vLLM's GPU buckets, since a CPU step can take a second.
TTFT_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
E2E_BUCKETS = (0.3, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0)


@dataclass
class RequestTimes:
    """time.monotonic() readings of one request: when it arrived, and when its last tokens came."""

    arrival: float
    first_token: float | None = None
    last_token: float | None = None


class EngineMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        reg = self.registry
        self.running = Gauge("pagedllm:num_requests_running", "Sequences running", registry=reg)
        self.waiting = Gauge("pagedllm:num_requests_waiting", "Sequences waiting", registry=reg)
        self.kv_usage = Gauge("pagedllm:kv_cache_usage_perc", "KV cache usage (1 = full)", registry=reg)
        self.kv_slots = Gauge(
            "pagedllm:kv_cache_slots_perc",
            "Share of KV token slots by state (they sum to 1): live tokens, unused tails of last blocks, "
            "contiguous reserve beyond a sequence, free gaps too small for the waiting request, other free",
            ["state"],
            registry=reg,
        )
        self.prefix_hit_rate = Gauge(
            "pagedllm:prefix_cache_hit_rate",
            "Prompt tokens found in the prefix cache / prompt tokens looked up, since start",
            registry=reg,
        )
        self.weight_memory = Gauge(
            "pagedllm:weight_memory_bytes",
            "Memory holding the model's weights in their loaded storage (quantized or not)",
            registry=reg,
        )
        self.kv_cache_memory = Gauge("pagedllm:kv_cache_memory_bytes", "Memory of the KV cache", registry=reg)
        self.kv_cache_blocks = Gauge("pagedllm:kv_cache_blocks", "KV cache blocks in all", registry=reg)
        self.kv_block_size = Gauge("pagedllm:kv_cache_block_size", "Tokens per KV block", registry=reg)
        self.prompt_tokens = Counter("pagedllm:prompt_tokens", "Prompt tokens", registry=reg)
        self.generation_tokens = Counter("pagedllm:generation_tokens", "Generated tokens", registry=reg)
        self.preemptions = Counter("pagedllm:num_preemptions", "Preemptions", registry=reg)
        self.prefix_queries = Counter(
            "pagedllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache", registry=reg
        )
        self.prefix_hits = Counter(
            "pagedllm:prefix_cache_hits", "Prompt tokens found in the prefix cache", registry=reg
        )
        self.ttft = Histogram(
            "pagedllm:time_to_first_token_seconds",
            "Time to first token in seconds",
            buckets=TTFT_BUCKETS,
            registry=reg,
        )
        self.itl = Histogram(
            "pagedllm:inter_token_latency_seconds",
            "Inter-token latency in seconds (between a request's successive steps)",
            buckets=ITL_BUCKETS,
            registry=reg,
        )
        self.e2e = Histogram(
            "pagedllm:e2e_request_latency_seconds",
            "End-to-end request latency in seconds (arrival to last token)",
            buckets=E2E_BUCKETS,
            registry=reg,
        )
        # Prefix cache tiers (kv/tiers.py): blocks each tier holds, blocks loaded from it, blocks moved
        # into it, and disk files that failed their checksum; in vLLM's names where it has them: the
        # offloading connector's bytes by transfer (its GPU is the device cache here, on any device) and
        # the KV connector's prefix tokens (every lookup asks the tiers below the device cache too).
        self.tier_blocks = Gauge(
            "pagedllm:kv_offload_cached_blocks", "Prefix blocks held by each tier", ["tier"], registry=reg
        )
        self.tier_size = Gauge(
            "pagedllm:kv_offload_size_blocks", "Blocks each tier holds at most", ["tier"], registry=reg
        )
        self.tier_used = Gauge(
            "pagedllm:kv_offload_used_blocks",
            "Blocks of each tier in use (host: cached prefix blocks, swapped sequences, disk reads)",
            ["tier"],
            registry=reg,
        )
        self.tier_hits = Counter(
            "pagedllm:kv_offload_hit_blocks",
            "Prefix blocks found in a tier below the device cache and loaded from it",
            ["tier"],
            registry=reg,
        )
        self.tier_stores = Counter(
            "pagedllm:kv_offload_stored_blocks", "Blocks copied down into each tier", ["tier"], registry=reg
        )
        self.tier_corrupt = Counter(
            "pagedllm:kv_offload_corrupt_blocks",
            "Disk tier files that failed their checksum (deleted, recomputed)",
            registry=reg,
        )
        self.tier_bytes = Counter(
            "pagedllm:kv_offload_total_bytes",
            "KV bytes moved between tiers (vLLM's transfer types; GPU: the device cache)",
            ["transfer_type"],
            registry=reg,
        )
        self.external_queries = Counter(
            "pagedllm:external_prefix_cache_queries",
            "Prompt tokens looked up in the tiers below the device cache",
            registry=reg,
        )
        self.external_hits = Counter(
            "pagedllm:external_prefix_cache_hits",
            "Prompt tokens found in the tiers below the device cache and loaded from them",
            registry=reg,
        )
        self._seen: dict[str, int] = {}  # each counter's engine total when last read

    def observe(self, engine: LLMEngine) -> None:
        """Read the engine's queues, counters and KV pool (engine thread only)."""
        stats = engine.stats()
        self.weight_memory.set(engine.weight_bytes)
        self.kv_cache_memory.set(engine.kv_cache_bytes)
        self.kv_cache_blocks.set(engine.num_kv_blocks)
        self.kv_block_size.set(engine.config.block_size)
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting + stats.num_swapped)
        usage = stats.kv_usage
        self.kv_usage.set(1.0 - usage.fraction(usage.free_slots))
        for state, slots in usage.parts().items():
            self.kv_slots.labels(state).set(usage.fraction(slots))
        self.prefix_hit_rate.set(stats.prefix_cache_hit_rate)
        for name, counter in (
            ("num_preemptions", self.preemptions),
            ("prefix_cache_queries", self.prefix_queries),
            ("prefix_cache_hits", self.prefix_hits),
        ):
            self._advance(name, counter, getattr(stats, name))
        if stats.kv_tiers is not None:
            block_bytes = engine.kv_cache_bytes // engine.num_kv_blocks
            self._observe_tiers(stats.kv_tiers, block_bytes, engine.config.block_size)
            self._advance("external_queries", self.external_queries, stats.prefix_cache_queries)

    def _observe_tiers(self, tiers: TierUsage, block_bytes: int, block_size: int) -> None:
        for tier, size, used, cached in (
            ("host", tiers.host_blocks, tiers.host_used_blocks, tiers.host_cached_blocks),
            ("disk", tiers.disk_blocks, tiers.disk_cached_blocks, tiers.disk_cached_blocks),
        ):
            self.tier_size.labels(tier).set(size)
            self.tier_used.labels(tier).set(used)
            self.tier_blocks.labels(tier).set(cached)
        counts = tiers.counters
        # Every block a hit loads comes from host memory (a disk hit is read into it first).
        self._advance("external_hits", self.external_hits, counts.host_hit_blocks * block_size)
        for transfer, blocks in (
            ("GPU_to_CPU", counts.offloaded_blocks),
            ("CPU_to_GPU", counts.host_hit_blocks),
            ("GPU_to_DISK", counts.persisted_blocks),
            ("DISK_to_CPU", counts.disk_hit_blocks),
        ):
            self._advance(transfer, self.tier_bytes.labels(transfer), blocks * block_bytes)
        for name, counter, total in (
            ("host_hits", self.tier_hits.labels("host"), counts.host_hit_blocks),
            ("disk_hits", self.tier_hits.labels("disk"), counts.disk_hit_blocks),
            ("host_stores", self.tier_stores.labels("host"), counts.offloaded_blocks),
            ("disk_stores", self.tier_stores.labels("disk"), counts.persisted_blocks),
            ("corrupt", self.tier_corrupt, counts.disk_corrupt_blocks),
        ):
            self._advance(name, counter, total)

    def _advance(self, name: str, counter, total: int) -> None:
        """Bring a Prometheus counter up to the engine's running total."""
        counter.inc(total - self._seen.get(name, 0))
        self._seen[name] = total

    def observe_output(self, times: RequestTimes, now: float, new_tokens: int, finished: bool) -> None:
        """A step's output for a request at `now`: with new tokens, its time to first token or its
        inter-token latency; once finished, its end-to-end latency."""
        if new_tokens:
            if times.first_token is None:
                times.first_token = now
                self.ttft.observe(now - times.arrival)
            else:
                self.itl.observe(now - times.last_token)
            times.last_token = now
        if finished:
            self.e2e.observe(now - times.arrival)

    def token_totals(self) -> dict[str, float]:
        """Prompt and generated tokens since start (the dashboard turns them into tokens/s)."""
        get = self.registry.get_sample_value
        return {
            "prompt_tokens": get("pagedllm:prompt_tokens_total"),
            "generation_tokens": get("pagedllm:generation_tokens_total"),
        }

    @staticmethod
    def num_generated(output: RequestOutput) -> int:
        return sum(len(o.token_ids) for o in output.outputs)

    def render(self) -> bytes:
        return generate_latest(self.registry)
