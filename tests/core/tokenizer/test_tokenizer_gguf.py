"""The SmolLM2 GGUF's tokenizer metadata: special ids, special-token handling, spec transport,
and clear errors for what is not supported. SentencePiece GGUFs: test_tokenizer_sentencepiece_gguf.py."""

from dataclasses import dataclass
from typing import Any

import msgspec
import pytest

from ember_core.tokenizer import Tokenizer, TokenizerSpec, tokenizer_from_gguf


@dataclass
class Field:
    value: Any

    def contents(self) -> Any:
        return self.value


@dataclass
class Reader:
    fields: dict[str, Any]


def with_fields(reader: Any, **overrides: Any) -> Reader:
    """reader's fields with some replaced; keys use '__' for '.', a None value removes the key."""
    fields = dict(reader.fields)
    for key, value in overrides.items():
        key = key.replace("__", ".")
        if value is None:
            fields.pop(key)
        else:
            fields[key] = Field(value)
    return Reader(fields)


def test_special_ids(smollm: Tokenizer) -> None:
    assert smollm.vocab_size == 49152
    assert smollm.bos_token_id == 1
    assert smollm.eos_token_id == 2
    assert smollm.stop_token_ids == frozenset({0, 2})  # <|endoftext|>, <|im_end|>
    assert smollm.special_tokens["<|im_start|>"] == 1
    assert smollm.special_tokens["<|im_end|>"] == 2
    assert len(smollm.special_tokens) == 17
    assert smollm.added_tokens == {}
    assert not smollm.add_bos_token
    assert smollm.chat_template is not None and "<|im_start|>" in smollm.chat_template


def test_known_ids(smollm: Tokenizer) -> None:
    assert smollm.encode("Hello world! 123") == [19556, 905, 17, 216, 33, 34, 35]
    assert smollm.encode("  multiple   spaces") == [216, 2701, 256, 5600]


def test_special_tokens_are_recognised_only_when_allowed(smollm: Tokenizer) -> None:
    assert smollm.encode("<|im_end|>", allow_special=True) == [2]
    as_text = smollm.encode("<|im_end|>")
    assert len(as_text) > 1
    assert not set(as_text) & set(smollm.special_tokens.values())
    assert smollm.decode(as_text) == "<|im_end|>"

    prompt = "<|im_start|>user\nHi there<|im_end|>\n"
    ids = smollm.encode(prompt, allow_special=True)
    assert ids == [1, *smollm.encode("user\nHi there"), 2, *smollm.encode("\n")]
    assert smollm.decode(ids) == prompt
    assert smollm.decode(ids, skip_special_tokens=True) == "user\nHi there\n"


def test_decode_rejects_unknown_ids(smollm: Tokenizer) -> None:
    with pytest.raises(ValueError, match="token id 49152 is out of range"):
        smollm.decode([5, 49152])
    with pytest.raises(ValueError, match="token id -1 is out of range"):
        smollm.decode([-1])
    with pytest.raises(ValueError, match="out of range"):
        smollm.decode_bytes([10**9])


def test_spec_round_trips_through_msgpack(smollm: Tokenizer) -> None:
    wire = msgspec.msgpack.encode(smollm.spec)
    rebuilt = Tokenizer.from_spec(msgspec.msgpack.decode(wire, type=TokenizerSpec))
    assert rebuilt.spec == smollm.spec
    text = "<|im_start|>assistant\nDéjà vu 😀 x=42<|im_end|>"
    assert rebuilt.encode(text, allow_special=True) == smollm.encode(text, allow_special=True)
    assert rebuilt.stop_token_ids == smollm.stop_token_ids


def test_eot_and_user_defined_tokens(smollm_reader: Any) -> None:
    tokens = smollm_reader.fields["tokenizer.ggml.tokens"].contents()
    token_types = list(smollm_reader.fields["tokenizer.ggml.token_type"].contents())
    token_types[3] = 4  # <repo_name> becomes a user-defined token
    tokenizer = tokenizer_from_gguf(
        with_fields(smollm_reader, tokenizer__ggml__token_type=token_types, tokenizer__ggml__eot_token_id=5)
    )
    assert 5 in tokenizer.stop_token_ids
    assert tokenizer.added_tokens == {tokens[3]: 3}
    # User-defined tokens are always recognised and never skipped.
    assert tokenizer.encode("a<repo_name>b") == [*tokenizer.encode("a"), 3, *tokenizer.encode("b")]
    assert tokenizer.decode([3, 4], skip_special_tokens=True) == "<repo_name>"


@pytest.mark.parametrize("pre", ["default", "deepseek-llm", "gpt2", None])
def test_unsupported_pre_tokenizer_is_a_clear_error(smollm_reader: Any, pre: str | None) -> None:
    with pytest.raises(ValueError, match="unsupported GGUF pre-tokenizer.*supported: .*smollm"):
        tokenizer_from_gguf(with_fields(smollm_reader, tokenizer__ggml__pre=pre))


def test_unsupported_tokenizer_model_is_a_clear_error(smollm_reader: Any) -> None:
    with pytest.raises(ValueError, match="tokenizer.ggml.model='t5'; supported: 'gpt2' .*'llama'"):
        tokenizer_from_gguf(with_fields(smollm_reader, tokenizer__ggml__model="t5"))


def test_add_bos_token_default_follows_llama_cpp(smollm_reader: Any) -> None:
    llama3 = tokenizer_from_gguf(
        with_fields(smollm_reader, tokenizer__ggml__pre="llama-bpe", tokenizer__ggml__add_bos_token=None)
    )
    assert llama3.add_bos_token
