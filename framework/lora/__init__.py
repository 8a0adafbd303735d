"""LoRA adapters: many adapters over one base model, mixed in a batch.

- `request.py`: `LoRARequest(lora_name, lora_int_id, lora_path)`, what a request names;
- `peft_adapter.py`: reading and checking an adapter in PEFT's format;
- `manager.py`: the worker's adapter slots (`--max-loras`), LRU eviction, the adapters
  kept loaded in host memory (`--max-cpu-loras`) and each step's token -> slot mapping.

The layers that carry adapters (models/layers/lora.py) add their LoRA term through the
`lora_linear` op, which platforms implement like any other op.
"""

from .request import LoRARequest

__all__ = ["LoRARequest"]
