"""Request bodies as msgspec Structs: types and ranges are checked while decoding.

Unknown fields are ignored. Fields OpenAI defines that ember does not implement (tool_choice,
best_of, suffix), and vLLM's extensions it does not implement (beam search, bad_words, ...), are
accepted at their no-op values, which SDKs and frameworks send, and any other value is a 400.
Output constraints (response_format, structured_outputs, guided_*) are read by constraints.py; the
Responses API's input items, tools and unimplemented fields by responses/input.py.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, TypeVar

import msgspec
from msgspec import UNSET, Meta, UnsetType

from ember_core import sampling_limits as limits
from ember_core.sampling_params import SETTINGS, DeclaredSetting
from ember_gateway.edge.errors import ApiError

Body = TypeVar("Body", bound=msgspec.Struct)
_MISSING_FIELD = re.compile(r"Object missing required field `([^`]+)`.*")


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class _GenerationFields(msgspec.Struct, kw_only=True):
    model: str
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    # extensions
    return_token_ids: bool = False  # add the generated token ids to each choice (as vLLM does)
    logit_bias: dict[str, limits.LOGIT_BIAS.type] | None = None  # token id (as a string) -> bias
    # output constraints: constraints.py
    response_format: dict[str, Any] | None = None
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    json_any_whitespace: bool = False  # JSON outputs may pretty-print (a space, or a line break and indentation)
    # not implemented: only their no-op values pass `reject_unsupported_values`
    tool_choice: str | dict[str, Any] | None = None
    function_call: str | dict[str, Any] | None = None  # the legacy tool_choice
    use_beam_search: Any = None
    bad_words: Any = None
    allowed_token_ids: Any = None
    prompt_logprobs: Any = None
    truncate_prompt_tokens: Any = None


def _sampling_field(declared: DeclaredSetting) -> tuple[str, Any, Any]:
    setting = declared.setting
    kind = setting.body_type or (setting.limit.type if setting.limit else declared.type)
    kind = Annotated[kind, Meta(description=setting.meaning)]
    if setting.body == "nullable":
        return declared.name, kind | None, None
    return declared.name, kind, declared.default


# Fields shared by completions and chat completions: the sampling settings a body carries, made
# from SamplingParams' declarations (null: not given), and the fields above. max_tokens null: as
# many as the context leaves; 0 only with echo, to score the prompt (`reject_unsupported_values`).
GenerationRequest = msgspec.defstruct(
    "GenerationRequest",
    [_sampling_field(declared) for declared in SETTINGS.values() if declared.setting.body != "mapped"],
    bases=(_GenerationFields,), kw_only=True, module=__name__,
)  # fmt: skip
class CompletionRequest(GenerationRequest, kw_only=True):
    # a string, strings, token ids, or lists of token ids; mixing kinds is rejected after decoding
    prompt: str | list[str | int | list[int]]
    logprobs: limits.LOGPROBS.type | None = None
    echo: bool | None = None
    best_of: int | None = None  # not implemented beyond best_of == n
    suffix: str | None = None  # not implemented


class TextPart(msgspec.Struct, tag="text", tag_field="type"):
    text: str


class RefusalPart(msgspec.Struct, tag="refusal", tag_field="type"):
    """An assistant's earlier refusal, sent back in the conversation."""

    refusal: str


class ChatMessage(msgspec.Struct):
    # "function": the deprecated answer to a function_call, read as a tool result
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[TextPart | RefusalPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool message's answer to


class ChatCompletionRequest(GenerationRequest, kw_only=True):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_completion_tokens: Annotated[int, Meta(ge=1)] | None = None
    logprobs: bool | None = None
    top_logprobs: limits.LOGPROBS.type | None = None
    # vLLM's: end the prompt with the assistant's turn header; or leave the last (assistant) message
    # open, for the model to go on with it
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    echo: bool = False  # vLLM's, not implemented: only false passes
    modalities: list[str] | None = None  # not implemented: only ["text"] passes
    tools: list[dict[str, Any]] | None = None  # tools.py
    parallel_tool_calls: bool | None = None
    # type-checked, then unused: the model answers in text, a valid outcome of function_call "auto"
    functions: list[dict[str, Any]] | None = None  # the legacy tools
    audio: Any = None  # not implemented: only null passes


class TokenizeRequest(msgspec.Struct, kw_only=True):
    """vLLM's /tokenize: a prompt, or chat messages rendered with the model's chat template."""

    model: str
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Meta(min_length=1)] | None = None
    add_special_tokens: bool = True  # a prompt's BOS, where the model wants one
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    model: str
    tokens: list[limits.TOKEN_ID.type]


