"""A PEFT LoRA checkpoint -> llama.cpp's LoRA GGUF, as convert_lora_to_gguf.py writes it:
general.type "adapter", adapter.type "lora", adapter.lora.alpha, and for each adapted module
"<base tensor>.lora_a" (A, [rank, in]) and "<base tensor>.lora_b" (B, [out, rank]), B's rows
transformed as the base tensor's are (llama's q and k interleaved)."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import load_file

from ember_bench.gguf_export import FILE_TYPES, gguf_name, transform
from ember_bench.gguf_families import family_of

_PREFIX = "base_model.model."


def export_lora_gguf(adapter_dir: Path, model_dir: Path, out: Path, file_type: str = "F16") -> Path:
    """Write the adapter in adapter_dir, trained on the checkpoint in model_dir, to out."""
    adapter_dir, model_dir, out = Path(adapter_dir), Path(model_dir), Path(out)
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    lora = json.loads((adapter_dir / "adapter_config.json").read_text(encoding="utf-8"))
    family = family_of(config)
    num_layers = config["num_hidden_layers"]
    names = gguf.get_tensor_name_map(family.arch, num_layers)
    dense_names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, num_layers)
    qtype = FILE_TYPES[file_type][1]
    writer = gguf.GGUFWriter(path=out, arch=gguf.MODEL_ARCH_NAMES[family.arch])
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(lora["lora_alpha"]))
    for key, tensor in sorted(load_file(adapter_dir / "adapter_model.safetensors").items()):
        if key.endswith(".base_layer.weight"):  # an adapted head's own weight, skipped as convert does
            continue
        module, _, kind = key.removeprefix(_PREFIX).rpartition(".lora_")
        _, base = gguf_name(f"{module}.weight", names, dense_names, family)
        values = tensor.to(torch.float32)
        if kind == "B.weight":
            values = transform(f"{module}.weight", values, config, family)
        data = gguf.quants.quantize(np.ascontiguousarray(values.numpy()), qtype)
        writer.add_tensor(f"{base}.lora_{'a' if kind == 'A.weight' else 'b'}", data, raw_dtype=qtype)
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()
    return out
