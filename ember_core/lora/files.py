"""An adapter's file, whichever kind: a PEFT checkpoint or a llama.cpp LoRA GGUF."""

from __future__ import annotations

from ember_core.lora.errors import AdapterError
from ember_core.lora.gguf_files import read_gguf_adapter
from ember_core.lora.peft_files import read_peft_adapter
from ember_core.lora.sources import AdapterSource
from ember_core.lora.weights import AdapterWeights
from ember_core.models.decoder_config import DecoderConfig
from ember_core.models.gpt2_config import GPT2Config


def read_adapter(source: AdapterSource, config: DecoderConfig | GPT2Config) -> AdapterWeights:
    """A .gguf path (a file, or owner/repo/file.gguf on the Hub) is llama.cpp's format; anything else
    a PEFT checkpoint (a directory, or a Hub repo id)."""
    if source.path.endswith(".gguf"):
        if isinstance(config, GPT2Config):
            raise AdapterError("llama.cpp LoRA GGUF adapters serve the model families ember reads from GGUF, not GPT-2")
        return read_gguf_adapter(source, config)
    return read_peft_adapter(source)
