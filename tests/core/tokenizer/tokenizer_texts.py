"""Texts that exercise tokenizers: Unicode from many scripts, emoji, whitespace runs, digits, code,
control characters, and special-token look-alikes."""

import random

NUM_TEXTS = 2500

FIXED_TEXTS = [
    "Hello, world! It's a test; we'll see what THEY'VE done, 'S 'll.",
    "  leading and trailing spaces  ",
    "tabs\tand\nnewlines\r\n\r\nand\n\n\nblank lines\n",
    "def square(x):\n    return x ** 2  # comment\n\n\nclass A:\n\tpass\n",
    "for (int i = 0; i < 10; ++i) { a[i] = i * 3.5f; }",
    "3.14159 and 2718281828 and 1,000,000 and ٣٤٥ and ½ and １２３ and Ⅻ",
    "a   1",
    "x 12  345   6789",
    "price:   $1234.56!!!   ok",
    "😀🎉👍🏽 emoji and a family 👨‍👩‍👧 and flags 🇫🇷🇯🇵",
    "日本語のテキスト、中文文本。한국어 텍스트",
    "Café déjà vu, naïve façade, Ångström, Øre, Straße, ǅemal",
    "control \x00\x01\x04\x06\x13\x14\x16\x1d\x1c\x1f\x7f chars",
    "\u00a0non-breaking\u2003em space\u3000ideographic space\u2028line sep",
    "Ελληνικά, русский текст, العربية, हिन्दी",
    "unassigned planes \U00040000\U0007ffff\U00080000\U000bffff end",
    "<|im_start|>user\nhi<|im_end|> looks special",
    "",
    " ",
    "\n",
    "'",
    "'s",
]

_POOLS = [
    "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ",
    "0123456789",
    "٠١٢٣٤٥٦٧٨٩１２３½²",
    "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~",
    "     \t\n\r\u00a0\u3000",
    "éèêëñüöäåøßçœÉÑÜ",
    "".join(map(chr, range(0x4E00, 0x4E40))),
    "".join(map(chr, range(0x1F600, 0x1F640))) + "\u200d\U0001F3FD\ufe0f",
    "".join(map(chr, [*range(0x20), 0x7F])),
    "ЖжЯяΩωαβ",
    "\U00040000\U00050001\U00090002\U000b0003",
]
_WORDS = " ".join(FIXED_TEXTS).split() + ["'s", "'re", "'ll", "n't", "<|im_end|>", "<|endoftext|>", "zzzq"]


def varied_texts(count: int, seed: int) -> list[str]:
    """FIXED_TEXTS plus random mixes of words, whitespace runs, digit runs and characters from
    many scripts, with control characters and bytes some vocabularies lack."""
    rng = random.Random(seed)
    texts = list(FIXED_TEXTS)
    while len(texts) < count:
        fragments = []
        for _ in range(rng.randint(1, 12)):
            kind = rng.random()
            if kind < 0.35:
                fragments.append(rng.choice(_WORDS))
            elif kind < 0.55:
                fragments.append(rng.choice(" \t\n") * rng.randint(1, 6))
            elif kind < 0.7:
                fragments.append("".join(rng.choices("0123456789", k=rng.randint(1, 8))))
            else:
                pool = rng.choice(_POOLS)
                fragments.append("".join(rng.choices(pool, k=rng.randint(1, 6))))
        texts.append(("" if rng.random() < 0.5 else " ").join(fragments))
    return texts
