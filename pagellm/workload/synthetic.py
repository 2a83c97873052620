"""Workload stage: synthetic request lists (prompt token ids +
exact output lengths).

Every backend gets the same list: prompts are random token ids (no tokenizer round
trip, so lengths are exact) and outputs run with ignore_eos to their exact length.
`pagellm simulate` draws its lengths from the same generators.
"""

from __future__ import annotations

import argparse
import math
import random
from collections.abc import Callable
from dataclasses import dataclass

from pagellm.errors import ConfigError

WORKLOADS = ("mixed", "fixed", "sharegpt", "shared-prefix", "multi-turn")
# The token that stands for a multi-turn conversation's earlier answers (the simulator's
# requests all sample it, so their answers are hit in the prefix cache as a chat's are).
ANSWER_TOKEN_ID = 0


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int


@dataclass(frozen=True)
class WorkloadSpec:
    kind: str = "mixed"  # mixed: uniform ranges; fixed; sharegpt: long-tailed; shared-prefix
    num_requests: int = 64
    prompt_len: tuple[int, int] = (16, 256)  # uniform range (mixed), or fixed value [0]
    output_len: tuple[int, int] = (16, 256)
    shared_prefix_len: int = 512  # shared-prefix: tokens common to every prompt
    # multi-turn: num_requests / turns conversations of this many turns, interleaved (turn
    # 1 of each, then turn 2 of each, ...); a turn's prompt is the conversation so far
    # (earlier turns, each answer as output_len ANSWER_TOKEN_IDs) and prompt_len new tokens
    turns: int = 8
    seed: int = 0
    vocab_low: int = 100  # ordinary tokens only (no specials)
    vocab_high: int = 30000

    def __post_init__(self) -> None:
        if self.kind not in WORKLOADS:
            raise ConfigError(f"workload must be one of {WORKLOADS}, got {self.kind!r}")
        if self.num_requests < 1:
            raise ConfigError("the workload needs at least one request")
        if self.turns < 1:
            raise ConfigError(f"--turns must be at least 1, got {self.turns}")


def _lognormal_length(rng: random.Random, mean: float, sigma: float, low: int, high: int) -> int:
    # E[lognormal] = exp(mu + sigma^2 / 2): choose mu so that the mean is `mean`.
    mu = math.log(mean) - sigma * sigma / 2
    return max(low, min(high, int(rng.lognormvariate(mu, sigma))))


def make_workload(spec: WorkloadSpec, max_model_len: int | None = None) -> list[BenchRequest]:
    """The request list for `spec`; lengths are clipped so prompt + output fit max_model_len."""
    rng = random.Random(spec.seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(spec.vocab_low, spec.vocab_high) for _ in range(n)]

    if spec.kind == "multi-turn":
        return _multi_turn(spec, tokens, max_model_len)
    shared = tokens(spec.shared_prefix_len) if spec.kind == "shared-prefix" else []
    requests = []
    for _ in range(spec.num_requests):
        if spec.kind == "fixed":
            prompt_len, output_len = spec.prompt_len[0], spec.output_len[0]
        elif spec.kind == "sharegpt":
            # A ShareGPT-like mix: mean prompt ~160, mean output ~340, long tails.
            prompt_len = _lognormal_length(rng, 160, 0.9, 4, 2048)
            output_len = _lognormal_length(rng, 340, 0.8, 4, 2048)
        else:
            prompt_len = rng.randint(*spec.prompt_len)
            output_len = rng.randint(*spec.output_len)
        if max_model_len is not None:
            prompt_len = min(prompt_len, max_model_len - len(shared) - 2)
            output_len = min(output_len, max_model_len - len(shared) - prompt_len)
        requests.append(BenchRequest(shared + tokens(prompt_len), output_len))
    return requests


def _multi_turn(spec: WorkloadSpec, tokens: Callable[[int], list[int]], max_model_len: int | None) -> list[BenchRequest]:
    """Conversations of fixed-length turns (prompt_len[0] new tokens, output_len[0] answer
    tokens), interleaved turn by turn; a conversation that would outgrow max_model_len
    stops early."""
    num_conversations = -(-spec.num_requests // spec.turns)
    turn_len, answer_len = spec.prompt_len[0], spec.output_len[0]
    histories: list[list[int] | None] = [[] for _ in range(num_conversations)]
    requests = []
    for _ in range(spec.turns):
        for index, history in enumerate(histories):
            if history is None or len(requests) == spec.num_requests:
                continue
            prompt = history + tokens(turn_len)
            if max_model_len is not None and len(prompt) + answer_len > max_model_len:
                histories[index] = None
                continue
            requests.append(BenchRequest(prompt, answer_len))
            histories[index] = prompt + [ANSWER_TOKEN_ID] * answer_len
    return requests


# ---------------------------------------------------------------- command line


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workload", choices=WORKLOADS, default="mixed")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, nargs=2, default=(16, 256), metavar=("LO", "HI"))
    parser.add_argument("--output-len", type=int, nargs=2, default=(16, 256), metavar=("LO", "HI"))
    parser.add_argument("--shared-prefix-len", type=int, default=512)
    parser.add_argument("--turns", type=int, default=8,
                        help="multi-turn: turns per conversation (--num-requests / --turns conversations; "
                        "each turn --prompt-len LO new tokens, answered with --output-len LO tokens)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the workload (and of the arrivals in `bench serve`)")


def workload_spec_from_args(args: argparse.Namespace) -> WorkloadSpec:
    return WorkloadSpec(
        kind=args.workload,
        num_requests=args.num_requests,
        prompt_len=tuple(args.prompt_len),
        output_len=tuple(args.output_len),
        shared_prefix_len=args.shared_prefix_len,
        turns=args.turns,
        seed=args.seed,
    )
