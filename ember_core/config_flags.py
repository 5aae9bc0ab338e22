"""Command-line flags made from a config dataclass: one per field, named after it, with the field's
default, its docstring (the string under it) as help, and its environment variable EMBER_<FIELD>."""

from __future__ import annotations

import argparse
import ast
import inspect
import itertools
import os
import sys
import textwrap
import types
import typing
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any


def env_name(field: str) -> str:
    return f"EMBER_{field.upper()}"


def env_default(field: str, default: Any) -> Any:
    """The flag's environment variable when set, else `default` (argparse converts string defaults with `type`)."""
    return os.environ.get(env_name(field), default)


def _identity(value: Any) -> Any:
    return value


def _or_none(value: str | None) -> str | None:
    return value or None  # an empty value leaves an optional text setting unset


def comma_list(value: str) -> tuple[str, ...]:
    return tuple(item.strip() for item in value.split(",") if item.strip())


def boolean(value: str | bool) -> bool:
    """A switch's environment variable: true / false, 1 / 0, yes / no, on / off."""
    if isinstance(value, bool):
        return value
    if value.strip().lower() in ("1", "true", "yes", "on"):
        return True
    if value.strip().lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"must be true or false, got {value!r}")


@dataclass(frozen=True)
class Flag:
    """A config field's flag. The namespace holds the flag's value as typed on a command line (a list
    as one comma-separated string), so a launcher can hand it on as text; `value` makes it the field's."""

    field: str
    help: str
    default: Any
    parse: Callable[[str], Any]  # argparse's `type`
    value: Callable[[Any], Any] = _identity
    choices: Sequence[str] | None = None
    env: bool = True  # also read from EMBER_<FIELD>

    @property
    def option(self) -> str:
        return "--" + self.field.replace("_", "-")

    @property
    def is_switch(self) -> bool:
        """A bool field: --FLAG / --no-FLAG on a command line."""
        return self.parse is boolean

    def argv(self, value: Any) -> list[str]:
        """The flag with `value` (as the namespace holds it) for a launcher's command line."""
        if self.is_switch:
            return [self.option if value else "--no-" + self.option.removeprefix("--")]
        return [] if value is None else [self.option, str(value)]

    @property
    def shown_default(self) -> str:
        if self.default is None:
            return "none"
        return f"{self.default:g}" if isinstance(self.default, float) else str(self.default)


def field_docs(cls: type) -> dict[str, str]:
    """Each field's docstring, on one line."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    return {
        node.target.id: " ".join(doc.value.value.split())
        for node, doc in itertools.pairwise(body)
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
        and isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant) and isinstance(doc.value.value, str)
    }


def config_flags(
    cls: type,
    *,
    skip: Collection[str] = (),
    parse: Mapping[str, Callable[[str], Any]] | None = None,
    choices: Mapping[str, Sequence[str]] | None = None,
    no_env: Collection[str] = (),
) -> list[Flag]:
    """A flag per field of `cls` but those in `skip`, in field order; `parse` overrides the type the
    annotation implies (int, float, str, tuple[str, ...], any of them or None)."""
    docs, hints = field_docs(cls), typing.get_type_hints(cls)
    flags = []
    for spec in fields(cls):
        if spec.name in skip:
            continue
        hint = hints[spec.name]
        optional = isinstance(hint, types.UnionType) and type(None) in typing.get_args(hint)
        base = next(arg for arg in typing.get_args(hint) if arg is not type(None)) if optional else hint
        default, value = spec.default, _identity
        if typing.get_origin(base) is tuple:
            base, default, value = str, ",".join(default), comma_list
        elif base is str and optional:
            value = _or_none
        elif base is bool:
            base = boolean
        if base not in (int, float, str, boolean):
            raise TypeError(f"{cls.__name__}.{spec.name}: no flag for {hint}")
        if spec.name not in docs:
            raise TypeError(f"{cls.__name__}.{spec.name} needs a docstring: its flag's help")
        flags.append(Flag(
            spec.name, docs[spec.name], default, (parse or {}).get(spec.name, base), value,
            (choices or {}).get(spec.name), spec.name not in no_env,
        ))
    return flags


def add_flags(parser: argparse.ArgumentParser, flags: Sequence[Flag]) -> None:
    for flag in flags:
        where = f"default {flag.shown_default}" + (f"; {env_name(flag.field)}" if flag.env else "")
        if flag.is_switch:
            parser.add_argument(
                flag.option, action=argparse.BooleanOptionalAction,
                default=env_switch(flag.field, flag.default) if flag.env else flag.default, help=f"{flag.help} ({where})".replace("%", "%%"),
            )
            continue
        parser.add_argument(
            flag.option, type=flag.parse, choices=flag.choices,
            default=env_default(flag.field, flag.default) if flag.env else flag.default,
            help=f"{flag.help} ({where})".replace("%", "%%"),  # argparse %-formats help
        )


def env_switch(field: str, default: bool) -> bool:
    """A switch's default: its environment variable when set (a bad value is a one-line error, exit 2)."""
    try:
        return boolean(env_default(field, default))
    except argparse.ArgumentTypeError as exc:
        print(f"ember: error: {env_name(field)} {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def config_kwargs(flags: Sequence[Flag], args: argparse.Namespace) -> dict[str, Any]:
    return {flag.field: flag.value(getattr(args, flag.field)) for flag in flags}


def markdown_table(flags: Sequence[Flag]) -> str:
    rows = ["| flag | environment | default | meaning |", "|---|---|---|---|"]
    for flag in flags:
        env = f"`{env_name(flag.field)}`" if flag.env else ""
        default = f"`{flag.default}`" if isinstance(flag.default, str) else flag.shown_default
        meaning = flag.help.replace("|", r"\|")
        rows.append(f"| `{flag.option}` | {env} | {default} | {meaning} |")
    return "\n".join(rows) + "\n"
