"""ember's token ids must equal the original tokenizer's on thousands of varied strings:
`tokenizers` itself for HF files, an independent pure-Python byte-level BPE for the GGUF."""

import itertools
import json
import random
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import regex
from tokenizers import Regex, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as HfTokenizer

from ember_core.tokenizer import Tokenizer, load_hf_tokenizer
from ember_core.tokenizer.pretokenizers import GGUF_PRE_ADDS_BOS, GGUF_PRE_PATTERNS, gguf_pre_pattern, hf_pre_pattern
from tests.core.tokenizer.tokenizer_texts import NUM_TEXTS, varied_texts

TEXTS = varied_texts(NUM_TEXTS, seed=0)


def gpt2_byte_to_char() -> dict[int, str]:
    kept = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    shifted = [byte for byte in range(256) if byte not in kept]
    return {**{byte: chr(byte) for byte in kept}, **{byte: chr(0x100 + index) for index, byte in enumerate(shifted)}}


BYTE_TO_CHAR = gpt2_byte_to_char()


def byte_level(text: str) -> str:
    return "".join(BYTE_TO_CHAR[byte] for byte in text.encode())


# --- HF: tokenizers trained here, saved as tokenizer.json (and vocab.json + merges.txt) -------------

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
LLAMA3_HF_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

PRE_TOKENIZERS = {
    "byte_level": lambda: pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    "single_digits": lambda: pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    ),
    "digit_runs": lambda: pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=False), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    ),
    "llama3_split": lambda: pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_HF_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    ),
    # Matches do not cover the text: the gaps between them are pieces too.
    "gappy_split": lambda: pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r"\p{L}+| ?\p{N}"), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    ),
}


@cache
def train_hf_tokenizer(pre_tokenizer: str, full_alphabet: bool) -> HfTokenizer:
    tokenizer = HfTokenizer(models.BPE())
    tokenizer.pre_tokenizer = PRE_TOKENIZERS[pre_tokenizer]()
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=len(SPECIAL_TOKENS) + 256 + 400,
        special_tokens=SPECIAL_TOKENS,
        # Without the full alphabet, bytes absent from the training text (\x04 among them) get no token.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet() if full_alphabet else [],
        show_progress=False,
    )
    training_texts = [text for text in varied_texts(3000, seed=1) if "\x04" not in text]
    tokenizer.train_from_iterator(training_texts, trainer)
    return tokenizer


HF_CASES = [
    ("byte_level", True),
    ("byte_level", False),
    ("single_digits", False),
    ("digit_runs", True),
    ("llama3_split", True),
    ("gappy_split", True),
]


def assert_same_ids(ember: Tokenizer, reference: HfTokenizer, texts: list[str], round_trip: bool) -> None:
    expected = [encoding.ids for encoding in reference.encode_batch(texts, add_special_tokens=False)]
    actual = [ember.encode(text, allow_special=True) for text in texts]
    mismatches = [(text, want, got) for text, want, got in zip(texts, expected, actual) if want != got]
    assert not mismatches, f"{len(mismatches)} of {len(texts)} texts differ, e.g. {mismatches[:3]}"
    for text, ids in zip(texts, expected):
        assert ember.decode(ids) == reference.decode(ids, skip_special_tokens=False)
        if round_trip:
            assert ember.decode(ids) == text


@pytest.mark.parametrize(("pre_tokenizer", "full_alphabet"), HF_CASES)
def test_tokenizer_json_ids_match_tokenizers(tmp_path: Path, pre_tokenizer: str, full_alphabet: bool) -> None:
    train_hf_tokenizer(pre_tokenizer, full_alphabet).save(str(tmp_path / "tokenizer.json"))
    reference = HfTokenizer.from_file(str(tmp_path / "tokenizer.json"))
    ember = load_hf_tokenizer(tmp_path)
    assert ember is not None
    assert ember.special_tokens == {text: reference.token_to_id(text) for text in SPECIAL_TOKENS}
    assert (bytes([4]) in ember.spec.mergeable_ranks) == full_alphabet
    assert_same_ids(ember, reference, TEXTS, round_trip=full_alphabet)


