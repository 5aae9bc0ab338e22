"""Who may change what the server runs, through real servers: runtime adapter loads are off unless
switched on (404, nothing reaches an engine; an engine refuses them on its own switch too), read
only from inside --lora-dir (symlinks and ".." resolved; every path outside gets one answer, whether
it exists or not), from the Hub only with --allow-lora-from-hub (without it no socket is opened),
behind admin keys where there are some; user keys from a list and a file; no error body carries a
library's text, a traceback or a host path the client did not send."""

from __future__ import annotations

import json
import shutil
import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from ember_bench.random_models import random_checkpoint
from ember_core import LLM
from ember_core.lora.sources import HUB_AT_RUNTIME_OFF, OUTSIDE_THE_ROOTS
from ember_engine.adapter_loads import SWITCHED_OFF, AdapterLoads
from ember_proto import LoadAdapter
from tests.gateway.api.test_validation import assert_openai_error
from tests.integration.test_lora_served import _adapter
from tests.processes import served, wait_until

USERS, ADMIN = ("user-one", "user-two"), "admin-key"
FILE_USER = "user-from-file"
LOAD, UNLOAD = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"
LIBRARY_WORDS = ("huggingface_hub", "safetensors_rust", "HeaderTooSmall", "ConnectError")


class HubTrap:
    """A listening socket standing in for the Hugging Face Hub (HF_ENDPOINT): counts who connects."""

    def __init__(self) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.server.settimeout(0.1)
        self.url = f"http://127.0.0.1:{self.server.getsockname()[1]}"
        self.connections = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                connection, _ = self.server.accept()
            except TimeoutError:
                continue
            self.connections += 1
            connection.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.server.close()


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapter-access")
    model_dir = random_checkpoint("llama", root / "model")
    allowed, outside = root / "adapters", root / "outside"
    allowed.mkdir()
    good = _adapter(model_dir, allowed / "good", 4, 0)
    shutil.copytree(good, outside / "stray")
    (allowed / "escape").symlink_to(outside / "stray")  # a link inside the root to an adapter outside it
    (allowed / "junk").mkdir()
    (allowed / "junk" / "adapter_config.json").write_text('{"r": "eight"}')
    shutil.copytree(good, allowed / "torn")
    (allowed / "torn" / "adapter_model.safetensors").write_bytes(b"\x00" * 64)  # not a safetensors file
    (root / "keys.txt").write_text(f"\n{FILE_USER}\n\n")
    (root / "admins.txt").write_text(f"{ADMIN}\n")
    return {"root": root, "model": model_dir, "allowed": allowed, "outside": outside, "good": good}


@pytest.fixture(scope="module")
def hub() -> Iterator[HubTrap]:
    trap = HubTrap()
    yield trap
    trap.close()


@pytest.fixture(scope="module")
def server(files: dict[str, Path], hub: HubTrap) -> Iterator[tuple[str, Path]]:
    log = files["root"] / "serve.log"
    with served(files["model"], log, "--enable-lora", "--num-blocks", "64", "--allow-runtime-lora-updating",
                "--lora-dir", str(files["allowed"]), "--api-key", ",".join(USERS), "--api-key-file",
                str(files["root"] / "keys.txt"), "--admin-api-key-file", str(files["root"] / "admins.txt"),
                env={"HF_ENDPOINT": hub.url}) as url:  # fmt: skip
        yield url, log


def _call(url: str, path: str, body: dict | None = None, key: str | None = None) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(f"{url}{path}", data, headers)
    try:
        with urllib.request.urlopen(request, timeout=120) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def _refused(url: str, path: str, lora_path: str, status: int = 400) -> dict:
    code, body = _call(url, LOAD, {"lora_name": "probe", "lora_path": lora_path}, ADMIN)
    error = assert_openai_error(code, body, status)
    assert not [word for word in LIBRARY_WORDS if word in json.dumps(body)], body
    return error


COMPLETION = {"model": "", "prompt": "hi", "max_tokens": 2}


def test_user_keys_from_a_list_and_a_file_and_admin_keys(server) -> None:
    url, _ = server
    model = _call(url, "/v1/models", key=USERS[0])[1]["data"][0]["id"]
    completion = {**COMPLETION, "model": model}
    for key in (*USERS, FILE_USER, ADMIN):  # an admin key opens every route
        assert _call(url, "/v1/completions", completion, key)[0] == 200, key
    for key in (None, "wrong", USERS[0] + "x"):
        code, body = _call(url, "/v1/completions", completion, key)
        assert code == 401 and body["error"]["code"] == "invalid_api_key"
    for key in (*USERS, FILE_USER):
        code, body = _call(url, LOAD, {"lora_name": "x", "lora_path": "/anything"}, key)
        assert code == 403 and body["error"]["type"] == "permission_error", body
        assert _call(url, UNLOAD, {"lora_name": "x"}, key)[0] == 403
    assert _call(url, LOAD, {"lora_name": "x", "lora_path": "/anything"})[0] == 401
    for open_path in ("/health", "/metrics"):
        with urllib.request.urlopen(f"{url}{open_path}", timeout=10) as answer:
            assert answer.status == 200


