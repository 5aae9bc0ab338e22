"""The engine's command-line flags, each also read from EMBER_<FLAG>: the same EngineConfig fields
as LLM(**kwargs), for `ember generate`, `ember serve` and `ember-engine`."""

from __future__ import annotations

import argparse
import os

from ember_core.config import DECODE_ATTENTION, DEFAULT_MODEL, KV_CACHE_DTYPES, LORA_DTYPES, NUMERICS, EngineConfig
from ember_core.config_flags import env_default, env_name, env_switch
from ember_core.speculative_config import speculative_config


def _env_list(name: str) -> list[str]:
    """A list flag's environment variable: entries separated by spaces."""
    return os.environ.get(env_name(name), "").split()


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = EngineConfig()
    parser.add_argument("--model", default=env_default("model", DEFAULT_MODEL), help="local dir, .gguf file, hub repo id or short name")
    parser.add_argument("--block-size", type=int, default=env_default("block_size", defaults.block_size))
    parser.add_argument("--num-blocks", type=int, default=env_default("num_blocks", None),
                        help="KV pool size in blocks (overrides --kv-cache-mib)")
    parser.add_argument("--kv-cache-mib", type=float, default=env_default("kv_cache_mib", defaults.kv_cache_mib))
    parser.add_argument("--max-num-seqs", type=int, default=env_default("max_num_seqs", defaults.max_num_seqs))
    parser.add_argument("--max-num-batched-tokens", type=int,
                        default=env_default("max_num_batched_tokens", defaults.max_num_batched_tokens))
    parser.add_argument("--max-model-len", type=int, default=env_default("max_model_len", None))
    parser.add_argument("--admission", choices=["preempt", "reserve"], default=env_default("admission", defaults.admission))
    parser.add_argument("--batching", choices=["continuous", "static"], default=env_default("batching", defaults.batching))
    parser.add_argument("--device", default=env_default("device", None), help="cuda, mps or cpu (default: detected)")
    parser.add_argument("--dtype", default=env_default("dtype", None), help="float32, bfloat16, float16 or auto (on a CPU: by its kernels' build and the numerics, a fixed table)")
    parser.add_argument("--gguf-weights", choices=["blocks", "dequantized"], default=env_default("gguf_weights", defaults.gguf_weights),
                        help="float32 on CPU: keep GGUF Q4_0-Q8_0/Q2_K-Q6_K blocks and 16-bit weights as stored (default; same outputs) or expand them at load")
    parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=env_default("kv_cache_dtype", defaults.kv_cache_dtype),
                        help="K/V storage; auto = the model's dtype. float16 or bfloat16 halve a float32 model's "
                             "cache (rounded K/V)")
    parser.add_argument("--decode-attention", choices=DECODE_ATTENTION, default=env_default("decode_attention", defaults.decode_attention),
                        help="auto = ember's C++ kernel on CPU, FlexAttention elsewhere if it passes its start-up "
                             "check, else SDPA over gathered blocks")
    parser.add_argument("--scheduling-policy", choices=["fcfs", "priority"],
                        default=env_default("scheduling_policy", defaults.scheduling_policy),
                        help="fcfs: arrival order (a request's non-zero priority is refused); priority: lower "
                             "`priority` first, preempting lower-priority requests when the KV pool is full")
    parser.add_argument("--priority-aging-s", type=float, default=env_default("priority_aging_s", defaults.priority_aging_s),
                        help="under --scheduling-policy priority: a request waiting this long ranks ahead of all "
                             "that have not, whatever their priority (no request waits forever)")
    parser.add_argument("--speculative-config", type=_speculative_config_text, default=env_default("speculative_config", None),
                        help='n-gram speculative decoding as vLLM spells it: \'{"method": "ngram", '
                             '"num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}\' '
                             '(also "disable_by_batch_size": no drafts while more sequences run; default 4)')
    parser.add_argument("--task", choices=["generate", "embed"], default=env_default("task", defaults.task),
                        help="generate: completions, chat and embeddings; embed: embeddings only (generation "
                             "requests are refused)")
    parser.add_argument("--numerics", choices=NUMERICS, default=env_default("numerics", defaults.numerics),
                        help="the linears' arithmetic: exact (the weights' values in --dtype, bit-identical to the "
                             "dequantized model), fast (activations quantized to int8 times the weights' integers, as "
                             "llama.cpp; float checkpoints are quantized to Q8_0 at load), auto (fast for a quantized "
                             "GGUF file, else exact); either way batch-invariant")
    parser.add_argument("--enable-lora", action=argparse.BooleanOptionalAction,
                        default=env_switch("enable_lora", defaults.enable_lora),
                        help="serve LoRA adapters over the model, rows of different adapters in one batch")
    parser.add_argument("--max-loras", type=int, default=env_default("max_loras", defaults.max_loras),
                        help="adapters that run at once, from as many slots (with --enable-lora); more may be loaded, a "
                             "request whose adapter has no slot waits for the least recently used free one")
    parser.add_argument("--max-lora-rank", type=int, default=env_default("max_lora_rank", defaults.max_lora_rank),
                        help="the highest rank an adapter may have (with --enable-lora)")
    parser.add_argument("--lora-dtype", choices=LORA_DTYPES, default=env_default("lora_dtype", defaults.lora_dtype),
                        help="the adapters' weights: auto = the model's dtype; bfloat16 halves what a float32 model's "
                             "adapters read each step (their values rounded)")
    parser.add_argument("--lora-modules", nargs="+", default=_env_list("lora_modules"), metavar="NAME=PATH",
                        help="adapters to load at start, each served as the model NAME (turns --enable-lora on): a "
                             "PEFT checkpoint's directory or Hub repo id, or a llama.cpp LoRA .gguf (a file, or "
                             "owner/repo/file.gguf on the Hub)")
    parser.add_argument("--allow-runtime-lora-updating", action=argparse.BooleanOptionalAction,
                        default=env_switch("allow_runtime_lora_updating", defaults.allow_runtime_lora_updating),
                        help="let clients load and unload adapters while serving (POST /v1/load_lora_adapter and "
                             "/v1/unload_lora_adapter; default off: those routes do not exist), from --lora-dir only")
    parser.add_argument("--lora-dir", nargs="+", action="extend", default=_env_list("lora_dir"), metavar="DIR",
                        help="a directory runtime adapter loads may read from (repeatable); a lora_path must resolve "
                             "inside one, symlinks followed")
    parser.add_argument("--allow-lora-from-hub", action=argparse.BooleanOptionalAction,
                        default=env_switch("allow_lora_from_hub", defaults.allow_lora_from_hub),
                        help="let runtime adapter loads name Hugging Face Hub ids (the engine then downloads what a "
                             "client names); --lora-modules always may")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int,
                        default=env_default("tensor_parallel_size", defaults.tensor_parallel_size),
                        help="split the model's layers over this many processes (gloo on CPU); on one host the engine "
                             "starts them, across hosts torchrun does (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)")
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                        default=env_switch("enable_prefix_caching", defaults.enable_prefix_caching),
                        help="reuse the cached K/V of prompt prefixes computed before (default: on)")


def _speculative_config_text(value: str) -> str:
    """The flag's JSON text, checked here so that a bad one is a one-line usage error."""
    try:
        speculative_config(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


def engine_kwargs_from_args(args: argparse.Namespace) -> dict:
    return {name: getattr(args, name) for name in EngineConfig.field_names()}
