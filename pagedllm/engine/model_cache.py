"""Engines in one process share a loaded model: weights are read-only, and each engine owns its KV cache."""

from __future__ import annotations

import json
import weakref

import torch

from pagedllm.models import LoadedModel, load_model
from pagedllm.models.linear import few_rows
from pagedllm.models.loader import ResolvedModel, resolve_model
from pagedllm.models.parallel import SINGLE, TensorParallel

_loaded_models: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def load_shared_model(
    model: str | ResolvedModel,
    dtype: torch.dtype,
    device: str,
    quantization: str | None = "auto",
    tp: TensorParallel = SINGLE,
    max_num_seqs: int | None = None,
    max_model_len: int | None = None,
) -> LoadedModel:
    """load_model, reusing a model another live engine already loaded with the same settings (a shard of a
    tensor-parallel group is its engine's own: its layers collect through that group). Engines of
    different max_model_len share a model unless its RoPE depends on it (ModelConfig.for_context)."""
    settings = dict(quantization=quantization, max_num_seqs=max_num_seqs, max_model_len=max_model_len)
    if tp.size > 1:
        return load_model(model, dtype, device, tp=tp, **settings)
    model = resolve_model(model)
    rope = model.config.for_context(max_model_len).rope_scaling
    key = (model.name, dtype, device, quantization, few_rows(max_num_seqs), json.dumps(rope, sort_keys=True))
    loaded = _loaded_models.get(key)
    if loaded is None:
        loaded = load_model(model, dtype, device, **settings)
        _loaded_models[key] = loaded
    return loaded
