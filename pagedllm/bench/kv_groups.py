"""`pagedllm bench memory --hybrid`: KV memory of a model with sliding-window layers, hybrid KV groups
(each sliding layer holds only its window) against every layer's full history.

No weights are loaded: the model's config gives its layers, windows and KV geometry, and the real
allocator and scheduler run without a forward pass (every step "samples" token 7, EOS ignored).
- Bytes per request: one request of each context length, its prompt prefilled in chunks of
  max_num_batched_tokens, then one decode step; the KV bytes its blocks take while it decodes, and the
  most they took during its prefill.
- At a fixed KV budget: `--num-requests` equal requests sent at once; the most and the mean running at a
  time, the steps all took (fewer: larger batches), the preemptions, and the share of the KV slots that
  are live while a request waits (memory is the bottleneck; `bench memory`'s steps): a slot is live when it
  holds the K/V of a computed token that a later query of its layers reads, so a block's empty tail, the
  tokens of a window group's oldest block that left the window, a prompt's slots whose chunk is not
  computed yet, promised and free blocks all are not.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

from pagedllm.bench import flags
from pagedllm.bench.table import aligned
from pagedllm.engine.config import KV_CACHE_DTYPES, parse_bytes
from pagedllm.engine.kv_sizing import kv_block_bytes, model_kv_groups
from pagedllm.engine.sampler import Sample
from pagedllm.engine.scheduler import Scheduler
from pagedllm.engine.sequence import Sequence
from pagedllm.kv import PagedAllocator
from pagedllm.models import ModelConfig
from pagedllm.sampling_params import SamplingParams


@dataclass(frozen=True)
class Geometry:
    """What sizes a model's KV blocks: its config, the KV dtype, the block size and a step's tokens."""

    config: ModelConfig
    kv_dtype: torch.dtype
    block_size: int = 16
    max_num_batched_tokens: int = 2048

    def kv_pool(self, hybrid: bool, budget: int) -> PagedAllocator:
        groups = model_kv_groups(self.config, hybrid)
        return PagedAllocator(
            budget // self.block_bytes(hybrid),
            self.block_size,
            enable_prefix_caching=False,
            num_host_blocks=0,
            windows=groups.windows,
            prefill_chunk=self.block_size,  # as the engine's allocator (LLMEngine._make_allocator)
        )

    def block_bytes(self, hybrid: bool) -> int:
        layers = model_kv_groups(self.config, hybrid).layers_per_group
        cfg = self.config
        return kv_block_bytes(cfg, cfg.num_kv_heads, self.kv_dtype, self.block_size, layers)


@dataclass
class Served:
    """Equal requests sent at once to a scheduler over a fixed KV budget."""

    max_running: int
    mean_running: float
    steps: int
    preemptions: int
    live_share: float  # mean over steps with a request waiting of live slots / all slots


def _step(scheduler: Scheduler) -> None:
    """Schedule one step and hand back what its forward pass would: token 7 for each finished row."""
    out = scheduler.schedule()
    scheduler.update_from_output([(seq, Sample(7)) for _, seq in out.ready()])


def live_slots(allocator: PagedAllocator, running: list[Sequence]) -> int:
    """Slots holding the K/V of a computed token that a later query reads: in a full group every computed
    token, in a window group the last window's (the next query is at the first uncomputed position)."""
    bs, tokens, live = allocator.block_size, allocator.block_states().num_tokens, set()
    for seq in running:
        computed = seq.num_cached_tokens
        for window, table in zip(allocator.windows, allocator.block_tables(seq.seq_id), strict=True):
            first = 0 if window is None else max(0, computed + 1 - window)
            for i, block in enumerate(table):
                lo, hi = max(first, i * bs), min(computed, i * bs + tokens[block])
                if block >= 0 and lo < hi:
                    live.update(block * bs + p % bs for p in range(lo, hi))
    return len(live)


