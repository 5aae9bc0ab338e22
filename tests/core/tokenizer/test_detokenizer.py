"""Streaming deltas never break a UTF-8 character and add up to the one-shot decode (less a character
cut off at the end), for byte-level and SentencePiece-style vocabularies."""

import random

import pytest
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HfTokenizer

from ember_core.tokenizer import IncrementalDetokenizer, Tokenizer, TokenizerSpec
from ember_core.tokenizer.sentencepiece_style import sentencepiece_spec

MULTIBYTE_TEXT = "日本語のテキスト😀🎉👍🏽👨‍👩‍👧éñüПривет"


def fragment_tokens() -> list[bytes]:
    """Every byte, every multi-byte character whole, and pieces of them cut at each byte."""
    tokens: dict[bytes, None] = {bytes([byte]): None for byte in range(256)}
    for char in MULTIBYTE_TEXT:
        data = char.encode()
        for cut in range(1, len(data)):
            tokens.setdefault(data[:cut])
            tokens.setdefault(data[cut:])
        tokens.setdefault(data)
        tokens.setdefault(b" " + data)
    return list(tokens)


TOKENS = fragment_tokens()
SPECIAL_IDS = {"<|im_end|>": len(TOKENS), "<|endoftext|>": len(TOKENS) + 1}
TOKENIZER = Tokenizer(
    TokenizerSpec(
        pattern=r"\s?\S+|\s+",
        mergeable_ranks={data: rank for rank, data in enumerate(TOKENS)},
        special_tokens=SPECIAL_IDS,
    )
)


def random_ids(rng: random.Random) -> list[int]:
    ids: list[int] = []
    for _ in range(rng.randint(0, 8)):
        kind = rng.random()
        if kind < 0.4:
            text = "".join(rng.choices(MULTIBYTE_TEXT + " ab", k=rng.randint(1, 6)))
            ids += TOKENIZER.encode(text)
        elif kind < 0.8:
            ids += rng.choices(range(TOKENIZER.vocab_size), k=rng.randint(1, 4))
        else:
            ids.append(rng.choice(list(SPECIAL_IDS.values())))
    return ids


def stream(ids: list[int], chunk_sizes: list[int], skip_special_tokens: bool) -> str:
    full = TOKENIZER.decode(ids, skip_special_tokens=skip_special_tokens)
    detokenizer = IncrementalDetokenizer(TOKENIZER, skip_special_tokens=skip_special_tokens)
    emitted, position = "", 0
    for size in chunk_sizes:
        emitted += detokenizer.push(ids[position : position + size])
        position += size
        # A prefix of the full decode: no replacement character shows up early.
        assert full.startswith(emitted), (ids, emitted, full)
    return emitted


@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize("max_chunk", [1, 5])
def test_deltas_add_up_to_the_full_decode(skip_special_tokens: bool, max_chunk: int) -> None:
    rng = random.Random(max_chunk)
    for _ in range(400):
        ids = random_ids(rng)
        chunk_sizes = []
        while sum(chunk_sizes) < len(ids):
            chunk_sizes.append(rng.randint(0, max_chunk) if max_chunk > 1 else 1)
        emitted = stream(ids, chunk_sizes, skip_special_tokens)
        # All of it, but for the one replacement character a cut-off last character decodes to.
        assert TOKENIZER.decode(ids, skip_special_tokens)[len(emitted) :] in ("", "\ufffd")


def test_a_character_split_over_tokens_is_held_back() -> None:
    ids = [TOKENS.index(bytes([byte])) for byte in "😀".encode()]
    detokenizer = IncrementalDetokenizer(TOKENIZER)
    assert [detokenizer.push([token_id]) for token_id in ids] == ["", "", "", "😀"]


def test_a_character_cut_off_at_the_end_never_becomes_text() -> None:
    ids = [TOKENS.index(bytes([byte])) for byte in "a😀".encode()][:-1]
    assert TOKENIZER.decode(ids) == "a\ufffd"
    detokenizer = IncrementalDetokenizer(TOKENIZER)
    assert "".join(detokenizer.push([token_id]) for token_id in ids) == "a"


