"""Small SentencePiece models trained here with the sentencepiece package (BPE and unigram, byte
fallback, user-defined symbols, whitespace-only pieces), in Llama's and in Gemma's layout of special
tokens: the vocabularies the SentencePiece-style tokenizer tests compare ember with transformers on."""

from __future__ import annotations

import io
import random
from functools import cache

import sentencepiece
from sentencepiece import sentencepiece_model_pb2

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "It's a test; we'll see what they've done with 1,000 items and 3.14 apples.",
    "def square(x):\n    return x ** 2  # comment\n",
    "for (int i = 0; i < 10; ++i) { total += values[i]; }",
    "Café déjà vu, naïve façade, Straße.",
    "日本語のテキストと中文文本。",
    "Emoji: 😀 🎉 👍",
    "   indented   text\twith\ttabs\n\nand blank lines",
    "```python\nprint('hello world')\n```",
]
SYLLABLES = ["ka", "to", "ri", "men", "sa", "lo", "ve", "qu", "ist", "ing", "er", "ion", "str", "ph", "ou", "é", "ß"]
# User-defined symbols: SentencePiece never splits them; transformers makes them added tokens.
USER_DEFINED = ["<|im_start|>", "<|im_end|>", "```"]
GEMMA_USER_DEFINED = ["<start_of_turn>", "<end_of_turn>"]
# Llama's layout: <unk> 0, <s> 1, </s> 2; Gemma's: <pad> 0, <eos> 1, <bos> 2, <unk> 3, a control token
# <mask> 4, no dummy prefix.
LAYOUTS = {
    "llama": {"unk_id": 0, "bos_id": 1, "eos_id": 2, "pad_id": -1, "user_defined_symbols": USER_DEFINED},
    "gemma": {
        "pad_id": 0, "eos_id": 1, "bos_id": 2, "unk_id": 3, "pad_piece": "<pad>", "eos_piece": "<eos>",
        "bos_piece": "<bos>", "add_dummy_prefix": False, "user_defined_symbols": GEMMA_USER_DEFINED,
        "control_symbols": ["<mask>"],
    },
}


def training_corpus() -> list[str]:
    rng = random.Random(0)
    words = " ".join(SENTENCES).split(" ") + ["".join(rng.choices(SYLLABLES, k=rng.randint(1, 4))) for _ in range(300)]
    return [" ".join(rng.choices(words, k=rng.randint(3, 20))) + " " + str(rng.randint(0, 10**6)) for _ in range(3000)]


@cache
def trained_model(model_type: str, layout: str = "llama") -> bytes:
    """A serialized SentencePiece model of 500 pieces (256 of them bytes); model_type "bpe" or "unigram"."""
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(training_corpus()),
        model_writer=model,
        model_type=model_type,
        vocab_size=500,
        byte_fallback=True,
        split_digits=True,
        allow_whitespace_only_pieces=True,
        remove_extra_whitespaces=False,
        normalization_rule_name="identity",
        minloglevel=2,
        **LAYOUTS[layout],
    )
    return model.getvalue()


def model_proto(model_type: str, layout: str = "llama") -> sentencepiece_model_pb2.ModelProto:
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(trained_model(model_type, layout))
    return proto
