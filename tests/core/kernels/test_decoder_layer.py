"""cpu_ops.ops().decoder_layer_ (kernels/decoder_layer.cpp), a decoder layer's decode step as one
C++ call, against the layer's modules: the same output bits and the same K/V written, for every
family's switches (norms before and after, q/k norms, biases, GeGLU, partial rotary, windows,
soft-caps), float32 weights with biases, GGUF blocks (mixed-format K-quant linears too, in both
numerics), a half-size cache, LoRA adapters on some rows, and a tensor-parallel rank's layer (the
call stops at o's output, which the ranks add up); and decode steps take it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.profiler import profile

from ember_core import LLM
from ember_core.kernels import cpu_ops
from ember_core.layers.linear import StackedBlockLinear
from ember_core.loaders import load_model
from ember_core.lora.slots import AdapterSlots
from ember_core.lora.weights import AdapterWeights
from ember_core.models.decoder import Decoder
from ember_core.parallel.group import join, leave
from ember_core.runner.inputs import SequenceChunk
from ember_core.runner.model_runner import ModelRunner
from tests.families import FAMILIES, write_checkpoint
from tests.processes import free_port

pytestmark = pytest.mark.usefixtures("kernel")

BLOCK_SIZE = 4
KQUANTS = Path(__file__).parents[1] / "data" / "kquants"
CONTEXT_LENGTHS = (1, 5, 13, 30)  # tokens before the decode: one to several blocks each, past the windows


def tiny_model(family: str, tmp_path: Path, dtype: torch.dtype = torch.float32) -> Decoder:
    write_checkpoint(family, tmp_path / family)
    return load_model(str(tmp_path / family), torch.device("cpu"), dtype, compact_weights=False).model


def _prefilled_decode_step(runner: ModelRunner, vocab_size: int):
    """Prompts of CONTEXT_LENGTHS tokens in the cache, then one decode step's inputs for all of them."""
    generator = torch.Generator().manual_seed(1)
    blocks_each = -(-(max(CONTEXT_LENGTHS) + 1) // BLOCK_SIZE)
    num_groups = len(runner.layout.group_windows)
    tables = []
    for i in range(len(CONTEXT_LENGTHS)):
        first = 1 + i * blocks_each * num_groups
        tables.append([list(range(first + g * blocks_each, first + (g + 1) * blocks_each)) for g in range(num_groups)])
    for length, table in zip(CONTEXT_LENGTHS, tables):
        prompt = torch.randint(vocab_size, (length,), generator=generator).tolist()
        runner.forward_hidden([SequenceChunk(prompt, 0, table, num_prompt_tokens=length)])
    next_tokens = torch.randint(vocab_size, (len(tables),), generator=generator).tolist()
    chunks = [SequenceChunk([t], n, table, num_prompt_tokens=n) for t, n, table in zip(next_tokens, CONTEXT_LENGTHS, tables)]
    return runner.prepare(chunks)


def _layer_inputs(model: Decoder, input_ids: torch.Tensor, positions: torch.Tensor, meta):
    """The first layer's input and every rope's cos / sin, as Decoder.forward computes them."""
    hidden = model.embed_tokens(input_ids)
    if model.config.embedding_scale is not None:
        hidden = hidden * torch.tensor(model.config.embedding_scale).to(hidden.dtype)
    tables = {
        rope: rope.cos_sin(positions, hidden.dtype, rope.use_long_table(positions, meta.prompt_lengths)) for rope in model.ropes
    }
    return hidden, tables


def _assert_fused_layers_match_modules(runner: ModelRunner, row_slots: list[int] | None = None) -> None:
    """row_slots: each decode row's LoRA slot (-1: none), with AdapterSlots over the model."""
    model = runner.model
    input_ids, positions, meta = _prefilled_decode_step(runner, model.config.vocab_size)
    assert meta.decodes_only_on_kernel
    if row_slots is not None:
        runner.adapter_rows.set(row_slots, input_ids.device)
        meta.adapters = True
    hidden, tables = _layer_inputs(model, input_ids, positions, meta)
    for layer in model.layers:
        cos, sin = tables[layer.rope]
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


@pytest.mark.parametrize("family", sorted(FAMILIES))
@torch.inference_mode()
def test_every_family_s_layer(family: str, tmp_path: Path) -> None:
    _assert_fused_layers_match_modules(ModelRunner(tiny_model(family, tmp_path), num_blocks=256, block_size=BLOCK_SIZE))


@pytest.mark.parametrize("family", ["llama", "gemma2", "phi3", "qwen2_moe"])
@torch.inference_mode()
def test_a_tensor_parallel_rank_s_layer(family: str, tmp_path: Path) -> None:
    """A rank of a one-rank group: the same split path as N ranks (the attention's and the MLP's
    calls, each to its partial output, and the sums), with every rank's part in this process."""
    write_checkpoint(family, tmp_path / family)
    parallel = join(0, 1, f"127.0.0.1:{free_port()}")
    try:
        model = load_model(str(tmp_path / family), torch.device("cpu"), torch.float32, parallel=parallel).model
        _assert_fused_layers_match_modules(ModelRunner(model, num_blocks=256, block_size=BLOCK_SIZE))
    finally:
        leave()


@pytest.mark.parametrize("kv_cache_dtype", [torch.float32, torch.float16])
@torch.inference_mode()
def test_float32_weights_with_biases(kv_cache_dtype: torch.dtype, tmp_path: Path) -> None:
    model = tiny_model("llama", tmp_path)
    runner = ModelRunner(model, num_blocks=64, block_size=BLOCK_SIZE, kv_cache_dtype=kv_cache_dtype)
    _assert_fused_layers_match_modules(runner)


@torch.inference_mode()
def test_gguf_blocks(smollm2_gguf_path: Path) -> None:
    llm = LLM(str(smollm2_gguf_path), dtype="float32", block_size=BLOCK_SIZE, num_blocks=64)
    _assert_fused_layers_match_modules(llm.engine.runner)


@pytest.mark.parametrize("numerics", ["exact", "fast"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@torch.inference_mode()
def test_mixed_format_linears_of_k_quant_files(numerics: str, dtype: str) -> None:
    """llama-quantize's Q4_K_M stores q/k in Q4_K and v in Q6_K in some layers, and on qwen2's
    320-wide rows falls back to Q5_0 / Q8_0: fused linears of parts in different formats."""
    for name in ("llama-Q4_K_M", "qwen2-Q4_K_M"):
        llm = LLM(str(KQUANTS / f"{name}.gguf"), dtype=dtype, numerics=numerics, block_size=BLOCK_SIZE, num_blocks=64)
        layers = llm.engine.runner.model.layers
        stacked = [layer for layer in layers if isinstance(layer.self_attn.qkv_proj, StackedBlockLinear)]
        assert stacked and all(layer.fused_operands is not None for layer in layers), name
        assert max(layer.fused_operands[4][0] for layer in stacked) > 1  # QKV in parts
        _assert_fused_layers_match_modules(llm.engine.runner)


def _random_adapter(slots: AdapterSlots, rank: int, seed: int, skip: str) -> AdapterWeights:
    """Every target of the model but those whose name holds `skip`, A and B drawn at random."""
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for module, (linear, part) in slots.targets.items():
        if skip not in module:
            a = torch.randn(rank, linear.in_features, generator=generator) / linear.in_features**0.5
            weights[module] = (a, torch.randn(linear.parts[part], rank, generator=generator) / rank)
    return AdapterWeights(rank, 2.0 / rank, weights)


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma2", "phi3", "qwen2_moe"])
@pytest.mark.parametrize("lora_dtype", ["auto", "bfloat16"])
@torch.inference_mode()
def test_lora_adapters_on_some_rows(family: str, lora_dtype: str, tmp_path: Path) -> None:
    """Two adapters of different ranks and targets in slots 0 and 2, and rows of none."""
    runner = ModelRunner(tiny_model(family, tmp_path), num_blocks=256, block_size=BLOCK_SIZE)
    slots = AdapterSlots(runner.model, max_loras=3, max_rank=8, lora_dtype=lora_dtype)
    runner.adapter_rows = slots.rows
    slots.load("first", _random_adapter(slots, 8, seed=1, skip="k_proj"))
    slots.load("second", _random_adapter(slots, 3, seed=2, skip="mlp"))
    slots.load("third", _random_adapter(slots, 5, seed=3, skip="o_proj"))
    assert all(layer.fused_adapters is not None for layer in runner.model.layers)
    _assert_fused_layers_match_modules(runner, row_slots=[0, -1, 2, 0])


@pytest.mark.parametrize("family", FAMILIES)
@torch.inference_mode()
def test_decode_steps_run_each_layer_as_one_call_and_prefills_do_not(family: str, tmp_path: Path) -> None:
    model = tiny_model(family, tmp_path)
    runner = ModelRunner(model, num_blocks=64, block_size=BLOCK_SIZE)
    groups = len(runner.layout.group_windows)
    table, other = [[1 + 3 * g, 2 + 3 * g, 3 + 3 * g] for g in range(groups)], [[20 + g] for g in range(groups)]
    steps = {
        "prefill": [SequenceChunk([3, 4, 5], 0, table, num_prompt_tokens=3)],
        "decode": [SequenceChunk([6], 3, table, num_prompt_tokens=3)],
        "mixed": [SequenceChunk([7], 4, table, num_prompt_tokens=3), SequenceChunk([8, 9], 0, other)],
    }
    calls = {}
    fused_layer = f"{cpu_ops.active_instruction_set().op_namespace}::decoder_layer_"
    for name, chunks in steps.items():
        with profile() as prof:
            runner.forward_hidden(chunks)
        calls[name] = sum(event.count for event in prof.key_averages() if event.key == fused_layer)
    assert calls == {"prefill": 0, "decode": model.config.num_layers, "mixed": 0}


@torch.inference_mode()
def test_bad_operands_are_rejected_before_the_cache_changes(tmp_path: Path) -> None:
    model = tiny_model("llama", tmp_path)
    runner = ModelRunner(model, num_blocks=64, block_size=BLOCK_SIZE)
    input_ids, positions, meta = _prefilled_decode_step(runner, model.config.vocab_size)
    layer = runner.model.layers[0]
    hidden, tables = _layer_inputs(model, input_ids, positions, meta)
    cos, sin = tables[layer.rope]
    norms, weights, _, _, _ = layer.fused_operands
    attention, group = layer.self_attn, meta.groups[0]
    key_cache = attention.attn.key_cache
    before = key_cache.clone()

    def call(weights: list[torch.Tensor], num_heads: int = model.config.num_heads, norms: tuple = tuple(norms),
             parts: list[int] | None = None, stage: int = 0, partial: torch.Tensor | None = None) -> None:
        parts = [1] * len(weights) if parts is None else parts
        cpu_ops.ops().decoder_layer_(
            hidden.clone(), list(norms), 1e-5, weights, [None] * len(parts), [-1] * len(weights), parts, False, cos,
            sin,
            key_cache, attention.attn.value_cache, group.slot_mapping, group.decode_block_tables,
            group.decode_context_lens, num_heads, 0.25, 0.0, 0, None, [], [], [], stage, partial,
        )

    with pytest.raises(RuntimeError, match=r"must each hold qkv, o, gate_up and down \(or qkv and o\)"):
        call(list(weights[:3]))
    with pytest.raises(RuntimeError, match=r"weights and formats must hold a part each \(5\), got 4"):
        call(list(weights), parts=[2, 1, 1, 1])
    with pytest.raises(RuntimeError, match="every linear has at least one part"):
        call(list(weights), parts=[0, 2, 1, 1])
    with pytest.raises(RuntimeError, match="the qkv projection gives 128 columns, expected"):
        call(list(weights), num_heads=2)
    with pytest.raises(RuntimeError, match="norms must hold 6 entries"):
        call(list(weights), norms=list(norms[:4]))
    partial = torch.empty_like(hidden)
    for stage, linears, out in [(1, 4, None), (0, 4, partial), (2, 2, partial), (3, 4, partial)]:
        with pytest.raises(RuntimeError, match=f"stage {stage} takes partial only for a rank's part"):
            call(list(weights[:linears]), stage=stage, partial=out)
    assert torch.equal(key_cache, before)
