"""A model directory with a tokenizer: the tiny random GPT-2 plus a byte-level BPE trained here."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2; 0 is the model's EOS
CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello, world! How are you today? I am fine, thank you.",
    "Once upon a time there was a small model that could only say a few words.",
    "ünïcödé text: café, naïve, jalapeño, 東京, €100 and emoji 🙂 are bytes too.",
    "def main():\n    print('hello')\n    return 0\n",
    "the of and to in is that it for on with as was at by be this have from",
]


def write_model_with_tokenizer(model_dir: Path, target: Path, vocab_size: int = 384) -> Path:
    """Copies the checkpoint in model_dir to target and adds vocab.json, merges.txt and a
    tokenizer_config.json with a ChatML template. The vocabulary fills exactly vocab_size ids,
    so every id the model can sample decodes to something."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    shutil.copytree(model_dir, target)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS * 20, trainer)
    if tokenizer.get_vocab_size() != vocab_size:
        raise RuntimeError(f"trained {tokenizer.get_vocab_size()} tokens, wanted {vocab_size}")
    tokenizer.model.save(str(target))
    config = {
        "added_tokens_decoder": {
            str(index): {"content": text, "special": True} for index, text in enumerate(SPECIAL_TOKENS)
        },
        "bos_token": "<|endoftext|>",
        "eos_token": "<|endoftext|>",
        "chat_template": CHATML_TEMPLATE,
        "tokenizer_class": "GPT2Tokenizer",
    }
    (target / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return target
