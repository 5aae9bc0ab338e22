"""Small tokenizers for random checkpoints, trained offline on sentences of common English words.

Two styles, as the families ship them: byte-level BPE (GPT-2, Llama 3, Qwen, OLMo) and
SentencePiece-style BPE with byte fallback (Llama 2, Mistral, Gemma, Phi-3). The SentencePiece
style gets its merges the way Hugging Face converts a SentencePiece model: every split of a token
into two tokens, ranked by the token's id. Tokenizing with those merges is what llama.cpp's
SentencePiece tokenizer does with scores that fall with the id, so the GGUF tokenizes as the
checkpoint does.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from ember_bench.families import CHAT_TOKENS, SpecialTokens, TokenizerStyle
from ember_bench.gguf_vocab import LLAMA3_SPLIT, QWEN2_SPLIT, SPM_SPACE
from ember_bench.workload import WORDS

CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_TRAINING_SENTENCES = 4000


def training_sentences(seed: int) -> list[str]:
    """Sentences of common words with capitals, digits and punctuation: what every vocabulary
    here is trained on."""
    rng = random.Random(seed)
    sentences = []
    for _ in range(_TRAINING_SENTENCES):
        words = rng.choices(WORDS, k=rng.randint(4, 14))
        words[0] = words[0].capitalize()
        if rng.random() < 0.3:
            words.insert(rng.randrange(len(words)), str(rng.randint(0, 2025)))
        sentences.append(" ".join(words) + rng.choice(".,!?;:") + rng.choice(["", "\n"]))
    return sentences


def write_tokenizer(
    out_dir: Path, style: TokenizerStyle, specials: SpecialTokens, vocab_size: int, seed: int = 0
) -> None:
    """Train a tokenizer of exactly vocab_size ids (unreachable `<extra_N>` entries fill what
    training leaves) and save it with transformers, chat template included."""
    from transformers import PreTrainedTokenizerFast

    if style.startswith("sentencepiece"):
        tokenizer = _sentencepiece_style(style, specials, vocab_size, seed)
    else:
        tokenizer = _byte_level(style, specials, vocab_size, seed)
    if tokenizer.get_vocab_size() != vocab_size:
        raise ValueError(f"vocab_size {vocab_size} is too small for {tokenizer.get_vocab_size()} base tokens")
    hf_tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token=specials.bos, eos_token=specials.eos, unk_token=specials.unk,
        pad_token=specials.pad, additional_special_tokens=[
            token for token in specials.added_tokens() if token.content in CHAT_TOKENS
        ],
    )
    hf_tokenizer.chat_template = CHATML_TEMPLATE
    hf_tokenizer.save_pretrained(out_dir)


def _byte_level(style: TokenizerStyle, specials: SpecialTokens, vocab_size: int, seed: int):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    if style == "gpt2":
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        split = LLAMA3_SPLIT if style == "llama3" else QWEN2_SPLIT
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials.texts(), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(training_sentences(seed), trainer)
    tokenizer = _padded(tokenizer, vocab_size)
    steps = [processors.ByteLevel(trim_offsets=False)]
    if specials.add_bos:
        steps.append(_bos_template(tokenizer, specials.bos))
    tokenizer.post_processor = processors.Sequence(steps)
    return tokenizer


def _sentencepiece_style(style: TokenizerStyle, specials: SpecialTokens, vocab_size: int, seed: int):
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    prefix_space = style == "sentencepiece"
    # Trained per word, so no piece spans a space: SentencePiece's split_by_whitespace.
    trainer_tokenizer = Tokenizer(models.BPE())
    trainer_tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement=SPM_SPACE, prepend_scheme="first" if prefix_space else "never"
    )
    fixed = [*specials.texts(), *(f"<0x{byte:02X}>" for byte in range(256))]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=fixed, show_progress=False)
    trainer_tokenizer.train_from_iterator(training_sentences(seed), trainer)
    trained = json.loads(trainer_tokenizer.to_str())["model"]["vocab"]
    vocab = {token: token_id for token, token_id in sorted(trained.items(), key=lambda item: item[1])}

    tokenizer = Tokenizer(models.BPE(
        vocab=vocab, merges=_sentencepiece_merges(vocab), unk_token=specials.unk, byte_fallback=True, fuse_unk=True,
    ))
    space = [normalizers.Replace(" ", SPM_SPACE)]
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend(SPM_SPACE), *space] if prefix_space else space)
    decoder_steps = [decoders.Replace(SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix_space:
        decoder_steps.append(decoders.Strip(" ", 1, 0))
    tokenizer.decoder = decoders.Sequence(decoder_steps)
    tokenizer.add_special_tokens(specials.added_tokens())
    tokenizer = _padded(tokenizer, vocab_size)
    if specials.add_bos:
        tokenizer.post_processor = _bos_template(tokenizer, specials.bos)
    return tokenizer


def _sentencepiece_merges(vocab: dict[str, int]) -> list[tuple[str, str]]:
    merges = []
    for token, token_id in vocab.items():
        if token.startswith("<") and token.endswith(">"):
            continue  # specials and byte tokens are never merged into
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                merges.append((token_id, vocab[left], (left, right)))
    return [pair for _, _, pair in sorted(merges)]


def _padded(tokenizer, vocab_size: int):
    """Fill the model vocabulary up to vocab_size with entries no merge makes."""
    from tokenizers import Tokenizer

    spec = json.loads(tokenizer.to_str())
    vocab = spec["model"]["vocab"]
    used = len(vocab) + sum(1 for added in spec["added_tokens"] if added["content"] not in vocab)
    for index in range(vocab_size - used):
        vocab[f"<extra_{index}>"] = used + index
    return Tokenizer.from_str(json.dumps(spec))


def _bos_template(tokenizer, bos: str | None):
    from tokenizers import processors

    if bos is None:
        raise ValueError("add_bos needs a bos token")
    bos_id = tokenizer.token_to_id(bos)
    return processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A $B:1", special_tokens=[(bos, bos_id)])
