"""Tokenization for ember: byte-level BPE on tiktoken, SentencePiece-style vocabularies on HF tokenizers;
no torch, no transformers, so gateways can import it."""

from ember_core.tokenizer.chat_template import render_chat
from ember_core.tokenizer.detokenizer import IncrementalDetokenizer
from ember_core.tokenizer.from_gguf import tokenizer_from_gguf
from ember_core.tokenizer.hf import load_hf_tokenizer
from ember_core.tokenizer.output_text import OutputText, StopRules
from ember_core.tokenizer.spec import TokenizerSpec
from ember_core.tokenizer.tokenizer import Tokenizer

__all__ = [
    "IncrementalDetokenizer",
    "OutputText",
    "StopRules",
    "Tokenizer",
    "TokenizerSpec",
    "load_hf_tokenizer",
    "render_chat",
    "tokenizer_from_gguf",
]
