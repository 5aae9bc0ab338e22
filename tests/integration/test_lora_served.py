"""LoRA adapters served end to end (`ember serve --lora-modules`, then one loaded and unloaded
while serving, as a llama.cpp LoRA GGUF) through the OpenAI SDK: each adapter is a model whose
completions equal the offline engine's with that adapter, /v1/models names its parent, the
dashboard's feed counts its requests, requests in flight go on through loads and unloads, and bad
loads and unknown names get OpenAI error bodies."""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import signal
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from ember_bench.gguf_lora_export import export_lora_gguf
from ember_bench.random_models import random_checkpoint
from ember_core import LLM, LoRARequest, SamplingParams
from tests.processes import STARTUP_TIMEOUT_S, child_pids, free_port, served, spawned, stop_process, wait_until

PROMPT = "The adapter says"


def _adapter(model_dir: Path, path: Path, rank: int, seed: int) -> Path:
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    torch.manual_seed(seed)
    config = LoraConfig(r=rank, lora_alpha=rank, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False)
    adapted = get_peft_model(base, config)
    with torch.no_grad():
        for name, param in adapted.named_parameters():
            if "lora_" in name:
                param.normal_(0.0, 1.0 / rank**0.5)
    adapted.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, openai.OpenAI, dict]]:
    root = tmp_path_factory.mktemp("lora-served")
    model_dir = random_checkpoint("llama", root / "model")
    first, second = _adapter(model_dir, root / "first", 8, 0), _adapter(model_dir, root / "second", 4, 1)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm = LLM(str(model_dir), dtype="float32", num_blocks=64, enable_lora=True)
    expected = {
        name: llm.generate([PROMPT], greedy, lora_request=request)[0].text
        for name, request in (("base", None), ("first", LoRARequest("first", 1, str(first))),
                              ("second", LoRARequest("second", 2, str(second))))
    }  # fmt: skip
    del llm
    assert len(set(expected.values())) == 3, expected  # each adapter changes the text
    with served(model_dir, root / "serve.log", "--model-name", "base", "--lora-modules", f"first={first}",
                "--max-loras", "2", "--allow-runtime-lora-updating", "--lora-dir", str(root)) as url:  # fmt: skip
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        # loaded while serving as llama.cpp's GGUF of the same adapter (float32: the same tokens)
        second_gguf = export_lora_gguf(second, model_dir, root / "second.gguf", "F32")
        yield url, client, {"expected": expected, "second": str(second_gguf), "model_dir": str(model_dir), "root": str(root)}


def _post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def _text(client: openai.OpenAI, model: str) -> str:
    return client.completions.create(model=model, prompt=PROMPT, temperature=0, max_tokens=8,
                                     extra_body={"ignore_eos": True}).choices[0].text  # fmt: skip


