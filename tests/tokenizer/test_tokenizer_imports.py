"""The tokenizer package must not depend on transformers (it is only the tests' reference)."""

from __future__ import annotations

import subprocess
import sys


def test_tokenizer_package_does_not_import_transformers() -> None:
    code = (
        "import sys, pagellm.tokenizer, pagellm.tokenizer.gguf_tokenizer, pagellm.tokenizer.hf_tokenizer; "
        "print('transformers' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"
