"""ember's RoPE (ember_core/models/rotary.py) against transformers: inverse frequencies, attention
factors, cos / sin and the rotation itself, bit for bit, for every kind the supported families use."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding
from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb as phi3_apply_rotary_pos_emb
from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

from ember_core.models.rotary import Rope, RopeScaling, apply_rope, apply_rope_, hf_rope_parameters

MAX_POSITION_EMBEDDINGS = 16384
ORIGINAL = "original_max_position_embeddings"
TensorPair = tuple[torch.Tensor, torch.Tensor]
# LongRoPE's short_factor / long_factor are added per rotary dim (_with_longrope_factors).
ROPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 8.0},
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, ORIGINAL: 8192},
    # Small, so that every head dim has frequencies in all three llama3 bands.
    "llama3_short_context": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, ORIGINAL: 64},
    "yarn_qwen": {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0, ORIGINAL: 4096},
    "yarn_deepseek_mscales": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, ORIGINAL: 4096,
                              "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 1.0},
    "yarn_equal_mscales": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, ORIGINAL: 4096,
                           "mscale": 1.0, "mscale_all_dim": 1.0},
    "yarn_untruncated": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, ORIGINAL: 4096,
                         "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False},
    "yarn_attention_factor_and_betas": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, ORIGINAL: 2048,
                                        "attention_factor": 0.8, "beta_fast": 16, "beta_slow": 2},
    "yarn_factor_from_context_lengths": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": None, ORIGINAL: 4096},
    # Phi-3 style: no factor, no attention factor, both derived from the two context lengths.
    "longrope_phi3": {"rope_type": "longrope", "rope_theta": 10000.0, ORIGINAL: 4096},
    "longrope_explicit": {"rope_type": "longrope", "rope_theta": 250000.0, ORIGINAL: 2048, "factor": 8.0,
                          "attention_factor": 1.19},
    "longrope_no_extension": {"rope_type": "longrope", "rope_theta": 10000.0, ORIGINAL: MAX_POSITION_EMBEDDINGS},
}


def _with_longrope_factors(params: dict, rotary_dim: int, seed: int = 0) -> dict:
    if params.get("rope_type", params.get("type")) != "longrope":
        return params
    generator = torch.Generator().manual_seed(seed)
    spread = torch.tensor([[0.5], [40.0]], dtype=torch.float64)  # short factors near 1, long ones up to 41
    short, long = (1 + torch.rand(2, rotary_dim // 2, generator=generator, dtype=torch.float64) * spread).tolist()
    return {**params, "short_factor": short, "long_factor": long}


@pytest.mark.parametrize("partial_rotary_factor", [1.0, 0.75])
@pytest.mark.parametrize("head_dim", [64, 96, 128])
@pytest.mark.parametrize("name", ROPES)
def test_inv_freq_and_attention_factor_bit_identical_to_transformers(
    name: str, head_dim: int, partial_rotary_factor: float
) -> None:
    rotary_dim = int(head_dim * partial_rotary_factor)
    params = {**_with_longrope_factors(ROPES[name], rotary_dim), "partial_rotary_factor": partial_rotary_factor}
    config = transformers.LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim,
                                      max_position_embeddings=MAX_POSITION_EMBEDDINGS, rope_parameters=params)
    rope = Rope.from_hf(config.to_dict())
    assert (rope.head_dim, rope.rotary_dim) == (head_dim, rotary_dim)
    init = ROPE_INIT_FUNCTIONS.get(params["rope_type"], Phi3RotaryEmbedding.compute_default_rope_parameters)
    # transformers' longrope gives the long table for a seq_len beyond the original context.
    seq_lens = {False: None, True: params.get(ORIGINAL, 0) + 1}
    for long in (False, True) if rope.has_long_table else (False,):
        expected, attention_factor = init(config, torch.device("cpu"), seq_len=seq_lens[long])
        assert torch.equal(rope.inv_freq(long), expected)
        assert rope.attention_factor == attention_factor
    plain = Rope(head_dim, rotary_dim, params["rope_theta"])
    assert (name == "default") == torch.equal(rope.inv_freq(), plain.inv_freq())


def _config_dict(config_class: type, **kwargs) -> dict:
    return config_class(**kwargs).to_dict()


PHI3_LONGROPE = _with_longrope_factors({"type": "longrope"}, 96, seed=1)
# config.json spellings from before transformers 5, next to the config class that converts them.
OLD_SPELLINGS = {
    "qwen2_yarn": (transformers.Qwen2Config, dict(
        hidden_size=256, num_attention_heads=2, max_position_embeddings=131072, rope_theta=1000000.0,
        rope_scaling={"type": "yarn", "factor": 4.0, ORIGINAL: 32768})),
    "phi3_longrope": (transformers.Phi3Config, dict(
        hidden_size=256, num_attention_heads=2, max_position_embeddings=131072, original_max_position_embeddings=4096,
        partial_rotary_factor=0.75, rope_theta=10000.0, rope_scaling=PHI3_LONGROPE)),
    "gemma3_linear": (transformers.Gemma3TextConfig, dict(
        hidden_size=256, num_attention_heads=2, head_dim=64, rope_theta=1000000.0, rope_local_base_freq=10000.0,
        rope_scaling={"rope_type": "linear", "factor": 8.0})),
}


@pytest.mark.parametrize("name", OLD_SPELLINGS)
def test_old_config_spellings_read_as_transformers_converts_them(name: str) -> None:
    config_class, old = OLD_SPELLINGS[name]
    new = _config_dict(config_class, **old)
    for layer_type in sorted(set(new.get("layer_types") or [None])):
        assert Rope.from_hf(old, layer_type) == Rope.from_hf(new, layer_type)


@pytest.mark.parametrize("older_name", ["su", "yarn"])
def test_phi3_older_names_of_longrope_read_as_longrope(older_name: str) -> None:
    """Phi3Config renames them (transformers 5 then fails to load 'su' configs, so ember compares spellings)."""
    cfg = OLD_SPELLINGS["phi3_longrope"][1]
    renamed = {**cfg, "rope_scaling": {**cfg["rope_scaling"], "type": older_name}}
    assert Rope.from_hf(renamed) == Rope.from_hf(cfg) and Rope.from_hf(cfg).has_long_table


def test_gemma3_layer_types_get_their_own_rope_and_share_it() -> None:
    cfg = _config_dict(transformers.Gemma3TextConfig, **OLD_SPELLINGS["gemma3_linear"][1])
    sliding, full = Rope.from_hf(cfg, "sliding_attention"), Rope.from_hf(cfg, "full_attention")
    assert (sliding.theta, sliding.scaling) == (10000.0, None)
    assert (full.theta, full.scaling) == (1000000.0, RopeScaling("linear", 8.0))
    assert {Rope.from_hf(cfg, layer_type) for layer_type in cfg["layer_types"]} == {sliding, full}
    assert hf_rope_parameters(cfg, "full_attention")["factor"] == 8.0
    with pytest.raises(ValueError, match="differ per layer type"):
        Rope.from_hf(cfg)
    with pytest.raises(ValueError, match="no RoPE parameters for layer type 'chunked_attention'"):
        Rope.from_hf(cfg, "chunked_attention")


def test_what_ember_cannot_run_is_refused_by_name() -> None:
    cfg = {"hidden_size": 256, "num_attention_heads": 2, "max_position_embeddings": 4096}
    with pytest.raises(ValueError, match="'dynamic'.*depend on the sequence length"):
        Rope.from_hf({**cfg, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}})
    with pytest.raises(ValueError, match="'ntk'; ember supports 'default', 'linear', 'llama3', 'yarn', 'longrope'"):
        Rope.from_hf({**cfg, "rope_scaling": {"type": "ntk", "factor": 2.0}})
    with pytest.raises(ValueError, match="linear rope scaling needs 'factor'"):
        Rope.from_hf({**cfg, "rope_scaling": {"rope_type": "linear"}})
    with pytest.raises(ValueError, match="short_factor has 3 entries, expected rotary_dim / 2 = 64"):
        Rope.from_hf({**cfg, "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 3, "long_factor": [2.0]}})
    with pytest.raises(ValueError, match="rotary_dim must be even"):
        Rope(head_dim=64, rotary_dim=30 + 1, theta=10000.0)
    longrope = Rope.from_hf({**cfg, "rope_scaling": _with_longrope_factors({"rope_type": "longrope"}, 128)})
    with pytest.raises(ValueError, match="pass use_long"):
        longrope.cos_sin(torch.arange(4), torch.float32)


DTYPES = [torch.float32, torch.bfloat16]
POSITIONS = torch.arange(301)


def _module_cos_sin(module: torch.nn.Module, positions: torch.Tensor, dtype: torch.dtype, *layer: str) -> TensorPair:
    with torch.no_grad():
        cos, sin = module(torch.empty(1, dtype=dtype), positions[None], *layer)
    return cos[0], sin[0]


@pytest.mark.parametrize("dtype", DTYPES)
def test_qwen2_yarn_cos_sin_are_transformers_bits(dtype: torch.dtype) -> None:
    config = transformers.Qwen2Config(
        hidden_size=256, num_attention_heads=2, max_position_embeddings=512, rope_theta=1e6,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, ORIGINAL: 128},
    )
    rope = Rope.from_hf(config.to_dict())
    assert rope.attention_factor > 1.0
    expected = _module_cos_sin(Qwen2RotaryEmbedding(config), POSITIONS, dtype)
    actual = rope.cos_sin(POSITIONS, dtype)
    assert torch.equal(actual[0], expected[0]) and torch.equal(actual[1], expected[1])
    assert actual[0].dtype == dtype


@pytest.mark.parametrize("dtype", DTYPES)
def test_gemma3_cos_sin_per_layer_type_are_transformers_bits(dtype: torch.dtype) -> None:
    config = transformers.Gemma3TextConfig(hidden_size=256, num_attention_heads=2, head_dim=64, rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
    })
    module = Gemma3RotaryEmbedding(config)
    tables = {}
    for layer_type in ("sliding_attention", "full_attention"):
        expected = _module_cos_sin(module, POSITIONS, dtype, layer_type)
        tables[layer_type] = Rope.from_hf(config.to_dict(), layer_type).cos_sin(POSITIONS, dtype)
        assert torch.equal(tables[layer_type][0], expected[0]) and torch.equal(tables[layer_type][1], expected[1])
    assert not torch.equal(tables["sliding_attention"][0], tables["full_attention"][0])


def _phi3_config() -> transformers.Phi3Config:
    """Phi-4-mini's rotation (head_dim 128, 96 dims turn) with an original context of 128 tokens."""
    return transformers.Phi3Config(
        hidden_size=256, num_attention_heads=2, max_position_embeddings=512, original_max_position_embeddings=128,
        partial_rotary_factor=0.75, rope_scaling=_with_longrope_factors({"rope_type": "longrope"}, 96, seed=2),
    )


