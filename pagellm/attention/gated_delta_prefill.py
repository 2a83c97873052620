"""Attention stage: a Gated DeltaNet prefill run's short convolution and delta rule.

CPU: the short convolution (one request's tokens through the causal depthwise conv,
continuing from its conv state, then SiLU) in one native call (kernels/csrc/gated_delta.c
causal_conv_run) instead of PyTorch's conv1d and the concatenation and transposes around
it; the delta rule token after token in one native call (gated_delta_prefill_run: each
(head, 16 value columns) carries its slice of the state through the run in L1) instead
of PyTorch's chunked form (attention/linear_attention.py delta_rule_chunked). GPU: the rule
token after token in Triton (attention/triton_gated_delta.py).

Whether a native kernel runs is measured, not assumed: the first run of each shape and
token count (rounded up to a power of two) times it against the PyTorch form on copies of
the state, and the faster serves that size from then on.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import time
from collections.abc import Callable

import torch

from pagellm.attention.linear_attention import causal_conv, delta_rule_chunked
from pagellm.kernels.build import load_kernels

logger = logging.getLogger(__name__)

_TRIALS = 3  # timed runs of each candidate when a size is first seen (the median decides)

ConvRun = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class NativeConv:
    """causal_conv_run on CPU tensors: the run's rows bf16 or float32 (strided rows read
    in place), the state and the output float32."""

    def __init__(self, library: ctypes.CDLL, num_threads: int) -> None:
        self._run = library.causal_conv_run
        self.num_threads = num_threads

    def __call__(
        self,
        x: torch.Tensor,  # [tokens, channels]
        conv_state: torch.Tensor,  # [channels, kernel - 1] float32, contiguous: read and replaced
        weight: torch.Tensor,  # [channels, kernel]
    ) -> torch.Tensor:  # [tokens, channels] float32, after SiLU
        if x.dtype not in (torch.bfloat16, torch.float32) or x.stride(1) != 1:
            x = x.float().contiguous()
        weight = weight.float().contiguous()
        tokens, channels = x.shape
        out = torch.empty(tokens, channels, dtype=torch.float32)
        self._run(
            x.data_ptr(), int(x.dtype is torch.float32), x.stride(0), tokens, channels, weight.data_ptr(),
            conv_state.data_ptr(), weight.shape[1], out.data_ptr(), self.num_threads,
        )  # fmt: skip
        return out


class NativeDeltaRule:
    """gated_delta_prefill_run on CPU tensors: the run token after token, the state updated
    in place."""

    def __init__(self, library: ctypes.CDLL, num_threads: int) -> None:
        self._run = library.gated_delta_prefill_run
        self.num_threads = num_threads

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, v, g, beta = (t.float().contiguous() for t in (q, k, v, g, beta))
        tokens, heads, key_dim = q.shape
        value_dim = v.shape[2]
        out = torch.empty(tokens, heads, value_dim, dtype=torch.float32)
        self._run(
            q.data_ptr(), k.data_ptr(), v.data_ptr(), g.data_ptr(), beta.data_ptr(), state.data_ptr(), tokens, heads,
            key_dim, value_dim, out.data_ptr(), self.num_threads,
        )  # fmt: skip
        return out, state


def chunked_in_place(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch's chunked form with the native run's contract: the state updated in place."""
    out, after = delta_rule_chunked(q, k, v, g, beta, state)
    state.copy_(after)
    return out, state


