"""`pagedllm viz --out DIR`: pictures of the KV cache from a real engine run, paged vs contiguous slabs.

The same requests run through the engine on a real model (the built-in SmolLM2 by default) twice,
with the paged layout (prefix caching on) and with contiguous slabs (`--reserve`), both given the same
KV memory (`--num-blocks` x `--block-size` token slots). Requests arrive a few steps apart; half of them
start with a shared system prompt, and the first one asks for n = 3 samples (forked copy-on-write).
Everything is greedy or seeded, so a run is repeatable. After every step the recorder
(pagedllm.viz.recording) reads the engine's stats (KV usage, queues) and its KV snapshot (the
dashboard's), and from the snapshot every slot's state. Three figures come out:

- kv_memory_map: the seed lesson's figure at the chosen step (`--step`; default: the step at which
  the paged run holds the most sequences), one band per layout;
- kv_usage: each layout's slots over the whole run as stacked areas (live / tail / reserved /
  external / free) with its running and waiting counts;
- block_tables: at the chosen step, the paged block tables of a few sequences (logical -> physical),
  shared blocks drawn as shared, over the physical pool.

Each figure's numbers are the KV usage recorded at its step.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pagedllm.models.loader import DEFAULT_MODEL
from pagedllm.viz import require_matplotlib
from pagedllm.viz.recording import busiest_step, make_workload, record
from pagedllm.workload import parse_range


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagedllm viz", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True, help="folder for the figures (created if missing)")
    parser.add_argument("--format", default="png", choices=["png", "svg"])
    parser.add_argument("--model", default=DEFAULT_MODEL, help="built-in name, HF folder or .gguf file")
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
    from pagedllm.engine.model_cache import load_shared_model

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
