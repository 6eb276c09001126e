"""The KV dashboard: GET /v1/kv snapshots, the /metrics it adds to, and the page in a real Chromium."""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest
from helpers import assert_all_blocks_free, openai_client, running_server, wait_until_idle

from pagedllm import SamplingParams
from pagedllm.engine.kv_snapshot import KVSnapshots
from pagedllm.entrypoints.openai.server import build_app

MODEL = "smollm2-135m"
BLOCK = 32
# 64 MiB of SmolLM2 float16 KV (the CPU's default) = 91 blocks of 32 tokens. The system prompt spans several
# full blocks, so requests that start with it share them through the prefix cache, and an n = 3 request
# forks them.
SYSTEM = "You are a careful assistant. Answer briefly, in plain words, and never make things up. " * 5


def metric(base: str, name: str) -> float:
    """One sample of the server's /metrics, e.g. `pagedllm:kv_cache_slots_perc{state="live"}`."""
    line = next(x for x in get(f"{base}/metrics").splitlines() if x.startswith(name + " "))
    return float(line.split()[-1])


def get(url: str):
    with urllib.request.urlopen(url) as response:
        body = response.read()
    return json.loads(body) if response.headers.get_content_type() == "application/json" else body.decode()


@pytest.fixture(scope="module")
def server():
    app = build_app(MODEL, kv_cache_memory="64MiB", max_model_len=512, enable_prefix_caching=True)
    with running_server(app) as base:
        yield base, app.state.engine.engine


@pytest.fixture
def client(server):
    with openai_client(*server) as client:
        yield client


def in_flight(client, max_tokens: int = 120, trio_tokens: int | None = None) -> list:
    """Start an n = 3 request (`trio_tokens` long, default `max_tokens`) and four others (three of them
    sharing the system prompt); return futures."""
    pool = ThreadPoolExecutor(5)

    def complete(prompt: str, n: int, seed: int, max_tokens: int = max_tokens):
        return client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=max_tokens, n=n, temperature=1.0, seed=seed,
            extra_body={"ignore_eos": True},
        )  # fmt: skip

    prompts = [SYSTEM + "Name a colour.", SYSTEM + "Name a fruit.", SYSTEM + "Name a river.", "Count: 1, 2,"]
    futures = [pool.submit(complete, SYSTEM + "Name three animals.", 3, 0, trio_tokens or max_tokens)]
    futures += [pool.submit(complete, prompt, 1, i) for i, prompt in enumerate(prompts)]
    pool.shutdown(wait=False)
    return futures


