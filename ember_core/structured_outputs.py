"""Constrained decoding with llguidance: a request's StructuredOutputs (JSON schema, any JSON
object, regex, choice, or grammar) becomes an llguidance grammar, checked without a model (the
gateway's 400s) and compiled once per model and constraint; each constrained sequence keeps a
matcher, which gives the mask of the tokens allowed next (runner/token_masks.py) and consumes each
token sampled.

Torch-free: the gateway imports it to check constraints."""

from __future__ import annotations

import json
from dataclasses import dataclass

import llguidance
import msgspec
from llguidance.gbnf_to_lark import GbnfToLarkError, any_to_lark

from ember_core.tokenizer import Tokenizer
from ember_proto import StructuredOutputs

_KINDS = ("json", "json_object", "regex", "choice", "grammar")


class StructuredOutputError(ValueError):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field  # which of StructuredOutputs' fields is wrong


def grammar_of(spec: StructuredOutputs) -> str:
    """The llguidance grammar of a constraint; StructuredOutputError naming the field when it is
    not exactly one valid constraint."""
    given = [kind for kind in _KINDS if getattr(spec, kind) not in (None, False)]
    if len(given) != 1:
        raise StructuredOutputError("", f"give exactly one of {', '.join(_KINDS)}, got {given or 'none'}")
    kind = given[0]
    if kind == "json":
        try:
            schema = json.loads(spec.json)
        except ValueError as exc:
            raise StructuredOutputError(kind, f"the JSON schema is not JSON: {exc}") from None
        if not isinstance(schema, (dict, bool)):
            raise StructuredOutputError(kind, "a JSON schema is an object (or true / false)")
        grammar = _json_grammar(schema, spec.any_whitespace)
    elif kind == "json_object":
        grammar = _json_grammar({"type": "object"}, spec.any_whitespace)
    elif kind == "regex":
        grammar = llguidance.LLMatcher.grammar_from_regex(spec.regex)
    elif kind == "choice":
        if not spec.choice or not all(spec.choice):
            raise StructuredOutputError(kind, "choice needs at least one non-empty string")
        # Lark string literals take JSON's escapes
        grammar = llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.choice))
    else:
        try:
            lark = any_to_lark(spec.grammar)  # GBNF (llama.cpp's) becomes Lark; Lark stays
        except GbnfToLarkError as exc:
            raise StructuredOutputError(kind, f"the GBNF grammar does not parse: {exc}") from None
        grammar = llguidance.LLMatcher.grammar_from_lark(lark)
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error and not error.startswith("WARNING"):
        raise StructuredOutputError(kind, f"invalid {kind}: {error.strip()}")
    return grammar


# Compact JSON: at most one space between tokens, never a line break, so a small model cannot spend
# its max_tokens on blank lines and indentation (llguidance's default, free whitespace, lets it).
# No space at all makes SmolLM2 repeat a call in a tool-call array or a key in an object without
# end; one optional space keeps the JSON it was trained on ({"a": 1, "b": 2}) within reach.
COMPACT_JSON = {"whitespace_pattern": r"[ ]?"}
# With any_whitespace: one space, or one line break and an indentation up to six levels deep, between
# tokens: room to pretty-print, never runs of blank lines.
JSON_WHITESPACE = r"(?:[ \t]?|\r?\n(?: {0,24}|\t{0,6}))"


def _json_grammar(schema: dict | bool, any_whitespace: bool) -> str:
    """llguidance's JSON grammar, compact or with JSON_WHITESPACE, unless the schema gives its own
    `x-guidance` options (llguidance's: whitespace_flexible, whitespace_pattern, ...)."""
    if schema is True:
        schema = {}
    if isinstance(schema, dict) and "x-guidance" not in schema:
        options = {"whitespace_pattern": JSON_WHITESPACE} if any_whitespace else COMPACT_JSON
        schema = {**schema, "x-guidance": options}
    return llguidance.LLMatcher.grammar_from_json_schema(schema)


class _TokenizerView:
    """What llguidance's TokenizerWrapper reads of a tokenizer: every id's bytes and an encoder."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: list[int]) -> None:
        self.eos_token_id = eos_token_ids[0]
        self.bos_token_id = tokenizer.bos_token_id
        self.tokens = [_bytes_of(tokenizer, token_id) for token_id in range(vocab_size)]
        self.special_token_ids = sorted(tokenizer.special_tokens.values())
        self._tokenizer = tokenizer

    def __call__(self, text: str) -> list[int]:
        return self._tokenizer.encode(text)


def _bytes_of(tokenizer: Tokenizer, token_id: int) -> bytes:
    try:
        return tokenizer.decode_bytes([token_id])
    except ValueError:  # an id past the tokenizer's (a padded vocabulary): never text
        return b""


@dataclass
class ConstraintCompiler:
    """One model's: its llguidance tokenizer (built on first use, ~1 s) and each distinct
    constraint compiled once; matchers are copies of the compiled one."""

    tokenizer: Tokenizer
    vocab_size: int
    eos_token_ids: list[int]

    def __post_init__(self) -> None:
        self._lltokenizer: llguidance.LLTokenizer | None = None
        self._compiled: dict[bytes, llguidance.LLMatcher] = {}

    def matcher(self, spec: StructuredOutputs) -> llguidance.LLMatcher:
        """A fresh matcher of this constraint; StructuredOutputError when it does not compile."""
        key = msgspec.msgpack.encode(spec)
        compiled = self._compiled.get(key)
        if compiled is None:
            compiled = llguidance.LLMatcher(self._llguidance_tokenizer(), grammar_of(spec), log_level=0)
            if compiled.is_error():
                raise StructuredOutputError("", f"the constraint does not compile: {compiled.get_error()}")
            self._compiled[key] = compiled
        return compiled.deep_copy()

    def _llguidance_tokenizer(self) -> llguidance.LLTokenizer:
        if self._lltokenizer is None:
            tokenizer_json = self.tokenizer.spec.tokenizer_json
            # llguidance runs a SentencePiece-style tokenizer.json itself: it knows the "▁" put in
            # front of a text, which an encoder handed to it through TokenizerWrapper would add.
            source = (
                llguidance.TokenizerWrapper(_TokenizerView(self.tokenizer, self.vocab_size, self.eos_token_ids))
                if tokenizer_json is None
                else tokenizer_json
            )
            self._lltokenizer = llguidance.LLTokenizer(source, n_vocab=self.vocab_size, eos_token=self.eos_token_ids)
        return self._lltokenizer
