"""The model families ember serves, one row each and read by the bench and the tests alike: the
family's transformers classes, whether it is a mixture of experts, and what each user builds from
it: the tiny default shape and the tokenizer of the bench's random checkpoints (random_models.py),
and the switches the core tests turn on in theirs (tests/families.py). How each family's GGUF is
written is in gguf_families.py, under the same names.

Data only, importable without torch or gguf: `ember bench`'s parser reads it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

TokenizerStyle = Literal["gpt2", "llama3", "qwen2", "sentencepiece", "sentencepiece_no_prefix"]
CHAT_TOKENS = ("<|im_start|>", "<|im_end|>")


@dataclass(frozen=True)
class SpecialTokens:
    bos: str | None
    eos: str
    unk: str | None = None
    pad: str | None = None
    add_bos: bool = False
    others: tuple[str, ...] = ()  # further control tokens the family's vocabulary has
    rstrip: tuple[str, ...] = ()  # tokens that swallow the whitespace after them (Phi-3's chat tokens)

    def texts(self) -> list[str]:
        named = [self.unk, self.bos, self.eos, self.pad, *self.others]
        return list(dict.fromkeys(text for text in [*named, *CHAT_TOKENS] if text is not None))

    def added_tokens(self) -> list[Any]:
        from tokenizers import AddedToken

        return [AddedToken(text, special=True, normalized=False, rstrip=text in self.rstrip) for text in self.texts()]


_TINY_DECODER: dict[str, Any] = {
    "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
}
_TINY_WITH_HEAD_DIM = {**_TINY_DECODER, "head_dim": 16}  # configs whose head_dim default is not hidden / heads
_TINY_GEMMA = {**_TINY_WITH_HEAD_DIM, "query_pre_attn_scalar": 16, "sliding_window": 16}  # llama.cpp scales by head_dim
# 8 experts of 64 (the expert size where config.json names it intermediate_size), top-2.
_TINY_MOE = {**_TINY_DECODER, "intermediate_size": 64, "num_experts": 8, "num_local_experts": 8, "num_experts_per_tok": 2}
_TINY_HYBRID = {
    **_TINY_WITH_HEAD_DIM, "num_hidden_layers": 4, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
    "linear_key_head_dim": 16, "linear_value_head_dim": 16,
}
_SPM_SPECIALS = SpecialTokens(bos="<s>", eos="</s>", unk="<unk>", add_bos=True)
_GEMMA_SPECIALS = SpecialTokens(bos="<bos>", eos="<eos>", unk="<unk>", pad="<pad>", add_bos=True)
_QWEN_SPECIALS = SpecialTokens(bos=None, eos="<|im_end|>", pad="<|endoftext|>")
_GPT2_SPECIALS = SpecialTokens(bos=None, eos="<|endoftext|>", pad="<|pad|>")
# The tests' windows: shorter than their prompts, so every window slides.
TEST_WINDOW = 7


@dataclass(frozen=True)
class Family:
    name: str
    config_class: str  # in transformers
    model_class: str
    tokenizer: TokenizerStyle  # the bench's random checkpoint: its tokenizer, specials and default shape
    specials: SpecialTokens
    tiny: dict[str, Any] = field(default_factory=lambda: dict(_TINY_DECODER))
    # The tests' random checkpoint: the family's distinctive switches over tests/families.py's COMMON.
    test_switches: dict[str, Any] = field(default_factory=dict)
    moe: bool = False
    decoder: bool = True  # run by ember's one decoder (ember_core/models/family.py); GPT-2 has its own model
    zero_centered_norms: bool = False  # Gemma's RMSNorm scales by (1 + w)
    embeddings_times_sqrt_hidden: bool = False  # Gemma scales its input embeddings up
    # Recurrent layers beside attention (a state pool): tested by tests/core/models/test_hybrid.py,
    # not the family table's tests.
    hybrid: bool = False


# In this order `ember bench families` runs the dense decoders (the first, Llama, is its baseline).
FAMILIES: dict[str, Family] = {
    family.name: family
    for family in (
        Family("llama", "LlamaConfig", "LlamaForCausalLM", "llama3",
               SpecialTokens(bos="<|begin_of_text|>", eos="<|end_of_text|>", add_bos=True),
               test_switches=dict(attention_bias=True, mlp_bias=True)),
        Family("qwen2", "Qwen2Config", "Qwen2ForCausalLM", "qwen2", _QWEN_SPECIALS,
               {**_TINY_DECODER, "tie_word_embeddings": True},
               # sliding layers from the third on, as Qwen2's max_window_layers makes them
               dict(use_sliding_window=True, sliding_window=TEST_WINDOW, max_window_layers=2, tie_word_embeddings=True)),
        Family("qwen3", "Qwen3Config", "Qwen3ForCausalLM", "qwen2", _QWEN_SPECIALS,
               {**_TINY_WITH_HEAD_DIM, "tie_word_embeddings": True}, dict(head_dim=24, attention_bias=True)),
        Family("mistral", "MistralConfig", "MistralForCausalLM", "sentencepiece", _SPM_SPECIALS,
               test_switches=dict(sliding_window=TEST_WINDOW)),
        Family("gemma2", "Gemma2Config", "Gemma2ForCausalLM", "sentencepiece_no_prefix", _GEMMA_SPECIALS,
               dict(_TINY_GEMMA),
               dict(head_dim=16, query_pre_attn_scalar=20, sliding_window=TEST_WINDOW, attn_logit_softcapping=3.0,
                    final_logit_softcapping=5.0),
               zero_centered_norms=True, embeddings_times_sqrt_hidden=True),
        Family("gemma3", "Gemma3TextConfig", "Gemma3ForCausalLM", "sentencepiece_no_prefix", _GEMMA_SPECIALS,
               {**_TINY_GEMMA, "num_hidden_layers": 6},  # layer 5 is global
               dict(
                   head_dim=16, query_pre_attn_scalar=16, sliding_window=TEST_WINDOW,
                   layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
                   rope_parameters={
                       "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                       "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1_000_000.0},
                   },
               ),
               zero_centered_norms=True, embeddings_times_sqrt_hidden=True),
        Family("phi3", "Phi3Config", "Phi3ForCausalLM", "sentencepiece",
               SpecialTokens(bos="<s>", eos="<|endoftext|>", unk="<unk>", add_bos=True, others=("</s>",),
                             rstrip=("</s>", *CHAT_TOKENS)),  # as Phi-3's, which llama.cpp expects
               {**_TINY_DECODER, "original_max_position_embeddings": 256},
               # LongRoPE whose long table turns from position 64 on, over 3/4 of each head
               dict(
                   max_position_embeddings=512, original_max_position_embeddings=64,
                   rope_parameters={
                       "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                       "short_factor": [1.0 + 0.1 * i for i in range(6)],
                       "long_factor": [2.0 + 0.5 * i for i in range(6)],
                   },
               )),
        Family("olmo2", "Olmo2Config", "Olmo2ForCausalLM", "gpt2", _GPT2_SPECIALS),
        # The mixtures of experts: 6-8 experts, top-2, with and without renormalised weights; in the
        # tests Qwen2-MoE's shared expert and a dense layer (mlp_only_layers), Qwen3-MoE's dense layers
        # between sparse ones (and its window, which every layer takes).
        Family("mixtral", "MixtralConfig", "MixtralForCausalLM", "sentencepiece", _SPM_SPECIALS, dict(_TINY_MOE),
               dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=64, sliding_window=TEST_WINDOW),
               moe=True),
        Family("qwen2_moe", "Qwen2MoeConfig", "Qwen2MoeForCausalLM", "qwen2", _QWEN_SPECIALS,
               {**_TINY_MOE, "moe_intermediate_size": 64, "shared_expert_intermediate_size": 128},
               dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=96,
                    mlp_only_layers=[2], norm_topk_prob=False),
               moe=True),
        Family("qwen3_moe", "Qwen3MoeConfig", "Qwen3MoeForCausalLM", "qwen2", _QWEN_SPECIALS,
               {**_TINY_MOE, "head_dim": 16, "moe_intermediate_size": 64, "norm_topk_prob": True},
               dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=2,
                    head_dim=24, norm_topk_prob=True, use_sliding_window=True, sliding_window=TEST_WINDOW),
               moe=True),
        # The bench's as OLMoE's own: as many KV heads as query heads (llama.cpp sizes the k norm by the
        # hidden size).
        Family("olmoe", "OlmoeConfig", "OlmoeForCausalLM", "gpt2", _GPT2_SPECIALS, {**_TINY_MOE, "num_key_value_heads": 4},
               dict(num_experts=8, num_experts_per_tok=2, intermediate_size=64, norm_topk_prob=False),
               moe=True),
        # The hybrids: Qwen3.5 (three Gated DeltaNet layers, then full attention), its MoE, LFM2 (short
        # convolutions); q/k and value heads of one width, as llama.cpp requires.
        Family("qwen3_5", "Qwen3_5TextConfig", "Qwen3_5ForCausalLM", "qwen2", _QWEN_SPECIALS,
               dict(_TINY_HYBRID), zero_centered_norms=True, hybrid=True),
        Family("qwen3_5_moe", "Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", "qwen2", _QWEN_SPECIALS,
               {**_TINY_HYBRID, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                "shared_expert_intermediate_size": 64}, moe=True, zero_centered_norms=True, hybrid=True),
        Family("lfm2", "Lfm2Config", "Lfm2ForCausalLM", "qwen2", _GPT2_SPECIALS,
               {**_TINY_DECODER, "num_hidden_layers": 4, "layer_types": ["conv", "full_attention", "conv", "full_attention"],
                "block_multiple_of": 64}, hybrid=True),
        Family("granitemoehybrid", "GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM", "gpt2", _GPT2_SPECIALS,
               {**_TINY_DECODER, "num_hidden_layers": 4, "layer_types": ["mamba", "attention", "mamba", "attention"],
                "mamba_n_heads": 8, "mamba_d_state": 16, "num_local_experts": 0, "shared_intermediate_size": 128},
               hybrid=True),
        Family("gpt2", "GPT2Config", "GPT2LMHeadModel", "gpt2", SpecialTokens(bos="<|endoftext|>", eos="<|endoftext|>"),
               {"vocab_size": 512, "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 256}, decoder=False),
    )
}  # fmt: skip
