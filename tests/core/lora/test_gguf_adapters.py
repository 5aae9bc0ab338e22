"""llama.cpp's LoRA GGUF adapters (convert_lora_to_gguf.py's format, written here by ember_bench's
exporter, which writes that script's bytes) against transformers + PEFT in float32: over the GGUF
file of the checkpoint and over the checkpoint itself, llama's q and k rows interleaved or not
(qwen2); files that are not such adapters, or are for another architecture, are refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from ember_bench.gguf_export import export_gguf
from ember_bench.gguf_lora_export import export_lora_gguf
from ember_core import LLM, LoRARequest
from tests.core.lora.peft_reference import ADAPTERS, GREEDY, PROMPT_LENGTHS, peft_greedy, write_adapter
from tests.families import GGUF_OVERRIDES, token_prompts, write_checkpoint


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def converted(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, list[Path]]:
    """A checkpoint, its F32 GGUF file, and PEFT adapters over it (one over the head) with their
    F32 GGUF conversions beside them."""
    root = tmp_path_factory.mktemp(f"gguf-lora-{request.param}")
    write_checkpoint(request.param, root / "base", **{**GGUF_OVERRIDES.get(request.param, {}), "tie_word_embeddings": False})
    model_file = export_gguf(root / "base", root / "model-F32.gguf", "F32")
    adapters = []
    for index, (rank, targets, rslora) in enumerate([ADAPTERS[0], ADAPTERS[3]]):
        write_adapter(root / "base", root / f"adapter{index}", rank, targets, rslora, seed=20 + index)
        adapters.append(export_lora_gguf(root / f"adapter{index}", root / "base", root / f"adapter{index}.gguf", "F32"))
    return root / "base", model_file, adapters


@pytest.mark.parametrize("model", ["gguf", "checkpoint"])
def test_a_gguf_adapter_equals_peft(converted, model: str) -> None:
    model_dir, model_file, adapter_files = converted
    prompts = token_prompts(PROMPT_LENGTHS)
    llm = LLM(str(model_file if model == "gguf" else model_dir), num_blocks=512, block_size=4, device="cpu",
              dtype="float32", enable_lora=True)  # fmt: skip
    requests = [LoRARequest(f"gguf-{i}", i + 1, str(path)) for i, path in enumerate(adapter_files)]
    expected = [[peft_greedy(model_dir, path.with_suffix(""), p) for p in prompts] for path in adapter_files]
    for request, tokens in zip(requests, expected):
        assert [o.token_ids for o in llm.generate(prompts, GREEDY, lora_request=request)] == tokens
    mixed = llm.generate([p for _ in requests for p in prompts], GREEDY, lora_request=[r for r in requests for _ in prompts])
    assert [o.token_ids for o in mixed] == [t for tokens in expected for t in tokens]
    assert expected[0] != expected[1]


def test_files_that_are_not_adapters_for_this_model_are_refused(converted, tmp_path: Path) -> None:
    model_dir, model_file, _ = converted
    other = "qwen2" if "llama" in str(model_dir) else "llama"
    write_checkpoint(other, tmp_path / "other", **GGUF_OVERRIDES.get(other, {}))
    write_adapter(tmp_path / "other", tmp_path / "other-adapter", 4, ["q_proj"], False, seed=1)
    foreign = export_lora_gguf(tmp_path / "other-adapter", tmp_path / "other", tmp_path / "other-adapter.gguf", "F32")
    llm = LLM(str(model_dir), num_blocks=64, block_size=4, device="cpu", dtype="float32", enable_lora=True)
    with pytest.raises(ValueError, match=f"is for a {other} model"):
        llm.engine.add_adapter("foreign", str(foreign))
    with pytest.raises(ValueError, match="not a llama.cpp LoRA adapter"):
        llm.engine.add_adapter("model", str(model_file))
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file")
    with pytest.raises(ValueError, match="not a GGUF file"):
        llm.engine.add_adapter("junk", str(tmp_path / "junk.gguf"))
    with pytest.raises(ValueError, match="does not exist"):
        llm.engine.add_adapter("nowhere", "/no/such/adapter.gguf")
    assert llm.engine.adapters.names == []
