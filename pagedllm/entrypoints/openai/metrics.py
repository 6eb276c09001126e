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
        # into it, and disk files that failed their checksum.
        self.tier_blocks = Gauge(
            "pagedllm:kv_offload_cached_blocks", "Prefix blocks held by each tier", ["tier"], registry=reg
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
        self._seen: dict[str, int] = {}  # each counter's engine total when last read

    def observe(self, engine: LLMEngine) -> None:
        """Read the engine's queues, counters and KV pool (engine thread only)."""
        stats = engine.stats()
        self.weight_memory.set(engine.weight_bytes)
        self.kv_cache_memory.set(engine.kv_cache_bytes)
        self.kv_cache_blocks.set(engine.num_kv_blocks)
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
            self._observe_tiers(stats.kv_tiers)

    def _observe_tiers(self, tiers: TierUsage) -> None:
        self.tier_blocks.labels("host").set(tiers.host_cached_blocks)
        self.tier_blocks.labels("disk").set(tiers.disk_cached_blocks)
        counts = tiers.counters
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
