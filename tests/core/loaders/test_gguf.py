"""The GGUF loader on the real SmolLM2-135M-Instruct Q4_1 file and on small GGUF files written here."""

from __future__ import annotations

import math
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as Q
from torch import nn

from ember_core import LLM, SamplingParams
from ember_core.layers.block_embedding import GGUFBlockEmbedding
from ember_core.layers.linear import SMALL_BATCH_ROWS, GGUFBlockLinear, StackedBlockLinear
from ember_core.loaders.gguf_loader import FastGGUFReader, load_gguf
from ember_core.loaders.gguf_tensors import dequantize
from ember_core.models.decoder import Decoder
from ember_core.models.rotary import apply_rope
from ember_core.runner.context_cost import context_cost_per_position
from ember_core.runner.inputs import SequenceChunk
from ember_core.runner.model_runner import ModelRunner
from ember_core.tokenizer import Tokenizer
from ember_core.tokenizer.byte_level import BYTE_TO_CHAR
from tests.core.layers.test_linear import RANDOM_BLOCK_HALF_OFFSETS, random_blocks
from tests.core.models.test_llama_hf import LLAMA3_ROPE
from tests.reference import ember_prompt_logits, reference_logits

CPU = torch.device("cpu")
PAD_ID = 2  # <|im_end|>, as in the file
TEXT_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
    "1, 1, 2, 3, 5, 8, 13,",
]
CHAT_PROMPTS = [
    "What is the boiling point of water?",
    "Write a haiku about autumn.",
    "Give me three tips for learning to program.",
    "Why is the sky blue?",
]


@pytest.fixture(scope="module")
def smollm2_path(smollm2_gguf_path: Path) -> Path:
    return smollm2_gguf_path


@pytest.fixture(scope="module")
def llm(smollm2_path: Path) -> LLM:
    return LLM(str(smollm2_path), device="cpu", dtype="float32", kv_cache_mib=32, numerics="exact")


@pytest.fixture(scope="module")
def reference(smollm2_path: Path) -> transformers.LlamaForCausalLM:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        smollm2_path.parent, gguf_file=smollm2_path.name, dtype=torch.float32
    ).eval()
    assert all(param.dtype == torch.float32 for param in model.parameters())
    return model


@pytest.fixture(scope="module")
def raw_tensors(smollm2_reader: gguf.GGUFReader) -> dict[str, gguf.ReaderTensor]:
    return {tensor.name: tensor for tensor in smollm2_reader.tensors}


def _loaded_weight(model: nn.Module, name: str) -> torch.Tensor:
    """A weight's float32 values, whether its layer holds them or expands them from GGUF blocks."""
    module = model.get_submodule(name.rpartition(".")[0])
    if isinstance(module, (GGUFBlockLinear, GGUFBlockEmbedding)):
        return module.dequantized_weight()
    return model.get_parameter(name).detach()


def _prompt_ids(tokenizer: Tokenizer) -> list[list[int]]:
    chats = [tokenizer.apply_chat_template([{"role": "user", "content": text}]) for text in CHAT_PROMPTS]
    return [tokenizer.encode(text) for text in TEXT_PROMPTS] + chats


# --- q/k row order -----------------------------------------------------------------------------


def _llama_cpp_permute(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """convert_hf_to_gguf.py's LlamaModel.permute, verbatim."""
    return weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _ggml_rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """ggml's rope for llama (GGML_ROPE_TYPE_NORM): adjacent dims (2i, 2i+1) rotate by position * theta^(-2i/d)."""
    head_dim = x.shape[-1]
    angles = positions[:, None].double() * theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)


def _scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Attention logits [heads, queries, keys]; query head h reads kv head h // group, as in ggml and HF."""
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    return torch.einsum("thd,shd->hts", q.double(), k.double())