def _generate_cos_sin(module: torch.nn.Module, prompt_length: int, dtype: torch.dtype) -> TensorPair:
    """transformers' tables as generate() asks for them: the prompt in one forward, then one token each."""
    steps = [_module_cos_sin(module, torch.arange(prompt_length), dtype)]
    steps += [_module_cos_sin(module, POSITIONS[position : position + 1], dtype)
              for position in range(prompt_length, len(POSITIONS))]
    return torch.cat([cos for cos, _ in steps]), torch.cat([sin for _, sin in steps])


@pytest.mark.parametrize("dtype", DTYPES)
def test_phi3_longrope_partial_cos_sin_switch_tables_per_token_as_generate_does(dtype: torch.dtype) -> None:
    config = _phi3_config()
    rope = Rope.from_hf(config.to_dict())
    assert (rope.rotary_dim, rope.scaling.original_max_position_embeddings) == (96, 128)
    module = Phi3RotaryEmbedding(config)
    # One batch: a prompt shorter than the original context (short table until position 128) and a
    # longer one (the long table throughout), each continued to position 300.
    prompt_lengths = (100, 200)
    positions = torch.cat([POSITIONS] * len(prompt_lengths))
    per_token_prompt_length = torch.tensor(prompt_lengths).repeat_interleave(len(POSITIONS))
    use_long = rope.use_long_table(positions, per_token_prompt_length)
    cos, sin = rope.cos_sin(positions, dtype, use_long)
    for index, prompt_length in enumerate(prompt_lengths):
        rows = slice(index * len(POSITIONS), (index + 1) * len(POSITIONS))
        expected_cos, expected_sin = _generate_cos_sin(module, prompt_length, dtype)
        assert torch.equal(cos[rows], expected_cos) and torch.equal(sin[rows], expected_sin)
    assert use_long.tolist() == [position >= 128 for position in range(301)] + [True] * 301
    short_cos, _ = _module_cos_sin(module, torch.arange(100), dtype)
    assert not torch.equal(short_cos, cos[len(POSITIONS) : len(POSITIONS) + 100])  # the tables do differ


