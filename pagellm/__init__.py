"""pagellm: LLM inference with continuous batching over a paged KV cache.

The public names are imported lazily so that `import pagellm.core` (pure Python) does
not drag in torch and the model stack.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagellm.config.engine_args import EngineArgs
    from pagellm.entrypoints.llm import LLM
    from pagellm.lora.request import LoRARequest
    from pagellm.outputs import CompletionOutput, EmbeddingRequestOutput, RequestOutput, ScoringRequestOutput
    from pagellm.pooling_params import PoolingParams
    from pagellm.sampling_params import SamplingParams
    from pagellm.structured_outputs_params import StructuredOutputsParams

__all__ = [
    "LLM", "EngineArgs", "SamplingParams", "StructuredOutputsParams", "PoolingParams", "RequestOutput",
    "CompletionOutput", "EmbeddingRequestOutput", "ScoringRequestOutput", "LoRARequest",
]  # fmt: skip

_LOCATIONS = {
    "LLM": "pagellm.entrypoints.llm",
    "EngineArgs": "pagellm.config.engine_args",
    "SamplingParams": "pagellm.sampling_params",
    "StructuredOutputsParams": "pagellm.structured_outputs_params",
    "RequestOutput": "pagellm.outputs",
    "CompletionOutput": "pagellm.outputs",
    "PoolingParams": "pagellm.pooling_params",
    "EmbeddingRequestOutput": "pagellm.outputs",
    "ScoringRequestOutput": "pagellm.outputs",
    "LoRARequest": "pagellm.lora.request",
}


def __getattr__(name: str) -> Any:
    if name == "__version__":  # read on first use: importlib.metadata costs ~20 ms to import
        from pagellm.version import package_version

        return package_version()
    if name in _LOCATIONS:
        return getattr(importlib.import_module(_LOCATIONS[name]), name)
    raise AttributeError(f"module 'pagellm' has no attribute {name!r}")
