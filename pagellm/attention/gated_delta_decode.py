"""Attention stage: CPU: a Gated DeltaNet's decode step in one native call
(kernels/csrc/gated_delta.c): the conv step, the q/k norms, the gates and the delta rule of
every decoding request, on its state slot in place. (On an NVIDIA GPU the step is
attention/triton_gated_delta.py's.)

Whether it runs is measured, not assumed: the first decode step of each batch size (up to
a power of two) times it against the PyTorch step (attention/linear_attention.py) on
copies of the step's inputs and states, and the faster one serves that size from then on.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from pagellm.attention.linear_attention import DecodeShape, causal_conv_steps, delta_rule_steps
from pagellm.kernels.build import load_kernels

logger = logging.getLogger(__name__)

# Timed runs of each candidate when a batch size is first seen (the median decides).
_TRIALS = 3


def l2_normalized(x: torch.Tensor) -> torch.Tensor:  # float32, over the last dimension
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6)


def rule_inputs(
    shape: DecodeShape,
    conv: torch.Tensor,  # [tokens, conv dim] float32: after the convolution
    b: torch.Tensor,  # [tokens, value heads]
    a: torch.Tensor,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
) -> tuple[torch.Tensor, ...]:
    """The delta rule's inputs from the convolved channels and the gates' projections:
    q (L2-normalized and scaled) and k (L2-normalized) per value head, v, the log of the
    decay g = -exp(A_log) * softplus(a + dt_bias), and beta = sigmoid(b)."""
    tokens = conv.shape[0]
    key_size = shape.key_heads * shape.key_dim
    q, k, v = conv.split([key_size, key_size, shape.value_heads * shape.value_dim], dim=-1)
    q = l2_normalized(q.reshape(tokens, shape.key_heads, shape.key_dim)) * shape.key_dim**-0.5
    k = l2_normalized(k.reshape(tokens, shape.key_heads, shape.key_dim))
    v = v.reshape(tokens, shape.value_heads, shape.value_dim)
    if shape.value_heads != shape.key_heads:  # each q/k head serves several value heads
        repeats = shape.value_heads // shape.key_heads
        if shape.tiled:  # value head i reads key head i % key heads
            q, k = q.repeat(1, repeats, 1), k.repeat(1, repeats, 1)
        else:  # ... or i // repeats
            q, k = q.repeat_interleave(repeats, dim=1), k.repeat_interleave(repeats, dim=1)
    g = -a_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    return q, k, v, g, b.float().sigmoid()


def torch_decode(
    shape: DecodeShape,
    mixed: torch.Tensor,  # [R, conv dim]
    b: torch.Tensor,  # [R, value heads]
    a: torch.Tensor,
    conv_weight: torch.Tensor,  # [conv dim, kernel]
    conv_states: torch.Tensor,  # [slots, conv dim, kernel - 1] float32
    states: torch.Tensor,  # [slots, value heads, key dim, value dim] float32
    slots: torch.Tensor,  # [R] int64
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
) -> torch.Tensor:  # [R, value heads, value dim] float32; the slots' states updated
    """The PyTorch decode step (the model's own functions): the reference and the fallback."""
    conv, conv_states[slots] = causal_conv_steps(mixed, conv_states[slots], conv_weight)
    q, k, v, g, beta = rule_inputs(shape, conv, b, a, a_log, dt_bias)
    out, states[slots] = delta_rule_steps(q, k, v, g, beta, states[slots])
    return out


class NativeDecode:
    """csrc/gated_delta.c's step on float32 CPU tensors."""

    def __init__(self, library: ctypes.CDLL, num_threads: int) -> None:
        self._run = library.gated_delta_decode
        self.num_threads = num_threads

    def __call__(
        self,
        shape: DecodeShape,
        mixed: torch.Tensor,
        b: torch.Tensor,
        a: torch.Tensor,
        conv_weight: torch.Tensor,
        conv_states: torch.Tensor,
        states: torch.Tensor,
        slots: torch.Tensor,
        a_log: torch.Tensor,
        dt_bias: torch.Tensor,
    ) -> torch.Tensor:
        rows = mixed.shape[0]
        f32 = torch.float32
        mixed, b, a = (t.to(f32).contiguous() for t in (mixed, b, a))
        conv_weight, a_log, dt_bias = (t.to(f32).contiguous() for t in (conv_weight, a_log, dt_bias))
        slots = slots.to(torch.int64).contiguous()
        assert conv_states.is_contiguous() and states.is_contiguous() and conv_states.dtype == states.dtype == f32
        out = torch.empty(rows, shape.value_heads, shape.value_dim, dtype=f32)
        scratch = torch.empty(rows, shape.conv_dim, dtype=f32)
        self._run(
            mixed.data_ptr(), b.data_ptr(), a.data_ptr(), conv_weight.data_ptr(), conv_states.data_ptr(),
            states.data_ptr(), slots.data_ptr(), a_log.data_ptr(), dt_bias.data_ptr(), rows, shape.key_heads,
            shape.value_heads, shape.key_dim, shape.value_dim, conv_weight.shape[1], int(shape.tiled),
            out.data_ptr(), scratch.data_ptr(), self.num_threads,
        )  # fmt: skip
        return out


DecodeStep = Callable[..., torch.Tensor]


class DecodeChoice:
    """The faster decode step per batch size (rounded up to a power of two), measured on
    the first step of that size; PyTorch's where the native kernels cannot run."""

    def __init__(self, native: NativeDecode | None) -> None:
        self.native = native
        self._chosen: dict[tuple[DecodeShape, int], DecodeStep] = {}

    @classmethod
    def for_this_machine(cls) -> DecodeChoice:
        library = load_kernels()
        return cls(None if library is None else NativeDecode(library, torch.get_num_threads()))

    def step(self, shape: DecodeShape, *args: torch.Tensor) -> torch.Tensor:
        mixed, states = args[0], args[5]
        if mixed.device.type == "cuda":  # the Triton kernels (attention/triton_gated_delta.py)
            from pagellm.attention.triton_gated_delta import triton_decode

            return triton_decode(shape, *args)
        if self.native is None or mixed.device.type != "cpu" or states.dtype != torch.float32:
            return torch_decode(shape, *args)
        key = (shape, 1 << max(mixed.shape[0] - 1, 0).bit_length())
        chosen = self._chosen.get(key)
        if chosen is None:
            chosen = self._chosen[key] = self._measure(shape, args)
        return chosen(shape, *args)

    def _measure(self, shape: DecodeShape, args: tuple[torch.Tensor, ...]) -> DecodeStep:
        assert self.native is not None
        timings: dict[str, float] = {}
        candidates: dict[str, DecodeStep] = {"native": self.native, "torch": torch_decode}
        for name, candidate in candidates.items():
            runs = []
            slots = args[6]
            for _ in range(_TRIALS):
                # On copies of the rows' states (in slots 0..R-1): the real ones stay untouched.
                copies = list(args)
                copies[4], copies[5] = args[4][slots], args[5][slots]
                copies[6] = torch.arange(slots.shape[0], dtype=torch.int64)
                start = time.perf_counter()
                candidate(shape, *copies)
                runs.append(time.perf_counter() - start)
            timings[name] = sorted(runs)[len(runs) // 2]
        name = min(timings, key=timings.__getitem__)
        logger.debug("Gated DeltaNet decode of %d rows: %s (%s)", args[0].shape[0], name,
                     ", ".join(f"{n} {1e3 * t:.3f} ms" for n, t in timings.items()))  # fmt: skip
        return candidates[name]


@functools.cache
def process_decode_choice() -> DecodeChoice:
    """The one choice every Gated DeltaNet of this process shares (by shape and batch size)."""
    return DecodeChoice.for_this_machine()
