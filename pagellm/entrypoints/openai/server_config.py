"""Entrypoints stage: CLI: `pagellm serve`'s own settings as one frozen ServerConfig, and
their flags, generated from it (argparse only: `pagellm --help` imports no web framework).

The flags are the fields in order (the request limits, limits_config.py, and the engine's,
config/cli_args.py, follow them); `ServerConfig.from_namespace` checks everything once, so
the server, its replicas' command lines and the data-parallel router read typed values.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from pagellm.entrypoints.openai.api_key import API_KEY_ENV
from pagellm.entrypoints.openai.limits_config import RequestLimits
from pagellm.entrypoints.openai.reasoning import REASONING_FORMATS
from pagellm.errors import ConfigError

STRUCTURED_OUTPUTS_KEYS = ("enable_in_reasoning",)
DATA_PARALLEL_ROUTINGS = ("affinity", "load")


def structured_outputs_config(text: str) -> dict[str, bool]:
    """--structured-outputs-config: a JSON object of the keys this server reads."""
    try:
        config = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(config, dict):
        raise argparse.ArgumentTypeError("must be a JSON object, e.g. '{\"enable_in_reasoning\": true}'")
    unknown = sorted(set(config) - set(STRUCTURED_OUTPUTS_KEYS))
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown key(s) {', '.join(unknown)}; this server reads: {', '.join(STRUCTURED_OUTPUTS_KEYS)}"
        )
    if not isinstance(config.get("enable_in_reasoning", False), bool):
        raise argparse.ArgumentTypeError("enable_in_reasoning must be true or false")
    return config


@dataclass(frozen=True)
class ServerConfig:
    """Everything `pagellm serve` decides besides the engine's settings."""

    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    api_key: str | None = None  # None: the API is open
    max_num_queued_requests: int | None = None
    shutdown_timeout: float = 5.0
    # /health fails when requests are in flight and the engine has completed no step for
    # this long (0: never). Generous: one prefill step of a large model on a small CPU
    # takes minutes.
    health_stall_seconds: float = 300.0
    sleep_idle_seconds: float = 0.0  # > 0: the engine sleeps after this long without requests
    sleep_idle_level: int = 1
    enable_per_request_metrics: bool = False  # every answer carries `timings`
    data_parallel_size: int = 1
    data_parallel_routing: str = "affinity"
    reasoning_parser: str | None = None
    structured_outputs_config: Mapping[str, bool] | None = None
    batch_dir: str | None = None
    lora_modules: tuple[str, ...] = ()
    # Set by a data-parallel server on its replicas: it tags the ids of stored responses, so
    # that the router sends a follow-up (GET, previous_response_id) to the replica holding it.
    data_parallel_rank: int | None = None
    limits: RequestLimits = field(default_factory=RequestLimits)

    def __post_init__(self) -> None:
        if self.max_num_queued_requests is not None and self.max_num_queued_requests < 1:
            raise ConfigError(f"--max-num-queued-requests must be at least 1, got {self.max_num_queued_requests}")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"--port must be in [0, 65535], got {self.port}")
        if self.shutdown_timeout < 0:
            raise ConfigError(f"--shutdown-timeout must be >= 0, got {self.shutdown_timeout}")
        if self.sleep_idle_seconds < 0:
            raise ConfigError(f"--sleep-idle-seconds must be >= 0, got {self.sleep_idle_seconds}")
        if self.sleep_idle_level not in (1, 2):
            raise ConfigError(f"--sleep-idle-level must be 1 or 2, got {self.sleep_idle_level}")
        if self.health_stall_seconds < 0:
            raise ConfigError(f"--health-stall-seconds must be >= 0, got {self.health_stall_seconds}")
        if self.data_parallel_size < 1:
            raise ConfigError(f"--data-parallel-size must be at least 1, got {self.data_parallel_size}")
        if self.data_parallel_routing not in DATA_PARALLEL_ROUTINGS:
            raise ConfigError(f"--data-parallel-routing must be one of {DATA_PARALLEL_ROUTINGS}")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_FORMATS:
            raise ConfigError(f"--reasoning-parser must be one of {sorted(REASONING_FORMATS)}")

    @classmethod
    def from_namespace(cls, args: argparse.Namespace, environ: Mapping[str, str] = os.environ) -> ServerConfig:
        """The settings of parsed `pagellm serve` flags (the API key from the environment
        where no flag gives one); ConfigError names a bad one."""
        values = {f.name: getattr(args, f.name) for f in fields(cls) if f.name != "limits" and hasattr(args, f.name)}
        values["api_key"] = values.get("api_key") or environ.get(API_KEY_ENV) or None
        values["lora_modules"] = tuple(values.get("lora_modules") or ())
        return cls(**values, limits=RequestLimits.from_namespace(args))

    def check_engine(self, enable_lora: bool) -> None:
        """What these settings need of the engine's."""
        if self.lora_modules and not enable_lora:
            raise ConfigError("--lora-modules needs --enable-lora")
        if self.data_parallel_size > 1 and enable_lora:  # the router would load an adapter on one replica only
            raise ConfigError("--enable-lora with --data-parallel-size > 1 is not supported yet")

    @property
    def structured_outputs_in_reasoning(self) -> bool:
        return bool((self.structured_outputs_config or {}).get("enable_in_reasoning"))

    def replica(self, name: str, data_parallel_rank: int | None = None) -> ServerConfig:
        """A data-parallel replica's settings: the router's name for the model, no batches
        (the router runs them: each replica would run every batch in the directory), and
        the same limits and request handling."""
        return dataclasses.replace(
            self, served_model_name=name, batch_dir="none", data_parallel_size=1, data_parallel_rank=data_parallel_rank
        )

    def to_cli(self) -> list[str]:
        """The flags that give a replica these settings (not its address, which the launcher
        gives, nor the API key, which it reads from its environment)."""
        flags: list[str] = []
        for spec in SERVER_FLAGS:
            value = getattr(self, spec.name)
            if not spec.replicated or value is None or value == spec.default:
                continue
            if spec.action == "store_true":  # a switch: on, since it is not its default
                flags.append(spec.flag)
                continue
            flags += [spec.flag, json.dumps(dict(value)) if spec.name == "structured_outputs_config" else str(value)]
        for limit in fields(RequestLimits):  # each replica checks the limits
            value = getattr(self.limits, limit.name)
            if value != limit.default:
                flags += ["--" + limit.name.replace("_", "-"), str(value)]
        return flags