class _MeasuredChoice:
    """Of a native and a PyTorch implementation of one computation that updates a state
    tensor in place (positional argument `state_at`), the faster per size: timed on the
    first call of that size on copies of the state (the real one is left to the chosen
    run), then kept."""

    label = ""
    state_at = 0

    def __init__(self, native: Callable[..., object] | None, fallback: Callable[..., object]) -> None:
        self.native = native
        self._fallback = fallback
        self._chosen: dict[tuple[int, ...], Callable[..., object]] = {}

    def _run(self, key: tuple[int, ...], *args: torch.Tensor) -> object:
        chosen = self._chosen.get(key)
        if chosen is None:
            chosen = self._chosen[key] = self._measure(key, args)
        return chosen(*args)

    def _measure(self, key: tuple[int, ...], args: tuple[torch.Tensor, ...]) -> Callable[..., object]:
        assert self.native is not None
        candidates = {"native": self.native, "torch": self._fallback}
        timings: dict[str, float] = {}
        for name, candidate in candidates.items():
            runs = []
            for _ in range(_TRIALS):
                copies = list(args)
                copies[self.state_at] = args[self.state_at].clone()
                start = time.perf_counter()
                candidate(*copies)
                runs.append(time.perf_counter() - start)
            timings[name] = sorted(runs)[len(runs) // 2]
        name = min(timings, key=timings.__getitem__)
        logger.debug("Gated DeltaNet prefill %s %s: %s (%s)", self.label, key, name,
                     ", ".join(f"{n} {1e3 * t:.3f} ms" for n, t in timings.items()))  # fmt: skip
        return candidates[name]


def _token_bucket(tokens: int) -> int:
    return 1 << max(tokens - 1, 0).bit_length()


class ConvChoice(_MeasuredChoice):
    """The faster prefill conv per (channels, kernel, token bucket); PyTorch's where the
    native kernels cannot run."""

    label = "conv (channels, kernel, tokens)"
    state_at = 1

    def __init__(self, native: NativeConv | None) -> None:
        super().__init__(native, causal_conv)

    @classmethod
    def for_this_machine(cls) -> ConvChoice:
        library = load_kernels()
        return cls(None if library is None else NativeConv(library, torch.get_num_threads()))

    def run(self, x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """causal_conv's result (and its state update) by the chosen implementation."""
        if (
            self.native is None or x.device.type != "cpu" or conv_state.dtype != torch.float32
            or not conv_state.is_contiguous()
        ):  # fmt: skip
            return causal_conv(x, conv_state, weight)
        return self._run((x.shape[1], weight.shape[1], _token_bucket(x.shape[0])), x, conv_state, weight)  # type: ignore[return-value]


class DeltaRuleChoice(_MeasuredChoice):
    """The faster prefill delta rule per (heads, key dim, value dim, token bucket): the native
    run token after token or PyTorch's chunked form; the chunked form where the native
    kernels cannot run."""

    label = "delta rule (heads, key dim, value dim, tokens)"
    state_at = 5

    def __init__(self, native: NativeDeltaRule | None) -> None:
        super().__init__(native, chunked_in_place)

    @classmethod
    def for_this_machine(cls) -> DeltaRuleChoice:
        library = load_kernels()
        return cls(None if library is None else NativeDeltaRule(library, torch.get_num_threads()))

    def run(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The run's outputs; `state` (contiguous float32) holds the state after it."""
        if self.native is None or state.device.type != "cpu" or state.dtype != torch.float32 or not state.is_contiguous():
            return chunked_in_place(q, k, v, g, beta, state)
        key = (q.shape[1], q.shape[2], v.shape[2], _token_bucket(q.shape[0]))
        return self._run(key, q, k, v, g, beta, state)  # type: ignore[return-value]


def prefill_delta_rule(
    q: torch.Tensor,  # [num_tokens, heads, key_dim] float32, normalized and scaled
    k: torch.Tensor,  # [num_tokens, heads, key_dim] float32, normalized
    v: torch.Tensor,  # [num_tokens, heads, value_dim] float32
    g: torch.Tensor,  # [num_tokens, heads]: log of the decay
    beta: torch.Tensor,  # [num_tokens, heads]
    state: torch.Tensor,  # [heads, key_dim, value_dim] float32: before the first token; updated in place
) -> torch.Tensor:  # outputs [num_tokens, heads, value_dim]
    """One request's run through the rule, `state` left holding the state after it: Triton's
    recurrent kernel on a GPU, elsewhere the measured choice of the native run and
    PyTorch's chunked form."""
    if state.device.type == "cuda" and state.is_contiguous():
        from pagellm.attention.triton_gated_delta import triton_delta_rule_run

        return triton_delta_rule_run(q, k, v, g, beta, state)[0]
    return process_delta_rule_choice().run(q, k, v, g, beta, state)[0]


@functools.cache
def process_conv_choice() -> ConvChoice:
    """The one choice every Gated DeltaNet of this process shares."""
    return ConvChoice.for_this_machine()


@functools.cache
def process_delta_rule_choice() -> DeltaRuleChoice:
    """The one choice every Gated DeltaNet of this process shares (by shape and token bucket)."""
    return DeltaRuleChoice.for_this_machine()


__all__ = [
    "ConvChoice",
    "DeltaRuleChoice",
    "NativeConv",
    "NativeDeltaRule",
    "prefill_delta_rule",
    "process_conv_choice",
    "process_delta_rule_choice",
]
