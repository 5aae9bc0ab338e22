"""SentencePiece-style tokenizers from HF model directories (Llama 2, Mistral, Phi-3, Gemma shapes;
BPE and Unigram) give transformers' AutoTokenizer's ids, decodes and chat prompts; the incremental
detokenizer adds up to the full decode; the spec carries them to a gateway; llguidance compiles a
JSON schema for them."""

from __future__ import annotations

import json
import random
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import llguidance
import msgspec
import pytest
from tokenizers import AddedToken, normalizers, processors
from tokenizers import Tokenizer as HfTokenizer
from transformers import AutoTokenizer, GemmaTokenizer, LlamaTokenizer, PreTrainedTokenizerBase, TokenizersBackend

from ember_core.structured_outputs import ConstraintCompiler
from ember_core.tokenizer import IncrementalDetokenizer, OutputText, Tokenizer, TokenizerSpec, load_hf_tokenizer
from ember_proto import StructuredOutputs
from tests.core.tokenizer.sentencepiece_models import trained_model
from tests.core.tokenizer.tokenizer_texts import varied_texts

LLAMA2_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
    "{% else %} {{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
)
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
SPECIAL_TEXTS = [
    "<s>[INST] What is 2+2? [/INST] 4</s>",
    "<s> <s>x</s>  <unk>",
    "<|im_start|>user\nHi  there<|im_end|>\n<|im_start|>assistant\n",
    "<bos><start_of_turn>user\nHallo 😀<end_of_turn>\n<start_of_turn>model\n<eos><pad><mask>",
    "```python\nprint(1)\n```",
    "  two leading spaces, trailing  ",
    "\n\nnew lines first",
]
TEXTS = SPECIAL_TEXTS + varied_texts(500, seed=3)
MESSAGES = [
    {"role": "user", "content": "Hello there, how are you? 😀"},
    {"role": "assistant", "content": " Fine. 日本語"},
    {"role": "user", "content": "  And  code: ```x = 1```"},
]


@dataclass(frozen=True)
class Case:
    model_type: str  # of the SentencePiece model: "bpe" or "unigram"
    layout: str  # of its special tokens: "llama" or "gemma"
    converter: type[PreTrainedTokenizerBase]  # the transformers class that converts it
    config: dict[str, Any] = field(default_factory=dict)  # tokenizer_config.json entries to set
    model_config: dict[str, Any] = field(default_factory=dict)  # config.json
    bos_first: bool = True  # tokenizer.json's post-processor puts BOS in front (it decides, not add_bos_token)
    legacy_json: bool = False  # tokenizer.json rewritten with a Prepend normalizer, as Llama 2's and Phi-3's
    added_specials: tuple[str, ...] = ()  # control tokens added to tokenizer.json, as Mistral v0.3's [INST]


LLAMA_CONFIG = {"chat_template": LLAMA2_TEMPLATE}
CASES = {
    "llama": Case("bpe", "llama", LlamaTokenizer, LLAMA_CONFIG),
    "llama-legacy": Case("bpe", "llama", LlamaTokenizer, {**LLAMA_CONFIG, "legacy": True}),
    # Llama 2's files: a legacy tokenizer.json that transformers rebuilds as LlamaTokenizer.
    "llama2-hub": Case("bpe", "llama", LlamaTokenizer, {**LLAMA_CONFIG, "legacy": False}, legacy_json=True),
    # Phi-3's: the same file, which transformers reads as written for model_type phi3.
    "phi3": Case("bpe", "llama", LlamaTokenizer, {**LLAMA_CONFIG, "eos_token": "<|im_end|>"}, {"model_type": "phi3"},
                 legacy_json=True),
    "mistral-v0.3": Case("bpe", "llama", LlamaTokenizer, LLAMA_CONFIG, {"model_type": "mistral"},
                         added_specials=("[INST]", "[/INST]")),
    "llama-unigram": Case("unigram", "llama", LlamaTokenizer, LLAMA_CONFIG),
    # add_bos_token is ignored: the post-processor does not put BOS in front.
    "unigram": Case("unigram", "llama", TokenizersBackend, {"add_bos_token": True}, bos_first=False),
    "gemma": Case("bpe", "gemma", GemmaTokenizer, {"chat_template": GEMMA_TEMPLATE}),
}


