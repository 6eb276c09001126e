"""`pagedllm bench lora`: many LoRA adapters batched on one base, against the base alone.

`--num-requests` requests (random prompts of `--input-len` tokens, `--output-len` greedy tokens each, EOS
ignored) are sent at once, request i under adapter i mod (N + 1) of `--num-adapters` N (the last share on
the base), to an engine with enable_lora; the same requests then run on the base alone, on an engine
without LoRA. Printed side by side: output tok/s and median TTFT of each, their ratio, and the memory of
each adapter (loaded once, whatever the number of its requests).

The adapters are random PEFT adapters (rank `--rank` on `--targets`, non-zero B) made with peft on the
model's float weights, or the PEFT folders of `--adapters`.

`--llama-server PATH` adds llama.cpp's `llama-server` as the peer (a GGUF model): each adapter converted
by llama.cpp's own convert_lora_to_gguf.py (from the tree PATH was built in, or `--llama-cpp-tree`), the
server started in its own process and environment (bench/peers.py) with every adapter (`--lora`, scale 0
until a request sets it: `--lora-init-without-apply`) and `-np` slots, and the same requests streamed to
its /v1/completions, each naming its adapter in llama-server's per-request `lora` field. Its rows are timed
over HTTP (pagedllm's offline, in this process).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from pagedllm.bench import flags
from pagedllm.bench.peers import PeerEnv, peer_env

DEFAULT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]


@dataclass
class Run:
    """One system on the workload: output tokens per second over the wall time, median TTFT."""

    system: str
    output_tok_s: float
    ttft_median_ms: float
    output_tokens: int


def make_random_adapter(
    base: Path, folder: Path, targets: list[str], r: int = 8, seed: int = 0, **config
) -> Path:
    """A PEFT LoRA adapter of the HF folder `base` with random A and B (peft starts B at zero: an adapter
    that changes nothing), scaled to move the tokens, not to swamp them; `config`: more LoraConfig
    settings (lora_alpha 16 unless given)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = {"lora_alpha": 16, **config}
    peft_model = get_peft_model(model, LoraConfig(r=r, target_modules=targets, **config))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
    peft_model.save_pretrained(folder)
    return folder


def request_loras(num_requests: int, num_adapters: int) -> list[int | None]:
    """Request i's adapter index: i mod (num_adapters + 1), the last of each round on the base (None)."""
    slots = [i % (num_adapters + 1) for i in range(num_requests)]
    return [slot if slot < num_adapters else None for slot in slots]


def run_pagedllm(llm, name: str, prompts: list[list[int]], params, loras: list) -> Run:
    """Every request added at once, stepped to the end: output tok/s over the wall time, median TTFT."""
    engine = llm.engine
    start = time.perf_counter()
    for i, (prompt, lora) in enumerate(zip(prompts, loras, strict=True)):
        engine.add_request(f"{name}-{i}", prompt, params, lora_request=lora)
    first: dict[str, float] = {}
    total = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.outputs[0].token_ids and out.request_id not in first:
                first[out.request_id] = time.perf_counter() - start
            if out.finished:
                total += len(out.outputs[0].token_ids)
    seconds = time.perf_counter() - start
    assert engine.stats().kv_all_free, "KV blocks leaked"
    return Run(name, total / seconds, 1e3 * statistics.median(first.values()), total)


# -- llama-server ----------------------------------------------------------------------------------------


def convert_adapters(tree: Path, base: Path, adapters: list[Path], out: Path, env: PeerEnv) -> list[Path]:
    """Each PEFT adapter as a GGUF LoRA, by llama.cpp's convert_lora_to_gguf.py (its own gguf-py)."""
    files = []
    for i, adapter in enumerate(adapters):
        outfile = out / f"adapter-{i}.gguf"
        argv = [sys.executable, str(tree / "convert_lora_to_gguf.py"), "--base", str(base)]
        done = subprocess.run(
            [*argv, "--outfile", str(outfile), "--outtype", "f32", str(adapter)],
            capture_output=True,
            text=True,
            env={**env.env, "PYTHONPATH": str(tree / "gguf-py")},
        )
        if done.returncode != 0:
            raise RuntimeError(f"convert_lora_to_gguf.py failed on {adapter}:\n{done.stderr[-2000:]}")
        files.append(outfile)
    return files


def llama_server_argv(binary: Path, gguf: Path, adapters: list[Path], args, port: int) -> list[str]:
    ctx = args.parallel * (args.input_len + args.output_len + 8)  # every slot holds one whole request
    argv = [str(binary), "-m", str(gguf), "--port", str(port), "-np", str(args.parallel), "-c", str(ctx)]
    argv += ["--lora-init-without-apply", "--no-webui"]
    for adapter in adapters:
        argv += ["--lora", str(adapter)]
    if args.threads:
        argv += ["-t", str(args.threads)]
    return argv


