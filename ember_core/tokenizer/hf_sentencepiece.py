"""A SentencePiece-style tokenizer.json (Llama 2, Mistral, Phi-3, Gemma: "▁" for spaces, "<0xAB>"
byte fallback, BPE or Unigram), read the way transformers' AutoTokenizer reads it."""

import json
from typing import Any

import tokenizers

from ember_core.tokenizer.hf_config import HfTokenizerConfig
from ember_core.tokenizer.sentencepiece_pipelines import use_gemma_pipeline, use_llama_pipeline
from ember_core.tokenizer.sentencepiece_style import sentencepiece_spec
from ember_core.tokenizer.tokenizer import Tokenizer

# config.json model types for which transformers reads tokenizer.json as written, whatever tokenizer
# class tokenizer_config.json names: it registers a generic tokenizer for them.
_AS_WRITTEN_MODEL_TYPES = frozenset({"mistral", "mixtral", "phi3"})
_GEMMA_MODEL_TYPES = frozenset({"gemma", "gemma2", "gemma3", "gemma3_text"})


def sentencepiece_style_tokenizer(tokenizer_json: dict[str, Any], config: HfTokenizerConfig) -> Tokenizer:
    tokenizer = tokenizers.Tokenizer.from_str(json.dumps(tokenizer_json))
    tokenizer_class = _transformers_class(config)
    if tokenizer_class in ("LlamaTokenizer", "GemmaTokenizer"):
        tokenizer = _rebuilt(tokenizer, tokenizer_class, config)
    _add_config_tokens(tokenizer, config)
    bos_token_id, eos_token_id = config.bos_and_eos_ids(tokenizer.token_to_id)
    spec = sentencepiece_spec(
        tokenizer,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        extra_stop_ids=config.extra_stop_ids(),
        chat_template=config.chat_template,
        add_bos_token=config.adds_bos(tokenizer_json),
    )
    return Tokenizer(spec)


def _transformers_class(config: HfTokenizerConfig) -> str | None:
    """The tokenizer class transformers' AutoTokenizer picks for the directory, without "Fast"."""
    model_type = config.model_config.get("model_type")
    if model_type in _AS_WRITTEN_MODEL_TYPES:
        return None
    named = config.tokenizer_config.get("tokenizer_class")
    if named:
        return named.removesuffix("Fast")
    return "GemmaTokenizer" if model_type in _GEMMA_MODEL_TYPES else None


def _rebuilt(tokenizer: tokenizers.Tokenizer, tokenizer_class: str, config: HfTokenizerConfig) -> tokenizers.Tokenizer:
    """The file's vocabulary and post-processor in the class's own pipeline. The class takes the
    added tokens of tokenizer_config.json, and only without those the file's."""
    rebuilt = tokenizers.Tokenizer(tokenizer.model)
    rebuilt.post_processor = tokenizer.post_processor
    if tokenizer_class == "LlamaTokenizer":
        add_prefix_space = config.tokenizer_config.get("add_prefix_space")
        legacy = bool(config.tokenizer_config.get("legacy", False))
        use_llama_pipeline(rebuilt, add_prefix_space=add_prefix_space is not False, legacy=legacy)
    else:
        use_gemma_pipeline(rebuilt)
    if not config.added_tokens_decoder():
        for _, token in sorted(tokenizer.get_added_tokens_decoder().items()):
            _add_token(rebuilt, token)
    return rebuilt


def _add_config_tokens(tokenizer: tokenizers.Tokenizer, config: HfTokenizerConfig) -> None:
    """As transformers does: tokenizer_config.json's added tokens join (or update) the tokenizer's,
    the tokens named bos_token, eos_token, ... become special, and the listed special tokens are
    added as special when the tokenizer lacks them."""
    present = {token.content: token.special for token in tokenizer.get_added_tokens_decoder().values()}
    decoder = config.added_tokens_decoder()
    wanted: dict[str, tokenizers.AddedToken] = {}
    for _, entry in sorted(decoder.items()):
        special = bool(entry.get("special", False))
        wanted[entry["content"]] = tokenizers.AddedToken(
            entry["content"],
            single_word=entry.get("single_word", False),
            lstrip=entry.get("lstrip", False),
            rstrip=entry.get("rstrip", False),
            normalized=entry.get("normalized", not special),
            special=special,
        )
    for text in config.named_special_token_texts():
        if not (wanted[text].special if text in wanted else present.get(text, False)):
            wanted[text] = tokenizers.AddedToken(text, normalized=False, special=True)
    for text in config.listed_special_token_texts():
        if text not in wanted and text not in present:
            wanted[text] = tokenizers.AddedToken(text, normalized=False, special=True)
    for text, token in wanted.items():
        if present.get(text) != token.special:
            _add_token(tokenizer, token)
    for token_id, entry in decoder.items():
        if tokenizer.token_to_id(entry["content"]) != token_id:
            raise ValueError(
                f"added token {entry['content']!r} has id {token_id} in tokenizer_config.json "
                f"but {tokenizer.token_to_id(entry['content'])} in tokenizer.json"
            )


def _add_token(tokenizer: tokenizers.Tokenizer, token: tokenizers.AddedToken) -> None:
    """Adds token, or sets its special flag and matching options if the tokenizer has it."""
    (tokenizer.add_special_tokens if token.special else tokenizer.add_tokens)([token])
