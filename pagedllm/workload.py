"""Synthetic prompts (random token ids of given or drawn lengths, seeded), the `LO-HI` length ranges the
commands take, and how far two systems' greedy outputs on them agree: shared by bench/ and viz/, which
both import this neutral module rather than each other."""

from __future__ import annotations

import random
from collections.abc import Sequence


def parse_range(text: str) -> tuple[int, int]:
    """'LO-HI' -> (LO, HI) with 1 <= LO <= HI; ValueError otherwise."""
    lo, hi = (int(x) for x in text.split("-"))
    if not 1 <= lo <= hi:
        raise ValueError(text)
    return lo, hi


def make_prompts(
    lengths: Sequence[int | tuple[int, int]],
    vocab: int,
    seed: int,
    shared_prefix_len: int = 0,
    num_prefixes: int = 1,
) -> list[list[int]]:
    """One prompt of random token ids in [0, vocab) per entry of `lengths`: that many tokens, or for a
    (LO, HI) pair a length drawn uniformly from LO..HI; every prompt starts with `shared_prefix_len`
    random tokens (a system prompt), one of `num_prefixes` such prefixes drawn at random for each prompt
    (tenants, each with its own system prompt). The same arguments give the same prompts."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(vocab) for _ in range(shared_prefix_len)] for _ in range(num_prefixes)]
    prompts = []
    for length in lengths:
        prefix = prefixes[rng.randrange(num_prefixes)] if num_prefixes > 1 else prefixes[0]
        n = rng.randint(*length) if isinstance(length, tuple) else length
        prompts.append(prefix + [rng.randrange(vocab) for _ in range(n)])
    return prompts


def first_difference(a: list[int], b: list[int]) -> int:
    """The number of tokens two outputs share before they part (the shorter's length if they never do)."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
