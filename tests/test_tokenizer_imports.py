"""Gateways import the tokenizer package without torch or transformers installed."""

import subprocess
import sys


def test_tokenizer_package_imports_neither_torch_nor_transformers() -> None:
    code = (
        "import sys, ember_core.tokenizer;"
        "heavy = sorted({'torch', 'transformers', 'tokenizers', 'gguf'} & set(sys.modules));"
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
