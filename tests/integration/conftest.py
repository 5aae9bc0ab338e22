"""Fixtures of the integration tests: the test model with a real BPE tokenizer and chat template."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.gateway.tiny_tokenizer import write_model_with_tokenizer


@pytest.fixture(scope="session")
def model_dir(gpt2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model_with_tokenizer(gpt2_dir, tmp_path_factory.mktemp("serving") / "gpt2-bpe")