def check_snapshot(snap: dict) -> None:
    """A paged snapshot agrees with itself: usage with the block lists, ref counts with the tables."""
    ref, tokens, cached = snap["blocks"]["ref"], snap["blocks"]["tokens"], snap["blocks"]["cached"]
    assert len(ref) == len(tokens) == len(cached) == snap["num_blocks"] == 91
    held = sum(r > 0 for r in ref)
    usage = snap["usage"]
    assert usage["live"] == sum(tokens) and usage["tail"] == held * BLOCK - sum(tokens)
    assert usage["free"] + usage["external"] == (len(ref) - held) * BLOCK
    assert usage["reserved"] == usage["external"] == 0
    assert sum(usage[p] for p in ("live", "tail", "reserved", "external", "free")) == snap["total_slots"]
    running = [s for s in snap["seqs"] if s["status"] == "running"]
    assert Counter(b for s in running for b in s["table"]) == {b: r for b, r in enumerate(ref) if r}
    assert snap["queues"]["running"] == len(running)
    for seq in running:
        assert len(seq["table"]) == -(-seq["tokens"] // BLOCK)
    resident = sum(s["tokens"] for s in running)
    assert usage["shared_saved"] == resident - usage["live"]


def forked_blocks(snap: dict) -> set[int]:
    """Blocks held by all three sequences of the n = 3 request (empty until it has forked)."""
    tables = {}
    for seq in snap["seqs"]:
        tables.setdefault(seq["request"], []).append(set(seq["table"]))
    trios = [t for t in tables.values() if len(t) == 3]
    return set.intersection(*trios[0]) if trios else set()


def test_kv_snapshots_are_consistent_while_requests_run(client, server):
    base, _ = server
    futures = in_flight(client, max_tokens=40)
    snaps = []
    while not all(f.done() for f in futures):
        snaps.append(get(f"{base}/v1/kv"))
    for snap in snaps:
        check_snapshot(snap)
    steps = [s["step"] for s in snaps]
    assert steps == sorted(steps) and len(set(steps)) > 5
    shared = [forked_blocks(s) for s in snaps if forked_blocks(s)]
    assert shared, "never saw the n = 3 request forked"
    for snap in snaps:
        for block in forked_blocks(snap):
            assert snap["blocks"]["ref"][block] >= 3
    assert max(s["queues"]["running"] for s in snaps) == 7  # 3 + 4 sequences, all fit
    assert [len(f.result().choices) for f in futures] == [3, 1, 1, 1, 1]
    final = get(f"{base}/v1/kv")
    assert final["usage"]["free"] == final["total_slots"] and final["seqs"] == []
    assert sum(final["blocks"]["cached"]) > 0  # the system prompt's blocks stay cached, free


def test_metrics_latency_histograms_and_kv_slot_shares(client, server):
    base, _ = server
    names = [
        f"pagedllm:{n}_count"
        for n in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds")
    ]
    before = [metric(base, n) for n in names]
    client.completions.create(model=MODEL, prompt="Hello there", max_tokens=6, temperature=0)
    # One first token, five gaps between the six tokens, one finished request.
    assert [metric(base, n) - b for n, b in zip(names, before, strict=True)] == [1, 5, 1]
    shares = {
        state: metric(base, f'pagedllm:kv_cache_slots_perc{{state="{state}"}}')
        for state in ("live", "tail", "reserved", "external", "free")
    }
    assert shares == {"live": 0, "tail": 0, "reserved": 0, "external": 0, "free": 1.0}  # idle again


def test_prefix_cache_hit_rate_gauge(client, server):
    base, engine = server
    prompt = "The prefix cache test prompt: " + "a b c d e f g h " * 12
    num_tokens = len(engine.tokenizer.encode(prompt))
    before = get(f"{base}/v1/kv")["counters"]
    for _ in range(2):
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)
    after = get(f"{base}/v1/kv")["counters"]
    hits = after["prefix_cache_hits"] - before["prefix_cache_hits"]
    assert after["prefix_cache_queries"] - before["prefix_cache_queries"] == 2 * num_tokens
    assert hits == (num_tokens - 1) // BLOCK * BLOCK  # the second time: every full block but the last token's
    rate = after["prefix_cache_hits"] / after["prefix_cache_queries"]
    assert metric(base, "pagedllm:prefix_cache_hit_rate") == pytest.approx(rate)


def test_contiguous_snapshot_runs_tile_the_cache():
    from pagedllm import LLM

    llm = LLM(
        MODEL, kv_cache_memory="4MiB", max_model_len=128, kv_layout="contiguous", contiguous_reserve="pow2"
    )
    engine, snapshots = llm.engine, KVSnapshots(llm.engine)
    for i, max_tokens in enumerate((40, 8, 20, 30)):
        engine.add_request(str(i), list(range(100, 110 + 7 * i)), SamplingParams(max_tokens=max_tokens))
    seen_waiting = False
    while engine.has_unfinished_requests():
        engine.step()
        snap, usage = snapshots.take(), engine.allocator.usage()
        assert snap["usage"] == usage.parts() | {"shared_saved": 0}
        runs = snap["runs"]
        assert [r[0] for r in runs] == [0] + [r[0] + r[1] for r in runs[:-1]]
        assert sum(r[1] for r in runs) == snap["total_slots"] == usage.total_slots
        assert sum(r[1] for r in runs if r[4]) == usage.external_frag_slots
        assert {s["id"]: s["slab"] for s in snap["seqs"]} == {r[3]: [r[0], r[1]] for r in runs if r[3]}
        assert [s["tokens"] for s in snap["seqs"]] == [
            engine.allocator.num_tokens(s["id"]) for s in snap["seqs"]
        ]
        seen_waiting |= snap["queues"]["waiting"] > 0
    assert seen_waiting  # 4 MiB holds ~180 float16 slots: the slabs did not all fit at once
    assert_all_blocks_free(engine)