@pytest.mark.parametrize("layer", [0, 17, 29])
def test_unpermuted_qk_with_rotate_half_gives_ggml_attention_scores(
    llm: LLM, raw_tensors: dict[str, gguf.ReaderTensor], layer: int
) -> None:
    """Raw GGUF rows under ggml's interleaved rope == ember's rows under HF's rotate_half rope."""
    model: Decoder = llm.engine.runner.model
    config = model.config
    heads, kv_heads, head_dim = config.num_heads, config.num_kv_heads, config.head_dim
    q_rows, kv_rows = heads * head_dim, kv_heads * head_dim
    raw_q = dequantize(raw_tensors[f"blk.{layer}.attn_q.weight"])
    raw_k = dequantize(raw_tensors[f"blk.{layer}.attn_k.weight"])
    fused = _loaded_weight(model, f"layers.{layer}.self_attn.qkv_proj.weight")
    q_weight, k_weight = fused[:q_rows], fused[q_rows : q_rows + kv_rows]
    # The loader's rows, permuted the way llama.cpp's converter does, are exactly the file's rows.
    assert torch.equal(_llama_cpp_permute(q_weight, heads), raw_q)
    assert torch.equal(_llama_cpp_permute(k_weight, kv_heads), raw_k)

    ids = llm.tokenizer.encode("The quick brown fox jumps over the lazy dog near the river bank")
    positions = torch.tensor([0, 1, 2, 3, 9, 33, 100, 513, 1000, 2047, 4096, 8191, 5, 6][: len(ids)])
    with torch.no_grad():
        hidden = model.layers[layer].attn_in_norm(model.embed_tokens(torch.tensor(ids)))
    num_tokens = len(ids)

    def project(weight: torch.Tensor, num: int) -> torch.Tensor:
        return (hidden @ weight.t()).view(num_tokens, num, head_dim)

    ggml = _scores(
        _ggml_rope(project(raw_q, heads).double(), positions, model.ropes[0].theta),
        _ggml_rope(project(raw_k, kv_heads).double(), positions, model.ropes[0].theta),
    )
    cos, sin = model.ropes[0].cos_sin(positions, torch.float32)
    ours = _scores(apply_rope(project(q_weight, heads), cos, sin), apply_rope(project(k_weight, kv_heads), cos, sin))
    wrong = _scores(apply_rope(project(raw_q, heads), cos, sin), apply_rope(project(raw_k, kv_heads), cos, sin))
    scale = ggml.abs().max()
    # Measured: 1e-5 to 5e-5 (float32 angles at positions up to 8191) vs 0.7 to 1.2 with the rows left permuted.
    assert (ours - ggml).abs().max() < 1e-3 * scale
    assert (wrong - ggml).abs().max() > 0.3 * scale, "without the un-permutation the scores must differ"


# --- against transformers ----------------------------------------------------------------------


def model_rope(llm: LLM):
    (rope,) = llm.engine.runner.model.ropes
    return rope


def test_config_from_metadata(llm: LLM, reference: transformers.LlamaForCausalLM) -> None:
    config, hf_config = llm.engine.runner.model.config, reference.config
    assert (config.num_layers, config.hidden_size, config.intermediate_size) == (30, 576, 1536)
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (9, 3, 64)
    assert config.num_kv_heads == hf_config.num_key_value_heads
    assert model_rope(llm).theta == hf_config.rope_parameters["rope_theta"] == 100000.0
    assert config.rms_norm_eps == pytest.approx(hf_config.rms_norm_eps)
    assert (config.vocab_size, config.max_position_embeddings) == (49152, 8192)
    assert config.tie_word_embeddings and model_rope(llm).scaling is None
    assert (config.bos_token_id, config.eos_token_ids) == (1, (2,))


def test_logits_match_transformers(llm: LLM, reference: transformers.LlamaForCausalLM) -> None:
    for prompt in _prompt_ids(llm.tokenizer):
        expected = reference_logits(reference, prompt)
        torch.testing.assert_close(ember_prompt_logits(llm, prompt), expected, rtol=0, atol=1e-3)


