"""The pipelines (normalizer, pre-tokenizer, decoder) that transformers builds around a
SentencePiece-style vocabulary, set on a HF tokenizers Tokenizer.

transformers' LlamaTokenizer and GemmaTokenizer build their own in place of a tokenizer.json's, and
its GGUF loader builds them around a GGUF vocabulary; ember builds the same so that its ids equal
transformers'. In each, "▁" stands for a space, and "<0xAB>" tokens spell bytes the vocabulary lacks.
"""

from tokenizers import Tokenizer, decoders, normalizers, pre_tokenizers

METASPACE = "\u2581"


def use_llama_pipeline(tokenizer: Tokenizer, add_prefix_space: bool, legacy: bool) -> None:
    """LlamaTokenizer's (Llama 2, Mistral, Phi-3): a Metaspace pre-tokenizer writes spaces as "▁" and
    puts one in front of the text ("first"); legacy also after every special token ("always")."""
    tokenizer.normalizer = None
    prepend_scheme = ("always" if legacy else "first") if add_prefix_space else "never"
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(METASPACE, prepend_scheme=prepend_scheme, split=False)
    tokenizer.decoder = _decoder(strip_leading_space=add_prefix_space)


def use_gemma_pipeline(tokenizer: Tokenizer) -> None:
    """GemmaTokenizer's: spaces written as "▁", nothing put in front."""
    tokenizer.normalizer = normalizers.Replace(" ", METASPACE)
    tokenizer.pre_tokenizer = None
    tokenizer.decoder = _decoder(strip_leading_space=False)


def use_phi3_pipeline(tokenizer: Tokenizer) -> None:
    """Phi-3's tokenizer.json, which transformers' GGUF loader rebuilds for the phi3 architecture:
    the "▁" in front comes from a normalizer, so every text between special tokens gets one."""
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend(METASPACE), normalizers.Replace(" ", METASPACE)])
    tokenizer.pre_tokenizer = None
    tokenizer.decoder = _decoder(strip_leading_space=True)


def _decoder(strip_leading_space: bool) -> decoders.Decoder:
    steps = [decoders.Replace(METASPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if strip_leading_space:
        steps.append(decoders.Strip(content=" ", left=1))
    return decoders.Sequence(steps)
