"""`pagedllm bench quality`: what each weight storage and KV cache dtype costs in quality, against the first.

Per configuration (`--configs`: dequantized-f32, dequantized-bf16, int8, int4, gguf) and KV cache dtype
(`--kv-cache-dtype`: auto, float32, bfloat16, int8, fp8; each config runs with each): weight memory, the KV
cache's bytes per token (every layer's K and V, a quantized cache's scales included); perplexity on a fixed
text (`--text`, default the Apache License 2.0 that ships in pagedllm/bench/data: 2,224 SmolLM2 tokens), all
of it in one prefill through the paged cache, on the GGUF path the engine's prefill takes
(`PAGEDLLM_GGUF_PATHS=invariant`: the integer path one user's decode takes, x rounded as
`PAGEDLLM_GGUF_ACTIVATIONS` says); the mean KL divergence of each position's next-token distribution from the
first configuration's on the same text (llama-perplexity's `--kl-divergence`); and greedy agreement with the
first configuration on the prompts the Hugging Face equivalence tests use (EQUIVALENCE_PROMPTS, `--max-tokens`
greedy tokens each): `same` = prompts whose tokens all equal the first run's, `prefix` = the mean number of
leading tokens equal to its. `--llama-cpp` adds llama.cpp on the same GGUF file and token ids, in its own
process (llama-cpp-python, bench/llama_cpp.py): its perplexity and its own KL divergence, the file's blocks
against an F32 copy of them (made once by llama_model_quantize), beside pagedllm's. `--configs gguf
--kv-cache-dtype float32 int8 fp8`: what a quantized KV cache costs the shipped model. dequantized-f32 / -bf16
are the model file's weights loaded unquantized in that dtype: for a GGUF file (every built-in model) its 4-
or 8-bit blocks dequantized, not an original float checkpoint. Each row is followed by what ran (attention
backend, CPU build, linear method per weight type, threads). Deterministic for a given CPU build (sums may
round differently between the AVX2 and AVX-512 kernels).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from pagedllm.bench import flags
from pagedllm.workload import first_difference

TEXT = Path(__file__).with_name("data") / "apache-2.0.txt"
# The prompts of tests/test_models_smollm2.py (greedy output there equals Hugging Face's).
EQUIVALENCE_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
    "1, 2, 3, 4, 5,",
    "Water boils at",
    "The three primary colors are",
    "Q: What is the largest planet in the solar system?\nA:",
    "Paged attention stores the key-value cache in fixed-size blocks, so that memory is allocated on "
    "demand and shared between sequences. The main benefit of this design is",
]
# name -> (dtype, quantization); None: the file's weights unquantized in dtype (a GGUF's blocks dequantized)
CONFIGS = {
    "dequantized-f32": ("float32", None),
    "dequantized-bf16": ("bfloat16", None),
    "int8": ("float32", "int8"),
    "int4": ("float32", "int4"),
    "gguf": ("float32", "gguf"),
}


@dataclass
class Quality:
    config: str
    kv_cache_dtype: str
    linear_method: str
    weight_mib: float
    kv_bytes_per_token: int  # every layer's K and V (a quantized cache's scales too)
    perplexity: float
    kl_divergence: float  # mean over the text's positions of KL(first config || this one)
    greedy_same: int  # prompts whose greedy tokens all equal the first config's
    greedy_prefix: float  # mean leading tokens equal to the first config's
    tokens: list[list[int]]
    ran: str = ""  # RunInfo.describe(): attention backend, CPU build, linear method per weight type, threads


def log_probs(
    model: torch.nn.Module, ids: list[int], dtype: torch.dtype, engine_caches: list, chunk: int = 256
) -> torch.Tensor:
    """[len(ids) - 1, vocab] float32 log-probabilities of each next token, in one prefill of all of `ids`
    (one sequence, blocks in order) on the GGUF path the engine's prefill takes (bf16_gate), logits
    computed `chunk` rows at a time. A quantized cache takes the key smoothing the engine calibrated for
    its own (`engine_caches`)."""
    from pagedllm import ops
    from pagedllm.models.attention import AttentionMetadata
    from pagedllm.models.quantization import bf16_gate, takes_bf16
    from pagedllm.ops.kv_cache import is_quantized, key_smoothing

    cfg, block = model.config, 16
    blocks = -(-len(ids) // block)
    caches = ops.allocate_kv_caches(
        cfg.num_layers, blocks, block, cfg.num_kv_heads, cfg.head_dim, dtype, "cpu"
    )
    if is_quantized(dtype):
        for (k_cache, _), (calibrated, _) in zip(caches, engine_caches, strict=True):
            for mine, theirs in zip(key_smoothing(k_cache), key_smoothing(calibrated), strict=True):
                mine.copy_(theirs)
    count = len(ids)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(count)[None],  # one KV group
        block_tables=torch.arange(blocks, dtype=torch.int32)[None, None],
        context_lens=torch.tensor([count], dtype=torch.int32),
        query_start_loc=torch.tensor([0, count], dtype=torch.int32),
        max_query_len=count,
        kv_caches=caches,
    )
    with torch.inference_mode(), bf16_gate(takes_bf16(True, count)):
        hidden = model(torch.tensor(ids), torch.arange(count), meta)
        parts = [
            torch.log_softmax(
                model.compute_logits(hidden[start : min(start + chunk, count - 1)]).float(), dim=-1
            )
            for start in range(0, count - 1, chunk)
        ]
    return torch.cat(parts)


def perplexity(logp: torch.Tensor, ids: list[int]) -> float:
    """exp(mean negative log-likelihood of ids[1:]) under log_probs' rows."""
    picked = logp.gather(1, torch.tensor(ids[1:])[:, None])
    return math.exp(-picked.double().mean().item())


