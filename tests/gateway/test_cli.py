import pytest

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
        "EMBER_MAX_PENDING": "8",
        "EMBER_REQUEST_TIMEOUT": "2.5",
        "EMBER_MAX_BODY_BYTES": "65536",
        "EMBER_MODEL_NAME": "served",
        "EMBER_ROUTING": "load",
    }.items():
        monkeypatch.setenv(name, value)
    assert config([]) == GatewayConfig(
        engine_addresses=("ipc:///tmp/engine.sock",), routing="load", host="0.0.0.0", port=9000, api_key="k",
        max_pending=8, request_timeout=2.5, max_body_bytes=65536, model_name="served",
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