def test_context_cost_of_smollm2_counts_each_projection_once(llm: LLM) -> None:
    heads, head_dim, kv_heads, hidden, inner = 9, 64, 3, 576, 1536
    linears = hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden + 3 * hidden * inner
    assert context_cost_per_position(llm.engine.runner.model) == pytest.approx(2 * heads * head_dim / linears)


def test_smollm2_runs_from_its_blocks_with_the_dequantized_weights_outputs(llm: LLM, smollm2_path: Path) -> None:
    """The packaged file is Q4_1 with a Q8_0 tied head: every Linear keeps its blocks, and every logit
    equals the float32 model's, bit for bit, through the block kernel (16 rows) and the prefill path
    (more than SMALL_BATCH_ROWS rows), and in decodes."""
    model = llm.engine.runner.model
    linears = [m for m in model.modules() if isinstance(m, (nn.Linear, GGUFBlockLinear))]
    assert len(linears) == 4 * 30 + 1 and all(isinstance(m, GGUFBlockLinear) for m in linears)
    assert model.lm_head.kind == Q.Q8_0 and model.layers[0].mlp.gate_up_proj.kind == Q.Q4_1
    # The tied embedding reads the head's blocks: no float32 table (113 MB) is left, only the norms.
    assert model.embed_tokens.blocks is model.lm_head.blocks
    assert sum(param.numel() for param in model.parameters()) < 100_000
    dequantized = LLM(str(smollm2_path), device="cpu", dtype="float32", kv_cache_mib=32, gguf_weights="dequantized")
    assert isinstance(dequantized.engine.runner.model.lm_head, nn.Linear)
    for prompt in _prompt_ids(llm.tokenizer)[:2]:
        prompt = (prompt * 16)[: SMALL_BATCH_ROWS + 8]
        for length in (16, len(prompt)):
            assert torch.equal(ember_prompt_logits(llm, prompt[:length]), ember_prompt_logits(dequantized, prompt[:length]))
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=2, ignore_eos=True)
    prompts = _prompt_ids(llm.tokenizer)[:3]
    for ours, theirs in zip(llm.generate(prompts, params), dequantized.generate(prompts, params)):
        assert (ours.token_ids, ours.logprobs) == (theirs.token_ids, theirs.logprobs)