def request_bytes(geometry: Geometry, hybrid: bool, context_len: int) -> tuple[int, int]:
    """(bytes while it decodes, most bytes during its prefill) of one request of `context_len` tokens."""
    budget = 2 * -(-context_len // geometry.block_size) * geometry.block_bytes(False)  # room to spare
    allocator = geometry.kv_pool(hybrid, budget)
    scheduler = Scheduler(allocator, context_len + 3, max_num_batched_tokens=geometry.max_num_batched_tokens)
    seq = Sequence("r", "r", 0, [1] * context_len, SamplingParams(max_tokens=3, ignore_eos=True))
    scheduler.add(seq)
    peak = 0
    while seq.num_cached_tokens < context_len:  # the prefill's steps
        _step(scheduler)
        peak = max(peak, allocator.num_total_blocks - allocator.pool.num_free)
    _step(scheduler)  # one decode
    used = allocator.num_total_blocks - allocator.pool.num_free
    scheduler.finish(seq)
    assert allocator.all_free()
    block = geometry.block_bytes(hybrid)
    return used * block, peak * block


def serve_at_once(
    geometry: Geometry, hybrid: bool, budget: int, num_requests: int, prompt_len: int, output_len: int
) -> Served:
    """`num_requests` requests of `prompt_len` + `output_len` tokens sent at once, on `budget` bytes of KV."""
    allocator = geometry.kv_pool(hybrid, budget)
    max_len = prompt_len + output_len
    scheduler = Scheduler(allocator, max_len, max_num_batched_tokens=geometry.max_num_batched_tokens)
    params = SamplingParams(max_tokens=output_len, ignore_eos=True)
    for i in range(num_requests):
        scheduler.add(Sequence(str(i), str(i), 0, [1 + i] * prompt_len, params))
    running, steps, live = [], 0, []
    while scheduler.running or scheduler.waiting or scheduler.swapped:
        _step(scheduler)
        running.append(len(scheduler.running))
        steps += 1
        if scheduler.waiting:
            live.append(
                live_slots(allocator, scheduler.running) / (allocator.num_total_blocks * allocator.block_size)
            )
    assert allocator.all_free()
    return Served(
        max(running),
        sum(running) / len(running),
        steps,
        scheduler.num_preemptions,
        sum(live) / max(len(live), 1),
    )


def run(args: argparse.Namespace, config: ModelConfig) -> str:
    geometry = Geometry(
        config, KV_CACHE_DTYPES[args.kv_cache_dtype], args.block_size, args.max_num_batched_tokens
    )
    windows = sorted({w for w in model_kv_groups(config, True).windows if w is not None})
    sliding = sum(config.layer_sliding_window(i) is not None for i in range(config.num_layers))
    lines = [
        f"pagedllm bench memory --hybrid: {args.model}, {config.num_layers} layers ({sliding} sliding, "
        f"window {windows}), {args.kv_cache_dtype} KV, block {args.block_size}, prefill chunks of "
        f"{args.max_num_batched_tokens} tokens",
        "KV bytes per request (MiB): full history keeps every layer's every token; hybrid gives back what "
        "left the window",
    ]
    table = [["context", "full history", "hybrid (decoding)", "less", "hybrid peak (prefill)"]]
    for n in args.context_lens:
        full, _ = request_bytes(geometry, False, n)
        hybrid, peak = request_bytes(geometry, True, n)
        table.append(
            [
                str(n),
                f"{full / 2**20:.1f}",
                f"{hybrid / 2**20:.1f}",
                f"{full / hybrid:.2f}x",
                f"{peak / 2**20:.1f}",
            ]
        )
    lines += aligned(table)
    budget = parse_bytes(args.kv_cache_memory)
    prompt, output = args.prompt_len, args.output_len
    lines.append(
        f"{args.hybrid_requests} requests of {prompt} + {output} tokens sent at once, "
        f"{args.kv_cache_memory} of KV:"
    )
    table = [["KV cache", "max running", "mean running", "steps", "preemptions", "live KV"]]
    served = {}
    for hybrid in (False, True):
        s = served[hybrid] = serve_at_once(geometry, hybrid, budget, args.hybrid_requests, prompt, output)
        name = "hybrid" if hybrid else "full history"
        row = [
            str(s.max_running),
            f"{s.mean_running:.2f}",
            str(s.steps),
            str(s.preemptions),
            f"{s.live_share:.1%}",
        ]
        table.append([name, *row])
    lines += aligned(table)
    full, hybrid = served[False], served[True]
    lines.append(
        f"hybrid vs full history: {hybrid.max_running / full.max_running:.2f}x the most running, "
        f"{hybrid.mean_running / full.mean_running:.2f}x the mean, "
        f"{full.steps / hybrid.steps:.2f}x fewer steps"
    )
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("--hybrid (a model with sliding-window layers)")
    group.add_argument("--hybrid", action="store_true", help="hybrid KV groups vs full history instead")
    flags.add_model(group, default="gemma3-270m", help="built-in name, HF folder or .gguf (config only)")
    group.add_argument("--kv-cache-dtype", default="float32", choices=sorted(KV_CACHE_DTYPES))
    group.add_argument("--context-lens", type=int, nargs="+", default=[1024, 4096, 8192])
    group.add_argument("--max-num-batched-tokens", type=int, default=2048, help="prefill chunk")
    flags.add_kv_cache_memory(group, "256MiB", help="KV budget of the requests sent at once")
    group.add_argument("--hybrid-requests", dest="hybrid_requests", type=int, default=32)
    group.add_argument("--prompt-len", type=int, default=3840)
    group.add_argument("--output-len", type=int, default=256)
