"""`pagedllm bench serve`: a load generator for any OpenAI-compatible server, shaped like `vllm bench serve`.

It targets `--base-url` (pagedllm's server, vLLM's, any other), or starts `pagedllm serve` itself with
the engine flags given here and stops it with SIGTERM at the end. Requests go out as a Poisson process
of `--request-rate` per second (`inf`: all at once), at most `--max-concurrency` in flight, all
streamed (`stream_options.include_usage`). Prompts: `random` token ids with lengths uniform in
`--input-len LO-HI` and `--output-len` tokens each (the same prompts `bench throughput` makes from the
same seed), or the `sharegpt` / `alpaca` length mixes of `bench memory` (pagedllm.bench.trace), their
prompts random token ids of the drawn lengths. `--ignore-eos` asks for exactly the output length.

Printed: request throughput, output and total tokens/s, time to first token (TTFT), time per output
token after the first (TPOT), inter-token latency (ITL, between streamed chunks) and end-to-end latency
(E2E), mean / p50 / p99, as a table or `--json`; the CPU time the load generator itself used, so a
reader can see it was not the bottleneck; and, from the server's /metrics where it has the counters
(pagedllm, vLLM), the share of the run's prompt tokens its prefix cache already held: against a server
that stays up, a second run of the same `--seed` finds its prompts cached and measures far less
prefill, so give each run against a long-lived server its own seed. `--compare-offline` then runs
`LLM.generate` on the same requests in this process (the server stopped first, the same engine
settings, max_num_seqs capped at the concurrency the server saw) and prints served / offline output
tokens/s. `--kv-offload-memory none 1GiB` runs the same requests against one server per value (without
and with a host tier under the prefix cache) and prints them side by side: the prefix hit rate, split
into the device cache's hits and those loaded from the tiers below it, and the latencies. `--setups
'LABEL: SERVE ARGS' ...` does the same for any `pagedllm serve` arguments (one server against
`--data-parallel-size 2` replicas, one routing against another), one run per value in the order given,
each row with its replicas' request counts.

`--soak` also injects faults (pagedllm.bench.soak): clients that disconnect mid-stream, bad
parameters, over-long prompts, malformed JSON, at `--max-concurrency` past the server's max_num_seqs;
it prints pass criteria and exits 1 if any fails.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import math
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from pagedllm.bench import flags, soak
from pagedllm.bench.load import (
    Request,
    Result,
    anthropic_event,
    openai_event,
    responses_event,
    run_load,
    send_streaming,
)
from pagedllm.bench.trace import WORKLOADS, make_trace
from pagedllm.workload import make_prompts, parse_range


@dataclass
class Stats:
    mean: float
    p50: float
    p99: float


@dataclass
class Summary:
    completed: int
    failed: int
    seconds: float
    prompt_tokens: int
    output_tokens: int
    request_throughput: float  # requests/s
    output_tok_s: float
    total_tok_s: float
    ttft_ms: Stats
    tpot_ms: Stats
    itl_ms: Stats
    e2e_ms: Stats
    client_cpu_seconds: float  # CPU time of this process while the requests ran
    prefix_cache: PrefixCacheUse | None = None  # the server's own counters over the run, where it has them
    replicas: dict[str, ReplicaLoad] | None = None  # per engine replica (pagedllm serve --data-parallel-size)


@dataclass
class PrefixCacheUse:
    """Prompt tokens the server looked up in its prefix cache during the run, and found there."""

    queries: float
    hits: float
    external_hits: float = 0.0  # of the hits, tokens loaded from tiers below the device cache (offload)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    @property
    def external_hit_rate(self) -> float:
        return self.external_hits / self.queries if self.queries else 0.0

    def since(self, before: PrefixCacheUse) -> PrefixCacheUse:
        return PrefixCacheUse(
            self.queries - before.queries, self.hits - before.hits, self.external_hits - before.external_hits
        )


@dataclass
class ReplicaLoad:
    """One engine replica's share of the run: requests it finished, prompt tokens looked up and found."""

    finished: float
    queries: float
    hits: float

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


# -- workload ---------------------------------------------------------------------------------------