def test_greedy_continuations_match_transformers(llm: LLM, reference: transformers.LlamaForCausalLM) -> None:
    prompts = _prompt_ids(llm.tokenizer)
    assert len(prompts) >= 8
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    # One left-padded batch: a CPU decode step costs about the same for 1 or 8 rows. The mask must be
    # explicit, or generate() would also mask every <|im_end|> (the pad token). An empty eos list
    # disables stopping (None would fall back to the model's EOS), like ignore_eos.
    width = max(map(len, prompts))
    ids = torch.tensor([[PAD_ID] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    generation = transformers.GenerationConfig(do_sample=False, max_new_tokens=32, eos_token_id=[], pad_token_id=PAD_ID)
    with torch.no_grad():
        expected = reference.generate(ids, attention_mask=mask, generation_config=generation)[:, width:]
    for prompt, output, reference_ids in zip(prompts, outputs, expected.tolist()):
        assert output.token_ids == reference_ids, llm.tokenizer.decode(prompt)


def test_half_size_kv_cache_doubles_the_pool_and_keeps_greedy_tokens(llm: LLM, smollm2_path: Path) -> None:
    """--kv-cache-dtype float16 / bfloat16 on the float32 model: twice the blocks in the same memory,
    the decode kernel still runs (widening K/V as it loads them), and greedy continuations stay the
    float32 cache's on these prompts: only K and V are rounded."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = _prompt_ids(llm.tokenizer)[:4]
    expected = [o.token_ids for o in llm.generate(prompts, params)]
    for kv_dtype in (torch.float16, torch.bfloat16):
        half = LLM(str(smollm2_path), device="cpu", dtype="float32", kv_cache_mib=32, kv_cache_dtype=str(kv_dtype)[6:],
                   numerics="exact")
        assert half.engine.block_manager.num_blocks // 2 == llm.engine.block_manager.num_blocks  # floor of 2x
        assert half.engine.runner.decode_attention == "kernel"
        assert half.engine.runner.model.layers[0].self_attn.attn.key_cache.dtype == kv_dtype
        assert [o.token_ids for o in half.generate(prompts, params)] == expected, kv_dtype


def test_steps_within_the_kernels_rows_give_each_request_the_same_bits_alone_or_in_a_burst(smollm2_path: Path) -> None:
    """With steps of at most SMALL_BATCH_ROWS tokens every linear runs ember's row-independent kernel
    and decode attention cuts each sequence by its own length, so a request's logprobs are the
    same bits alone, among other requests (batched decodes, prompts split across steps) and with
    another chunk size. (Longer steps send prompts through BLAS sgemm, whose bits may differ.)"""
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(100, 40000, (n,), generator=generator).tolist() for n in (100, 70, 90, 120, 40, 100)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)

    def first_request_logprobs(prompts: list[list[int]], max_num_batched_tokens: int) -> list[float]:
        engine = LLM(str(smollm2_path), device="cpu", dtype="float32", kv_cache_mib=32,
                     max_num_batched_tokens=max_num_batched_tokens, numerics="exact")
        return [token.logprob for token in engine.generate(prompts, params)[0].logprobs]

    alone = first_request_logprobs(prompts[:1], SMALL_BATCH_ROWS)
    assert first_request_logprobs(prompts, SMALL_BATCH_ROWS) == alone
    assert first_request_logprobs(prompts, 37) == alone


def test_float16_model_decodes_on_cpu(smollm2_path: Path) -> None:
    """--dtype float16 on CPU: the decode kernel takes a float16 query over a float16 cache (it used
    to reject float16, so the first decode step failed)."""
    half = LLM(str(smollm2_path), device="cpu", dtype="float16", kv_cache_mib=16)
    assert half.engine.runner.decode_attention == "kernel"
    outputs = half.generate(TEXT_PROMPTS[:2], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert [len(o.token_ids) for o in outputs] == [6, 6]


# --- dequantization ----------------------------------------------------------------------------


def _f16(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)


def _decode_q8_0(raw: np.ndarray) -> np.ndarray:
    """34-byte blocks: fp16 scale, 32 int8."""
    blocks = raw.reshape(-1, 34)
    return _f16(blocks[:, :2]) * np.ascontiguousarray(blocks[:, 2:]).view(np.int8).astype(np.float32)


def _decode_q4_1(raw: np.ndarray) -> np.ndarray:
    """20-byte blocks: fp16 scale, fp16 minimum, 16 bytes holding values 0-15 (low nibbles) and 16-31 (high)."""
    blocks = raw.reshape(-1, 20)
    nibbles = np.concatenate((blocks[:, 4:] & 0x0F, blocks[:, 4:] >> 4), axis=1).astype(np.float32)
    return _f16(blocks[:, :2]) * nibbles + _f16(blocks[:, 2:4])


@pytest.mark.parametrize(
    ("gguf_name", "weight", "rows", "decode"),
    [
        ("token_embd.weight", "embed_tokens.weight", slice(None), _decode_q8_0),
        ("blk.3.ffn_down.weight", "layers.3.mlp.down_proj.weight", slice(None), _decode_q4_1),
        ("blk.3.ffn_up.weight", "layers.3.mlp.gate_up_proj.weight", slice(1536, None), _decode_q4_1),
        ("blk.3.attn_v.weight", "layers.3.self_attn.qkv_proj.weight", slice(576 + 192, None), _decode_q4_1),
        ("blk.3.attn_norm.weight", "layers.3.attn_in_norm.weight", slice(None), None),
    ],
)
def test_file_tensors_dequantized_into_the_right_parameters(
    llm: LLM,
    raw_tensors: dict[str, gguf.ReaderTensor],
    gguf_name: str,
    weight: str,
    rows: slice,
    decode: object,
) -> None:
    tensor = raw_tensors[gguf_name]
    loaded = _loaded_weight(llm.engine.runner.model, weight)[rows]
    shape = tuple(reversed(tensor.shape.tolist()))
    expected = torch.tensor(gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(shape))
    assert torch.equal(loaded, expected)
    if decode is not None:  # our own decoding of the block format, independent of gguf-py
        assert torch.equal(loaded, torch.from_numpy(decode(np.asarray(tensor.data)).reshape(shape)))


ROUND_TRIP_TYPES = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1]
K_QUANT_TYPES = [Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K]


def _encode(values: np.ndarray, qtype: Q) -> np.ndarray:
    if qtype == Q.F32:
        return values
    return values.astype(np.float16) if qtype == Q.F16 else gguf.quants.quantize(values, qtype)


def _round_trip(values: np.ndarray, qtype: Q) -> np.ndarray:
    """What a reader gets back for values stored as qtype."""
    return np.asarray(gguf.quants.dequantize(_encode(values, qtype), qtype), dtype=np.float32).reshape(values.shape)


def test_dequantize_every_type(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    shape = (3, 512)
    written: dict[str, tuple[Q, np.ndarray]] = {}
    writer = gguf.GGUFWriter(tmp_path / "types.gguf", "llama")
    for qtype in ROUND_TRIP_TYPES:
        values = rng.standard_normal(shape).astype(np.float32)
        writer.add_tensor(qtype.name, _encode(values, qtype), raw_dtype=None if qtype in (Q.F32, Q.F16) else qtype)
        written[qtype.name] = (qtype, values)
    for qtype in K_QUANT_TYPES:
        block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
        # Random blocks; bytes below 0x3c keep every fp16 scale finite.
        data = rng.integers(0, 0x3C, (shape[0], shape[1] // block_size * type_size), dtype=np.uint8)
        writer.add_tensor(qtype.name, data, raw_dtype=qtype)
        written[qtype.name] = (qtype, gguf.quants.dequantize(data, qtype))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    for tensor in gguf.GGUFReader(tmp_path / "types.gguf").tensors:
        qtype, values = written[tensor.name]
        actual = dequantize(tensor)
        assert tensor.tensor_type == qtype and actual.shape == shape and actual.dtype == torch.float32
        if qtype in K_QUANT_TYPES:
            assert torch.equal(actual, torch.from_numpy(values))
            continue
        assert torch.equal(actual, torch.from_numpy(_round_trip(values, qtype)))
        assert (actual - torch.from_numpy(values)).abs().max() < 0.1 * np.abs(values).max()  # a real round trip


# --- a GGUF file written here --------------------------------------------------------------------

SYNTHETIC_LLAMA3_ROPE = LLAMA3_ROPE
# Tensor types by HF name suffix; block types need rows of 32-multiples. q/k/v (fused, q/k
# permuted) and o, down run from their blocks; gate + up mix types: a StackedBlockLinear.
SYNTHETIC_TYPES = {
    "embed_tokens.weight": Q.Q8_0,
    "q_proj.weight": Q.Q4_1,
    "k_proj.weight": Q.Q4_1,
    "v_proj.weight": Q.Q4_1,
    "o_proj.weight": Q.Q8_0,
    "gate_proj.weight": Q.F16,
    "up_proj.weight": Q.Q4_1,
    "down_proj.weight": Q.Q8_0,
    "lm_head.weight": Q.F16,
}
GGUF_NAMES = {
    "embed_tokens": "token_embd",
    "norm": "output_norm",
    "lm_head": "output",
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _gguf_name(hf_name: str) -> str:
    name = hf_name.removeprefix("model.")
    if name.startswith("layers."):
        _, layer, rest = name.split(".", 2)
        module, kind = rest.rsplit(".", 1)
        return f"blk.{layer}.{GGUF_NAMES[module]}.{kind}"
    module, kind = name.rsplit(".", 1)
    return f"{GGUF_NAMES[module]}.{kind}"


def _llama3_rope_factors(rope: dict, head_dim: int) -> np.ndarray:
    """convert_hf_to_gguf.py's rope_freqs for llama3 scaling."""
    freqs = 1.0 / (rope["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    old_context = rope["original_max_position_embeddings"]
    low_freq_wavelen = old_context / rope["low_freq_factor"]
    high_freq_wavelen = old_context / rope["high_freq_factor"]
    factors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            factors.append(1.0)
        elif wavelen > low_freq_wavelen:
            factors.append(rope["factor"])
        else:
            smooth = (old_context / wavelen - rope["low_freq_factor"]) / (rope["high_freq_factor"] - rope["low_freq_factor"])
            factors.append(1 / ((1 - smooth) / rope["factor"] + smooth))
    return np.array(factors, dtype=np.float32)


def _stored_rows(name: str, param: torch.Tensor, qtype: Q, config: transformers.LlamaConfig) -> tuple[np.ndarray, torch.Tensor]:
    """(what the file stores for a parameter, in llama.cpp's row order; the weight it stands for, in HF's).

    gguf-py cannot quantize to K-quants or IQ4 types, so such a parameter is replaced by random blocks.
    Quantization blocks run along rows, so permuting rows does not change what each row stores.
    """
    heads = config.num_attention_heads if ".q_proj." in name else config.num_key_value_heads if ".k_proj." in name else 0
    if qtype in RANDOM_BLOCK_HALF_OFFSETS:
        # Factors small enough for weights of ~0.01-0.1.
        scale = {Q.Q4_K: 1e-4, Q.IQ4_NL: 5e-4}.get(qtype, 2e-5)
        blocks = random_blocks(qtype, param.shape[0], param.shape[1], seed=len(name), scale=scale)
        values = torch.from_numpy(np.asarray(gguf.quants.dequantize(blocks, qtype), dtype=np.float32).reshape(param.shape))
        if heads:
            blocks = blocks[_llama_cpp_permute(torch.arange(param.shape[0]), heads).numpy()]
        return blocks, values
    rows = _llama_cpp_permute(param, heads) if heads else param
    return _encode(rows.numpy(), qtype), torch.from_numpy(_round_trip(param.numpy(), qtype))


def _write_synthetic_gguf(path: Path, hf_model: transformers.LlamaForCausalLM, types: dict[str, Q] = SYNTHETIC_TYPES) -> dict[str, torch.Tensor]:
    """Write hf_model the way llama.cpp's converter does, with tensor types by HF name suffix (first
    match); return the weights as stored (after quantization)."""
    config = hf_model.config
    tokens = [BYTE_TO_CHAR[byte] for byte in range(256)] + ["Ġt", "<s>", "</s>"]
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.NORMAL] * 257 + [gguf.TokenType.CONTROL] * 2)
    writer.add_token_merges(["Ġ t"])
    writer.add_bos_token_id(257)
    writer.add_eos_token_id(258)
    writer.add_tensor("rope_freqs.weight", _llama3_rope_factors(SYNTHETIC_LLAMA3_ROPE, config.head_dim))
    stored: dict[str, torch.Tensor] = {}
    for name, param in hf_model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            stored[name] = stored["model.embed_tokens.weight"]  # no output tensor: the head is the embedding
            continue
        qtype = next((t for suffix, t in types.items() if name.endswith(suffix)), Q.F32)
        data, stored[name] = _stored_rows(name, param, qtype, config)
        writer.add_tensor(_gguf_name(name), data, raw_dtype=None if qtype in (Q.F32, Q.F16) else qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return stored


def _synthetic_llama(**overrides) -> transformers.LlamaForCausalLM:
    """A 2-layer GQA Llama over the synthetic files' 259-token vocabulary, with llama3 rope."""
    defaults = {
        "vocab_size": 259,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "rope_parameters": SYNTHETIC_LLAMA3_ROPE,
    }
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**defaults, **overrides})).eval()


