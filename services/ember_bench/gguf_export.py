"""A Hugging Face checkpoint directory -> one GGUF file, written as llama.cpp's convert_hf_to_gguf.py
writes it (the per-family rules are in gguf_families.py, the tokenizer in gguf_vocab.py).

Tensor types follow convert_hf_to_gguf.py: 1-d tensors, norms and biases stay F32; every other
weight takes the file type. The 4- and 5-bit types, which convert leaves to llama-quantize, are
written as `llama-quantize --pure` writes them: the one type for every such weight, with no
Q6_K output. A weight whose rows are not a whole number of quantization blocks falls back to
F16, as both tools do. Tensors are converted and written one at a time, so a 0.5B model never
sits in memory whole.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors import safe_open

from ember_bench.gguf_families import Config, GGUFFamily, family_of
from ember_bench.gguf_vocab import add_tokenizer

FILE_TYPES: dict[str, tuple[gguf.LlamaFileType, gguf.GGMLQuantizationType]] = {
    "F32": (gguf.LlamaFileType.ALL_F32, gguf.GGMLQuantizationType.F32),
    "F16": (gguf.LlamaFileType.MOSTLY_F16, gguf.GGMLQuantizationType.F16),
    "BF16": (gguf.LlamaFileType.MOSTLY_BF16, gguf.GGMLQuantizationType.BF16),
    "Q8_0": (gguf.LlamaFileType.MOSTLY_Q8_0, gguf.GGMLQuantizationType.Q8_0),
    "Q5_1": (gguf.LlamaFileType.MOSTLY_Q5_1, gguf.GGMLQuantizationType.Q5_1),
    "Q5_0": (gguf.LlamaFileType.MOSTLY_Q5_0, gguf.GGMLQuantizationType.Q5_0),
    "Q4_1": (gguf.LlamaFileType.MOSTLY_Q4_1, gguf.GGMLQuantizationType.Q4_1),
    "Q4_0": (gguf.LlamaFileType.MOSTLY_Q4_0, gguf.GGMLQuantizationType.Q4_0),
}
_UNUSED_SUFFIXES = (
    ".attn.bias", ".attn.masked_bias", ".attention.bias", ".attention.masked_bias", ".rotary_emb.inv_freq",
)
_CONV1D_WEIGHTS = (".c_attn.weight", ".c_proj.weight", ".c_fc.weight")
# convert_hf_to_gguf.py keeps these in F32 whatever the file type (the routers: they are small and
# decide which experts run; a recurrent layer's convolution).
_UNQUANTIZED = (
    gguf.MODEL_TENSOR.POS_EMBD, gguf.MODEL_TENSOR.FFN_GATE_INP, gguf.MODEL_TENSOR.FFN_GATE_INP_SHEXP,
    gguf.MODEL_TENSOR.SSM_CONV1D, gguf.MODEL_TENSOR.SHORTCONV_CONV,
)
# A Hugging Face checkpoint's one expert's projection: convert_hf_to_gguf.py stacks the experts of a
# layer into one [experts, rows, columns] tensor.
_EXPERT_TENSOR = re.compile(r"(model\.layers\.\d+\.\w+\.experts)\.(\d+)\.(\w+)\.weight")


@dataclass(frozen=True)
class PlannedTensor:
    name: str
    qtype: gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # numpy order: rows last
    load: Callable[[], np.ndarray]  # float32, transformed


def export_gguf(model_dir: Path, out: Path, file_type: str = "F32") -> Path:
    """Write the checkpoint in model_dir (config.json, safetensors, optional tokenizer.json) to out."""
    model_dir, out = Path(model_dir), Path(out)
    if file_type not in FILE_TYPES:
        raise ValueError(f"unsupported GGUF file type {file_type!r}; supported: {', '.join(FILE_TYPES)}")
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    family = family_of(config)
    llama_file_type, default_qtype = FILE_TYPES[file_type]
    plan = plan_tensors(model_dir, config, family, default_qtype)

    writer = gguf.GGUFWriter(path=None, arch=gguf.MODEL_ARCH_NAMES[family.arch])
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(model_dir.name)
    family.write_hparams(config, writer)
    writer.add_file_type(llama_file_type)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    add_tokenizer(writer, model_dir, -(config["vocab_size"] // -family.vocab_multiple) * family.vocab_multiple)
    for tensor in plan:
        dtype, byte_shape = _stored_layout(tensor.shape, tensor.qtype)
        writer.add_tensor_info(
            tensor.name, byte_shape, dtype, int(np.prod(byte_shape)) * dtype.itemsize, raw_dtype=tensor.qtype
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        writer.write_header_to_file(out)
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for tensor in plan:
            writer.write_tensor_data(gguf.quants.quantize(tensor.load(), tensor.qtype))
    finally:
        writer.close()
    return out


def plan_tensors(
    model_dir: Path, config: Config, family: GGUFFamily, default_qtype: gguf.GGMLQuantizationType
) -> list[PlannedTensor]:
    num_layers = config.get("num_hidden_layers") or config["n_layer"]
    name_map = gguf.get_tensor_name_map(family.arch, num_layers)
    # A tied checkpoint may still store lm_head.weight; transformers ignores it, and so does the GGUF.
    tied = config.get("tie_word_embeddings") is True
    plan = [
        PlannedTensor(name, gguf.GGMLQuantizationType.F32, data.shape, lambda data=data: data)
        for name, data in family.extra_tensors(config)
    ]
    # Dense MLPs between sparse ones (Qwen-MoE's mlp_only_layers) take llama's names, which the MoE
    # architectures' maps lack.
    dense_names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, num_layers)
    experts: dict[str, list[tuple[int, Path, str]]] = {}
    checkpoint = _checkpoint_tensors(model_dir)
    for hf_name, (path, shape) in checkpoint.items():
        if hf_name.endswith(_UNUSED_SUFFIXES) or (tied and hf_name == "lm_head.weight"):
            continue
        if hf_name == "lm_head.weight" and family.output_must_be_tied:
            raise ValueError(f"{gguf.MODEL_ARCH_NAMES[family.arch]} GGUF files tie the output to token_embd, "
                             "but this checkpoint has its own lm_head.weight")
        if expert := _EXPERT_TENSOR.fullmatch(hf_name):
            experts.setdefault(f"{expert[1]}.{expert[3]}.weight", []).append((int(expert[2]), path, hf_name))
            continue
        whole = transform(hf_name, torch.empty(shape, device="meta"), config, family)
        for part_name, rows in family.split_tensor(hf_name, config) or [(hf_name, _whole)]:
            kind, name = gguf_name(family.rename(part_name), name_map, dense_names, family)
            part_shape = tuple(rows(whole).shape)
            qtype = _tensor_type(name, kind, part_shape, default_qtype)
            plan.append(PlannedTensor(name, qtype, part_shape, _loader(path, hf_name, config, family, rows)))
    for stacked_name, parts in experts.items():
        parts.sort()
        if [index for index, _, _ in parts] != list(range(len(parts))):
            raise ValueError(f"{stacked_name}: the checkpoint's experts are not numbered 0 to {len(parts) - 1}")
        kind, name = gguf_name(stacked_name, name_map, dense_names, family)
        shape = (len(parts), *checkpoint[parts[0][2]][1])
        plan.append(PlannedTensor(name, _tensor_type(name, kind, shape, default_qtype), shape, _stacked_loader(parts)))
    return plan


def gguf_name(
    hf_name: str, name_map: gguf.TensorNameMap, dense_names: gguf.TensorNameMap, family: GGUFFamily
) -> tuple[gguf.MODEL_TENSOR, str]:
    mapped = name_map.get_type_and_name(hf_name, try_suffixes=(".weight", ".bias"))
    if mapped is None and ".mlp." in hf_name:
        mapped = dense_names.get_type_and_name(hf_name, try_suffixes=(".weight", ".bias"))
    if mapped is None:
        raise ValueError(f"no GGUF tensor name for {hf_name!r} in architecture {gguf.MODEL_ARCH_NAMES[family.arch]}")
    return mapped


def _stacked_loader(parts: list[tuple[int, Path, str]]) -> Callable[[], np.ndarray]:
    def load() -> np.ndarray:
        values = []
        for _, path, hf_name in parts:
            with safe_open(path, framework="pt") as checkpoint:
                values.append(checkpoint.get_tensor(hf_name).to(torch.float32))
        return torch.stack(values).numpy()

    return load


def _tensor_type(
    name: str, kind: gguf.MODEL_TENSOR, shape: tuple[int, ...], default_qtype: gguf.GGMLQuantizationType
) -> gguf.GGMLQuantizationType:
    if len(shape) <= 1 or name.endswith("_norm.weight") or not name.endswith(".weight") or kind in _UNQUANTIZED:
        return gguf.GGMLQuantizationType.F32
    block_size, _ = gguf.GGML_QUANT_SIZES[default_qtype]
    if shape[-1] % block_size != 0:
        return gguf.GGMLQuantizationType.F16
    return default_qtype


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _loader(
    path: Path, hf_name: str, config: Config, family: GGUFFamily, rows: Callable[[torch.Tensor], torch.Tensor]
) -> Callable[[], np.ndarray]:
    def load() -> np.ndarray:
        with safe_open(path, framework="pt") as checkpoint:
            data = checkpoint.get_tensor(hf_name).to(torch.float32)
        return rows(transform(hf_name, data, config, family)).contiguous().numpy()

    return load


def transform(hf_name: str, data: torch.Tensor, config: Config, family: GGUFFamily) -> torch.Tensor:
    """One checkpoint tensor as the GGUF holds it (float32)."""
    if family.permute_qk and hf_name.endswith(("q_proj.weight", "q_proj.bias")):
        data = llama_rope_permute(data, config["num_attention_heads"])
    elif family.permute_qk and hf_name.endswith(("k_proj.weight", "k_proj.bias")):
        data = llama_rope_permute(data, config.get("num_key_value_heads") or config["num_attention_heads"])
    if family.norm_shift and hf_name.endswith("norm.weight"):
        data = data + family.norm_shift
    if family.conv1d_weights and hf_name.endswith(_CONV1D_WEIGHTS):
        data = data.T
    if family.reshape_tensor is not None:
        data = family.reshape_tensor(hf_name, data, config)
    return data.contiguous()


def llama_rope_permute(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Reorder each head's rows from HF's rotate-half layout [x0..x(d/2-1), y0..] to the
    interleaved pairs [x0, y0, x1, y1, ...] that llama.cpp's llama rope rotates."""
    head_rows = weight.shape[0] // num_heads
    return (
        weight.reshape(num_heads, 2, head_rows // 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)
    )


def _stored_layout(shape: tuple[int, ...], qtype: gguf.GGMLQuantizationType) -> tuple[np.dtype, tuple[int, ...]]:
    if qtype == gguf.GGMLQuantizationType.F32:
        return np.dtype(np.float32), shape
    if qtype == gguf.GGMLQuantizationType.F16:
        return np.dtype(np.float16), shape
    return np.dtype(np.uint8), gguf.quant_shape_to_byte_shape(shape, qtype)


def _checkpoint_tensors(model_dir: Path) -> dict[str, tuple[Path, tuple[int, ...]]]:
    """Every tensor name -> (its safetensors file, its shape), read from the headers only."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        paths = [model_dir / name for name in files]
    else:
        paths = sorted(model_dir.glob("*.safetensors"))
    if not paths:
        raise ValueError(f"{model_dir} has no .safetensors weights")
    tensors = {}
    for path in paths:
        with safe_open(path, framework="pt") as checkpoint:
            for name in checkpoint.keys():  # noqa: SIM118 - safe_open has keys(), no iteration
                tensors[name] = (path, tuple(checkpoint.get_slice(name).get_shape()))
    return tensors
