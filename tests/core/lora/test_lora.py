"""LoRA adapters against transformers + PEFT in float32, on random checkpoints with random adapters:
greedy tokens alone, and in one batch that mixes adapters and the base model; the prefix cache never
hands one adapter's blocks to another; bad adapters are refused with nothing loaded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ember_bench.gguf_export import export_gguf
from ember_core import LLM, LoRARequest
from ember_core.engine.intake import RequestRejected
from tests.conftest import assert_pool_free
from tests.core.lora.peft_reference import ADAPTERS, ATTENTION, GREEDY, PROMPT_LENGTHS, peft_greedy, write_adapter
from tests.families import FAMILIES, token_prompts, write_checkpoint

# phi3's checkpoint fuses q, k, v and gate, up; GPT-2's are c_attn and c_fc, its two c_proj told apart
_RENAMED_TARGETS = {
    "phi3": {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"},
    "gpt2": {"q_proj": "c_attn", "k_proj": "c_attn", "v_proj": "c_attn", "o_proj": "attn.c_proj", "gate_proj": "c_fc",
             "up_proj": "c_fc", "down_proj": "mlp.c_proj"},
}  # fmt: skip


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """Each family's checkpoint and its adapters, one of them over the output head; phi3 has fused qkv
    and gate/up in its checkpoint, GPT-2 its Conv1D c_attn and c_fc, the mixtures of experts adapt
    their attention, and qwen2_moe its shared expert (routed experts take none)."""
    family = request.param
    root = tmp_path_factory.mktemp(f"lora-{family}")
    write_checkpoint(family, root / "base")
    adapters = []
    for index, (rank, targets, rslora) in enumerate(ADAPTERS):
        if family in _RENAMED_TARGETS:
            targets = sorted({_RENAMED_TARGETS[family].get(t, t) for t in targets})
        if family in ("mixtral", "qwen3_moe", "olmoe"):  # q_proj.. and gate_proj.. of qwen2_moe: its attention and shared expert
            targets = [t for t in targets if t in ATTENTION or t == "lm_head"]
        write_adapter(root / "base", root / f"adapter{index}", rank, targets, rslora, seed=index)
        adapters.append(LoRARequest(f"{family}-{index}", index + 1, str(root / f"adapter{index}")))
    return root / "base", adapters


def test_each_adapter_alone_and_all_mixed_with_the_base_equal_peft(served) -> None:
    model_dir, adapters = served
    prompts = token_prompts(PROMPT_LENGTHS)
    choices = [None, *adapters]
    expected = {
        (c.lora_name if c else "", i): peft_greedy(model_dir, Path(c.lora_path) if c else None, p)
        for c in choices for i, p in enumerate(prompts)
    }  # fmt: skip
    # the adapters change the tokens, or this test could not tell them from the base
    outputs = {c: tuple(tuple(expected[(c.lora_name if c else "", i)]) for i in range(len(prompts))) for c in choices}
    assert len(set(outputs.values())) == len(choices)
    llm = LLM(str(model_dir), num_blocks=512, block_size=4, device="cpu", dtype="float32", enable_lora=True, max_loras=4)
    for choice in choices:
        alone = [llm.generate([p], GREEDY, lora_request=choice)[0].token_ids for p in prompts]
        assert alone == [expected[(choice.lora_name if choice else "", i)] for i in range(len(prompts))], choice
    mixed_prompts = [p for _ in choices for p in prompts]
    mixed_requests = [c for c in choices for _ in prompts]
    mixed = [o.token_ids for o in llm.generate(mixed_prompts, GREEDY, lora_request=mixed_requests)]
    assert mixed == [expected[(c.lora_name if c else "", i % len(prompts))] for i, c in enumerate(mixed_requests)]
    assert_pool_free(llm)


def test_the_prefix_cache_is_kept_apart_by_adapter(served) -> None:
    model_dir, adapters = served
    llm = LLM(str(model_dir), num_blocks=256, block_size=4, device="cpu", dtype="float32", enable_lora=True)
    prompt = token_prompts((40,))[0]
    first = llm.generate([prompt], GREEDY, lora_request=adapters[0])[0].token_ids
    hits = llm.stats().num_prefix_cache_hits
    base = llm.generate([prompt], GREEDY)[0].token_ids
    assert llm.stats().num_prefix_cache_hits == hits  # the base model found none of the adapter's blocks
    assert llm.generate([prompt], GREEDY, lora_request=adapters[0])[0].token_ids == first
    assert llm.stats().num_prefix_cache_hits > hits  # its own, it finds
    assert base != first


def test_bad_adapters_are_refused_and_leave_nothing_loaded(served, tmp_path: Path) -> None:
    model_dir, adapters = served
    llm = LLM(str(model_dir), num_blocks=64, block_size=4, device="cpu", dtype="float32", enable_lora=True, max_lora_rank=8)
    with pytest.raises(ValueError, match="rank 16, above"):
        llm.engine.add_adapter("big", adapters[2].lora_path)
    with pytest.raises(ValueError, match="not a PEFT checkpoint"):
        llm.engine.add_adapter("empty", str(tmp_path))
    config = json.loads((Path(adapters[0].lora_path) / "adapter_config.json").read_text())
    (tmp_path / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(ValueError, match="DoRA"):
        llm.engine.add_adapter("dora", str(tmp_path))
    with pytest.raises(ValueError, match="does not exist"):
        llm.engine.add_adapter("nowhere", "/no/such/adapter")
    with pytest.raises(ValueError, match="does not exist"):
        llm.generate([[5, 6]], GREEDY, lora_request=LoRARequest("missing", 9, "/no/such/adapter"))
    assert llm.engine.adapters.names == []
    with pytest.raises(RequestRejected, match="no LoRA adapter 'missing'"):
        llm.engine.add_request("unknown", [5, 6], GREEDY, adapter="missing")


@pytest.fixture(scope="module")
def llama_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Path], list[LoRARequest]]:
    """A llama checkpoint, its GGUF files (F32, and Q8_0 blocks), and two adapters over it, one of
    them over the head too."""
    root = tmp_path_factory.mktemp("lora-gguf")
    write_checkpoint("llama", root / "base")
    files = {kind: export_gguf(root / "base", root / f"model-{kind}.gguf", kind) for kind in ("F32", "Q8_0")}
    adapters = []
    for index, (rank, targets, rslora) in enumerate([ADAPTERS[0], ADAPTERS[3]]):
        write_adapter(root / "base", root / f"adapter{index}", rank, targets, rslora, seed=10 + index)
        adapters.append(LoRARequest(f"gguf-{index}", index + 1, str(root / f"adapter{index}")))
    return root / "base", files, adapters


def test_an_adapter_over_a_gguf_file_equals_peft_over_its_checkpoint(llama_files) -> None:
    """The F32 file holds the checkpoint's values (its q and k rows permuted as llama.cpp stores them)."""
    model_dir, files, adapters = llama_files
    prompts = token_prompts(PROMPT_LENGTHS)
    llm = LLM(str(files["F32"]), num_blocks=256, block_size=4, device="cpu", dtype="float32", enable_lora=True)
    for adapter in adapters:
        expected = [peft_greedy(model_dir, Path(adapter.lora_path), p) for p in prompts]
        assert [o.token_ids for o in llm.generate(prompts, GREEDY, lora_request=adapter)] == expected