def llama_server_body(prompt: list[int], output_len: int, adapter: int | None, num_adapters: int) -> dict:
    """A streamed /v1/completions request under `adapter` (llama-server's `lora`: every adapter's scale for
    this request, 0 for the others; None: all 0, the base)."""
    return {
        "prompt": prompt,
        "max_tokens": output_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "lora": [{"id": i, "scale": 1.0 if i == adapter else 0.0} for i in range(num_adapters)],
    }


def run_llama_server(args, gguf: Path, files: list[Path], prompts, loras: list, env: PeerEnv) -> list[Run]:
    """The mixed and the base-only workloads against one llama-server holding every adapter."""
    import asyncio

    from pagedllm.bench.serve import free_port, summarize

    port = free_port()
    log = tempfile.TemporaryFile("w+")
    argv = llama_server_argv(args.llama_server, gguf, files, args, port)
    server = subprocess.Popen(argv, stdout=log, stderr=log, env=env.env)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(server, url, log)
        runs = []
        workloads = {"llama-server, adapters": loras, "llama-server, base": [None] * len(loras)}
        for name, adapters in workloads.items():
            bodies = [
                (llama_server_body(p, args.output_len, a, len(files)), len(p))
                for p, a in zip(prompts, adapters, strict=True)
            ]
            results, seconds, cpu = asyncio.run(_send_all(f"{url}/v1/completions", bodies))
            failed = [r.error for r in results if not r.ok]
            if failed:
                raise RuntimeError(f"{name}: {len(failed)} requests failed: {failed[0]}")
            summary = summarize(results, seconds, cpu)
            runs.append(Run(name, summary.output_tok_s, summary.ttft_ms.p50, summary.output_tokens))
        return runs
    finally:
        server.terminate()
        server.wait(30)
        log.close()


def _wait_healthy(server: subprocess.Popen, url: str, log, timeout: float = 300) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout
    while True:
        if server.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"llama-server exited with {server.returncode}: {log.read()[-2000:]}")
        try:
            if urllib.request.urlopen(f"{url}/health", timeout=5).status == 200:
                return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"llama-server did not come up in {timeout:.0f} s") from None
            time.sleep(0.2)


async def _send_all(url: str, bodies: list[tuple[dict, int]]):
    """Every (body, prompt length) streamed at once: bench serve's load generator's results."""
    import httpx2  # bench serve's client (pagedllm[bench])

    from pagedllm.bench.load import run_load, send_streaming

    limits = httpx2.Limits(max_connections=len(bodies) + 1)
    async with httpx2.AsyncClient(timeout=None, limits=limits) as client:
        return await run_load(bodies, float("inf"), None, 0, lambda item: send_streaming(client, url, *item))


