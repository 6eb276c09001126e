"""A real engine run recorded step by step for `pagedllm viz`: the workload, and after every step the
engine's stats, its KV snapshot (the dashboard's) and each KV slot's state read from that snapshot."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from pagedllm.kv import KVUsage

NUM_SAMPLES = 3  # of the first request


@dataclass
class Arrival:
    request_id: str
    step: int  # the request is added before this engine step (1 = the first step)
    prompt: list[int]
    max_tokens: int
    n: int = 1

    def params(self):
        """Greedy, or seeded sampling for several samples: either way the same tokens every run."""
        from pagedllm import SamplingParams

        sampled = self.n > 1
        seed = int(self.request_id[1:])
        return SamplingParams(
            n=self.n,
            max_tokens=self.max_tokens,
            ignore_eos=True,
            temperature=1.0 if sampled else 0.0,
            seed=seed,
        )


@dataclass
class StepRecord:
    """One layout after one engine step."""

    step: int
    usage: KVUsage
    running: int
    waiting: int  # waiting + swapped
    states: list[str]  # slot states in address order ("external": a free slot in a too-small gap)
    snapshot: dict  # engine.kv_snapshot()


@dataclass
class Run:
    label: str
    steps: list[StepRecord] = field(default_factory=list)

    def at(self, step: int) -> StepRecord:
        if not 1 <= step <= len(self.steps):
            raise ValueError(f"--step {step} is outside the {self.label} run (steps 1..{len(self.steps)})")
        return self.steps[step - 1]


def make_workload(
    num_requests: int, output_len: tuple[int, int], vocab: int, max_model_len: int, seed: int
) -> list[Arrival]:
    """Random-token prompts; even requests start with one shared 48-token system prompt; the first one
    asks for NUM_SAMPLES samples and arrives alone (so a contiguous fork finds room for its slabs); the
    others arrive one every three steps."""
    rng = random.Random(seed)
    system = [rng.randrange(vocab) for _ in range(48)]
    arrivals = []
    for i in range(num_requests):
        own = [rng.randrange(vocab) for _ in range(rng.randint(8, 56))]
        prompt = system + own if i % 2 == 0 else own
        max_tokens = min(rng.randint(*output_len), max_model_len - len(prompt))
        if max_tokens < 1:
            raise ValueError(
                f"--max-model-len {max_model_len} leaves no room after a {len(prompt)}-token prompt"
            )
        step = 1 if i == 0 else 2 + 3 * (i - 1)
        arrivals.append(Arrival(f"r{i}", step, prompt, max_tokens, NUM_SAMPLES if i == 0 else 1))
    return arrivals


def add_due(engine, pending: list[Arrival]) -> None:
    """Add (and drop from `pending`) the requests due before the engine's next step."""
    next_step = engine.stats().num_steps + 1
    while pending and pending[0].step <= next_step:
        arrival = pending.pop(0)
        engine.add_request(arrival.request_id, arrival.prompt, arrival.params())


def make_engine(args, kv_layout: str):
    """A fresh engine with the run's KV memory; prefix caching on for the paged layout."""
    from pagedllm import LLM

    return LLM(
        args.model,
        num_kv_blocks=args.num_blocks,
        block_size=args.block_size,
        max_model_len=args.max_model_len,
        kv_layout=kv_layout,
        contiguous_reserve=args.reserve,
        enable_prefix_caching=kv_layout == "paged",
    ).engine


def record(args, kv_layout: str, arrivals: list[Arrival]) -> Run:
    """Run the requests through a fresh engine, recording every step."""
    engine = make_engine(args, kv_layout)
    run = Run("paged" if kv_layout == "paged" else f"contiguous ({args.reserve})")
    pending = list(arrivals)
    while pending or engine.has_unfinished_requests():
        add_due(engine, pending)
        engine.step()
        stats, snapshot = engine.stats(), engine.kv_snapshot()
        waiting = stats.num_waiting + stats.num_swapped
        states = slot_states(snapshot)
        run.steps.append(
            StepRecord(stats.num_steps, stats.kv_usage, stats.num_running, waiting, states, snapshot)
        )
    if not engine.stats().kv_all_free:
        raise RuntimeError(f"{run.label}: KV blocks leaked")
    return run


def slot_states(snapshot: dict) -> list[str]:
    """Every KV slot's state in address order (SlotState's names), read from a KV snapshot. Paged: a
    block some table holds is live up to its tokens, then tail; any other block is free. Contiguous: a
    slab is live up to its sequence's tokens, then reserved; a gap is free, or "external" when it is too
    small for the request the allocator last refused."""
    states = []
    if "blocks" in snapshot:
        block_size, blocks = snapshot["block_size"], snapshot["blocks"]
        for ref, tokens in zip(blocks["ref"], blocks["tokens"], strict=True):
            if ref:
                states += ["live"] * tokens + ["tail"] * (block_size - tokens)
            else:
                states += ["free"] * block_size
        return states
    for _start, size, tokens, seq_id, external in snapshot["runs"]:  # the address space in order
        if seq_id is None:
            states += ["external" if external else "free"] * size
        else:
            states += ["live"] * tokens + ["reserved"] * (size - tokens)
    return states


def busiest_step(run: Run) -> int:
    """The first step at which the run holds the most sequences."""
    return max(run.steps, key=lambda r: (r.running, -r.step)).step
