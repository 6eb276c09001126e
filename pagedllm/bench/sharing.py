"""`pagedllm bench sharing`: KV memory saved by sharing blocks among the sequences of one request.

Kwon et al. (2023), Fig. 15: with parallel sampling (n samples of one prompt) the samples share the
prompt's blocks; with beam search the beams also share every block of output they have in common.
The paper measured 6.1-9.8% (Alpaca) and 16.2-30.5% (ShareGPT) of KV memory saved for n = 2..6, and
37.6-55.2% / 44.3-66.3% for beam width 2..6.

No model: one synthetic trace (`pagedllm.bench.trace`) is replayed through the paged allocator with
every request run as n parallel samples or as a beam search of width k. Each step the samples append
one token each (sample 0 generates the trace's output length, the others lengths drawn from the same
distribution), or the search takes one step of `pagedllm.engine.beam_search` (Hugging Face's beam
search, run to the trace's output length, no EOS): continuations fork their parent's block table,
pruned beams free theirs. Prompts are admitted on arrival and the pool is large enough that nothing
is ever preempted. Each step counts the KV blocks in use (shared blocks once) and the blocks the same
sequences would hold if each owned a copy of all its tokens; saving = 1 - (sum over steps of blocks in
use) / (sum over steps of blocks without sharing). Prefix caching is off: only sharing within a request
counts.

Beam search needs next-token log-probabilities: `SyntheticLM` draws them with the shape SmolLM2-135M-
Instruct showed on greedy chat answers (12 prompts, 1,389 tokens): the top token's probability has mean
0.63 and standard deviation 0.29 (a Beta(1.1, 0.64) draw here); the rest of the mass falls off with rank
as rank ** -1.45 over 50 more tokens (0.39, 0.14, 0.08, 0.05 of it for the next four, as measured).

`--model NAME` also runs a small real set through the engine (8 chat prompts, n = 4 sampling and beam
width 4, 128 tokens) and reads the same two counts from the allocator after every step.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pagedllm.bench import flags
from pagedllm.bench.table import aligned
from pagedllm.bench.trace import WORKLOADS, Request, make_trace
from pagedllm.engine.beam_search import BeamSearch
from pagedllm.kv import PagedAllocator
from pagedllm.sampling_params import BeamSearchParams

PAPER = {  # Kwon et al. (2023), memory saved, % (over widths 2..6)
    ("alpaca", "parallel"): (6.1, 9.8),
    ("sharegpt", "parallel"): (16.2, 30.5),
    ("alpaca", "beam"): (37.6, 55.2),
    ("sharegpt", "beam"): (44.3, 66.3),
}
MODES = ("parallel", "beam")
REAL_PROMPTS = [
    "Write a short story about a cat.",
    "Explain photosynthesis.",
    "Give me three tips for learning Python.",
    "How do airplanes fly?",
    "Summarize the plot of Romeo and Juliet.",
    "Why is the sky blue?",
    "Write an email asking for a day off.",
    "What are the benefits of exercise?",
]


@dataclass
class Row:
    workload: str  # a trace name, or the model's for the real run
    mode: str  # "parallel" (n samples) or "beam" (beam width)
    width: int
    blocks_shared: float  # mean KV blocks in use over the steps
    blocks_unshared: float  # mean KV blocks with each sequence holding its own copy
    steps: int

    @property
    def saving(self) -> float:
        return 1 - self.blocks_shared / self.blocks_unshared


class SyntheticLM:
    """Next-token log-probabilities drawn with the shape of SmolLM2-135M-Instruct's (see the module doc)."""

    TOP1_BETA = (1.1, 0.64)
    TAIL_EXPONENT = 1.45
    TAIL_TOKENS = 50

    def __init__(self, rng: random.Random):
        self.rng = rng
        weights = [r**-self.TAIL_EXPONENT for r in range(1, self.TAIL_TOKENS + 1)]
        self.tail = [w / sum(weights) for w in weights]

    def top(self, num: int) -> tuple[list[float], list[int]]:
        """The `num` most likely next tokens (ids 0..50) and their log-probabilities, best first."""
        top1 = min(max(self.rng.betavariate(*self.TOP1_BETA), 1e-9), 1 - 1e-9)
        probs = [top1] + [(1 - top1) * w for w in self.tail]
        ranked = sorted(range(len(probs)), key=lambda t: -probs[t])[:num]
        return [math.log(probs[t]) for t in ranked], ranked


@dataclass
class _Live:
    """A request being replayed: its sequences in the allocator and how many tokens each still adds."""

    request: Request
    seqs: list[str]
    remaining: list[int] = field(default_factory=list)  # parallel sampling: per sequence
    search: BeamSearch | None = None
    outputs: list[list[int]] = field(default_factory=list)  # beam search: per beam
    cum_logprobs: list[float] = field(default_factory=list)
    forks: int = 0


