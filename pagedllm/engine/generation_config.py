"""The model creator's sampling defaults, read from `generation_config.json` (vLLM's `--generation-config`).

`auto` (the default) reads the file in the model's folder, a folder path reads it there, `vllm` ignores
it. The defaults apply only where a request leaves a setting unset: the server's sampling fields, and
`LLM.generate(prompts)` called without SamplingParams. The built-in models' GGUF files carry no sampling
metadata, so their converted folders have no generation_config.json: vLLM's defaults apply to them.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# generation_config.json key -> SamplingParams field (vLLM reads the same keys).
KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def sampling_defaults(generation_config: str, model_folder: Path | None) -> dict:
    """SamplingParams keyword arguments the model's generation_config.json sets ({} if none)."""
    if generation_config == "vllm":
        return {}
    folder = model_folder if generation_config == "auto" else Path(generation_config).expanduser()
    if folder is None:
        return {}
    path = folder / "generation_config.json"
    if not path.is_file():
        if generation_config != "auto":
            raise FileNotFoundError(f"generation_config={generation_config!r}: no {path}")
        return {}
    values = json.loads(path.read_text())
    fields = {f.name for f in dataclasses.fields(SamplingParams)}
    defaults = {
        field: values[key] for key, field in KEYS.items() if field in fields and values.get(key) is not None
    }
    if defaults:
        SamplingParams(**defaults)  # a bad value in the file fails here, naming the setting
        logger.info(
            "sampling defaults from %s: %s (where a request leaves them unset; --generation-config vllm "
            "ignores them)",
            path,
            defaults,
        )
    return defaults
