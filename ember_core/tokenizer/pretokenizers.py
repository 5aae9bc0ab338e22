"""Pre-tokenizers written as the single split regex tiktoken runs.

Both HF tokenizers and llama.cpp pre-tokenize in stages (split digits, then apply GPT-2's regex to
each remaining run); tiktoken has one pattern, so each supported stage combination is folded into
one regex that yields the same pieces.
"""

from typing import Any

import regex

GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"

# GPT-2's regex applied to the text between digits. Digits never join other pieces, and a
# whitespace run that ends where a digit starts is at the end of its run, so `(?!\S)` becomes
# "not followed by a non-space non-digit": "a   1" -> "a", "   ", "1".
_GPT2_BETWEEN_DIGITS = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?[^\s\p{L}\p{N}]+|\s+(?![^\s\p{N}])|\s+"
GPT2_SINGLE_DIGITS = r"\p{N}|" + _GPT2_BETWEEN_DIGITS
GPT2_DIGIT_RUNS = r"\p{N}+|" + _GPT2_BETWEEN_DIGITS

# llama.cpp spells the contractions out in place of `(?i:...)`, which would also match "'ſ".
_CONTRACTIONS_ANY_CASE = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
LLAMA3 = (
    _CONTRACTIONS_ANY_CASE
    + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2 = _CONTRACTIONS_ANY_CASE + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
QWEN35 = (
    _CONTRACTIONS_ANY_CASE
    + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tiktoken's o200k and Mistral's tekken patterns split words at case changes; llama.cpp writes
# "upper" as a letter that is not a-z and "lower" as a letter that is not A-Z.
_UPPER, _LOWER = r"(?:(?=\p{L})[^a-z])", r"(?:(?=\p{L})[^A-Z])"
GPT4O = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+(?:{_CONTRACTIONS_ANY_CASE})?"
    rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*(?:{_CONTRACTIONS_ANY_CASE})?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
TEKKEN = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _named(pattern: str, *names: str) -> dict[str, str]:
    return dict.fromkeys(names, pattern)


# tokenizer.ggml.pre values -> the regexes llama.cpp's llama-vocab.cpp runs for them, grouped as
# there. OLMo 2 and Phi-4 GGUFs say "dbrx"; Qwen2, 2.5 and 3 "qwen2"; Llama 3.x "llama-bpe".
GGUF_PRE_PATTERNS: dict[str, str] = {
    **_named(GPT2, "gpt-2", "phi-2", "mpt", "olmo", "jais", "gigachat", "a.x-4.0", "mellum", "exaone4", "trillion",
             "granite-docling"),
    **_named(GPT2_SINGLE_DIGITS, "smollm", "starcoder", "refact", "codeshell", "command-r", "exaone", "minerva-7b",
             "mellum2"),
    **_named(LLAMA3, "llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
             "jina-v5-nano", "dbrx", "smaug-bpe"),
    **_named(QWEN2, "qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2", "hunyuan", "solar-open"),
    **_named(QWEN35, "qwen35"),
    **_named(GPT4O, "gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"),
    **_named(TEKKEN, "tekken"),
}

# llama.cpp prepends BOS for these when the GGUF does not say.
GGUF_PRE_ADDS_BOS = frozenset(
    {"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2", "jina-v5-nano", "tekken"}
)

SUPPORTED_HF_PRE_TOKENIZERS = (
    "ByteLevel(use_regex=true)",
    "Sequence[Digits, ByteLevel(use_regex=true)]",
    "Sequence[Split(Isolated), ByteLevel(use_regex=false)]",
)


def gguf_pre_pattern(pre: str | None) -> str:
    if pre not in GGUF_PRE_PATTERNS:
        raise ValueError(
            f"unsupported GGUF pre-tokenizer tokenizer.ggml.pre={pre!r}; "
            f"supported: {', '.join(sorted(GGUF_PRE_PATTERNS))}"
        )
    return GGUF_PRE_PATTERNS[pre]


def hf_pre_pattern(pre_tokenizer: dict[str, Any] | None) -> str:
    """The tiktoken pattern equivalent to a tokenizer.json pre_tokenizer."""
    steps = _flatten(pre_tokenizer)
    kinds = [step["type"] for step in steps]
    for step in steps:
        if step["type"] == "ByteLevel" and step.get("add_prefix_space", False):
            raise ValueError("unsupported pre_tokenizer: ByteLevel(add_prefix_space=true)")
    if kinds == ["ByteLevel"] and _uses_regex(steps[0]):
        return GPT2
    if kinds == ["Digits", "ByteLevel"] and _uses_regex(steps[1]):
        return GPT2_SINGLE_DIGITS if steps[0].get("individual_digits", False) else GPT2_DIGIT_RUNS
    if kinds == ["Split", "ByteLevel"] and not _uses_regex(steps[1]):
        return _isolated_split_pattern(steps[0])
    described = kinds[0] if len(kinds) == 1 else f"Sequence[{', '.join(kinds)}]" if kinds else "null"
    raise ValueError(
        f"unsupported pre_tokenizer {described}; supported: {', '.join(SUPPORTED_HF_PRE_TOKENIZERS)}"
    )


def _flatten(pre_tokenizer: dict[str, Any] | None) -> list[dict[str, Any]]:
    if pre_tokenizer is None:
        return []
    if pre_tokenizer["type"] == "Sequence":
        return [step for inner in pre_tokenizer["pretokenizers"] for step in _flatten(inner)]
    return [pre_tokenizer]


def _uses_regex(byte_level: dict[str, Any]) -> bool:
    return bool(byte_level.get("use_regex", True))


def _isolated_split_pattern(split: dict[str, Any]) -> str:
    if split.get("behavior") != "Isolated" or split.get("invert", False):
        raise ValueError(
            f"unsupported Split pre_tokenizer behavior={split.get('behavior')!r} invert={split.get('invert')!r}; "
            "only behavior=Isolated, invert=false is supported"
        )
    source = split["pattern"]
    if "Regex" in source:
        pattern = source["Regex"]
    else:
        pattern = regex.escape(source["String"])
    # Split keeps the text between matches as pieces of their own; tiktoken drops text no
    # alternative matches, so the last alternative takes characters up to the next match.
    return f"(?:{pattern})|(?:(?!(?:{pattern}))[\\s\\S])+"
