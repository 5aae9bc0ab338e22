"""Chat templates rendered the way transformers' apply_chat_template(tokenize=False) renders them."""

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment


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
    # Like transformers: keys set to None (OpenAI's content=None) are dropped, and tools /
    # documents are defined (as None) unless given.
    cleaned = [{key: value for key, value in message.items() if value is not None} for message in messages]
    context = {"tools": None, "documents": None, **extra}
    try:
        return _compile(template).render(
            messages=cleaned,
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token,
            eos_token=eos_token,
            **context,
        )
    except (jinja2.TemplateError, TypeError) as error:
        raise ValueError(f"chat template error: {error}") from error


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; when
    rendering a prompt it only outputs its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


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
        return environment.from_string(template)
    except jinja2.TemplateError as error:
        raise ValueError(f"chat template error: {error}") from error
