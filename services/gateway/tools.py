"""Tool calling in chat: which tools a request offers and how it wants them called (`tool_choice`),
how they reach the model, and the calls read back from its output.

With `required` or a named function the output is constrained to calls whose arguments match the
function's `parameters` schema (a JSON array of calls with `parallel_tool_calls`, else one call).
With `auto` the model's own syntax is parsed: Hermes-style `<tool_call>{...}</tool_call>` blocks,
or a whole output that is a call object or an array of them (Llama 3.x's JSON calls, where
`parameters` stands for `arguments`). A chat template that renders `tools` gets them; for one that
does not (SmolLM2-135M's), the tools are described in a system message.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from ember_gateway.errors import ApiError
from ember_gateway.schemas import ChatCompletionRequest
from ember_proto import StructuredOutputs

_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class ToolPlan:
    tools: list[dict[str, Any]]  # the request's tool objects (type function)
    choice: str  # "auto", "required", or the name of the one function to call
    parallel: bool

    @property
    def constrained(self) -> bool:
        return self.choice != "auto"

    def functions(self) -> list[dict[str, Any]]:
        return [tool["function"] for tool in self.tools]


def tool_plan(body: ChatCompletionRequest) -> ToolPlan | None:
    """None when the output is plain text: no tools, or tool_choice none."""
    if not body.tools or body.tool_choice == "none":
        return None
    names = []
    for index, tool in enumerate(body.tools):
        function = tool.get("function")
        if tool.get("type") != "function" or not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ApiError(400, "a tool is {\"type\": \"function\", \"function\": {\"name\", ...}}", param=f"tools[{index}]")
        if not isinstance(function.get("parameters", {}), dict):
            raise ApiError(400, "a function's parameters are a JSON schema object", param=f"tools[{index}].function.parameters")
        names.append(function["name"])
    choice = body.tool_choice or "auto"
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
        if name not in names:
            raise ApiError(400, f"tool_choice names no function among the tools: {name!r}", param="tool_choice")
        choice = name
    elif choice not in ("auto", "required"):
        raise ApiError(400, "tool_choice must be none, auto, required or {\"type\": \"function\", ...}", param="tool_choice")
    return ToolPlan(body.tools, choice, body.parallel_tool_calls is not False)


def constraint(plan: ToolPlan) -> StructuredOutputs | None:
    """The output a required or named tool_choice allows: calls of the offered functions."""
    if not plan.constrained:
        return None
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": function["name"]}, "arguments": function.get("parameters") or {"type": "object"}},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for function in plan.functions()
        if plan.choice in ("required", function["name"])
    ]
    call = calls[0] if len(calls) == 1 else {"anyOf": calls}
    several = plan.parallel and plan.choice == "required"  # a named function: one call of it
    schema = {"type": "array", "items": call, "minItems": 1} if several else call
    return StructuredOutputs(json=json.dumps(schema))


def describe(plan: ToolPlan) -> str:
    """The system message that offers the tools to a model whose chat template does not render them."""
    lines = [
        "You can call these tools (JSON schemas of their arguments):",
        *(json.dumps(function) for function in plan.functions()),
        (
            'To call one, answer with <tool_call>{"name": NAME, "arguments": {...}}</tool_call> '
            "(one block per call); otherwise answer normally."
        ),
    ]
    return "\n".join(lines)


def parse_calls(plan: ToolPlan, text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool calls) of an output; no calls: the text is the content."""
    if plan.constrained:
        calls = _calls(_json(text))
        return None, [_openai_call(call) for call in calls]
    blocks = _HERMES_CALL.findall(text)
    calls = [call for block in blocks for call in _calls(_json(block))]
    if not blocks:
        calls = _calls(_json(text.strip()))
    if not calls:
        return text, []
    if not plan.parallel:
        calls = calls[:1]
    content = _HERMES_CALL.sub("", text).strip() if blocks else ""
    return content or None, [_openai_call(call) for call in calls]


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _calls(value: Any) -> list[dict[str, Any]]:
    """The calls in a decoded output: a call object or a list of them; anything else, none."""
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return []
        arguments = item.get("arguments", item.get("parameters", {}))
        if not isinstance(arguments, dict):
            return []
        calls.append({"name": item["name"], "arguments": arguments})
    return calls


def _openai_call(call: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": call["name"], "arguments": json.dumps(call["arguments"])},
    }
