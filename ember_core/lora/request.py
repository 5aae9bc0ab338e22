"""A request's adapter, as vLLM names it: `LLM.generate(..., lora_request=LoRARequest(name, id, path))`."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    lora_name: str  # what requests name it by (the server's `model`)
    lora_int_id: int  # vLLM's; any positive integer, unique per adapter
    lora_path: str  # a PEFT checkpoint's directory, or a Hub repo id
