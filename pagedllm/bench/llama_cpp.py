"""The llama.cpp peers of `bench latency` and `bench speculative`, from pagedllm's side: which GGUF file
they run, its copy in another type, and llama-cpp-python's generate loop in a child process with its own
environment (llama_cpp_peer.py is the child; bench/peers.py what its environment leaves out).

Each peer is named as what it is: `llama-cpp-python` (llama.cpp's library under llama-cpp-python's Python
generate loop) and `llama-cpp-python LlamaPromptLookupDecoding` (that loop with its prompt-lookup draft);
llama.cpp's own C++ timing is `llama-bench` (bench/llama_bench.py)."""

from __future__ import annotations

import argparse
import importlib.util
from collections import Counter
from pathlib import Path

from pagedllm.bench.peers import PeerEnv, peer_env, run_script

LLAMA_CPP_PYTHON = "llama-cpp-python"
PROMPT_LOOKUP = f"{LLAMA_CPP_PYTHON} LlamaPromptLookupDecoding"
CHILD = Path(__file__).with_name("llama_cpp_peer.py")


def gguf_of(parser: argparse.ArgumentParser, model: str, flag: str, python: bool = True) -> Path:
    """The GGUF file a llama.cpp peer runs, or a parser error naming what is missing (`python`: the peer
    is llama-cpp-python, which must be importable)."""
    from pagedllm.models.loader import gguf_file

    if python and importlib.util.find_spec("llama_cpp") is None:
        parser.error(f"{flag} needs llama-cpp-python (pip install llama-cpp-python; docs/BENCHMARKS.md)")
    gguf = gguf_file(model)
    if gguf is None:
        parser.error(f"{flag} runs a GGUF file; model {model!r} is not one")
    return gguf


def file_in_type(gguf: Path, gguf_type: str) -> Path:
    """The GGUF to run for a --llama-cpp-types entry: the file itself ("file"), or a copy in another type
    made once by llama_model_quantize, cached next to pagedllm's converted models."""
    from pagedllm.models.gguf_loader import cache_root

    if gguf_type == "file":
        return gguf
    target = cache_root() / f"{gguf.stem}.{gguf_type}.gguf"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_suffix(".partial")
        job = {"mode": "quantize", "source": str(gguf), "target": str(partial), "ftype": gguf_type}
        run_script(CHILD, job, peer_env(), LLAMA_CPP_PYTHON)
        partial.rename(target)
    return target


def main_type(gguf: Path) -> str:
    """The file's main tensor type, e.g. Q4_1 (the most common type among its 2-D tensors)."""
    from gguf import GGUFReader

    types = Counter(t.tensor_type.name for t in GGUFReader(gguf).tensors if len(t.shape) == 2)
    return types.most_common(1)[0][0]


def generate(job: dict) -> tuple[list[dict], PeerEnv]:
    """llama_cpp_peer.py's "generate" job (a dict as its docstring says) in a child process with its own
    environment: its results, and that environment."""
    env = peer_env()
    return run_script(CHILD, {"mode": "generate", **job}, env, LLAMA_CPP_PYTHON), env


def log_probs(gguf: Path, ids: list[int], threads: int, output: Path) -> PeerEnv:
    """llama_cpp_peer.py's "log_probs" job: llama.cpp's log-probabilities of each next token of `ids` on
    `gguf`, saved at `output` (numpy), in a child process with its own environment."""
    env = peer_env()
    job = {
        "mode": "log_probs",
        "model": str(gguf),
        "threads": threads,
        "ids": ids,
        "output_path": str(output),
    }
    run_script(CHILD, job, env, LLAMA_CPP_PYTHON)
    return env
