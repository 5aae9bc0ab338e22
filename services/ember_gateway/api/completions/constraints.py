"""A request's output constraint, from the fields OpenAI and vLLM define for it: `response_format`
(OpenAI's json_object and json_schema), `structured_outputs` (vLLM's json / regex / choice /
grammar / json_object) and vLLM's older `guided_json`, `guided_regex`, `guided_choice`,
`guided_grammar`. At most one may be given; it is checked here, so a bad one gets a 400 naming its
field before it reaches an engine. A `strict` json_schema admits only the properties it declares
(strict_schema.py)."""

from __future__ import annotations

import json
from typing import Any

from ember_core.structured_outputs import StructuredOutputError, grammar_of
from ember_gateway.api.completions.strict_schema import strict_schema
from ember_gateway.api.request_bodies import GenerationRequest
from ember_gateway.edge.errors import ApiError
from ember_proto import StructuredOutputs

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
_VLLM_KINDS = ("json", "regex", "choice", "grammar", "json_object")


def structured_outputs_of(body: GenerationRequest) -> StructuredOutputs | None:
    given = []
    if body.response_format is not None and body.response_format.get("type") != "text":
        given.append(("response_format", _from_response_format(body.response_format)))
    if body.structured_outputs not in (None, {}):
        given.append(("structured_outputs", _from_vllm(body.structured_outputs)))
    for name, kind in _GUIDED.items():
        value = getattr(body, name)
        if value is not None:
            given.append((name, _constraint(kind, value, name)))
    if len(given) > 1:
        names = ", ".join(name for name, _ in given)
        raise ApiError(400, f"give at most one output constraint, got {names}", param=given[1][0])
    if not given:
        return None
    param, constraint = given[0]
    try:
        grammar_of(constraint)
    except StructuredOutputError as exc:
        raise ApiError(400, f"{param}: {exc}", param=param) from None
    return constraint


def _from_response_format(response_format: dict[str, Any]) -> StructuredOutputs:
    kind = response_format.get("type")
    if kind == "json_object":
        return StructuredOutputs(json_object=True)
    if kind != "json_schema":
        raise ApiError(400, f"response_format type must be text, json_object or json_schema, got {kind!r}",
                       param="response_format.type")
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), (dict, bool)):
        raise ApiError(400, "response_format.json_schema must be an object with a `schema` object",
                       param="response_format.json_schema")
    # OpenAI's: a json_schema without a schema allows any JSON
    schema = spec.get("schema", {})
    return StructuredOutputs(json=json.dumps(strict_schema(schema) if spec.get("strict") is True else schema))


def _from_vllm(value: Any) -> StructuredOutputs:
    if not isinstance(value, dict):
        raise ApiError(400, "structured_outputs must be an object", param="structured_outputs")
    given = [kind for kind in _VLLM_KINDS if value.get(kind) not in (None, False)]
    if len(given) != 1:
        raise ApiError(400, f"structured_outputs takes exactly one of {', '.join(_VLLM_KINDS)}", param="structured_outputs")
    return _constraint(given[0], value[given[0]], f"structured_outputs.{given[0]}")


def _constraint(kind: str, value: Any, param: str) -> StructuredOutputs:
    if kind == "json":
        if isinstance(value, str):
            return StructuredOutputs(json=value)
        if isinstance(value, (dict, bool)):
            return StructuredOutputs(json=json.dumps(value))
        raise ApiError(400, f"{param} must be a JSON schema (an object, or its JSON text)", param=param)
    if kind == "json_object":
        return StructuredOutputs(json_object=True)
    if kind == "choice":
        if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
            raise ApiError(400, f"{param} must be a list of strings", param=param)
        return StructuredOutputs(choice=value)
    if not isinstance(value, str):
        raise ApiError(400, f"{param} must be a string", param=param)
    return StructuredOutputs(**{kind: value})