def mean_kl(reference: torch.Tensor, logp: torch.Tensor, chunk: int = 256) -> float:
    """Mean over positions of KL(reference || logp), both rows of log-probabilities."""
    total = 0.0
    for start in range(0, len(logp), chunk):
        ref, mine = reference[start : start + chunk].double(), logp[start : start + chunk].double()
        total += (ref.exp() * (ref - mine)).sum().item()
    return total / len(logp)


def evaluate(
    model: str, name: str, kv_cache_dtype: str, text_ids: list[int], prompts: list[str], max_tokens: int
) -> tuple[Quality, torch.Tensor]:
    """One configuration: perplexity of text_ids, greedy tokens of each prompt (agreement and KL divergence
    filled in later), and its log-probabilities on text_ids."""
    from pagedllm import LLM, SamplingParams

    dtype, quantization = CONFIGS[name]
    llm = LLM(
        model,
        dtype=dtype,
        quantization=quantization,
        kv_cache_dtype=kv_cache_dtype,
        kv_cache_memory="64MiB",
        max_model_len=512,
    )
    engine = llm.engine
    outputs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    assert engine.stats().kv_all_free, "KV blocks leaked"
    logp = log_probs(engine.model, text_ids, engine.config.kv_torch_dtype, engine.layer_kv_caches())
    info = engine.run_info()
    tokens = [o.outputs[0].token_ids for o in outputs]
    weight_mib = info.weight_bytes / 2**20
    return Quality(
        name,
        info.kv_dtype if kv_cache_dtype == "auto" else kv_cache_dtype,  # auto named as resolved
        info.linear_method,
        weight_mib,
        info.kv_token_bytes,
        perplexity(logp, text_ids),
        0.0,
        0,
        0.0,
        tokens,
        info.describe(),
    ), logp


@dataclass
class PeerQuality:
    system: str
    perplexity: float
    kl_divergence: float  # from the peer's own F32 run of the same weights
    kl_from_first: float  # from pagedllm's first config: how far the two engines' float runs are apart
    ran: str


def llama_cpp_quality(gguf: Path, ids: list[int], reference: torch.Tensor) -> list[PeerQuality]:
    """llama-cpp-python on an F32 copy of `gguf` and on the file itself, each scoring ids in one
    evaluation."""
    import tempfile

    import numpy as np

    from pagedllm.bench import llama_cpp

    rows, own = [], None
    with tempfile.TemporaryDirectory(prefix="pagedllm-quality-") as folder:
        for kind in ("F32", "file"):
            output = Path(folder) / f"{kind}.npy"
            env = llama_cpp.log_probs(
                llama_cpp.file_in_type(gguf, kind), ids, torch.get_num_threads(), output
            )
            logp = torch.from_numpy(np.load(output))
            own = logp if own is None else own
            name = "F32" if kind == "F32" else llama_cpp.main_type(gguf)
            ran = f"{torch.get_num_threads()} threads, logits_all; {env.describe()}"
            rows.append(
                PeerQuality(
                    f"{llama_cpp.LLAMA_CPP_PYTHON} {name}",
                    perplexity(logp, ids),
                    mean_kl(own, logp),
                    mean_kl(reference, logp),
                    ran,
                )
            )
    return rows


