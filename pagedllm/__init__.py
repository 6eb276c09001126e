"""pagedllm: a readable Python LLM inference engine built on PagedAttention."""

from pagedllm._runtime import set_openmp_defaults

set_openmp_defaults()  # before torch starts its OpenMP threads

__version__ = "0.1.0"
__all__ = ["LLM", "BeamSearchParams", "GuidedDecodingParams", "LoRARequest", "SamplingParams"]


def __getattr__(name: str):
    # Lazy so that `import pagedllm.kv` stays free of torch.
    if name == "LLM":
        from pagedllm.entrypoints.llm import LLM

        return LLM
    if name in ("SamplingParams", "BeamSearchParams", "GuidedDecodingParams"):
        from pagedllm import sampling_params

        return getattr(sampling_params, name)
    if name == "LoRARequest":
        from pagedllm.lora_request import LoRARequest

        return LoRARequest
    raise AttributeError(f"module 'pagedllm' has no attribute {name!r}")
