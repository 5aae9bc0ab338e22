"""Embeddings against transformers' final hidden states (after the final norm) with random weights, in
float32: last-token and mean pooling, alone and batched, in one chunk or many; sentence-transformers'
pooling files read; Matryoshka truncation; and embedding requests beside generation in the same steps."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest
import torch
import transformers

from ember_bench.gguf_export import export_gguf
from ember_core import LLM, SamplingParams
from ember_core.engine.engine import RequestRejected
from ember_core.pooling import PoolingConfig, read_pooling_config
from ember_proto import EmbedOptions, FinishReason
from tests.conftest import assert_pool_free
from tests.families import token_prompts, write_checkpoint

COSINE = 0.9999
PROMPT_LENGTHS = (1, 9, 70, 150)  # 150 > SMALL_BATCH_ROWS: the batched SDPA prefill path
ST_POOLING = {"last": "pooling_mode_lasttoken", "mean": "pooling_mode_mean_tokens", "cls": "pooling_mode_cls_token"}


def write_sentence_transformers_files(model_dir: Path, pooling: str, normalize: bool = True) -> None:
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (model_dir / "modules.json").write_text(json.dumps(modules))
    (model_dir / "1_Pooling").mkdir(exist_ok=True)
    flags = {flag: flag == ST_POOLING[pooling] for flag in ST_POOLING.values()}
    (model_dir / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64, **flags}))


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, transformers.PreTrainedModel]:
    model_dir = tmp_path_factory.mktemp(request.param)
    return model_dir, write_checkpoint(request.param, model_dir)


def _reference(model: transformers.PreTrainedModel, prompt: list[int], pooling: str) -> torch.Tensor:
    with torch.no_grad():
        hidden = model(torch.tensor([prompt]), output_hidden_states=True).hidden_states[-1][0]
    pooled = {"last": hidden[-1], "mean": hidden.mean(dim=0), "cls": hidden[0]}[pooling]
    return torch.nn.functional.normalize(pooled, dim=0)


def _cosines(embeddings: list[list[float]], expected: list[torch.Tensor]) -> list[float]:
    return [torch.nn.functional.cosine_similarity(torch.tensor(e), x, dim=0).item() for e, x in zip(embeddings, expected)]


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_embeddings_equal_transformers_hidden_states_alone_batched_and_chunked(checkpoint, pooling: str) -> None:
    model_dir, hf_model = checkpoint
    write_sentence_transformers_files(model_dir, pooling)
    prompts = token_prompts(PROMPT_LENGTHS)
    expected = [_reference(hf_model, prompt, pooling) for prompt in prompts]
    whole = LLM(str(model_dir), num_blocks=256, block_size=4, device="cpu", dtype="float32")
    chunked = LLM(str(model_dir), num_blocks=256, block_size=4, device="cpu", dtype="float32", max_num_batched_tokens=32)
    assert whole.engine.loaded.pooling == PoolingConfig(pooling, normalize=True)
    alone = [whole.embed([prompt])[0].embedding for prompt in prompts]
    batched = [output.embedding for output in whole.embed(prompts)]
    in_chunks = [output.embedding for output in chunked.embed(prompts)]
    for embeddings in (alone, batched, in_chunks):
        assert min(_cosines(embeddings, expected)) >= COSINE
        assert all(abs(torch.tensor(e).norm().item() - 1) < 1e-5 for e in embeddings)
    assert_pool_free(whole)
    assert_pool_free(chunked)


def test_preempted_embedding_requests_recompute_to_the_same_vectors(checkpoint) -> None:
    model_dir, _ = checkpoint
    write_sentence_transformers_files(model_dir, "mean")
    prompts = token_prompts((60, 56), seed=3)
    roomy = LLM(str(model_dir), num_blocks=256, block_size=4, device="cpu", dtype="float32")
    expected = [torch.tensor(output.embedding) for output in roomy.embed(prompts)]
    # Six generations growing a block every four steps each beside two 15-block prompts computed 10
    # tokens a step in a pool of 30 blocks: the youngest requests, the embeddings, are preempted mid-prompt.
    squeezed = LLM(str(model_dir), num_blocks=30, block_size=4, device="cpu", dtype="float32", max_num_batched_tokens=16)
    engine = squeezed.engine
    for index, prompt in enumerate(token_prompts((3,) * 6, seed=4)):
        engine.add_request(f"gen-{index}", prompt, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
    for index, prompt in enumerate(prompts):
        engine.add_request(f"emb-{index}", prompt, SamplingParams(max_tokens=0), embed=EmbedOptions())
    sequences = [engine._sequences[f"emb-{index}"] for index in range(len(prompts))]
    embedded, restarted = {}, False
    while engine.has_unfinished():
        computed = [seq.num_computed_tokens for seq in sequences]
        embedded.update({d.request_id: d.embedding for d in engine.step() if d.request_id.startswith("emb")})
        restarted |= any(seq.num_computed_tokens < before for seq, before in zip(sequences, computed))
    assert restarted
    vectors = [torch.frombuffer(bytearray(embedded[f"emb-{index}"]), dtype=torch.float32) for index in range(2)]
    assert min(_cosines([v.tolist() for v in vectors], expected)) >= COSINE
    assert_pool_free(squeezed)


def test_a_gguf_files_pooling_type_is_its_pooling(checkpoint, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model_dir, hf_model = checkpoint
    add_file_type = gguf.GGUFWriter.add_file_type

    def with_mean_pooling(writer: gguf.GGUFWriter, file_type: int) -> None:
        add_file_type(writer, file_type)
        writer.add_pooling_type(gguf.PoolingType.MEAN)

    monkeypatch.setattr(gguf.GGUFWriter, "add_file_type", with_mean_pooling)
    path = export_gguf(model_dir, tmp_path / "model.gguf")
    llm = LLM(str(path), num_blocks=64, device="cpu", dtype="float32")
    assert llm.engine.loaded.pooling == PoolingConfig("mean")
    prompt = token_prompts((20,))[0]
    assert min(_cosines([llm.embed([prompt])[0].embedding], [_reference(hf_model, prompt, "mean")])) >= COSINE


def test_last_token_pooling_reuses_the_prefix_cache_and_gives_the_same_embedding(checkpoint) -> None:
    model_dir, hf_model = checkpoint
    write_sentence_transformers_files(model_dir, "last")
    prompt = token_prompts((70,))[0]
    llm = LLM(str(model_dir), num_blocks=256, block_size=4, device="cpu", dtype="float32")
    first = llm.embed([prompt])[0].embedding
    second = llm.embed([prompt])[0].embedding
    assert llm.stats().num_prefix_cache_hits > 0
    assert min(_cosines([first, second], [_reference(hf_model, prompt, "last")] * 2)) >= COSINE


def test_embedding_requests_beside_generation_leave_its_tokens_and_free_every_block(checkpoint) -> None:
    model_dir, _ = checkpoint
    write_sentence_transformers_files(model_dir, "mean")
    prompts = token_prompts((5, 40, 90, 17), seed=7)
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    llm = LLM(str(model_dir), num_blocks=256, block_size=4, device="cpu", dtype="float32", max_num_batched_tokens=48)
    expected = [output.token_ids for output in llm.generate(prompts, greedy)]
    engine = llm.engine
    for index, prompt in enumerate(prompts):
        engine.add_request(f"gen-{index}", prompt, greedy)
        engine.add_request(f"emb-{index}", prompt, SamplingParams(max_tokens=0), embed=EmbedOptions())
    tokens: dict[str, list[int]] = {f"gen-{index}": [] for index in range(len(prompts))}
    embedded, mixed_steps = {}, 0
    while engine.has_unfinished():
        running = {seq.request_id[:3] for seq in engine.scheduler.running.values()}
        mixed_steps += running == {"gen", "emb"}
        for delta in engine.step():
            if delta.request_id.startswith("gen"):
                tokens[delta.request_id] += delta.new_token_ids
            else:
                assert (delta.finish_reason, delta.new_token_ids) == (FinishReason.STOP, [])
                embedded[delta.request_id] = delta.embedding
    assert mixed_steps > 0
    assert [tokens[f"gen-{index}"] for index in range(len(prompts))] == expected
    assert all(len(embedding) == 4 * 64 for embedding in embedded.values())
    assert_pool_free(llm)


def test_dimensions_truncate_a_matryoshka_model_and_are_refused_elsewhere(checkpoint, tmp_path: Path) -> None:
    model_dir, _ = checkpoint
    write_sentence_transformers_files(model_dir, "last")
    prompt = token_prompts((12,))[0]
    plain = LLM(str(model_dir), num_blocks=64, device="cpu", dtype="float32")
    with pytest.raises(RequestRejected, match="not a Matryoshka model"):
        plain.embed([prompt], dimensions=16)
    full = plain.embed([prompt])[0].embedding
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "matryoshka_dimensions": [16, 32, 64]}))
    try:
        matryoshka = LLM(str(model_dir), num_blocks=64, device="cpu", dtype="float32")
        truncated = matryoshka.embed([prompt], dimensions=16)[0].embedding
        with pytest.raises(RequestRejected, match=r"one of \[16, 32, 64\]"):
            matryoshka.embed([prompt], dimensions=20)
    finally:
        (model_dir / "config.json").write_text(json.dumps(config))
    assert len(truncated) == 16
    assert truncated == pytest.approx(torch.nn.functional.normalize(torch.tensor(full[:16]), dim=0).tolist(), abs=1e-6)


def test_an_embed_engine_refuses_generation(checkpoint) -> None:
    model_dir, _ = checkpoint
    llm = LLM(str(model_dir), num_blocks=64, device="cpu", dtype="float32", task="embed")
    with pytest.raises(RequestRejected, match="embeddings only"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2))
    assert len(llm.embed([[5, 6, 7]])[0].embedding) == 64


def test_pooling_config_from_sentence_transformers_files_and_config_json(tmp_path: Path) -> None:
    assert read_pooling_config(tmp_path, {}) == PoolingConfig("last", normalize=True, matryoshka_dimensions=None)
    write_sentence_transformers_files(tmp_path, "cls", normalize=False)
    assert read_pooling_config(tmp_path, {"is_matryoshka": True}) == PoolingConfig("cls", False, ())
    assert read_pooling_config(None, {}, "mean") == PoolingConfig("mean", True, None)
