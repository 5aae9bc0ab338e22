"""Writes openai_openapi_subset.json: the named response schemas of OpenAI's published description
and every schema they $ref, with OpenAPI 3.0's `nullable: true` rewritten as JSON Schema's
anyOf [schema, {type: null}] (see README.md here).

    python tests/gateway/data/vendor_openai_schemas.py PATH/TO/openapi.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

COMMIT = "f85dbe223d40e1a31cba812ab2d755c7e98a92a3"
ROOTS = (
    "CreateChatCompletionResponse", "CreateChatCompletionStreamResponse", "CreateCompletionResponse",
    "ListModelsResponse", "Model", "Response", "ResponseStreamEvent", "CreateEmbeddingResponse",
)
OUT = Path(__file__).with_name("openai_openapi_subset.json")
PREFIX = "#/components/schemas/"


def references(node: Any) -> set[str]:
    if isinstance(node, dict):
        found = {node["$ref"].removeprefix(PREFIX)} if isinstance(node.get("$ref"), str) else set()
        return found.union(*(references(value) for value in node.values()))
    if isinstance(node, list):
        return set().union(*(references(value) for value in node))
    return set()


def without_nullable(node: Any) -> Any:
    if isinstance(node, list):
        return [without_nullable(value) for value in node]
    if not isinstance(node, dict):
        return node
    rewritten = {key: without_nullable(value) for key, value in node.items() if key != "nullable"}
    return {"anyOf": [rewritten, {"type": "null"}]} if node.get("nullable") is True else rewritten


def subset(schemas: dict[str, Any]) -> dict[str, Any]:
    wanted, todo = set(), list(ROOTS)
    while todo:
        name = todo.pop()
        if name not in wanted:
            wanted.add(name)
            todo.extend(references(schemas[name]))
    return {name: without_nullable(schemas[name]) for name in sorted(wanted)}


def main() -> None:
    document = json.loads(Path(sys.argv[1]).read_text())
    source = {
        "repository": "https://github.com/openai/openai-openapi",
        "commit": COMMIT,
        "file": "openapi.json (components.schemas)",
        "licence": "MIT, Copyright (c) OpenAI: see README.md beside this file",
        "changes": "only these schemas and what they $ref; OpenAPI 3.0's `nullable: true` (which JSON "
        "Schema ignores) rewritten as anyOf [schema, {type: null}]; written by vendor_openai_schemas.py",
    }
    OUT.write_text(json.dumps({"_source": source, "components": {"schemas": subset(document["components"]["schemas"])}}, indent=1) + "\n")


if __name__ == "__main__":
    main()
