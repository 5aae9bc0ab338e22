"""Engine configuration: one frozen dataclass that CLI flags, env vars and LLM(**kwargs) map onto."""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal

from ember_core.speculative_config import SpeculativeConfig, speculative_config

DEFAULT_MODEL = "smollm2-135m-instruct"

Admission = Literal["preempt", "reserve"]
Batching = Literal["continuous", "static"]
SchedulingPolicy = Literal["fcfs", "priority"]
GGUFWeights = Literal["blocks", "dequantized"]
DecodeAttention = Literal["auto", "kernel", "flex", "sdpa"]
Task = Literal["generate", "embed"]
LoRADtype = Literal["auto", "float32", "bfloat16"]
LORA_DTYPES: tuple[LoRADtype, ...] = ("auto", "float32", "bfloat16")
Numerics = Literal["auto", "exact", "fast"]  # ember_core/numerics.py
NUMERICS: tuple[Numerics, ...] = ("auto", "exact", "fast")
KV_CACHE_DTYPES = ("auto", "float32", "float16", "bfloat16", "int8", "fp8_e4m3")
DECODE_ATTENTION: tuple[DecodeAttention, ...] = ("auto", "kernel", "flex", "sdpa")


def lora_module(entry: str) -> tuple[str, str]:
    """A --lora-modules entry, "name=path", as (name, path)."""
    name, _, path = entry.partition("=")
    return name.strip(), path.strip()


