"""A sampling setting is declared once, in SamplingParams: the HTTP bodies, the OpenAPI document and
`ember generate`'s flags are made from it, and the wire's SamplingOptions, which keeps its own
versioned copy, fails here the moment it disagrees (a name, a default or a type)."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from ember_cli.main import build_parser
from ember_core.sampling_params import SETTINGS, DeclaredSetting, SamplingParams
from ember_gateway.api.openapi import DOCUMENTS
from ember_gateway.api.request_bodies import ChatCompletionRequest, CompletionRequest
from ember_proto import SamplingOptions, StructuredOutputs

ENGINE_SETTINGS = [name for name, declared in SETTINGS.items() if declared.setting.engine]
BODY_SETTINGS = [name for name, declared in SETTINGS.items() if declared.setting.body != "mapped"]


def _other_value(declared: DeclaredSetting) -> Any:
    """A valid value of the setting that is not its default, drawn from its declaration."""
    limit = declared.setting.limit
    if limit is not None:
        low = limit.ge if limit.ge is not None else limit.gt + (1 if limit.kind is int else 0.5)
        candidates = [limit.kind(bound) for bound in (limit.le, low, low + 1) if bound is not None]
        return next(value for value in candidates if value != declared.default and limit.allows(value))
    if declared.type is bool:
        return not declared.default
    return {
        "stop": ("end",),
        "stop_token_ids": (5, 9),
        "logit_bias": {3: -1.5},
        "structured_outputs": StructuredOutputs(regex="a+"),
    }[declared.name]


def test_the_wire_carries_exactly_the_settings_the_engine_samples_with() -> None:
    assert set(SamplingOptions.__struct_fields__) == set(ENGINE_SETTINGS)


def test_the_wire_and_sampling_params_have_the_same_defaults() -> None:
    encode = msgspec.msgpack.encode
    assert encode(SamplingParams().to_wire()) == encode(SamplingOptions())  # as the engine receives it
    assert SamplingParams.from_wire(SamplingOptions()) == SamplingParams()


@pytest.mark.parametrize("name", ENGINE_SETTINGS)
def test_every_value_of_a_setting_crosses_the_wire_unchanged(name: str) -> None:
    params = SamplingParams(**{name: _other_value(SETTINGS[name])})
    received = msgspec.msgpack.decode(msgspec.msgpack.encode(params.to_wire()), type=SamplingOptions)
    assert SamplingParams.from_wire(received) == params


@pytest.mark.parametrize("name", BODY_SETTINGS)
def test_a_body_setting_is_a_field_of_both_bodies_the_document_and_the_cli(name: str) -> None:
    value = _other_value(SETTINGS[name])
    wire_value = list(value) if isinstance(value, tuple) else value
    for body_type, extra in ((CompletionRequest, {"prompt": "x"}), (ChatCompletionRequest, {"messages": [{"role": "user"}]})):
        body = msgspec.convert({"model": "m", **extra, name: wire_value}, body_type)
        assert getattr(body, name) == wire_value
        described = DOCUMENTS[True]["components"]["schemas"][body_type.__name__]["properties"][name]
        assert SETTINGS[name].setting.meaning in str(described)
    parser, _ = build_parser()
    flag = "--" + name.replace("_", "-")
    argv = ["generate", "hi"]
    if isinstance(value, bool):
        argv.append(flag if value else f"--no-{name.replace('_', '-')}")
    else:
        for item in value if isinstance(value, tuple) else (value,):
            argv += [flag, str(item)]
    parsed = getattr(parser.parse_args(argv), name)
    assert (tuple(parsed) if isinstance(parsed, list) else parsed) == value