def test_synthetic_gguf_loads_and_matches_transformers(tmp_path: Path) -> None:
    """Untied head, GQA, q/k biases (permuted too), llama3 rope as rope_freqs, F32/F16/Q8_0/Q4_1 tensors,
    with the Q4_1/Q8_0 layers run from their blocks or dequantized at load."""
    hf_model = _synthetic_llama(
        hidden_size=64, intermediate_size=96, max_position_embeddings=128, attention_bias=True, tie_word_embeddings=False
    )
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            param.copy_(torch.rand_like(param) + 0.5 if "norm" in name else torch.randn_like(param) * 0.15)
    stored = _write_synthetic_gguf(tmp_path / "tiny.gguf", hf_model)
    hf_model.load_state_dict(stored)
    models = _logits_match_with_blocks_and_dequantized(tmp_path / "tiny.gguf", hf_model)
    for keep_blocks, model in models.items():
        assert not model.config.tie_word_embeddings and model.config.qkv_bias and model.config.o_bias
        freq_factors = model.ropes[0].freq_factors
        assert freq_factors is not None and max(freq_factors) == 8.0
        layer = model.layers[1]
        block_layers = [layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.down_proj]
        assert all(isinstance(m, GGUFBlockLinear) == keep_blocks for m in block_layers)
        assert isinstance(layer.mlp.gate_up_proj, StackedBlockLinear) == keep_blocks
        if keep_blocks:
            assert [part.kind for part in layer.mlp.gate_up_proj.parts] == [Q.F16, Q.Q4_1]
        assert not isinstance(model.lm_head, GGUFBlockLinear)  # F16 alone: keep_16_bit_weights' job
    assert context_cost_per_position(models[True]) == context_cost_per_position(models[False])  # stacked parts count once


