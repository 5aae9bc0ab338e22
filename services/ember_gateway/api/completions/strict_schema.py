"""OpenAI's strict mode for a JSON schema (`response_format.json_schema.strict`, a function's
`strict`): an object admits only the properties it declares. JSON Schema lets an object without
`additionalProperties` take any other key, and a small model constrained by such a schema invents
keys; strict mode closes every object the schema describes that does not say otherwise."""

from __future__ import annotations

from typing import Any

# Keywords whose value is a schema, or a list or a map of schemas.
_SCHEMA = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def strict_schema(schema: Any) -> Any:
    """schema with `additionalProperties: false` on every object schema that has no such key."""
    if not isinstance(schema, dict):
        return schema
    strict = dict(schema)
    for key in _SCHEMA:
        if key in strict:
            strict[key] = strict_schema(strict[key])
    for key in _SCHEMA_LISTS:
        if isinstance(strict.get(key), list):
            strict[key] = [strict_schema(item) for item in strict[key]]
    for key in _SCHEMA_MAPS:
        if isinstance(strict.get(key), dict):
            strict[key] = {name: strict_schema(item) for name, item in strict[key].items()}
    is_object = strict.get("type") == "object" or (isinstance(strict.get("type"), list) and "object" in strict["type"])
    if (is_object or "properties" in strict) and "additionalProperties" not in strict:
        strict["additionalProperties"] = False
    return strict
