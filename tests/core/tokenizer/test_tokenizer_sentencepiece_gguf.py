"""SentencePiece tokenizers from GGUF metadata (tokenizer.ggml.model = "llama": tokens, scores, token
types, optional merges) give the ids, decodes and special tokens of transformers' GGUF tokenizer, for
the Llama, Mistral, Phi-3 and Gemma 2 / 3 architectures."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from transformers import AutoTokenizer, LlamaTokenizer
from transformers.tokenization_utils_base import generate_merges

from ember_core.tokenizer import IncrementalDetokenizer, Tokenizer, tokenizer_from_gguf
from ember_core.tokenizer.gguf_sentencepiece import merges_by_priority
from tests.core.tokenizer.sentencepiece_models import model_proto, trained_model
from tests.core.tokenizer.test_tokenizer_gguf import Field, Reader
from tests.core.tokenizer.test_tokenizer_sentencepiece import TEXTS, assert_ids_match, id_sequences

CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"


@dataclass(frozen=True)
class Case:
    architecture: str
    model_type: str = "bpe"  # of the SentencePiece model
    with_merges: bool = False  # write tokenizer.ggml.merges (else they are derived from the scores)
    add_bos: bool | None = True  # tokenizer.ggml.add_bos_token; None: not written
    layout_of: str | None = None  # the special tokens' layout, if not the architecture's

    @property
    def layout(self) -> str:
        return self.layout_of or ("gemma" if self.architecture.startswith("gemma") else "llama")


CASES = {
    "llama": Case("llama"),
    "llama-unigram": Case("llama", model_type="unigram"),
    "llama-merges": Case("llama", with_merges=True, add_bos=None),
    "mistral-no-bos": Case("mistral", add_bos=False),
    "phi3": Case("phi3"),
    "gemma2": Case("gemma2"),
    "gemma3-unigram": Case("gemma3", model_type="unigram"),
}


def hf_merges(directory: Path, model_type: str) -> list[str]:
    """The merges transformers' LlamaTokenizer derives from the SentencePiece model."""
    directory.mkdir()
    (directory / "tokenizer.model").write_bytes(trained_model(model_type))
    tokenizer_json = json.loads(LlamaTokenizer.from_pretrained(directory).backend_tokenizer.to_str())
    return [" ".join(merge) for merge in tokenizer_json["model"]["merges"]]


