"""The --log-level flag of every ember command, checked while parsing (a bad level is a one-line
usage error, not a traceback from logging)."""

from __future__ import annotations

import argparse
import logging
import os

LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def _level(value: str) -> str:
    level = value.strip().upper()
    if level not in LEVELS:
        raise argparse.ArgumentTypeError(f"must be one of {', '.join(LEVELS)} (any case), got {value!r}")
    return level


def add_log_level_argument(parser: argparse.ArgumentParser, default: str | None = "INFO") -> None:
    """--log-level, defaulting to EMBER_LOG_LEVEL, else `default`."""
    parser.add_argument(
        "--log-level", type=_level, default=os.environ.get("EMBER_LOG_LEVEL", default),
        help=f"{', '.join(LEVELS)} (EMBER_LOG_LEVEL)",
    )


def configure_logging(level: str) -> None:
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