def compare(results: list[Quality]) -> None:
    """Fill in each result's greedy agreement with the first one."""
    reference = results[0].tokens
    for r in results:
        pairs = list(zip(r.tokens, reference, strict=True))
        r.greedy_same = sum(a == b for a, b in pairs)
        r.greedy_prefix = sum(first_difference(a, b) for a, b in pairs) / len(pairs)


def run(
    model: str,
    configs: list[str],
    text: str,
    max_text_tokens: int | None,
    max_tokens: int,
    kv_cache_dtypes: Sequence[str] = ("auto",),
    llama_cpp: Path | None = None,
) -> tuple[list[Quality], list[PeerQuality]]:
    """Every (config, KV cache dtype) pair, config-major; agreement and KL divergence are from the first.
    With `llama_cpp` (a GGUF file), llama.cpp's rows on the same token ids too."""
    from pagedllm.models.loader import read_config, resolve_checkpoint
    from pagedllm.models.tokenizer import load_tokenizer

    folder = resolve_checkpoint(model)
    ids = load_tokenizer(folder).encode(text)[:max_text_tokens]
    limit = read_config(folder).max_position_embeddings
    if len(ids) > limit:
        raise ValueError(
            f"the text has {len(ids)} tokens, more than the model's {limit}: pass --max-text-tokens"
        )
    results, reference = [], None
    for name in configs:
        for kv in kv_cache_dtypes:
            result, logp = evaluate(model, name, kv, ids, EQUIVALENCE_PROMPTS, max_tokens)
            reference = logp if reference is None else reference  # the first's, kept for the rest
            result.kl_divergence = mean_kl(reference, logp)
            results.append(result)
            del logp
            gc.collect()  # the config's engine, before the next one loads its weights
    compare(results)
    peers = llama_cpp_quality(llama_cpp, ids, reference) if llama_cpp is not None else []
    return results, peers


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagedllm bench quality",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    flags.add_model(parser)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    flags.add_kv_cache_dtype(
        parser,
        default=["auto"],
        many=True,
        help="the KV cache's dtype (auto: the engine's, float16 under float32 weights on the CPU); each "
        "config runs with each",
    )
    parser.add_argument("--text", type=Path, default=TEXT, help="the text whose perplexity is measured")
    parser.add_argument("--max-text-tokens", type=int, default=None)
    parser.add_argument("--max-tokens", type=int, default=32, help="greedy tokens per prompt")
    parser.add_argument(
        "--llama-cpp",
        action="store_true",
        help="add llama-cpp-python on the same GGUF file: perplexity, KL divergence from its own F32 copy",
    )
    flags.add_json(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    gguf = None
    if args.llama_cpp:
        from pagedllm.bench.llama_cpp import gguf_of

        gguf = gguf_of(parser, args.model, "--llama-cpp")
    text = args.text.read_text()
    results, peers = run(
        args.model, args.configs, text, args.max_text_tokens, args.max_tokens, args.kv_cache_dtype, gguf
    )
    if args.json:
        print(json.dumps([asdict(r) for r in [*results, *peers]], indent=2))
        return 0
    base = results[0]
    print(
        f"model {args.model}; perplexity of {args.text.name}; greedy agreement with {base.config} weights, "
        f"{base.kv_cache_dtype} KV on {len(EQUIVALENCE_PROMPTS)} prompts x {args.max_tokens} tokens"
    )
    print(
        f"{'config':<17}{'KV':>10}{'storage':>9}{'weights MiB':>13}{'KV B/token':>12}{'perplexity':>12}"
        f"{'vs first':>10}{'KL':>10}{'same':>7}{'prefix':>8}"
    )
    for r in results:
        delta = f"{r.perplexity / base.perplexity - 1:+.2%}"
        print(
            f"{r.config:<17}{r.kv_cache_dtype:>10}{r.linear_method:>9}{r.weight_mib:>13.1f}"
            f"{r.kv_bytes_per_token:>12,}{r.perplexity:>12.4f}{delta:>10}{r.kl_divergence:>10.5f}"
            f"{r.greedy_same:>4}/{len(r.tokens)}"
            f"{r.greedy_prefix:>8.1f}"
        )
        print(f"  ran: {r.ran}")
    if peers:
        print(f"{'system':<27}{'perplexity':>12}{'KL from its F32':>17}{'KL from the first row':>23}")
        for p in peers:
            print(f"{p.system:<27}{p.perplexity:>12.4f}{p.kl_divergence:>17.5f}{p.kl_from_first:>23.5f}")
            print(f"  ran: {p.ran}")
    print(
        "KL: mean KL divergence of each next-token distribution of the text from the first row's; same: "
        "prompts whose greedy tokens all equal the first row's; prefix: mean tokens before a difference"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
