"""LoRARequest: which LoRA adapter a request runs under, as vLLM names it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """An adapter by name, a positive integer id unique to it in the engine (the prefix cache keys its
    blocks by the id), and the folder of its PEFT files (adapter_config.json, adapter_model.safetensors)."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        lora_int_id = self.lora_int_id
        if not isinstance(lora_int_id, int) or isinstance(lora_int_id, bool) or lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive integer, got {self.lora_int_id!r}")
        if not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
