"""POST /v1/embeddings: each input's pooled, L2-normalised final hidden state, computed by the engine
as a prefill-only request (EmbedOptions)."""

from __future__ import annotations

import array
import base64
import time
import uuid

from aiohttp import web

from ember_core.output_processor import fan_out
from ember_core.pooling import dimensions_error
from ember_core.sampling_params import SamplingParams
from ember_gateway.api.completions.choices import check_prompt
from ember_gateway.api.completions.prompts import prompt_ids, prompt_list
from ember_gateway.api.completions.respond import json_response
from ember_gateway.api.request_bodies import EmbeddingRequest
from ember_gateway.api.response_bodies import CreateEmbeddingResponse, Embedding, EmbeddingUsage
from ember_gateway.edge.errors import ApiError
from ember_gateway.edge.intake import accept
from ember_gateway.engines.generation import Generation
from ember_gateway.engines.served_model import ServedModel
from ember_proto import EmbedOptions


async def create_embeddings(request: web.Request) -> web.Response:
    arrived_at = time.monotonic()
    state, model, body = await accept(request, EmbeddingRequest)
    inputs = [prompt_ids(prompt, model.tokenizer, "input") for prompt in prompt_list(body.input, "input")]
    for token_ids in inputs:
        _check_input(token_ids, model)
    if body.dimensions is not None:
        error = dimensions_error(body.dimensions, model.card.hidden_size, model.card.matryoshka_dimensions)
        if error is not None:
            raise ApiError(400, error, param="dimensions")
    params = SamplingParams(max_tokens=0, priority=body.priority)
    generation = Generation(
        state.pool,
        model,
        state.metrics,
        request_id=f"embd-{uuid.uuid4().hex}",
        arrived_at=arrived_at,
        choices=fan_out([(token_ids, params) for token_ids in inputs]),
        timeout=state.config.request_timeout,
        max_pending=state.config.max_pending,
        embed=EmbedOptions(body.dimensions),
        requests_param="input",
    )
    with generation:
        vectors = await generation.embeddings()
    prompt_tokens = sum(map(len, inputs))
    return json_response(CreateEmbeddingResponse(
        object="list",
        data=[
            Embedding(object="embedding", embedding=_encoded(vector, body.encoding_format), index=index)
            for index, vector in enumerate(vectors)
        ],
        model=model.name,
        usage=EmbeddingUsage(prompt_tokens=prompt_tokens, total_tokens=prompt_tokens),
    ))


def _check_input(token_ids: list[int], model: ServedModel) -> None:
    check_prompt(token_ids, model, "input")
    limit = model.card.max_model_len
    if len(token_ids) > limit:
        raise ApiError(
            400,
            f"This model's maximum context length is {limit} tokens, and an input has {len(token_ids)} tokens. "
            "Please shorten the input.",
            param="input",
            code="context_length_exceeded",
        )


def _encoded(vector: bytes, encoding_format: str) -> list[float] | str:
    """float: the values; base64: the float32 little-endian bytes the engine sent, as OpenAI's API sends them."""
    if encoding_format == "base64":
        return base64.b64encode(vector).decode()
    return array.array("f", vector).tolist()
