"""OpenAI's strict mode closes every object a JSON schema describes, and only those without their own
additionalProperties."""

from __future__ import annotations

from ember_gateway.api.completions.strict_schema import strict_schema


def test_every_object_is_closed_where_the_schema_says_nothing() -> None:
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "where": {"type": "object", "properties": {"lat": {"type": "number"}}},
            "tags": {"type": "array", "items": {"properties": {"name": {"type": "string"}}}},
            "extra": {"type": "object", "additionalProperties": {"type": "integer"}},
            "either": {"anyOf": [{"type": "object"}, {"type": "string"}]},
            "ref": {"$ref": "#/$defs/point"},
            "nullable": {"type": ["object", "null"], "properties": {}},
        },
        "$defs": {"point": {"type": "object", "properties": {"x": {"type": "number"}}}},
    }
    strict = strict_schema(schema)
    properties = strict["properties"]
    assert strict["additionalProperties"] is False
    assert properties["where"]["additionalProperties"] is False
    assert properties["tags"]["items"]["additionalProperties"] is False
    assert properties["extra"]["additionalProperties"] == {"type": "integer"}  # its own choice stays
    assert properties["either"]["anyOf"][0]["additionalProperties"] is False
    assert "additionalProperties" not in properties["either"]["anyOf"][1]
    assert strict["$defs"]["point"]["additionalProperties"] is False
    assert properties["nullable"]["additionalProperties"] is False
    assert "additionalProperties" not in properties["city"]
    assert "additionalProperties" not in schema["properties"]["where"]  # the caller's schema is untouched


def test_an_open_object_stays_open_when_it_says_so() -> None:
    schema = {"type": "object", "additionalProperties": True}
    assert strict_schema(schema) == schema
    assert strict_schema(True) is True
