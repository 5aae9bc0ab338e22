"""The hybrid decoders (Qwen3.5's Gated DeltaNet layers beside gated attention, dense and with experts;
LFM2's short convolutions beside attention; Granite 4.0-H's Mamba2 layers beside attention without
RoPE, dense and with experts) against transformers' own classes with random weights: greedy tokens alone and batched; and ember's invariant for a model whose
linear layers keep a recurrent state per sequence: batch, chunked prefill, block size and
preemption never change a token or a logprob, in float32 and bfloat16; every state slot and block
comes back."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from ember_bench.gguf_export import export_gguf
from ember_core import LLM, LoRARequest, SamplingParams
from ember_core.layers.gated_delta_net import GatedDeltaNet, _gated_delta_net_torch
from ember_core.layers.mamba2 import Mamba2, _mamba2_torch
from ember_core.layers.recurrent_batch import RecurrentBatch
from ember_core.layers.short_conv import ShortConv, _short_conv_torch
from ember_core.loaders import load_model
from ember_core.models.decoder_config import LinearAttentionConfig, Mamba2Config, ShortConvConfig
from ember_core.parallel.group import TensorParallel
from tests.conftest import assert_pool_free
from tests.core.lora.peft_reference import GREEDY as PEFT_GREEDY
from tests.core.lora.peft_reference import peft_greedy, write_adapter
from tests.families import COMMON, HYBRID, HYBRID_FAMILIES, token_prompts, transformers_greedy, write_hybrid_checkpoint

PROMPT_LENGTHS = (1, 9, 70, 150)  # 150 > SMALL_BATCH_ROWS: that prompt's projections take the batched path
MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module", params=sorted(HYBRID_FAMILIES))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, transformers.PreTrainedModel]:
    model_dir = tmp_path_factory.mktemp(request.param)
    return model_dir, write_hybrid_checkpoint(model_dir, family=request.param)


def test_the_layer_pattern_loads_with_attention_layers_only_in_the_kv_pool(checkpoint) -> None:
    model_dir, hf_model = checkpoint
    model = load_model(str(model_dir), torch.device("cpu"), torch.float32).model
    assert [layer.linear for layer in model.config.layers] == [kind != "full_attention" for kind in hf_model.config.layer_types]
    llm = LLM(str(model_dir), num_blocks=64, block_size=4, device="cpu", dtype="float32", max_num_seqs=3)
    assert llm.engine.runner.layout.layers_per_group == 2  # the two full-attention layers
    assert llm.engine.state_slots.num_slots == 3


def test_greedy_tokens_equal_transformers_alone_and_batched(checkpoint) -> None:
    model_dir, hf_model = checkpoint
    prompts = token_prompts(PROMPT_LENGTHS)
    expected = [transformers_greedy(hf_model, prompt, MAX_TOKENS) for prompt in prompts]
    llm = LLM(str(model_dir), num_blocks=256, block_size=4, device="cpu", dtype="float32")
    alone = [llm.generate([prompt], GREEDY)[0].token_ids for prompt in prompts]
    batched = [output.token_ids for output in llm.generate(prompts, GREEDY)]
    assert alone == expected
    assert batched == expected
    assert_pool_free(llm)
    assert llm.engine.state_slots.num_free_slots == llm.engine.state_slots.num_slots


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_batch_chunks_block_size_and_preemption_change_no_token_or_logprob(checkpoint, dtype: str) -> None:
    """A recurrent layer computes each token as a decode would: chunking a prompt, batching it with
    others, or recomputing it after preemption keeps every logprob's bits."""
    model_dir, _ = checkpoint
    prompts = token_prompts((5, 17, 40, 60, 33), seed=99)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    plain = LLM(str(model_dir), num_blocks=512, block_size=16, device="cpu", dtype=dtype)
    alone = [plain.generate([prompt], params)[0] for prompt in prompts]
    assert len({tuple(output.token_ids) for output in alone}) == len(prompts)
    # Blocks of 3, a pool that holds the longest request alone and a third more, prompts in chunks
    # of at most 20 tokens, fewer state slots than requests.
    squeezed = LLM(
        str(model_dir), num_blocks=40, block_size=3, device="cpu", dtype=dtype, max_num_batched_tokens=20, max_num_seqs=3
    )
    outputs = squeezed.generate(prompts, params)
    assert [output.token_ids for output in outputs] == [output.token_ids for output in alone]
    assert [output.logprobs for output in outputs] == [output.logprobs for output in alone]
    assert squeezed.stats().num_preemptions > 0, "the pool must be squeezed enough to preempt"
    assert_pool_free(squeezed)
    assert squeezed.engine.state_slots.num_free_slots == 3


