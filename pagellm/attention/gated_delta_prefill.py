"""Attention stage: a Gated DeltaNet prefill run's short convolution and delta rule.

CPU: the short convolution (one request's tokens through the causal depthwise conv,
continuing from its conv state, then SiLU) in one native call (kernels/csrc/gated_delta.c
causal_conv_run) instead of PyTorch's conv1d and the concatenation and transposes around
it. GPU: the rule token after token in Triton (attention/triton_gated_delta.py), elsewhere
the chunked form in PyTorch (`prefill_delta_rule`).

Whether it runs is measured, not assumed: the first run of each (channels, kernel) and
token count (rounded up to a power of two) times it against attention/linear_attention.py's
causal_conv on copies of the conv state, and the faster serves that size from then on.
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


class ConvChoice:
    """The faster prefill conv per (channels, kernel, token bucket), measured on the first
    run of that size; PyTorch's where the native kernels cannot run."""

    def __init__(self, native: NativeConv | None) -> None:
        self.native = native
        self._chosen: dict[tuple[int, int, int], ConvRun] = {}

    @classmethod
    def for_this_machine(cls) -> ConvChoice:
        library = load_kernels()
        return cls(None if library is None else NativeConv(library, torch.get_num_threads()))

    def run(self, x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """causal_conv's result (and its state update) by the chosen implementation."""
        native = self.native
        if (
            native is None or x.device.type != "cpu" or conv_state.dtype != torch.float32
            or not conv_state.is_contiguous()
        ):  # fmt: skip
            return causal_conv(x, conv_state, weight)
        key = (x.shape[1], weight.shape[1], 1 << max(x.shape[0] - 1, 0).bit_length())
        chosen = self._chosen.get(key)
        if chosen is None:
            chosen = self._chosen[key] = self._measure(x, conv_state, weight)
        return chosen(x, conv_state, weight)

    def _measure(self, x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor) -> ConvRun:
        assert self.native is not None
        candidates: dict[str, ConvRun] = {"native": self.native, "torch": causal_conv}
        timings: dict[str, float] = {}
        for name, candidate in candidates.items():
            runs = []
            for _ in range(_TRIALS):
                copy = conv_state.clone()  # the real state stays for the chosen one's run
                start = time.perf_counter()
                candidate(x, copy, weight)
                runs.append(time.perf_counter() - start)
            timings[name] = sorted(runs)[len(runs) // 2]
        name = min(timings, key=timings.__getitem__)
        logger.debug("Gated DeltaNet prefill conv of %d tokens x %d channels: %s (%s)", x.shape[0], x.shape[1], name,
                     ", ".join(f"{n} {1e3 * t:.3f} ms" for n, t in timings.items()))  # fmt: skip
        return candidates[name]


def prefill_delta_rule(
    q: torch.Tensor,  # [num_tokens, heads, key_dim] float32, normalized and scaled
    k: torch.Tensor,  # [num_tokens, heads, key_dim] float32, normalized
    v: torch.Tensor,  # [num_tokens, heads, value_dim] float32
    g: torch.Tensor,  # [num_tokens, heads]: log of the decay
    beta: torch.Tensor,  # [num_tokens, heads]
    state: torch.Tensor,  # [heads, key_dim, value_dim] float32: before the first token
) -> tuple[torch.Tensor, torch.Tensor]:  # outputs [num_tokens, heads, value_dim], the state after
    """One request's run through the rule: Triton's recurrent kernel on a GPU (the state
    updated in place), the chunked form in PyTorch elsewhere."""
    if state.device.type == "cuda" and state.is_contiguous():
        from pagellm.attention.triton_gated_delta import triton_delta_rule_run

        return triton_delta_rule_run(q, k, v, g, beta, state)
    return delta_rule_chunked(q, k, v, g, beta, state)


@functools.cache
def process_conv_choice() -> ConvChoice:
    """The one choice every Gated DeltaNet of this process shares."""
    return ConvChoice.for_this_machine()


__all__ = ["ConvChoice", "NativeConv", "prefill_delta_rule", "process_conv_choice"]
