"""What an engine actually runs, read once for the benchmarks' rows: the model's sizes, the KV cache's
geometry and dtype, the attention backend, the CPU kernels' instruction-set build, the linear method of
each weight type and the thread count (`LLMEngine.run_info()`)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

from pagedllm import ops
from pagedllm.engine.op_profile import linears_in_call_order, weight_kind


@dataclass(frozen=True)
class RunInfo:
    model: str  # as the engine was asked for it
    vocab_size: int
    max_model_len: int
    eos_token_ids: frozenset[int]
    weight_bytes: int  # the weights as stored
    num_kv_blocks: int
    kv_cache_bytes: int
    kv_dtype: str  # what K/V are stored in: float32, bfloat16, int8, float8_e4m3fn
    block_size: int
    attention_backend: str  # ops.BACKENDS' name serving the model's dtype on its device
    cpu_isa: str | None  # the C++ kernels' build (avx512, avx2_vnni, ...); None: not built / not a CPU
    linear_method: str  # the loader's name for the weights' multiplier: dense, onednn, kernel, int8, gguf...
    weight_kinds: dict[str, int]  # each linear layer's weight type and multiplier -> layers of it
    threads: int

    @property
    def kv_token_bytes(self) -> int:
        """K/V bytes one token takes over every layer."""
        return self.kv_cache_bytes // (self.num_kv_blocks * self.block_size)

    def describe(self) -> str:
        """One line a benchmark row prints: what ran, as the engine chose it."""
        isa = f" ({self.cpu_isa})" if self.cpu_isa else ""
        kinds = ", ".join(f"{kind} x{n}" for kind, n in self.weight_kinds.items())
        return (
            f"attention {self.attention_backend}{isa}, K/V {self.kv_dtype}; "
            f"linear {self.linear_method}: {kinds}; {self.threads} threads"
        )


def read_run_info(engine) -> RunInfo:
    """`engine`'s RunInfo (an LLMEngine, read between steps)."""
    config, model = engine.config, engine.model
    device = torch.device(config.device)
    isa = None
    if device.type == "cpu":
        from pagedllm.ops import native

        isa = native.built_isa()
    return RunInfo(
        model=config.model,
        vocab_size=model.config.vocab_size,
        max_model_len=engine.max_model_len,
        eos_token_ids=frozenset(engine.eos_token_ids),
        weight_bytes=engine.weight_bytes,
        num_kv_blocks=engine.num_kv_blocks,
        kv_cache_bytes=engine.kv_cache_bytes,
        kv_dtype=str(config.kv_torch_dtype).removeprefix("torch."),
        block_size=config.block_size,
        attention_backend=ops.get_backend_name(device, config.torch_dtype),
        cpu_isa=isa,
        linear_method=engine.loaded_model.linear_method,
        weight_kinds=dict(Counter(weight_kind(layer) for layer in linears_in_call_order(model))),
        threads=torch.get_num_threads(),
    )
