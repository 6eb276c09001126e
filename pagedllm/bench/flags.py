"""The flags the benchmarks share, each defined once here: the model, the weight storage, the
activations' dtype, the KV cache's memory and dtype, the seed, the thread count and JSON output. A bench
passes its own default or help where its workload needs another; the names and meanings stay the same.
This module loads neither torch nor the engine until a flag needs them (`bench serve`'s load generator
stays light)."""

from __future__ import annotations

import argparse
import json

QUANTIZATIONS = ["auto", "none", "int8", "int4", "gguf"]
_MANY = " (several values: one run each)"
_QUANTIZATION_HELP = (
    "weight storage: auto keeps a GGUF file's own blocks, none loads the float weights, int8 / int4 "
    "quantize at load"
)


def add_model(parser, default: str | None = None, help: str = "built-in name, HF folder or .gguf file"):
    """--model, by default pagedllm's DEFAULT_MODEL."""
    if default is None:
        from pagedllm.models.loader import DEFAULT_MODEL

        default = DEFAULT_MODEL
    parser.add_argument("--model", default=default, help=help)


def add_quantization(parser, default: str | list[str] = "auto", many: bool = False, help: str | None = None):
    parser.add_argument(
        "--quantization",
        nargs="+" if many else None,
        default=default,
        choices=QUANTIZATIONS,
        help=(help or _QUANTIZATION_HELP) + (_MANY if many else ""),
    )


def add_dtype(parser, help: str = "the activations' and float weights' dtype (auto: float32 on the CPU)"):
    parser.add_argument("--dtype", default="auto", help=help)


def add_kv_cache_memory(parser, default: str, help: str = "the KV cache's size, e.g. 512MiB"):
    parser.add_argument("--kv-cache-memory", default=default, help=help)


def add_kv_cache_dtype(
    parser, default: str | list[str] = "auto", many: bool = False, help: str | None = None
):
    from pagedllm.engine.config import KV_CACHE_DTYPES

    parser.add_argument(
        "--kv-cache-dtype",
        nargs="+" if many else None,
        default=default,
        choices=["auto", *KV_CACHE_DTYPES],
        help=(help or "K/V storage (auto: the engine's, float16 under float32 activations on the CPU)")
        + (_MANY if many else ""),
    )


def add_seed(parser, help: str = "seed of the random prompts"):
    parser.add_argument("--seed", type=int, default=0, help=help)


def add_threads(parser, help: str = "torch threads (default: torch's)"):
    parser.add_argument("--threads", type=int, default=None, help=help)


def add_json(parser, help: str = "print JSON instead of a table"):
    parser.add_argument("--json", action="store_true", help=help)


def apply_threads(args: argparse.Namespace) -> None:
    """--threads, if given, before anything runs."""
    if args.threads is not None:
        if args.threads < 1:
            raise SystemExit(f"--threads must be at least 1, got {args.threads}")
        import torch

        torch.set_num_threads(args.threads)


def json_object(flag: str, text: str | None) -> dict | None:
    """A JSON object typed on the command line (None: not given); a ValueError naming the flag. (The
    `pagedllm generate` / `serve` commands parse --speculative-config with it too.)"""
    if text is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"{flag} is not JSON ({error}): {text!r}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{flag} must be a JSON object, got {text!r}")
    return value
