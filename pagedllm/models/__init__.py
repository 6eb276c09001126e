"""Model families on the paged KV cache, and their loaders (Hugging Face folders, GGUF files)."""

from pagedllm.models.attention import AttentionMetadata, PagedAttention
from pagedllm.models.config import ModelConfig
from pagedllm.models.loader import BUILTIN_MODELS, DEFAULT_MODEL, LoadedModel, load_model
from pagedllm.models.registry import MODEL_CLASSES

__all__ = [
    "BUILTIN_MODELS",
    "DEFAULT_MODEL",
    "MODEL_CLASSES",
    "AttentionMetadata",
    "LoadedModel",
    "ModelConfig",
    "PagedAttention",
    "load_model",
]
