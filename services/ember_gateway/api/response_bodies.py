"""Response bodies as msgspec Structs, which openapi.py describes. Every body the gateway sends is
built as one of these (formats.py, logprobs.py, respond.py, app.py, tokenize.py, and errors.py for
the error body), so the document cannot drift from them; msgspec encodes them (a field left UNSET
is left out)."""

from __future__ import annotations

from typing import Literal

import msgspec
from msgspec import UNSET, UnsetType

FinishLabel = Literal["stop", "length", "tool_calls"]


class Shape(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A response object: exactly these fields (additionalProperties false in the document)."""


class ErrorDetail(Shape):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(Shape):
    """Every 4xx and 5xx body, as OpenAI's; a stream that fails after its 200 sends it as an event."""

    error: ErrorDetail


class Usage(Shape):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class TopLogprob(Shape):
    token: str
    logprob: float
    bytes: list[int] | None  # null without a tokenizer


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(Shape):
    content: list[TokenLogprob] | None
    refusal: list[TokenLogprob] | None


class FunctionCall(Shape):
    name: str
    arguments: str  # JSON text


class ToolCall(Shape):
    id: str
    type: Literal["function"]
    function: FunctionCall


class ToolCallChunk(Shape):
    """A stream sends each call whole, once complete."""

    index: int  # first, as in OpenAI's streams (a subclass of ToolCall would put it last)
    id: str
    type: Literal["function"]
    function: FunctionCall


class ChatCompletionMessage(Shape):
    role: Literal["assistant"]
    content: str | None
    refusal: None
    tool_calls: list[ToolCall] | UnsetType = UNSET


class ChatCompletionChoice(Shape):
    index: int
    message: ChatCompletionMessage
    logprobs: ChatLogprobs | None
    finish_reason: FinishLabel
    token_ids: list[int] | UnsetType = UNSET  # with return_token_ids


class ChatCompletion(Shape):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatCompletionChoice]
    usage: Usage


class ChatCompletionDelta(Shape):
    role: Literal["assistant"] | UnsetType = UNSET  # the first chunk of each choice
    content: str | UnsetType = UNSET
    tool_calls: list[ToolCallChunk] | UnsetType = UNSET


class ChatCompletionChunkChoice(Shape):
    index: int
    delta: ChatCompletionDelta
    logprobs: ChatLogprobs | None
    finish_reason: FinishLabel | None
    token_ids: list[int] | UnsetType = UNSET


class ChatCompletionChunk(Shape):
    """One `data:` event of a chat stream; with stream_options.include_usage every chunk has usage
    null, and a last chunk with no choices has the usage."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatCompletionChunkChoice]
    usage: Usage | None | UnsetType = UNSET


class CompletionLogprobs(Shape):
    """An echoed prompt's first token has null logprobs: nothing precedes it."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]

    def __add__(self, after: CompletionLogprobs) -> CompletionLogprobs:
        """The logprobs of a text followed by those of the text after it."""
        return CompletionLogprobs(
            tokens=self.tokens + after.tokens,
            token_logprobs=self.token_logprobs + after.token_logprobs,
            top_logprobs=self.top_logprobs + after.top_logprobs,
            text_offset=self.text_offset + after.text_offset,
        )


class CompletionChoice(Shape):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: Literal["stop", "length"]
    token_ids: list[int] | UnsetType = UNSET


class Completion(Shape):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class CompletionChunkChoice(Shape):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: Literal["stop", "length"] | None
    token_ids: list[int] | UnsetType = UNSET


class CompletionChunk(Shape):
    """One `data:` event of a completions stream; usage as in ChatCompletionChunk."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChunkChoice]
    usage: Usage | None | UnsetType = UNSET


class Model(Shape):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int
    # ember's: what the serving engine's bits depend on besides the request: the activations' dtype,
    # the numerics (exact or fast), the KV cache's dtype and the CPU kernels' build
    dtype: str | None = None
    numerics: str | None = None
    kv_cache_dtype: str | None = None
    cpu_build: str | None = None
    parent: str | None = None  # a LoRA adapter's base model (vLLM's)


class AdapterChange(Shape):
    """The answer to POST /v1/load_lora_adapter and /v1/unload_lora_adapter; message is vLLM's text."""

    object: Literal["lora_adapter"]
    lora_name: str
    status: Literal["loaded", "unloaded"]
    message: str


class ModelList(Shape):
    object: Literal["list"]
    data: list[Model]


class Health(Shape):
    """model and engine_id: the first engine taking requests; models and engines: all of them."""

    status: Literal["ok"]
    model: str
    engine_id: str
    models: list[str]
    engines: list[str]


class TokenizeResponse(Shape):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None  # with return_token_strs


class DetokenizeResponse(Shape):
    prompt: str


class Embedding(Shape):
    object: Literal["embedding"]
    embedding: list[float] | str  # a string with encoding_format base64
    index: int


class EmbeddingUsage(Shape):
    prompt_tokens: int
    total_tokens: int


class CreateEmbeddingResponse(Shape):
    object: Literal["list"]
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage
