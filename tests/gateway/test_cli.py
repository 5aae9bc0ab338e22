from dataclasses import fields

import pytest

from ember_core.config_flags import field_docs
from ember_gateway.cli import build_parser, config_from_args
from ember_gateway.config import GatewayConfig


def config(argv: list[str]) -> GatewayConfig:
    return config_from_args(build_parser().parse_args(argv))


def test_defaults(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("EMBER_ENGINE", raising=False)
    assert config([]) == GatewayConfig(engine_addresses=("tcp://127.0.0.1:5555",))


def test_every_flag_has_an_environment_variable(monkeypatch: pytest.MonkeyPatch):
    for name, value in {
        "EMBER_ENGINE": "ipc:///tmp/engine.sock",
        "EMBER_HOST": "0.0.0.0",
        "EMBER_PORT": "9000",
        "EMBER_API_KEY": "k",
        "EMBER_ADMIN_API_KEY": "a,b",
        "EMBER_ALLOW_RUNTIME_LORA_UPDATING": "true",
        "EMBER_MAX_PENDING": "8",
        "EMBER_REQUEST_TIMEOUT": "2.5",
        "EMBER_MAX_BODY_BYTES": "65536",
        "EMBER_MODEL_NAME": "served",
        "EMBER_ROUTING": "load",
        "EMBER_ENGINE_TIMEOUT": "7",
        "EMBER_ALLOWED_ORIGINS": "https://a.example, https://b.example",
        "EMBER_ENGINE_WAIT": "0",
        "EMBER_ENGINE_RESUME_WAIT": "60",
        "EMBER_HEADER_TIMEOUT": "1.5",
        "EMBER_BODY_TIMEOUT": "2",
        "EMBER_KEEPALIVE_TIMEOUT": "3",
        "EMBER_MAX_CONNECTIONS": "9",
    }.items():
        monkeypatch.setenv(name, value)
    assert config([]) == GatewayConfig(
        engine_addresses=("ipc:///tmp/engine.sock",), routing="load", host="0.0.0.0", port=9000, api_key="k",
        admin_api_key="a,b", allow_runtime_lora_updating=True, max_pending=8, request_timeout=2.5, max_body_bytes=65536, model_name="served", engine_timeout=7.0,
        allowed_origins=("https://a.example", "https://b.example"), engine_wait=0.0, engine_resume_wait=60.0,
        header_timeout=1.5, body_timeout=2.0, keepalive_timeout=3.0, max_connections=9,
    )
    assert config(["--port", "9001", "--max-pending", "3"]).port == 9001  # flags win


def test_engines_repeat_or_separate_by_commas(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("EMBER_ENGINE", "tcp://a:1,dns+tcp://engines:5555")
    assert config([]).engine_addresses == ("tcp://a:1", "dns+tcp://engines:5555")
    argv = ["--engine", "tcp://a:1, tcp://b:2", "--engine", "ipc:///tmp/c"]
    assert config(argv).engine_addresses == ("tcp://a:1", "tcp://b:2", "ipc:///tmp/c")


def test_empty_api_key_from_the_environment_means_no_auth(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("EMBER_API_KEY", "")
    assert config(["--engine", "tcp://127.0.0.1:5555"]).api_key is None


@pytest.mark.parametrize(
    "argv",
    [
        ["--engine", "http://x"],
        ["--engine", "dns+tcp://engines"],
        ["--engine", "tcp://h:1", "--routing", "random"],
        ["--engine", "tcp://h:1", "--engine-timeout", "0"],
        ["--engine", "tcp://h:1", "--max-pending", "0"],
        ["--engine", "tcp://h:1", "--port", "x"],
        ["--engine", "tcp://h:1", "--request-timeout", "-1"],
        ["--engine", "tcp://h:1", "--request-timeout", "inf"],
        ["--engine", "tcp://h:1", "--engine-wait", "nan"],
        ["--engine", "tcp://h:1", "--engine-resume-wait", "-1"],
        ["--engine", "tcp://h:1", "--engine-resume-wait", "soon"],
    ],
)
def test_bad_settings_are_usage_errors(argv: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture):
    from ember_gateway.cli import main

    monkeypatch.delenv("EMBER_ENGINE", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert "ember-gateway: error:" in capsys.readouterr().err


def test_ember_serve_hands_every_gateway_flag_to_its_gateway(monkeypatch: pytest.MonkeyPatch):
    from ember_cli.serve import _gateway_argv
    from ember_cli.serve import build_parser as serve_parser

    monkeypatch.delenv("EMBER_API_KEY", raising=False)
    serve_args = serve_parser().parse_args([
        "--port", "9001", "--api-key", "k", "--max-pending", "3", "--request-timeout", "2.5",
        "--max-body-bytes", "65536", "--model-name", "served", "--engine-timeout", "7", "--allowed-origins", "",
    ])
    argv = _gateway_argv(serve_args, ["ipc:///tmp/engine.sock"], listen_fd=5)
    assert argv[1:3] == ["-m", "ember_gateway"]
    assert config(argv[3:]) == GatewayConfig(
        engine_addresses=("ipc:///tmp/engine.sock",), port=9001, api_key="k", max_pending=3, request_timeout=2.5,
        max_body_bytes=65536, model_name="served", engine_timeout=7.0, allowed_origins=(), listen_fd=5,
    )


def test_ember_serve_switches_runtime_adapter_loads_on_for_its_engines_and_its_gateway_alike(tmp_path) -> None:
    from ember_cli.serve import _engine_argv, _gateway_argv
    from ember_cli.serve import build_parser as serve_parser

    args = serve_parser().parse_args(["--allow-runtime-lora-updating", "--lora-dir", str(tmp_path), "--admin-api-key", "a"])
    assert config(_gateway_argv(args, ["ipc:///tmp/engine.sock"], listen_fd=5)[3:]).allow_runtime_lora_updating
    engine = _engine_argv(args, "ipc:///tmp/engine.sock")
    assert "--allow-runtime-lora-updating" in engine and engine[engine.index("--lora-dir") + 1] == str(tmp_path)
    off = serve_parser().parse_args([])
    assert not config(_gateway_argv(off, ["ipc:///tmp/engine.sock"], listen_fd=5)[3:]).allow_runtime_lora_updating
    assert "--no-allow-runtime-lora-updating" in _engine_argv(off, "ipc:///tmp/engine.sock")


def test_several_user_and_admin_keys_from_flags_and_files(tmp_path) -> None:
    users, admins = tmp_path / "users", tmp_path / "admins"
    users.write_text("u2\n\n u3 \n")
    admins.write_text("a2\n")
    keys = config(["--api-key", "u1, u4", "--api-key-file", str(users), "--admin-api-key", "a1",
                   "--admin-api-key-file", str(admins)]).api_keys()  # fmt: skip
    assert keys == ((b"u1", b"u4", b"u2", b"u3"), (b"a1", b"a2"))
    empty = tmp_path / "empty"
    empty.write_text("\n")
    for argv, message in (
        (["--api-key-file", str(tmp_path / "missing")], r"cannot be read \(FileNotFoundError\)"),
        (["--admin-api-key-file", str(empty)], "holds no key"),
        (["--api-key", "same", "--admin-api-key", "same"], "both a user key and an admin key"),
    ):
        with pytest.raises(ValueError, match=message):
            config(argv)


def test_ember_serve_hands_on_an_empty_api_key_that_overrides_the_environment(monkeypatch: pytest.MonkeyPatch):
    from ember_cli.serve import _gateway_argv
    from ember_cli.serve import build_parser as serve_parser

    monkeypatch.setenv("EMBER_API_KEY", "secret")  # the gateway inherits it
    argv = _gateway_argv(serve_parser().parse_args(["--api-key", ""]), ["ipc:///tmp/engine.sock"], listen_fd=5)
    assert config(argv[3:]).api_key is None


def test_every_flag_but_engine_is_a_field_and_its_help_the_fields_docstring(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("EMBER_ENGINE_TIMEOUT", raising=False)
    actions = {action.dest: action for action in build_parser()._actions}
    for field in fields(GatewayConfig):
        if field.name != "engine_addresses":
            assert field_docs(GatewayConfig)[field.name] in actions[field.name].help
    assert actions["engine_timeout"].default == GatewayConfig.engine_timeout
    assert f"(default {GatewayConfig.engine_timeout:g}; EMBER_ENGINE_TIMEOUT)" in actions["engine_timeout"].help
