"""What processes import: gateways no torch, engines on CPU no torch._dynamo."""

import subprocess
import sys
from pathlib import Path


def test_tokenizer_package_imports_neither_torch_nor_transformers() -> None:
    code = (
        "import sys, ember_core.tokenizer;"
        "heavy = sorted({'torch', 'transformers', 'gguf'} & set(sys.modules));"
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_an_engine_on_cpu_never_imports_torch_dynamo(gpt2_dir: Path) -> None:
    """torch._dynamo costs ~2 s of every engine start; loading and serving chunked prompts on CPU
    (the lower-right causal mask) must not pull it in."""
    code = (
        "import sys; from ember_core import LLM, SamplingParams;"
        f"llm = LLM({str(gpt2_dir)!r}, device='cpu', dtype='float32', max_num_batched_tokens=16);"
        "llm.generate([list(range(1, 60)), list(range(1, 40))], SamplingParams(max_tokens=3));"
        "assert 'torch._dynamo' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