def _logits_match_with_blocks_and_dequantized(path: Path, hf_model: transformers.LlamaForCausalLM) -> dict[bool, Decoder]:
    """Load the file with and without keeping its blocks; both give hf_model's logits, and the same bits.
    Returns the two models by keep_blocks."""
    num_tokens = SMALL_BATCH_ROWS + 16  # the prefill path; the last 5 tokens again go through the block kernel
    vocab_size = hf_model.config.vocab_size
    prompt = torch.randint(0, vocab_size, (num_tokens,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.inference_mode():
        expected = hf_model(torch.tensor([prompt])).logits[0]
    logits, models = {}, {}
    for keep_blocks in (True, False):
        model, tokenizer, _ = load_gguf(path, CPU, torch.float32, keep_blocks)
        assert tokenizer.decode(tokenizer.encode("a tiny test")) == "a tiny test"
        blocks = list(range(num_tokens // 8))
        runner = ModelRunner(model, num_blocks=len(blocks), block_size=8)
        with torch.inference_mode():
            chunks = [SequenceChunk(prompt, 0, [blocks]), SequenceChunk(prompt[-5:], num_tokens - 5, [blocks])]
            logits[keep_blocks] = [model.compute_logits(runner.forward_hidden([chunk])) for chunk in chunks]
        torch.testing.assert_close(logits[keep_blocks][0], expected, rtol=0, atol=1e-4)
        torch.testing.assert_close(logits[keep_blocks][1], expected[-5:], rtol=0, atol=1e-4)
        models[keep_blocks] = model
    for blocks, dequantized in zip(logits[True], logits[False]):
        assert torch.equal(blocks, dequantized)
    return models


# As llama.cpp's Q4_K_M: Q4_K, with Q6_K for the tied embedding / head, some layers' V and down
# projections, so layer 1's fused QKV mixes the two; and one tensor in each other block format.
K_QUANT_TYPES_BY_SUFFIX = {
    "embed_tokens.weight": Q.Q6_K,
    "layers.1.self_attn.v_proj.weight": Q.Q6_K,
    "layers.0.mlp.down_proj.weight": Q.Q6_K,
    "layers.0.self_attn.o_proj.weight": Q.Q5_K,
    "layers.1.mlp.gate_proj.weight": Q.Q4_0,
    "layers.1.mlp.up_proj.weight": Q.Q5_1,
    "layers.1.mlp.down_proj.weight": Q.Q5_0,
    "layers.0.mlp.gate_proj.weight": Q.Q2_K,
    "layers.0.mlp.up_proj.weight": Q.Q3_K,
    "layers.1.self_attn.k_proj.weight": Q.IQ4_NL,
    "layers.1.self_attn.o_proj.weight": Q.IQ4_XS,
    "proj.weight": Q.Q4_K,
}


def test_k_quant_gguf_runs_from_its_blocks(tmp_path: Path) -> None:
    # K-quant rows are whole blocks of 256.
    hf_model = _synthetic_llama(hidden_size=256, intermediate_size=512, max_position_embeddings=256, tie_word_embeddings=True)
    stored = _write_synthetic_gguf(tmp_path / "k.gguf", hf_model, K_QUANT_TYPES_BY_SUFFIX)
    hf_model.load_state_dict(stored)
    models = _logits_match_with_blocks_and_dequantized(tmp_path / "k.gguf", hf_model)
    first, second = models[True].layers
    assert models[True].lm_head.kind == Q.Q6_K and first.mlp.down_proj.kind == Q.Q6_K
    assert models[True].embed_tokens.blocks is models[True].lm_head.blocks
    assert first.self_attn.qkv_proj.kind == Q.Q4_K and first.self_attn.o_proj.kind == Q.Q5_K
    assert second.mlp.down_proj.kind == Q.Q5_0
    assert [part.kind for part in first.mlp.gate_up_proj.parts] == [Q.Q2_K, Q.Q3_K]
    assert [part.kind for part in second.self_attn.qkv_proj.parts] == [Q.Q4_K, Q.IQ4_NL, Q.Q6_K]
    assert second.self_attn.o_proj.kind == Q.IQ4_XS
    assert [part.kind for part in second.mlp.gate_up_proj.parts] == [Q.Q4_0, Q.Q5_1]
    assert [part.out_features for part in second.self_attn.qkv_proj.parts] == [256, 128, 128]
    assert not any(isinstance(m, GGUFBlockLinear) for m in models[False].modules())
    # Decode steps: layer 0 in one C++ call, layer 1 (stacked QKV) through its modules; the same bits.
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)
    runs = [
        [(o.token_ids, o.logprobs) for o in llm.generate(["a tiny test", "tt", "another prompt here"], params)]
        for llm in (
            LLM(str(tmp_path / "k.gguf"), device="cpu", dtype="float32", kv_cache_mib=4, gguf_weights=w, numerics="exact")
            for w in ("blocks", "dequantized")
        )
    ]
    assert runs[0] == runs[1]


def test_rejects_other_architectures(tmp_path: Path) -> None:
    writer = gguf.GGUFWriter(tmp_path / "gpt2.gguf", "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="GGUF architecture 'gpt2' is not supported"):
        load_gguf(tmp_path / "gpt2.gguf", CPU, torch.float32)


def test_the_fast_reader_reads_what_ggufs_reader_reads(smollm2_gguf_path: Path, smollm2_reader: FastGGUFReader) -> None:
    reference = gguf.GGUFReader(smollm2_gguf_path)
    assert type(smollm2_reader.data) is np.ndarray and isinstance(reference.data, np.memmap)
    assert list(smollm2_reader.fields) == list(reference.fields)
    for name, field in smollm2_reader.fields.items():
        expected = reference.fields[name]
        assert (field.types, field.data) == (expected.types, expected.data), name
        assert all(np.array_equal(part, other) for part, other in zip(field.parts, expected.parts, strict=True)), name
    for tensor, expected in zip(smollm2_reader.tensors, reference.tensors, strict=True):
        assert (tensor.name, tensor.tensor_type, list(tensor.shape)) == (expected.name, expected.tensor_type, list(expected.shape))
        assert np.array_equal(tensor.data, expected.data), tensor.name