def model_dir(root: Path, case: Case) -> Path:
    source, directory = root / "source", root / "model"
    source.mkdir()
    (source / "tokenizer.model").write_bytes(trained_model(case.model_type, case.layout))
    case.converter.from_pretrained(source).save_pretrained(directory)
    (directory / "tokenizer.model").unlink(missing_ok=True)
    shutil.rmtree(source)
    config_path = directory / "tokenizer_config.json"
    config = {**json.loads(config_path.read_text()), **case.config}
    config_path.write_text(json.dumps(config))
    tokenizer = HfTokenizer.from_file(str(directory / "tokenizer.json"))
    if case.bos_first:
        bos = config["bos_token"]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, tokenizer.token_to_id(bos))]
        )
    if case.legacy_json:
        tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        tokenizer.pre_tokenizer = None
    tokenizer.add_special_tokens([AddedToken(text, special=True, normalized=False) for text in case.added_specials])
    tokenizer.save(str(directory / "tokenizer.json"))
    if case.model_config:
        (directory / "config.json").write_text(json.dumps(case.model_config))
    return directory


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Tokenizer, Any]:
    """(ember's tokenizer, transformers') for one case."""
    directory = model_dir(tmp_path_factory.mktemp(request.param), CASES[request.param])
    ember = load_hf_tokenizer(directory)
    assert ember is not None and ember.spec.tokenizer_json is not None
    return ember, AutoTokenizer.from_pretrained(directory)


def test_ids_match_transformers(pair: tuple[Tokenizer, Any]) -> None:
    assert_ids_match(*pair)


def assert_ids_match(ember: Tokenizer, reference: Any) -> None:
    """With and without special tokens recognised, and as a prompt (BOS added where it adds one)."""
    mismatches = []
    for text in TEXTS:
        expected = reference.encode(text, add_special_tokens=False)
        as_text = reference.encode(text, add_special_tokens=False, split_special_tokens=True)
        prompt_differs = expected[:1] != [ember.bos_token_id] and ember.encode_prompt(text) != reference.encode(text)
        if ember.encode(text, allow_special=True) != expected or ember.encode(text) != as_text or prompt_differs:
            mismatches.append(text)
    assert not mismatches, f"{len(mismatches)} of {len(TEXTS)} texts differ, e.g. {mismatches[:3]}"


def test_special_tokens_and_ids_match_transformers(pair: tuple[Tokenizer, Any]) -> None:
    ember, reference = pair
    added = reference.backend_tokenizer.get_added_tokens_decoder()
    assert ember.special_tokens == {token.content: token_id for token_id, token in added.items() if token.special}
    assert ember.added_tokens == {token.content: token_id for token_id, token in added.items() if not token.special}
    assert (ember.bos_token_id, ember.eos_token_id) == (reference.bos_token_id, reference.eos_token_id)
    assert ember.vocab_size == len(reference)


def whole_characters(ember: Tokenizer, ids: list[int]) -> bool:
    try:
        ember.decode_bytes(ids).decode()
    except UnicodeDecodeError:
        return False
    return True