def make_requests(args, vocab: int, max_model_len: int, tokenizer=None) -> list[Request]:
    if args.dataset == "random":
        prompts = make_prompts(
            [args.input_len] * args.num_prompts,
            vocab,
            args.seed,
            args.shared_prefix_len,
            args.num_shared_prefixes,
        )
        lengths = [(len(p), args.output_len) for p in prompts]
    else:
        trace = make_trace(WORKLOADS[args.dataset], args.num_prompts, 1.0, args.seed, max_model_len)
        prompts = make_prompts([r.prompt_len for r in trace], vocab, args.seed)
        lengths = [(r.prompt_len, r.output_len) for r in trace]
    if ENDPOINTS[args.endpoint].takes_text:  # the random ids decoded (lengths then approximate)
        prompts = [tokenizer.decode(p) for p in prompts]
    return [Request(p, n_in, n_out) for p, (n_in, n_out) in zip(prompts, lengths, strict=True)]


@dataclass(frozen=True)
class Endpoint:
    """How the bench speaks one API: its route, whether it takes text (else token ids), the body's fields
    of its own for a request, and how its stream's events read (openai_event's signature)."""

    path: str
    takes_text: bool
    fields: Callable[[Request], dict]
    read: Callable[[dict], tuple[str, int | None]] = openai_event
    takes_ignore_eos: bool = True  # vLLM's extra; Anthropic's API has no such field
    max_tokens: str = "max_tokens"  # the field that bounds the output (the Responses API's is its own)


def _user_turn(request: Request) -> dict:
    return {"messages": [{"role": "user", "content": request.prompt}]}


def _responses_fields(request: Request) -> dict:
    return {"input": request.prompt}


OPENAI_USAGE = {"stream_options": {"include_usage": True}}
ENDPOINTS = {
    "completions": Endpoint("/v1/completions", False, lambda r: {"prompt": r.prompt} | OPENAI_USAGE),
    "chat": Endpoint("/v1/chat/completions", True, lambda r: _user_turn(r) | OPENAI_USAGE),
    "messages": Endpoint("/v1/messages", True, _user_turn, anthropic_event, takes_ignore_eos=False),
    "responses": Endpoint(
        "/v1/responses", True, _responses_fields, responses_event, max_tokens="max_output_tokens"
    ),
}


def request_body(args, model: str, request: Request) -> dict:
    endpoint = ENDPOINTS[args.endpoint]
    body = {"model": model, endpoint.max_tokens: request.output_len, "temperature": args.temperature}
    body["stream"] = True
    if args.ignore_eos:
        body["ignore_eos"] = True
    return body | endpoint.fields(request)


# -- the report ---------------------------------------------------------------------------------------


def _stats(values_s: list[float]) -> Stats:
    if not values_s:
        return Stats(0.0, 0.0, 0.0)
    ms = sorted(v * 1000 for v in values_s)
    p99 = ms[min(len(ms) - 1, math.ceil(0.99 * len(ms)) - 1)]
    return Stats(statistics.fmean(ms), statistics.median(ms), p99)