# -- the command -----------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagedllm bench lora", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    flags.add_model(parser)
    flags.add_quantization(parser)
    flags.add_kv_cache_memory(parser, "256MiB")
    flags.add_seed(parser)
    flags.add_threads(parser)
    flags.add_json(parser)
    parser.add_argument("--num-requests", type=int, default=32, help="requests, all sent at once")
    parser.add_argument("--num-adapters", type=int, default=4, help="adapters the requests spread over")
    parser.add_argument("--input-len", type=int, default=128, help="prompt tokens per request")
    parser.add_argument("--output-len", type=int, default=128, help="greedy tokens per request")
    parser.add_argument("--rank", type=int, default=8, help="the random adapters' rank")
    parser.add_argument("--targets", nargs="+", default=DEFAULT_TARGETS, help="the projections they adapt")
    parser.add_argument("--adapters", nargs="*", default=None, help="PEFT folders instead of random ones")
    parser.add_argument("--llama-server", type=Path, default=None, help="llama.cpp's llama-server binary")
    parser.add_argument(
        "--llama-cpp-tree", type=Path, default=None,
        help="llama.cpp's tree, for convert_lora_to_gguf.py (default: the one of --llama-server's build/bin)",
    )  # fmt: skip
    parser.add_argument("--parallel", type=int, default=16, help="llama-server's -np (slots)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    for name in ("num_requests", "num_adapters", "input_len", "output_len", "rank", "parallel"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.adapters is not None and len(args.adapters) != args.num_adapters:
        parser.error(f"--adapters names {len(args.adapters)} folders, --num-adapters is {args.num_adapters}")
    gguf = None
    if args.llama_server is not None:
        from pagedllm.bench import llama_cpp

        if not args.llama_server.is_file():
            parser.error(f"--llama-server {str(args.llama_server)!r} is not a file")
        if importlib.util.find_spec("httpx2") is None:
            parser.error("--llama-server's requests need httpx2: pip install 'pagedllm[bench]'")
        gguf = llama_cpp.gguf_of(parser, args.model, "--llama-server", python=False)
        args.llama_cpp_tree = args.llama_cpp_tree or args.llama_server.resolve().parents[2]
        if not (args.llama_cpp_tree / "convert_lora_to_gguf.py").is_file():
            parser.error(f"no convert_lora_to_gguf.py in {str(args.llama_cpp_tree)!r} (--llama-cpp-tree)")
    flags.apply_threads(args)
    from pagedllm import LLM, LoRARequest, SamplingParams
    from pagedllm.models.loader import read_config, resolve_checkpoint
    from pagedllm.workload import make_prompts

    work = Path(tempfile.mkdtemp(prefix="pagedllm-bench-lora-"))
    base_folder = resolve_checkpoint(args.model, float_weights=True)
    folders = [Path(a) for a in args.adapters] if args.adapters is not None else [
        make_random_adapter(base_folder, work / f"adapter-{i}", args.targets, args.rank, args.seed + i)
        for i in range(args.num_adapters)
    ]  # fmt: skip
    requests = [LoRARequest(f"adapter-{i}", i + 1, str(f)) for i, f in enumerate(folders)]
    indices = request_loras(args.num_requests, args.num_adapters)
    loras = [requests[i] if i is not None else None for i in indices]
    common = dict(
        quantization=args.quantization, kv_cache_memory=args.kv_cache_memory, max_num_seqs=args.num_requests,
        max_model_len=args.input_len + args.output_len + 8,
    )  # fmt: skip
    rank = max(_rank_of(folder) for folder in folders)
    lora_llm = LLM(
        args.model, enable_lora=True, max_loras=args.num_adapters, max_cpu_loras=args.num_adapters,
        max_lora_rank=rank, **common,
    )  # fmt: skip
    base_llm = LLM(args.model, **common)
    vocab = read_config(resolve_checkpoint(args.model)).vocab_size
    prompts = make_prompts([args.input_len] * args.num_requests, vocab, args.seed)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    warm = [p[:16] for p in prompts[: args.num_adapters + 1]]  # first-call costs, the adapters' loads
    lora_llm.generate(warm, SamplingParams(max_tokens=2), lora_request=[*requests, None])
    base_llm.generate(warm, SamplingParams(max_tokens=2))
    runs = [
        run_pagedllm(lora_llm, f"pagedllm, {args.num_adapters} adapters + base", prompts, params, loras),
        run_pagedllm(base_llm, "pagedllm, base", prompts, params, [None] * len(prompts)),
    ]
    memory = lora_llm.engine.stats().lora_bytes
    if args.llama_server is not None:
        env = peer_env()
        files = convert_adapters(args.llama_cpp_tree, base_folder, folders, work, env)
        runs += run_llama_server(args, gguf, files, prompts, indices, env)
    report(args, runs, memory)
    return 0


def _rank_of(folder: Path) -> int:
    return int(json.loads((folder / "adapter_config.json").read_text())["r"])


def report(args, runs: list[Run], memory: dict[str, int]) -> None:
    """The runs side by side, each mixed run's ratio to its own base run, and the adapters' bytes."""
    if args.json:
        print(json.dumps({"runs": [asdict(r) for r in runs], "adapter_bytes": memory}))
        return
    print(
        f"model {args.model}, {args.num_requests} requests at once ({args.input_len} prompt, "
        f"{args.output_len} output tokens each) over {args.num_adapters} adapters and the base"
    )
    print(f"{'system':<36}{'output tok/s':>14}{'TTFT p50 ms':>14}")
    for run in runs:
        print(f"{run.system:<36}{run.output_tok_s:>14.1f}{run.ttft_median_ms:>14.1f}")
    for mixed, base in zip(runs[::2], runs[1::2], strict=True):
        print(
            f"{mixed.system} / base: output tok/s {mixed.output_tok_s / base.output_tok_s:.2f}x, "
            f"TTFT p50 {mixed.ttft_median_ms / base.ttft_median_ms:.2f}x"
        )
    if len(runs) == 4:
        ours, peer = runs[0], runs[2]
        print(
            f"{ours.system} / {peer.system}: output tok/s {ours.output_tok_s / peer.output_tok_s:.2f}x, "
            f"TTFT p50 {ours.ttft_median_ms / peer.ttft_median_ms:.2f}x"
        )
    per = ", ".join(f"{name} {nbytes / 2**20:.2f} MiB" for name, nbytes in memory.items())
    total = sum(memory.values()) / 2**20
    print(f"adapter memory (each loaded once for all its requests): {per}; total {total:.2f} MiB")


if __name__ == "__main__":
    sys.exit(main())
