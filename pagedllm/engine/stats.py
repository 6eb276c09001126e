"""What the engine shows its callers between steps: queue and counter readings, and a trace of each step.

These are the engine's public face for the server's metrics, the dashboard, the benchmarks and the
pictures: none of them reaches into the scheduler, the allocator or the runner.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pagedllm.kv import KVUsage
from pagedllm.kv.tiers import TierUsage

STEP_PHASES = ("schedule", "inputs", "forward", "sample", "rest", "propose")


@dataclass(frozen=True)
class EngineStats:
    """The engine between two steps: its queues, its counters since start, and its KV memory."""

    num_steps: int
    num_running: int
    num_waiting: int
    num_swapped: int
    num_preemptions: int
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache at first admission
    prefix_cache_hits: int  # of those, tokens the cache held
    num_blocks_swapped_out: int  # device -> host block copies
    num_blocks_swapped_in: int  # host -> device
    kv_usage: KVUsage
    kv_all_free: bool  # every KV block is back in the free pool (nothing is resident)
    # Speculative decoding: verify passes (a sequence's step with drafts), draft tokens they checked, and
    # how many of those the target model accepted.
    spec_verifies: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    kv_tiers: TierUsage | None = None  # the prefix cache's host and disk tiers (None: off)
    lora_bytes: dict[str, int] | None = None  # the LoRA adapters in memory by name, their bytes (enable_lora)

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    @property
    def spec_acceptance_rate(self) -> float:
        return self.spec_accepted_tokens / self.spec_draft_tokens if self.spec_draft_tokens else 0.0

    @property
    def spec_mean_accepted_length(self) -> float:
        """Tokens a verify pass yields on average: its accepted drafts and the target's own next token."""
        return 1 + self.spec_accepted_tokens / self.spec_verifies if self.spec_verifies else 0.0


@dataclass(frozen=True)
class StepTrace:
    """One step as its observers see it: wall seconds of each phase (STEP_PHASES; `rest` is block
    tables, token appends, detokenizing and outputs; `propose` speculative decoding's draft tokens) and
    what the step computed."""

    step: int
    seconds: dict[str, float]
    prefill_tokens: int  # prompt tokens computed (chunks of prefills in progress included)
    decode_seqs: int  # sequences that computed one token
    context_tokens: int  # K/V tokens attention read in each layer: every scheduled sequence's context

    @property
    def host_seconds(self) -> float:
        """Everything but the model's forward pass."""
        return sum(s for phase, s in self.seconds.items() if phase != "forward")


StepObserver = Callable[[StepTrace], None]
