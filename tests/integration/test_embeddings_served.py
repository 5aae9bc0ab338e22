"""POST /v1/embeddings end to end: a random Qwen2 checkpoint laid out as a sentence-transformers model
(last-token pooling, Normalize, Matryoshka sizes) under `ember serve --task embed`, through the OpenAI
SDK and raw HTTP, against transformers' final hidden states; the same model served to generate
answers embeddings too."""

from __future__ import annotations

import base64
import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
import torch

from tests.core.engine.test_embeddings import write_sentence_transformers_files
from tests.gateway.api.test_openai_conformance import openai_errors
from tests.processes import served

transformers = pytest.importorskip("transformers")
from ember_bench.random_models import random_checkpoint

MODEL = "embedder"
MATRYOSHKA = [16, 32]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model_dir = random_checkpoint("qwen2", tmp_path_factory.mktemp("qwen2") / "model", num_hidden_layers=2)
    write_sentence_transformers_files(model_dir, "last")
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "matryoshka_dimensions": MATRYOSHKA}))
    return model_dir


@pytest.fixture(scope="module")
def base_url(model_dir: Path) -> Iterator[str]:
    # prompts over 32 tokens are computed in chunks
    with served(model_dir, model_dir.parent / "embed.log", "--task", "embed", "--model-name", MODEL,
                "--max-num-batched-tokens", "32") as base:
        yield base


@pytest.fixture(scope="module")
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def reference(model_dir: Path):
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def embed(token_ids: list[int]) -> np.ndarray:
        with torch.no_grad():
            hidden = model(torch.tensor([token_ids]), output_hidden_states=True).hidden_states[-1][0, -1]
        return torch.nn.functional.normalize(hidden, dim=0).numpy()

    return embed


def post(base_url: str, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(f"{base_url}{path}", json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def token_ids(base_url: str, text: str) -> list[int]:
    status, body = post(base_url, "/tokenize", {"model": MODEL, "prompt": text})
    assert status == 200, body
    return body["tokens"]


def assert_close(embedding: list[float] | np.ndarray, expected: np.ndarray) -> None:
    vector = np.asarray(embedding, dtype=np.float64)
    cosine = vector @ expected / (np.linalg.norm(vector) * np.linalg.norm(expected))
    assert cosine >= 0.9999
    assert abs(np.linalg.norm(vector) - 1) < 1e-5


def test_strings_equal_transformers_in_base64_the_sdks_default_and_in_floats(client, base_url, reference) -> None:
    texts = ["The quick brown fox jumps over the lazy dog", "hello " * 30]  # the second: chunks of 32 tokens
    default = client.embeddings.create(model=MODEL, input=texts)
    floats = client.embeddings.create(model=MODEL, input=texts, encoding_format="float")
    ids = [token_ids(base_url, text) for text in texts]
    assert len(ids[1]) > 32
    for index, prompt in enumerate(ids):
        assert_close(default.data[index].embedding, reference(prompt))
        assert floats.data[index].embedding == pytest.approx(default.data[index].embedding, abs=1e-7)
        assert default.data[index].index == index
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == sum(map(len, ids))
    assert floats.model == MODEL


def test_one_string_token_ids_and_token_id_lists(client, reference) -> None:
    prompts = [[5, 6, 7, 8, 9], [40, 41]]
    one = client.embeddings.create(model=MODEL, input=prompts[0], encoding_format="float")
    many = client.embeddings.create(model=MODEL, input=prompts, encoding_format="float")
    assert len(one.data) == 1 and len(many.data) == 2
    assert_close(one.data[0].embedding, reference(prompts[0]))
    for index, prompt in enumerate(prompts):
        assert_close(many.data[index].embedding, reference(prompt))
    assert len(client.embeddings.create(model=MODEL, input="one string").data) == 1


def test_dimensions_truncate_and_renormalise(client) -> None:
    full = client.embeddings.create(model=MODEL, input=[5, 6, 7], encoding_format="float").data[0].embedding
    short = client.embeddings.create(model=MODEL, input=[5, 6, 7], dimensions=16).data[0].embedding
    expected = np.asarray(full[:16]) / np.linalg.norm(full[:16])
    assert short == pytest.approx(expected.tolist(), abs=1e-6)


def test_bodies_conform_to_openais_schema_and_base64_is_little_endian_float32(base_url) -> None:
    status, floats = post(base_url, "/v1/embeddings", {"model": MODEL, "input": ["a", "b c"]})
    assert status == 200, floats
    assert openai_errors(floats, "CreateEmbeddingResponse") == []
    status, encoded = post(base_url, "/v1/embeddings", {"model": MODEL, "input": ["a", "b c"], "encoding_format": "base64"})
    assert status == 200, encoded
    for float_item, base64_item in zip(floats["data"], encoded["data"]):
        decoded = np.frombuffer(base64.b64decode(base64_item["embedding"]), dtype="<f4")
        assert decoded.tolist() == pytest.approx(float_item["embedding"], abs=1e-7)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"input": []}, "input"),
        ({"input": [[]]}, "input"),
        ({"input": ""}, "input"),
        ({"input": [1, "a"]}, "input"),
        ({"input": [10**6]}, "input"),
        ({"input": [5] * 300}, "input"),  # past the 256 positions
        ({"input": "a", "dimensions": 20}, "dimensions"),
        ({"input": "a", "dimensions": 0}, "dimensions"),
        ({"input": "a", "encoding_format": "int8"}, "encoding_format"),
        ({}, "input"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(base_url, fields: dict[str, Any], param: str) -> None:
    status, body = post(base_url, "/v1/embeddings", {"model": MODEL, **fields})
    assert status == 400, body
    assert body["error"]["param"] == param
    assert body["error"]["type"] == "invalid_request_error"


def test_the_sdk_raises_bad_request_for_an_unsupported_dimension(client) -> None:
    with pytest.raises(openai.BadRequestError, match="one of"):
        client.embeddings.create(model=MODEL, input="a", dimensions=20)


def test_an_embed_engine_refuses_generation_with_a_400(base_url) -> None:
    status, body = post(base_url, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2})
    assert (status, body["error"]["param"]) == (400, "model")
    assert "embeddings only" in body["error"]["message"]
    status, body = post(base_url, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    assert (status, body["error"]["param"]) == (400, "model")


def test_a_generating_model_answers_embeddings_too(model_dir: Path, client) -> None:
    with served(model_dir, model_dir.parent / "generate.log", "--model-name", MODEL) as base:
        generating = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        embedded = generating.embeddings.create(model=MODEL, input=[[5, 6, 7, 8]], encoding_format="float")
        completion = generating.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=3, temperature=0)
    expected = client.embeddings.create(model=MODEL, input=[[5, 6, 7, 8]], encoding_format="float")
    assert embedded.data[0].embedding == pytest.approx(expected.data[0].embedding, abs=1e-6)
    assert completion.usage.completion_tokens == 3