class PlainTextFormat(msgspec.Struct, tag="text", tag_field="type"):
    pass


class JsonObjectFormat(msgspec.Struct, tag="json_object", tag_field="type"):
    pass


class JsonSchemaFormat(msgspec.Struct, tag="json_schema", tag_field="type", kw_only=True):
    name: Annotated[str, Meta(pattern="^[A-Za-z0-9_-]{1,64}$")]
    schema: dict[str, Any]
    strict: bool | None = None
    description: str | UnsetType = UNSET


class ResponseText(msgspec.Struct, kw_only=True):
    """The Responses API's `text` (a Response echoes it): its `format` is chat's response_format, flattened."""

    format: PlainTextFormat | JsonObjectFormat | JsonSchemaFormat = msgspec.field(default_factory=PlainTextFormat)
    verbosity: Literal["low", "medium", "high"] | None | UnsetType = UNSET  # a hint ember's models do not take


Metadata = Annotated[
    dict[Annotated[str, Meta(max_length=64)], Annotated[str, Meta(max_length=512)]], Meta(max_length=16)
]


class ResponsesRequest(msgspec.Struct, kw_only=True):
    """OpenAI's Responses API, stateless: the whole conversation is the `input` (a string, or items
    read by responses/input.py). Tools are OpenAI's flat function tools, checked there too."""

    model: str
    input: str | Annotated[list[dict[str, Any]], Meta(min_length=1)]
    instructions: str | None = None
    max_output_tokens: Annotated[int, Meta(ge=1)] | None = None
    temperature: limits.TEMPERATURE.type | None = None
    top_p: limits.TOP_P.type | None = None
    text: ResponseText = msgspec.field(default_factory=ResponseText)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    metadata: Metadata | None = None
    user: str | UnsetType = UNSET  # a Response echoes it, or leaves it out
    stream: bool = False
    priority: limits.PRIORITY.type = 0  # vLLM's: lower runs first; the engine's --scheduling-policy priority
    # the state ember does not keep: only their no-op values pass (responses/input.py)
    store: bool | None = None
    previous_response_id: str | None = None
    background: bool | None = None
    conversation: Any = None
    # not implemented: only their no-op values pass
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    top_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    truncation: Literal["auto", "disabled"] | None = None


class LoadLoRAAdapterRequest(msgspec.Struct, kw_only=True):
    """vLLM's POST /v1/load_lora_adapter: a PEFT checkpoint (a directory on the engines' hosts, or a
    Hub repo id) or a llama.cpp LoRA GGUF (a .gguf file, or owner/repo/file.gguf on the Hub) served as
    the model lora_name."""

    lora_name: Annotated[str, Meta(min_length=1)]
    lora_path: Annotated[str, Meta(min_length=1)]


class UnloadLoRAAdapterRequest(msgspec.Struct, kw_only=True):
    lora_name: Annotated[str, Meta(min_length=1)]
    lora_int_id: int | None = None  # vLLM's; ignored


class EmbeddingRequest(msgspec.Struct, kw_only=True):
    model: str
    # a string, strings, token ids, or lists of token ids, as completions' prompt
    input: str | list[str | int | list[int]]
    encoding_format: Literal["float", "base64"] = "float"  # base64: the float32 values' bytes, little-endian
    dimensions: Annotated[int, Meta(ge=1)] | None = None  # a Matryoshka model's embeddings truncated
    user: str | None = None  # accepted, unused
    priority: limits.PRIORITY.type = 0  # as in GenerationRequest


_DECODERS = {
    body_type: msgspec.json.Decoder(body_type)
    for body_type in (CompletionRequest, ChatCompletionRequest, ResponsesRequest, TokenizeRequest, DetokenizeRequest,
                      EmbeddingRequest, LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest)
}