def id_sequences(ember: Tokenizer, seed: int) -> list[list[int]]:
    """Pieces of encodings run together, with special and random (not byte) tokens between them:
    every run of byte tokens spells whole characters (transformers decodes a run that does not as
    one U+FFFD per byte; ember, which cannot take back streamed text, as Python's UTF-8 decoder does)."""
    rng = random.Random(seed)
    encodings = [ember.encode(text, allow_special=True) for text in TEXTS]
    byte_tokens = {token_id for token_id in range(ember.vocab_size) if len(ember.decode_bytes([token_id])) == 1}
    others = sorted(set(range(ember.vocab_size)) - byte_tokens)
    sequences = []
    for _ in range(300):
        ids: list[int] = []
        for _ in range(rng.randint(1, 4)):
            encoding = rng.choice(encodings)
            cut = rng.randint(0, min(12, len(encoding)))
            while not whole_characters(ember, encoding[:cut]):
                cut -= 1
            ids += encoding[:cut] + rng.choices([*ember.special_tokens.values(), *others], k=rng.randint(0, 2))
        sequences.append(ids)
    return sequences


@pytest.mark.parametrize("skip_special_tokens", [False, True])
def test_decodes_match_transformers(pair: tuple[Tokenizer, Any], skip_special_tokens: bool) -> None:
    ember, reference = pair
    for ids in id_sequences(ember, seed=skip_special_tokens):
        expected = reference.decode(ids, skip_special_tokens=skip_special_tokens)
        assert ember.decode(ids, skip_special_tokens) == expected, ids
        detokenizer = IncrementalDetokenizer(ember, skip_special_tokens)
        assert "".join(detokenizer.push([token_id]) for token_id in ids) == expected, ids


def test_chat_prompt_matches_transformers(pair: tuple[Tokenizer, Any]) -> None:
    ember, reference = pair
    if ember.chat_template is None:  # the unigram case: chat is refused, not guessed
        with pytest.raises(ValueError, match="no chat template"):
            ember.render_chat(MESSAGES)
        return
    text = reference.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert ember.render_chat(MESSAGES) == text
    assert ember.apply_chat_template(MESSAGES) == reference.encode(text, add_special_tokens=False)


def test_spec_round_trips_through_msgpack(pair: tuple[Tokenizer, Any]) -> None:
    ember, _ = pair
    rebuilt = Tokenizer.from_spec(msgspec.msgpack.decode(msgspec.msgpack.encode(ember.spec), type=TokenizerSpec))
    assert rebuilt.spec == ember.spec
    for text in TEXTS[:50]:
        assert rebuilt.encode(text) == ember.encode(text)
        ids = ember.encode(text, allow_special=True)
        assert rebuilt.decode(ids) == ember.decode(ids)


def test_llguidance_compiles_a_json_schema_and_reads_tokens_as_ember(pair: tuple[Tokenizer, Any]) -> None:
    ember, _ = pair
    eos = [ember.eos_token_id]
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    matcher = ConstraintCompiler(ember, ember.vocab_size, eos).matcher(StructuredOutputs(json=json.dumps(schema)))
    assert not matcher.is_error()
    # The document's tokens, less the "▁" SentencePiece puts in front, are a way through the schema.
    ids = ember.encode('{"city": "Köln 😀"}')
    ids = ids[1:] if ember.decode_bytes(ids[:1]) == b" " else ids
    assert matcher.consume_tokens(ids) and matcher.is_accepting(), matcher.get_error()
    lltokenizer = llguidance.LLTokenizer(ember.spec.tokenizer_json, n_vocab=ember.vocab_size, eos_token=eos)
    plain = [token_id for token_id in range(ember.vocab_size) if not lltokenizer.is_special_token(token_id)]
    assert [lltokenizer.decode_bytes([token_id]) for token_id in plain] == [ember.decode_bytes([i]) for i in plain]


def test_an_output_keeps_the_space_that_continues_its_prompt(pair: tuple[Tokenizer, Any]) -> None:
    """A generation continues its prompt, so its first token's leading space is text (as vLLM
    keeps it): prompt text + output text is the decode of prompt + output, where decode() alone
    would drop that space at the start."""
    ember, reference = pair
    prompt, output = ember.encode("The capital of France is"), ember.encode("Paris, and of Italy Rome.")
    text = OutputText(ember).push(output, final=True).text
    assert reference.decode(prompt) + text == reference.decode(prompt + output)
