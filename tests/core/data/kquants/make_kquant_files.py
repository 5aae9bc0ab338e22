"""Writes the K-quant GGUF files of tests/core/loaders/test_kquant_files.py: small random checkpoints of three
families (tests/families.py), converted to F32 GGUF (ember_bench.gguf_export) and quantized by
llama.cpp's own `llama-quantize` to its Q4_K_M, Q5_K_M and Q3_K_M mixes, so the tests read the type
mix real files have: Q4_K/Q5_K/Q3_K beside Q6_K in the layers llama.cpp gives more bits, and where a
row is not a whole number of 256-value super-blocks (qwen2's 320), its fallbacks Q5_0, Q5_1, Q8_0.

    python -m tests.core.data.kquants.make_kquant_files --llama-cpp-dir DIR

DIR holds (or gets) the llama.cpp build of ember_bench.llama_server.build_llama_cpp.
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
from pathlib import Path

from ember_bench.gguf_export import export_gguf
from ember_bench.llama_server import build_llama_cpp
from tests.families import write_checkpoint

HERE = Path(__file__).parent
SHAPES = {
    "llama": {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
                  "attention_bias": False, "mlp_bias": False},
    "qwen2": {"hidden_size": 320, "intermediate_size": 512, "num_attention_heads": 5, "num_key_value_heads": 1,
                  "use_sliding_window": False},
    "qwen3_moe": {"hidden_size": 256, "moe_intermediate_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
                      "num_key_value_heads": 2, "head_dim": 64, "use_sliding_window": False},
}  # fmt: skip
COMMON = {"num_hidden_layers": 3, "max_position_embeddings": 4096}
MIXES = {"llama": ("Q4_K_M", "Q5_K_M", "Q3_K_M"), "qwen2": ("Q4_K_M",), "qwen3_moe": ("Q4_K_M",)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-cpp-dir", type=Path, required=True)
    quantize = build_llama_cpp(parser.parse_args().llama_cpp_dir, ("llama-quantize",)) / "llama-quantize"
    for family, shape in SHAPES.items():
        with tempfile.TemporaryDirectory() as scratch:
            checkpoint = Path(scratch) / family
            write_checkpoint(family, checkpoint, **COMMON, **shape)
            f32 = export_gguf(checkpoint, checkpoint / "model-F32.gguf", "F32")
            for mix in MIXES[family]:
                out = HERE / f"{family}-{mix}.gguf"
                subprocess.run([str(quantize), str(f32), str(out), mix], check=True, capture_output=True)
                print(out.name, out.stat().st_size)


if __name__ == "__main__":
    main()
