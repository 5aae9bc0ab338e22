"""POST /tokenize and /detokenize, in vLLM's shapes: a prompt or chat messages to the token ids the
model would see (with their count and the model's context length), and token ids back to text."""

from __future__ import annotations

from aiohttp import web

from ember_core.tokenizer import Tokenizer
from ember_gateway.api.completions.chat import render_prompt
from ember_gateway.api.completions.logprobs import token_string
from ember_gateway.api.completions.respond import json_response
from ember_gateway.api.request_bodies import DetokenizeRequest, TokenizeRequest
from ember_gateway.api.response_bodies import DetokenizeResponse, TokenizeResponse
from ember_gateway.edge.errors import ApiError
from ember_gateway.edge.intake import accept
from ember_gateway.engines.served_model import ServedModel


async def tokenize(request: web.Request) -> web.Response:
    _, model, body = await accept(request, TokenizeRequest)
    tokenizer = _tokenizer(model)
    if (body.prompt is None) == (body.messages is None):
        raise ApiError(400, "give either prompt or messages", param="prompt")
    if body.messages is not None:
        tokens = render_prompt(body, model)
    else:
        tokens = tokenizer.encode_prompt(body.prompt) if body.add_special_tokens else tokenizer.encode(body.prompt)
    return json_response(TokenizeResponse(
        count=len(tokens),
        max_model_len=model.card.max_model_len,
        tokens=tokens,
        token_strs=[token_string(tokenizer, token) for token in tokens] if body.return_token_strs else None,
    ))


async def detokenize(request: web.Request) -> web.Response:
    _, model, body = await accept(request, DetokenizeRequest)
    tokenizer = _tokenizer(model)
    try:
        return json_response(DetokenizeResponse(prompt=tokenizer.decode(body.tokens)))
    except ValueError as exc:
        raise ApiError(400, str(exc), param="tokens") from None


def _tokenizer(model: ServedModel) -> Tokenizer:
    if model.tokenizer is None:
        raise ApiError(400, "this model has no tokenizer: it takes and gives token ids only")
    return model.tokenizer
