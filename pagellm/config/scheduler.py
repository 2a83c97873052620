"""Config stage: the continuous-batching scheduler's limits and policy."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pagellm.config.validation import check_int
from pagellm.errors import ConfigError

SchedulingPolicy = Literal["fcfs", "priority", "shortest-remaining"]
PreemptionMode = Literal["recompute", "swap"]

SCHEDULING_POLICIES: tuple[str, ...] = ("fcfs", "priority", "shortest-remaining")
PREEMPTION_MODES: tuple[str, ...] = ("recompute", "swap")
# The step's token budget when the user sets none and prefills may be chunked.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
# Background tokens per step when the user sets none (chosen by benchmarks/batch_priority.py).
DEFAULT_BACKGROUND_TOKEN_BUDGET = 16


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """Limits and policy of the continuous-batching scheduler.

    max_num_batched_tokens is the token budget of one forward pass; max_num_seqs caps the
    number of running requests. Without chunked prefill a prompt is only ever scheduled
    whole, so the budget must be able to hold the longest possible one.
    """

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int
    enable_chunked_prefill: bool = True
    scheduling_policy: SchedulingPolicy = "fcfs"
    preemption_mode: PreemptionMode = "recompute"
    max_num_partial_prefills: int | None = None
    long_prefill_token_threshold: int | None = None
    prefill_share: float = 1.0
    # Tokens background requests (batch lines) may take per step, so that a step never
    # grows long on their account: an interactive request arriving waits for at most such
    # a step. None: the whole step budget.
    background_token_budget: int | None = None
    # LoRA: the most distinct adapters in one step (the slots beside the model); None: LoRA off.
    max_loras: int | None = None
    # Multi-step decoding: while every running request decodes and nothing waits, each
    # computes up to this many positions per step, sampling and feeding back in the runner.
    num_scheduler_steps: int = 1

    def __post_init__(self) -> None:
        check_int("SchedulerConfig", "max_num_seqs", self.max_num_seqs, 1)
        check_int("SchedulerConfig", "num_scheduler_steps", self.num_scheduler_steps, 1)
        if self.max_loras is not None:
            check_int("SchedulerConfig", "max_loras", self.max_loras, 1)
        if self.background_token_budget is not None:
            check_int("SchedulerConfig", "background_token_budget", self.background_token_budget, 1)
        if self.max_num_partial_prefills is not None:
            check_int("SchedulerConfig", "max_num_partial_prefills", self.max_num_partial_prefills, 1)
        if self.long_prefill_token_threshold is not None:
            check_int("SchedulerConfig", "long_prefill_token_threshold", self.long_prefill_token_threshold, 1)
        if isinstance(self.prefill_share, bool) or not isinstance(self.prefill_share, (int, float)):
            raise ConfigError(f"SchedulerConfig.prefill_share must be a number, got {self.prefill_share!r}.")
        if not 0.0 < self.prefill_share <= 1.0:
            raise ConfigError(
                f"SchedulerConfig.prefill_share must be in (0, 1], got {self.prefill_share} "
                "(0 would starve new requests while any request decodes)."
            )
        check_int("SchedulerConfig", "max_num_batched_tokens", self.max_num_batched_tokens, 1)
        check_int("SchedulerConfig", "max_model_len", self.max_model_len, 1)
        if not isinstance(self.enable_chunked_prefill, bool):
            raise ConfigError(
                "SchedulerConfig.enable_chunked_prefill must be a bool, "
                f"got {self.enable_chunked_prefill!r}."
            )
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ConfigError(
                f"SchedulerConfig.scheduling_policy must be one of {SCHEDULING_POLICIES}, "
                f"got {self.scheduling_policy!r}."
            )
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ConfigError(
                f"SchedulerConfig.preemption_mode must be one of {PREEMPTION_MODES}, "
                f"got {self.preemption_mode!r}."
            )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ConfigError(
                "With chunked prefill disabled a prompt is scheduled whole, so "
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least "
                f"max_model_len ({self.max_model_len}). Raise max_num_batched_tokens, lower "
                "max_model_len, or enable chunked prefill."
            )
        if (
            not self.enable_chunked_prefill
            and self.background_token_budget is not None
            and self.background_token_budget < self.max_model_len
        ):
            raise ConfigError(
                "With chunked prefill disabled a background prompt is scheduled whole, so "
                f"background_token_budget ({self.background_token_budget}) must be at least "
                f"max_model_len ({self.max_model_len}), or chunked prefill enabled."
            )
        if not self.enable_chunked_prefill and self.balances_prefill:
            raise ConfigError(
                "max_num_partial_prefills, long_prefill_token_threshold and prefill_share < 1 "
                "split prefills over steps: they need chunked prefill enabled."
            )

    @property
    def balances_prefill(self) -> bool:
        """Whether any prefill/decode balance knob is set away from 'no limit'."""
        return (
            self.max_num_partial_prefills is not None
            or self.long_prefill_token_threshold is not None
            or self.prefill_share < 1.0
        )
