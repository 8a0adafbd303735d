"""What a request names when it runs with an adapter (vLLM's `LoRARequest`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """An adapter: `lora_name` (what clients call it), `lora_int_id` (a positive id, unique
    per adapter: the engine keys slots, caches and prefix hashes by it) and `lora_path`
    (a PEFT adapter folder: adapter_config.json and adapter_model.safetensors)."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive integer, got {self.lora_int_id!r}")
        if not self.lora_name:
            raise ValueError("lora_name must not be empty")
