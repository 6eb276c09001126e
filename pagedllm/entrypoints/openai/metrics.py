"""Prometheus metrics of one engine (vLLM's metric names, `pagedllm:` prefix), in a registry of its own."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.outputs import RequestOutput


class EngineMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        reg = self.registry
        self.running = Gauge("pagedllm:num_requests_running", "Sequences running", registry=reg)
        self.waiting = Gauge("pagedllm:num_requests_waiting", "Sequences waiting", registry=reg)
        self.kv_usage = Gauge("pagedllm:kv_cache_usage_perc", "KV cache usage (1 = full)", registry=reg)
        self.prompt_tokens = Counter("pagedllm:prompt_tokens", "Prompt tokens", registry=reg)
        self.generation_tokens = Counter("pagedllm:generation_tokens", "Generated tokens", registry=reg)
        self.preemptions = Counter("pagedllm:num_preemptions", "Preemptions", registry=reg)
        self.prefix_queries = Counter(
            "pagedllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache", registry=reg
        )
        self.prefix_hits = Counter(
            "pagedllm:prefix_cache_hits", "Prompt tokens found in the prefix cache", registry=reg
        )
        self._seen = {"num_preemptions": 0, "prefix_cache_queries": 0, "prefix_cache_hits": 0}

    def observe(self, engine: LLMEngine) -> None:
        """Read the scheduler's queues and counters and the KV pool (engine thread only)."""
        scheduler = engine.scheduler
        self.running.set(len(scheduler.running))
        self.waiting.set(len(scheduler.waiting) + len(scheduler.swapped))
        usage = engine.allocator.usage()
        self.kv_usage.set(1.0 - usage.fraction(usage.free_slots))
        for name, counter in (
            ("num_preemptions", self.preemptions),
            ("prefix_cache_queries", self.prefix_queries),
            ("prefix_cache_hits", self.prefix_hits),
        ):
            total = getattr(scheduler, name)
            counter.inc(total - self._seen[name])
            self._seen[name] = total

    @staticmethod
    def num_generated(output: RequestOutput) -> int:
        return sum(len(o.token_ids) for o in output.outputs)

    def render(self) -> bytes:
        return generate_latest(self.registry)