def test_vocab_json_and_merges_txt_ids_match_tokenizers(tmp_path: Path) -> None:
    reference = train_hf_tokenizer("byte_level", False)
    reference.model.save(str(tmp_path))
    (tmp_path / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": "<|im_start|>", "eos_token": {"content": "<|im_end|>", "special": True}})
    )
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"additional_special_tokens": ["<|endoftext|>"]}))
    ember = load_hf_tokenizer(tmp_path)
    assert ember is not None
    assert ember.special_tokens == {text: reference.token_to_id(text) for text in SPECIAL_TOKENS}
    assert ember.bos_token_id == reference.token_to_id("<|im_start|>")
    assert ember.eos_token_id == reference.token_to_id("<|im_end|>")
    assert_same_ids(ember, reference, TEXTS, round_trip=False)


def test_ids_that_do_not_follow_the_merge_order_are_mapped(tmp_path: Path) -> None:
    trained = json.loads(train_hf_tokenizer("byte_level", True).to_str())
    vocab = trained["model"]["vocab"]
    shuffled_ids = sorted(vocab.values())
    random.Random(2).shuffle(shuffled_ids)
    trained["model"]["vocab"] = dict(zip(vocab, shuffled_ids))
    # A vocabulary entry no merge builds: BPE must never produce it, though it still decodes.
    trained["model"]["vocab"]["zzzq"] = len(vocab)
    for entry in trained["added_tokens"]:
        entry["id"] = trained["model"]["vocab"][entry["content"]]
    (tmp_path / "tokenizer.json").write_text(json.dumps(trained))
    reference = HfTokenizer.from_file(str(tmp_path / "tokenizer.json"))
    ember = load_hf_tokenizer(tmp_path)
    assert ember is not None
    assert ember.spec.rank_to_id is not None
    assert ember.decode([len(vocab)]) == "zzzq"
    assert_same_ids(ember, reference, TEXTS, round_trip=True)


@pytest.mark.parametrize(("pre_tokenizer", "full_alphabet"), HF_CASES)
def test_pattern_gives_the_pieces_of_the_pre_tokenizer(pre_tokenizer: str, full_alphabet: bool) -> None:
    reference = train_hf_tokenizer(pre_tokenizer, full_alphabet)
    pattern = regex.compile(hf_pre_pattern(json.loads(reference.to_str())["pre_tokenizer"]))
    for text in TEXTS:
        expected = [piece for piece, _ in reference.pre_tokenizer.pre_tokenize_str(text)]
        assert [byte_level(piece) for piece in pattern.findall(text)] == expected, text


# --- GGUF: an independent pure-Python BPE following llama.cpp's "smollm" pre-tokenizer ----------------


