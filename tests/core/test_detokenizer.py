"""Streaming deltas never break a UTF-8 character and add up to the one-shot decode (less a character
cut off at the end)."""

import random

import pytest

from ember_core.tokenizer import IncrementalDetokenizer, Tokenizer, TokenizerSpec

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