def test_use_long_is_ignored_by_single_table_kinds() -> None:
    rope = Rope(head_dim=64, rotary_dim=64, theta=10000.0)
    assert rope.use_long_table(POSITIONS, torch.full_like(POSITIONS, 5000)) is None
    as_long = rope.cos_sin(POSITIONS, torch.float32, torch.ones_like(POSITIONS, dtype=torch.bool))
    assert torch.equal(as_long[0], rope.cos_sin(POSITIONS, torch.float32)[0])


def test_partial_rotary_turns_the_first_dims_as_phi3_does() -> None:
    rope = Rope.from_hf(_phi3_config().to_dict())
    tokens, heads, kv_heads, head_dim = 37, 4, 2, 128
    generator = torch.Generator().manual_seed(0)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=generator)
    q, k, _ = qkv.view(tokens, heads + 2 * kv_heads, head_dim).split([heads, kv_heads, kv_heads], dim=1)
    positions = torch.arange(tokens) + 90
    cos, sin = rope.cos_sin(positions, torch.float32, rope.use_long_table(positions, torch.full_like(positions, 200)))
    # transformers' layout: [batch, heads, tokens, head_dim], cos / sin [batch, tokens, rotary_dim].
    expected_q, expected_k = (
        rotated[0].transpose(0, 1)
        for rotated in phi3_apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None])
    )
    assert torch.equal(apply_rope(q, cos, sin), expected_q) and torch.equal(apply_rope(k, cos, sin), expected_k)

    # In place, on the q and k columns of a fused QKV output (the C++ op where it is built).
    untouched_v = qkv[:, (heads + kv_heads) * head_dim :].clone()
    q_and_k = qkv[:, : (heads + kv_heads) * head_dim].view(tokens, heads + kv_heads, head_dim)
    assert apply_rope_(q_and_k, cos, sin) is q_and_k
    assert torch.equal(q_and_k[:, :heads], expected_q) and torch.equal(q_and_k[:, heads:], expected_k)
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim :], untouched_v)


@pytest.mark.parametrize("rotary_dim", [24, 96])  # 24: not whole pairs of the bf16 kernel's vectors
def test_partial_rotary_in_place_in_bfloat16(rotary_dim: int) -> None:
    rope = Rope(head_dim=128, rotary_dim=rotary_dim, theta=10000.0)
    x = torch.randn(9, 3, 128, generator=torch.Generator().manual_seed(rotary_dim)).bfloat16()
    cos, sin = rope.cos_sin(torch.arange(9) * 7, torch.bfloat16)
    expected = apply_rope(x, cos, sin)
    actual = apply_rope_(x.clone(), cos, sin)
    assert torch.equal(actual[..., rotary_dim:], x[..., rotary_dim:])
    # The C++ bf16 op rounds once where torch rounds each product: within one bf16 step of it.
    torch.testing.assert_close(actual.float(), expected.float(), rtol=2**-7, atol=2**-7)
