"""Entrypoints stage: CLI: the limits `pagellm serve` puts on client-controlled input, and
their flags (argparse only: `pagellm --help` imports no web framework).

Each limit has a default and a flag; request_limits.py applies them.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields

from pagellm.errors import ConfigError

MAX_N = 128  # completions per request; n is a real cost multiplier, so it is bounded


@dataclass(frozen=True)
class RequestLimits:
    max_request_body_bytes: int = 16 * 1024 * 1024
    max_prompts_per_request: int = 256
    max_n: int = MAX_N
    max_stop_strings: int = 16
    max_stop_string_length: int = 1024
    max_logit_bias_entries: int = 1024
    max_messages: int = 4096
    max_message_chars: int = 4 * 1024 * 1024
    max_stored_responses: int = 1024
    max_batch_file_bytes: int = 200 * 1024 * 1024  # OpenAI's limit for a batch input file

    def __post_init__(self) -> None:
        for field in fields(self):
            if getattr(self, field.name) < 1:
                raise ConfigError(f"--{field.name.replace('_', '-')} must be at least 1, got {getattr(self, field.name)}")
        if self.max_n > MAX_N:
            raise ConfigError(f"--max-n must be at most {MAX_N}, got {self.max_n}")

    @classmethod
    def from_namespace(cls, args: argparse.Namespace) -> RequestLimits:
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if getattr(args, f.name, None) is not None})


def add_limit_args(parser: argparse.ArgumentParser) -> None:
    defaults = RequestLimits()
    helps = {
        "max_request_body_bytes": "largest request body in bytes; larger ones get 413",
        "max_prompts_per_request": "most prompts in one /v1/completions request",
        "max_n": f"largest n (completions per request, at most {MAX_N})",
        "max_stop_strings": "most stop strings (and stop_token_ids) in a request",
        "max_stop_string_length": "longest stop string, in characters",
        "max_logit_bias_entries": "most logit_bias entries in a request",
        "max_messages": "most messages in a chat request",
        "max_message_chars": "most characters of content in one chat message, and in one text prompt or input",
        "max_stored_responses": "most responses kept in memory for GET /v1/responses/{id} and previous_response_id "
        "(the oldest is evicted first)",
        "max_batch_file_bytes": "largest file POST /v1/files takes, in bytes (the body limit there)",
    }
    for field in fields(RequestLimits):
        parser.add_argument(
            "--" + field.name.replace("_", "-"),
            type=int,
            default=None,
            help=f"{helps[field.name]} (default: {getattr(defaults, field.name)})",
        )