# -- the page, in Debian's Chromium driven by Playwright ---------------------------------------------------

CHROMIUM = shutil.which("chromium")
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None,
    reason="Debian's chromium is not installed here (apt-get install -y chromium; the README's test command "
    "installs it, so CI runs this test)",
)

PAGE_STATE = """() => {
  const cells = [...document.querySelectorAll('#map .cell')];
  const value = (k) => document.querySelector(`#numbers tr[data-k="${k}"] .v`).textContent;
  return {
    drawn: window.kvDashboard.snap, updates: window.kvDashboard.updates, cells: cells.length,
    shared: cells.filter((c) => c.classList.contains('shared'))
      .map((c) => [+c.dataset.block, +c.textContent]),
    live: value('live'), tail: value('tail'), free: value('free'), running: value('running'),
    seqs: [...document.querySelectorAll('#seqs tbody tr')].map((tr) => tr.dataset.seq),
  };
}"""


@pytest.fixture
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM)
        yield chromium
        chromium.close()


class Recorder(threading.Thread):
    """Polls /v1/kv as fast as it can, keeping a snapshot of every step it sees, until stopped."""

    def __init__(self, base: str):
        super().__init__(daemon=True)
        self.base, self.by_step, self.stop = base, {}, threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            snap = get(f"{self.base}/v1/kv")
            self.by_step[snap["step"]] = snap

    def __enter__(self) -> Recorder:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.join(timeout=10)


def between_steps(snap: dict) -> dict:
    """What no step changed: a request added between two steps changes only the waiting count and the
    prompt token counter (and the snapshot's time), not the step number."""
    queues = {k: v for k, v in snap["queues"].items() if k != "waiting"}
    counters = {k: v for k, v in snap["counters"].items() if k != "prompt_tokens"}
    rest = {k: v for k, v in snap.items() if k not in ("time", "queues", "counters")}
    return rest | {"queues": queues, "counters": counters}


def drawn_at_recorded_steps(page, recorder: Recorder, script: str, wanted, count: int = 3) -> list[dict]:
    """`count` page states about a second apart, each drawn from a snapshot of a step `wanted` accepts
    and equal to the recorder's own /v1/kv of that step (the page state is read in one evaluate, so it
    is one render's). Checks that the page kept updating, drawing later steps."""
    shown, deadline = [], time.monotonic() + 60
    while len(shown) < count and time.monotonic() < deadline:
        state = page.evaluate(script) | {"at": time.monotonic()}
        recorded = recorder.by_step.get(state["drawn"]["step"])
        if recorded is None or not wanted(recorded):
            time.sleep(0.1)
            continue
        assert between_steps(state["drawn"]) == between_steps(recorded)
        shown.append(state)
        time.sleep(1.0)
    assert len(shown) == count, f"the page drew only {len(shown)} of {count} steps /v1/kv was seen at"
    steps = [state["drawn"]["step"] for state in shown]
    assert steps == sorted(steps) and steps[-1] > steps[0]  # the engine went on, and the page with it
    # Each state was read about a second after the previous one and shows a later step: the page redrew
    # in between. (How often is the poll period's business, POLL_MS = 500 in dashboard.js, and the engine
    # step's: a timing bound here would only measure how busy the test machine is.)
    assert shown[-1]["updates"] - shown[0]["updates"] >= count - 1
    return shown


def open_dashboard(browser, base: str, errors: list):
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.goto(f"{base}/dashboard")
    page.wait_for_function("() => window.kvDashboard.updates >= 1")
    return page


