"""Fixtures of the core tests: the default model's tokenizer, read from its GGUF."""

from __future__ import annotations

from typing import Any

import pytest

from ember_core.tokenizer import Tokenizer, tokenizer_from_gguf


@pytest.fixture(scope="session")
def smollm_reader(smollm2_reader: Any) -> Any:
    return smollm2_reader


@pytest.fixture(scope="session")
def smollm(smollm_reader: Any) -> Tokenizer:
    return tokenizer_from_gguf(smollm_reader)
