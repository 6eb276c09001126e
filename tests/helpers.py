"""Assertions shared by tests that run the engine."""

from __future__ import annotations


def assert_all_blocks_free(llm_or_engine) -> None:
    """Every engine test ends here: no request left, every KV block back in the free pool."""
    engine = getattr(llm_or_engine, "engine", llm_or_engine)
    assert not engine.has_unfinished_requests()
    assert engine.allocator.all_free(), engine.allocator.usage()