def test_adapters_are_models_with_their_own_completions(setup) -> None:
    url, client, data = setup
    models = {model.id: model for model in client.models.list().data}
    assert set(models) == {"base", "first"}
    assert models["first"].model_extra["parent"] == "base" and models["base"].model_extra.get("parent") is None
    assert _text(client, "first") == data["expected"]["first"]
    assert _text(client, "base") == data["expected"]["base"]
    chat = client.chat.completions.create(model="first", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert chat.model == "first"
    response = client.responses.create(model="first", input="hi", max_output_tokens=4, temperature=0)
    assert response.model == "first" and response.status in ("completed", "incomplete")
    base, adapted = (client.embeddings.create(model=m, input=PROMPT).data[0].embedding for m in ("base", "first"))
    assert len(base) == len(adapted) and base != adapted  # the adapter changes the hidden states too
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as answer:
        metrics = answer.read().decode()
    assert re.search(r'ember_lora_adapter_info\{[^}]*model_name="first"[^}]*parent="base"[^}]*\} 1', metrics), metrics[-2000:]
    assert re.search(r'ember_generation_tokens_total\{model_name="first"\} (\d+)', metrics)
    update = _dashboard_update(url)
    models = {model["name"]: model for model in update["models"]}
    assert models["first"]["parent"] == "base" and models["first"]["engines"] == 1
    assert models["first"]["requests"] >= 3 and models["first"]["generation_tokens"] > 0  # completion, chat, responses
    assert models["base"]["parent"] is None and models["base"]["requests"] >= 1


def _dashboard_update(url: str) -> dict:
    """The first update GET /dashboard/events sends."""
    with urllib.request.urlopen(f"{url}/dashboard/events", timeout=30) as feed:
        line = b""
        while not line.startswith(b"data: "):
            line = feed.readline()
    return json.loads(line[len(b"data: "):])


def test_an_adapter_loaded_while_serving_then_unloaded(setup) -> None:
    url, client, data = setup
    status, text = _post(f"{url}/v1/load_lora_adapter", {"lora_name": "second", "lora_path": data["second"]})
    assert status == 200 and text["status"] == "loaded" and text["lora_name"] == "second", text
    assert _text(client, "second") == data["expected"]["second"]
    assert {model.id for model in client.models.list().data} == {"base", "first", "second"}
    status, error = _post(f"{url}/v1/load_lora_adapter", {"lora_name": "second", "lora_path": data["second"]})
    assert status == 400 and error["error"]["param"] == "lora_name"
    status, text = _post(f"{url}/v1/unload_lora_adapter", {"lora_name": "second"})
    assert status == 200, text
    with pytest.raises(openai.NotFoundError):
        _text(client, "second")
    assert _text(client, "first") == data["expected"]["first"]


def test_requests_in_flight_go_on_through_loads_and_unloads(setup) -> None:
    """Unloading an adapter that a stream still uses is a 409; requests of the base model and of an
    adapter run while another adapter is loaded, serves a request and is unloaded. None of the
    requests fails or changes its tokens."""
    url, client, data = setup
    long = client.completions.create(model="first", prompt=PROMPT, max_tokens=240, temperature=0, stream=True,
                                     extra_body={"ignore_eos": True})  # fmt: skip
    first_chunk = next(iter(long))
    status, error = _post(f"{url}/v1/unload_lora_adapter", {"lora_name": "first"})
    assert status == 409 and "in use" in error["error"]["message"], error
    with concurrent.futures.ThreadPoolExecutor(max_workers=12) as pool:
        running = [pool.submit(_text, client, model) for model in ("base", "first") * 6]
        assert _post(f"{url}/v1/load_lora_adapter", {"lora_name": "second", "lora_path": data["second"]})[0] == 200
        assert _text(client, "second") == data["expected"]["second"]
        assert _post(f"{url}/v1/unload_lora_adapter", {"lora_name": "second"})[0] == 200
        assert [future.result() for future in running] == [data["expected"][m] for m in ("base", "first") * 6]
    rest = list(long)
    assert rest[-1].choices[0].finish_reason == "length" and first_chunk.choices[0].text is not None
    assert {model.id for model in client.models.list().data} == {"base", "first"}


def test_bad_loads_and_unknown_adapters_are_openai_errors(setup, tmp_path: Path) -> None:
    url, client, _ = setup
    for body in ({"lora_name": "broken", "lora_path": str(tmp_path)}, {"lora_name": "gone", "lora_path": "/no/such/dir"}):
        status, error = _post(f"{url}/v1/load_lora_adapter", body)
        assert status == 400 and error["error"]["message"], error
    assert _post(f"{url}/v1/load_lora_adapter", {"lora_name": "x"})[0] == 400
    status, error = _post(f"{url}/v1/unload_lora_adapter", {"lora_name": "nobody"})
    assert status == 404 and error["error"]["code"] == "model_not_found"
    assert {model.id for model in client.models.list().data} == {"base", "first"}


def test_an_adapter_loaded_while_serving_is_loaded_again_when_its_engine_restarts(setup, tmp_path: Path) -> None:
    """A stream of a runtime adapter whose engine is killed mid-generation waits (--engine-resume-wait)
    for the restarted engine, which gets the adapter again first, and ends with the tokens it would
    have had; the adapter is then served as before."""
    data = setup[2]
    port, log = free_port(), tmp_path / "serve.log"
    argv = ["-m", "ember_cli", "serve", "--model", data["model_dir"], "--model-name", "base", "--port", str(port),
            "--dtype", "float32", "--num-blocks", "64", "--enable-lora", "--engine-resume-wait", "120",
            "--allow-runtime-lora-updating", "--lora-dir", data["root"]]  # fmt: skip
    with spawned(argv, log) as process:
        wait_until(lambda: process.poll() is not None or "ember: ready" in log.read_text(), STARTUP_TIMEOUT_S, "serve")
        url = f"http://127.0.0.1:{port}"
        assert _post(f"{url}/v1/load_lora_adapter", {"lora_name": "second", "lora_path": data["second"]})[0] == 200
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        request = {"model": "second", "prompt": PROMPT, "max_tokens": 120, "temperature": 0, "extra_body": {"ignore_eos": True}}
        expected = client.completions.create(**request).choices[0].text
        stream = client.completions.create(**request, stream=True)
        text = next(iter(stream)).choices[0].text
        engine = child_pids(process.pid, "ember_engine")[0]
        os.kill(engine, signal.SIGSTOP)  # mid-generation
        os.kill(engine, signal.SIGKILL)
        text += "".join(chunk.choices[0].text for chunk in stream)
        assert text == expected
        assert "loaded LoRA adapter second again on engine" in log.read_text()
        assert _text(client, "second") == data["expected"]["second"]
        process.send_signal(signal.SIGTERM)
        assert stop_process(process, timeout=30) == 0
