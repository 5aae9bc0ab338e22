"""Chat templates rendered the way transformers' apply_chat_template(tokenize=False) renders them."""

import json
from datetime import datetime
from functools import lru_cache
from typing import Any, ClassVar

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

# The names a message's reasoning comes under; templates read it as reasoning_content (Qwen3) or
# thinking (gpt-oss).
_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


def render_chat(
    template: str,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    bos_token: str = "",
    eos_token: str = "",
    **extra: Any,
) -> str:
    """The prompt text for messages. A broken template, or one that rejects the messages, raises
    ValueError with the template's message."""
    context = {"tools": None, "documents": None, **extra}  # defined, as None, unless given
    try:
        return _compile(template).render(
            messages=[_template_message(message) for message in messages],
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token,
            eos_token=eos_token,
            **context,
        )
    # A template is a program: whatever it raises means it cannot render these messages.
    except (jinja2.TemplateError, ArithmeticError, LookupError, TypeError, ValueError) as error:
        raise ValueError(f"chat template error: {error}") from error


def _template_message(message: dict[str, Any]) -> dict[str, Any]:
    """A message as transformers hands it to a template: keys set to None (OpenAI's content=None)
    dropped, and its reasoning under every name templates read it by."""
    kept = {key: value for key, value in message.items() if value is not None}
    reasoning = next((kept[key] for key in _REASONING_KEYS if key in kept), None)
    if reasoning is None:
        return kept
    return {"thinking": reasoning, **kept, "reasoning_content": reasoning}


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; when
    rendering a prompt it only outputs its body."""

    tags: ClassVar[set[str]] = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


class _Namespace(jinja2.utils.Namespace):
    """namespace() without underscore names, which could reach Python's internals (as transformers)."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, attributes = args[0], dict(*args[1:], **kwargs)
        for name in attributes:
            _check_namespace_name(name)
        jinja2.utils.Namespace.__init__(self, attributes)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_namespace_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)


def _check_namespace_name(name: Any) -> None:
    # A function, not a method: Namespace answers every attribute lookup on itself from its contents.
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(f"a namespace cannot hold an underscore name: {name!r}")


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # jinja's own tojson escapes HTML characters, which would change the prompt.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


@lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    try:
        environment = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
        )
        environment.filters["tojson"] = _tojson
        environment.globals["raise_exception"] = _raise_exception
        environment.globals["strftime_now"] = _strftime_now
        environment.globals["namespace"] = _Namespace
        return environment.from_string(template)
    except jinja2.TemplateError as error:
        raise ValueError(f"chat template error: {error}") from error
