"""Low-rank adapters (LoRA) served over one base model: read from PEFT checkpoints, held in slots of
the model's linears, each request's rows computed with its own (layers/lora.py)."""

from ember_core.lora.request import LoRARequest

__all__ = ["LoRARequest"]
