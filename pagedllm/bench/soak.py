"""`pagedllm bench serve --soak`: the load of `bench serve` with faults mixed in, then the pass criteria.

Each request is, with probability `--fault-rate`, one fault (in turn):
  disconnect      a stream whose client goes away after its first event (the server must abort it)
  bad_params      a well-formed request with one bad field (negative temperature, n=0, an unknown field,
                  logprobs past the server's limit, ...): must be a 4xx with an OpenAI-style message
  too_long        a prompt longer than the server's max_model_len: a 4xx
  malformed_json  a body that is not JSON: a 4xx
and otherwise well-formed: completions (token ids) or chat, streamed or not, n = 1 or 2, EOS ignored,
so a complete answer has exactly n * max_tokens tokens and every choice ends with "length".

Pass criteria, printed at the end: every well-formed request answered completely; every bad one
refused with a 4xx and a message; the server alive (/health) once traffic stops; the KV pool back to
all-free with nothing running or waiting (read from /metrics); and, when the bench started the server,
a graceful exit (SIGTERM -> exit 0). Preemptions seen are printed (a small KV budget forces them).

`--kill-replica-every S` (a `--data-parallel-size` server on this machine): every S seconds, once every
replica runs, the process of the replica running most requests (its pid from GET /v1/kv) is SIGKILLed.
A well-formed request may then also end with a clear error naming the replica (a stream it was serving:
an error event; a request every attempt of which died: a 503); none may go without an answer for
`--request-timeout` seconds, and once traffic stops Ray must have brought every replica back with all
its KV blocks free.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
from dataclasses import asdict, dataclass, field

from pagedllm.bench.load import Request, run_load

FAULTS = ("disconnect", "bad_params", "too_long", "malformed_json")
BAD_PARAMS = [
    {"temperature": -1.0},
    {"top_p": 1.5},
    {"n": 0},
    {"max_tokens": -1},
    {"no_such_field": 1},
    {"logprobs": 10_000},
    {"stop_token_ids": [-5]},
    {"seed": "abc"},
    {"prompt": None},
]


@dataclass
class Outcome:
    kind: str  # "ok" (well-formed) or a fault's name
    passed: bool
    detail: str = ""


@dataclass
class ServerState:
    """What /metrics says once traffic has stopped."""

    running: float | None = None
    waiting: float | None = None
    kv_usage: float | None = None
    preemptions: float | None = None
    healthy: bool = False


@dataclass
class SoakReport:
    outcomes: list[Outcome]
    seconds: float
    client_cpu_seconds: float
    state: ServerState
    criteria: list[tuple[str, bool, str]] = field(default_factory=list)
    killed: list[str] = field(default_factory=list)  # replicas SIGKILLed (--kill-replica-every)


def _is_openai_error(status: int, body: bytes) -> tuple[bool, str]:
    try:
        error = json.loads(body)["error"]
        message = error["message"]
        ok = 400 <= status < 500 and bool(message) and error.get("code") in (status, str(status), None)
        return ok, f"{status}: {message}"
    except (ValueError, KeyError, TypeError):
        return False, f"{status}: not an OpenAI-style error body: {body[:200]!r}"


def _well_formed(args, model: str, request: Request, rng: random.Random) -> tuple[str, dict]:
    body = {"model": model, "max_tokens": request.output_len, "temperature": 0.0, "ignore_eos": True}
    body["n"] = 2 if rng.random() < 0.2 else 1
    if rng.random() < 0.5:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    if rng.random() < 0.2:
        words = " ".join(rng.choice(["red", "blue", "cat", "sun", "tree"]) for _ in range(rng.randint(1, 20)))
        return "/v1/chat/completions", body | {"messages": [{"role": "user", "content": words}]}
    return "/v1/completions", body | {"prompt": request.prompt}


async def _complete(client, path: str, body: dict) -> Outcome:
    """A well-formed request must come back whole: every choice to "length", n * max_tokens tokens."""
    want = body["n"] * body["max_tokens"]
    if body.get("stream"):
        reasons: dict[int, str] = {}
        usage, done = None, False
        async with client.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                return Outcome(
                    "ok", False, f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                )
            async for line in response.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        return Outcome("ok", False, f"error event: {chunk['error']}")
                    usage = chunk.get("usage") or usage
                    for choice in chunk.get("choices") or []:
                        if choice.get("finish_reason"):
                            reasons[choice["index"]] = choice["finish_reason"]
        tokens = usage["completion_tokens"] if usage else None
    else:
        response = await client.post(path, json=body)
        if response.status_code != 200:
            return Outcome("ok", False, f"HTTP {response.status_code}: {response.content[:200]!r}")
        data, done = response.json(), True
        reasons = {c["index"]: c["finish_reason"] for c in data["choices"]}
        tokens = data["usage"]["completion_tokens"]
    complete = done and tokens == want and sorted(reasons) == list(range(body["n"]))
    complete = complete and set(reasons.values()) == {"length"}
    return Outcome("ok", complete, "" if complete else f"incomplete: {tokens}/{want} tokens, {reasons}")


async def _disconnect(client, path: str, body: dict) -> Outcome:
    body = body | {"stream": True, "max_tokens": body["max_tokens"] * 4}
    async with client.stream("POST", path, json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                return Outcome("disconnect", True)  # leaving the block closes the connection mid-stream
    return Outcome("disconnect", False, f"no event before the stream ended (HTTP {response.status_code})")


async def _refused(client, kind: str, path: str, **send) -> Outcome:
    response = await client.post(path, **send)
    ok, detail = _is_openai_error(response.status_code, response.content)
    return Outcome(kind, ok, detail)


async def run(client, args, base_url: str, model: str, requests: list[Request]) -> SoakReport:
    max_model_len = (await client.get("/v1/models")).json()["data"][0].get(
        "max_model_len"
    ) or args.max_model_len
    rng = random.Random(args.seed)
    plan = []
    for i, request in enumerate(requests):
        fault = FAULTS[i % len(FAULTS)] if rng.random() < args.fault_rate else None
        plan.append((fault, request, random.Random(rng.random())))

    async def send(item) -> Outcome:
        try:
            outcome = await asyncio.wait_for(_send(item), args.request_timeout)
        except TimeoutError:
            return Outcome(item[0] or "ok", False, f"hung: no answer within {args.request_timeout:g} s")
        if (
            args.kill_replica_every
            and outcome.kind == "ok"
            and not outcome.passed
            and "replica" in outcome.detail
        ):
            return Outcome("cut", True, outcome.detail)  # a replica died under it and it said so
        return outcome

    async def _send(item) -> Outcome:
        fault, request, r = item
        path, body = _well_formed(args, model, request, r)
        body["max_tokens"] = max(1, min(body["max_tokens"], max_model_len - request.prompt_len - 1))
        try:
            if fault is None:
                return await _complete(client, path, body)
            if fault == "disconnect":
                return await _disconnect(client, path, body)
            if fault == "bad_params":
                return await _refused(client, fault, path, json=body | r.choice(BAD_PARAMS))
            if fault == "too_long":
                prompt = [r.randrange(1, 1000) for _ in range(max_model_len + 5)]
                body = {k: v for k, v in body.items() if k != "messages"} | {"prompt": prompt}
                return await _refused(client, fault, "/v1/completions", json=body)
            bad = json.dumps(body)[: r.randint(1, 20)].encode()  # cut off: never valid JSON
            return await _refused(
                client, fault, path, content=bad, headers={"Content-Type": "application/json"}
            )
        except Exception as error:
            return Outcome(fault or "ok", False, f"client error: {type(error).__name__}: {error}")

    killer = None
    if args.kill_replica_every:
        killed: list[str] = []
        killer = asyncio.create_task(_kill_replicas(client, args.kill_replica_every, killed))
    try:
        outcomes, seconds, cpu = await run_load(
            plan, args.request_rate, args.max_concurrency, args.seed, send
        )
    finally:
        if killer is not None:
            killer.cancel()
    state = await _settled_state(client, timeout=300.0 if killer else 60.0)
    return SoakReport(outcomes, seconds, cpu, state, killed=killed if killer else [])


async def _kill_replicas(client, every: float, killed: list[str]) -> None:
    """Every `every` s, SIGKILL the process of the replica running most requests (GET /v1/kv); once all
    replicas run again (/health 200), so that one is killed while the others serve."""
    while True:
        await asyncio.sleep(every)
        while (await client.get("/health")).status_code != 200:
            await asyncio.sleep(1)
        replicas = (await client.get("/v1/kv")).json()["replicas"]
        busiest = max(replicas, key=lambda r: r["num_running"] + r["num_waiting"])
        os.kill(busiest["pid"], signal.SIGKILL)
        killed.append(busiest["replica"])


def _metric(text: str, name: str) -> float | None:
    """The metric's value, summed over its samples (one per replica behind a replicas' endpoint)."""
    values = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        for prefix in ("pagedllm:", "vllm:")
        if line.startswith(prefix + name + " ") or line.startswith(prefix + name + "{")
    ]
    return sum(values) if values else None


async def _settled_state(client, timeout: float = 60.0) -> ServerState:
    """Poll /metrics and /health until nothing runs or waits (aborts finish on the engine thread) and the
    server is healthy (killed replicas back), or `timeout` s pass; then read them."""
    state = ServerState()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        try:
            text = (await client.get("/metrics")).text
            state.healthy = (await client.get("/health")).status_code == 200
        except Exception:
            return state
        state.running = _metric(text, "num_requests_running")
        state.waiting = _metric(text, "num_requests_waiting")
        state.kv_usage = _metric(text, "kv_cache_usage_perc")
        state.preemptions = _metric(text, "num_preemptions_total")
        settled = state.running == 0 and state.waiting == 0 and state.kv_usage == 0 and state.healthy
        if settled or loop.time() > deadline:
            return state
        await asyncio.sleep(0.5)


def criteria(report: SoakReport, exit_code: int | None) -> list[tuple[str, bool, str]]:
    good = [o for o in report.outcomes if o.kind in ("ok", "cut")]
    bad = [o for o in report.outcomes if o.kind in ("bad_params", "too_long", "malformed_json")]
    failed = [o for o in good + bad if not o.passed]
    state = report.state
    rows = [
        (
            "every well-formed request answered completely"
            + (" or ended with a clear error when its replica was killed" if report.killed else ""),
            all(o.passed for o in good),
            f"{sum(o.passed for o in good)}/{len(good)}"
            + (f" ({sum(o.kind == 'cut' for o in good)} cut by a killed replica)" if report.killed else ""),
        ),
        (
            "every bad request refused with a 4xx and a message",
            all(o.passed for o in bad),
            f"{sum(o.passed for o in bad)}/{len(bad)}",
        ),
        (
            "clients that disconnected mid-stream",
            all(o.passed for o in report.outcomes if o.kind == "disconnect"),
            f"{sum(o.kind == 'disconnect' for o in report.outcomes)} (the server aborts them: KV pool below)",
        ),
        ("server alive after the traffic (/health)", state.healthy, "200" if state.healthy else "no answer"),
        (
            "KV pool all free, nothing running or waiting (/metrics)",
            state.kv_usage == 0 and state.running == 0 and state.waiting == 0,
            f"kv usage {state.kv_usage}, running {state.running}, waiting {state.waiting}",
        ),
    ]
    if report.killed:
        rows.append(
            ("replicas SIGKILLed, Ray brought back (/health)", state.healthy, ", ".join(report.killed))
        )
    if exit_code is not None:
        rows.append(("graceful shutdown (SIGTERM -> exit 0)", exit_code == 0, f"exit code {exit_code}"))
    for outcome in failed[:5]:
        rows.append((f"  failed {outcome.kind}", False, outcome.detail))
    return rows


def report(report: SoakReport, args, exit_code: int | None) -> int:
    """Print the pass criteria (or JSON); 0 if all hold, else 1."""
    report.criteria = criteria(report, exit_code)
    passed = all(ok for _, ok, _ in report.criteria)
    kinds = ("ok", "cut", *FAULTS) if report.killed else ("ok", *FAULTS)  # "cut": only with a killer
    counts = {kind: sum(o.kind == kind for o in report.outcomes) for kind in kinds}
    if args.json:
        data = asdict(report)
        data.pop("outcomes")
        data |= {"counts": counts, "passed": passed}
        print(json.dumps(data, indent=2))
        return 0 if passed else 1
    mix = ", ".join(f"{n} {kind}" for kind, n in counts.items())
    print(
        f"soak: {len(report.outcomes)} requests in {report.seconds:.1f} s ({mix}), concurrency "
        f"{args.max_concurrency or 'unlimited'}; preemptions {report.state.preemptions}; "
        f"load generator CPU {report.client_cpu_seconds:.1f} s"
    )
    for name, ok, detail in report.criteria:
        print(f"{'PASS' if ok else 'FAIL'}  {name}: {detail}")
    print("soak passed" if passed else "soak FAILED")
    return 0 if passed else 1