@dataclass(frozen=True)
class FlagSpec:
    """How one ServerConfig field is a flag."""

    name: str
    help: str
    type: Any = None
    default: Any = None
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    nargs: str | None = None
    action: str | None = None  # "store_true": a switch
    replicated: bool = True  # a data-parallel replica's command line carries it (to_cli)

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


_DEFAULTS = ServerConfig()
SERVER_FLAGS = (
    FlagSpec("host", "address to listen on", default=_DEFAULTS.host, replicated=False),
    FlagSpec("port", "port (0 = any free port)", int, _DEFAULTS.port, replicated=False),
    FlagSpec("served_model_name", "the model name clients use (default: the model file or folder name)"),
    FlagSpec("api_key", f"require 'Authorization: Bearer KEY' on the API (default: ${API_KEY_ENV})", replicated=False),
    FlagSpec("max_num_queued_requests", "most requests waiting for the batch; more get 503 (default: no limit)", int),
    FlagSpec(
        "shutdown_timeout",
        "seconds in-flight requests get to finish after SIGINT/SIGTERM before they are aborted (default: 5)",
        float, _DEFAULTS.shutdown_timeout,
    ),  # fmt: skip
    FlagSpec(
        "health_stall_seconds",
        "GET /health answers 503 (engine_stalled) when requests are in flight and no engine step "
        "has completed for this many seconds; 0 turns the check off (default: 300)",
        float, _DEFAULTS.health_stall_seconds,
    ),  # fmt: skip
    FlagSpec(
        "sleep_idle_seconds",
        "after this many seconds without requests the engine sleeps (frees its KV cache, and its weights "
        "at --sleep-idle-level 2); the next request wakes it and waits meanwhile (default: 0, never)",
        float, _DEFAULTS.sleep_idle_seconds,
    ),  # fmt: skip
    FlagSpec(
        "sleep_idle_level",
        "how deep the idle sleep goes: 1 frees the KV cache, 2 the weights too (reloaded on wake-up) (default: 1)",
        int, _DEFAULTS.sleep_idle_level,
    ),  # fmt: skip
    FlagSpec(
        "enable_per_request_metrics",
        "every answer carries `timings`: queue, prefill and decode time, time to first token, mean "
        "inter-token latency, cached tokens by source, preemptions, speculative acceptance (a request "
        "asks for them alone with \"timings\": true)",
        default=False, action="store_true",
    ),  # fmt: skip
    FlagSpec(
        "data_parallel_size",
        "engine replicas behind this endpoint, each with its own KV cache (and its own "
        "--tensor-parallel-size ranks); requests go by prefix-cache affinity, then load. With "
        "--distributed-executor-backend ray the replicas are placed on the Ray cluster (default: 1)",
        int, _DEFAULTS.data_parallel_size, replicated=False,
    ),  # fmt: skip
    FlagSpec(
        "data_parallel_routing",
        "how the replicas are chosen: affinity = prefix-cache affinity, then load; "
        "load = the least loaded replica only (default: affinity)",
        default=_DEFAULTS.data_parallel_routing, choices=DATA_PARALLEL_ROUTINGS, replicated=False,
    ),  # fmt: skip
    FlagSpec(
        "reasoning_parser",
        "split a thinking model's output: the text between its think tags goes to "
        "reasoning_content (chat), reasoning items (Responses) and thinking blocks (Messages) "
        "(default: none, all text is content)",
        choices=tuple(sorted(REASONING_FORMATS)),
    ),  # fmt: skip
    FlagSpec(
        "structured_outputs_config",
        """vLLM's option, as a JSON object; this server reads '{"enable_in_reasoning": true}': """
        "with --reasoning-parser, output constraints (response formats, tool calls) hold the "
        "think block too, from the first output token (default: they hold the answer after it)",
        structured_outputs_config, metavar="JSON",
    ),  # fmt: skip
    FlagSpec(
        "batch_dir",
        "where the Files and Batch API keep uploaded files and batches, so that a restart "
        "resumes unfinished batches; 'none' turns the API off (default: "
        "$PAGELLM_CACHE_DIR or ~/.cache/pagellm, then batches/<served model name>)",
        metavar="DIR",
    ),  # fmt: skip
    FlagSpec(
        "lora_modules",
        "LoRA adapters to serve from the start (with --enable-lora), each as name=path or "
        "{\"name\": ..., \"path\": ...}; requests select one by its name in `model`",
        default=[], metavar="NAME=PATH", nargs="+", replicated=False,
    ),  # fmt: skip
    FlagSpec("data_parallel_rank", argparse.SUPPRESS, int),
)
assert [spec.name for spec in SERVER_FLAGS] == [f.name for f in fields(ServerConfig) if f.name != "limits"]


def add_server_args(parser: argparse.ArgumentParser) -> None:
    """A flag per ServerConfig field, in field order."""
    for spec in SERVER_FLAGS:
        options: dict[str, Any] = {"default": spec.default, "help": spec.help}
        for key in ("type", "choices", "metavar", "nargs", "action"):
            if getattr(spec, key) is not None:
                options[key] = getattr(spec, key)
        parser.add_argument(spec.flag, **options)