class _Replay:
    """One trace through the paged allocator, every request as `width` samples or beams."""

    def __init__(self, mode: str, width: int, block_size: int, seed: int):
        self.mode, self.width, self.block_size = mode, width, block_size
        self.lm = SyntheticLM(random.Random(seed))
        self.kv: PagedAllocator | None = None

    def admit(self, request: Request, output_lens: list[int]) -> _Live:
        seq_id = f"{request.req_id}.0"
        self.kv.allocate(seq_id, [1] * request.prompt_len, max(output_lens))
        live = _Live(request, [seq_id])
        if self.mode == "parallel":
            for i in range(1, self.width):
                live.seqs.append(f"{request.req_id}.{i}")
                self.kv.fork(seq_id, live.seqs[-1])
            live.remaining = list(output_lens)
        else:
            params = BeamSearchParams(self.width, request.output_len, ignore_eos=True)
            live.search = BeamSearch(params, (), request.output_len)
            live.outputs, live.cum_logprobs = [[]], [0.0]
        return live

    def advance(self, live: _Live) -> None:
        """One token for every unfinished sample of the request, or one step of its beam search."""
        if self.mode == "parallel":
            for i, seq_id in enumerate(live.seqs):
                if live.remaining[i]:
                    self.kv.append(seq_id, 0)
                    live.remaining[i] -= 1
            return
        tops = [self.lm.top(live.search.num_candidates) for _ in live.seqs]
        chosen = live.search.step(list(zip(live.outputs, live.cum_logprobs, strict=True)), tops)
        seqs, kept = [], set()
        for c in chosen:  # fork every extra continuation of a parent before any parent appends
            if c.parent in kept:
                live.forks += 1
                seqs.append(f"{live.request.req_id}.b{live.forks}")
                self.kv.fork(live.seqs[c.parent], seqs[-1])
            else:
                kept.add(c.parent)
                seqs.append(live.seqs[c.parent])
        for i, seq_id in enumerate(live.seqs):
            if i not in kept:
                self.kv.free(seq_id)  # pruned: its blocks return at once
        for seq_id, c in zip(seqs, chosen, strict=True):
            self.kv.append(seq_id, c.token_id)
        live.outputs = [live.outputs[c.parent] + [c.token_id] for c in chosen]
        live.cum_logprobs = [c.cum_logprob for c in chosen]
        live.seqs = seqs

    def done(self, live: _Live) -> bool:
        return live.search.done if live.search is not None else not any(live.remaining)

    def run(self, trace: list[Request], output_lens: list[list[int]]) -> tuple[float, float, int]:
        """Replay to the end; returns (mean blocks in use, mean blocks without sharing, steps)."""
        bs = self.block_size
        bound = sum(
            -(-(r.prompt_len + n) // bs) + 1 for r, lens in zip(trace, output_lens, strict=True) for n in lens
        )
        self.kv = PagedAllocator(bound, bs, enable_prefix_caching=False, num_host_blocks=0)
        pending, active = deque(zip(trace, output_lens, strict=True)), []
        used = unshared = step = 0
        while pending or active:
            while pending and pending[0][0].arrival_step <= step:
                active.append(self.admit(*pending.popleft()))
            for live in active:
                self.advance(live)
            used += self.kv.num_total_blocks - self.kv.num_free_blocks
            unshared += sum(-(-self.kv.num_tokens(s) // bs) for live in active for s in live.seqs)
            for live in [live for live in active if self.done(live)]:
                for seq_id in live.seqs:
                    self.kv.free(seq_id)
                active.remove(live)
            step += 1
        assert self.kv.all_free(), "KV blocks leaked"
        return used / step, unshared / step, step


def replay(trace: list[Request], workload: str, mode: str, width: int, args: argparse.Namespace) -> Row:
    """Every request of the trace as `width` parallel samples or beams; one row."""
    w = WORKLOADS[workload]
    mu = math.log(w.output_mean) - w.output_sigma**2 / 2

    def lengths(request: Request) -> list[int]:
        """Sample 0 has the trace's length; sample i > 0 its own draw, the same at every width."""
        if mode == "beam":
            return [request.output_len] * width
        draws = [
            random.Random(f"{args.seed}-{request.req_id}-{i}").lognormvariate(mu, w.output_sigma)
            for i in range(1, width)
        ]
        return [request.output_len] + [
            min(max(1, round(n)), args.max_model_len - request.prompt_len) for n in draws
        ]

    output_lens = [lengths(r) for r in trace]
    shared, unshared, steps = _Replay(mode, width, args.block_size, args.seed).run(trace, output_lens)
    return Row(workload, mode, width, shared, unshared, steps)


def run_real(args: argparse.Namespace) -> list[Row]:
    """The engine on a real model: n = 4 sampling and beam width 4 over a few chat prompts, the two
    block counts read from the engine's KV snapshot after every step."""
    from pagedllm import LLM, BeamSearchParams, SamplingParams

    llm = LLM(args.model, kv_cache_memory="512MiB", max_model_len=1024, enable_prefix_caching=False)
    engine = llm.engine
    tok = llm.get_tokenizer()
    chats = [[{"role": "user", "content": q}] for q in REAL_PROMPTS]
    prompts = [
        list(tok.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=False))
        for c in chats
    ]
    settings = [
        ("parallel", SamplingParams(n=4, max_tokens=args.real_tokens, temperature=1.0, seed=args.seed)),
        ("beam", BeamSearchParams(4, args.real_tokens)),
    ]
    rows = []
    for mode, params in settings:
        for i, prompt in enumerate(prompts):
            engine.add_request(f"{mode}-{i}", prompt, params)
        used = unshared = steps = 0
        while engine.has_unfinished_requests():
            engine.step()
            snapshot = engine.kv_snapshot()
            used += sum(ref > 0 for ref in snapshot["blocks"]["ref"])
            tokens = [seq["tokens"] for seq in snapshot["seqs"] if seq["status"] == "running"]
            unshared += sum(-(-n // snapshot["block_size"]) for n in tokens)
            steps += 1
        assert engine.stats().kv_all_free, "KV blocks leaked"
        rows.append(Row(args.model, mode, 4, used / steps, unshared / steps, steps))
    return rows


def run(args: argparse.Namespace) -> tuple[dict, list[Row]]:
    rows = []
    for workload in args.workloads:
        trace = make_trace(WORKLOADS[workload], args.num_requests, args.rate, args.seed, args.max_model_len)
        rows += [replay(trace, workload, mode, width, args) for mode in MODES for width in args.widths]
    if args.model:
        rows += run_real(args)
    info = {k: getattr(args, k) for k in ("num_requests", "rate", "block_size", "max_model_len", "seed")}
    return info, rows


def format_table(info: dict, rows: list[Row]) -> str:
    lines = [
        f"pagedllm bench sharing: {info['num_requests']} requests per trace, rate {info['rate']}/step, "
        f"block size {info['block_size']}, max_model_len {info['max_model_len']}, seed {info['seed']}",
        "blocks: mean KV blocks in use over the steps, shared / if every sequence held its own copy",
    ]
    table = [["trace", "mode", "width", "blocks shared", "blocks unshared", "saved", "paper"]]
    for r in rows:
        paper = PAPER.get((r.workload, r.mode))
        table.append(
            [
                r.workload,
                "parallel sampling" if r.mode == "parallel" else "beam search",
                str(r.width),
                f"{r.blocks_shared:,.1f}",
                f"{r.blocks_unshared:,.1f}",
                f"{100 * r.saving:.1f}%",
                f"{paper[0]}-{paper[1]}%" if paper else "-",
            ]
        )
    lines += aligned(table)
    return "\n".join(lines)


def plot(rows: list[Row], path: Path) -> None:
    """Saved share per width, one panel per mode, one bar per trace; the paper's range shaded."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4))
    for ax, mode in zip(fig.subplots(1, 2), MODES, strict=True):
        mine = [r for r in rows if r.mode == mode]
        names = list(dict.fromkeys(r.workload for r in mine))
        widths = sorted({r.width for r in mine})
        bar = 0.8 / len(names)
        for j, name in enumerate(names):
            xs = [
                widths.index(r.width) + (j - (len(names) - 1) / 2) * bar for r in mine if r.workload == name
            ]
            ys = [100 * r.saving for r in mine if r.workload == name]
            ax.bar(xs, ys, bar, label=name)
            if (name, mode) in PAPER:
                lo, hi = PAPER[(name, mode)]
                ax.axhspan(lo, hi, alpha=0.12, color=f"C{j}", label=f"paper, {name}")
        ax.set_xticks(range(len(widths)), [str(w) for w in widths])
        ax.set_xlabel("n (parallel samples)" if mode == "parallel" else "beam width")
        ax.set_ylabel("KV memory saved by sharing, %")
        ax.set_title("Parallel sampling" if mode == "parallel" else "Beam search")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedllm bench sharing", description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", choices=sorted(WORKLOADS), default=["sharegpt", "alpaca"])
    parser.add_argument("--widths", nargs="+", type=int, default=[2, 4, 6], help="n and beam widths")
    parser.add_argument("--num-requests", type=int, default=200)
    parser.add_argument("--rate", type=float, default=1.0, help="Poisson arrivals per step")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=2048)
    flags.add_seed(parser, help="seed of the trace")
    flags.add_model(
        parser, default="", help="also run the engine on this model (n = 4, beam width 4; default: none)"
    )
    parser.add_argument("--real-tokens", type=int, default=128, help="max tokens per answer in the real run")
    parser.add_argument("--plot", type=Path, metavar="FILE.png", help="draw the saved share per width")
    flags.add_json(parser, help="print JSON {config, rows} instead of a table")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if any(w < 1 for w in args.widths) or args.num_requests < 1:
        parser.exit(2, "pagedllm bench sharing: error: --widths and --num-requests must be >= 1\n")
    info, rows = run(args)
    if args.json:
        print(
            json.dumps({"config": info, "rows": [asdict(r) | {"saving": r.saving} for r in rows]}, indent=2)
        )
    else:
        print(format_table(info, rows))
    if args.plot:
        plot([r for r in rows if r.workload in WORKLOADS], args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
