"""Sim stage: `pagellm tune --num-gpus N`'s layouts: every way to deploy one model
on N GPUs as DP replicas of a TP-GPU group (TP x DP = N).

A layout is refused before any simulation when the model's heads cannot split over TP
(tensor_parallel.tp_split_error); one whose GPUs cannot hold the model's share, its
activations and the KV of one max_model_len request is refused when its engine
configuration resolves (target.resolve_engine_config), with the TP sizes that fit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagellm.errors import ConfigError
from pagellm.config.model import ModelConfig
from pagellm.sim.tensor_parallel_costs import tp_split_error


@dataclass(frozen=True)
class Layout:
    tensor_parallel_size: int
    data_parallel_size: int
    error: str | None = None  # why the model cannot be split this way (None: it can)

    @property
    def knobs(self) -> dict[str, int]:
        return {
            "tensor_parallel_size": self.tensor_parallel_size,
            "data_parallel_size": self.data_parallel_size,
        }


def enumerate_layouts(num_gpus: int, config: ModelConfig) -> list[Layout]:
    """Every (TP, DP) with TP x DP = num_gpus, widest TP first, each with the reason it
    cannot split (if any)."""
    if num_gpus < 1:
        raise ConfigError(f"--num-gpus must be at least 1, got {num_gpus}")
    layouts = []
    for tp in range(num_gpus, 0, -1):
        if num_gpus % tp == 0:
            layouts.append(Layout(tp, num_gpus // tp, tp_split_error(config, tp)))
    return layouts


def layout_label(tensor_parallel_size: int, data_parallel_size: int) -> str:
    """"TP=8", "2 x TP=4", "8 x TP=1": replicas times the GPUs of each."""
    group = f"TP={tensor_parallel_size}"
    return group if data_parallel_size == 1 else f"{data_parallel_size} x {group}"


def best_layout_line(record: dict[str, Any]) -> str | None:
    """The sentence naming the recommended layout of a --num-gpus run (None otherwise)."""
    num_gpus = record.get("num_gpus")
    recommended = record.get("recommended")
    if num_gpus is None or recommended is None:
        return None
    knobs = recommended["knobs"]
    tp, dp = knobs["tensor_parallel_size"], knobs["data_parallel_size"]
    refused = [
        layout_label(p["knobs"]["tensor_parallel_size"], p["knobs"]["data_parallel_size"])
        for p in record["points"]
        if p["results"] is None
    ]
    line = f"best layout for {num_gpus} GPUs: {layout_label(tp, dp)}"
    line += f" ({dp} replica{'s' if dp > 1 else ''} of {tp} GPU{'s' if tp > 1 else ''})"
    if not recommended["meets_goal"]:
        line += ", the closest to the goal (none meets it)"
    if refused:
        line += f"; refused: {', '.join(dict.fromkeys(refused))}"
    return line