def write_gguf(directory: Path, case: Case) -> Path:
    proto = model_proto(case.model_type, case.layout)
    pieces = [piece.piece for piece in proto.pieces]
    if case.architecture.startswith("gemma"):
        # Gemma files write the tokens of two or more spaces with real spaces.
        pieces = [" " * len(piece) if len(piece) > 1 and set(piece) == {"▁"} else piece for piece in pieces]
    path = directory / f"{case.architecture}.gguf"
    writer = gguf.GGUFWriter(str(path), case.architecture)
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(pieces)
    writer.add_token_scores([piece.score for piece in proto.pieces])
    writer.add_token_types([piece.type for piece in proto.pieces])
    if case.with_merges:
        writer.add_token_merges(hf_merges(directory / "sentencepiece", case.model_type))
    writer.add_bos_token_id(proto.trainer_spec.bos_id)
    writer.add_eos_token_id(proto.trainer_spec.eos_id)
    writer.add_unk_token_id(proto.trainer_spec.unk_id)
    if proto.trainer_spec.pad_id >= 0:
        writer.add_pad_token_id(proto.trainer_spec.pad_id)
    writer.add_eot_token_id(pieces.index("<end_of_turn>" if case.layout == "gemma" else "<|im_end|>"))
    if case.add_bos is not None:
        writer.add_add_bos_token(case.add_bos)
    writer.add_add_space_prefix(proto.normalizer_spec.add_dummy_prefix)
    writer.add_chat_template(CHAT_TEMPLATE)
    writer.add_tensor("token_embd.weight", np.zeros((len(pieces), 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Tokenizer, Any, Case]:
    """(ember's tokenizer, transformers', the case) for one GGUF."""
    case = CASES[request.param]
    path = write_gguf(tmp_path_factory.mktemp(request.param), case)
    ember = tokenizer_from_gguf(gguf.GGUFReader(path))
    return ember, AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name), case


def test_ids_match_transformers(pair: tuple[Tokenizer, Any, Case]) -> None:
    assert_ids_match(*pair[:2])


def test_metadata_matches_transformers(pair: tuple[Tokenizer, Any, Case]) -> None:
    ember, reference, case = pair
    added = reference.backend_tokenizer.get_added_tokens_decoder()
    assert ember.special_tokens == {token.content: token_id for token_id, token in added.items() if token.special}
    assert ember.added_tokens == {token.content: token_id for token_id, token in added.items() if not token.special}
    assert (ember.bos_token_id, ember.eos_token_id) == (reference.bos_token_id, reference.eos_token_id)
    assert ember.add_bos_token == (case.add_bos is not False)
    assert ember.chat_template == CHAT_TEMPLATE
    all_added = {**ember.special_tokens, **ember.added_tokens}
    end_of_turn = all_added["<end_of_turn>" if case.layout == "gemma" else "<|im_end|>"]
    assert ember.stop_token_ids == {ember.eos_token_id, end_of_turn}


@pytest.mark.parametrize("skip_special_tokens", [False, True])
def test_decodes_match_transformers(pair: tuple[Tokenizer, Any, Case], skip_special_tokens: bool) -> None:
    ember, reference, _ = pair
    for ids in id_sequences(ember, seed=int(skip_special_tokens)):
        expected = reference.decode(ids, skip_special_tokens=skip_special_tokens)
        assert ember.decode(ids, skip_special_tokens) == expected, ids
        detokenizer = IncrementalDetokenizer(ember, skip_special_tokens)
        assert "".join(detokenizer.push([token_id]) for token_id in ids) == expected, ids


@pytest.mark.parametrize(("model_type", "by_position"), [("bpe", False), ("unigram", False), ("unigram", True)])
def test_merges_from_scores_are_the_ones_transformers_derives(model_type: str, by_position: bool) -> None:
    """Ties included: by score (or, as for Gemma, by position), then by the lengths of the parts."""
    pieces = model_proto(model_type).pieces
    tokens = [piece.piece for piece in pieces]
    scores = [-index for index in range(len(tokens))] if by_position else [piece.score for piece in pieces]
    vocab = {token: token_id for token_id, token in enumerate(tokens)}
    expected = generate_merges(vocab, dict(zip(tokens, scores)))
    assert merges_by_priority(vocab, dict(zip(tokens, scores))) == expected
    assert len(expected) > 100


def test_without_space_prefix_nothing_is_put_in_front(tmp_path: Path) -> None:
    """tokenizer.ggml.add_space_prefix = false (which transformers ignores) as llama.cpp reads it."""
    proto = model_proto("bpe", "gemma")  # trained without SentencePiece's dummy prefix
    assert not proto.normalizer_spec.add_dummy_prefix
    tokenizer = tokenizer_from_gguf(gguf.GGUFReader(write_gguf(tmp_path, Case("llama", layout_of="gemma"))))
    assert tokenizer.spaces_stripped_at_start == 0
    assert tokenizer.decode_bytes(tokenizer.encode("a")) == b"a"
    for text in TEXTS:
        assert tokenizer.decode(tokenizer.encode(text)) == text


def test_a_vocabulary_without_scores_or_merges_is_a_clear_error() -> None:
    fields = {
        "tokenizer.ggml.model": Field("llama"),
        "tokenizer.ggml.tokens": Field(["<unk>", "▁", "a"]),
    }
    with pytest.raises(ValueError, match="neither tokenizer.ggml.merges nor tokenizer.ggml.scores"):
        tokenizer_from_gguf(Reader(fields))
