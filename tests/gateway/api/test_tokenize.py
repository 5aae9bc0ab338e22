"""POST /tokenize and /detokenize in vLLM's shapes."""

from __future__ import annotations

from tests.gateway.api.test_validation import assert_openai_error
from tests.gateway.conftest import Gateway
from tests.gateway.fake_engine import FakeEngine

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]


async def test_a_prompt_and_messages_tokenize_as_the_model_sees_them(gateway: Gateway, fake_engine: FakeEngine):
    status, body = await gateway.post("/tokenize", {"model": "fake-model", "prompt": "hi", "return_token_strs": True})
    assert status == 200 and body == {"count": 2, "max_model_len": 64, "tokens": [104, 105], "token_strs": ["h", "i"]}
    status, body = await gateway.post("/tokenize", {"model": "fake-model", "messages": MESSAGES})
    assert status == 200 and body["token_strs"] is None
    await gateway.post("/v1/chat/completions", {"model": "fake-model", "messages": MESSAGES, "max_tokens": 1})
    assert body["tokens"] == fake_engine.received[-1].prompt_token_ids and body["count"] == len(body["tokens"])
    status, body = await gateway.post("/detokenize", {"model": "fake-model", "tokens": [104, 105]})
    assert status == 200 and body == {"prompt": "hi"}


async def test_bad_tokenize_requests_are_openai_errors(gateway: Gateway):
    for path, request, status, param in [
        ("/tokenize", {"model": "fake-model"}, 400, "prompt"),
        ("/tokenize", {"model": "fake-model", "prompt": "a", "messages": MESSAGES}, 400, "prompt"),
        ("/tokenize", {"model": "other", "prompt": "a"}, 404, "model"),
        ("/tokenize", {"model": "fake-model", "messages": []}, 400, "messages"),
        ("/detokenize", {"model": "fake-model", "tokens": [280]}, 400, "tokens"),  # past the tokenizer's 259
        ("/detokenize", {"model": "fake-model", "tokens": [-1]}, 400, "tokens[0]"),
    ]:
        got, body = await gateway.post(path, request)
        assert_openai_error(got, body, status)
        assert body["error"]["param"] == param, (request, body)