@pytest.mark.parametrize("tiled", [False, True], ids=["grouped", "tiled"])
def test_the_torch_mixer_computes_what_the_kernel_does(tiled: bool) -> None:
    """Where ember's C++ op does not run (no toolchain, a GPU), the same steps in torch ops; value
    heads grouped by key head (Hugging Face's order) or tiled (llama.cpp's)."""
    config = LinearAttentionConfig(
        num_key_heads=2, num_value_heads=4, key_head_dim=8, value_head_dim=12, conv_kernel=3, tiled_value_heads=tiled
    )
    torch.manual_seed(3)
    layer = GatedDeltaNet(config, hidden_size=32, eps=1e-6)
    with torch.no_grad():
        for param in layer.parameters():
            param.normal_(0.0, 0.3)
    states = {}
    for run in ("kernel", "torch"):
        layer.states = [
            torch.randn(3, *shape, generator=torch.Generator().manual_seed(seed))
            for seed, (shape, _) in enumerate(layer.state_specs())
        ]
        # A sequence continuing in slot 2, a fresh one in slot 0, a decode in slot 1.
        batch = RecurrentBatch.of([5, 7, 1], [2, 0, 1], [False, True, False], torch.device("cpu"))
        hidden = torch.randn(13, 32, generator=torch.Generator().manual_seed(4))
        with torch.no_grad():
            projected = layer.in_proj(hidden).contiguous()
            operands = (projected, layer.conv1d.weight.view(config.conv_size, -1), layer.A_log, layer.dt_bias,
                        layer.norm.weight, layer.eps, *layer.states)
            if run == "kernel":
                from ember_core.kernels import cpu_ops

                if not cpu_ops.is_available():
                    pytest.skip("no C++ toolchain: only the torch mixer runs here")
                out = cpu_ops.ops().gated_delta_net(*operands, batch.starts, batch.slots, batch.fresh, 2, 8, 12, tiled)
            else:
                out = _gated_delta_net_torch(config, *operands, batch)
        states[run] = (out, *layer.states)
    for kernel_tensor, torch_tensor in zip(states["kernel"], states["torch"]):
        torch.testing.assert_close(kernel_tensor, torch_tensor, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2}), "speculative decoding"),
        (dict(kv_cache_mib=0.0001), "state pool"),
    ],
)
def test_what_a_hybrid_cannot_run_with_is_refused_in_one_line(checkpoint, flags: dict, message: str) -> None:
    model_dir, _ = checkpoint
    with pytest.raises(ValueError, match=message):
        LLM(str(model_dir), device="cpu", dtype="float32", **flags)


def test_a_multimodal_checkpoint_serves_its_language_model(tmp_path: Path) -> None:
    """Qwen3.5's releases are image-text checkpoints: config.json's text_config and the
    model.language_model.* weights are the text model; the vision tower's weights are skipped."""
    text = {key: value for key, value in HYBRID.items() if key not in ("bos_token_id", "eos_token_id", "pad_token_id")}
    vision = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=COMMON["hidden_size"])
    torch.manual_seed(5)
    hf_model = transformers.Qwen3_5ForConditionalGeneration(transformers.Qwen3_5Config(text_config=text, vision_config=vision))
    hf_model.eval().save_pretrained(tmp_path, safe_serialization=True)
    prompt = token_prompts((11,), seed=7)[0]
    llm = LLM(str(tmp_path), num_blocks=64, block_size=4, device="cpu", dtype="float32")
    assert llm.generate([prompt], GREEDY)[0].token_ids == transformers_greedy(hf_model, prompt, MAX_TOKENS)


