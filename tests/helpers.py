"""Assertions shared by tests that run the engine."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator


def assert_all_blocks_free(llm_or_engine) -> None:
    """Every engine test ends here: no request left, every KV block back in the free pool."""
    engine = getattr(llm_or_engine, "engine", llm_or_engine)
    assert not engine.has_unfinished_requests()
    assert engine.allocator.all_free(), engine.allocator.usage()


@contextlib.contextmanager
def running_server(app) -> Iterator[str]:
    """Serve `app` with uvicorn on a free loopback port until the block ends; yields the base URL."""
    import uvicorn

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if urllib.request.urlopen(f"{base}/health").status == 200:
                break
        except OSError:
            pass
        assert time.monotonic() < deadline, "server did not come up"
        time.sleep(0.1)
    try:
        yield base
    finally:
        server.should_exit = True
        thread.join(timeout=30)


@contextlib.contextmanager
def openai_client(base: str, engine) -> Iterator:
    """The official client on a running server; afterwards every request must be done, every block free."""
    import openai

    yield openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
    # The engine thread finishes (or aborts) asynchronously: give it a moment, then nothing may be left.
    deadline = time.monotonic() + 10
    while (
        engine.has_unfinished_requests() or not engine.allocator.all_free()
    ) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert_all_blocks_free(engine)
