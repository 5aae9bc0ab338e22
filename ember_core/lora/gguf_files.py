"""A llama.cpp LoRA adapter in GGUF, as convert_lora_to_gguf.py writes it, by path or from the Hub
("owner/repo/file.gguf"): general.type "adapter", adapter.type "lora" and adapter.lora.alpha, and for
each adapted tensor of the base file "<tensor>.lora_a" [rank, in] and "<tensor>.lora_b" [out, rank],
B's rows in the base file's order (llama's q and k interleaved). llama.cpp scales a delta by
alpha / rank, and by 1 when alpha is 0."""

from __future__ import annotations

import logging
from pathlib import Path

import gguf

from ember_core.loaders.gguf_config import gguf_family, metadata
from ember_core.loaders.gguf_tensors import dequantize, hf_name, in_hf_row_order
from ember_core.lora.errors import AdapterError
from ember_core.lora.sources import AdapterSource
from ember_core.lora.weights import AdapterWeights
from ember_core.models.decoder_config import DecoderConfig
from ember_core.models.family import Family

logger = logging.getLogger(__name__)


def _file(source: AdapterSource) -> Path:
    parts = source.path.split("/")
    if not source.from_hub or len(parts) < 3:
        local = Path(source.path).expanduser()
        if not local.is_file():
            problem = "is not a file" if local.exists() else "does not exist"
            raise AdapterError(f"{source.path} {problem} (expected a GGUF file, or owner/repo/file.gguf on the Hub)")
        return local
    from huggingface_hub import hf_hub_download

    try:
        return Path(hf_hub_download("/".join(parts[:2]), "/".join(parts[2:])))
    except Exception as exc:
        logger.warning("fetching adapter %s from the Hugging Face Hub failed: %s: %s", source.path, type(exc).__name__, exc)
        raise AdapterError(f"{source.path} could not be fetched from the Hugging Face Hub") from exc


def _fits(architecture: str, adapter_family: Family, family: Family) -> bool:
    # llama.cpp writes Mistral's and Mixtral's files as llama (q and k interleaved alike)
    return adapter_family.name == family.name or (architecture == "llama" and family.gguf_permuted_qk)


def read_gguf_adapter(source: AdapterSource, config: DecoderConfig) -> AdapterWeights:
    """The adapter's weights, their names and rows as the model's checkpoint has them; AdapterError
    for a file that is not such an adapter, or not one for this model's architecture."""
    file = _file(source)
    try:
        reader = gguf.GGUFReader(file)
    except (ValueError, OSError, IndexError, KeyError, OverflowError) as exc:  # what gguf's parser raises on bad bytes
        logger.warning("adapter %s: not a readable GGUF file: %s", source.path, exc)
        raise AdapterError(f"{file.name} is not a GGUF file (or a truncated one)") from exc
    if metadata(reader, "general.type", None) != "adapter" or metadata(reader, "adapter.type", None) != "lora":
        raise AdapterError(f"{file.name} is not a llama.cpp LoRA adapter (general.type 'adapter', adapter.type 'lora')")
    architecture, adapter_family = gguf_family(reader)
    if not _fits(architecture, adapter_family, config.family):
        raise AdapterError(f"adapter {file.name} is for a {architecture} model, not this {config.family.name} model")
    pairs: dict[str, dict[str, gguf.ReaderTensor]] = {}
    for tensor in reader.tensors:
        base, _, kind = tensor.name.rpartition(".lora_")
        if kind not in ("a", "b"):
            raise AdapterError(f"adapter {file.name}: {tensor.name!r} is not a LoRA tensor (trained norms are not supported)")
        pairs.setdefault(base, {})[kind] = tensor
    weights, ranks = {}, set()
    for base, pair in pairs.items():
        if set(pair) != {"a", "b"}:
            raise AdapterError(f"adapter {file.name}: {base} needs both lora_a and lora_b")
        name = hf_name(base, config.family)
        a, b = dequantize(pair["a"]), in_hf_row_order(name, dequantize(pair["b"]), config)
        if a.shape[0] != b.shape[1]:
            raise AdapterError(f"adapter {file.name}: {base} has lora_a {tuple(a.shape)} and lora_b {tuple(b.shape)}")
        ranks.add(a.shape[0])
        weights[name.removesuffix(".weight")] = (a, b)
    if len(ranks) != 1:
        raise AdapterError(f"adapter {file.name}: a rank per tensor ({sorted(ranks)}) is not supported")
    rank, alpha = ranks.pop(), float(metadata(reader, "adapter.lora.alpha", 0.0))
    return AdapterWeights(rank, alpha / rank if alpha else 1.0, weights)
