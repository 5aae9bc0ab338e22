"""`ember generate`'s sampling flags, one per setting an HTTP body carries, made from SamplingParams'
declarations: the same names, meanings and defaults (but where the CLI keeps its own), checked by
SamplingParams itself."""

from __future__ import annotations

import argparse
from typing import Any

from ember_core.sampling_params import SETTINGS, DeclaredSetting, SamplingParams

# A command line wants a short greedy answer by default.
CLI_DEFAULTS = {"max_tokens": 64, "temperature": 0.0}
_LIST_FLAGS = {"stop": str, "stop_token_ids": int}  # repeatable: --stop A --stop B


def _flag(declared: DeclaredSetting) -> tuple[str, dict[str, Any]]:
    setting = declared.setting
    default = CLI_DEFAULTS.get(declared.name, declared.default)
    options: dict[str, Any] = {"dest": declared.name, "help": setting.meaning, "default": default}
    if declared.name in _LIST_FLAGS:
        options.update(action="append", type=_LIST_FLAGS[declared.name])
    elif declared.type is bool:
        options.update(action=argparse.BooleanOptionalAction)
    else:
        options.update(type=setting.limit.kind if setting.limit else declared.type)
    return "--" + declared.name.replace("_", "-"), options


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling (as the HTTP API's fields of the same names)")
    for declared in SETTINGS.values():
        if declared.setting.body != "mapped":
            flag, options = _flag(declared)
            group.add_argument(flag, **options)


def sampling_params_from_args(args: argparse.Namespace) -> SamplingParams:
    """Raises SamplingParamError (a ValueError: the CLI's one-line message) on a value out of range."""
    return SamplingParams(**{name: getattr(args, name) for name in SETTINGS if hasattr(args, name)})