@dataclass(frozen=True)
class EngineConfig:
    model: str = DEFAULT_MODEL
    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_mib: float = 512  # SmolLM2 in float32: 11,650 tokens, its whole 8192 context and more
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None
    admission: Admission = "preempt"
    batching: Batching = "continuous"
    device: str | None = None
    dtype: str | None = None  # None / "auto": ember_core/auto_dtype.py's table on a CPU, bfloat16 on a GPU
    # "blocks": a float32 CPU model keeps a GGUF file's Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q2_K to
    # Q6_K / IQ4_NL / IQ4_XS blocks and the 16-bit rows of bfloat16 / float16 weights (any checkpoint) as
    # stored: the same outputs, 2-7x less memory traffic. "dequantized" expands them at load.
    gguf_weights: GGUFWeights = "blocks"
    # "auto": the model's dtype. A float32 model may keep float16 or bfloat16 K/V: half the cache
    # memory and half the bytes decode attention streams, at the cost of rounding K and V. "int8" and
    # "fp8_e4m3" keep 8-bit codes with a float16 scale per token and KV head (layers/kv_quant.py):
    # 1.94x the tokens of a bfloat16 cache at head_dim 64, 3.9x those of float32.
    kv_cache_dtype: str = "auto"
    # "auto": ember's C++ kernel on CPU, FlexAttention elsewhere when it compiles and matches SDPA
    # at start, else SDPA over gathered blocks.
    decode_attention: DecodeAttention = "auto"
    # Reuse the cached K/V of a prompt's longest prefix computed before (shared system prompts,
    # chat turns, retries); the same tokens as without it.
    enable_prefix_caching: bool = True
    # "fcfs": requests run in arrival order and must not ask for a priority; "priority": by (priority,
    # arrival), lower first, preempting lower-priority running requests when the pool is full. A
    # request waiting priority_aging_s seconds ranks ahead of all that have not (starvation bound).
    scheduling_policy: SchedulingPolicy = "fcfs"
    priority_aging_s: float = 60.0
    # n-gram speculative decoding: a SpeculativeConfig, or its JSON text or dict (vLLM's spelling);
    # None: off.
    speculative_config: SpeculativeConfig | dict[str, Any] | str | None = None
    # "generate": completions and chat, and embeddings by the model's pooling; "embed": embeddings
    # only (vLLM's pooling runner), generation requests refused.
    task: Task = "generate"
    # The linears' arithmetic (ember_core/numerics.py): "exact" (the weights' values in the model's
    # dtype), "fast" (int8 activations times the weights' integers), "auto" (fast for a quantized
    # GGUF file on the CPU kernels, exact for float checkpoints).
    numerics: Numerics = "auto"
    # LoRA adapters over the model (vLLM's --enable-lora, --max-loras, --max-lora-rank): max_loras
    # run at once from as many slots of the attention and MLP linears (lora/slots.py), each of rank
    # max_lora_rank at most.
    enable_lora: bool = False
    max_loras: int = 4
    max_lora_rank: int = 16
    # The adapters' A and B (vLLM's --lora-dtype): "auto" the model's dtype; "bfloat16" halves what a
    # float32 model's adapters read each step, their values rounded. Their products sum in float32.
    lora_dtype: LoRADtype = "auto"
    # Adapters loaded at start, "name=path" each (lora/files.py: a PEFT checkpoint or a llama.cpp
    # LoRA GGUF, by path or from the Hub); any turns enable_lora on.
    lora_modules: tuple[str, ...] = ()
    # Adapters loaded and unloaded while serving, by gateways (POST /v1/load_lora_adapter): refused
    # unless allow_runtime_lora_updating; a local path must resolve inside one of lora_dir, a Hub id
    # needs allow_lora_from_hub (lora/sources.py). lora_modules are the operator's and load from anywhere.
    allow_runtime_lora_updating: bool = False
    lora_dir: tuple[str, ...] = ()
    allow_lora_from_hub: bool = False
    # Tensor parallelism (vLLM's --tensor-parallel-size): the model's layers split over this many
    # processes (parallel/), started by the engine on this host, or by torchrun across hosts.
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "speculative_config", speculative_config(self.speculative_config))
        object.__setattr__(self, "lora_modules", tuple(self.lora_modules))
        object.__setattr__(self, "lora_dir", tuple(self.lora_dir))
        missing = next((directory for directory in self.lora_dir if not Path(directory).expanduser().is_dir()), None)
        if missing is not None:
            raise ValueError(f"lora_dir {missing!r} is not a directory")
        bad = next((module for module in self.lora_modules if not lora_module(module)[0] or not lora_module(module)[1]), None)
        if bad is not None:
            raise ValueError(f"lora_modules takes name=path entries, got {bad!r}")
        if self.lora_modules:
            object.__setattr__(self, "enable_lora", True)
        if self.enable_lora and self.tensor_parallel_size != 1:
            raise ValueError("LoRA adapters are not split across tensor-parallel ranks yet: use tensor_parallel_size 1")
        if self.lora_dtype not in LORA_DTYPES:
            raise ValueError(f"lora_dtype must be one of {', '.join(LORA_DTYPES)}, got {self.lora_dtype!r}")
        if not self.model:
            raise ValueError("model must name a model: a local directory, a .gguf file, a hub repo id or a short name")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_loras", "max_lora_rank", "tensor_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.num_blocks is not None and (not isinstance(self.num_blocks, int) or self.num_blocks < 1):
            raise ValueError(f"num_blocks must be an integer >= 1, got {self.num_blocks!r}")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 1):
            raise ValueError(f"max_model_len must be an integer >= 1, got {self.max_model_len!r}")
        if self.kv_cache_mib <= 0:
            raise ValueError(f"kv_cache_mib must be > 0, got {self.kv_cache_mib}")
        if self.admission not in ("preempt", "reserve"):
            raise ValueError(f"admission must be 'preempt' or 'reserve', got {self.admission!r}")
        if self.batching not in ("continuous", "static"):
            raise ValueError(f"batching must be 'continuous' or 'static', got {self.batching!r}")
        if self.gguf_weights not in ("blocks", "dequantized"):
            raise ValueError(f"gguf_weights must be 'blocks' or 'dequantized', got {self.gguf_weights!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(  # noqa: TRY004 - every config error is a ValueError: bad input, one line
                f"enable_prefix_caching must be a bool, got {self.enable_prefix_caching!r}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}")
        if not self.priority_aging_s > 0:
            raise ValueError(f"priority_aging_s must be > 0, got {self.priority_aging_s}")
        if self.task not in ("generate", "embed"):
            raise ValueError(f"task must be 'generate' or 'embed', got {self.task!r}")
        if self.numerics not in NUMERICS:
            raise ValueError(f"numerics must be one of {', '.join(NUMERICS)}, got {self.numerics!r}")
        if self.decode_attention not in DECODE_ATTENTION:
            raise ValueError(f"decode_attention must be one of {', '.join(DECODE_ATTENTION)}, got {self.decode_attention!r}")

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]
