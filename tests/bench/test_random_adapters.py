"""`ember bench make-adapters`: random LoRA adapters shaped for a model, from its GGUF file, that
transformers + PEFT load onto the checkpoint and that change ember's greedy text, each its own way."""

from __future__ import annotations

from pathlib import Path

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from ember_bench.gguf_export import export_gguf
from ember_bench.random_models import random_checkpoint
from ember_core import LLM, LoRARequest, SamplingParams
from tests.bench.helpers import run_bench_cli


def test_adapters_for_a_gguf_model_load_in_peft_and_change_the_text(tmp_path: Path) -> None:
    model_dir = random_checkpoint("qwen2", tmp_path / "model", num_hidden_layers=2)
    gguf_file = export_gguf(model_dir, tmp_path / "model.gguf", "Q8_0")
    outs = [tmp_path / "a0", tmp_path / "a1"]
    assert run_bench_cli("make-adapters", "--model", str(gguf_file), "--rank", "4", "--targets", "q_proj,down_proj,lm_head",
                         "--out", *map(str, outs)) == 0  # fmt: skip
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    adapted = PeftModel.from_pretrained(base, outs[0])
    assert {name.split(".lora_")[0].rpartition(".")[2] for name, _ in adapted.named_parameters() if "lora_" in name} == {
        "q_proj", "down_proj", "lm_head"}  # fmt: skip
    llm = LLM(str(gguf_file), dtype="float32", num_blocks=32, enable_lora=True)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    requests = [None] + [LoRARequest(out.name, index + 1, str(out)) for index, out in enumerate(outs)]
    texts = [llm.generate(["Random adapters"], greedy, lora_request=request)[0].text for request in requests]
    assert len(set(texts)) == 3, texts


def test_an_unknown_target_is_one_line(tmp_path: Path, capsys) -> None:
    model_dir = random_checkpoint("llama", tmp_path / "model", num_hidden_layers=1)
    assert run_bench_cli("make-adapters", "--model", str(model_dir), "--targets", "q_proj,c_attn", "--out", str(tmp_path / "a")) == 2
    assert "has no c_attn to adapt" in capsys.readouterr().err
    assert not (tmp_path / "a").exists()
