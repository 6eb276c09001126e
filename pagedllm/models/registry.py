"""Which class runs a checkpoint: Hugging Face `architectures` and GGUF `general.architecture` names."""

from __future__ import annotations

from torch import nn

from pagedllm.models.gemma3 import Gemma3ForCausalLM
from pagedllm.models.llama import LlamaForCausalLM

MODEL_CLASSES: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Qwen3MoeForCausalLM": LlamaForCausalLM,
    "MixtralForCausalLM": LlamaForCausalLM,
    "Phi3ForCausalLM": LlamaForCausalLM,
    "Gemma2ForCausalLM": Gemma3ForCausalLM,  # Gemma 3's layer without QK-norm, with soft-capping
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Gemma3ForConditionalGeneration": Gemma3ForCausalLM,  # the text part; vision weights are skipped
}

# GGUF general.architecture -> the Hugging Face architecture whose weight names the converter produces.
GGUF_ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}


def model_class(architecture: str) -> type[nn.Module]:
    """The module class for a Hugging Face architecture name; a clear error for one we do not run."""
    try:
        return MODEL_CLASSES[architecture]
    except KeyError:
        raise ValueError(
            f"unsupported model architecture {architecture!r}; supported: {sorted(MODEL_CLASSES)}"
        ) from None


def gguf_architecture(name: str) -> str:
    """The Hugging Face architecture for a GGUF general.architecture value."""
    try:
        return GGUF_ARCHITECTURES[name]
    except KeyError:
        raise ValueError(
            f"unsupported GGUF architecture {name!r}; supported: {sorted(GGUF_ARCHITECTURES)}"
        ) from None