def summarize(results: list[Result], seconds: float, cpu_seconds: float) -> Summary:
    done = [r for r in results if r.ok]
    prompt_tokens = sum(r.prompt_len for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    return Summary(
        completed=len(done),
        failed=len(results) - len(done),
        seconds=seconds,
        prompt_tokens=prompt_tokens,
        output_tokens=output_tokens,
        request_throughput=len(done) / seconds,
        output_tok_s=output_tokens / seconds,
        total_tok_s=(prompt_tokens + output_tokens) / seconds,
        ttft_ms=_stats([r.ttft for r in done]),
        tpot_ms=_stats(tpot),
        itl_ms=_stats([gap for r in done for gap in r.itl]),
        e2e_ms=_stats([r.e2e for r in done]),
        client_cpu_seconds=cpu_seconds,
    )


def format_summary(s: Summary) -> str:
    lines = [
        f"completed {s.completed}, failed {s.failed}, in {s.seconds:.1f} s",
        f"request throughput   {s.request_throughput:10.2f} req/s",
        f"output tokens/s      {s.output_tok_s:10.1f}   ({s.output_tokens:,} tokens)",
        f"total tokens/s       {s.total_tok_s:10.1f}   ({s.prompt_tokens:,} prompt tokens)",
        f"{'':20}{'mean':>10}{'p50':>10}{'p99':>10}  (ms)",
    ]
    for name, stats in (("TTFT", s.ttft_ms), ("TPOT", s.tpot_ms), ("ITL", s.itl_ms), ("E2E", s.e2e_ms)):
        lines.append(f"{name:20}{stats.mean:10.1f}{stats.p50:10.1f}{stats.p99:10.1f}")
    share = s.client_cpu_seconds / s.seconds if s.seconds else 0.0
    lines.append(
        f"load generator CPU   {s.client_cpu_seconds:10.2f} s  ({share:.1%} of one core over the run)"
    )
    if s.prefix_cache is not None:
        pc = s.prefix_cache
        lines.append(
            f"server prefix cache  {pc.hit_rate:10.1%}   ({pc.hits:,.0f} of {pc.queries:,.0f} prompt tokens "
            "found cached, from its /metrics)"
        )
    for replica, load in sorted((s.replicas or {}).items()):
        lines.append(f"replica {replica:12} {load.finished:5.0f} requests, prefix cache {load.hit_rate:6.1%}")
    if s.replicas:
        loads = [load.finished for load in s.replicas.values()]
        lines.append(f"busiest / least busy replica: {max(loads) / max(min(loads), 1):.2f}x (requests)")
    return "\n".join(lines)


# Random token prompts (the completions endpoint; chat wraps them in a template, which does share blocks)
# share no block: a run that finds this share of their tokens cached repeats prompts the server has served
# before (the same --seed against a server that stayed up).
REPEAT_HIT_RATE = 0.1

_PREFIX_CACHE_COUNTER = re.compile(
    r"^\w+:((?:external_)?prefix_cache_(?:hits|queries))_total(?:\{[^}]*\})? ([0-9.eE+-]+)$", re.M
)


def prefix_cache_counters(metrics_text: str) -> PrefixCacheUse | None:
    """The prefix cache's hit and query counters in a Prometheus /metrics text (pagedllm's
    `pagedllm:prefix_cache_*_total`, vLLM's `vllm:prefix_cache_*_total`, and the hits of the tiers or
    KV connector below, `*:external_prefix_cache_hits_total`), or None if it has none."""
    totals: dict[str, float] = {}
    for kind, value in _PREFIX_CACHE_COUNTER.findall(metrics_text):
        totals[kind] = totals.get(kind, 0.0) + float(value)
    if "prefix_cache_queries" not in totals:
        return None
    return PrefixCacheUse(
        totals["prefix_cache_queries"],
        totals.get("prefix_cache_hits", 0.0),
        totals.get("external_prefix_cache_hits", 0.0),
    )


_REPLICA_COUNTER = re.compile(
    r"^\w+:(e2e_request_latency_seconds_count|prefix_cache_queries_total|prefix_cache_hits_total)"
    r'\{replica="([^"]+)"[^}]*\} ([0-9.eE+-]+)$',
    re.M,
)
_REPLICA_FIELDS = {
    "e2e_request_latency_seconds_count": "finished",
    "prefix_cache_queries_total": "queries",
    "prefix_cache_hits_total": "hits",
}


def replica_counters(metrics_text: str) -> dict[str, ReplicaLoad]:
    """Each engine replica's counters in the /metrics of pagedllm's replicas (samples labelled `replica`)."""
    found: dict[str, dict[str, float]] = {}
    for name, replica, value in _REPLICA_COUNTER.findall(metrics_text):
        found.setdefault(replica, dict.fromkeys(_REPLICA_FIELDS.values(), 0.0))[_REPLICA_FIELDS[name]] = (
            float(value)
        )
    return {replica: ReplicaLoad(**fields) for replica, fields in found.items()}


def replica_loads(before: str, after: str) -> dict[str, ReplicaLoad] | None:
    """What each replica did between two /metrics readings (None where the server has no replicas)."""
    start, end = replica_counters(before), replica_counters(after)
    zero = ReplicaLoad(0.0, 0.0, 0.0)
    loads = {
        replica: ReplicaLoad(
            load.finished - start.get(replica, zero).finished,
            load.queries - start.get(replica, zero).queries,
            load.hits - start.get(replica, zero).hits,
        )
        for replica, load in end.items()
    }
    return loads or None


def read_metrics(base_url: str, api_key: str | None) -> str:
    """The server's /metrics text now ("" where it has none)."""
    try:
        return http_get(base_url, "/metrics", api_key).decode()
    except (OSError, ValueError):
        return ""


# -- the server -------------------------------------------------------------------------------------


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    """`pagedllm serve` in a subprocess on a free loopback port; `stop()` sends SIGTERM (graceful)."""

    def __init__(self, args, extra_args: list[str] | None = None):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        argv = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", "--model", args.model]
        argv += ["--port", str(self.port), "--kv-cache-memory", args.kv_cache_memory]
        argv += ["--max-num-seqs", str(args.max_num_seqs), "--quantization", args.quantization]
        argv += ["--kv-cache-dtype", args.kv_cache_dtype]
        if args.max_model_len:
            argv += ["--max-model-len", str(args.max_model_len)]
        if args.api_key:
            argv += ["--api-key", args.api_key]
        argv += args.serve_arg + (extra_args or [])
        self.log = tempfile.NamedTemporaryFile("w+", prefix="pagedllm-serve-", suffix=".log", delete=False)
        self.process = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT)
        self._log_text: str | None = None

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"pagedllm serve exited with {self.process.returncode}: {self.log_text()}")
            try:
                if urllib.request.urlopen(f"{self.base_url}/health", timeout=5).status == 200:
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"pagedllm serve did not come up in {timeout:.0f} s: {self.log_text()}")
            time.sleep(0.2)

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM, then the exit code (0: drained, every KV block free); the log file is then removed."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            code = self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            code = self.process.wait()
        if self._log_text is None:
            self._log_text = Path(self.log.name).read_text()
            self.log.close()
            os.unlink(self.log.name)
        return code

    def log_text(self, tail: int | None = 3000) -> str:
        text = self._log_text if self._log_text is not None else Path(self.log.name).read_text()
        return text if tail is None else text[-tail:]


