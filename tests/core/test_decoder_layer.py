"""cpu_ops.ops().llama_decode_layer_ (kernels/decoder_layer.cpp), a Llama layer's decode step as
one C++ call, against the layer's modules: the same output bits and the same K/V written, for float32
weights with biases, GGUF blocks and a half-size cache; and decode steps take it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.profiler import profile

from ember_core import LLM
from ember_core.kernels import cpu_ops
from ember_core.models.llama import Llama, LlamaConfig
from ember_core.models.rotary import rope_cos_sin, rope_inv_freq
from ember_core.runner.inputs import SequenceChunk
from ember_core.runner.model_runner import ModelRunner
from tests.core.test_kernels import kernel  # noqa: F401 - the fixture that builds the extension or skips

pytestmark = pytest.mark.usefixtures("kernel")

BLOCK_SIZE = 4
CONTEXT_LENGTHS = (1, 5, 13, 30)  # tokens before the decode: one to several blocks each
TINY = LlamaConfig(
    vocab_size=101, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=96,
    rms_norm_eps=1e-5, attention_bias=True, mlp_bias=True,
)


def _tiny_llama(seed: int = 0) -> Llama:
    torch.manual_seed(seed)
    model = Llama(TINY)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn_like(param) * 0.3 + (1.0 if param.dim() == 1 else 0.0))
    model.inv_freq = rope_inv_freq(TINY.head_dim, TINY.rope_theta)
    return model


def _prefilled_decode_step(runner: ModelRunner, vocab_size: int):
    """Prompts of CONTEXT_LENGTHS tokens in the cache, then one decode step's inputs for all of them."""
    generator = torch.Generator().manual_seed(1)
    blocks_each = -(-(max(CONTEXT_LENGTHS) + 1) // BLOCK_SIZE)
    tables = [list(range(1 + i * blocks_each, 1 + (i + 1) * blocks_each)) for i in range(len(CONTEXT_LENGTHS))]
    for length, table in zip(CONTEXT_LENGTHS, tables):
        prompt = torch.randint(vocab_size, (length,), generator=generator).tolist()
        runner.forward_hidden([SequenceChunk(prompt, 0, table, None)])
    next_tokens = torch.randint(vocab_size, (len(tables),), generator=generator).tolist()
    return runner.prepare([SequenceChunk([t], n, table, None) for t, n, table in zip(next_tokens, CONTEXT_LENGTHS, tables)])


def _assert_fused_layers_match_modules(runner: ModelRunner) -> None:
    model = runner.model
    input_ids, positions, meta = _prefilled_decode_step(runner, model.config.vocab_size)
    assert meta.decodes_only_on_kernel
    hidden = model.embed_tokens(input_ids)
    cos, sin = rope_cos_sin(positions, model.inv_freq, hidden.dtype)
    for layer in model.layers:
        caches = (layer.self_attn.attn.key_cache, layer.self_attn.attn.value_cache)
        before = [cache.clone() for cache in caches]
        expected = layer.forward_modules(hidden, cos, sin, meta)
        written = [cache.clone() for cache in caches]
        for cache, old in zip(caches, before):
            cache.copy_(old)
        fused = layer.forward_fused_(hidden.clone(), cos, sin, meta)
        assert torch.equal(fused, expected)
        assert all(torch.equal(cache, new) for cache, new in zip(caches, written))
        assert not torch.equal(written[0], before[0])  # the step did write its keys
        hidden = expected


@pytest.mark.parametrize("kv_cache_dtype", [torch.float32, torch.float16])
@torch.inference_mode()
def test_float32_weights_with_biases(kv_cache_dtype: torch.dtype) -> None:
    runner = ModelRunner(_tiny_llama(), num_blocks=64, block_size=BLOCK_SIZE, kv_cache_dtype=kv_cache_dtype)
    _assert_fused_layers_match_modules(runner)


@torch.inference_mode()
def test_gguf_blocks(smollm2_gguf_path: Path) -> None:
    llm = LLM(str(smollm2_gguf_path), dtype="float32", block_size=BLOCK_SIZE, num_blocks=64)
    _assert_fused_layers_match_modules(llm.engine.runner)


@torch.inference_mode()
def test_decode_steps_run_each_layer_as_one_call_and_prefills_do_not() -> None:
    runner = ModelRunner(_tiny_llama(), num_blocks=64, block_size=BLOCK_SIZE)
    table = [1, 2, 3]
    steps = {
        "prefill": [SequenceChunk([3, 4, 5], 0, table, None)],
        "decode": [SequenceChunk([6], 3, table, None)],
        "mixed": [SequenceChunk([7], 4, table, None), SequenceChunk([8, 9], 0, [4], None)],
    }
    calls = {}
    fused_layer = f"{cpu_ops.active_instruction_set().op_namespace}::llama_decode_layer_"
    for name, chunks in steps.items():
        with profile() as prof:
            runner.forward_hidden(chunks)
        calls[name] = sum(event.count for event in prof.key_averages() if event.key == fused_layer)
    assert calls == {"prefill": 0, "decode": TINY.num_layers, "mixed": 0}


@torch.inference_mode()
def test_bad_operands_are_rejected_before_the_cache_changes() -> None:
    runner = ModelRunner(_tiny_llama(), num_blocks=64, block_size=BLOCK_SIZE)
    input_ids, positions, meta = _prefilled_decode_step(runner, TINY.vocab_size)
    layer = runner.model.layers[0]
    hidden = runner.model.embed_tokens(input_ids)
    cos, sin = rope_cos_sin(positions, runner.model.inv_freq, hidden.dtype)
    attention, mlp = layer.self_attn, layer.mlp
    weights = [attention.qkv_proj.weight, attention.o_proj.weight, mlp.gate_up_proj.weight, mlp.down_proj.weight]
    key_cache = attention.attn.key_cache
    before = key_cache.clone()

    def call(weights: list[torch.Tensor], num_heads: int = TINY.num_heads) -> None:
        cpu_ops.ops().llama_decode_layer_(
            hidden.clone(), layer.input_layernorm.weight, layer.post_attention_layernorm.weight, 1e-5,
            weights, [None] * len(weights), [-1] * len(weights), cos, sin, key_cache, attention.attn.value_cache,
            meta.slot_mapping, meta.decode_block_tables, meta.decode_context_lens, num_heads, 0.25,
        )

    with pytest.raises(RuntimeError, match="must each hold qkv, o, gate_up and down"):
        call(weights[:3])
    with pytest.raises(RuntimeError, match="the qkv projection gives 128 columns, expected"):
        call(weights, num_heads=2)
    assert torch.equal(key_cache, before)