def test_an_adapter_inside_the_root_loads_and_unloads_with_an_admin_key(server, files) -> None:
    url, _ = server
    code, body = _call(url, LOAD, {"lora_name": "good", "lora_path": str(files["good"])}, ADMIN)
    assert code == 200 and body["status"] == "loaded", body
    assert "good" in {model["id"] for model in _call(url, "/v1/models", key=USERS[0])[1]["data"]}
    assert _call(url, UNLOAD, {"lora_name": "good"}, ADMIN)[0] == 200


def test_every_path_outside_the_roots_gets_one_answer_whether_it_exists_or_not(server, files) -> None:
    url, _ = server
    allowed, outside = files["allowed"], files["outside"]
    escapes = [
        str(allowed / ".." / "outside" / "stray"),  # an adapter, reached by ".."
        str(allowed / "escape"),  # a symlink inside the root to that adapter
        str(outside / "stray"),  # the adapter itself
        "/etc", "/root", "/proc/self", "/no/such/directory", str(outside / "missing"),  # existing or not
        "./adapters/good", "../adapters", "adapters", "good",  # relative: never the engine's working directory
        "~", "~/.ssh",
    ]
    answers = [_refused(url, LOAD, path) for path in escapes]
    assert all(answer == answers[0] for answer in answers), answers
    assert answers[0]["message"] == OUTSIDE_THE_ROOTS
    missing_inside = _refused(url, LOAD, str(allowed / "missing"))  # inside a root: saying so is no leak
    assert missing_inside["message"] == (
        f"cannot load adapter 'probe': {allowed / 'missing'} does not exist (expected a PEFT checkpoint's directory)"
    )


def test_hub_ids_are_refused_at_once_without_a_socket(server, hub: HubTrap) -> None:
    url, _ = server
    for hub_id in ("someone/some-adapter", "someone/repo/adapter.gguf"):
        assert _refused(url, LOAD, hub_id)["message"] == HUB_AT_RUNTIME_OFF
    assert hub.connections == 0


def test_bad_files_inside_a_root_are_answered_in_embers_words_and_logged_whole(server, files) -> None:
    url, log = server
    junk = _refused(url, LOAD, str(files["allowed"] / "junk"))
    assert junk["message"] == f"cannot load adapter 'probe': {files['allowed'] / 'junk'}: adapter_config.json has no integer r and numeric lora_alpha"
    torn = _refused(url, LOAD, str(files["allowed"] / "torn"))
    assert "adapter_model.safetensors is not a readable safetensors file" in torn["message"]
    wait_until(lambda: "adapter_model.safetensors unreadable" in log.read_text(), 10, "the full reason in the log")
    assert "adapter change refused" in log.read_text()


def test_with_the_switch_off_the_routes_are_absent_and_nothing_reaches_an_engine(files) -> None:
    log = files["root"] / "off.log"
    with served(files["model"], log, "--enable-lora", "--num-blocks", "64", "--lora-dir", str(files["allowed"])) as url:
        for path, body in ((LOAD, {"lora_name": "good", "lora_path": str(files["good"])}), (UNLOAD, {"lora_name": "good"})):
            code, answer = _call(url, path, body)
            assert code == 404 and answer["error"]["code"] == "not_found", answer
        with urllib.request.urlopen(f"{url}/openapi.json", timeout=10) as document:
            assert LOAD not in json.loads(document.read())["paths"]
    assert "adapter change refused" not in log.read_text()  # what an engine logs for a load it refuses


def test_an_engine_refuses_runtime_loads_on_its_own_switch(files, hub: HubTrap, monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever a gateway sends: an engine started without --allow-runtime-lora-updating answers 403;
    one with --allow-lora-from-hub does go to the Hub (so the trap above would have seen a socket),
    and answers without the network's own words."""
    import huggingface_hub.constants

    off = LLM(str(files["model"]), dtype="float32", num_blocks=16, enable_lora=True)
    answer = AdapterLoads(off.engine).load(b"gateway", LoadAdapter("r1", "good", str(files["good"])))
    assert answer is not None and (answer.code, answer.message) == (403, SWITCHED_OFF)
    on = LLM(str(files["model"]), dtype="float32", num_blocks=16, enable_lora=True, allow_runtime_lora_updating=True,
             lora_dir=(str(files["allowed"]),), allow_lora_from_hub=True)  # fmt: skip
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", hub.url)
    loads = AdapterLoads(on.engine)
    before = hub.connections
    assert loads.load(b"gateway", LoadAdapter("r2", "hubbed", "someone/some-adapter")) is None  # read on a thread
    wait_until(lambda: not loads._read.empty(), 120, "the Hub attempt to end")
    ((_, done),) = loads.finished()
    assert done.code == 400 and done.message == "cannot load adapter 'hubbed': someone/some-adapter could not be fetched from the Hugging Face Hub"
    assert hub.connections > before