def http_get(base_url: str, path: str, api_key: str | None) -> bytes:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with urllib.request.urlopen(
        urllib.request.Request(f"{base_url}{path}", headers=headers), timeout=30
    ) as r:
        return r.read()


def get_json(base_url: str, path: str, api_key: str | None) -> dict:
    return json.loads(http_get(base_url, path, api_key))


# -- offline comparison -------------------------------------------------------------------------------


def run_offline(args, requests: list[Request]) -> tuple[float, int]:
    """LLM.generate on the same requests and settings; seconds of generate() (after a warm-up), tokens."""
    from pagedllm import LLM, SamplingParams
    from pagedllm.entrypoints.openai.server import server_cpu_batched_tokens

    max_num_seqs = min(args.max_num_seqs, args.max_concurrency or args.max_num_seqs)
    llm = LLM(
        args.model,
        kv_cache_memory=args.kv_cache_memory,
        max_model_len=args.max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=server_cpu_batched_tokens(),  # the step budget the server ran with
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    params = [
        SamplingParams(max_tokens=r.output_len, temperature=args.temperature, ignore_eos=args.ignore_eos)
        for r in requests
    ]
    llm.generate([r.prompt for r in requests[:2]], params[:2])  # warm-up, as the served run had
    start = time.perf_counter()
    outputs = llm.generate([r.prompt for r in requests], params)
    seconds = time.perf_counter() - start
    return seconds, sum(len(o.outputs[0].token_ids) for o in outputs)


# -- command line -------------------------------------------------------------------------------------


def _range(text: str) -> tuple[int, int]:
    try:
        return parse_range(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be LO-HI with 1 <= LO <= HI, got {text!r}") from None


def _setup(text: str) -> tuple[str, list[str]]:
    label, sep, serve_args = text.partition(":")
    if not sep or not label.strip():
        raise argparse.ArgumentTypeError(f"a setup is 'LABEL: SERVE ARGS', got {text!r}")
    return label.strip(), shlex.split(serve_args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagedllm bench serve", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    target = parser.add_argument_group("target")
    target.add_argument("--base-url", default=None, help="a running server (default: start pagedllm serve)")
    flags.add_model(target, help="the model to serve (and its vocabulary)")
    target.add_argument(
        "--served-model-name", default=None, help="the name in requests (default: the server's)"
    )
    target.add_argument(
        "--api-key", default=os.environ.get("PAGEDLLM_API_KEY"), help="sent as a Bearer token"
    )
    target.add_argument(
        "--endpoint-type",
        "--endpoint",
        dest="endpoint",
        choices=list(ENDPOINTS),
        default="completions",
        help="the API the requests speak (messages: Anthropic's)",
    )
    target.add_argument(
        "--vocab-size", type=int, default=None, help="token ids to draw from (default: --model's)"
    )
    server = parser.add_argument_group("the server this bench starts (without --base-url)")
    flags.add_kv_cache_memory(server, "1GiB")
    server.add_argument("--max-model-len", type=int, default=1024)
    server.add_argument("--max-num-seqs", type=int, default=256)
    flags.add_quantization(
        server, help="weight storage, served and offline alike (none: the float weights other servers load)"
    )
    server.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="K/V storage, served and offline alike: a name `pagedllm serve --kv-cache-dtype` takes (auto, "
        "int8, fp8, ...; checked there, so that this load generator needs no torch)",
    )
    server.add_argument("--serve-arg", action="append", default=[], help="one more `pagedllm serve` argument")
    server.add_argument(
        "--kv-offload-memory",
        nargs="+",
        default=None,
        metavar="SIZE",
        help="one run per value, side by side: `pagedllm serve --kv-offload-memory SIZE` (a host tier under "
        "the prefix cache), or none (without it)",
    )
    server.add_argument(
        "--setups",
        nargs="+",
        default=None,
        type=_setup,
        metavar="'LABEL: ARGS'",
        help="one run per value, side by side, in this order: `pagedllm serve ARGS` (after the flags above, "
        "so they override them), its row named LABEL",
    )
    server.add_argument("--startup-timeout", type=float, default=600.0)
    load = parser.add_argument_group("load")
    load.add_argument("--dataset", choices=["random", *sorted(WORKLOADS)], default="random")
    load.add_argument("--num-prompts", type=int, default=64)
    load.add_argument("--input-len", type=_range, default=(100, 300), help="random: LO-HI prompt tokens")
    load.add_argument("--output-len", type=int, default=64, help="random: output tokens per request")
    load.add_argument(
        "--shared-prefix-len",
        type=int,
        default=0,
        help="random: tokens of a system prompt before each prompt",
    )
    load.add_argument(
        "--num-shared-prefixes",
        type=int,
        default=1,
        help="random: distinct system prompts (tenants), one drawn at random for each request",
    )
    load.add_argument(
        "--request-rate", type=float, default=math.inf, help="Poisson requests/s (inf: at once)"
    )
    load.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    load.add_argument("--ignore-eos", action="store_true", help="ask for exactly the output length")
    load.add_argument("--temperature", type=float, default=0.0)
    flags.add_seed(load)
    out = parser.add_argument_group("report")
    flags.add_json(out)
    out.add_argument(
        "--compare-offline",
        action="store_true",
        help="also LLM.generate on the same requests: served / offline",
    )
    soak = parser.add_argument_group("soak (pagedllm.bench.soak)")
    soak.add_argument("--soak", action="store_true", help="inject faults and check the pass criteria")
    soak.add_argument("--fault-rate", type=float, default=0.25, help="share of requests that are faults")
    soak.add_argument(
        "--kill-replica-every",
        type=float,
        default=None,
        help="seconds between SIGKILLs of the busiest replica's process (a --data-parallel-size server here)",
    )
    soak.add_argument(
        "--request-timeout", type=float, default=600.0, help="seconds without an answer that fail a request"
    )
    return parser


def _vocab_size(args) -> int:
    if args.vocab_size:
        return args.vocab_size
    from pagedllm.models.loader import read_config, resolve_checkpoint

    return read_config(resolve_checkpoint(args.model)).vocab_size


def _tokenizer(args):
    from pagedllm.models.loader import resolve_checkpoint
    from pagedllm.models.tokenizer import load_tokenizer

    return load_tokenizer(resolve_checkpoint(args.model))


async def _serve_load(args, base_url: str, model: str, requests: list[Request]):
    import httpx2  # checked in main()

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    endpoint = ENDPOINTS[args.endpoint]
    limits = httpx2.Limits(max_connections=args.max_concurrency or len(requests) + 1)
    async with httpx2.AsyncClient(base_url=base_url, headers=headers, timeout=None, limits=limits) as client:
        if args.soak:
            return await soak.run(client, args, base_url, model, requests)

        async def send(request: Request) -> Result:
            body = request_body(args, model, request)
            return await send_streaming(client, endpoint.path, body, request.prompt_len, endpoint.read)

        # Warm-up, not counted: the first prompt reversed, so that it leaves nothing in the server's prefix
        # cache that the workload asks for.
        await send(Request(requests[0].prompt[::-1], requests[0].prompt_len, 4))
        metrics_before = read_metrics(base_url, args.api_key)
        report = await run_load(requests, args.request_rate, args.max_concurrency, args.seed, send)
        metrics_after = read_metrics(base_url, args.api_key)
        before, after = prefix_cache_counters(metrics_before), prefix_cache_counters(metrics_after)
        used = after.since(before) if before and after else None
        return report, used, replica_loads(metrics_before, metrics_after)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if importlib.util.find_spec("httpx2") is None:
        parser.error("the load generator needs httpx2: pip install 'pagedllm[bench]'")
    if args.ignore_eos and not ENDPOINTS[args.endpoint].takes_ignore_eos:
        parser.error(f"--ignore-eos: the {args.endpoint} API has no ignore_eos (greedy outputs match chat's)")
    if args.compare_offline and (args.base_url or args.endpoint != "completions"):
        parser.error("--compare-offline needs the server this bench starts and --endpoint completions")
    for name in ("kv_offload_memory", "setups"):
        if getattr(args, name) and (args.base_url or args.soak or args.compare_offline):
            flag = "--" + name.replace("_", "-")
            parser.error(f"{flag} starts a server per value: not with --base-url, --soak, --compare-offline")
    if args.kv_offload_memory and args.setups:
        parser.error("--kv-offload-memory and --setups both name the servers to run: give one")
    if args.soak:
        args.ignore_eos = True  # every well-formed answer then has exactly the length asked for
    if args.kv_offload_memory:
        setups = [
            (size, [] if size.lower() == "none" else ["--kv-offload-memory", size])
            for size in args.kv_offload_memory
        ]
        return _side_by_side(args, parser, setups, "kv offload memory")
    if args.setups:
        return _side_by_side(args, parser, args.setups, "setup")
    server, exit_code, base_url, model, requests, report = _measure(args, parser)
    if args.soak:
        code = soak.report(report, args, exit_code)
        if code != 0 and server is not None:
            print(f"--- the server's log (tail):\n{server.log_text()}", file=sys.stderr)
        return code
    (results, seconds, cpu), prefix_cache, summary_replicas = report
    summary = summarize(results, seconds, cpu)
    summary.prefix_cache, summary.replicas = prefix_cache, summary_replicas
    repeated = prefix_cache is not None and prefix_cache.hit_rate >= REPEAT_HIT_RATE
    if (
        repeated
        and args.dataset == "random"
        and args.endpoint == "completions"
        and not args.shared_prefix_len
    ):
        print(
            f"warning: the server's prefix cache already held {prefix_cache.hit_rate:.0%} of these random "
            "prompts' tokens (an earlier run with this --seed): this run measured little prefill; give "
            "each run against a server that stays up its own --seed",
            file=sys.stderr,
        )
    offline = run_offline(args, requests) if args.compare_offline else None
    workload = _workload(args, len(requests), summary.prompt_tokens)
    if args.json:
        data = {"config": vars(args) | {"input_len": list(args.input_len)}, "summary": asdict(summary)}
        data["failures"] = [r.error for r in results if not r.ok][:10]
        if offline:
            data["offline"] = {"seconds": offline[0], "output_tok_s": offline[1] / offline[0]}
            data["served_over_offline"] = summary.output_tok_s / (offline[1] / offline[0])
        print(json.dumps(data, indent=2, default=str))
        return 0 if summary.failed == 0 else 1
    started = "started by this bench" if server else "given"
    print(f"target: {base_url} ({started}), {ENDPOINTS[args.endpoint].path}, model {model}")
    print(f"workload: {workload}")
    print(format_summary(summary))
    for error in [r.error for r in results if not r.ok][:5]:
        print(f"failed: {error}")
    if offline:
        offline_tok_s = offline[1] / offline[0]
        ratio = summary.output_tok_s / offline_tok_s
        print(
            f"offline LLM.generate, same requests: {offline[1]:,} tokens in {offline[0]:.1f} s = "
            f"{offline_tok_s:.1f} output tok/s; served / offline = {ratio:.2f}x"
        )
    return 0 if summary.failed == 0 else 1


def _workload(args, num_requests: int, prompt_tokens: int) -> str:
    lengths = "{}-{} input tokens, {} output tokens".format(*args.input_len, args.output_len)
    if args.shared_prefix_len:
        lengths += f" after one of {args.num_shared_prefixes} {args.shared_prefix_len}-token system prompts"
    return (
        f"{args.dataset}, {num_requests} prompts ({prompt_tokens:,} prompt tokens), "
        f"{lengths if args.dataset == 'random' else 'lengths from the trace'}"
        f"{' (EOS ignored)' if args.ignore_eos else ''}, rate {args.request_rate:g}/s, "
        f"concurrency {args.max_concurrency or 'unlimited'}"
    )


def _measure(args, parser, serve_args: list[str] | None = None):
    """Start the server (unless --base-url), run the workload against it, stop it: (the server or None,
    its exit code, base URL, model name, the requests, the load's report)."""
    server = None if args.base_url else ServerProcess(args, serve_args)
    try:
        if server is not None:
            server.wait_ready(args.startup_timeout)
        base_url = args.base_url or server.base_url
        try:
            served = get_json(base_url, "/v1/models", args.api_key)["data"][0]
        except urllib.error.HTTPError as error:
            answer = f"{base_url}/v1/models answered {error.code}: {error.read()!r}"
            parser.exit(2, f"pagedllm bench serve: error: {answer}\n")
        model = args.served_model_name or served["id"]
        max_model_len = served.get("max_model_len") or args.max_model_len
        tokenizer = _tokenizer(args) if ENDPOINTS[args.endpoint].takes_text else None
        requests = make_requests(args, _vocab_size(args), max_model_len, tokenizer)
        report = asyncio.run(_serve_load(args, base_url, model, requests))
    except BaseException:
        if server is not None:
            server.stop()
        raise
    exit_code = server.stop() if server is not None else None
    return server, exit_code, base_url, model, requests, report


def _side_by_side(args, parser, setups: list[tuple[str, list[str]]], what: str) -> int:
    """The same requests against one server per setup (its label, its `pagedllm serve` arguments), one
    after another, printed side by side."""
    runs = []
    for label, extra in setups:
        server, exit_code, _, _, requests, report = _measure(args, parser, extra)
        (results, seconds, cpu), prefix_cache, replicas = report
        summary = summarize(results, seconds, cpu)
        summary.prefix_cache, summary.replicas = prefix_cache, replicas
        runs.append((label, summary, exit_code))
        if exit_code != 0 or summary.failed:
            print(f"--- the server's log (tail), {what} {label}:\n{server.log_text()}", file=sys.stderr)
    if args.json:
        data = {"config": vars(args) | {"input_len": list(args.input_len)}}
        key = what.replace(" ", "_")
        data["runs"] = [{key: label, "summary": asdict(s), "exit_code": c} for label, s, c in runs]
        print(json.dumps(data, indent=2, default=str))
    else:
        print(f"workload: {_workload(args, len(requests), runs[0][1].prompt_tokens)}")
        print(f"servers: --kv-cache-memory {args.kv_cache_memory} unless a row says otherwise, one per row")
        print(format_runs(runs, what))
    return 0 if all(code == 0 and s.failed == 0 for _, s, code in runs) else 1


def format_runs(runs: list[tuple[str, Summary, int | None]], what: str) -> str:
    """One row per server run: prefix hits (all, the device cache's, the tiers'), latencies, throughput,
    and the requests each replica finished (a --data-parallel-size server)."""
    width = max(18, len(what), *(len(label) for label, _, _ in runs))
    head = (
        f"{what:>{width}}{'hit rate':>10}{'device':>9}{'tiers':>8}{'TTFT mean':>11}{'p50':>9}{'p99':>9}"
        f"{'E2E mean':>10}{'req/s':>8}{'out tok/s':>11}{'failed':>8}  requests by replica"
    )
    lines = [head + "   (ms)"]
    for label, s, _ in runs:
        pc = s.prefix_cache or PrefixCacheUse(0.0, 0.0)
        loads = sorted((load.finished for load in (s.replicas or {}).values()), reverse=True)
        by_replica = " / ".join(f"{n:.0f}" for n in loads) if loads else "-"
        if len(loads) > 1:
            by_replica += f" ({loads[0] / max(loads[-1], 1):.2f}x)"
        lines.append(
            f"{label:>{width}}{pc.hit_rate:10.1%}{pc.hit_rate - pc.external_hit_rate:9.1%}"
            f"{pc.external_hit_rate:8.1%}{s.ttft_ms.mean:11.0f}{s.ttft_ms.p50:9.0f}{s.ttft_ms.p99:9.0f}"
            f"{s.e2e_ms.mean:10.0f}{s.request_throughput:8.2f}{s.output_tok_s:11.1f}{s.failed:8d}"
            f"  {by_replica}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