@pytest.fixture(scope="module", params=sorted(HYBRID_FAMILIES))
def gguf_files(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[dict[str, Path], transformers.PreTrainedModel]:
    """A checkpoint as llama.cpp's converter writes it (byte for byte, checked against its
    convert_hf_to_gguf.py): q/k and value heads of one width, as llama.cpp requires, value heads
    tiled, the decay as -exp(A_log)."""
    model_dir = tmp_path_factory.mktemp(f"{request.param}_gguf")
    equal_widths = {} if request.param == "lfm2" else {"linear_key_head_dim": 12}
    hf_model = write_hybrid_checkpoint(model_dir, seed=1, family=request.param, **equal_widths)
    return {kind: export_gguf(model_dir, model_dir / f"model-{kind}.gguf", kind) for kind in ("F32", "Q8_0")}, hf_model


@pytest.mark.parametrize("kind", ["F32", "Q8_0"])
def test_a_gguf_file_gives_transformers_tokens_from_its_blocks_as_from_its_values(gguf_files, kind: str) -> None:
    paths, hf_model = gguf_files
    prompts = token_prompts((3, 20, 70))
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
    runs = {
        weights: LLM(str(paths[kind]), num_blocks=256, block_size=4, device="cpu", dtype="float32", numerics="exact",
                     gguf_weights=weights).generate(prompts, params)
        for weights in ("blocks", "dequantized")
    }  # fmt: skip
    assert [output.logprobs for output in runs["blocks"]] == [output.logprobs for output in runs["dequantized"]]
    if kind == "F32":
        assert [output.token_ids for output in runs["blocks"]] == [transformers_greedy(hf_model, prompt, MAX_TOKENS) for prompt in prompts]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_conversations_next_turn_resumes_from_its_state_checkpoint(checkpoint, dtype: str) -> None:
    """The second turn finds the first turn's prompt and answer cached up to the answer's last full
    block, KV blocks and recurrent state both, and computes the same bits as without a cache; a
    repeated prompt resumes at its own last block boundary."""
    model_dir, _ = checkpoint
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=2)
    system, question, follow_up = token_prompts((37, 9, 8), seed=5)
    cached = LLM(str(model_dir), num_blocks=256, block_size=4, device="cpu", dtype=dtype, max_num_batched_tokens=16)
    fresh = LLM(str(model_dir), num_blocks=256, block_size=4, device="cpu", dtype=dtype, enable_prefix_caching=False)
    first = cached.generate([system + question], params)[0]
    assert first.logprobs == fresh.generate([system + question], params)[0].logprobs
    second_prompt = system + question + first.token_ids + follow_up
    second = cached.generate([second_prompt], params)[0]
    computed_before = len(system + question) + len(first.token_ids) - 1  # the last token was sampled, not computed
    assert cached.stats().num_prefix_cache_hits == computed_before // 4 * 4
    expected = fresh.generate([second_prompt], params)[0]
    assert (second.token_ids, second.logprobs) == (expected.token_ids, expected.logprobs)
    hits = cached.stats().num_prefix_cache_hits
    again = cached.generate([second_prompt], params)[0]
    assert cached.stats().num_prefix_cache_hits - hits == (len(second_prompt) - 1) // 4 * 4
    assert (again.token_ids, again.logprobs) == (expected.token_ids, expected.logprobs)
    assert_pool_free(cached)


