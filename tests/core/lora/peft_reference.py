"""Random PEFT adapters over random checkpoints, and transformers + PEFT's greedy tokens: the
reference the LoRA tests compare ember with."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers
from peft import LoraConfig, PeftModel, get_peft_model

from ember_core import SamplingParams

MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
# 150 rows: past the fused decoder layer's 128, so prefill runs layer by layer too.
PROMPT_LENGTHS = (5, 23, 150)
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
# (rank, targets, rsLoRA) of the adapters each family serves at once
ADAPTERS = [
    (8, ATTENTION + MLP, False), (4, ["q_proj", "v_proj"], True), (16, ["k_proj", "down_proj", "up_proj"], False),
    (6, ["lm_head", "o_proj", "gate_proj"], False),
]  # fmt: skip


def write_adapter(model_dir: Path, path: Path, rank: int, targets: list[str], rslora: bool, seed: int) -> None:
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    torch.manual_seed(seed)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, use_rslora=rslora, init_lora_weights=False)
    adapted = get_peft_model(base, config)
    with torch.no_grad():  # B and A of the size a trained adapter's delta has against these weights
        for name, param in adapted.named_parameters():
            if "lora_" in name:
                param.normal_(0.0, 0.3 / rank**0.5)
    adapted.save_pretrained(path)


def peft_greedy(model_dir: Path, adapter: Path | None, prompt: list[int]) -> list[int]:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter).eval()
    generation = transformers.GenerationConfig(do_sample=False, max_new_tokens=MAX_TOKENS, eos_token_id=[], pad_token_id=0)
    with torch.no_grad():
        ids = torch.tensor([prompt])
        return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=generation)[
            0, len(prompt) :
        ].tolist()
