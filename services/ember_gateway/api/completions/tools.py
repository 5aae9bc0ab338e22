"""Tool calling in chat: which tools a request offers and how it wants them called (`tool_choice`),
how they reach the model, and the calls read back from its output.

With `required` or a named function the output is constrained to calls whose arguments match the
function's `parameters` schema (a JSON array of calls with `parallel_tool_calls`, else one call).
With `auto` the model's own syntax is parsed, by the parser of its family as its chat template
shows it: Llama 3.x's templates ask for a JSON object `{"name", "parameters"}` (or an array of
them) as the whole output; Hermes-style templates (Qwen 2.5, Qwen3, Hermes, SmolLM3) for
`<tool_call>{"name", "arguments"}</tool_call>` blocks; Mistral's for `[TOOL_CALLS]` and the calls
after it, a JSON array (`[TOOL_CALLS] [{"name", "arguments"}, ...]`, v0.3) or `name[ARGS]{...}`
per call (`[TOOL_CALLS]a[ARGS]{...}[TOOL_CALLS]b[ARGS]{...}`, newer tokenizers). A chat template
that renders `tools` gets them; for one that does not (SmolLM2's, Gemma's, Phi's, OLMo's), the tools
are described in a system message that asks for the Hermes blocks, or in the first user message
where the template refuses a system message (Gemma 2).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Literal

from ember_core.tokenizer.chat_template import render_chat
from ember_gateway.api.completions.strict_schema import strict_schema
from ember_gateway.api.request_bodies import ChatCompletionRequest
from ember_gateway.edge.errors import ApiError
from ember_proto import StructuredOutputs

_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"
_HERMES_CALL = re.compile(rf"{_HERMES_OPEN}\s*(.*?)\s*{_HERMES_CLOSE}", re.DOTALL)
_LLAMA_PYTHON_TAG = "<|python_tag|>"
_MISTRAL_CALLS, _MISTRAL_ARGS = "[TOOL_CALLS]", "[ARGS]"

ToolSyntax = Literal["hermes", "llama3_json", "mistral"]


@dataclass(frozen=True)
class ToolPlan:
    tools: list[dict[str, Any]]  # the request's tool objects (type function)
    choice: str  # "auto", "required", or the name of the one function to call
    parallel: bool
    syntax: ToolSyntax = "hermes"  # how the model writes calls under "auto"

    @property
    def constrained(self) -> bool:
        return self.choice != "auto"

    @property
    def reads_control_tokens(self) -> bool:
        """Mistral's vocabularies make [TOOL_CALLS] a control token, whose text the output keeps
        only when special tokens are not skipped (as vLLM's Mistral parser asks too)."""
        return self.syntax == "mistral" and not self.constrained

    def functions(self) -> list[dict[str, Any]]:
        return [tool["function"] for tool in self.tools]


def tool_syntax(chat_template: str | None) -> ToolSyntax:
    """The model family's call syntax, read from its chat template."""
    if chat_template and _MISTRAL_CALLS in chat_template:
        return "mistral"
    renders_tools = bool(chat_template) and "tools" in chat_template and _HERMES_OPEN not in chat_template
    if renders_tools and (_LLAMA_PYTHON_TAG in chat_template or '"parameters"' in chat_template):
        return "llama3_json"
    return "hermes"


def tool_plan(body: ChatCompletionRequest, chat_template: str | None) -> ToolPlan | None:
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
    return ToolPlan(body.tools, choice, body.parallel_tool_calls is not False, tool_syntax(chat_template))


def constraint(plan: ToolPlan) -> StructuredOutputs | None:
    """The output a required or named tool_choice allows: calls of the offered functions."""
    if not plan.constrained:
        return None
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": function["name"]}, "arguments": _arguments_schema(function)},
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


def _arguments_schema(function: dict[str, Any]) -> dict[str, Any]:
    parameters = function.get("parameters") or {"type": "object"}
    return strict_schema(parameters) if function.get("strict") is True else parameters


def describe(plan: ToolPlan) -> str:
    """The text that offers the tools to a model whose chat template does not render them."""
    lines = [
        "You can call these tools (JSON schemas of their arguments):",
        *(json.dumps(function) for function in plan.functions()),
        (
            'To call one, answer with <tool_call>{"name": NAME, "arguments": {...}}</tool_call> '
            "(one block per call); otherwise answer normally."
        ),
    ]
    return "\n".join(lines)


def with_tool_description(
    plan: ToolPlan, messages: list[dict[str, Any]], chat_template: str
) -> list[dict[str, Any]]:
    """The messages with the tools described (describe()) for a template that does not render them:
    in the system message, or at the head of the first user message when the template refuses a
    system message (Gemma 2's raises) or leaves it out."""
    description = describe(plan)
    first_user = next((index for index, message in enumerate(messages) if message["role"] == "user"), None)
    if first_user is not None and not _renders_system_message(chat_template):
        message = messages[first_user]
        described = {**message, "content": f"{description}\n\n{message['content']}"}
        return [*messages[:first_user], described, *messages[first_user + 1 :]]
    if messages and messages[0]["role"] == "system":  # joined: Gemma 3's template takes one system message
        system = messages[0]
        return [{**system, "content": "\n\n".join(filter(None, [system["content"], description]))}, *messages[1:]]
    return [{"role": "system", "content": description}, *messages]


@lru_cache(maxsize=16)
def _renders_system_message(chat_template: str) -> bool:
    probe = "ember: does the system message reach the prompt?"
    try:
        prompt = render_chat(chat_template, [{"role": "system", "content": probe}, {"role": "user", "content": "Hi"}])
    except ValueError:
        return False
    return probe in prompt


def parse_calls(plan: ToolPlan, text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool calls) of an output; no calls (a forced call cut short too): the text is the content."""
    content, calls = _read_calls(plan, text)
    return content, [_openai_call(call, plan.syntax) for call in calls[: None if plan.parallel else 1]]


def _read_calls(plan: ToolPlan, text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, calls as {"name", "arguments"})."""
    if plan.constrained:
        content, calls = "", _calls(_json(text))
    elif plan.syntax == "llama3_json":  # the whole output is the call or an array of calls
        content, calls = "", _calls(_json(text.strip().removeprefix(_LLAMA_PYTHON_TAG)))
    elif plan.syntax == "mistral":  # content, then calls from the first [TOOL_CALLS] to the end
        content, marker, rest = text.partition(_MISTRAL_CALLS)
        content, calls = content.strip(), (_mistral_calls(rest) if marker else [])
    else:
        blocks = _HERMES_CALL.findall(text)
        content, calls = _HERMES_CALL.sub("", text).strip(), [call for block in blocks for call in _calls(_json(block))]
    if not calls:
        return text, []
    return content or None, calls


class CallStream:
    """One streamed choice's output with tools: its content as it comes, held back only where it
    may begin a call, and each call (an OpenAI stream entry, with its index) once it is complete.
    A forced call (required / named), Llama 3.x's JSON and Mistral's calls run to the end of the
    output: they come at the end."""

    def __init__(self, plan: ToolPlan) -> None:
        self._plan = plan
        self._text = ""
        self._done = 0  # characters of _text sent as content or read as calls
        self._whole = plan.constrained  # the output from _done on is read once it is complete
        self._plain = False  # a Llama 3.x output that began as text: all content
        self.num_calls = 0

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        self._text += text
        if self._whole:
            return "", []
        if self._plan.syntax == "hermes":
            return self._hermes()
        if self._plan.syntax == "mistral":
            return self._mistral()
        if not self._plain:
            start = self._text.lstrip()
            if start[:1] in ("{", "[") or start.startswith(_LLAMA_PYTHON_TAG):
                self._whole = True
                return "", []
            self._plain = bool(start) and not _LLAMA_PYTHON_TAG.startswith(start)
            if not self._plain:
                return "", []
        return self._content(len(self._text))

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """What is left once the output is complete: a call cut short is content."""
        if self._whole:
            content, calls = _read_calls(self._plan, self._text[self._done :])
            return content or "", self._entries(calls)
        return self._content(len(self._text))

    def _hermes(self) -> tuple[str, list[dict[str, Any]]]:
        content, calls = "", []
        while True:
            rest = self._text[self._done :]
            start = rest.find(_HERMES_OPEN)
            if start < 0:
                more, _ = self._content(len(self._text) - _partial_suffix(rest, _HERMES_OPEN))
                return content + more, self._entries(calls)
            end = rest.find(_HERMES_CLOSE, start)
            more, _ = self._content(self._done + start)
            content += more
            if end < 0:
                return content, self._entries(calls)
            block = rest[start + len(_HERMES_OPEN) : end]
            self._done += end - start + len(_HERMES_CLOSE)
            parsed = _calls(_json(block.strip()))
            if parsed:
                calls += parsed
            else:  # not a call after all
                content += f"{_HERMES_OPEN}{block}{_HERMES_CLOSE}"

    def _mistral(self) -> tuple[str, list[dict[str, Any]]]:
        start = self._text.find(_MISTRAL_CALLS, self._done)
        if start < 0:
            return self._content(len(self._text) - _partial_suffix(self._text[self._done :], _MISTRAL_CALLS))
        self._whole = True
        return self._content(start)

    def _content(self, end: int) -> tuple[str, list[dict[str, Any]]]:
        content, self._done = self._text[self._done : end], max(self._done, end)
        return content, []

    def _entries(self, calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if not self._plan.parallel:
            calls = calls[: max(0, 1 - self.num_calls)]
        syntax = self._plan.syntax
        entries = [{"index": self.num_calls + i, **_openai_call(call, syntax)} for i, call in enumerate(calls)]
        self.num_calls += len(entries)
        return entries


def _partial_suffix(text: str, tag: str) -> int:
    """The length of text's longest ending that begins tag (held back: it may be the tag's start)."""
    return next((n for n in range(min(len(tag) - 1, len(text)), 0, -1) if tag.startswith(text[-n:])), 0)


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


def _mistral_calls(text: str) -> list[dict[str, Any]]:
    """The calls after Mistral's first [TOOL_CALLS]: a JSON array (or object) of them, or
    name[ARGS]{...} each, the later ones after a [TOOL_CALLS] of their own."""
    if text.lstrip()[:1] in ("[", "{"):
        return _calls(_json(text))
    named = [piece.partition(_MISTRAL_ARGS) for piece in text.split(_MISTRAL_CALLS)]
    if not all(marker for _, marker, _ in named):
        return []
    return _calls([{"name": name.strip(), "arguments": _json(arguments)} for name, _, arguments in named])


def _openai_call(call: dict[str, Any], syntax: ToolSyntax) -> dict[str, Any]:
    # Mistral's templates take back only ids of 9 letters and digits.
    call_id = uuid.uuid4().hex[:9] if syntax == "mistral" else f"call_{uuid.uuid4().hex[:24]}"
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": call["name"], "arguments": json.dumps(call["arguments"])},
    }