def test_an_unfinished_character_is_replaced_when_it_cannot_complete() -> None:
    partial = TOKENS.index("😀".encode()[:2])
    detokenizer = IncrementalDetokenizer(TOKENIZER, skip_special_tokens=False)
    assert detokenizer.push([partial]) == ""
    assert detokenizer.push(TOKENIZER.encode("a")) == "\ufffda"
    assert detokenizer.push([partial]) == ""
    assert detokenizer.push([SPECIAL_IDS["<|im_end|>"]]) == "\ufffd<|im_end|>"
    assert detokenizer.push([partial]) == ""  # held back, and dropped if nothing follows


def test_skipped_special_tokens_do_not_cut_a_character() -> None:
    first, rest = "日".encode()[:1], "日".encode()[1:]
    ids = [TOKENS.index(first), SPECIAL_IDS["<|endoftext|>"], TOKENS.index(rest)]
    detokenizer = IncrementalDetokenizer(TOKENIZER, skip_special_tokens=True)
    assert "".join(detokenizer.push([token_id]) for token_id in ids) == "日"


# --- SentencePiece style: "▁" for spaces, "<0xAB>" byte tokens, the leading space decode() drops ---


def sentencepiece_pair() -> tuple[Tokenizer, HfTokenizer]:
    """(ember's tokenizer, HF tokenizers' reference) of a small Llama-style vocabulary: every byte as
    a <0xAB> token, a few pieces, a Metaspace pre-tokenizer and Llama's decoder."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{byte:02X}>": 3 + byte for byte in range(256)}}
    for piece in ["▁", "a", "b", "▁a", "▁b", "ab", "▁ab", "日", "▁▁"]:
        vocab[piece] = len(vocab)
    merges = [("▁", "a"), ("▁", "b"), ("a", "b"), ("▁a", "b"), ("▁", "▁")]
    reference = HfTokenizer(models.BPE(vocab, merges, byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    reference.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    reference.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(content=" ", left=1)]
    )
    specials = ["<unk>", "<s>", "</s>"]
    reference.add_special_tokens([AddedToken(text, special=True, normalized=False) for text in specials])
    return Tokenizer(sentencepiece_spec(reference, bos_token_id=1, eos_token_id=2)), reference


SP_TOKENIZER, SP_REFERENCE = sentencepiece_pair()
SP_TEXT = " ab  b a😀日本 b\n"


def sp_stream(ids: list[int], skip_special_tokens: bool) -> str:
    detokenizer = IncrementalDetokenizer(SP_TOKENIZER, skip_special_tokens=skip_special_tokens)
    return "".join(detokenizer.push([token_id]) for token_id in ids)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_sentencepiece_deltas_drop_the_leading_space_once(skip_special_tokens: bool) -> None:
    for text in [SP_TEXT, "ab", "  b", "😀 a", "<s>ab</s> b", "</s>"]:
        ids = SP_TOKENIZER.encode(text, allow_special=True)
        for with_bos in (ids, [1, *ids], [1, 2, *ids]):
            expected = SP_REFERENCE.decode(with_bos, skip_special_tokens=skip_special_tokens)
            assert SP_TOKENIZER.decode(with_bos, skip_special_tokens) == expected
            assert sp_stream(with_bos, skip_special_tokens) == expected


def test_sentencepiece_character_over_byte_tokens_is_held_back() -> None:
    ids = SP_TOKENIZER.encode("😀")
    assert SP_TOKENIZER.decode_bytes(ids[:1]) == b" "  # the "▁" put in front, dropped at the start
    detokenizer = IncrementalDetokenizer(SP_TOKENIZER)
    assert [detokenizer.push([token_id]) for token_id in ids] == ["", "", "", "", "😀"]
    assert detokenizer.push(SP_TOKENIZER.encode("b")) == " b"


def test_sentencepiece_deltas_add_up_to_the_full_decode() -> None:
    """Random ids, byte tokens that spell no character among them: the stream is decode() (which
    gives Python's U+FFFD per invalid byte sequence, where HF tokenizers gives one per byte token of
    the run: the stream cannot take back a character it sent)."""
    rng = random.Random(0)
    for _ in range(500):
        ids = rng.choices(range(SP_TOKENIZER.vocab_size), k=rng.randint(0, 10))
        for skip_special_tokens in (True, False):
            full = SP_TOKENIZER.decode(ids, skip_special_tokens)
            assert full[: len(emitted := sp_stream(ids, skip_special_tokens))] == emitted
            assert full[len(emitted) :] in ("", "\ufffd")
