"""EngineConfig: every knob of the engine in one place (vLLM's names where vLLM has the concept)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

import torch

from pagedllm.engine.speculative import SpeculativeConfig
from pagedllm.kv import default_block_size
from pagedllm.models.loader import DEFAULT_MODEL

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPES.update({"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "half": torch.float16})

# kv_cache_dtype's names besides "auto" (fp8 and fp8_e4m3 are vLLM's names of the same e4m3 codes). int8
# and fp8 store codes with a float32 scale per token and KV head (ops/kv_cache.py).
KV_CACHE_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int8": torch.int8,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
}

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


QUANTIZATION_CHOICES = ("auto", None, "none", "int8", "int4", "gguf")


def parse_bytes(value: int | str, name: str = "kv_cache_memory") -> int:
    """'512MiB', '1.5GB', '4096' or an int -> bytes; errors name the setting."""
    if isinstance(value, int):
        size = value
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
        unit = match.group(2).lower() if match else None
        if unit not in _UNITS:
            raise ValueError(f"{name} must be a size like '512MiB' or '2GB', got {value!r}")
        size = int(float(match.group(1)) * _UNITS[unit])
    if size <= 0:
        raise ValueError(f"{name} must be positive, got {value!r}")
    return size


@dataclass
class EngineConfig:
    model: str = DEFAULT_MODEL
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on CUDA
    device: str = "cpu"
    # Tokens per KV block; None: the KV cache dtype's default (kv.default_block_size: blocks of the same bytes
    # whatever the dtype, so 16 float32, 32 bfloat16, 64 int8 / fp8 tokens), resolved at construction.
    block_size: int | None = None
    # KV cache size (of each rank); ignored when num_kv_blocks or memory_budget is given
    kv_cache_memory: int | str = "1GiB"
    # auto: float16 under float32 activations on the CPU (llama.cpp's default cache: half float32's bytes, its
    # greedy tokens), else the activations' dtype; "float32" is the exact cache; bfloat16 halves K/V memory
    # too, int8 / fp8 quarter it (scales included); attention sums in float32 always
    kv_cache_dtype: str = "auto"
    # Commit the CPU KV cache's memory at start-up, as vLLM does (its cost per GiB: docs/JOURNAL.md,
    # Start-up), so that the steps never pay it; False: pages are committed by first use (`pagedllm
    # generate`: a one-shot run that uses a few blocks of its cache starts that much sooner).
    prefault_kv_cache: bool = True
    num_kv_blocks: int | None = None
    # Weights and KV cache together (vLLM's gpu_memory_utilization, in bytes): the KV cache gets what the
    # loaded weights leave, so smaller (quantized) weights mean more KV blocks.
    memory_budget: int | str | None = None
    # auto: a GGUF file keeps its own quantized blocks (see models/quantization.py), other checkpoints
    # load unquantized; None / "none": unquantized in `dtype`; "int8" / "int4": weight-only, at load time.
    quantization: str | None = "auto"
    max_model_len: int | None = None  # default: the model's context length
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    kv_layout: Literal["paged", "contiguous"] = "paged"
    contiguous_reserve: Literal["max", "pow2"] = "max"
    enable_prefix_caching: bool = True  # as vLLM v1; the contiguous layout has no cache and ignores it
    enable_chunked_prefill: bool = True  # as vLLM v1: long prompts are prefilled over several steps
    # vLLM's name. False: a sliding-window layer's blocks go back to the pool once they leave its window
    # (KV groups, kv/groups.py; the paged layout only). True: every layer keeps every token's K/V.
    disable_hybrid_kv_cache_manager: bool = False
    preemption_mode: Literal["recompute", "swap"] = "recompute"
    # Prefix cache tiers (kv/tiers.py): full prefix blocks the device cache evicts move down to host memory
    # (this many bytes, beside kv_cache_memory; swap preemption shares it), and with kv_offload_dir every
    # cached block is also written to files there (at most kv_offload_disk bytes), found again after a
    # restart. Either alone turns the tiers on (a disk tier alone stages its reads in a host pool the
    # size of the KV cache). Paged layout, prefix caching, one rank, full-attention models.
    kv_offload_memory: int | str | None = None
    kv_offload_dir: str | None = None
    kv_offload_disk: int | str = "20GiB"
    watermark: float = 0.01  # share of KV blocks an admission must leave free (vLLM's 1%)
    generation_config: str = "auto"  # sampling defaults: auto (the model folder's), vllm (none) or a folder
    # Speculative decoding, as vLLM spells it: {"method": "ngram", "num_speculative_tokens": 4,
    # "prompt_lookup_max": 4, "prompt_lookup_min": 1} (a dict, made a SpeculativeConfig); None: off.
    speculative_config: SpeculativeConfig | dict | None = None
    # Tensor parallelism: ranks, where they meet (tcp://HOST:PORT or env://; default: this machine, or
    # torchrun's), over how many machines, and how long rank 0 waits for a rank in a collective (seconds).
    tensor_parallel_size: int = 1
    distributed_init_method: str | None = None
    nnodes: int = 1
    distributed_timeout: float = 60.0
    # LoRA adapters (vLLM's names): requests name one by LoRARequest; at most max_loras adapters run in one
    # step (the others' requests wait), of rank at most max_lora_rank; max_cpu_loras stay loaded in memory
    # (None: max_loras), the least recently used one no unfinished request holds dropped beyond that.
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def _check_kv_cache_dtype(self) -> None:
        """kv_cache_dtype is a known name, and one the activations' dtype can be stored in."""
        if self.kv_cache_dtype != "auto" and self.kv_cache_dtype not in KV_CACHE_DTYPES:
            choices = ["auto", *KV_CACHE_DTYPES]
            raise ValueError(f"kv_cache_dtype must be one of {choices}, got {self.kv_cache_dtype!r}")
        setting = f"kv_cache_dtype={self.kv_cache_dtype!r} with dtype={self.dtype!r}"
        if self.kv_torch_dtype == torch.float32 and self.torch_dtype != torch.float32:
            raise ValueError(
                f"{setting}: K and V are computed in {self.torch_dtype}, so a float32 cache would hold the "
                "same values in twice the memory; choose 'auto', 'bfloat16', 'int8' or 'fp8'"
            )
        if self.kv_torch_dtype == torch.float16 and self.torch_dtype not in (torch.float32, torch.float16):
            raise ValueError(
                f"{setting}: a float16 cache is read under float32 or float16 activations; choose 'auto', "
                "'bfloat16', 'int8' or 'fp8'"
            )

    def __post_init__(self) -> None:
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            why = (
                f"this torch ({torch.__version__}) is built without CUDA"
                if torch.version.cuda is None
                else ("no CUDA GPU is visible")
            )
            raise ValueError(f"device={self.device!r}: {why}; use device='cpu'")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPES)}, got {self.dtype!r}")
        self._check_kv_cache_dtype()
        if self.block_size is None:
            self.block_size = default_block_size(self.kv_torch_dtype.itemsize)
        if self.kv_layout not in ("paged", "contiguous"):
            raise ValueError(f"kv_layout must be 'paged' or 'contiguous', got {self.kv_layout!r}")
        if self.contiguous_reserve not in ("max", "pow2"):
            raise ValueError(
                f"contiguous_reserve must be 'max' or 'pow2', got {self.contiguous_reserve!r} ('oracle' "
                "needs each request's true output length: only `pagedllm bench memory` knows it)"
            )
        positive = ("block_size", "max_num_seqs", "max_num_batched_tokens", "tensor_parallel_size", "nnodes")
        for name in positive:
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be a positive integer, got {self.num_kv_blocks!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len!r}")
        if not isinstance(self.watermark, (int, float)) or not 0 <= self.watermark < 1:
            raise ValueError(f"watermark must be a fraction in [0, 1), got {self.watermark!r}")
        parse_bytes(self.kv_cache_memory)
        self._check_offload()
        if self.memory_budget is not None:
            parse_bytes(self.memory_budget, "memory_budget")
        if self.quantization not in QUANTIZATION_CHOICES:
            raise ValueError(
                f"quantization must be one of {list(QUANTIZATION_CHOICES)}, got {self.quantization!r}"
            )
        if self.tensor_parallel_size % self.nnodes:
            raise ValueError(
                f"tensor_parallel_size={self.tensor_parallel_size} does not split over nnodes={self.nnodes}"
            )
        if self.nnodes > 1 and self.distributed_init_method is None:
            raise ValueError(f"nnodes={self.nnodes} needs distributed_init_method='tcp://HOST:PORT'")
        if not self.distributed_timeout > 0:
            raise ValueError(f"distributed_timeout must be > 0 seconds, got {self.distributed_timeout!r}")
        self._check_lora()
        if isinstance(self.speculative_config, dict):
            self.speculative_config = SpeculativeConfig.from_dict(self.speculative_config)
        elif not isinstance(self.speculative_config, SpeculativeConfig | None):
            raise ValueError(f"speculative_config must be a dict, got {self.speculative_config!r}")

    def _check_lora(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        if not isinstance(self.max_cpu_loras, int) or self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras must be an integer >= max_loras={self.max_loras}, got {self.max_cpu_loras!r}"
            )

    def _check_offload(self) -> None:
        if self.kv_offload_memory is not None:
            parse_bytes(self.kv_offload_memory, "kv_offload_memory")
        parse_bytes(self.kv_offload_disk, "kv_offload_disk")
        if self.kv_offload_dir is not None and not str(self.kv_offload_dir).strip():
            raise ValueError(f"kv_offload_dir must be a folder, got {self.kv_offload_dir!r}")
        if not self.has_kv_tiers:
            return
        for needs, ok in (
            ("kv_layout='paged'", self.kv_layout == "paged"),
            ("enable_prefix_caching=True", self.enable_prefix_caching),
            ("tensor_parallel_size=1", self.tensor_parallel_size == 1),
        ):
            if not ok:
                raise ValueError(f"kv_offload_memory / kv_offload_dir (prefix cache tiers) need {needs}")

    @property
    def has_kv_tiers(self) -> bool:
        """Whether prefix cache tiers (host memory, disk) are on."""
        return self.kv_offload_memory is not None or self.kv_offload_dir is not None

    @property
    def is_parallel(self) -> bool:
        """Whether the model is split over several ranks (tensor parallelism)."""
        return self.tensor_parallel_size > 1

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if self.device.startswith("cuda") else torch.float32
        return DTYPES[self.dtype]

    @property
    def kv_torch_dtype(self) -> torch.dtype:
        """The dtype K/V are stored in (attention computes in float32 either way)."""
        if self.kv_cache_dtype != "auto":
            return KV_CACHE_DTYPES[self.kv_cache_dtype]
        # float32 activations on the CPU store K/V as float16, llama.cpp's default: half the bytes each decode
        # step reads, and float32's tokens on the exact path (BENCHMARKS W11, P16)
        on_cpu = not self.device.startswith("cuda")
        return torch.float16 if on_cpu and self.torch_dtype == torch.float32 else self.torch_dtype