@needs_chromium
def test_dashboard_page_draws_the_live_paged_cache(client, server, browser, tmp_path):
    base, _ = server
    errors = []
    page = open_dashboard(browser, base, errors)  # first, so its time series start before the load
    # The n = 3 request outlives the page checks below by a wide margin on any machine (they take about
    # three seconds), so the row hovered after them is still there: 400 + its prompt fit max_model_len.
    futures = in_flight(client, max_tokens=100, trio_tokens=400)
    with Recorder(base) as recorder:
        shown = drawn_at_recorded_steps(page, recorder, PAGE_STATE, forked_blocks)
        # While the n = 3 request runs: its third sequence's block table marks the forked blocks shared.
        trio = next(s for s in shown[-1]["seqs"] if s.endswith("#2"))
        page.hover(f'#seqs tbody tr[data-seq="{trio}"]')
        entries = page.locator("#table-view .entry.shared")
        assert entries.count() >= len(forked_blocks(shown[-1]["drawn"])) >= 1
        assert "×" in entries.first.inner_text()
        page.screenshot(path=os.environ.get("PAGEDLLM_DASHBOARD_SCREENSHOT") or tmp_path / "dashboard.png")
    for state in shown:
        snap = state["drawn"]
        ref, usage, queues = snap["blocks"]["ref"], snap["usage"], snap["queues"]
        assert state["cells"] == snap["num_blocks"] == 91
        assert state["shared"] == [[b, r] for b, r in enumerate(ref) if r > 1]
        assert {b for b, r in state["shared"] if r >= 3} >= forked_blocks(snap)  # the fork, drawn shared
        assert [state[k] for k in ("live", "tail", "free")] == [
            f"{usage[k]:,}" for k in ("live", "tail", "free")
        ]
        assert state["running"] == f"{queues['running']} / {queues['waiting']} / {queues['swapped']}"
        assert state["seqs"] == [s["id"] for s in snap["seqs"]]
    assert [len(f.result().choices) for f in futures] == [3, 1, 1, 1, 1]
    assert errors == []


RUNS_STATE = """() => {
  const segs = [...document.querySelectorAll('#map .seg')];
  const value = (k) => document.querySelector(`#numbers tr[data-k="${k}"] .v`).textContent;
  return {
    drawn: window.kvDashboard.snap, updates: window.kvDashboard.updates,
    runs: new Set(segs.map((s) => s.dataset.run)).size,
    slabs: [...new Set(segs.filter((s) => s.dataset.seq).map((s) => s.dataset.seq))],
    external: new Set(segs.filter((s) => s.classList.contains('external')).map((s) => +s.dataset.run)).size,
    live: value('live'), reserved: value('reserved'), external_slots: value('external'),
  };
}"""


@needs_chromium
def test_dashboard_page_draws_contiguous_slabs_and_gaps(server, browser):
    app = build_app(
        MODEL, kv_cache_memory="8MiB", max_model_len=256, kv_layout="contiguous", contiguous_reserve="pow2"
    )  # 176 slots: a few slabs at a time, and gaps between them
    errors = []
    with running_server(app) as base, openai_client(base, app.state.engine.engine) as client:
        page = open_dashboard(browser, base, errors)
        done = threading.Event()

        def ask_until_done(i: int) -> list[str]:
            """One client's requests, back to back until the page checks end: the load outlasts them on
            any machine (a fixed batch of six ran out before the second check on CI's)."""
            reasons = []
            while not done.is_set():
                choice = client.completions.create(
                    model=MODEL, prompt="Count: 1, 2," * (1 + i % 3), max_tokens=16 + 8 * i, temperature=0,
                    extra_body={"ignore_eos": True},
                ).choices[0]  # fmt: skip
                reasons.append(choice.finish_reason)
            return reasons

        with ThreadPoolExecutor(6) as pool, Recorder(base) as recorder:
            futures = [pool.submit(ask_until_done, i) for i in range(6)]
            try:
                shown = drawn_at_recorded_steps(page, recorder, RUNS_STATE, lambda snap: snap["seqs"], 2)
            finally:
                done.set()
            assert all(f.result() and set(f.result()) == {"length"} for f in futures)
    for state in shown:
        runs, usage = state["drawn"]["runs"], state["drawn"]["usage"]
        assert state["runs"] == len(runs)
        assert state["slabs"] == [r[3] for r in runs if r[3] is not None]
        assert state["external"] == sum(r[4] for r in runs)
        assert [state[k] for k in ("live", "reserved", "external_slots")] == [
            f"{usage[k]:,}" for k in ("live", "reserved", "external")
        ]
    assert errors == []