# llama.cpp's regexes per tokenizer.ggml.pre, run one after the other; text between matches is
# kept as pieces of its own.
LLAMA_CPP_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
LLAMA_CPP_STAGES = {
    "gpt-2": [LLAMA_CPP_GPT2],
    "smollm": [r"\p{N}", LLAMA_CPP_GPT2],
    "llama-bpe": [
        (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
        r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
    ],
    "qwen2": [
        (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
        r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
    ],
    "qwen35": [
        (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
        r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
    ],
    "gpt-4o": [
        (r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+"
        r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?"
        r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*"
        r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?"
        r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
    ],
    "tekken": [
        (r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+"
        r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*"
        r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
    ],
}
# llama-vocab.cpp's tokenizer.ggml.pre names, by the pre-tokenizer of LLAMA_CPP_STAGES they share.
LLAMA_CPP_PRE_NAMES = {
    "gpt-2": ["gpt-2", "phi-2", "mpt", "olmo", "jais", "gigachat", "a.x-4.0", "mellum", "exaone4", "trillion",
              "granite-docling"],
    "smollm": ["smollm", "starcoder", "refact", "codeshell", "command-r", "exaone", "minerva-7b", "mellum2"],
    "llama-bpe": ["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                  "jina-v5-nano", "dbrx", "smaug-bpe"],
    "qwen2": ["qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2", "hunyuan", "solar-open"],
    "qwen35": ["qwen35"],
    "gpt-4o": ["gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"],
    "tekken": ["tekken"],
}


def split_keeping_gaps(pattern: str, text: str) -> list[str]:
    pieces, position = [], 0
    for match in regex.finditer(pattern, text):
        pieces += [text[position : match.start()], match.group()]
        position = match.end()
    return [piece for piece in [*pieces, text[position:]] if piece]


def llama_cpp_pieces(pre: str, text: str) -> list[str]:
    pieces = [text]
    for stage in LLAMA_CPP_STAGES[pre]:
        pieces = [smaller for piece in pieces for smaller in split_keeping_gaps(stage, piece)]
    return pieces


class ReferenceBpe:
    def __init__(self, tokens: list[str], token_types: list[int], merges: list[str]) -> None:
        self.token_id = {text: token_id for token_id, (text, kind) in enumerate(zip(tokens, token_types)) if kind == 1}
        self.merge_rank = {tuple(merge.split(" ")): rank for rank, merge in enumerate(merges)}

    @cache  # noqa: B019 - a reference tokenizer per test module: its cache lives as long as it does
    def encode_piece(self, piece: str) -> tuple[int, ...]:
        # Characters with no token are dropped before merging, as HF tokenizers' BPE does.
        symbols = [char for char in byte_level(piece) if char in self.token_id]
        while len(symbols) > 1:
            ranks = [self.merge_rank.get(pair, float("inf")) for pair in itertools.pairwise(symbols)]
            best = min(range(len(ranks)), key=ranks.__getitem__)
            if ranks[best] == float("inf"):
                break
            symbols[best : best + 2] = [symbols[best] + symbols[best + 1]]
        return tuple(self.token_id[symbol] for symbol in symbols)

    def encode(self, text: str) -> list[int]:
        return [token_id for piece in llama_cpp_pieces("smollm", text) for token_id in self.encode_piece(piece)]


@pytest.fixture(scope="module")
def smollm_reference(smollm_reader: Any) -> ReferenceBpe:
    fields = smollm_reader.fields
    return ReferenceBpe(
        fields["tokenizer.ggml.tokens"].contents(),
        fields["tokenizer.ggml.token_type"].contents(),
        fields["tokenizer.ggml.merges"].contents(),
    )


def test_gguf_ids_match_the_reference_bpe(smollm: Tokenizer, smollm_reference: ReferenceBpe) -> None:
    mismatches = [
        (text, expected, actual)
        for text in TEXTS
        if (expected := smollm_reference.encode(text)) != (actual := smollm.encode(text))
    ]
    assert not mismatches, f"{len(mismatches)} of {len(TEXTS)} texts differ, e.g. {mismatches[:3]}"


@pytest.mark.parametrize("pre", sorted(LLAMA_CPP_STAGES))
def test_gguf_pattern_gives_the_pieces_of_llama_cpp_stages(pre: str) -> None:
    pattern = regex.compile(gguf_pre_pattern(pre))
    for text in TEXTS:
        assert pattern.findall(text) == llama_cpp_pieces(pre, text), text


def test_every_gguf_pre_name_has_the_pattern_of_its_llama_cpp_group() -> None:
    """OLMo 2 and Phi-4 GGUFs say "dbrx", Qwen2 / 2.5 / 3 "qwen2", Llama 3.x "llama-bpe"."""
    by_name = {name: group for group, names in LLAMA_CPP_PRE_NAMES.items() for name in names}
    assert set(GGUF_PRE_PATTERNS) == set(by_name)
    assert {name: gguf_pre_pattern(name) for name in by_name} == {
        name: gguf_pre_pattern(group) for name, group in by_name.items()
    }
    # llama.cpp's LLAMA3 pre-tokenizer type (not dbrx or smaug-bpe, which share its regex) and tekken
    assert GGUF_PRE_ADDS_BOS == {
        "llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2", "jina-v5-nano",
        "tekken",
    }


def test_gguf_decode_round_trips(smollm: Tokenizer) -> None:
    # The SmolLM2 vocabulary has no token for these bytes; texts holding them cannot round-trip.
    missing = "".join(map(chr, [0x04, 0x06, 0x13, 0x14, 0x16, 0x1D]))
    round_trippable = [text for text in TEXTS if not regex.search(f"[{missing}\U00040000-\U000bffff]", text)]
    assert len(round_trippable) > NUM_TEXTS // 2
    for text in round_trippable:
        assert smollm.decode(smollm.encode(text)) == text


def test_gguf_drops_bytes_without_a_token(smollm: Tokenizer) -> None:
    # '"' + '"' merges into one token once \x04 between them is dropped, as in HF tokenizers.
    assert smollm.encode('"\x04"') == smollm.encode('""')
    assert len(smollm.encode('""')) == 1
    # Only the lead byte of U+50000 lacks a token: its three continuation bytes stay.
    assert smollm.decode(smollm.encode("a\x04b \U00050000c")) == "ab \ufffd\ufffd\ufffdc"