@pytest.mark.parametrize(("dtype", "numerics"), [("float32", "exact"), ("float32", "fast"), ("bfloat16", "exact")])
def test_adapters_over_quantized_blocks_are_batch_invariant(llama_files, dtype: str, numerics: str) -> None:
    _, files, adapters = llama_files
    prompts = token_prompts(PROMPT_LENGTHS)
    llm = LLM(str(files["Q8_0"]), num_blocks=512, block_size=4, device="cpu", dtype=dtype, numerics=numerics,
              enable_lora=True)  # fmt: skip
    choices = [None, *adapters]
    alone = {(i, j): llm.generate([p], GREEDY, lora_request=c)[0].token_ids for i, c in enumerate(choices) for j, p in enumerate(prompts)}
    mixed = llm.generate([p for _ in choices for p in prompts], GREEDY, lora_request=[c for c in choices for _ in prompts])
    assert [o.token_ids for o in mixed] == [alone[(i, j)] for i in range(len(choices)) for j in range(len(prompts))]
    assert len({tuple(alone[(i, len(prompts) - 1)]) for i in range(len(choices))}) == len(choices)
    assert_pool_free(llm)


def test_past_max_loras_adapters_take_turns_and_every_request_finishes(served) -> None:
    """One slot, three adapters and the base in one batch: each adapter's requests wait for the slot
    (least recently used first), none fails, and each gets its tokens alone."""
    model_dir, adapters = served
    prompts = token_prompts((5, 23))
    llm = LLM(str(model_dir), num_blocks=256, block_size=4, device="cpu", dtype="float32", enable_lora=True, max_loras=1)
    choices = [None, *adapters]
    alone = {(i, j): llm.generate([p], GREEDY, lora_request=c)[0].token_ids for i, c in enumerate(choices) for j, p in enumerate(prompts)}
    mixed = llm.generate([p for _ in choices for p in prompts], GREEDY, lora_request=[c for c in choices for _ in prompts])
    assert [o.token_ids for o in mixed] == [alone[(i, j)] for i in range(len(choices)) for j in range(len(prompts))]
    assert sorted(llm.engine.adapters.names) == sorted(a.lora_name for a in adapters)
    assert_pool_free(llm)