TIERS_STATE = """() => ({
  drawn: window.kvDashboard.snap, hidden: document.querySelector('#tiers-panel').hidden,
  rows: [...document.querySelectorAll('#tiers tbody tr')].map((tr) => [tr.dataset.tier,
    ...['.used', '.cached', '.loads'].map((k) => tr.querySelector(k).textContent)]),
  hits: document.querySelector('#tier-hits').textContent,
})"""


@needs_chromium
def test_dashboard_page_draws_the_prefix_cache_tiers(browser, tmp_path):
    # 22 device blocks under 4 tenants' prompts of 6 full blocks each, asked twice: the second round loads
    # what the device evicted from host memory, and every block is written through to disk.
    app = build_app(
        MODEL,
        kv_cache_memory="16MiB",
        max_model_len=512,
        kv_offload_memory="64MiB",
        kv_offload_dir=str(tmp_path),
    )
    prompts = [f"Tenant {i}. " + SYSTEM * 2 for i in range(4)]
    errors = []
    with running_server(app) as base, openai_client(base, app.state.engine.engine) as client:
        for prompt in prompts * 2:
            client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
        wait_until_idle(app.state.engine.engine)
        snap = get(f"{base}/v1/kv")  # idle: every later snapshot is of this step
        page = open_dashboard(browser, base, errors)
        page.wait_for_function(f"() => window.kvDashboard.snap.step === {snap['step']}")
        state = page.evaluate(TIERS_STATE)
    tiers, ref = snap["tiers"], snap["blocks"]["ref"]
    counters = tiers["counters"]
    assert counters["host_hit_blocks"] > 0 and counters["persisted_blocks"] > 0
    assert tiers["host_cached_blocks"] <= tiers["host_used_blocks"] <= tiers["host_blocks"]
    assert tiers["disk_cached_blocks"] <= tiers["disk_blocks"]
    device_cached = sum(c and r == 0 for c, r in zip(snap["blocks"]["cached"], ref, strict=True))
    used = sum(r > 0 for r in ref)
    rows = [
        ["device", used, snap["num_blocks"], device_cached, None],
        ["host", tiers["host_used_blocks"], tiers["host_blocks"], tiers["host_cached_blocks"]],
        ["disk", tiers["disk_cached_blocks"], tiers["disk_blocks"], tiers["disk_cached_blocks"]],
    ]
    rows[1].append(counters["host_hit_blocks"])
    rows[2].append(counters["disk_hit_blocks"])
    assert not state["hidden"] and state["rows"] == [
        [tier, f"{used:,} / {size:,}", f"{held:,}", "–" if loads is None else f"{loads:,}"]
        for tier, used, size, held, loads in rows
    ]
    below = counters["host_hit_blocks"] * BLOCK / snap["counters"]["prefix_cache_queries"]
    assert f"{100 * below:.1f}% loaded from the tiers" in state["hits"]
    assert errors == []


def test_serve_flags_shape_the_kv_cache_the_dashboard_shows(monkeypatch):
    from pagedllm.engine.config import EngineConfig
    from pagedllm.entrypoints import cli
    from pagedllm.entrypoints.openai import server as server_module

    seen = {}
    monkeypatch.setattr(server_module, "main", lambda model, **kwargs: seen.update(kwargs, model=model) or 0)
    argv = ["serve", "--kv-layout", "contiguous", "--contiguous-reserve", "pow2", "--block-size", "32"]
    assert cli.main([*argv, "--max-num-seqs", "8", "--enable-prefix-caching"]) == 0
    server_only = ("model", "host", "port", "served_model_name", "limits", "shutdown_timeout")
    server_only += ("reasoning_parser",)
    engine_kwargs = {k: v for k, v in seen.items() if k not in server_only}
    assert engine_kwargs.pop("max_num_batched_tokens") is None  # the server's own default (build_app)
    config = EngineConfig(model=seen["model"], **engine_kwargs)
    assert (config.kv_layout, config.contiguous_reserve, config.block_size) == ("contiguous", "pow2", 32)
    assert (config.max_num_seqs, config.enable_prefix_caching) == (8, True)
