"""Worker stage: for tests only: make chosen steps raise, to test what a failing step costs.

Off unless the environment variable PAGELLM_FAULT_INJECTION is set; never set it in
production. Its value is a comma-separated list of:

    rate=R      every step with work raises with probability R (seed=S seeds the draws)
    steps=A:B   the A-th, B-th, ... step with work raises (counted from 1)
    request=T   a step that computes a request whose id contains T raises
    hang=A:S    the A-th step with work blocks for S seconds before it runs (a stuck kernel)

The fault is raised inside the model runner just before the forward pass, after the
runner took in the step's new requests and blocks, as a failing kernel would.
"""

from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass

from pagellm.core.scheduler_output import SchedulerOutput
from pagellm.errors import ConfigError

ENV_VAR = "PAGELLM_FAULT_INJECTION"


class InjectedFault(RuntimeError):
    """The fault PAGELLM_FAULT_INJECTION asked for."""


@dataclass
class FaultInjector:
    rate: float = 0.0
    steps: frozenset[int] = frozenset()
    request: str | None = None
    seed: int = 0
    hang: tuple[int, float] | None = None  # (step, seconds)

    def __post_init__(self) -> None:
        self._random = random.Random(self.seed)
        self.num_steps = 0

    @classmethod
    def from_env(cls) -> FaultInjector | None:
        spec = os.environ.get(ENV_VAR, "").strip()
        if not spec:
            return None
        settings: dict[str, object] = {}
        for part in spec.split(","):
            key, _, value = part.strip().partition("=")
            try:
                if key == "rate":
                    settings["rate"] = float(value)
                elif key == "seed":
                    settings["seed"] = int(value)
                elif key == "steps":
                    settings["steps"] = frozenset(int(step) for step in value.split(":") if step)
                elif key == "request":
                    settings["request"] = value
                elif key == "hang":
                    step, _, seconds = value.partition(":")
                    settings["hang"] = (int(step), float(seconds))
                else:
                    raise ValueError(f"unknown key {key!r}")
            except ValueError as e:
                raise ConfigError(f"{ENV_VAR}={spec!r}: {e} (rate=R, seed=S, steps=A:B, request=TEXT, hang=STEP:SECONDS)") from None
        return cls(**settings)  # type: ignore[arg-type]

    def check(self, scheduler_output: SchedulerOutput) -> None:
        """Block (hang=) or raise InjectedFault where this step is one the settings name."""
        if not scheduler_output.num_scheduled_tokens:
            return
        self.num_steps += 1
        if self.hang is not None and self.num_steps == self.hang[0]:
            time.sleep(self.hang[1])
        failing = self.num_steps in self.steps or (self.rate > 0 and self._random.random() < self.rate)
        if self.request is not None:
            failing |= any(self.request in req_id for req_id in scheduler_output.num_scheduled_tokens)
        if failing:
            raise InjectedFault(f"injected fault in step {self.num_steps} ({ENV_VAR})")