def decode_body(raw: bytes, body_type: type[Body]) -> Body:
    if not raw.strip():
        raise ApiError(400, "the request body is empty; expected a JSON object")
    try:
        body = _DECODERS[body_type].decode(raw)
    except msgspec.ValidationError as exc:
        raise validation_error(exc) from None
    except msgspec.DecodeError as exc:
        raise ApiError(400, f"the request body is not valid JSON: {_decode_error_message(raw, exc)}") from None
    except RecursionError:  # msgspec decodes nesting recursively: thousands of levels deep
        raise ApiError(400, "the request body is nested too deeply") from None
    if isinstance(body, GenerationRequest):
        reject_unsupported_values(body)
    return body


def validation_error(exc: msgspec.ValidationError, within: str = "") -> ApiError:
    """msgspec's complaint as a 400 naming the field; within: where the checked value sits in the body."""
    message, _, location = str(exc).partition(" - at `$")
    location = f"{within}{location.rstrip('`')}".lstrip(".")
    if location:
        message = f"{message} (at `{location}`)"
    missing = _MISSING_FIELD.fullmatch(message)
    param = f"{location}.{missing[1]}".lstrip(".") if missing else location
    return ApiError(400, f"invalid request: {message}", param=param or None)


# a high surrogate escape not followed by a low one, or a low one not preceded by a high one
_LONE_SURROGATE = re.compile(
    rb"\\u(d[89ab][0-9a-f]{2})(?!\\ud[c-f])|(?<!\\ud[89ab][0-9a-f]{2})\\u(d[c-f][0-9a-f]{2})", re.IGNORECASE
)


def _decode_error_message(raw: bytes, exc: msgspec.DecodeError) -> str:
    """msgspec's message, except for a lone UTF-16 surrogate escape, which it reports as truncated input."""
    lone = _LONE_SURROGATE.search(raw)
    if lone is None:
        return str(exc)
    escape = (lone[1] or lone[2]).decode()
    return f"a lone UTF-16 surrogate \\u{escape} at byte {lone.start()} (a string holds only whole surrogate pairs)"


# vLLM's extensions ember does not implement, and what to do instead
_VLLM_EXTENSIONS_NOT_IMPLEMENTED = {
    "use_beam_search": "sample with n instead",
    "bad_words": "use logit_bias against their tokens",
    "allowed_token_ids": "use logit_bias",
    "prompt_logprobs": "send echo with logprobs (completions)",
    "truncate_prompt_tokens": "shorten the prompt",
}


def reject_unsupported_values(body: GenerationRequest) -> None:
    for choice, tools in (("tool_choice", "tools"), ("function_call", "functions")):
        value = getattr(body, choice)
        calls_tools = choice == "tool_choice" and isinstance(body, ChatCompletionRequest)
        if not calls_tools and value not in (None, "none", "auto"):
            raise ApiError(
                400, f"{choice} must be \"none\" or \"auto\" here: ember calls tools through chat's tools and tool_choice",
                param=choice,
            )
        if value is not None and isinstance(body, ChatCompletionRequest) and getattr(body, tools) is None:
            raise ApiError(400, f"{choice} is only allowed when {tools} are given", param=choice)
    for name, instead in _VLLM_EXTENSIONS_NOT_IMPLEMENTED.items():
        if getattr(body, name) not in (None, False, [], {}):
            raise ApiError(400, f"ember does not implement {name}: {instead}", param=name)
    if body.stream_options is not None and not body.stream:
        raise ApiError(400, "stream_options can only be given with stream: true", param="stream_options")
    if body.max_tokens == 0 and not (isinstance(body, CompletionRequest) and body.echo):
        raise ApiError(400, "max_tokens must be >= 1 (0 is for scoring a prompt with echo)", param="max_tokens")
    if isinstance(body, CompletionRequest):
        if body.best_of is not None and body.best_of != (body.n or 1):
            raise ApiError(400, "ember does not implement best_of: leave it out or send n", param="best_of")
        if body.suffix:
            raise ApiError(400, "ember does not implement suffix (insertion): leave it out", param="suffix")
    elif body.echo:
        raise ApiError(400, "ember does not implement echo for chat: the reply holds the new text only", param="echo")
    elif body.modalities not in (None, ["text"]) or body.audio is not None:
        param = "audio" if body.audio is not None else "modalities"
        raise ApiError(400, "ember answers in text only: leave out audio, or send modalities [\"text\"]", param=param)
