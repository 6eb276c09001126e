"""`pagedllm viz --out DIR`: pictures of the KV cache from a real engine run, paged vs contiguous slabs.

The same requests run through the engine on a real model (the built-in SmolLM2 by default) twice,
with the paged layout (prefix caching on) and with contiguous slabs (`--reserve`), both given the same
KV memory (`--num-blocks` x `--block-size` token slots). Requests arrive a few steps apart; half of them
start with a shared system prompt, and the first one asks for n = 3 samples (forked copy-on-write).
Everything is greedy or seeded, so a run is repeatable. After every step the recorder reads
`usage()`, the queues, the slot states and a KV snapshot (the dashboard's). Three figures come out:

- kv_memory_map: the seed lesson's figure at the chosen step (`--step`; default: the step at which
  the paged run holds the most sequences), one band per layout;
- kv_usage: each layout's slots over the whole run as stacked areas (live / tail / reserved /
  external / free) with its running and waiting counts;
- block_tables: at the chosen step, the paged block tables of a few sequences (logical -> physical),
  shared blocks drawn as shared, over the physical pool.

Each figure's numbers are the recorded `usage()` of its step.
"""

from __future__ import annotations

import argparse
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path

from pagedllm.bench.throughput import parse_range
from pagedllm.kv import KVUsage
from pagedllm.viz import require_matplotlib

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
    snapshot: dict  # KVSnapshots.take()


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
    while pending and pending[0].step <= engine.num_steps + 1:
        arrival = pending.pop(0)
        engine.add_request(arrival.request_id, arrival.prompt, arrival.params())


def make_engine(args, kv_layout: str):
    """A fresh engine with the run's KV memory; prefix caching on for the paged layout."""
    from pagedllm.engine.config import EngineConfig
    from pagedllm.engine.llm_engine import LLMEngine

    return LLMEngine(
        EngineConfig(
            model=args.model,
            num_kv_blocks=args.num_blocks,
            block_size=args.block_size,
            max_model_len=args.max_model_len,
            kv_layout=kv_layout,
            contiguous_reserve=args.reserve,
            enable_prefix_caching=kv_layout == "paged",
        )
    )


def record(args, kv_layout: str, arrivals: list[Arrival]) -> Run:
    """Run the requests through a fresh engine, recording every step."""
    from pagedllm.kv import ContiguousAllocator

    engine = make_engine(args, kv_layout)
    allocator, scheduler = engine.allocator, engine.scheduler
    run = Run("paged" if kv_layout == "paged" else f"contiguous ({args.reserve})")
    pending = list(arrivals)
    while pending or engine.has_unfinished_requests():
        add_due(engine, pending)
        engine.step()
        states = [str(s) for s in allocator.slot_states()]
        if isinstance(allocator, ContiguousAllocator):
            for r in allocator.runs():
                if r.external:
                    states[r.start : r.start + r.size] = ["external"] * r.size
        waiting = len(scheduler.waiting) + len(scheduler.swapped)
        usage, snapshot = allocator.usage(), engine.kv_snapshot()
        run.steps.append(
            StepRecord(engine.num_steps, usage, len(scheduler.running), waiting, states, snapshot)
        )
    if not allocator.all_free():
        raise RuntimeError(f"{run.label}: KV blocks leaked")
    return run


def busiest_step(run: Run) -> int:
    """The first step at which the run holds the most sequences."""
    return max(run.steps, key=lambda r: (r.running, -r.step)).step


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagedllm viz", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True, help="folder for the figures (created if missing)")
    parser.add_argument("--format", default="png", choices=["png", "svg"])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--step", type=int, default=None, help="the step drawn (default: paged's busiest)")
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--output-len", default="24-160", help="LO-HI output tokens per request (uniform)")
    parser.add_argument("--num-blocks", type=int, default=64, help="KV blocks, the same for both layouts")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=256)
    parser.add_argument("--reserve", default="pow2", choices=["pow2", "max"], help="contiguous slab size")
    parser.add_argument("--seed", type=int, default=0)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    for name in ("num_requests", "num_blocks", "block_size", "max_model_len"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    try:
        lo, hi = parse_range(args.output_len)
    except ValueError:
        parser.error(f"--output-len must be LO-HI with 1 <= LO <= HI, got {args.output_len!r}")
    try:
        require_matplotlib()
        from pagedllm.viz import figures
    except ImportError as error:
        parser.exit(2, f"pagedllm viz: error: {error}\n")
    from pagedllm.engine.config import EngineConfig
    from pagedllm.engine.llm_engine import load_shared_model

    config = EngineConfig(model=args.model)
    loaded = load_shared_model(args.model, config.torch_dtype, config.device)  # held: both runs share it
    try:
        arrivals = make_workload(
            args.num_requests, (lo, hi), loaded.config.vocab_size, args.max_model_len, args.seed
        )
    except ValueError as error:
        parser.error(str(error))
    paged = record(args, "paged", arrivals)
    contiguous = record(args, "contiguous", arrivals)
    step = args.step if args.step is not None else busiest_step(paged)
    try:
        runs = [(contiguous, contiguous.at(step)), (paged, paged.at(step))]
    except ValueError as error:
        parser.error(str(error))
    args.out.mkdir(parents=True, exist_ok=True)
    paths = figures.draw_all(runs, step, args, args.out)
    for run in (contiguous, paged):
        print(figures.summary(run))
    for path in paths:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
