"""ember_core: the engine library. Heavy imports (torch) happen on first use, so the
torch-free parts (tokenizer) can be imported by the gateway."""

from typing import Any

__all__ = ["LLM", "CompletionOutput", "EngineConfig", "LoRARequest", "RequestOutput", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name in ("LLM", "RequestOutput", "CompletionOutput"):
        from ember_core import llm

        return getattr(llm, name)
    if name == "SamplingParams":
        from ember_core.sampling_params import SamplingParams

        return SamplingParams
    if name == "LoRARequest":
        from ember_core.lora.request import LoRARequest

        return LoRARequest
    if name == "EngineConfig":
        from ember_core.config import EngineConfig

        return EngineConfig
    raise AttributeError(f"module 'ember_core' has no attribute {name!r}")
