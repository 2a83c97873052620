"""Worker stage: what the runner remembers of a request between steps.

Its own module because two parts of a step read it: the model runner, which keeps it, and
speculative verification (worker/spec_verification.py), which extends its tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagellm.lora.request import LoRARequest
from pagellm.pooling_params import PoolingParams
from pagellm.sampling_params import SamplingParams


@dataclass
class RunnerRequestState:
    """What the runner remembers of a request between steps."""

    token_ids: list[int]  # prompt + outputs so far
    num_prompt_tokens: int
    block_ids: list[list[int]]  # one table per KV cache group
    num_computed_tokens: int
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int]
    num_pending_forks: int = 0
    matcher: Any = None  # the output constraint's llguidance matcher (driver only)
    pooling_params: PoolingParams | None = None  # an embedding request: pooled, never sampled
    lora_request: LoRARequest | None = None  # the adapter its rows run under
    state_slot: int | None = None  # a hybrid model: its recurrent-state slot

    @property
    def lora_int_id(self) -> int:
        return 0 if self.lora_request is None else self.lora_request.lora_int_id

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens
