"""Pictures of what the engine does (matplotlib, an optional dependency: `pip install 'pagedllm[viz]'`)."""

from __future__ import annotations

import importlib.util


def require_matplotlib() -> None:
    """One clear line instead of a traceback when the pictures' dependency is missing."""
    if importlib.util.find_spec("matplotlib") is None:
        raise ImportError(
            "drawing pictures needs matplotlib, an optional dependency: pip install 'pagedllm[viz]'"
        )