def test_the_torch_short_convolution_computes_what_the_kernel_does() -> None:
    from ember_core.kernels import cpu_ops

    if not cpu_ops.is_available():
        pytest.skip("no C++ toolchain: only the torch short convolution runs here")
    torch.manual_seed(3)
    layer = ShortConv(ShortConvConfig(kernel=4, bias=True), hidden_size=32)
    with torch.no_grad():
        for param in layer.parameters():
            param.normal_(0.0, 0.3)
    batch = RecurrentBatch.of([5, 7, 1], [2, 0, 1], [False, True, False], torch.device("cpu"))
    projected = torch.randn(13, 96, generator=torch.Generator().manual_seed(4))
    weight = layer.conv.weight.view(32, -1)
    runs = []
    for run in ("kernel", "torch"):
        state = torch.randn(3, 32, 3, generator=torch.Generator().manual_seed(1))
        if run == "kernel":
            out = cpu_ops.ops().short_conv(projected, weight, layer.conv.bias, state, batch.starts, batch.slots, batch.fresh)
        else:
            out = _short_conv_torch(projected, weight, layer.conv.bias, state, batch)
        runs.append((out, state))
    for kernel_tensor, torch_tensor in zip(*runs):
        torch.testing.assert_close(kernel_tensor, torch_tensor, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_torch_mamba2_computes_what_the_kernel_does(dtype: torch.dtype) -> None:
    """Granite 4.0-H's mixer: heads in groups sharing B and C, a convolution bias, time steps clamped
    from above (the limit cuts some), in the model's dtype."""
    from ember_core.kernels import cpu_ops

    if not cpu_ops.is_available():
        pytest.skip("no C++ toolchain: only the torch Mamba2 runs here")
    config = Mamba2Config(num_heads=6, head_dim=4, state_size=5, num_groups=3, conv_kernel=3, time_step_max=0.9)
    torch.manual_seed(3)
    layer = Mamba2(config, hidden_size=16, eps=1e-6).to(dtype)
    with torch.no_grad():
        for param in layer.parameters():
            param.normal_(0.0, 0.5)
    batch = RecurrentBatch.of([5, 7, 1], [2, 0, 1], [False, True, False], torch.device("cpu"))
    projected = torch.randn(13, config.projection_size, generator=torch.Generator().manual_seed(4)).to(dtype)
    operands = (projected, layer.conv1d.weight.view(config.conv_size, -1), layer.conv1d.bias, layer.A_log,
                layer.dt_bias, layer.D, layer.norm.weight, layer.eps)  # fmt: skip
    runs = []
    for run in ("kernel", "torch"):
        states = [
            torch.randn(3, *shape, generator=torch.Generator().manual_seed(seed)).to(torch.float32 if float32 else dtype)
            for seed, (shape, float32) in enumerate(layer.state_specs())
        ]
        with torch.no_grad():
            if run == "kernel":
                out = cpu_ops.ops().mamba2(*operands, *states, batch.starts, batch.slots, batch.fresh, 3, 0.0, 0.9)
            else:
                out = _mamba2_torch(config, *operands, *states, batch)
        runs.append((out, *states))
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    for kernel_tensor, torch_tensor in zip(*runs):
        torch.testing.assert_close(kernel_tensor, torch_tensor, rtol=tolerance, atol=tolerance)


# Per family, the projections a LoRA adapter takes: the recurrent layers' and the attention layers'.
LORA_TARGETS = {
    "qwen3_5": ["q_proj", "o_proj", "in_proj_qkv", "in_proj_z", "out_proj", "gate_proj", "down_proj"],
    "qwen3_5_moe": ["q_proj", "v_proj", "in_proj_qkv", "in_proj_b", "out_proj"],
    "lfm2": ["q_proj", "in_proj", "out_proj", "w1", "w2"],
    "granitemoehybrid": ["q_proj", "o_proj", "in_proj", "out_proj", "input_linear", "output_linear"],
}


def test_lora_adapters_on_the_projections_equal_peft(checkpoint, tmp_path: Path) -> None:
    """An adapter over the recurrent and attention layers' projections, alone and batched beside the
    base model, gives PEFT's greedy tokens."""
    model_dir, hf_model = checkpoint
    family = next(name for name, (_, model_class, _) in HYBRID_FAMILIES.items() if type(hf_model).__name__ == model_class)
    write_adapter(model_dir, tmp_path / "adapter", 8, LORA_TARGETS[family], False, seed=3)
    prompts = token_prompts((9, 33))
    expected = [peft_greedy(model_dir, tmp_path / "adapter", prompt) for prompt in prompts]
    base = [peft_greedy(model_dir, None, prompt) for prompt in prompts]
    assert expected != base  # the adapter shows
    llm = LLM(str(model_dir), num_blocks=256, block_size=4, device="cpu", dtype="float32", enable_lora=True)
    adapter = LoRARequest("hybrid", 1, str(tmp_path / "adapter"))
    assert [llm.generate([prompt], PEFT_GREEDY, lora_request=adapter)[0].token_ids for prompt in prompts] == expected
    mixed = llm.generate(prompts + prompts, PEFT_GREEDY, lora_request=[adapter, adapter, None, None])
    assert [output.token_ids for output in mixed] == expected + base


def test_tensor_parallelism_is_refused_in_one_line_before_any_rank_loads(checkpoint) -> None:
    model_dir, _ = checkpoint
    with pytest.raises(ValueError, match="tensor parallelism does not split a hybrid model's recurrent layers"):
        load_model(str(model_dir), torch.device("cpu"), torch.float32, parallel=TensorParallel(0, 2))
